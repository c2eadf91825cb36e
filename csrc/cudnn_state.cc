#include "cudnn_state.h"

#include <map>
#include <memory>

#include "fault_injection.h"

namespace ffi = xla::ffi;

namespace jax_cp {
namespace {

// A cudnnCreate that failed on one device: its status, the error returned
// then, and the device's free memory at that moment (when it could be read).
struct HandleFailure {
  std::string status;
  std::string message;
  bool free_known = false;
  size_t free_bytes = 0;
};

// Every device's handle state, under one mutex. Never destroyed.
struct Registry {
  std::mutex mu;
  std::map<int, std::unique_ptr<DeviceCudnn>> handles;
  std::map<int, HandleFailure> failures;
};

Registry& GetRegistry() {
  static Registry* registry = new Registry;
  return *registry;
}

// Free memory of `device`, or false when it cannot be read.
bool FreeBytes(const CudaLibraries& libs, int device, size_t* free_bytes) {
  bool ok = false;
  ffi::Error e = WithCudaDevice(libs, device, [&]() -> ffi::Error {
    size_t total = 0;
    ok = libs.cudart.MemGetInfo(free_bytes, &total) == cudaSuccess;
    return ffi::Error::Success();
  });
  return ok && e.success();
}

std::string MiB(size_t bytes) { return std::to_string(bytes >> 20) + " MiB"; }

}  // namespace

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
  Registry& reg = GetRegistry();
  std::lock_guard<std::mutex> lock(reg.mu);
  auto it = reg.handles.find(device);
  if (it != reg.handles.end()) return it->second.get();

  const std::string where = "cudnnCreate on device " + std::to_string(device);
  auto failed = reg.failures.find(device);
  if (failed != reg.failures.end()) {
    const HandleFailure& f = failed->second;
    size_t free_now = 0;
    const bool freed = f.free_known && FreeBytes(libs, device, &free_now) &&
                       free_now >= f.free_bytes + kHandleRetryFreeBytes;
    if (!freed) {
      return ffi::Error::Internal(
          "cudnnCreate failed earlier on device " + std::to_string(device) +
          " (" + f.status + "); not retried: free GPU memory (e.g. "
          "XLA_PYTHON_CLIENT_PREALLOCATE=false) and call "
          "jax_cp.attention.cudnn.retry_cudnn_handle() or restart. The "
          "first failure: " + f.message);
    }
    // Enough memory was freed since the failure: try once more.
    reg.failures.erase(failed);
  }

  // Allocated first, so nothing can throw between a successful cudnnCreate
  // and the handle's registration.
  auto state = std::make_unique<DeviceCudnn>();
  cudnnHandle_t handle = nullptr;
  cudnnStatus_t st = CUDNN_STATUS_SUCCESS;
  std::string status;
  ffi::Error err = WithCudaDevice(libs, device, [&]() -> ffi::Error {
    if (ShouldFail(FaultPoint::kHandle)) {
      st = CUDNN_STATUS_INTERNAL_ERROR;
      status = std::string(libs.cudnn.GetErrorString(st)) + " (injected)";
    } else {
      st = libs.cudnn.Create(&handle);
      if (st != CUDNN_STATUS_SUCCESS) status = libs.cudnn.GetErrorString(st);
    }
    return ffi::Error::Success();
  });
  if (err.failure()) return err;  // cudaGetDevice / cudaSetDevice failed
  if (st != CUDNN_STATUS_SUCCESS) {
    HandleFailure f;
    f.status = status;
    f.free_known = FreeBytes(libs, device, &f.free_bytes);
    f.message = where + " failed: " + status + " (free device memory: " +
                (f.free_known ? MiB(f.free_bytes) : std::string("unknown")) +
                "); later calls on this device fail at once until more "
                "memory is free or the failure is reset";
    std::string message = f.message;
    reg.failures[device] = std::move(f);
    return ffi::Error::Internal(std::move(message));
  }
  state->device = device;
  state->handle = handle;
  DeviceCudnn* raw = state.get();
  reg.handles.emplace(device, std::move(state));
  return raw;
}

int ResetFailedCudnnHandles() {
  Registry& reg = GetRegistry();
  std::lock_guard<std::mutex> lock(reg.mu);
  const int n = static_cast<int>(reg.failures.size());
  reg.failures.clear();
  return n;
}

std::map<int, std::string> FailedCudnnHandles() {
  Registry& reg = GetRegistry();
  std::lock_guard<std::mutex> lock(reg.mu);
  std::map<int, std::string> out;
  for (const auto& [device, f] : reg.failures) out[device] = f.message;
  return out;
}

}  // namespace jax_cp
