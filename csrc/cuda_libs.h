// Run-time access to the CUDA runtime and cuDNN libraries that JAX loaded.
//
// The extension links neither libcudart nor libcudnn. Both are resolved with
// dlopen/dlsym on first use, preferring the copy already in the process
// (RTLD_NOLOAD by soname: JAX's CUDA plugin loads them before any custom call
// runs), so the process never holds a second copy of either library. The
// cuDNN frontend is compiled with NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING and
// reaches cuDNN through the same handle (cudnn_frontend::cudnn_dlhandle).
#ifndef JAX_CP_CSRC_CUDA_LIBS_H_
#define JAX_CP_CSRC_CUDA_LIBS_H_

#include <cuda_runtime_api.h>
#include <cudnn.h>

#include <cstddef>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_cp {

// The few CUDA runtime entry points this extension calls itself.
struct CudaRuntimeApi {
  cudaError_t (*GetDevice)(int*);
  cudaError_t (*SetDevice)(int);
  const char* (*GetErrorString)(cudaError_t);
  const char* (*GetErrorName)(cudaError_t);
  // Free and total memory of the current device (read after a failed
  // cudnnCreate, to retry only once memory was freed; cudnn_state.cc).
  cudaError_t (*MemGetInfo)(size_t*, size_t*);
  // Loading and launching the embedded kernels (device_kernels.cc).
  cudaError_t (*LibraryLoadData)(cudaLibrary_t*, const void*, cudaJitOption*,
                                 void**, unsigned int, cudaLibraryOption*,
                                 void**, unsigned int);
  cudaError_t (*LibraryGetKernel)(cudaKernel_t*, cudaLibrary_t, const char*);
  cudaError_t (*LaunchKernel)(const void*, dim3, dim3, void**, size_t,
                              cudaStream_t);
};

// The few cuDNN entry points this extension calls itself (graph building and
// execution go through the frontend).
struct CudnnApi {
  cudnnStatus_t (*Create)(cudnnHandle_t*);
  cudnnStatus_t (*SetStream)(cudnnHandle_t, cudaStream_t);
  const char* (*GetErrorString)(cudnnStatus_t);
  size_t (*GetVersion)();
};

struct CudaLibraries {
  CudaRuntimeApi cudart;
  CudnnApi cudnn;
};

// Loads both libraries once per process (thread-safe) and points the cuDNN
// frontend at cuDNN. Every later call returns the same result, including a
// load failure, whose message says which library or symbol is missing.
xla::ffi::ErrorOr<const CudaLibraries*> GetCudaLibraries();

// "cudaErrorMemoryAllocation (out of memory)": the error's name and its
// description.
std::string CudaErrorText(const CudaLibraries& libs, cudaError_t st);

// The soname of the CUDA runtime these headers belong to ("libcudart.so.13").
const char* CudaRuntimeSoname();

// Makes the cuDNN frontend open the same CUDA runtime as JAX. The frontend
// tries libcudart.so.12 before libcudart.so.13 unless the environment variable
// CUDNN_FRONTEND_CUDART_LIB_NAME names one; this sets that variable to
// CudaRuntimeSoname() when the user has not set it. Called once at import.
void PinFrontendCudaRuntime();

}  // namespace jax_cp

#endif  // JAX_CP_CSRC_CUDA_LIBS_H_
