// nanobind module `jax_cp._jax_cp_cuda`: the FFI handler capsules, the
// contract constants Python reads (ffi_targets.h), the graph-cache
// counters, the cuDNN handle failure memory and the test-only fault
// injection switch (fault_injection.h). Importing it loads no CUDA library (they are opened on the first
// custom call), so it imports on machines without a GPU. Its Python
// signatures are in jax_cp/_jax_cp_cuda.pyi.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>

#include "cuda_libs.h"
#include "cudnn_state.h"
#include "fault_injection.h"
#include "ffi_targets.h"
#include "sdpa_graph.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

namespace {

struct Target {
  const char* role;  // key of FFI_TARGETS
  const char* name;  // FFI target name
  XLA_FFI_Handler* handler;
};

const Target kTargets[] = {
    {"sdpa_fwd", jax_cp::kSdpaForwardTarget, JaxCpCudnnSdpaForward},
    {"sdpa_fwd_out", jax_cp::kSdpaForwardOutTarget, JaxCpCudnnSdpaForwardOut},
    {"sdpa_fwd_into", jax_cp::kSdpaForwardIntoTarget,
     JaxCpCudnnSdpaForwardInto},
    {"sdpa_bwd", jax_cp::kSdpaBackwardTarget, JaxCpCudnnSdpaBackward},
    {"sdpa_bwd_into", jax_cp::kSdpaBackwardIntoTarget,
     JaxCpCudnnSdpaBackwardInto},
    {"merge_rows", jax_cp::kMergeRowsTarget, JaxCpMergeRows},
};

template <typename Enum>
int64_t Code(Enum value) {
  return static_cast<int64_t>(value);
}

}  // namespace

NB_MODULE(_jax_cp_cuda, m) {
  m.doc() =
      "cuDNN SDPA and row-merge handlers (XLA FFI) for "
      "jax_cp's 'cudnn' backend.";

  // Must happen before the cuDNN frontend first opens the CUDA runtime.
  jax_cp::PinFrontendCudaRuntime();

  // JAX_CP_FAULT_INJECT is read here, once; a spec that does not parse
  // fails the import rather than testing nothing.
  if (!jax_cp::FaultInjectionEnvError().empty()) {
    throw nb::value_error(jax_cp::FaultInjectionEnvError().c_str());
  }

  nb::dict targets;
  for (const Target& t : kTargets) targets[t.role] = t.name;
  m.attr("FFI_TARGETS") = targets;

  nb::dict masks;
  masks["no_mask"] = Code(jax_cp::SdpaMask::kNoMask);
  masks["causal_top_left"] = Code(jax_cp::SdpaMask::kCausalTopLeft);
  masks["causal_bottom_right"] = Code(jax_cp::SdpaMask::kCausalBottomRight);
  m.attr("MASK_CODES") = masks;

  nb::dict merge_ops;
  merge_ops["add"] = Code(jax_cp::MergeOp::kAdd);
  merge_ops["max"] = Code(jax_cp::MergeOp::kMax);
  m.attr("MERGE_OP_CODES") = merge_ops;

  m.attr("MAX_HEAD_DIM") = jax_cp::kMaxHeadDim;
  m.attr("SEGMENT_META_ROWS") = jax_cp::kSegmentMetaRows;
  m.attr("SEGMENT_META_WIDTH_MULTIPLE") = jax_cp::kSegmentMetaWidthMultiple;

  m.def(
      "registrations",
      []() {
        nb::dict d;
        for (const Target& t : kTargets) {
          d[t.name] = nb::capsule(reinterpret_cast<void*>(t.handler));
        }
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
      "reset_failed_handles", &jax_cp::ResetFailedCudnnHandles,
      "Forgets every remembered cudnnCreate failure, so the next call on "
      "such a device tries again; returns how many were forgotten.");

  m.def(
      "failed_handles",
      []() {
        nb::dict d;
        for (const auto& [device, message] : jax_cp::FailedCudnnHandles())
          d[nb::int_(device)] = message;
        return d;
      },
      "Returns {device: message} of the remembered cudnnCreate failures.");

  m.def(
      "set_fault_injection",
      [](const std::string& spec) {
        std::string error;
        if (!jax_cp::SetFaultInjection(spec, &error)) {
          throw nb::value_error(error.c_str());
        }
      },
      nb::arg("spec"),
      "Test only: replaces the fault injection spec (as JAX_CP_FAULT_INJECT: "
      "'point[:count],...'; '' disarms every point) and zeroes the counters. "
      "Raises ValueError for an unknown point or a bad count.");

  m.def(
      "fault_injection_counts",
      []() {
        nb::dict d;
        for (const jax_cp::FaultPointState& s :
             jax_cp::FaultInjectionState()) {
          nb::dict e;
          e["remaining"] = s.remaining;
          e["injected"] = s.injected;
          d[s.name] = e;
        }
        return d;
      },
      "Test only: {point: dict(remaining=, injected=)} for every fault "
      "point; remaining is -1 (every hit fails), 0 (not armed) or the "
      "failures left.");

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
