// Loading and launching the kernels of kernels.cu (see device_kernels.h).
#include "device_kernels.h"

#include <mutex>
#include <string>

#include "cudnn_state.h"

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

const DeviceKernels& LoadDeviceKernels(const CudaLibraries& libs) {
  static DeviceKernels* kernels = nullptr;
  static std::once_flag once;
  std::call_once(once, [&libs]() {
    auto* k = new DeviceKernels;
    cudaLibrary_t lib = nullptr;
    cudaError_t st = libs.cudart.LibraryLoadData(
        &lib, kKernelsPtx, nullptr, nullptr, 0, nullptr, nullptr, 0);
    if (st != cudaSuccess) {
      k->error = std::string("cudaLibraryLoadData(kernels.cu PTX) failed: ") +
                 libs.cudart.GetErrorString(st);
    }
    auto get = [&](cudaKernel_t* out, const char* name) {
      if (!k->error.empty()) return;
      st = libs.cudart.LibraryGetKernel(out, lib, name);
      if (st != cudaSuccess) {
        k->error = std::string("cudaLibraryGetKernel(") + name +
                   ") failed: " + libs.cudart.GetErrorString(st);
      }
    };
    for (int d = 0; d < kKernelDtypes; ++d) {
      for (int op = 0; op < 2; ++op) {
        for (int vec = 0; vec < 2; ++vec) {
          get(&k->merge[d][op][vec], kMergeNames[d][op][vec]);
        }
      }
    }
    get(&k->clear_uncovered_rows, "jax_cp_clear_uncovered_rows");
    get(&k->ragged_offsets, "jax_cp_ragged_offsets");
    kernels = k;  // never freed: the library lives as long as the process
  });
  return *kernels;
}

ffi::Error LaunchDeviceKernel(const CudaLibraries& libs, int device,
                              cudaKernel_t kernel, dim3 grid, dim3 block,
                              void** args, cudaStream_t stream,
                              const std::string& what) {
  const void* fn = reinterpret_cast<const void*>(kernel);
  return WithCudaDevice(libs, device, [&]() -> ffi::Error {
    cudaError_t st = libs.cudart.LaunchKernel(fn, grid, block, args, 0, stream);
    if (st != cudaSuccess) {
      return ffi::Error::Internal(what + ": kernel launch failed: " +
                                  libs.cudart.GetErrorString(st));
    }
    return ffi::Error::Success();
  });
}

}  // namespace jax_cp
