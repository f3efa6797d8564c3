// ferry._ferry: the compiled part of the `ferry` Python package (python/ferry/__init__.py adds the
// asyncio glue and re-exports everything).

#include "common.hpp"

PYBIND11_MODULE(_ferry, m) {
  namespace fp = ferry::python;
  m.doc() = "ferry: awaitable bulk transfers for Python inference servers";
  fp::add_core(m);
  fp::add_asyncio(m);
  fp::add_testing(m);
  fp::add_kv(m);
  fp::add_directory(m);
  fp::add_bench(m);
#ifdef FERRY_PYTHON_URING
  fp::add_uring(m);
  m.attr("HAS_URING") = true;
#else
  m.attr("HAS_URING") = false;
#endif
#ifdef FERRY_PYTHON_UCX
  fp::add_ucx(m);
  m.attr("HAS_UCX") = true;
#else
  m.attr("HAS_UCX") = false;
#endif
}
