// asyncio: `await transfer` and `await ferry.when_all(...)` resume on the awaiting event loop's
// thread, woken through an eventfd the loop reads (loop.add_reader), never by polling.
//
// Each await is a small C++ coroutine frame that awaits the transfer (or the when_all) with ferry's
// own awaiters, on a scheduler whose post() is GIL-free: it links the frame onto its notifier's
// ready list and, if the list was empty, writes the notifier's eventfd. The completing thread (the
// executor's, the timer thread, a thread that called Completer.succeed) does nothing else: no GIL,
// no Python object. The loop then calls dispatch() on its own thread, with the GIL: it resumes each
// ready frame (C++ only: the awaiter reads its result), takes the result, frees the frame and sets
// the asyncio future the awaiting task waits on.
//
// Lifetimes. A frame holds its notifier's state (shared), so the state outlives every frame that
// may still be posted to it; frames are freed only by dispatch (or by the notifier's own teardown,
// below), on a thread with the GIL, never by a completing thread. The eventfd is written under the
// state's mutex: once the mutex is released, dispatch may free the frame and with it the state.
// A notifier whose loop has gone (its Python object destroyed) is orphaned: frames still posted to
// it later go to one process-wide list, resumed and freed by the next dispatch of any loop or the
// next await.
//
// C++ tasks (ferry._Task: serve_releases, PushReceiver.receive, PushedRequest.finish) run on the
// loop's thread too. Awaiting one spawns it on a scheduler whose post() queues the coroutine on the
// notifier's run_loop (never throws) and writes the same eventfd; dispatch then polls that queue
// with the GIL, so the task's body, and every await inside it, resumes on the loop's thread, where
// it may call Python (a ReleaseLedger's free callback). When it ends, dispatch sets its future and
// drops what it held. A task cannot be cancelled from Python (a ferry::task has no cancellation):
// cancelling the awaiting asyncio task cancels the await only; close the link's endpoint to end a
// receive loop. A notifier whose loop has gone never runs its queue again: tasks still in it are
// leaked, not resumed.

#include <coroutine>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

#include <sys/eventfd.h>
#include <unistd.h>

#include "common.hpp"
#include "ferry/run_loop.hpp"
#include "ferry/spawn.hpp"
#include "ferry/when_all.hpp"

namespace ferry::python {

namespace {

struct notifier_state;

struct frame_promise;
using frame_handle = std::coroutine_handle<frame_promise>;

// Where a frame goes when its await is over: the notifier's ready list.
struct loop_scheduler {
  notifier_state* state;
  void post(std::coroutine_handle<> h) const noexcept;
};

struct frame_promise {
  std::shared_ptr<notifier_state> state;
  frame_promise* next = nullptr;  // the ready list's link, under the state's mutex
  std::uint64_t token = 0;
  bool is_batch = false;
  transfer_state state_result = transfer_state::pending;
  batch_result batch;
  std::exception_ptr error;

  template <class... Args>
  explicit frame_promise(const std::shared_ptr<notifier_state>& s, const Args&...) noexcept
      : state(s) {}

  [[nodiscard]] loop_scheduler get_scheduler() const noexcept { return {state.get()}; }
  frame_handle get_return_object() noexcept { return frame_handle::from_promise(*this); }
  std::suspend_always initial_suspend() noexcept { return {}; }
  std::suspend_always final_suspend() noexcept { return {}; }
  void return_void() noexcept {}
  // Only await_suspend can throw (a when_all's join failing to allocate), before anything is
  // linked: the creator rethrows it.
  void unhandled_exception() noexcept { error = std::current_exception(); }
};

struct frame {
  using promise_type = frame_promise;
  frame(frame_handle h) noexcept : handle(h) {}  // NOLINT: the coroutine's return object
  frame_handle handle;
};

// co_await this_promise{}: the frame's own promise, without suspending.
struct this_promise {
  frame_promise* p = nullptr;
  bool await_ready() const noexcept { return false; }
  bool await_suspend(frame_handle h) noexcept {
    p = &h.promise();
    return false;
  }
  frame_promise& await_resume() const noexcept { return *p; }
};

frame await_one(std::shared_ptr<notifier_state>, transfer t) {
  frame_promise& p = co_await this_promise{};
  p.state_result = co_await t;
}

frame await_all(std::shared_ptr<notifier_state>, std::vector<transfer> members,
                std::chrono::duration<double> timeout) {
  frame_promise& p = co_await this_promise{};
  p.is_batch = true;
  p.batch = co_await when_all(std::span<const transfer>(members), timeout);
}

// Frames posted to notifiers whose loop has gone.
struct orphan_list {
  std::mutex mutex;
  frame_promise* head = nullptr;
};
orphan_list& orphaned_frames() {
  static auto* list = new orphan_list;
  return *list;
}

struct notifier_state {
  int fd = -1;
  std::mutex mutex;
  frame_promise* head = nullptr;
  frame_promise* tail = nullptr;
  bool orphaned = false;
  run_loop tasks;                       // the C++ tasks' queue, polled by dispatch
  std::vector<std::uint64_t> finished;  // tokens of tasks that ended; only touched inside dispatch

  notifier_state() {
    fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fd < 0) throw std::system_error(errno, std::system_category(), "ferry: eventfd for asyncio");
  }
  notifier_state(const notifier_state&) = delete;
  notifier_state& operator=(const notifier_state&) = delete;
  ~notifier_state() { ::close(fd); }

  // Takes the ready list and clears the eventfd's count, together, so that a post after this
  // finds the list empty and writes the eventfd again.
  frame_promise* take() noexcept {
    std::lock_guard lock(mutex);
    std::uint64_t count = 0;
    [[maybe_unused]] const ssize_t n = ::read(fd, &count, sizeof count);
    frame_promise* list = head;
    head = tail = nullptr;
    return list;
  }
};

void loop_scheduler::post(std::coroutine_handle<> h) const noexcept {
  frame_promise& p = frame_handle::from_address(h.address()).promise();
  p.next = nullptr;
  {
    std::lock_guard lock(state->mutex);
    if (!state->orphaned) {
      const bool was_empty = state->head == nullptr;
      if (was_empty) {
        state->head = &p;
      } else {
        state->tail->next = &p;
      }
      state->tail = &p;
      if (was_empty) {
        const std::uint64_t one = 1;
        [[maybe_unused]] const ssize_t n = ::write(state->fd, &one, sizeof one);
      }
      return;
    }
  }
  // Orphaned (for good): the state is not touched again here.
  orphan_list& o = orphaned_frames();
  std::lock_guard lock(o.mutex);
  p.next = o.head;
  o.head = &p;
}

// Where a spawned C++ task resumes: the notifier's run_loop, and a write of its eventfd.
struct task_scheduler {
  std::shared_ptr<notifier_state> state;
  void post(std::coroutine_handle<> h) const noexcept {
    state->tasks.post(h);
    const std::uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = ::write(state->fd, &one, sizeof one);
  }
};

// Resumes (the awaiter reads its result) and frees the orphans' frames. With the GIL.
void run_orphans() {
  orphan_list& o = orphaned_frames();
  frame_promise* list = nullptr;
  {
    std::lock_guard lock(o.mutex);
    list = std::exchange(o.head, nullptr);
  }
  while (list != nullptr) {
    frame_promise* next = list->next;
    frame_handle h = frame_handle::from_promise(*list);
    h.resume();
    h.destroy();
    list = next;
  }
}

// ferry._Notifier: one per event loop (ferry's asyncio glue keeps it with the loop and registers
// fd with loop.add_reader(fd, dispatch)).
class notifier {
 public:
  notifier() : state_(std::make_shared<notifier_state>()) {}
  notifier(const notifier&) = delete;
  notifier& operator=(const notifier&) = delete;

  ~notifier() {
    frame_promise* list = nullptr;
    {
      std::lock_guard lock(state_->mutex);
      state_->orphaned = true;
      list = std::exchange(state_->head, nullptr);
      state_->tail = nullptr;
    }
    while (list != nullptr) {
      frame_promise* next = list->next;
      frame_handle h = frame_handle::from_promise(*list);
      h.resume();
      h.destroy();
      list = next;
    }
    run_orphans();
  }

  [[nodiscard]] int fd() const noexcept { return state_->fd; }

  // (result, None) when decided at once, else (None, future).
  py::tuple await_transfer(const py_transfer& t, const py::object& loop) {
    return start(await_one(state_, t.t), loop);
  }

  // `who` names the awaitable the caller made (ferry.when_all, LoadTracker.when_layer) in errors.
  py::tuple await_batch(py::handle transfers, py::handle timeout, const py::object& loop,
                        const std::string& who) {
    const members_of mem(transfers, who);
    std::vector<transfer> members(mem.view().begin(), mem.view().end());
    return start(await_all(state_, std::move(members), timeout_arg(timeout, who)), loop);
  }

  // The loop's reader callback: sets the results of every await that has ended.
  void dispatch() {
    run_orphans();
    frame_promise* list = state_->take();
    std::vector<std::pair<py::object, py::object>> results;
    while (list != nullptr) {
      frame_promise* next = list->next;
      frame_handle h = frame_handle::from_promise(*list);
      h.resume();
      const frame_promise& p = h.promise();
      py::object result = p.is_batch ? py::cast(p.batch) : py::cast(p.state_result);
      const std::uint64_t token = p.token;
      h.destroy();
      if (auto it = futures_.find(token); it != futures_.end()) {
        results.emplace_back(std::move(it->second), std::move(result));
        futures_.erase(it);
      }
      list = next;
    }
    // The C++ tasks whose awaits ended (or that were just spawned) run now, on this thread.
    state_->tasks.poll();
    std::vector<std::uint64_t> finished = std::move(state_->finished);
    state_->finished.clear();
    for (const std::uint64_t token : finished) {
      if (auto it = tasks_.find(token); it != tasks_.end()) {
        results.emplace_back(std::move(it->second.future), py::none());
        tasks_.erase(it);
      }
    }
    // A future cancelled meanwhile (its task was cancelled) keeps its cancellation.
    for (auto& [future, result] : results) {
      if (!future.attr("done")().cast<bool>()) future.attr("set_result")(result);
    }
  }

  [[nodiscard]] std::size_t pending() const noexcept { return futures_.size() + tasks_.size(); }

  // Spawns the C++ task on this loop; returns the future dispatch sets (to None) when it ends.
  py::object start_task(const std::shared_ptr<py_task>& t, const py::object& loop) {
    if (t->started) {
      throw std::runtime_error(t->who + ": this awaitable was awaited already (each call makes "
                                        "one, awaited once)");
    }
    task<void> body = t->make();
    t->started = true;
    py::object future = loop.attr("create_future")();
    const std::uint64_t token = ++next_token_;
    tasks_.emplace(token, task_entry{future, t});
    py_task* raw = t.get();
    notifier_state* st = state_.get();
    any_scheduler s(task_scheduler{state_});
    // on_done runs inside dispatch's poll, with the GIL; tasks_ holds the py_task until then.
    spawn(s, std::move(body), [raw, st, token](std::exception_ptr e) noexcept {
      raw->done = true;
      raw->error = std::move(e);
      st->finished.push_back(token);
    });
    return future;
  }

 private:
  py::tuple start(frame f, const py::object& loop) {
    run_orphans();
    frame_handle h = f.handle;
    frame_promise& p = h.promise();
    p.token = ++next_token_;
    // Runs to its co_await: decided at once (done), or linked to the transfer(s). Once linked, a
    // completion may post the frame at any moment, but only dispatch, on this thread, resumes it;
    // a frame whose future could not be made is freed there without a result.
    h.resume();
    if (h.done()) {
      const std::exception_ptr error = p.error;
      py::object result;
      if (!error) result = p.is_batch ? py::cast(p.batch) : py::cast(p.state_result);
      h.destroy();
      if (error) std::rethrow_exception(error);
      return py::make_tuple(result, py::none());
    }
    py::object future = loop.attr("create_future")();
    futures_.emplace(p.token, future);
    return py::make_tuple(py::none(), future);
  }

  std::shared_ptr<notifier_state> state_;
  struct task_entry {
    py::object future;
    std::shared_ptr<py_task> task;
  };
  std::unordered_map<std::uint64_t, py::object> futures_;
  std::unordered_map<std::uint64_t, task_entry> tasks_;
  std::uint64_t next_token_ = 0;
};

}  // namespace

void add_asyncio(py::module_& m) {
  py::class_<notifier>(m, "_Notifier",
                       "One per event loop: an eventfd the loop reads, and the awaits it wakes.")
      .def(py::init<>())
      .def_property_readonly("fd", &notifier::fd)
      .def_property_readonly("pending", &notifier::pending)
      .def("await_transfer", &notifier::await_transfer)
      .def("await_batch", &notifier::await_batch, py::arg("transfers"), py::arg("timeout"),
           py::arg("loop"), py::arg("who") = "ferry.when_all")
      .def("start_task", &notifier::start_task)
      .def("dispatch", &notifier::dispatch);

  py::class_<py_task, std::shared_ptr<py_task>>(
      m, "_Task",
      "A C++ coroutine awaited once from asyncio: it runs on the awaiting loop's thread. "
      "Cancelling the awaiting task cancels the await only.")
      .def_property_readonly("done", [](const py_task& t) { return t.done; })
      .def("_result", [](py_task& t) -> py::object {
        if (!t.done) throw std::runtime_error(t.who + ": has not ended");
        if (t.error) std::rethrow_exception(t.error);
        return t.result ? t.result() : py::none();
      });

  // What ferry.when_all and LoadTracker.when_layer check when called, not only once awaited: the
  // transfers (a Batch, an iterable; a list's or tuple's items are checked now, any other
  // iterable's when awaited, since reading them would use them up) and the timeout.
  m.def("_check_wait",
        [](py::handle transfers, py::handle timeout, const std::string& who) {
          if (PyList_Check(transfers.ptr()) || PyTuple_Check(transfers.ptr())) {
            (void)members_of(transfers, who);
          } else if (!py::isinstance<batch>(transfers)) {
            (void)iterable_arg(transfers, who, "transfers",
                               "a ferry.Batch or an iterable of ferry.Transfer");
          }
          (void)timeout_arg(timeout, who);
        },
        py::arg("transfers"), py::arg("timeout"), py::arg("who"));
}

}  // namespace ferry::python
