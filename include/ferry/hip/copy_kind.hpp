#pragma once
// Which memories a GPU copy moves between.

namespace ferry::hip {

enum class copy_kind {
  device_to_device,  // within one GPU
  peer,              // between two GPUs (unified addressing finds them)
  host_to_device,
  device_to_host,
};

}  // namespace ferry::hip
