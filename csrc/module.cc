// nanobind module `jax_cp._jax_cp_cuda`: the FFI handler capsules and the
// graph-cache counters. Importing it loads no CUDA library (they are opened
// on the first custom call), so it imports on machines without a GPU.
#include <nanobind/nanobind.h>

#include "cuda_libs.h"
#include "sdpa_graph.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxCpCudnnSdpaForward);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxCpCudnnSdpaBackward);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxCpCudnnSdpaForwardInto);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxCpCudnnSdpaBackwardInto);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxCpMergeRows);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxCpAssembleKv);

namespace {

template <typename Fn>
nb::capsule HandlerCapsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_jax_cp_cuda, m) {
  m.doc() =
      "cuDNN SDPA, row-merge and K/V assembly handlers (XLA FFI) for jax_cp's 'cudnn' "
      "backend.";

  // Must happen before the cuDNN frontend first opens the CUDA runtime.
  jax_cp::PinFrontendCudaRuntime();

  m.def(
      "registrations",
      []() {
        nb::dict d;
        d["jax_cp_cudnn_sdpa_fwd"] = HandlerCapsule(JaxCpCudnnSdpaForward);
        d["jax_cp_cudnn_sdpa_bwd"] = HandlerCapsule(JaxCpCudnnSdpaBackward);
        d["jax_cp_cudnn_sdpa_fwd_into"] =
            HandlerCapsule(JaxCpCudnnSdpaForwardInto);
        d["jax_cp_cudnn_sdpa_bwd_into"] =
            HandlerCapsule(JaxCpCudnnSdpaBackwardInto);
        d["jax_cp_merge_rows"] = HandlerCapsule(JaxCpMergeRows);
        d["jax_cp_assemble_kv"] = HandlerCapsule(JaxCpAssembleKv);
        return d;
      },
      "Returns {FFI target name: handler capsule} (execute stage only).");

  m.def(
      "graph_cache_stats",
      []() {
        jax_cp::GraphCacheStats s = jax_cp::GetGraphCacheStats();
        nb::dict d;
        d["builds"] = s.builds;
        d["hits"] = s.hits;
        d["entries"] = s.entries;
        return d;
      },
      "Returns dict(builds=, hits=, entries=) of the process-wide cuDNN "
      "graph cache.");

  m.def("reset_graph_cache_stats", &jax_cp::ResetGraphCacheStats,
        "Zeroes the builds/hits counters (cached graphs are kept).");

  m.def(
      "build_info",
      []() {
        nb::dict d;
        for (const auto& [name, value] : jax_cp::BuildVersions())
          d[name.c_str()] = value;
        d["cuda_runtime_soname"] = jax_cp::CudaRuntimeSoname();
        return d;
      },
      "Compile-time versions of the cuDNN frontend, cuDNN and CUDA headers.");
}
