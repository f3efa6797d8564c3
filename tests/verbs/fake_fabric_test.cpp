// The fake verbs provider on its own, through its verbs calls: the RC behaviours the verbs backend's
// tests rely on (ordering, protection, RNR, flushes, queue depth, notification, injected faults).

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <poll.h>

#include <ferry/testing/verbs.hpp>

namespace {

namespace fake = ferry::verbs::fake;
using provider = fake::provider;
using namespace std::chrono_literals;

constexpr std::chrono::milliseconds hang_bound = 10s;  // the longest anything expected may take
constexpr auto quiet_period = 100ms;  // how long a test watches for what must not happen

constexpr int all_access =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

fake::fabric& fab() { return fake::fabric::instance(); }

bool readable(int fd, std::chrono::milliseconds wait = 0ms) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, static_cast<int>(wait.count())) == 1;
}

std::vector<ibv_wc> drain(provider::cq_handle cq) {
  std::vector<ibv_wc> got;
  std::array<ibv_wc, 16> batch{};
  for (int n; (n = provider::poll_cq(cq, static_cast<int>(batch.size()), batch.data())) > 0;) {
    got.insert(got.end(), batch.begin(), batch.begin() + n);
  }
  return got;
}

// Up to `n` completions, polled until they are all there or the hang bound passed.
std::vector<ibv_wc> poll_n(provider::cq_handle cq, std::size_t n) {
  std::vector<ibv_wc> got;
  const auto deadline = std::chrono::steady_clock::now() + hang_bound;
  while (got.size() < n && std::chrono::steady_clock::now() < deadline) {
    std::array<ibv_wc, 16> batch{};
    const int want = static_cast<int>(std::min(batch.size(), n - got.size()));
    const int k = provider::poll_cq(cq, want, batch.data());
    if (k == 0) std::this_thread::sleep_for(1ms);
    got.insert(got.end(), batch.begin(), batch.begin() + std::max(k, 0));
  }
  return got;
}

// What arrives during the quiet period (for tests that expect nothing).
std::vector<ibv_wc> poll_quiet(provider::cq_handle cq) {
  std::this_thread::sleep_for(quiet_period);
  return drain(cq);
}

std::optional<provider::async_event> next_event(provider::context_handle c) {
  if (!readable(provider::async_fd(c), hang_bound)) return std::nullopt;
  provider::async_event e{};
  if (provider::get_async_event(c, e) != 0) return std::nullopt;
  return e;
}

bool no_event(provider::context_handle c) {
  provider::async_event e{};
  return !readable(provider::async_fd(c)) && provider::get_async_event(c, e) == EAGAIN;
}

// Waits until the fabric pushed `count` completions (to see one arrive without polling it).
bool pushed_reaches(std::uint64_t count) {
  const auto deadline = std::chrono::steady_clock::now() + hang_bound;
  while (fab().completions_pushed() < count) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

std::vector<std::byte> pattern(std::size_t n, unsigned seed) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 131 + seed * 7 + 1) & 0xff);
  return v;
}

// Resumes the fabric even when a test fails while it is paused, so later tests run.
class pause_guard {
 public:
  pause_guard() { fab().pause(); }
  ~pause_guard() { fab().resume(); }
  pause_guard(const pause_guard&) = delete;
  pause_guard& operator=(const pause_guard&) = delete;
};

// Registered memory.
class region {
 public:
  region(provider::pd_handle pd, std::size_t size, int access) : bytes_(size) {
    mr_ = provider::reg_mr(pd, bytes_.data(), size, access);
    REQUIRE(mr_ != nullptr);
  }
  ~region() { provider::dereg_mr(mr_); }
  region(const region&) = delete;
  region& operator=(const region&) = delete;

  // A span, not the vector: the registration must keep pointing at the same memory.
  [[nodiscard]] std::span<std::byte> bytes() { return bytes_; }
  void fill(unsigned seed) {
    const auto p = pattern(bytes_.size(), seed);
    std::copy(p.begin(), p.end(), bytes_.begin());
  }
  [[nodiscard]] std::uint64_t addr(std::size_t offset = 0) const {
    return reinterpret_cast<std::uintptr_t>(bytes_.data() + offset);
  }
  [[nodiscard]] std::uint32_t lkey() const { return provider::lkey(mr_); }
  [[nodiscard]] std::uint32_t rkey() const { return provider::rkey(mr_); }
  [[nodiscard]] ibv_sge sge(std::size_t offset, std::uint32_t length) const {
    return ibv_sge{addr(offset), length, lkey()};
  }

 private:
  std::vector<std::byte> bytes_;
  provider::mr_handle mr_ = nullptr;
};

ibv_send_wr send_wr(std::uint64_t id, ibv_wr_opcode opcode, ibv_sge* sges, int n, bool signalled) {
  ibv_send_wr wr{};
  wr.wr_id = id;
  wr.opcode = opcode;
  wr.sg_list = sges;
  wr.num_sge = n;
  wr.send_flags = signalled ? IBV_SEND_SIGNALED : 0;
  return wr;
}

ibv_send_wr rdma_wr(std::uint64_t id, ibv_wr_opcode opcode, ibv_sge* sges, int n,
                    std::uint64_t remote, std::uint32_t rkey, bool signalled) {
  ibv_send_wr wr = send_wr(id, opcode, sges, n, signalled);
  wr.wr.rdma.remote_addr = remote;
  wr.wr.rdma.rkey = rkey;
  return wr;
}

int post(provider::qp_handle qp, ibv_send_wr& wr) {
  ibv_send_wr* bad = nullptr;
  return provider::post_send(qp, &wr, &bad);
}

int post_receive(provider::qp_handle qp, std::uint64_t id, ibv_sge* sges, int n) {
  ibv_recv_wr wr{};
  wr.wr_id = id;
  wr.sg_list = sges;
  wr.num_sge = n;
  ibv_recv_wr* bad = nullptr;
  return provider::post_recv(qp, &wr, &bad);
}

constexpr int init_mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
constexpr int rtr_mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                         IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
constexpr int rts_mask = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                         IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC;

int to_init(provider::qp_handle qp, unsigned access, int mask = init_mask, std::uint8_t port = 1) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = port;
  a.qp_access_flags = access;
  return provider::modify_qp(qp, a, mask);
}

int to_rtr(provider::qp_handle qp, std::uint16_t dlid, std::uint32_t dest_qpn,
           int mask = rtr_mask) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_4096;
  a.dest_qp_num = dest_qpn;
  a.rq_psn = 0;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  a.ah_attr.dlid = dlid;
  a.ah_attr.port_num = 1;
  return provider::modify_qp(qp, a, mask);
}

int to_rts(provider::qp_handle qp, int mask = rts_mask) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 14;
  a.retry_cnt = 7;
  a.rnr_retry = 7;
  a.sq_psn = 0;
  a.max_rd_atomic = 1;
  return provider::modify_qp(qp, a, mask);
}

int to_state(provider::qp_handle qp, ibv_qp_state state) {
  ibv_qp_attr a{};
  a.qp_state = state;
  return provider::modify_qp(qp, a, IBV_QP_STATE);
}

struct conn_options {
  std::uint32_t send_depth = 64;
  std::uint32_t recv_depth = 64;
  int cq_entries = 256;
  unsigned access = all_access;  // each queue pair's responder rights
  bool connect = true;           // to RTS; otherwise both queue pairs stay in RESET
};

// One end: a device context with a protection domain, a completion channel, send and receive
// completion queues on it, and an RC queue pair. Tests may destroy parts early and null them.
struct side {
  provider::context_handle ctx = nullptr;
  provider::pd_handle pd = nullptr;
  provider::channel_handle ch = nullptr;
  provider::cq_handle scq = nullptr;
  provider::cq_handle rcq = nullptr;
  provider::qp_handle qp = nullptr;
  ibv_qp_cap cap{};
  std::uint16_t lid = 0;

  side() = default;
  side(const side&) = delete;
  side& operator=(const side&) = delete;

  void open(const char* device, const conn_options& o) {
    ctx = provider::open_device(device);
    REQUIRE(ctx != nullptr);
    REQUIRE(provider::prepare_async_fd(ctx));
    pd = provider::alloc_pd(ctx);
    ch = provider::create_comp_channel(ctx);
    REQUIRE((pd != nullptr && ch != nullptr));
    scq = provider::create_cq(ctx, o.cq_entries, ch);
    rcq = provider::create_cq(ctx, o.cq_entries, ch);
    REQUIRE((scq != nullptr && rcq != nullptr));
    cap = ibv_qp_cap{o.send_depth, o.recv_depth, 4, 4, 64};
    qp = provider::create_qp(pd, scq, rcq, cap);
    REQUIRE(qp != nullptr);
    ibv_port_attr port{};
    REQUIRE(provider::query_port(ctx, 1, port) == 0);
    lid = port.lid;
  }

  ~side() {
    if (qp != nullptr) CHECK(provider::destroy_qp(qp) == 0);
    if (scq != nullptr) CHECK(provider::destroy_cq(scq) == 0);
    if (rcq != nullptr) CHECK(provider::destroy_cq(rcq) == 0);
    if (ch != nullptr) CHECK(provider::destroy_comp_channel(ch) == 0);
    if (pd != nullptr) provider::dealloc_pd(pd);
    if (ctx != nullptr) provider::close_device(ctx);
  }
};

// Two ends on devices fake0 and fake1, their queue pairs connected to each other.
struct connection {
  side a;
  side b;

  explicit connection(conn_options o = {}) {
    fab().add_device("fake0");
    fab().add_device("fake1");
    a.open("fake0", o);
    b.open("fake1", o);
    if (!o.connect) return;
    REQUIRE(to_init(a.qp, o.access) == 0);
    REQUIRE(to_init(b.qp, o.access) == 0);
    REQUIRE(to_rtr(a.qp, b.lid, provider::qp_num(b.qp)) == 0);
    REQUIRE(to_rtr(b.qp, a.lid, provider::qp_num(a.qp)) == 0);
    REQUIRE(to_rts(a.qp) == 0);
    REQUIRE(to_rts(b.qp) == 0);
  }
};

}  // namespace

TEST_CASE("fake verbs: devices, ports, GIDs, keys and object lifetimes", "[verbs]") {
  const std::size_t live_before = fab().live_objects();
  fab().add_device("fake0");
  fab().add_device("fake0");
  fab().add_device("fake1");
  const auto names = provider::device_names();
  CHECK(std::count(names.begin(), names.end(), "fake0") == 1);
  CHECK(std::count(names.begin(), names.end(), "fake1") == 1);

  errno = 0;
  CHECK(provider::open_device("no-such-device") == nullptr);
  CHECK(errno == ENODEV);

  provider::context_handle c0 = provider::open_device("fake0");
  provider::context_handle c1 = provider::open_device("fake1");
  REQUIRE((c0 != nullptr && c1 != nullptr));
  ibv_port_attr p0{};
  ibv_port_attr p1{};
  REQUIRE(provider::query_port(c0, 1, p0) == 0);
  REQUIRE(provider::query_port(c1, 1, p1) == 0);
  CHECK(p0.state == IBV_PORT_ACTIVE);
  CHECK(p0.link_layer == IBV_LINK_LAYER_INFINIBAND);
  CHECK(p0.active_mtu == IBV_MTU_4096);
  CHECK(p0.max_mtu == IBV_MTU_4096);
  CHECK(p0.lid != 0);
  CHECK(p1.lid != 0);
  CHECK(p0.lid != p1.lid);
  CHECK(provider::query_port(c0, 2, p0) == EINVAL);
  ibv_gid gid{};
  gid.raw[3] = 7;
  CHECK(provider::query_gid(c0, 1, 0, gid) == 0);
  CHECK(std::all_of(std::begin(gid.raw), std::end(gid.raw), [](auto b) { return b == 0; }));
  CHECK(provider::query_gid(c0, 1, 1, gid) == EINVAL);
  CHECK(provider::query_gid(c0, 2, 0, gid) == EINVAL);

  CHECK(provider::prepare_async_fd(c0));
  CHECK(no_event(c0));

  provider::pd_handle pd = provider::alloc_pd(c0);
  REQUIRE(pd != nullptr);
  std::vector<std::byte> memory(4096);
  errno = 0;
  CHECK(provider::reg_mr(pd, nullptr, 64, IBV_ACCESS_LOCAL_WRITE) == nullptr);
  CHECK(errno == EINVAL);
  errno = 0;
  CHECK(provider::reg_mr(pd, memory.data(), 0, IBV_ACCESS_LOCAL_WRITE) == nullptr);
  CHECK(errno == EINVAL);
  errno = 0;  // remote write without local write, refused as by the kernel
  CHECK(provider::reg_mr(pd, memory.data(), 64, IBV_ACCESS_REMOTE_WRITE) == nullptr);
  CHECK(errno == EINVAL);
  provider::mr_handle m1 = provider::reg_mr(pd, memory.data(), 2048, all_access);
  provider::mr_handle m2 = provider::reg_mr(pd, memory.data() + 2048, 2048, all_access);
  REQUIRE((m1 != nullptr && m2 != nullptr));
  const std::vector<std::uint32_t> keys{provider::lkey(m1), provider::rkey(m1), provider::lkey(m2),
                                        provider::rkey(m2)};
  for (std::size_t i = 0; i < keys.size(); ++i) {
    CHECK(keys[i] != 0);
    for (std::size_t j = i + 1; j < keys.size(); ++j) CHECK(keys[i] != keys[j]);
  }

  provider::channel_handle ch = provider::create_comp_channel(c0);
  REQUIRE(ch != nullptr);
  CHECK_FALSE(readable(provider::channel_fd(ch)));
  provider::cq_handle cq = provider::create_cq(c0, 0, ch);  // granted one entry
  REQUIRE(cq != nullptr);
  provider::cq_handle other_cq = provider::create_cq(c0, 16, nullptr);
  REQUIRE(other_cq != nullptr);

  ibv_qp_cap cap{0, 4, 1, 1, 0};
  errno = 0;
  CHECK(provider::create_qp(pd, cq, cq, cap) == nullptr);
  CHECK(errno == EINVAL);
  cap = ibv_qp_cap{1u << 20, 1u << 20, 64, 64, 4096};
  provider::qp_handle q1 = provider::create_qp(pd, cq, other_cq, cap);
  REQUIRE(q1 != nullptr);
  CHECK(cap.max_send_wr == 32768);
  CHECK(cap.max_recv_wr == 32768);
  CHECK(cap.max_send_sge == 16);
  CHECK(cap.max_recv_sge == 16);
  CHECK(cap.max_inline_data == 256);
  cap = ibv_qp_cap{8, 8, 2, 2, 32};
  provider::qp_handle q2 = provider::create_qp(pd, cq, cq, cap);
  REQUIRE(q2 != nullptr);
  CHECK(cap.max_send_wr == 8);
  CHECK(cap.max_inline_data == 32);
  CHECK(provider::qp_num(q1) != 0);
  CHECK(provider::qp_num(q1) != provider::qp_num(q2));

  // What is in use by a live object cannot go.
  CHECK(provider::destroy_cq(cq) == EBUSY);
  CHECK(provider::destroy_comp_channel(ch) == EBUSY);
  const std::size_t live = fab().live_objects();
  errno = 0;
  provider::dealloc_pd(pd);
  CHECK(errno == EBUSY);
  errno = 0;
  provider::close_device(c0);
  CHECK(errno == EBUSY);
  CHECK(fab().live_objects() == live);

  CHECK(provider::destroy_qp(q1) == 0);
  CHECK(provider::destroy_qp(q2) == 0);
  CHECK(provider::destroy_cq(cq) == 0);
  CHECK(provider::destroy_cq(other_cq) == 0);
  CHECK(provider::destroy_comp_channel(ch) == 0);
  CHECK(provider::dereg_mr(m1) == 0);
  CHECK(provider::dereg_mr(m2) == 0);
  provider::dealloc_pd(pd);
  provider::close_device(c0);
  provider::close_device(c1);
  CHECK(fab().live_objects() == live_before);
}

TEST_CASE("fake verbs: RDMA WRITE gathers and READ scatters, byte-exact", "[verbs]") {
  connection l;
  region src(l.a.pd, 4096, IBV_ACCESS_LOCAL_WRITE);
  region back(l.a.pd, 4096, IBV_ACCESS_LOCAL_WRITE);
  region dst(l.b.pd, 8192, all_access);
  src.fill(1);
  const auto sent_before = fab().posted_send_wrs();

  // Three pieces of src land back to back at dst + 64; the WRITE is unsignalled.
  std::array<ibv_sge, 3> pieces{src.sge(0, 100), src.sge(1000, 1), src.sge(2000, 2000)};
  ibv_send_wr write = rdma_wr(1, IBV_WR_RDMA_WRITE, pieces.data(), 3, dst.addr(64), dst.rkey(), false);
  // The READ behind it sees the WRITE's data (RC order) and scatters it into two pieces of back.
  std::array<ibv_sge, 2> halves{back.sge(10, 1500), back.sge(3000, 601)};
  ibv_send_wr read = rdma_wr(2, IBV_WR_RDMA_READ, halves.data(), 2, dst.addr(64), dst.rkey(), true);
  write.next = &read;
  ibv_send_wr* bad = nullptr;
  REQUIRE(provider::post_send(l.a.qp, &write, &bad) == 0);
  CHECK(fab().posted_send_wrs() - sent_before == 2);

  const auto wcs = poll_n(l.a.scq, 1);
  REQUIRE(wcs.size() == 1);
  CHECK(wcs[0].wr_id == 2);
  CHECK(wcs[0].status == IBV_WC_SUCCESS);
  CHECK(wcs[0].opcode == IBV_WC_RDMA_READ);
  CHECK(wcs[0].byte_len == 2101);
  CHECK(wcs[0].qp_num == provider::qp_num(l.a.qp));
  CHECK(poll_quiet(l.a.scq).empty());  // the unsignalled WRITE completes silently
  CHECK(drain(l.b.rcq).empty());       // and the responder sees no completion at all
  CHECK(fab().outstanding_sends(l.a.qp) == 0);

  std::vector<std::byte> expected;
  const auto s = src.bytes();
  expected.insert(expected.end(), s.begin(), s.begin() + 100);
  expected.push_back(s[1000]);
  expected.insert(expected.end(), s.begin() + 2000, s.begin() + 4000);
  const auto d = dst.bytes();
  CHECK(std::equal(expected.begin(), expected.end(), d.begin() + 64));
  CHECK(d[63] == std::byte{0});
  CHECK(d[64 + expected.size()] == std::byte{0});
  const auto r = back.bytes();
  CHECK(std::equal(expected.begin(), expected.begin() + 1500, r.begin() + 10));
  CHECK(std::equal(expected.begin() + 1500, expected.end(), r.begin() + 3000));
  CHECK(r[9] == std::byte{0});
  CHECK(r[3601] == std::byte{0});
}

TEST_CASE("fake verbs: an inline SEND_WITH_IMM lands in the oldest posted receive", "[verbs]") {
  connection l;
  region inbox(l.b.pd, 4096, IBV_ACCESS_LOCAL_WRITE);
  region src(l.a.pd, 4096, IBV_ACCESS_LOCAL_WRITE);
  std::array<ibv_sge, 2> first{inbox.sge(0, 16), inbox.sge(100, 64)};
  ibv_sge second = inbox.sge(1000, 1000);
  REQUIRE(post_receive(l.b.qp, 11, first.data(), 2) == 0);
  REQUIRE(post_receive(l.b.qp, 12, &second, 1) == 0);

  // Inline data needs no registration and is copied when posted.
  auto message = pattern(40, 2);
  const auto original = message;
  ibv_sge inline_sge{reinterpret_cast<std::uintptr_t>(message.data()), 40, 0};
  ibv_send_wr wr = send_wr(21, IBV_WR_SEND_WITH_IMM, &inline_sge, 1, true);
  wr.send_flags |= IBV_SEND_INLINE;
  wr.imm_data = 0xA1B2C3D4;
  {
    pause_guard paused;
    REQUIRE(post(l.a.qp, wr) == 0);
    std::fill(message.begin(), message.end(), std::byte{0xee});
  }

  auto recv = poll_n(l.b.rcq, 1);
  REQUIRE(recv.size() == 1);
  CHECK(recv[0].wr_id == 11);
  CHECK(recv[0].status == IBV_WC_SUCCESS);
  CHECK(recv[0].opcode == IBV_WC_RECV);
  CHECK(recv[0].byte_len == 40);
  CHECK((recv[0].wc_flags & IBV_WC_WITH_IMM) != 0);
  CHECK(recv[0].imm_data == 0xA1B2C3D4);
  CHECK(recv[0].qp_num == provider::qp_num(l.b.qp));
  CHECK(recv[0].src_qp == provider::qp_num(l.a.qp));
  const auto in = inbox.bytes();
  CHECK(std::equal(original.begin(), original.begin() + 16, in.begin()));
  CHECK(std::equal(original.begin() + 16, original.end(), in.begin() + 100));
  CHECK(in[124] == std::byte{0});
  auto sent = poll_n(l.a.scq, 1);
  REQUIRE(sent.size() == 1);
  CHECK(sent[0].wr_id == 21);
  CHECK(sent[0].status == IBV_WC_SUCCESS);
  CHECK(sent[0].opcode == IBV_WC_SEND);

  // A registered SEND without immediate takes the next receive.
  src.fill(3);
  ibv_sge body = src.sge(0, 700);
  ibv_send_wr plain = send_wr(22, IBV_WR_SEND, &body, 1, true);
  REQUIRE(post(l.a.qp, plain) == 0);
  recv = poll_n(l.b.rcq, 1);
  REQUIRE(recv.size() == 1);
  CHECK(recv[0].wr_id == 12);
  CHECK(recv[0].byte_len == 700);
  CHECK((recv[0].wc_flags & IBV_WC_WITH_IMM) == 0);
  CHECK(std::equal(src.bytes().begin(), src.bytes().begin() + 700, in.begin() + 1000));
  CHECK(poll_n(l.a.scq, 1).size() == 1);

  // More inline data than the queue pair was granted is refused at post time.
  std::vector<std::byte> big(l.a.cap.max_inline_data + 1);
  ibv_sge big_sge{reinterpret_cast<std::uintptr_t>(big.data()),
                  static_cast<std::uint32_t>(big.size()), 0};
  ibv_send_wr too_big = send_wr(23, IBV_WR_SEND, &big_sge, 1, true);
  too_big.send_flags |= IBV_SEND_INLINE;
  ibv_send_wr* bad = nullptr;
  CHECK(provider::post_send(l.a.qp, &too_big, &bad) == EINVAL);
  CHECK(bad == &too_big);
  CHECK(fab().outstanding_sends(l.a.qp) == 0);
}

TEST_CASE("fake verbs: a SEND waits for a receive (RNR) and holds back what follows",
          "[verbs][concurrency]") {
  connection l;
  region src(l.a.pd, 4096, IBV_ACCESS_LOCAL_WRITE);
  region dst(l.b.pd, 4096, all_access);
  src.fill(4);
  ibv_sge body = src.sge(0, 256);
  ibv_send_wr send = send_wr(1, IBV_WR_SEND, &body, 1, true);
  ibv_sge tail = src.sge(256, 256);
  ibv_send_wr write = rdma_wr(2, IBV_WR_RDMA_WRITE, &tail, 1, dst.addr(2048), dst.rkey(), true);
  send.next = &write;
  ibv_send_wr* bad = nullptr;
  REQUIRE(provider::post_send(l.a.qp, &send, &bad) == 0);

  CHECK(poll_quiet(l.a.scq).empty());
  CHECK(fab().outstanding_sends(l.a.qp) == 2);

  // The receive comes from another thread while this one waits for the completions.
  ibv_sge slot = dst.sge(0, 1024);
  std::atomic<int> posted{-1};
  std::thread receiver([&] {
    std::this_thread::sleep_for(20ms);
    posted = post_receive(l.b.qp, 9, &slot, 1);
  });
  const auto wcs = poll_n(l.a.scq, 2);
  receiver.join();
  CHECK(posted == 0);
  REQUIRE(wcs.size() == 2);
  CHECK(wcs[0].wr_id == 1);
  CHECK(wcs[0].status == IBV_WC_SUCCESS);
  CHECK(wcs[1].wr_id == 2);
  CHECK(wcs[1].status == IBV_WC_SUCCESS);
  const auto recv = poll_n(l.b.rcq, 1);
  REQUIRE(recv.size() == 1);
  CHECK(recv[0].wr_id == 9);
  CHECK(recv[0].byte_len == 256);
  const auto d = dst.bytes();
  CHECK(std::equal(src.bytes().begin(), src.bytes().begin() + 256, d.begin()));
  CHECK(std::equal(src.bytes().begin() + 256, src.bytes().begin() + 512, d.begin() + 2048));
}

TEST_CASE("fake verbs: a remote access error fails the request, flushes the rest and raises "
          "QP_ACCESS_ERR at the responder",
          "[verbs]") {
  struct variant {
    const char* name;
    unsigned qp_access;
    int mr_access;
    ibv_wr_opcode opcode;
    std::uint32_t rkey_offset;
    std::size_t remote_offset;
  };
  const variant v = GENERATE(
      variant{"wrong rkey", all_access, all_access, IBV_WR_RDMA_WRITE, 1000003, 0},
      variant{"past the region's end", all_access, all_access, IBV_WR_RDMA_WRITE, 0, 4000},
      variant{"region without remote read", all_access,
              IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE, IBV_WR_RDMA_READ, 0, 0},
      variant{"queue pair without remote write", IBV_ACCESS_REMOTE_READ, all_access,
              IBV_WR_RDMA_WRITE, 0, 0});
  INFO(v.name);
  conn_options o;
  o.access = v.qp_access;
  connection l(o);
  region src(l.a.pd, 4096, IBV_ACCESS_LOCAL_WRITE);
  region dst(l.b.pd, 4096, v.mr_access);
  src.fill(5);
  ibv_sge slot = dst.sge(0, 64);
  REQUIRE(post_receive(l.b.qp, 30, &slot, 1) == 0);

  ibv_sge body = src.sge(0, 512);
  ibv_send_wr bad_wr = rdma_wr(1, v.opcode, &body, 1, dst.addr(v.remote_offset),
                               dst.rkey() + v.rkey_offset, true);
  ibv_send_wr behind = rdma_wr(2, IBV_WR_RDMA_WRITE, &body, 1, dst.addr(1024), dst.rkey(), false);
  bad_wr.next = &behind;
  ibv_send_wr* bad = nullptr;
  REQUIRE(provider::post_send(l.a.qp, &bad_wr, &bad) == 0);

  auto wcs = poll_n(l.a.scq, 2);
  REQUIRE(wcs.size() == 2);
  CHECK(wcs[0].wr_id == 1);
  CHECK(wcs[0].status == IBV_WC_REM_ACCESS_ERR);
  CHECK(wcs[1].wr_id == 2);  // unsignalled, but an error completion always comes
  CHECK(wcs[1].status == IBV_WC_WR_FLUSH_ERR);
  CHECK(fab().outstanding_sends(l.a.qp) == 0);

  const auto e = next_event(l.b.ctx);
  REQUIRE(e.has_value());
  CHECK(e->type == IBV_EVENT_QP_ACCESS_ERR);
  CHECK(e->qp == l.b.qp);
  CHECK(no_event(l.b.ctx));
  CHECK(no_event(l.a.ctx));
  const auto flushed = poll_n(l.b.rcq, 1);
  REQUIRE(flushed.size() == 1);
  CHECK(flushed[0].wr_id == 30);
  CHECK(flushed[0].status == IBV_WC_WR_FLUSH_ERR);
  CHECK(std::all_of(dst.bytes().begin(), dst.bytes().end(), [](auto b) { return b == std::byte{0}; }));

  // Posting on a queue pair in the error state is accepted, and flushed.
  ibv_send_wr later = rdma_wr(3, IBV_WR_RDMA_WRITE, &body, 1, dst.addr(0), dst.rkey(), false);
  REQUIRE(post(l.a.qp, later) == 0);
  wcs = poll_n(l.a.scq, 1);
  REQUIRE(wcs.size() == 1);
  CHECK(wcs[0].wr_id == 3);
  CHECK(wcs[0].status == IBV_WC_WR_FLUSH_ERR);
}

TEST_CASE("fake verbs: local protection, length and vanished-peer errors", "[verbs]") {
  connection l;
  region src(l.a.pd, 4096, IBV_ACCESS_LOCAL_WRITE);
  region read_only(l.a.pd, 4096, 0);
  region dst(l.b.pd, 4096, all_access);

  SECTION("an lkey that is not the queue pair's fails locally and leaves the responder alone") {
    ibv_sge body = src.sge(0, 64);
    body.lkey = dst.lkey();  // a live key, but of the other device's protection domain
    ibv_send_wr wr = rdma_wr(1, IBV_WR_RDMA_WRITE, &body, 1, dst.addr(), dst.rkey(), false);
    REQUIRE(post(l.a.qp, wr) == 0);
    const auto wcs = poll_n(l.a.scq, 1);
    REQUIRE(wcs.size() == 1);
    CHECK(wcs[0].status == IBV_WC_LOC_PROT_ERR);
    std::this_thread::sleep_for(quiet_period);
    CHECK(no_event(l.b.ctx));
  }
  SECTION("a READ into memory without local write fails locally") {
    ibv_sge body = read_only.sge(0, 64);
    ibv_send_wr wr = rdma_wr(1, IBV_WR_RDMA_READ, &body, 1, dst.addr(), dst.rkey(), true);
    REQUIRE(post(l.a.qp, wr) == 0);
    const auto wcs = poll_n(l.a.scq, 1);
    REQUIRE(wcs.size() == 1);
    CHECK(wcs[0].status == IBV_WC_LOC_PROT_ERR);
  }
  SECTION("a SEND longer than the receive fails on both ends") {
    ibv_sge slot = dst.sge(0, 100);
    REQUIRE(post_receive(l.b.qp, 7, &slot, 1) == 0);
    ibv_sge body = src.sge(0, 101);
    ibv_send_wr wr = send_wr(1, IBV_WR_SEND, &body, 1, true);
    REQUIRE(post(l.a.qp, wr) == 0);
    const auto recv = poll_n(l.b.rcq, 1);
    REQUIRE(recv.size() == 1);
    CHECK(recv[0].wr_id == 7);
    CHECK(recv[0].status == IBV_WC_LOC_LEN_ERR);
    const auto sent = poll_n(l.a.scq, 1);
    REQUIRE(sent.size() == 1);
    CHECK(sent[0].status == IBV_WC_REM_INV_REQ_ERR);
  }
  SECTION("a peer that no longer exists exhausts the retries") {
    REQUIRE(provider::destroy_qp(l.b.qp) == 0);
    l.b.qp = nullptr;
    ibv_sge body = src.sge(0, 64);
    ibv_send_wr wr = rdma_wr(1, IBV_WR_RDMA_WRITE, &body, 1, dst.addr(), dst.rkey(), false);
    REQUIRE(post(l.a.qp, wr) == 0);
    const auto wcs = poll_n(l.a.scq, 1);
    REQUIRE(wcs.size() == 1);
    CHECK(wcs[0].status == IBV_WC_RETRY_EXC_ERR);
  }
}

TEST_CASE("fake verbs: moving to ERR flushes every request not yet executed, in order",
          "[verbs]") {
  connection l;
  region src(l.a.pd, 4096, IBV_ACCESS_LOCAL_WRITE);
  region dst(l.b.pd, 4096, all_access);
  ibv_sge body = src.sge(0, 64);
  ibv_sge slots[2] = {src.sge(1024, 64), src.sge(2048, 64)};
  {
    pause_guard paused;
    std::array<ibv_send_wr, 3> wrs{
        rdma_wr(1, IBV_WR_RDMA_WRITE, &body, 1, dst.addr(), dst.rkey(), false),
        rdma_wr(2, IBV_WR_RDMA_WRITE, &body, 1, dst.addr(), dst.rkey(), true),
        rdma_wr(3, IBV_WR_RDMA_WRITE, &body, 1, dst.addr(), dst.rkey(), false)};
    wrs[0].next = &wrs[1];
    wrs[1].next = &wrs[2];
    ibv_send_wr* bad = nullptr;
    REQUIRE(provider::post_send(l.a.qp, wrs.data(), &bad) == 0);
    REQUIRE(post_receive(l.a.qp, 101, &slots[0], 1) == 0);
    REQUIRE(post_receive(l.a.qp, 102, &slots[1], 1) == 0);
    REQUIRE(to_state(l.a.qp, IBV_QPS_ERR) == 0);
    CHECK(poll_quiet(l.a.scq).empty());  // flushes are the NIC's work too
    CHECK(fab().outstanding_sends(l.a.qp) == 3);
  }
  const auto sends = poll_n(l.a.scq, 3);
  REQUIRE(sends.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(sends[i].wr_id == i + 1);
    CHECK(sends[i].status == IBV_WC_WR_FLUSH_ERR);
    CHECK(sends[i].qp_num == provider::qp_num(l.a.qp));
  }
  const auto receives = poll_n(l.a.rcq, 2);
  REQUIRE(receives.size() == 2);
  CHECK(receives[0].wr_id == 101);
  CHECK(receives[1].wr_id == 102);
  CHECK(receives[1].status == IBV_WC_WR_FLUSH_ERR);
  CHECK(fab().outstanding_sends(l.a.qp) == 0);
  CHECK(std::all_of(dst.bytes().begin(), dst.bytes().end(), [](auto b) { return b == std::byte{0}; }));

  // ERR to RESET empties the queue pair; nothing may be posted there.
  REQUIRE(to_state(l.a.qp, IBV_QPS_RESET) == 0);
  ibv_send_wr wr = rdma_wr(4, IBV_WR_RDMA_WRITE, &body, 1, dst.addr(), dst.rkey(), true);
  ibv_send_wr* bad = nullptr;
  CHECK(provider::post_send(l.a.qp, &wr, &bad) == EINVAL);
  CHECK(bad == &wr);
  CHECK(post_receive(l.a.qp, 103, &slots[0], 1) == EINVAL);
}

TEST_CASE("fake verbs: queue pair transitions demand the kernel's attribute masks", "[verbs]") {
  conn_options o;
  o.connect = false;
  connection l(o);
  region src(l.a.pd, 4096, IBV_ACCESS_LOCAL_WRITE);
  ibv_sge body = src.sge(0, 8);
  ibv_send_wr wr = send_wr(1, IBV_WR_SEND, &body, 1, true);
  const std::uint32_t b_num = provider::qp_num(l.b.qp);

  CHECK(post(l.a.qp, wr) == EINVAL);
  CHECK(post_receive(l.a.qp, 1, &body, 1) == EINVAL);
  CHECK(to_rtr(l.a.qp, l.b.lid, b_num) == EINVAL);
  CHECK(to_init(l.a.qp, all_access, init_mask & ~IBV_QP_ACCESS_FLAGS) == EINVAL);
  CHECK(to_init(l.a.qp, all_access, init_mask | IBV_QP_AV) == EINVAL);
  CHECK(to_init(l.a.qp, all_access, init_mask, 2) == EINVAL);
  REQUIRE(to_init(l.a.qp, all_access) == 0);
  CHECK(post_receive(l.a.qp, 1, &body, 1) == 0);
  CHECK(post(l.a.qp, wr) == EINVAL);

  CHECK(to_rtr(l.a.qp, l.b.lid, b_num, rtr_mask & ~IBV_QP_MIN_RNR_TIMER) == EINVAL);
  CHECK(to_rtr(l.a.qp, static_cast<std::uint16_t>(l.b.lid + 100), b_num) == EINVAL);
  CHECK(to_rtr(l.a.qp, l.b.lid, b_num + 100000) == EINVAL);
  CHECK(to_rtr(l.a.qp, l.a.lid, b_num) == EINVAL);  // no such queue pair behind that LID
  REQUIRE(to_rtr(l.a.qp, l.b.lid, b_num) == 0);
  CHECK(post(l.a.qp, wr) == EINVAL);

  CHECK(to_rts(l.a.qp, rts_mask & ~IBV_QP_RNR_RETRY) == EINVAL);
  CHECK(to_rts(l.a.qp, rts_mask | IBV_QP_DEST_QPN) == EINVAL);
  REQUIRE(to_rts(l.a.qp) == 0);
  CHECK(to_init(l.a.qp, all_access) == EINVAL);
  ibv_qp_attr a{};
  a.qp_access_flags = IBV_ACCESS_REMOTE_READ;
  CHECK(provider::modify_qp(l.a.qp, a, IBV_QP_ACCESS_FLAGS) == 0);  // RTS to RTS
  CHECK(provider::modify_qp(l.a.qp, a, IBV_QP_PATH_MTU) == EINVAL);

  REQUIRE(to_state(l.a.qp, IBV_QPS_ERR) == 0);
  CHECK(to_rts(l.a.qp) == EINVAL);
  CHECK(poll_n(l.a.rcq, 1).size() == 1);  // the receive posted in INIT, flushed
  REQUIRE(to_state(l.a.qp, IBV_QPS_RESET) == 0);
  CHECK(to_state(l.b.qp, IBV_QPS_ERR) == 0);  // RESET to ERR is allowed too
}

TEST_CASE("fake verbs: the send queue holds max_send_wr requests until a later completion is "
          "polled",
          "[verbs]") {
  conn_options o;
  o.send_depth = 4;
  o.recv_depth = 2;
  connection l(o);
  REQUIRE(l.a.cap.max_send_wr == 4);
  region src(l.a.pd, 4096, IBV_ACCESS_LOCAL_WRITE);
  region dst(l.b.pd, 4096, all_access);
  ibv_sge body = src.sge(0, 64);

  std::array<ibv_send_wr, 6> wrs{};
  for (std::size_t i = 0; i < wrs.size(); ++i) {
    wrs[i] = rdma_wr(i, IBV_WR_RDMA_WRITE, &body, 1, dst.addr(64 * i), dst.rkey(), i == 3);
    if (i > 0) wrs[i - 1].next = &wrs[i];
  }
  {
    pause_guard paused;
    const auto sent_before = fab().posted_send_wrs();
    ibv_send_wr* bad = nullptr;
    CHECK(provider::post_send(l.a.qp, wrs.data(), &bad) == ENOMEM);
    CHECK(bad == &wrs[4]);  // the first four were posted
    CHECK(fab().posted_send_wrs() - sent_before == 4);
    CHECK(fab().outstanding_sends(l.a.qp) == 4);
    REQUIRE(provider::req_notify_cq(l.a.scq, false) == 0);
  }
  // Executed and completed, but not polled: the queue is still full.
  REQUIRE(readable(provider::channel_fd(l.a.ch), hang_bound));
  CHECK(fab().outstanding_sends(l.a.qp) == 4);
  ibv_send_wr* bad = nullptr;
  wrs[4].next = nullptr;
  CHECK(provider::post_send(l.a.qp, &wrs[4], &bad) == ENOMEM);
  provider::cq_handle fired = nullptr;
  REQUIRE(provider::get_cq_event(l.a.ch, fired) == 0);
  CHECK(fired == l.a.scq);
  provider::ack_cq_events(fired, 1);
  // Polling the signalled completion releases it and the three unsignalled requests before it.
  const auto wcs = poll_n(l.a.scq, 1);
  REQUIRE(wcs.size() == 1);
  CHECK(wcs[0].wr_id == 3);
  CHECK(fab().outstanding_sends(l.a.qp) == 0);

  // Receives: two fit, and one consumed stays outstanding until its completion is polled.
  region inbox(l.b.pd, 4096, IBV_ACCESS_LOCAL_WRITE);
  std::array<ibv_sge, 3> slots{inbox.sge(0, 64), inbox.sge(64, 64), inbox.sge(128, 64)};
  std::array<ibv_recv_wr, 3> recvs{};
  for (std::size_t i = 0; i < recvs.size(); ++i) {
    recvs[i].wr_id = 50 + i;
    recvs[i].sg_list = &slots[i];
    recvs[i].num_sge = 1;
    if (i > 0) recvs[i - 1].next = &recvs[i];
  }
  ibv_recv_wr* bad_recv = nullptr;
  CHECK(provider::post_recv(l.b.qp, recvs.data(), &bad_recv) == ENOMEM);
  CHECK(bad_recv == &recvs[2]);
  ibv_send_wr send = send_wr(60, IBV_WR_SEND, &body, 1, true);
  REQUIRE(post(l.a.qp, send) == 0);
  REQUIRE(poll_n(l.a.scq, 1).size() == 1);  // so the receive was consumed
  recvs[2].next = nullptr;
  CHECK(provider::post_recv(l.b.qp, &recvs[2], &bad_recv) == ENOMEM);
  const auto recv = poll_n(l.b.rcq, 1);
  REQUIRE(recv.size() == 1);
  CHECK(recv[0].wr_id == 50);
  CHECK(provider::post_recv(l.b.qp, &recvs[2], &bad_recv) == 0);

  // Unsignalled requests alone never free their slots; only a reset does.
  for (std::size_t i = 0; i < 4; ++i) {
    wrs[i].send_flags = 0;
    wrs[i].next = i < 3 ? &wrs[i + 1] : nullptr;
  }
  REQUIRE(provider::post_send(l.a.qp, wrs.data(), &bad) == 0);
  std::this_thread::sleep_for(quiet_period);
  CHECK(fab().outstanding_sends(l.a.qp) == 4);
  CHECK(provider::post_send(l.a.qp, &wrs[4], &bad) == ENOMEM);
  REQUIRE(to_state(l.a.qp, IBV_QPS_ERR) == 0);
  REQUIRE(to_state(l.a.qp, IBV_QPS_RESET) == 0);
  CHECK(fab().outstanding_sends(l.a.qp) == 0);
}

TEST_CASE("fake verbs: a channel event fires once per arming, for a completion pushed after it",
          "[verbs]") {
  connection l;
  region src(l.a.pd, 4096, IBV_ACCESS_LOCAL_WRITE);
  region dst(l.b.pd, 4096, all_access);
  ibv_sge body = src.sge(0, 64);
  const int fd = provider::channel_fd(l.a.ch);
  auto write = [&](std::uint64_t id) {
    ibv_send_wr wr = rdma_wr(id, IBV_WR_RDMA_WRITE, &body, 1, dst.addr(), dst.rkey(), true);
    return post(l.a.qp, wr);
  };

  // A completion that arrived before arming fires nothing, even while it waits in the queue.
  const auto pushed = fab().completions_pushed();
  REQUIRE(write(1) == 0);
  REQUIRE(pushed_reaches(pushed + 1));
  REQUIRE(provider::req_notify_cq(l.a.scq, false) == 0);
  std::this_thread::sleep_for(quiet_period);
  CHECK_FALSE(readable(fd));
  provider::cq_handle fired = nullptr;
  CHECK(provider::get_cq_event(l.a.ch, fired) == EAGAIN);

  // The next one fires, once.
  REQUIRE(write(2) == 0);
  REQUIRE(readable(fd, hang_bound));
  REQUIRE(provider::get_cq_event(l.a.ch, fired) == 0);
  CHECK(fired == l.a.scq);
  CHECK_FALSE(readable(fd));
  provider::ack_cq_events(fired, 1);
  REQUIRE(write(3) == 0);
  REQUIRE(pushed_reaches(pushed + 3));
  CHECK_FALSE(readable(fd));
  const auto wcs = poll_n(l.a.scq, 3);
  REQUIRE(wcs.size() == 3);
  CHECK(wcs[2].wr_id == 3);

  // Solicited-only arming ignores a SEND without the solicited flag.
  region inbox(l.b.pd, 4096, IBV_ACCESS_LOCAL_WRITE);
  ibv_sge slots[2] = {inbox.sge(0, 64), inbox.sge(64, 64)};
  REQUIRE(post_receive(l.b.qp, 1, &slots[0], 1) == 0);
  REQUIRE(post_receive(l.b.qp, 2, &slots[1], 1) == 0);
  REQUIRE(provider::req_notify_cq(l.b.rcq, true) == 0);
  ibv_send_wr plain = send_wr(4, IBV_WR_SEND, &body, 1, false);
  REQUIRE(post(l.a.qp, plain) == 0);
  CHECK(poll_n(l.b.rcq, 1).size() == 1);
  CHECK_FALSE(readable(provider::channel_fd(l.b.ch)));
  ibv_send_wr solicited = send_wr(5, IBV_WR_SEND, &body, 1, false);
  solicited.send_flags |= IBV_SEND_SOLICITED;
  REQUIRE(post(l.a.qp, solicited) == 0);
  REQUIRE(readable(provider::channel_fd(l.b.ch), hang_bound));
  REQUIRE(provider::get_cq_event(l.b.ch, fired) == 0);
  CHECK(fired == l.b.rcq);
  CHECK(poll_n(l.b.rcq, 1).size() == 1);

  // A completion queue whose events are not all acknowledged cannot be destroyed.
  REQUIRE(provider::destroy_qp(l.b.qp) == 0);
  l.b.qp = nullptr;
  CHECK(provider::destroy_cq(l.b.rcq) == EBUSY);
  provider::ack_cq_events(l.b.rcq, 1);
  CHECK(provider::destroy_cq(l.b.rcq) == 0);
  l.b.rcq = nullptr;
}

TEST_CASE("fake verbs: pause holds every completion and resume delivers them in order", "[verbs]") {
  connection l;
  region src(l.a.pd, 4096, IBV_ACCESS_LOCAL_WRITE);
  region dst(l.b.pd, 4096, all_access);
  ibv_sge body = src.sge(0, 64);
  ibv_sge slot = dst.sge(2048, 64);
  pause_guard paused;
  for (std::uint64_t i = 0; i < 8; ++i) {
    ibv_send_wr wr = rdma_wr(i, IBV_WR_RDMA_WRITE, &body, 1, dst.addr(64 * i), dst.rkey(), true);
    REQUIRE(post(l.a.qp, wr) == 0);
  }
  ibv_send_wr send = send_wr(8, IBV_WR_SEND, &body, 1, true);
  REQUIRE(post(l.a.qp, send) == 0);
  REQUIRE(post_receive(l.b.qp, 77, &slot, 1) == 0);
  CHECK(poll_quiet(l.a.scq).empty());
  CHECK(drain(l.b.rcq).empty());
  CHECK(fab().outstanding_sends(l.a.qp) == 9);

  fab().resume();
  const auto wcs = poll_n(l.a.scq, 9);
  REQUIRE(wcs.size() == 9);
  for (std::size_t i = 0; i < wcs.size(); ++i) {
    CHECK(wcs[i].wr_id == i);
    CHECK(wcs[i].status == IBV_WC_SUCCESS);
  }
  CHECK(poll_n(l.b.rcq, 1).size() == 1);
}

TEST_CASE("fake verbs: injected faults", "[verbs]") {
  SECTION("QP fatal: the queue pair's requests are flushed, with IBV_EVENT_QP_FATAL") {
    connection l;
    region src(l.a.pd, 4096, IBV_ACCESS_LOCAL_WRITE);
    ibv_sge slot = src.sge(0, 64);
    REQUIRE(post_receive(l.a.qp, 5, &slot, 1) == 0);
    fab().inject_qp_fatal(l.a.qp);
    const auto e = next_event(l.a.ctx);
    REQUIRE(e.has_value());
    CHECK(e->type == IBV_EVENT_QP_FATAL);
    CHECK(e->qp == l.a.qp);
    const auto wcs = poll_n(l.a.rcq, 1);
    REQUIRE(wcs.size() == 1);
    CHECK(wcs[0].status == IBV_WC_WR_FLUSH_ERR);
  }
  SECTION("CQ error: IBV_EVENT_CQ_ERR, and no completion arrives any more") {
    connection l;
    region src(l.a.pd, 4096, IBV_ACCESS_LOCAL_WRITE);
    region dst(l.b.pd, 4096, all_access);
    fab().inject_cq_error(l.a.scq);
    const auto e = next_event(l.a.ctx);
    REQUIRE(e.has_value());
    CHECK(e->type == IBV_EVENT_CQ_ERR);
    CHECK(e->cq == l.a.scq);
    ibv_sge body = src.sge(0, 64);
    ibv_send_wr wr = rdma_wr(1, IBV_WR_RDMA_WRITE, &body, 1, dst.addr(), dst.rkey(), true);
    REQUIRE(post(l.a.qp, wr) == 0);
    CHECK(poll_quiet(l.a.scq).empty());
    CHECK(fab().outstanding_sends(l.a.qp) == 1);
  }
  SECTION("port down: requests stall until the port is up again, or the queue pair is flushed") {
    {
      connection l;
      region src(l.a.pd, 4096, all_access);
      region dst(l.b.pd, 4096, all_access);
      fab().inject_port_down(l.a.ctx);
      const auto e = next_event(l.a.ctx);
      REQUIRE(e.has_value());
      CHECK(e->type == IBV_EVENT_PORT_ERR);
      CHECK(e->port == 1);
      ibv_port_attr port{};
      REQUIRE(provider::query_port(l.a.ctx, 1, port) == 0);
      CHECK(port.state == IBV_PORT_DOWN);
      ibv_sge body = src.sge(0, 64);
      ibv_send_wr wr = rdma_wr(1, IBV_WR_RDMA_WRITE, &body, 1, dst.addr(), dst.rkey(), true);
      REQUIRE(post(l.a.qp, wr) == 0);
      CHECK(poll_quiet(l.a.scq).empty());
      CHECK(fab().outstanding_sends(l.a.qp) == 1);
      // Requests towards the downed port stall as well.
      ibv_sge back = dst.sge(0, 64);
      ibv_send_wr reverse = rdma_wr(2, IBV_WR_RDMA_READ, &back, 1, src.addr(), src.rkey(), true);
      REQUIRE(post(l.b.qp, reverse) == 0);
      CHECK(poll_quiet(l.b.scq).empty());

      fab().inject_port_up(l.a.ctx);
      const auto up = next_event(l.a.ctx);
      REQUIRE(up.has_value());
      CHECK(up->type == IBV_EVENT_PORT_ACTIVE);
      CHECK(poll_n(l.a.scq, 1).size() == 1);
      CHECK(poll_n(l.b.scq, 1).size() == 1);

      fab().inject_port_down(l.a.ctx);
      REQUIRE(next_event(l.a.ctx).has_value());
      ibv_send_wr stuck = rdma_wr(3, IBV_WR_RDMA_WRITE, &body, 1, dst.addr(), dst.rkey(), false);
      REQUIRE(post(l.a.qp, stuck) == 0);
      CHECK(poll_quiet(l.a.scq).empty());
      REQUIRE(to_state(l.a.qp, IBV_QPS_ERR) == 0);  // flushing is local
      const auto wcs = poll_n(l.a.scq, 1);
      REQUIRE(wcs.size() == 1);
      CHECK(wcs[0].wr_id == 3);
      CHECK(wcs[0].status == IBV_WC_WR_FLUSH_ERR);
    }
    // Once every context on the device is closed, the cable is back in.
    provider::context_handle c = provider::open_device("fake0");
    REQUIRE(c != nullptr);
    ibv_port_attr port{};
    CHECK(provider::query_port(c, 1, port) == 0);
    CHECK(port.state == IBV_PORT_ACTIVE);
    provider::close_device(c);
  }
  SECTION("device fatal: IBV_EVENT_DEVICE_FATAL, then EIO and no completions at all") {
    {
      connection l;
      region src(l.a.pd, 4096, all_access);
      region dst(l.b.pd, 4096, all_access);
      ibv_sge body = src.sge(0, 64);
      ibv_sge slot = src.sge(1024, 64);
      REQUIRE(post_receive(l.a.qp, 1, &slot, 1) == 0);
      fab().inject_device_fatal(l.a.ctx);
      const auto e = next_event(l.a.ctx);
      REQUIRE(e.has_value());
      CHECK(e->type == IBV_EVENT_DEVICE_FATAL);
      ibv_send_wr wr = rdma_wr(1, IBV_WR_RDMA_WRITE, &body, 1, dst.addr(), dst.rkey(), true);
      ibv_send_wr* bad = nullptr;
      CHECK(provider::post_send(l.a.qp, &wr, &bad) == EIO);
      CHECK(bad == &wr);
      CHECK(post_receive(l.a.qp, 2, &slot, 1) == EIO);
      CHECK(to_state(l.a.qp, IBV_QPS_ERR) == EIO);
      CHECK(poll_quiet(l.a.rcq).empty());  // not even the receive's flush
      errno = 0;
      CHECK(provider::alloc_pd(l.a.ctx) == nullptr);
      CHECK(errno == EIO);
      // The peer's requests towards the dead device wait.
      ibv_sge back = dst.sge(0, 64);
      ibv_send_wr reverse = rdma_wr(2, IBV_WR_RDMA_READ, &back, 1, src.addr(), src.rkey(), true);
      REQUIRE(post(l.b.qp, reverse) == 0);
      CHECK(poll_quiet(l.b.scq).empty());
    }
    provider::context_handle c = provider::open_device("fake0");
    REQUIRE(c != nullptr);
    provider::pd_handle pd = provider::alloc_pd(c);
    CHECK(pd != nullptr);
    provider::dealloc_pd(pd);
    provider::close_device(c);
  }
  SECTION("dropped completions: requests execute, their completions never come") {
    connection l;
    region src(l.a.pd, 4096, IBV_ACCESS_LOCAL_WRITE);
    region dst(l.b.pd, 4096, all_access);
    src.fill(6);
    ibv_sge body = src.sge(0, 64);
    fab().drop_completions(l.a.qp, true);
    ibv_send_wr w1 = rdma_wr(1, IBV_WR_RDMA_WRITE, &body, 1, dst.addr(), dst.rkey(), true);
    ibv_send_wr w2 = rdma_wr(2, IBV_WR_RDMA_WRITE, &body, 1, dst.addr(64), dst.rkey(), true);
    w1.next = &w2;
    ibv_send_wr* bad = nullptr;
    REQUIRE(provider::post_send(l.a.qp, &w1, &bad) == 0);
    CHECK(poll_quiet(l.a.scq).empty());
    CHECK(fab().outstanding_sends(l.a.qp) == 2);
    fab().drop_completions(l.a.qp, false);
    ibv_send_wr w3 = rdma_wr(3, IBV_WR_RDMA_WRITE, &body, 1, dst.addr(128), dst.rkey(), true);
    REQUIRE(post(l.a.qp, w3) == 0);
    const auto wcs = poll_n(l.a.scq, 1);
    REQUIRE(wcs.size() == 1);
    CHECK(wcs[0].wr_id == 3);
    CHECK(fab().outstanding_sends(l.a.qp) == 0);  // a later completion releases the lost ones
    const auto d = dst.bytes();
    for (std::size_t at = 0; at < 192; at += 64) {
      CHECK(std::equal(src.bytes().begin(), src.bytes().begin() + 64, d.begin() + at));
    }
  }
}

TEST_CASE("fake verbs: a completion pushed into a full completion queue puts it in error",
          "[verbs]") {
  conn_options o;
  o.cq_entries = 2;
  connection l(o);
  region src(l.a.pd, 4096, IBV_ACCESS_LOCAL_WRITE);
  region dst(l.b.pd, 4096, all_access);
  ibv_sge body = src.sge(0, 64);
  for (std::uint64_t i = 0; i < 3; ++i) {
    ibv_send_wr wr = rdma_wr(i, IBV_WR_RDMA_WRITE, &body, 1, dst.addr(), dst.rkey(), true);
    REQUIRE(post(l.a.qp, wr) == 0);
  }
  const auto e = next_event(l.a.ctx);
  REQUIRE(e.has_value());
  CHECK(e->type == IBV_EVENT_CQ_ERR);
  CHECK(e->cq == l.a.scq);
  const auto wcs = drain(l.a.scq);
  REQUIRE(wcs.size() == 2);
  CHECK(wcs[1].wr_id == 1);
  ibv_send_wr more = rdma_wr(3, IBV_WR_RDMA_WRITE, &body, 1, dst.addr(), dst.rkey(), true);
  REQUIRE(post(l.a.qp, more) == 0);
  CHECK(poll_quiet(l.a.scq).empty());
  CHECK(no_event(l.a.ctx));
}

TEST_CASE("fake verbs: posters, pollers and control calls on many threads at once",
          "[verbs][concurrency]") {
  connection writes;
  connection sends;
  region src(writes.a.pd, 4096, IBV_ACCESS_LOCAL_WRITE);
  region dst(writes.b.pd, 4096, all_access);
  region inbox(sends.b.pd, 64 * 8, IBV_ACCESS_LOCAL_WRITE);
  src.fill(7);
  constexpr int write_rounds = 4000;  // every 8th signalled
  constexpr int send_rounds = 1000;
  const auto deadline = std::chrono::steady_clock::now() + hang_bound;
  const auto in_time = [&] { return std::chrono::steady_clock::now() < deadline; };
  std::atomic<int> failures{0};

  std::thread poster([&] {
    for (int i = 0; i < write_rounds && in_time(); ++i) {
      const std::size_t offset = static_cast<std::size_t>(i % 64) * 64;
      ibv_sge s = src.sge(offset, 64);
      ibv_send_wr wr = rdma_wr(static_cast<std::uint64_t>(i), IBV_WR_RDMA_WRITE, &s, 1,
                               dst.addr(offset), dst.rkey(), i % 8 == 7);
      int rc;
      while ((rc = post(writes.a.qp, wr)) == ENOMEM && in_time()) {
        std::this_thread::sleep_for(50us);
      }
      if (rc != 0) ++failures;
    }
  });
  std::vector<std::uint64_t> polled;
  std::thread poller([&] {
    while (polled.size() < write_rounds / 8 && in_time()) {
      ibv_wc wc[8];
      const int n = provider::poll_cq(writes.a.scq, 8, wc);
      for (int i = 0; i < n; ++i) {
        if (wc[i].status != IBV_WC_SUCCESS) ++failures;
        polled.push_back(wc[i].wr_id);
      }
      if (n == 0) std::this_thread::sleep_for(20us);
    }
  });
  std::thread sender([&] {
    int done = 0;
    for (int i = 0; i < send_rounds && in_time(); ++i) {
      std::uint64_t value = static_cast<std::uint64_t>(i);
      ibv_sge s{reinterpret_cast<std::uintptr_t>(&value), sizeof value, 0};
      ibv_send_wr wr = send_wr(static_cast<std::uint64_t>(i), IBV_WR_SEND, &s, 1, true);
      wr.send_flags |= IBV_SEND_INLINE;
      int rc;
      while ((rc = post(sends.a.qp, wr)) == ENOMEM && in_time()) {
        ibv_wc wc[8];
        done += std::max(provider::poll_cq(sends.a.scq, 8, wc), 0);
        std::this_thread::sleep_for(20us);
      }
      if (rc != 0) ++failures;
    }
    while (done < send_rounds && in_time()) {
      ibv_wc wc[8];
      const int n = provider::poll_cq(sends.a.scq, 8, wc);
      done += std::max(n, 0);
      if (n == 0) std::this_thread::sleep_for(20us);
    }
    if (done != send_rounds) ++failures;
  });
  std::vector<std::uint64_t> received;
  std::thread receiver([&] {
    std::uint64_t next_slot = 0;
    const auto repost = [&](std::uint64_t slot) {
      ibv_sge s = inbox.sge(static_cast<std::size_t>(slot % 8) * 64, 64);
      if (post_receive(sends.b.qp, slot % 8, &s, 1) != 0) ++failures;
    };
    for (; next_slot < 8; ++next_slot) repost(next_slot);
    while (received.size() < send_rounds && in_time()) {
      ibv_wc wc[8];
      const int n = provider::poll_cq(sends.b.rcq, 8, wc);
      for (int i = 0; i < n; ++i) {
        std::uint64_t value = 0;
        std::memcpy(&value, inbox.bytes().data() + wc[i].wr_id * 64, sizeof value);
        received.push_back(value);
        repost(wc[i].wr_id);
      }
      if (n == 0) std::this_thread::sleep_for(20us);
    }
  });
  std::thread controller([&] {
    std::vector<std::byte> scratch(4096);
    for (int i = 0; i < 100 && in_time(); ++i) {
      fab().pause();
      std::this_thread::sleep_for(100us);
      fab().resume();
      provider::mr_handle m = provider::reg_mr(sends.a.pd, scratch.data(), scratch.size(),
                                               IBV_ACCESS_LOCAL_WRITE);
      if (m == nullptr || provider::dereg_mr(m) != 0) ++failures;
      ibv_port_attr port{};
      if (provider::query_port(writes.a.ctx, 1, port) != 0) ++failures;
      if (fab().outstanding_sends(writes.a.qp) > writes.a.cap.max_send_wr) ++failures;
      std::this_thread::sleep_for(200us);
    }
  });
  poster.join();
  poller.join();
  sender.join();
  receiver.join();
  controller.join();

  CHECK(failures == 0);
  REQUIRE(polled.size() == write_rounds / 8);
  for (std::size_t i = 0; i < polled.size(); ++i) CHECK(polled[i] == i * 8 + 7);
  REQUIRE(received.size() == send_rounds);
  for (std::size_t i = 0; i < received.size(); ++i) CHECK(received[i] == i);
  CHECK(std::equal(src.bytes().begin(), src.bytes().end(), dst.bytes().begin()));
  CHECK(drain(sends.b.rcq).empty());
}
