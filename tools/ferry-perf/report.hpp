#pragma once
// What a run measured, and its three forms: the terminal table, JSON and an SVG plot.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli.hpp"

namespace ferry_perf {

struct cpu_times {
  double user_s = 0;
  double system_s = 0;
  [[nodiscard]] double total() const noexcept { return user_s + system_s; }
};

struct point_result {
  std::size_t block = 0;
  double seconds = 0;
  std::uint64_t ops = 0;  // blocks completed
  std::uint64_t bytes = 0;
  cpu_times initiator_process;
  cpu_times initiator_threads;  // the submitting threads only, added up
  cpu_times target_process;
  bool target_reported = false;
  std::uint64_t target_ops = 0;  // blocks the target handled itself (tcp); 0 for one-sided RMA
  std::vector<double> latency_us;  // latency workload: sorted samples
  std::vector<double> step_us;     // kv: sorted step times
  std::vector<double> layer_ready_us;  // kv: median time from the step's start to each layer ready
  bool checked = false;                // --check verified every byte moved, and it matched
  std::string error;

  [[nodiscard]] double mb_per_s() const noexcept { return seconds > 0 ? bytes / seconds / 1e6 : 0; }
  [[nodiscard]] double ops_per_s() const noexcept { return seconds > 0 ? ops / seconds : 0; }
  [[nodiscard]] double cpu_us_per_op(const cpu_times& c) const noexcept {
    return ops > 0 ? c.total() / static_cast<double>(ops) * 1e6 : 0;
  }
};

[[nodiscard]] inline double quantile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  const double pos = q * static_cast<double>(sorted.size() - 1);
  const auto lo = static_cast<std::size_t>(pos);
  const std::size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - static_cast<double>(lo));
}

[[nodiscard]] inline std::string size_name(std::size_t b) {
  if (b >= (1u << 30) && b % (1u << 30) == 0) return std::to_string(b >> 30) + "G";
  if (b >= (1u << 20) && b % (1u << 20) == 0) return std::to_string(b >> 20) + "M";
  if (b >= (1u << 10) && b % (1u << 10) == 0) return std::to_string(b >> 10) + "K";
  return std::to_string(b);
}

inline void print_table_header(const config& c) {
  std::printf("%-7s %10s %11s", "block", "MB/s", "ops/s");
  if (c.workload == "latency") std::printf(" %9s %9s %9s %9s", "p50 us", "p90 us", "p99 us", "p99.9 us");
  if (c.workload == "kv") std::printf(" %11s %11s", "step p50us", "step p99us");
  std::printf(" %12s %12s\n", "cpu us/op I", "cpu us/op T");
}

inline void print_row(const config& c, const point_result& p) {
  std::printf("%-7s %10.1f %11.0f", size_name(p.block).c_str(), p.mb_per_s(), p.ops_per_s());
  if (c.workload == "latency") {
    std::printf(" %9.1f %9.1f %9.1f %9.1f", quantile(p.latency_us, 0.5), quantile(p.latency_us, 0.9),
                quantile(p.latency_us, 0.99), quantile(p.latency_us, 0.999));
  }
  if (c.workload == "kv") {
    std::printf(" %11.1f %11.1f", quantile(p.step_us, 0.5), quantile(p.step_us, 0.99));
  }
  std::printf(" %12.2f", p.cpu_us_per_op(p.initiator_process));
  if (p.target_reported) {
    std::printf(" %12.2f\n", p.cpu_us_per_op(p.target_process));
  } else {
    std::printf(" %12s\n", "-");
  }
  if (c.workload == "kv" && !p.layer_ready_us.empty()) {
    std::printf("        layer ready (median us from step start):");
    for (std::size_t l = 0; l < p.layer_ready_us.size(); ++l) std::printf(" %.0f", p.layer_ready_us[l]);
    std::printf("\n");
  }
  std::fflush(stdout);
}

// ---- JSON

inline std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char ch : s) {
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (ch < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", ch);
          out += buf;
        } else {
          out += static_cast<char>(ch);
        }
    }
  }
  return out + "\"";
}

inline std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

inline std::string json_array(const std::vector<double>& v) {
  std::string out = "[";
  for (std::size_t i = 0; i < v.size(); ++i) {
    // Appended in two steps: g++ 12 -O3 reports a false -Wrestrict in `const char* + string&&`.
    if (i != 0) out += ',';
    out += json_number(v[i]);
  }
  return out + "]";
}

inline std::string json_cpu(const cpu_times& c) {
  return "{\"user_s\":" + json_number(c.user_s) + ",\"system_s\":" + json_number(c.system_s) + "}";
}

// `environment` is a JSON object (versions, host); `metrics` a JSON value (the backend's snapshot).
inline void write_json(const std::string& file, const config& c, const std::string& environment,
                       const std::vector<point_result>& points, const std::string& metrics) {
  std::ostringstream o;
  o << "{\n\"tool\":\"ferry-perf\",\n\"environment\":" << environment << ",\n";
  o << "\"command\":[";
  for (std::size_t i = 0; i < c.argv.size(); ++i) o << (i ? "," : "") << json_string(c.argv[i]);
  o << "],\n\"config\":{\"mode\":" << json_string(c.mode)
    << ",\"backend\":" << json_string(c.mode == "file" ? "file" : c.backend)
    << ",\"transport\":" << json_string(c.mode == "file" ? "io_uring" : c.backend == "ucx" ? c.transport
                                         : c.backend == "verbs" ? "rc" : "tcp")
    << ",\"op\":" << json_string(c.op) << ",\"workload\":" << json_string(c.workload)
    << ",\"block_sizes\":[";
  for (std::size_t i = 0; i < c.sizes.size(); ++i) o << (i ? "," : "") << c.sizes[i];
  o << "],\"batch\":" << c.batch << ",\"depth\":" << c.depth << ",\"threads\":" << c.threads
    << ",\"executor\":" << json_string(c.executor) << ",\"duration_s\":" << json_number(c.duration)
    << ",\"timeout_s\":" << json_number(c.timeout) << ",\"layers\":" << c.layers
    << ",\"requests\":" << c.requests << ",\"metrics\":" << (c.metrics ? "true" : "false")
    << ",\"connect\":" << json_string(c.connect) << ",\"path\":" << json_string(c.path)
    << ",\"direct\":" << (c.direct ? "true" : "false") << ",\"file_size\":" << c.file_size
    << ",\"check\":" << (c.check ? "true" : "false");
  if (c.backend == "ucx" && c.mode != "file") o << ",\"put_completion\":" << json_string(c.put_completion);
  if (c.backend == "verbs" && c.mode != "file") {
    o << ",\"device\":" << json_string(c.device) << ",\"gid_index\":" << c.gid_index;
  }
  o << "},\n";
  o << "\"results\":[";
  for (std::size_t i = 0; i < points.size(); ++i) {
    const point_result& p = points[i];
    o << (i ? ",\n" : "\n") << "{\"block_size\":" << p.block << ",\"seconds\":" << json_number(p.seconds)
      << ",\"ops\":" << p.ops << ",\"bytes\":" << p.bytes << ",\"mb_per_s\":" << json_number(p.mb_per_s())
      << ",\"ops_per_s\":" << json_number(p.ops_per_s())
      << ",\"cpu\":{\"initiator_process\":" << json_cpu(p.initiator_process)
      << ",\"initiator_threads\":" << json_cpu(p.initiator_threads)
      << ",\"initiator_us_per_op\":" << json_number(p.cpu_us_per_op(p.initiator_process));
    if (p.target_reported) {
      o << ",\"target_process\":" << json_cpu(p.target_process)
        << ",\"target_us_per_op\":" << json_number(p.cpu_us_per_op(p.target_process))
        << ",\"target_ops\":" << p.target_ops;
    }
    o << "}";
    if (!p.latency_us.empty()) {
      o << ",\"latency_us\":{\"samples\":" << p.latency_us.size()
        << ",\"min\":" << json_number(p.latency_us.front())
        << ",\"p50\":" << json_number(quantile(p.latency_us, 0.5))
        << ",\"p90\":" << json_number(quantile(p.latency_us, 0.9))
        << ",\"p99\":" << json_number(quantile(p.latency_us, 0.99))
        << ",\"p999\":" << json_number(quantile(p.latency_us, 0.999))
        << ",\"max\":" << json_number(p.latency_us.back()) << "}";
    }
    if (!p.step_us.empty()) {
      o << ",\"kv\":{\"steps\":" << p.step_us.size()
        << ",\"step_us_p50\":" << json_number(quantile(p.step_us, 0.5))
        << ",\"step_us_p99\":" << json_number(quantile(p.step_us, 0.99))
        << ",\"layer_ready_us_median\":" << json_array(p.layer_ready_us) << "}";
    }
    o << ",\"checked\":" << (p.checked ? "true" : "false");
    if (!p.error.empty()) o << ",\"error\":" << json_string(p.error);
    o << "}";
  }
  o << "\n],\n\"metrics\":" << metrics << "\n}\n";
  std::ofstream f(file);
  f << o.str();
  if (!f) throw std::runtime_error("cannot write " + file);
}

// ---- SVG: panels stacked one above the other, each a plot with its own axes and a legend column on
// its right:
//   throughput: MB/s against block size (every workload);
//   latency: percentile against latency, log scale, one line per block size (latency);
//   kv step time: p50 and p99 against block size (kv);
//   kv layers: the median time from a step's start until each layer was ready, against the layer's
//   index, one line per block size (kv).
// Failed runs are left out. A series of one point is drawn as a marker labelled with its value,
// never as a line of one point. Tick labels carry their unit, with as many digits as tell
// neighbouring ticks apart ("250 µs", "1.5 ms"), and the margins hold the longest of them.

inline std::string svg_escape(const std::string& s) {
  std::string out;
  for (char ch : s) {
    switch (ch) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      default: out += ch;
    }
  }
  return out;
}

// `v` with the decimals that a tick step of `step` needs (0.25 -> 2, 5 -> 0), trailing zeros
// dropped: ticks 0.5 apart read "1", "1.5", "2", every one distinct.
[[nodiscard]] inline std::string svg_number(double v, double step) {
  const int decimals = step > 0 ? std::clamp(static_cast<int>(std::ceil(-std::log10(step) - 1e-9)), 0, 9) : 0;
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, std::abs(v) < step / 2 ? 0.0 : v);
  std::string out = buf;
  if (out.find('.') != std::string::npos) {
    out.erase(out.find_last_not_of('0') + 1);
    if (out.back() == '.') out.pop_back();
  }
  return out;
}

// A time in µs in the unit that suits `scale_us` (the axis's largest value): ns, µs, ms or s.
struct time_unit {
  double us;  // µs per unit
  const char* name;
};
[[nodiscard]] inline time_unit time_unit_for(double scale_us) {
  if (scale_us < 1) return {1e-3, "ns"};
  if (scale_us < 1e3) return {1, "\u00b5s"};
  if (scale_us < 1e6) return {1e3, "ms"};
  return {1e6, "s"};
}

// A value to three significant digits, with its unit: "12.3 µs", "1.05 ms", "873 MB/s".
[[nodiscard]] inline std::string svg_value(double v, const std::string& unit) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.3g", v);
  return std::string(buf) + " " + unit;
}
[[nodiscard]] inline std::string svg_time(double us) {
  const time_unit u = time_unit_for(us);
  return svg_value(us / u.us, u.name);
}
[[nodiscard]] inline std::string svg_rate(double mb) {
  return mb >= 1e4 ? svg_value(mb / 1e3, "GB/s") : svg_value(mb, "MB/s");
}

// 1, 2 or 5 times a power of ten: about `count` steps across `span`.
[[nodiscard]] inline double nice_step(double span, int count) {
  if (!(span > 0)) return 1;
  const double raw = span / count;
  const double mag = std::pow(10, std::floor(std::log10(raw)));
  const double norm = raw / mag;
  return (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag;
}

struct svg_tick {
  double at;  // in the axis's coordinates
  std::string label;
};

// An axis: what its coordinates run over, its ticks, and what it measures. `kind` goes into the SVG
// (data-axis) for checkers: "size", "index", "time", "rate", "percent".
struct svg_axis {
  double lo = 0;
  double hi = 1;
  std::vector<svg_tick> ticks;
  std::string label;
  std::string kind;
};

// From 0 to a round value above `max`, ticks labelled by `label(value, step)`.
template <class Label>
[[nodiscard]] svg_axis linear_axis(double max, std::string text, std::string kind, Label label) {
  svg_axis a;
  a.label = std::move(text);
  a.kind = std::move(kind);
  if (!(max > 0)) max = 1;
  const double step = nice_step(max, 4);
  a.hi = std::ceil(max * 1.05 / step) * step;
  for (int i = 0; i * step <= a.hi * (1 + 1e-9); ++i) a.ticks.push_back({i * step, label(i * step, step)});
  return a;
}

[[nodiscard]] inline svg_axis time_axis(double max_us, const std::string& text) {
  const time_unit u = time_unit_for(max_us * 1.05);
  return linear_axis(max_us, text, "time", [&](double v, double step) {
    return svg_number(v / u.us, step / u.us) + " " + u.name;
  });
}

[[nodiscard]] inline svg_axis rate_axis(double max_mb) {
  const bool giga = max_mb * 1.05 >= 1e4;
  return linear_axis(max_mb, "bandwidth", "rate", [&](double v, double step) {
    return giga ? svg_number(v / 1e3, step / 1e3) + " GB/s" : svg_number(v, step) + " MB/s";
  });
}

// Block sizes on a log2 axis, a tick at each; one size sits in the middle.
[[nodiscard]] inline svg_axis size_axis(const std::vector<std::size_t>& sizes) {
  svg_axis a;
  a.label = "block size";
  a.kind = "size";
  double lo = 1e300, hi = -1e300;
  for (std::size_t b : sizes) {
    lo = std::min(lo, std::log2(static_cast<double>(b)));
    hi = std::max(hi, std::log2(static_cast<double>(b)));
    a.ticks.push_back({std::log2(static_cast<double>(b)), size_name(b)});
  }
  const double pad = hi > lo ? (hi - lo) * 0.05 : 1;
  a.lo = lo - pad;
  a.hi = hi + pad;
  return a;
}

// Layers 0 .. n-1, each a tick up to 16 layers, round steps beyond.
[[nodiscard]] inline svg_axis layer_axis(std::size_t n) {
  svg_axis a;
  a.label = "layer";
  a.kind = "index";
  a.lo = -0.5;
  a.hi = static_cast<double>(n) - 0.5;
  const double step = n <= 16 ? 1 : std::max(1.0, nice_step(static_cast<double>(n), 8));
  for (double l = 0; l < static_cast<double>(n); l += step) a.ticks.push_back({l, svg_number(l, 1)});
  return a;
}

// log10 of the latency in µs; decades, and 2 and 5 within them when the axis spans two decades or
// fewer.
[[nodiscard]] inline svg_axis latency_axis(double lo_us, double hi_us) {
  svg_axis a;
  a.label = "latency, completion to resume (log scale)";
  a.kind = "time";
  a.lo = std::floor(std::log10(std::max(lo_us, 1e-3)));
  a.hi = std::ceil(std::log10(std::max(hi_us, lo_us * 1.01)));
  if (a.hi <= a.lo) a.hi = a.lo + 1;
  const bool fine = a.hi - a.lo <= 2;
  for (double d = a.lo; d <= a.hi; d += 1) {
    for (double m : {1.0, 2.0, 5.0}) {
      if (m != 1 && !fine) continue;
      const double v = m * std::pow(10, d);
      if (std::log10(v) > a.hi + 1e-9) continue;
      const time_unit u = time_unit_for(v * 1.0001);
      a.ticks.push_back({std::log10(v), svg_number(v / u.us, v / u.us) + " " + u.name});
    }
  }
  return a;
}

struct svg_series {
  std::string name;
  std::vector<std::pair<double, double>> points;  // in the axes' coordinates
  std::string point_label;                        // a series of one point: its value, beside it
};

class svg_document {
 public:
  static constexpr double width = 900;
  static constexpr double left = 110;   // y tick labels up to 14 characters, then the axis label
  static constexpr double plot_w = 560;
  static constexpr double legend_x = left + plot_w + 16;
  static constexpr double panel_h = 330;
  static constexpr double panel_top = 44;  // the panel's title above its plot
  static constexpr double plot_h = 220;
  static constexpr double header = 36;

  explicit svg_document(std::string title) : title_(std::move(title)) {}

  void note(const std::string& text) {
    const double y = header + panels_ * panel_h + 40;
    body_ << "<text x=\"" << width / 2 << "\" y=\"" << y << "\" text-anchor=\"middle\">" << svg_escape(text)
          << "</text>\n";
    ++panels_;
  }

  void panel(const std::string& title, const svg_axis& x, const svg_axis& y, const std::vector<svg_series>& series) {
    static const char* colours[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"};
    const double top = header + panels_ * panel_h + panel_top;
    auto px = [&](double v) { return left + (v - x.lo) / (x.hi - x.lo) * plot_w; };
    auto py = [&](double v) { return top + plot_h - (v - y.lo) / (y.hi - y.lo) * plot_h; };
    body_ << "<g class=\"panel\">\n<text class=\"panel-title\" x=\"" << left << "\" y=\"" << top - 14
          << "\" font-size=\"13\" font-weight=\"bold\">" << svg_escape(title) << "</text>\n"
          << "<rect x=\"" << left << "\" y=\"" << top << "\" width=\"" << plot_w << "\" height=\"" << plot_h
          << "\" fill=\"none\" stroke=\"black\"/>\n";
    for (const svg_tick& t : y.ticks) {
      body_ << "<line x1=\"" << left << "\" x2=\"" << left + plot_w << "\" y1=\"" << py(t.at) << "\" y2=\""
            << py(t.at) << "\" stroke=\"#ddd\"/>\n<text class=\"tick\" data-axis=\"" << y.kind << "\" x=\""
            << left - 8 << "\" y=\"" << py(t.at) + 4 << "\" text-anchor=\"end\">" << svg_escape(t.label)
            << "</text>\n";
    }
    for (const svg_tick& t : x.ticks) {
      body_ << "<line x1=\"" << px(t.at) << "\" x2=\"" << px(t.at) << "\" y1=\"" << top + plot_h << "\" y2=\""
            << top + plot_h + 4 << "\" stroke=\"black\"/>\n<text class=\"tick\" data-axis=\"" << x.kind
            << "\" x=\"" << px(t.at) << "\" y=\"" << top + plot_h + 18 << "\" text-anchor=\"middle\">"
            << svg_escape(t.label) << "</text>\n";
    }
    body_ << "<text x=\"" << left + plot_w / 2 << "\" y=\"" << top + plot_h + 40
          << "\" text-anchor=\"middle\">" << svg_escape(x.label) << "</text>\n"
          << "<text x=\"18\" y=\"" << top + plot_h / 2 << "\" text-anchor=\"middle\" transform=\"rotate(-90 18 "
          << top + plot_h / 2 << ")\">" << svg_escape(y.label) << "</text>\n";
    std::size_t k = 0;
    for (const svg_series& s : series) {
      if (s.points.empty()) continue;
      const char* colour = colours[k % 6];
      if (s.points.size() >= 2) {
        body_ << "<polyline fill=\"none\" stroke=\"" << colour << "\" stroke-width=\"2\" points=\"";
        for (const auto& [vx, vy] : s.points) body_ << px(vx) << ',' << py(vy) << ' ';
        body_ << "\"/>\n";
      }
      // Markers where the points are few enough to tell apart; a lone point is only a marker.
      if (s.points.size() <= 64) {
        for (const auto& [vx, vy] : s.points) {
          body_ << "<circle cx=\"" << px(vx) << "\" cy=\"" << py(vy) << "\" r=\"" << (s.points.size() == 1 ? 5 : 3)
                << "\" fill=\"" << colour << "\"/>\n";
        }
      }
      if (s.points.size() == 1 && !s.point_label.empty()) {
        const auto [vx, vy] = s.points.front();
        const bool right_half = px(vx) > left + plot_w / 2;
        body_ << "<text x=\"" << px(vx) + (right_half ? -9 : 9) << "\" y=\"" << py(vy) - 8 << "\" text-anchor=\""
              << (right_half ? "end" : "start") << "\" fill=\"" << colour << "\">" << svg_escape(s.point_label)
              << "</text>\n";
      }
      body_ << "<text class=\"legend\" x=\"" << legend_x << "\" y=\"" << top + 12 + 16 * static_cast<double>(k)
            << "\" font-size=\"11\" fill=\"" << colour << "\">" << svg_escape(s.name) << "</text>\n";
      ++k;
    }
    body_ << "</g>\n";
    ++panels_;
  }

  [[nodiscard]] std::string text() const {
    const double height = header + std::max<std::size_t>(panels_, 1) * panel_h;
    std::ostringstream o;
    o << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
      << "\" viewBox=\"0 0 " << width << ' ' << height << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << width / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"14\">" << svg_escape(title_)
      << "</text>\n"
      << body_.str() << "</svg>\n";
    return o.str();
  }

 private:
  std::string title_;
  std::ostringstream body_;
  std::size_t panels_ = 0;
};

inline void write_svg(const std::string& file, const config& c, const std::vector<point_result>& points) {
  std::vector<const point_result*> ok;
  for (const auto& p : points) {
    if (p.error.empty() && p.ops > 0) ok.push_back(&p);
  }
  std::string shape = c.workload == "kv" ? std::to_string(c.layers) + " layers \u00d7 " + std::to_string(c.requests) +
                                               " requests \u00d7 batch " + std::to_string(c.batch)
                                         : "batch " + std::to_string(c.batch) + ", depth " + std::to_string(c.depth);
  svg_document doc("ferry-perf " + c.mode + " " + (c.mode == "file" ? "file" : c.backend) + " " + c.op + " (" +
                   c.workload + ", " + shape + ", threads " + std::to_string(c.threads) + ")");
  if (ok.empty()) {
    doc.note("no block size's run succeeded: nothing to plot");
  } else {
    std::vector<std::size_t> sizes;
    for (const point_result* p : ok) sizes.push_back(p->block);
    const svg_axis by_size = size_axis(sizes);

    double max_mb = 0;
    svg_series bandwidth{"bandwidth", {}, {}};
    for (const point_result* p : ok) {
      max_mb = std::max(max_mb, p->mb_per_s());
      bandwidth.points.emplace_back(std::log2(static_cast<double>(p->block)), p->mb_per_s());
    }
    bandwidth.point_label = size_name(ok.front()->block) + ": " + svg_rate(ok.front()->mb_per_s());
    doc.panel("Throughput (1 MB/s = 10\u2076 bytes per second)", by_size, rate_axis(max_mb), {bandwidth});

    // Percentile (y) against latency (x, log10 µs), one line per block size, at most 400 points each.
    double lo = 1e300, hi = 0;
    std::vector<svg_series> latency;
    for (const point_result* p : ok) {
      if (p->latency_us.empty()) continue;
      lo = std::min(lo, p->latency_us.front());
      hi = std::max(hi, p->latency_us.back());
      svg_series s{size_name(p->block) + ": p50 " + svg_time(quantile(p->latency_us, 0.5)) + ", p99 " +
                       svg_time(quantile(p->latency_us, 0.99)),
                   {}, {}};
      const std::size_t n = p->latency_us.size();
      const std::size_t step = std::max<std::size_t>(1, n / 400);
      auto lx = [](double us) { return std::log10(std::max(us, 1e-3)); };
      for (std::size_t i = 0; i < n; i += step) {
        s.points.emplace_back(lx(p->latency_us[i]), 100.0 * static_cast<double>(i + 1) / static_cast<double>(n));
      }
      if (n > 1) s.points.emplace_back(lx(p->latency_us.back()), 100.0);
      s.point_label = svg_time(p->latency_us.front());
      latency.push_back(std::move(s));
    }
    if (!latency.empty()) {
      svg_axis pct;
      pct.label = "percentile";
      pct.kind = "percent";
      pct.lo = 0;
      pct.hi = 100;
      for (int i = 0; i <= 4; ++i) pct.ticks.push_back({25.0 * i, std::to_string(25 * i)});
      doc.panel("Latency distribution", latency_axis(lo, hi), pct, latency);
    }

    if (c.workload == "kv") {
      svg_series p50{"step time p50", {}, {}}, p99{"step time p99", {}, {}};
      double max_step = 0, max_ready = 0;
      std::vector<svg_series> ready;
      std::size_t layers = 0;
      for (const point_result* p : ok) {
        if (p->step_us.empty()) continue;
        const double x = std::log2(static_cast<double>(p->block));
        p50.points.emplace_back(x, quantile(p->step_us, 0.5));
        p99.points.emplace_back(x, quantile(p->step_us, 0.99));
        max_step = std::max(max_step, quantile(p->step_us, 0.99));
        svg_series r{size_name(p->block), {}, {}};
        for (std::size_t l = 0; l < p->layer_ready_us.size(); ++l) {
          r.points.emplace_back(static_cast<double>(l), p->layer_ready_us[l]);
          max_ready = std::max(max_ready, p->layer_ready_us[l]);
        }
        if (!r.points.empty()) r.point_label = svg_time(r.points.front().second);
        layers = std::max(layers, p->layer_ready_us.size());
        ready.push_back(std::move(r));
      }
      if (!p50.points.empty()) {
        p50.point_label = "p50 " + svg_time(p50.points.front().second);
        p99.point_label = "p99 " + svg_time(p99.points.front().second);
        doc.panel("kv step time (all layers of a step ready)", by_size, time_axis(max_step, "step time"), {p50, p99});
      }
      if (layers > 0) {
        doc.panel("kv layers: median time from the step's start until the layer was ready", layer_axis(layers),
                  time_axis(max_ready, "ready after"), ready);
      }
    }
  }
  std::ofstream f(file);
  f << doc.text();
  if (!f) throw std::runtime_error("cannot write " + file);
}

}  // namespace ferry_perf
