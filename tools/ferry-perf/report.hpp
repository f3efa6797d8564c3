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
    << ",\"direct\":" << (c.direct ? "true" : "false") << ",\"file_size\":" << c.file_size;
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
    if (!p.error.empty()) o << ",\"error\":" << json_string(p.error);
    o << "}";
  }
  o << "\n],\n\"metrics\":" << metrics << "\n}\n";
  std::ofstream f(file);
  f << o.str();
  if (!f) throw std::runtime_error("cannot write " + file);
}

// ---- SVG: two panels, bandwidth against block size (log2 axis) and the latency distribution
// (percentile against latency, log axis) where the run measured latencies.

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

inline void write_svg(const std::string& file, const config& c, const std::vector<point_result>& points) {
  const double w = 720, h = 360, left = 80, right = 20, top = 40, bottom = 60;
  const double pw = w - left - right, ph = h - top - bottom;
  bool any_latency = false;
  for (const auto& p : points) any_latency = any_latency || !p.latency_us.empty();
  const double total_h = any_latency ? 2 * h : h;
  std::ostringstream o;
  o << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
    << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << w << "\" height=\"" << total_h
    << "\" viewBox=\"0 0 " << w << ' ' << total_h << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
    << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  const std::string title = "ferry-perf " + c.mode + " " + (c.mode == "file" ? "file" : c.backend) +
                            " " + c.op + " (" + c.workload + ", batch " + std::to_string(c.batch) +
                            ", depth " + std::to_string(c.depth) + ", threads " +
                            std::to_string(c.threads) + ")";
  o << "<text x=\"" << w / 2 << "\" y=\"20\" text-anchor=\"middle\" font-size=\"14\">"
    << svg_escape(title) << "</text>\n";

  // Panel 1.
  double max_mb = 1;
  for (const auto& p : points) max_mb = std::max(max_mb, p.mb_per_s());
  max_mb *= 1.1;
  const double lx0 = std::log2(static_cast<double>(points.empty() ? 1 : points.front().block));
  double lx1 = std::log2(static_cast<double>(points.empty() ? 2 : points.back().block));
  if (lx1 <= lx0) lx1 = lx0 + 1;
  auto px = [&](std::size_t b) {
    return left + (std::log2(static_cast<double>(b)) - lx0) / (lx1 - lx0) * pw;
  };
  auto py = [&](double mb) { return top + ph - mb / max_mb * ph; };
  o << "<g>\n<rect x=\"" << left << "\" y=\"" << top << "\" width=\"" << pw << "\" height=\"" << ph
    << "\" fill=\"none\" stroke=\"black\"/>\n";
  for (int i = 0; i <= 4; ++i) {
    const double v = max_mb * i / 4;
    o << "<line x1=\"" << left << "\" x2=\"" << left + pw << "\" y1=\"" << py(v) << "\" y2=\"" << py(v)
      << "\" stroke=\"#ddd\"/>\n<text x=\"" << left - 6 << "\" y=\"" << py(v) + 4
      << "\" text-anchor=\"end\">" << json_number(std::round(v)) << "</text>\n";
  }
  for (const auto& p : points) {
    o << "<text x=\"" << px(p.block) << "\" y=\"" << top + ph + 16 << "\" text-anchor=\"middle\">"
      << size_name(p.block) << "</text>\n";
  }
  o << "<text x=\"" << left + pw / 2 << "\" y=\"" << top + ph + 40
    << "\" text-anchor=\"middle\">block size</text>\n"
    << "<text x=\"16\" y=\"" << top + ph / 2 << "\" text-anchor=\"middle\" transform=\"rotate(-90 16 "
    << top + ph / 2 << ")\">MB/s</text>\n";
  if (!points.empty()) {
    o << "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"2\" points=\"";
    for (const auto& p : points) o << px(p.block) << ',' << py(p.mb_per_s()) << ' ';
    o << "\"/>\n";
    for (const auto& p : points) {
      o << "<circle cx=\"" << px(p.block) << "\" cy=\"" << py(p.mb_per_s())
        << "\" r=\"3\" fill=\"#1f77b4\"><title>" << size_name(p.block) << ": "
        << json_number(p.mb_per_s()) << " MB/s</title></circle>\n";
    }
  }
  o << "</g>\n";

  // Panel 2: percentile (y, 0-100) against latency (x, log10 us), one line per block size.
  if (any_latency) {
    const double t2 = h + top;
    double lo = 1e300, hi = 0;
    for (const auto& p : points) {
      if (p.latency_us.empty()) continue;
      lo = std::min(lo, std::max(0.01, p.latency_us.front()));
      hi = std::max(hi, p.latency_us.back());
    }
    double l0 = std::floor(std::log10(lo)), l1 = std::ceil(std::log10(std::max(hi, lo * 1.01)));
    if (l1 <= l0) l1 = l0 + 1;
    auto qx = [&](double us) { return left + (std::log10(std::max(us, 0.01)) - l0) / (l1 - l0) * pw; };
    auto qy = [&](double pct) { return t2 + ph - pct / 100 * ph; };
    o << "<g>\n<rect x=\"" << left << "\" y=\"" << t2 << "\" width=\"" << pw << "\" height=\"" << ph
      << "\" fill=\"none\" stroke=\"black\"/>\n";
    for (double d = l0; d <= l1; d += 1) {
      o << "<text x=\"" << qx(std::pow(10, d)) << "\" y=\"" << t2 + ph + 16
        << "\" text-anchor=\"middle\">" << json_number(std::pow(10, d)) << "</text>\n";
    }
    for (int i = 0; i <= 4; ++i) {
      o << "<text x=\"" << left - 6 << "\" y=\"" << qy(25.0 * i) + 4 << "\" text-anchor=\"end\">"
        << 25 * i << "</text>\n";
    }
    o << "<text x=\"" << left + pw / 2 << "\" y=\"" << t2 + ph + 40
      << "\" text-anchor=\"middle\">latency, completion to resume (us, log scale)</text>\n"
      << "<text x=\"16\" y=\"" << t2 + ph / 2 << "\" text-anchor=\"middle\" transform=\"rotate(-90 16 "
      << t2 + ph / 2 << ")\">percentile</text>\n";
    const char* colours[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"};
    std::size_t line = 0;
    for (const auto& p : points) {
      if (p.latency_us.empty()) continue;
      const char* colour = colours[line++ % 6];
      o << "<polyline fill=\"none\" stroke=\"" << colour << "\" stroke-width=\"1.5\" points=\"";
      const std::size_t n = p.latency_us.size();
      const std::size_t step = std::max<std::size_t>(1, n / 400);
      for (std::size_t i = 0; i < n; i += step) {
        o << qx(p.latency_us[i]) << ',' << qy(100.0 * static_cast<double>(i + 1) / static_cast<double>(n)) << ' ';
      }
      o << qx(p.latency_us.back()) << ',' << qy(100) << "\"/>\n";
      o << "<text x=\"" << left + 8 << "\" y=\"" << t2 + 16 * static_cast<double>(line) << "\" fill=\""
        << colour << "\">" << size_name(p.block) << ": p50 " << json_number(quantile(p.latency_us, 0.5))
        << " us, p99 " << json_number(quantile(p.latency_us, 0.99)) << " us</text>\n";
    }
    o << "</g>\n";
  }
  o << "</svg>\n";
  std::ofstream f(file);
  f << o.str();
  if (!f) throw std::runtime_error("cannot write " + file);
}

}  // namespace ferry_perf
