#pragma once
// The directories as the Python module holds them (directory.cpp binds them; ucx.cpp's NamedPeer
// takes one): the executor they run on, kept until the directory is gone, and close() that takes
// the directory down (withdrawing what it publishes) with the GIL released.

#include <memory>
#include <system_error>

#include "common.hpp"
#include "ferry/directory.hpp"
#ifdef FERRY_PYTHON_ETCD
#include "ferry/directory/etcd.hpp"
#endif

namespace ferry::python {

struct py_directory {
  std::shared_ptr<progress_executor> exec;  // outlives the directory
  directory* dir = nullptr;                 // null once closed

  py_directory() = default;
  py_directory(const py_directory&) = delete;
  py_directory& operator=(const py_directory&) = delete;
  virtual ~py_directory() = default;

  directory& get() {
    if (dir == nullptr) {
      throw std::system_error(make_error_code(directory_errc::closed),
                              "ferry.directory: the directory was closed");
    }
    return *dir;
  }
  void close() {
    if (dir == nullptr) return;
    dir = nullptr;
    py::gil_scoped_release released;
    destroy();
  }

 protected:
  virtual void destroy() = 0;
};

struct py_local_directory final : py_directory {
  std::unique_ptr<local_directory> local;
  ~py_local_directory() override { close(); }
  void destroy() override { local.reset(); }
};

#ifdef FERRY_PYTHON_ETCD
struct py_etcd_directory final : py_directory {
  std::unique_ptr<etcd_directory> etcd;
  ~py_etcd_directory() override { close(); }
  void destroy() override { etcd.reset(); }
};
#endif

}  // namespace ferry::python
