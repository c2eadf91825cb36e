// The extension's own kernels (kernels.cu): PTX compiled at build time,
// embedded, and loaded once per process with cudaLibraryLoadData through the
// CUDA runtime JAX loaded (context independent; the driver JIT-compiles the
// PTX for each device on first use). Nothing CUDA is linked.
#ifndef JAX_CP_CSRC_DEVICE_KERNELS_H_
#define JAX_CP_CSRC_DEVICE_KERNELS_H_

#include <cuda_runtime_api.h>

#include <string>

#include "cuda_libs.h"
#include "xla/ffi/api/ffi.h"

namespace jax_cp {

// Dtype index of the typed kernels: 0 float32, 1 bfloat16, 2 float16.
constexpr int kKernelDtypes = 3;

struct DeviceKernels {
  // jax_cp_merge_{add,max}_{f32,bf16,f16}[_vec]: [dtype][op][vectorised].
  cudaKernel_t merge[kKernelDtypes][2][2] = {};
  cudaKernel_t clear_uncovered_rows = nullptr;
  cudaKernel_t ragged_offsets = nullptr;
  std::string error;  // empty when every kernel was found
};

// Loads the module on the first call that succeeds (never unloaded; a
// failed load is tried again by the next call); check `error`.
const DeviceKernels& LoadDeviceKernels(const CudaLibraries& libs);

// Launches `kernel` on `stream` with `device` current; `what` names the
// caller in errors.
xla::ffi::Error LaunchDeviceKernel(const CudaLibraries& libs, int device,
                                   cudaKernel_t kernel, dim3 grid, dim3 block,
                                   void** args, cudaStream_t stream,
                                   const std::string& what);

}  // namespace jax_cp

#endif  // JAX_CP_CSRC_DEVICE_KERNELS_H_
