#include "cudnn_state.h"

#include <map>
#include <memory>

namespace ffi = xla::ffi;

namespace jax_cp {

ffi::Error WithCudaDevice(const CudaLibraries& libs, int device,
                          const std::function<ffi::Error()>& fn) {
  int previous = -1;
  cudaError_t st = libs.cudart.GetDevice(&previous);
  if (st != cudaSuccess) {
    return ffi::Error::Internal(std::string("cudaGetDevice failed: ") +
                                libs.cudart.GetErrorString(st));
  }
  const bool switch_device = previous != device;
  if (switch_device) {
    st = libs.cudart.SetDevice(device);
    if (st != cudaSuccess) {
      return ffi::Error::Internal("cudaSetDevice(" + std::to_string(device) +
                                  ") failed: " +
                                  libs.cudart.GetErrorString(st));
    }
  }
  ffi::Error result = fn();
  if (switch_device) libs.cudart.SetDevice(previous);
  return result;
}

ffi::ErrorOr<DeviceCudnn*> GetDeviceCudnn(const CudaLibraries& libs,
                                          int device) {
  static std::mutex* registry_mu = new std::mutex;
  static auto* registry = new std::map<int, std::unique_ptr<DeviceCudnn>>;

  std::lock_guard<std::mutex> lock(*registry_mu);
  auto it = registry->find(device);
  if (it != registry->end()) return it->second.get();

  auto state = std::make_unique<DeviceCudnn>();
  state->device = device;
  cudnnHandle_t handle = nullptr;
  ffi::Error err = WithCudaDevice(libs, device, [&]() -> ffi::Error {
    cudnnStatus_t st = libs.cudnn.Create(&handle);
    if (st != CUDNN_STATUS_SUCCESS) {
      return ffi::Error::Internal(
          "cudnnCreate on device " + std::to_string(device) +
          " failed: " + libs.cudnn.GetErrorString(st));
    }
    return ffi::Error::Success();
  });
  if (err.failure()) return err;
  state->handle = handle;
  DeviceCudnn* raw = state.get();
  registry->emplace(device, std::move(state));
  return raw;
}

}  // namespace jax_cp
