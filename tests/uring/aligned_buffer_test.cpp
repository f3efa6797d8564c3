// Memory aligned for O_DIRECT (aligned_buffer.hpp); its use with the ring is in files_test.cpp.

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <utility>

#include <ferry/uring/aligned_buffer.hpp>

using ferry::uring::aligned_buffer;

TEST_CASE("aligned_buffer: memory starts at the alignment asked for and is zero-filled", "[uring]") {
  for (const std::size_t alignment : {std::size_t{8}, std::size_t{512}, std::size_t{4096}}) {
    const aligned_buffer b(3 * alignment + 1, alignment);
    REQUIRE(b.size() == 3 * alignment + 1);
    CHECK(reinterpret_cast<std::uintptr_t>(b.data()) % alignment == 0);
    bool zero = true;
    for (const std::byte x : b.span()) zero = zero && x == std::byte{0};
    CHECK(zero);
    CHECK(b.subspan(alignment, 2).data() == b.data() + alignment);
  }
}

TEST_CASE("aligned_buffer: an alignment that is not a power of two of at least a pointer throws",
          "[uring]") {
  CHECK_THROWS_AS(aligned_buffer(64, 3), std::invalid_argument);
  CHECK_THROWS_AS(aligned_buffer(64, 2), std::invalid_argument);
  CHECK_THROWS_AS(aligned_buffer(64, 4095), std::invalid_argument);
}

TEST_CASE("aligned_buffer: moving hands the memory over and leaves the source empty", "[uring]") {
  aligned_buffer a(4096);
  std::byte* p = a.data();
  aligned_buffer b(std::move(a));
  CHECK(b.data() == p);
  CHECK(b.size() == 4096);
  CHECK(a.data() == nullptr);  // NOLINT: the moved-from state is part of the contract
  CHECK(a.size() == 0);
  aligned_buffer c;
  c = std::move(b);
  CHECK(c.data() == p);
  CHECK(b.data() == nullptr);  // NOLINT
  const aligned_buffer empty(0);
  CHECK(empty.size() == 0);
  CHECK(empty.data() != nullptr);
}
