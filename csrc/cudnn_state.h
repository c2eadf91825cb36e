// Per-device cuDNN handles and small CUDA helpers shared by the handlers.
#ifndef JAX_CP_CSRC_CUDNN_STATE_H_
#define JAX_CP_CSRC_CUDNN_STATE_H_

#include <cuda_runtime_api.h>
#include <cudnn.h>

#include <cstddef>
#include <functional>
#include <mutex>
#include <string>

#include "cuda_libs.h"
#include "xla/ffi/api/ffi.h"

namespace jax_cp {

// One cuDNN handle per device ordinal, created on first use and kept for the
// life of the process (never destroyed: destruction order at exit is not ours
// to control). `mu` serialises cudnnSetStream + execute on the handle, since a
// handle holds one stream at a time.
struct DeviceCudnn {
  int device = -1;
  cudnnHandle_t handle = nullptr;
  std::mutex mu;
};

// Returns the state for `device`, creating its handle the first time (with
// `device` made current while cudnnCreate runs).
xla::ffi::ErrorOr<DeviceCudnn*> GetDeviceCudnn(const CudaLibraries& libs,
                                               int device);

// Runs `fn` with `device` as the current CUDA device, restoring the previous
// one afterwards. cuDNN handle creation and graph building read the current
// device (compute capability, which engines exist).
xla::ffi::Error WithCudaDevice(const CudaLibraries& libs, int device,
                               const std::function<xla::ffi::Error()>& fn);

}  // namespace jax_cp

#endif  // JAX_CP_CSRC_CUDNN_STATE_H_
