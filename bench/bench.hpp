#pragma once

namespace ferry_bench {

struct options {
  bool quick = false;
};

void run_latency(const options& opt);
void run_when_all(const options& opt);
void run_throughput(const options& opt);
void run_uring(const options& opt);        // only where liburing was found
void run_uring_depth(const options& opt);  // likewise; only when asked for by name
void run_tcp(const options& opt);
void run_metrics(const options& opt);      // likewise
void run_kv(const options& opt);
void run_verbs(const options& opt);           // only where libibverbs was found
void run_verbs_hardware(const options& opt);  // skips where there is no RDMA device

}  // namespace ferry_bench
