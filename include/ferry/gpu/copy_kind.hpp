#pragma once
// Which memories a GPU copy moves between.

namespace ferry::gpu {

/// Which memories a GPU copy moves between (basic_copy_engine::copy).
enum class copy_kind {
  device_to_device,  ///< within one GPU
  peer,              ///< between two GPUs (unified addressing finds them)
  host_to_device,    ///< from host memory (pinned, for a truly asynchronous copy) to a GPU
  device_to_host,    ///< from a GPU to host memory
};

}  // namespace ferry::gpu

namespace ferry {
// The backend's earlier name (it covers the CUDA runtime too): ferry::hip:: names the same things.
namespace hip = gpu;
}  // namespace ferry
