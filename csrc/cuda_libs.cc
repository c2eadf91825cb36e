#include "cuda_libs.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string>

namespace ffi = xla::ffi;

// Defined here, declared by the cuDNN frontend headers when
// NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING is set: the frontend dlsym()s every
// cuDNN function from this handle. It must be set before the first frontend
// call, because the frontend caches each resolved symbol in a static.
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace jax_cp {
namespace {

#define JAX_CP_STR2(x) #x
#define JAX_CP_STR(x) JAX_CP_STR2(x)

// e.g. "libcudart.so.13" for CUDART_VERSION 13000.
const std::string& RuntimeSoname() {
  static const std::string name =
      "libcudart.so." + std::to_string(CUDART_VERSION / 1000);
  return name;
}

constexpr const char* kCudnnSoname = "libcudnn.so." JAX_CP_STR(CUDNN_MAJOR);

std::string DlError() {
  const char* e = dlerror();
  return e ? e : "unknown dlopen error";
}

// Prefers the copy already loaded by JAX (matched by soname); falls back to a
// normal search, which also looks in this module's RUNPATH (set by CMake to
// the pip wheels' library folders found at build time).
void* OpenLibrary(const char* soname, std::string* error) {
  if (void* h = dlopen(soname, RTLD_NOW | RTLD_NOLOAD)) return h;
  if (void* h = dlopen(soname, RTLD_NOW | RTLD_LOCAL)) return h;
  *error = std::string("cannot load ") + soname + ": " + DlError() +
           " (import jax and let its CUDA plugin initialise first, or put "
           "the library on LD_LIBRARY_PATH)";
  return nullptr;
}

template <typename Fn>
bool Resolve(void* lib, const char* lib_name, const char* symbol, Fn* out,
             std::string* error) {
  *out = reinterpret_cast<Fn>(dlsym(lib, symbol));
  if (*out == nullptr) {
    *error = std::string("symbol ") + symbol + " not found in " + lib_name;
    return false;
  }
  return true;
}

struct LoadResult {
  CudaLibraries libs{};
  std::string error;  // empty on success
};

LoadResult Load() {
  LoadResult r;
  std::string& err = r.error;
  const std::string& rt_name = RuntimeSoname();
  void* cudart = OpenLibrary(rt_name.c_str(), &err);
  if (cudart == nullptr) return r;
  CudaRuntimeApi& rt = r.libs.cudart;
  if (!Resolve(cudart, rt_name.c_str(), "cudaGetDevice", &rt.GetDevice, &err) ||
      !Resolve(cudart, rt_name.c_str(), "cudaSetDevice", &rt.SetDevice, &err) ||
      !Resolve(cudart, rt_name.c_str(), "cudaGetErrorString",
               &rt.GetErrorString, &err) ||
      !Resolve(cudart, rt_name.c_str(), "cudaGetErrorName", &rt.GetErrorName,
               &err) ||
      !Resolve(cudart, rt_name.c_str(), "cudaMemGetInfo", &rt.MemGetInfo,
               &err) ||
      !Resolve(cudart, rt_name.c_str(), "cudaLibraryLoadData",
               &rt.LibraryLoadData, &err) ||
      !Resolve(cudart, rt_name.c_str(), "cudaLibraryGetKernel",
               &rt.LibraryGetKernel, &err) ||
      !Resolve(cudart, rt_name.c_str(), "cudaLaunchKernel", &rt.LaunchKernel,
               &err)) {
    return r;
  }

  void* cudnn = OpenLibrary(kCudnnSoname, &err);
  if (cudnn == nullptr) return r;
  CudnnApi& dnn = r.libs.cudnn;
  if (!Resolve(cudnn, kCudnnSoname, "cudnnCreate", &dnn.Create, &err) ||
      !Resolve(cudnn, kCudnnSoname, "cudnnSetStream", &dnn.SetStream, &err) ||
      !Resolve(cudnn, kCudnnSoname, "cudnnGetErrorString", &dnn.GetErrorString,
               &err) ||
      !Resolve(cudnn, kCudnnSoname, "cudnnGetVersion", &dnn.GetVersion, &err)) {
    return r;
  }
  // cuDNN 9 graph API and ragged (THD) packed stats need >= 9.6 at run time.
  const size_t version = dnn.GetVersion();
  if (version < 90600) {
    err = "cuDNN " + std::to_string(version) +
          " is loaded; jax_cp's cuDNN backend needs cuDNN >= 9.6 (ragged "
          "packed stats, GQA with ragged offsets)";
    return r;
  }
  cudnn_frontend::cudnn_dlhandle = cudnn;
  return r;
}

}  // namespace

std::string CudaErrorText(const CudaLibraries& libs, cudaError_t st) {
  return std::string(libs.cudart.GetErrorName(st)) + " (" +
         libs.cudart.GetErrorString(st) + ")";
}

const char* CudaRuntimeSoname() { return RuntimeSoname().c_str(); }

void PinFrontendCudaRuntime() {
  // overwrite=0 keeps a user's explicit choice.
  setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", RuntimeSoname().c_str(), 0);
}

ffi::ErrorOr<const CudaLibraries*> GetCudaLibraries() {
  // Initialised once; a failure is remembered (nothing would change later).
  static const LoadResult* result = new LoadResult(Load());
  if (!result->error.empty()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_cp cuDNN backend: " + result->error);
  }
  return &result->libs;
}

}  // namespace jax_cp
