// Loading and launching the kernels of kernels.cu (see device_kernels.h).
#include "device_kernels.h"

#include <atomic>
#include <mutex>
#include <string>

#include "cudnn_state.h"
#include "fault_injection.h"

namespace ffi = xla::ffi;

namespace jax_cp {

extern const char kKernelsPtx[];  // generated from kernels.cu

namespace {

constexpr const char* kMergeNames[kKernelDtypes][2][2] = {
    {{"jax_cp_merge_add_f32", "jax_cp_merge_add_f32_vec"},
     {"jax_cp_merge_max_f32", "jax_cp_merge_max_f32_vec"}},
    {{"jax_cp_merge_add_bf16", "jax_cp_merge_add_bf16_vec"},
     {"jax_cp_merge_max_bf16", "jax_cp_merge_max_bf16_vec"}},
    {{"jax_cp_merge_add_f16", "jax_cp_merge_add_f16_vec"},
     {"jax_cp_merge_max_f16", "jax_cp_merge_max_f16_vec"}},
};

}  // namespace

namespace {

// The loaded module: the library, once cudaLibraryLoadData succeeded, and
// the kernels, published once all of them were found. Guarded by `mu`;
// `ready` is read without the lock on the fast path.
struct KernelModule {
  std::mutex mu;
  cudaLibrary_t library = nullptr;  // kept once loaded (never unloaded)
  DeviceKernels kernels;
  std::atomic<bool> ready{false};
};

KernelModule& Module() {
  static KernelModule* module = new KernelModule;  // never destroyed
  return *module;
}

}  // namespace

// A failed load is not remembered: the next call tries again (a failure can
// be transient, e.g. out of memory while the driver JIT-compiles the PTX).
// A library that loaded is kept, so a retry after a later step failed does
// not load a second copy. The result of a failure is a per-thread
// DeviceKernels holding only `error`, valid until this thread's next call.
const DeviceKernels& LoadDeviceKernels(const CudaLibraries& libs) {
  KernelModule& m = Module();
  if (m.ready.load(std::memory_order_acquire)) return m.kernels;
  thread_local DeviceKernels failed;
  std::lock_guard<std::mutex> lock(m.mu);
  if (m.ready.load(std::memory_order_relaxed)) return m.kernels;
  failed.error.clear();
  if (m.library == nullptr) {
    const bool inject = ShouldFail(FaultPoint::kKernelLoad);
    cudaLibrary_t lib = nullptr;
    const cudaError_t st =
        inject ? cudaErrorMemoryAllocation
               : libs.cudart.LibraryLoadData(&lib, kKernelsPtx, nullptr,
                                             nullptr, 0, nullptr, nullptr, 0);
    if (st != cudaSuccess) {
      failed.error = "cudaLibraryLoadData(kernels.cu PTX) failed: " +
                     CudaErrorText(libs, st) + (inject ? " (injected)" : "");
      return failed;
    }
    m.library = lib;
  }
  DeviceKernels k;
  auto get = [&](cudaKernel_t* out, const char* name) {
    if (!failed.error.empty()) return;
    const cudaError_t st = libs.cudart.LibraryGetKernel(out, m.library, name);
    if (st != cudaSuccess) {
      failed.error = std::string("cudaLibraryGetKernel(") + name +
                     ") failed: " + CudaErrorText(libs, st);
    }
  };
  for (int d = 0; d < kKernelDtypes; ++d) {
    for (int op = 0; op < 2; ++op) {
      for (int vec = 0; vec < 2; ++vec) {
        get(&k.merge[d][op][vec], kMergeNames[d][op][vec]);
      }
    }
  }
  get(&k.clear_uncovered_rows, "jax_cp_clear_uncovered_rows");
  get(&k.ragged_offsets, "jax_cp_ragged_offsets");
  if (!failed.error.empty()) return failed;
  m.kernels = k;
  m.ready.store(true, std::memory_order_release);
  return m.kernels;
}

ffi::Error LaunchDeviceKernel(const CudaLibraries& libs, int device,
                              cudaKernel_t kernel, dim3 grid, dim3 block,
                              void** args, cudaStream_t stream,
                              const std::string& what) {
  const void* fn = reinterpret_cast<const void*>(kernel);
  return WithCudaDevice(libs, device, [&]() -> ffi::Error {
    const bool inject = ShouldFail(FaultPoint::kKernelLaunch);
    // cudaErrorLaunchOutOfResources: a launch error that, unlike a fault in
    // a running kernel, leaves the context usable (as the injection does).
    const cudaError_t st =
        inject ? cudaErrorLaunchOutOfResources
               : libs.cudart.LaunchKernel(fn, grid, block, args, 0, stream);
    if (st != cudaSuccess) {
      return ffi::Error::Internal(what + ": kernel launch failed: " +
                                  CudaErrorText(libs, st) +
                                  (inject ? " (injected)" : ""));
    }
    return ffi::Error::Success();
  });
}

}  // namespace jax_cp
