// XLA FFI handlers `jax_cp_cudnn_sdpa_fwd{,_out,_into}`: packed varlen
// attention forward.
//
// Operands: q [Tq,Hq,D], k [Tkv,Hkv,D], v [Tkv,Hkv,D] (bf16/f16), meta
// int32 [4, W] (q_lens, kv_lens, and the token offsets q_start, kv_start of
// the S segments; see SegmentMeta). Results: out [Tq,Hq,D]
// (q dtype), stats [Tq,Hq] float32 (the natural-log LSE of the scaled scores
// on covered rows). Attributes: segments (S), mask (int64), scale (f32),
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
#include <utility>

#include "clear_rows.h"
#include "ragged_offsets.h"
#include "cuda_libs.h"
#include "ffi_errors.h"
#include "ffi_targets.h"
#include "sdpa_ffi_common.h"
#include "sdpa_graph.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_cp {
namespace {

// `into`: out_in/stats_in are the results' buffers (aliased); nothing is
// cleared. Otherwise both are null and the uncovered rows are filled.
// `stats` null: the inference form (no stats result, no stats in the graph).
ffi::Error SdpaForwardImpl(cudaStream_t stream, ffi::ScratchAllocator scratch,
                           int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                           ffi::AnyBuffer v, const ffi::AnyBuffer* out_in,
                           const ffi::AnyBuffer* stats_in, SegmentMeta meta,
                           ffi::AnyBuffer* out, ffi::AnyBuffer* stats,
                           int64_t segments, int64_t mask, float scale,
                           int64_t max_seqlen_q, int64_t max_seqlen_kv,
                           int64_t window_left, int64_t tiled,
                           int64_t offset_bits, int64_t poison) {
  const bool into = out_in != nullptr;
  const char* call = into ? kSdpaForwardIntoTarget
                     : stats == nullptr ? kSdpaForwardOutTarget
                                        : kSdpaForwardTarget;
  return GuardFfi(call, [&]() -> ffi::Error {
    const SdpaCommonOperands ops{q, k, v, meta};
    auto key_or = MakeSdpaKey(call, SdpaDirection::kForward, device, ops,
                              {segments, mask, scale, max_seqlen_q,
                               max_seqlen_kv, window_left, tiled, offset_bits,
                               poison});
    if (!key_or.has_value()) return key_or.error();
    SdpaGraphKey key = *key_or;
    key.stats = stats != nullptr;
    ffi::Error e = CheckSameAs(call, "out", *out, "q", q);
    if (e.success() && key.stats) e = CheckStats(call, "stats", *stats, key);
    if (e.success() && into) e = CheckAliased(call, "out", *out, *out_in);
    if (e.success() && into) {
      e = CheckAliased(call, "stats", *stats, *stats_in);
    }
    if (e.success() && into && key.tiled) {
      e = Invalid(call, "a tiled call cannot write into aliased buffers");
    }
    if (e.failure()) return e;

    const SegmentPointers seg = MetaPointers(meta);
    std::unordered_map<int64_t, void*> ptrs = {
        {sdpa_uid::kQ, q.untyped_data()},
        {sdpa_uid::kK, k.untyped_data()},
        {sdpa_uid::kV, v.untyped_data()},
        {sdpa_uid::kO, out->untyped_data()},
    };
    if (key.stats) ptrs.insert({sdpa_uid::kStats, stats->untyped_data()});
    auto libs_or = GetCudaLibraries();
    if (!libs_or.has_value()) return libs_or.error();
    const CudaLibraries& libs = **libs_or;
    e = BindRaggedOperands(call, libs, device, stream, scratch, seg, key,
                           ptrs);
    if (e.failure()) return e;
    const void* poison_flag = PoisonFlag(seg, key, poison);
    auto fill = [&]() -> ffi::Error {
      if (key.tokens_q == 0 || (into && poison_flag == nullptr)) {
        return ffi::Error::Success();
      }
      constexpr uint32_t kMinusInf = 0xff800000u;  // float32 -inf
      const int64_t tq = key.tokens_q;
      CoveringSegments rows = KeyedQueryRows(seg, key, poison_flag);
      // Written in place: every row is this call's or an earlier one's, so
      // only the poison fills.
      if (into) rows.coverage = Coverage::kAllRows;
      return FillUncoveredRows(
          libs, device, stream, 0, tq,
          {out->untyped_data(),
           static_cast<int64_t>(out->size_bytes()) / tq, 0u},
          {key.stats ? stats->untyped_data() : nullptr,
           key.stats ? static_cast<int64_t>(stats->size_bytes()) / tq : 0,
           kMinusInf},
          rows, "out/stats");
    };
    e = RunSdpaGraph(call, key, stream, scratch, std::move(ptrs));
    if (e.success()) e = fill();
    return e;
  });
}

ffi::Error SdpaForward(cudaStream_t stream, ffi::ScratchAllocator scratch,
                       int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                       ffi::AnyBuffer v, SegmentMeta meta,
                       ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> stats, int64_t segments,
                       int64_t mask, float scale, int64_t max_seqlen_q,
                       int64_t max_seqlen_kv, int64_t window_left, int64_t tiled,
                       int64_t offset_bits, int64_t poison) {
  return SdpaForwardImpl(stream, std::move(scratch), device, q, k, v, nullptr,
                         nullptr, meta, &*out, &*stats, segments, mask, scale,
                         max_seqlen_q, max_seqlen_kv, window_left, tiled,
                         offset_bits, poison);
}

ffi::Error SdpaForwardOut(cudaStream_t stream, ffi::ScratchAllocator scratch,
                          int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, SegmentMeta meta,
                          ffi::Result<ffi::AnyBuffer> out, int64_t segments,
                          int64_t mask, float scale, int64_t max_seqlen_q,
                          int64_t max_seqlen_kv, int64_t window_left,
                          int64_t tiled, int64_t offset_bits, int64_t poison) {
  return SdpaForwardImpl(stream, std::move(scratch), device, q, k, v, nullptr,
                         nullptr, meta, &*out, nullptr, segments, mask, scale,
                         max_seqlen_q, max_seqlen_kv, window_left, tiled,
                         offset_bits, poison);
}

ffi::Error SdpaForwardInto(
    cudaStream_t stream, ffi::ScratchAllocator scratch, int32_t device,
    ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out_in,
    ffi::AnyBuffer stats_in, SegmentMeta meta,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> stats,
    int64_t segments, int64_t mask, float scale, int64_t max_seqlen_q,
    int64_t max_seqlen_kv, int64_t window_left, int64_t tiled,
    int64_t offset_bits, int64_t poison) {
  return SdpaForwardImpl(stream, std::move(scratch), device, q, k, v, &out_in,
                         &stats_in, meta, &*out, &*stats, segments, mask,
                         scale, max_seqlen_q, max_seqlen_kv, window_left,
                         tiled, offset_bits, poison);
}

}  // namespace
}  // namespace jax_cp

// Deliberately without ffi::Traits::kCmdBufferCompatible: the first call for
// a key builds a cuDNN graph on the host, and the workspace comes from the
// scratch allocator, neither of which is allowed inside CUDA-graph capture.
namespace {

// The operands of jax_cp_cudnn_sdpa_fwd and _fwd_out, and their out result.
auto BindForwardOperands() {
  return jax_cp::BindSdpaContext()
      .Arg<ffi::AnyBuffer>()       // q
      .Arg<ffi::AnyBuffer>()       // k
      .Arg<ffi::AnyBuffer>()       // v
      .Arg<jax_cp::SegmentMeta>()  // meta [4, W]
      .Ret<ffi::AnyBuffer>();      // out
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxCpCudnnSdpaForward, jax_cp::SdpaForward,
    jax_cp::BindSdpaAttributes(BindForwardOperands()
        .Ret<ffi::AnyBuffer>()  // stats
    ));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxCpCudnnSdpaForwardOut, jax_cp::SdpaForwardOut,
    jax_cp::BindSdpaAttributes(BindForwardOperands()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxCpCudnnSdpaForwardInto, jax_cp::SdpaForwardInto,
    jax_cp::BindSdpaAttributes(jax_cp::BindSdpaContext()
        .Arg<ffi::AnyBuffer>()  // q
        .Arg<ffi::AnyBuffer>()  // k
        .Arg<ffi::AnyBuffer>()  // v
        .Arg<ffi::AnyBuffer>()  // out_in (aliased)
        .Arg<ffi::AnyBuffer>()  // stats_in (aliased)
        .Arg<jax_cp::SegmentMeta>()  // meta [4, W]
        .Ret<ffi::AnyBuffer>()  // out
        .Ret<ffi::AnyBuffer>()  // stats
    ));
