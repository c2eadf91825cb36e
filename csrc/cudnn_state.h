// Per-device cuDNN handles and small CUDA helpers shared by the handlers.
#ifndef JAX_CP_CSRC_CUDNN_STATE_H_
#define JAX_CP_CSRC_CUDNN_STATE_H_

#include <cuda_runtime_api.h>
#include <cudnn.h>

#include <cstddef>
#include <functional>
#include <map>
#include <mutex>
#include <string>

#include "cuda_libs.h"
#include "xla/ffi/api/ffi.h"

namespace jax_cp {

// One cuDNN handle per device ordinal, created on first use and kept for the
// life of the process (never destroyed: destruction order at exit is not ours
// to control; the registry never erases an entry, so a DeviceCudnn* stays
// valid). `mu` serialises every use of the handle: graph building
// (sdpa_graph.cc BuildGraph) and cudnnSetStream + execute, since a handle
// holds one stream at a time.
struct DeviceCudnn {
  int device = -1;
  cudnnHandle_t handle = nullptr;
  std::mutex mu;
};

// Returns the state for `device`, creating its handle the first time (with
// `device` made current while cudnnCreate runs).
//
// A failed cudnnCreate is remembered per device: later calls return an error
// at once ("cudnnCreate failed earlier on device N ...") without calling
// cudnnCreate again, because cuDNN's failure path (seen under memory
// pressure) is not safe to run over and over. Creation is retried
//   * when the device's free memory (cudaMemGetInfo) has grown by at least
//     kHandleRetryFreeBytes since the failure (checked on each call that
//     finds the failure; cheap, and only on the failing path), or
//   * after ResetFailedCudnnHandles().
xla::ffi::ErrorOr<DeviceCudnn*> GetDeviceCudnn(const CudaLibraries& libs,
                                               int device);

// How much more free device memory than at the failure makes GetDeviceCudnn
// retry a failed cudnnCreate by itself.
constexpr size_t kHandleRetryFreeBytes = size_t{64} << 20;

// Forgets every remembered cudnnCreate failure, so the next call on each
// such device tries again. Returns how many were forgotten. Handles that
// were created are kept.
int ResetFailedCudnnHandles();

// {device: message of its remembered cudnnCreate failure}.
std::map<int, std::string> FailedCudnnHandles();

// Runs `fn` with `device` as the current CUDA device, restoring the previous
// one afterwards. cuDNN handle creation and graph building read the current
// device (compute capability, which engines exist).
xla::ffi::Error WithCudaDevice(const CudaLibraries& libs, int device,
                               const std::function<xla::ffi::Error()>& fn);

}  // namespace jax_cp

#endif  // JAX_CP_CSRC_CUDNN_STATE_H_
