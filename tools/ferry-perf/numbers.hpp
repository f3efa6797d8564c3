#pragma once
// Numbers read from text strictly, for the command line (cli.hpp) and the control protocol
// (control.hpp): the whole text is the number, with no sign, space, hexadecimal or trailing
// characters, and it is finite. A value that does not fit is refused here, not wrapped, truncated
// or cast out of range later (a negative count read as 2^64 - 1, a NaN timeout cast to an integer).

#include <charconv>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

namespace ferry_perf {

// Decimal digits only, at most 2^64 - 1.
[[nodiscard]] inline std::optional<std::uint64_t> parse_whole(std::string_view text) {
  if (text.empty() || text.front() < '0' || text.front() > '9') return std::nullopt;
  std::uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return v;
}

// A finite decimal number: "0.5", "2", "1e-3". No sign (no quantity ferry-perf reads is negative),
// no "nan", "inf" or hexadecimal.
[[nodiscard]] inline std::optional<double> parse_real(std::string_view text) {
  if (text.empty() || !((text.front() >= '0' && text.front() <= '9') || text.front() == '.')) return std::nullopt;
  double v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v, std::chars_format::general);
  if (ec != std::errc() || end != text.data() + text.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

// The shortest text that parse_real reads back as exactly `v` (the initiator's figures cross the
// control connection unrounded).
[[nodiscard]] inline std::string format_real(double v) {
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return ec == std::errc() ? std::string(buf, end) : std::string("nan");
}

// A value as a message quotes it: cut short, so that a line of garbage does not flood the log.
[[nodiscard]] inline std::string in_quotes(std::string_view text) {
  constexpr std::size_t most = 40;
  std::string out = "'";
  for (char ch : text.substr(0, most)) out += (ch >= 0x20 && ch < 0x7f) ? ch : '?';
  return out + (text.size() > most ? "...'" : "'");
}

}  // namespace ferry_perf
