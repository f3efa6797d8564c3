#pragma once
// The GPU copy backend on the runtime this build targets: the HIP runtime (AMD), or the CUDA
// runtime where FERRY_HIP_CUDA is defined (NVIDIA; Meson defines it when it builds against the
// CUDA toolkit). The same backend runs on the in-process fake of ferry/hip/fake.hpp for tests:
// basic_copy_engine<fake::runtime>.

#include "ferry/hip/copy_engine.hpp"
#include "ferry/hip/copy_kind.hpp"

#if defined(FERRY_HIP_CUDA)
#include "ferry/hip/cuda_runtime.hpp"
namespace ferry::hip {
using gpu_runtime = cuda_runtime;
}  // namespace ferry::hip
#else
#include "ferry/hip/runtime.hpp"
namespace ferry::hip {
using gpu_runtime = hip_runtime;
}  // namespace ferry::hip
#endif

namespace ferry::hip {

using copy_engine = basic_copy_engine<gpu_runtime>;

}  // namespace ferry::hip
