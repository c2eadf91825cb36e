// XLA FFI handlers `jax_cp_cudnn_sdpa_fwd{,_out,_into}`: packed varlen
// attention forward.
//
// Operands: q [Tq,Hq,D], k [Tkv,Hkv,D], v [Tkv,Hkv,D] (bf16/f16), meta
// int32 [4, W] (q_lens, kv_lens, and the token offsets q_start, kv_start of
// the S segments; see SegmentMeta). Results: out [Tq,Hq,D]
// (q dtype), stats [Tq,Hq] float32 (the natural-log LSE of the scaled scores
// on covered rows). Attributes, decoded as one SdpaAttrs
// (sdpa_ffi_common.h): segments (S), mask (int64: SdpaMask), scale (f32),
// max_seqlen_q, max_seqlen_kv, window_left (int64; -1: no sliding window),
// tiled (int64 0/1), offset_bits (int64 32/64: the width of the element
// offsets the handler builds for cuDNN, ragged_offsets.h), poison (int64
// 0/1: entry S of the metadata's row 0 is a flag that, where nonzero, makes
// every row of every result NaN; PoisonFlag in sdpa_ffi_common.h).
//
// Rows outside every segment, and rows of a segment that see no key (a
// bottom-right segment with fewer keys than queries, one with no key, rows
// past a top-left window's reach), get 0 in out and -inf (the log-sum-exp
// of no scores) in stats; only those rows are written, by one small kernel
// after the graph (FillUncoveredRows, Coverage::kKeyedQueryRows*), which
// reads the segments on the device: traced metadata need no pass over out.
// A tiled call (attribute tiled = 1, SdpaGraphKey::tiled) has no padding
// mask, so its graph writes every row; the same fill overwrites the rows
// past each segment's length.
//
// `jax_cp_cudnn_sdpa_fwd_out` is the inference form: the same operands and
// attributes, one result (out). Its graph computes and writes no stats
// (SdpaGraphKey::stats = false), as for a forward nothing differentiates.
//
// `jax_cp_cudnn_sdpa_fwd_into` takes two more operands after v, out_in and
// stats_in, aliased to the results: nothing is cleared, the call writes the
// rows its segments cover and every other row keeps its value (unless the
// call is poisoned). Context parallel attention writes a second call's rows
// into the first's outputs this way, with no merge pass and no extra output
// buffers.
//
// The three handlers differ only in their buffers; one body
// (SdpaForwardCall) serves them, on the call path shared with the backward
// (RunSdpaCall).
#include <utility>

#include "clear_rows.h"
#include "ffi_errors.h"
#include "ffi_targets.h"
#include "sdpa_ffi_common.h"
#include "sdpa_graph.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_cp {
namespace {

// The forward's own buffers. `out_in`/`stats_in`: the results' buffers
// (aliased; into), or null, and then the uncovered rows are filled.
// `stats` null: the inference form (no stats result, no stats in the graph).
struct ForwardBuffers {
  const ffi::AnyBuffer* out_in;
  const ffi::AnyBuffer* stats_in;
  ffi::AnyBuffer* out;
  ffi::AnyBuffer* stats;
};

ffi::Error SdpaForwardCall(const char* target, const SdpaContext& ctx,
                           const SdpaCommonOperands& ops,
                           const ForwardBuffers& b, const SdpaAttrs& attrs) {
  const bool into = b.out_in != nullptr;
  auto check = [&](SdpaGraphKey& key) -> ffi::Error {
    key.stats = b.stats != nullptr;
    ffi::Error e = CheckSameAs(target, "out", *b.out, "q", ops.q);
    if (e.success() && key.stats) {
      e = CheckStats(target, "stats", *b.stats, key);
    }
    if (e.success() && into) e = CheckAliased(target, "out", *b.out, *b.out_in);
    if (e.success() && into) {
      e = CheckAliased(target, "stats", *b.stats, *b.stats_in);
    }
    if (e.success() && into && key.tiled) {
      e = Invalid(target, "a tiled call cannot write into aliased buffers");
    }
    return e;
  };
  auto run = [&](SdpaCall& call) -> ffi::Error {
    const SdpaGraphKey& key = call.key;
    call.ptrs.insert({sdpa_uid::kO, b.out->untyped_data()});
    if (key.stats) {
      call.ptrs.insert({sdpa_uid::kStats, b.stats->untyped_data()});
    }
    ffi::Error e = RunSdpaGraph(target, key, call.ctx.stream, *call.ctx.scratch,
                                std::move(call.ptrs));
    const int64_t tq = key.tokens_q;
    if (e.failure() || tq == 0 || (into && call.poison == nullptr)) return e;
    constexpr uint32_t kMinusInf = 0xff800000u;  // float32 -inf
    CoveringSegments rows = KeyedQueryRows(call.seg, key, call.poison);
    // Written in place: every row is this call's or an earlier one's, so
    // only the poison fills.
    if (into) rows.coverage = Coverage::kAllRows;
    return FillUncoveredRows(
        *call.libs, call.ctx.device, call.ctx.stream, 0, tq,
        {b.out->untyped_data(), static_cast<int64_t>(b.out->size_bytes()) / tq,
         0u},
        {key.stats ? b.stats->untyped_data() : nullptr,
         key.stats ? static_cast<int64_t>(b.stats->size_bytes()) / tq : 0,
         kMinusInf},
        rows, "out/stats");
  };
  return RunSdpaCall(target, SdpaDirection::kForward, ctx, ops, attrs, check,
                     run);
}

ffi::Error SdpaForward(cudaStream_t stream, ffi::ScratchAllocator scratch,
                       int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                       ffi::AnyBuffer v, SegmentMeta meta,
                       ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> stats, SdpaAttrs attrs) {
  return SdpaForwardCall(kSdpaForwardTarget, {stream, &scratch, device},
                         {q, k, v, meta}, {nullptr, nullptr, &*out, &*stats},
                         attrs);
}

ffi::Error SdpaForwardOut(cudaStream_t stream, ffi::ScratchAllocator scratch,
                          int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, SegmentMeta meta,
                          ffi::Result<ffi::AnyBuffer> out, SdpaAttrs attrs) {
  return SdpaForwardCall(kSdpaForwardOutTarget, {stream, &scratch, device},
                         {q, k, v, meta}, {nullptr, nullptr, &*out, nullptr},
                         attrs);
}

ffi::Error SdpaForwardInto(cudaStream_t stream, ffi::ScratchAllocator scratch,
                           int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                           ffi::AnyBuffer v, ffi::AnyBuffer out_in,
                           ffi::AnyBuffer stats_in, SegmentMeta meta,
                           ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::AnyBuffer> stats, SdpaAttrs attrs) {
  return SdpaForwardCall(kSdpaForwardIntoTarget, {stream, &scratch, device},
                         {q, k, v, meta}, {&out_in, &stats_in, &*out, &*stats},
                         attrs);
}

// The operands of jax_cp_cudnn_sdpa_fwd and _fwd_out, and their out result.
auto BindForwardOperands() {
  return BindSdpaContext()
      .Arg<ffi::AnyBuffer>()  // q
      .Arg<ffi::AnyBuffer>()  // k
      .Arg<ffi::AnyBuffer>()  // v
      .Arg<SegmentMeta>()     // meta [4, W]
      .Ret<ffi::AnyBuffer>();  // out
}

}  // namespace
}  // namespace jax_cp

// Deliberately without ffi::Traits::kCmdBufferCompatible: the first call for
// a key builds a cuDNN graph on the host, and the workspace comes from the
// scratch allocator, neither of which is allowed inside CUDA-graph capture.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxCpCudnnSdpaForward, jax_cp::SdpaForward,
    jax_cp::BindForwardOperands()
        .Ret<ffi::AnyBuffer>()  // stats
        .Attrs<jax_cp::SdpaAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxCpCudnnSdpaForwardOut, jax_cp::SdpaForwardOut,
    jax_cp::BindForwardOperands().Attrs<jax_cp::SdpaAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxCpCudnnSdpaForwardInto, jax_cp::SdpaForwardInto,
    jax_cp::BindSdpaContext()
        .Arg<ffi::AnyBuffer>()          // q
        .Arg<ffi::AnyBuffer>()          // k
        .Arg<ffi::AnyBuffer>()          // v
        .Arg<ffi::AnyBuffer>()          // out_in (aliased)
        .Arg<ffi::AnyBuffer>()          // stats_in (aliased)
        .Arg<jax_cp::SegmentMeta>()     // meta [4, W]
        .Ret<ffi::AnyBuffer>()          // out
        .Ret<ffi::AnyBuffer>()          // stats
        .Attrs<jax_cp::SdpaAttrs>());
