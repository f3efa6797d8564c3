#pragma once
// The GPU copy backend and the layer gate on the runtime this build targets: the HIP runtime (AMD), or the CUDA
// runtime where FERRY_GPU_CUDA is defined (NVIDIA; Meson defines it when it builds against the
// CUDA toolkit). The same backend runs on the in-process fake of ferry/testing/fake_gpu.hpp for tests:
// basic_copy_engine<fake::runtime>.

#include "ferry/detail/config.hpp"
#include "ferry/gpu/copy_engine.hpp"
#include "ferry/gpu/copy_kind.hpp"
#include "ferry/gpu/layer_gate.hpp"

#if defined(FERRY_GPU_CUDA)
#include "ferry/gpu/cuda_runtime.hpp"
namespace ferry::gpu {
/// The GPU runtime this build targets: cuda_runtime where FERRY_GPU_CUDA is defined.
using gpu_runtime = cuda_runtime;
}  // namespace ferry::gpu
#else
#include "ferry/gpu/hip_runtime.hpp"
namespace ferry::gpu {
/// The GPU runtime this build targets: hip_runtime (AMD), or cuda_runtime with FERRY_GPU_CUDA.
using gpu_runtime = hip_runtime;
}  // namespace ferry::gpu
#endif

namespace ferry::gpu {

/// The GPU copy backend on this build's runtime (gpu_runtime).
using copy_engine = basic_copy_engine<gpu_runtime>;
/// The layer gate on this build's runtime (gpu_runtime).
using layer_gate = basic_layer_gate<gpu_runtime>;

}  // namespace ferry::gpu
