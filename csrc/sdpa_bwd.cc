// XLA FFI handler `jax_cp_cudnn_sdpa_bwd`: packed varlen attention backward.
//
// Operands: q, k, v, out, dout, stats, meta (layouts as in sdpa_fwd.cc;
// out/dout like q, stats float32 [Tq,Hq] from the forward). Results: dq
// (like q), dk, dv (like k). Attributes as in the forward. A tiled call
// (tiled = 1) reads stats head-major ([S, Hq, s] in the [Tq, Hq] buffer) and,
// having no padding mask, computes every row: the Python wrapper gives the
// rows past a segment's length a huge log-sum-exp, so their probabilities,
// and with them their share of dq, dk and dv, are exactly 0.
//
// Q rows outside every segment or that see no key, and KV rows no query
// sees, get zero in dq, dk and dv; only those rows are written
// (FillUncoveredRows: dk/dv before the graph, dq after it, since cuDNN
// writes the dq rows of every segment row). cuDNN writes
// dK/dV per segment (no accumulation across segments), so segments' KV
// ranges must not overlap.
//
// `jax_cp_cudnn_sdpa_bwd_into` takes one more operand after stats, dq_in,
// aliased to dq: the call writes the Q rows its segments cover and every
// other row keeps its value (dk, dv are filled as usual).
//
// Both take one attribute more than the forward, after the common ones:
// deterministic = 1 runs the frontend's deterministic algorithm
// (SdpaGraphKey::deterministic), bitwise the same results run to run.
#include <unordered_map>
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

// `dq_in`: dq's buffer (aliased), or null for a fresh dq, whose uncovered
// rows are set to zero.
ffi::Error SdpaBackwardImpl(
    cudaStream_t stream, ffi::ScratchAllocator scratch, int32_t device,
    ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
    ffi::AnyBuffer dout, ffi::AnyBuffer stats, const ffi::AnyBuffer* dq_in,
    SegmentMeta meta, ffi::Result<ffi::AnyBuffer> dq,
    ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
    int64_t segments, int64_t mask, float scale, int64_t max_seqlen_q,
    int64_t max_seqlen_kv, int64_t window_left, int64_t tiled,
    int64_t offset_bits, int64_t poison, int64_t deterministic) {
  const bool into = dq_in != nullptr;
  const char* call = into ? kSdpaBackwardIntoTarget : kSdpaBackwardTarget;
  return GuardFfi(call, [&]() -> ffi::Error {
    const SdpaCommonOperands ops{q, k, v, meta};
    auto key_or = MakeSdpaKey(call, SdpaDirection::kBackward, device, ops,
                              {segments, mask, scale, max_seqlen_q,
                               max_seqlen_kv, window_left, tiled, offset_bits,
                               poison});
    if (!key_or.has_value()) return key_or.error();
    if (deterministic != 0 && deterministic != 1) {
      return Invalid(call, "deterministic must be 0 or 1; got " +
                               std::to_string(deterministic));
    }
    SdpaGraphKey& key = *key_or;
    key.deterministic = deterministic == 1;
    ffi::Error e = CheckSameAs(call, "out", out, "q", q);
    if (e.success()) e = CheckSameAs(call, "dout", dout, "q", q);
    if (e.success()) e = CheckStats(call, "stats", stats, key);
    if (e.success()) e = CheckSameAs(call, "dq", *dq, "q", q);
    if (e.success()) e = CheckSameAs(call, "dk", *dk, "k", k);
    if (e.success()) e = CheckSameAs(call, "dv", *dv, "v", v);
    if (e.success() && into) e = CheckAliased(call, "dq", *dq, *dq_in);
    if (e.success() && into && key.tiled) {
      e = Invalid(call, "a tiled call cannot write dq into an aliased buffer");
    }
    if (e.failure()) return e;

    const SegmentPointers seg = MetaPointers(meta);
    std::unordered_map<int64_t, void*> ptrs = {
        {sdpa_uid::kQ, q.untyped_data()},
        {sdpa_uid::kK, k.untyped_data()},
        {sdpa_uid::kV, v.untyped_data()},
        {sdpa_uid::kO, out.untyped_data()},
        {sdpa_uid::kDO, dout.untyped_data()},
        {sdpa_uid::kStats, stats.untyped_data()},
        {sdpa_uid::kDQ, dq->untyped_data()},
        {sdpa_uid::kDK, dk->untyped_data()},
        {sdpa_uid::kDV, dv->untyped_data()},
    };
    auto libs_or = GetCudaLibraries();
    if (!libs_or.has_value()) return libs_or.error();
    const CudaLibraries& libs = **libs_or;
    e = BindRaggedOperands(call, libs, device, stream, scratch, seg, key,
                           ptrs);
    if (e.failure()) return e;
    const int64_t tq = key.tokens_q, tkv = key.tokens_kv;
    if (tkv > 0) {
      const int64_t row_bytes = static_cast<int64_t>(dk->size_bytes()) / tkv;
      e = FillUncoveredRows(
          libs, device, stream, 0, tkv, {dk->untyped_data(), row_bytes, 0u},
          {dv->untyped_data(), row_bytes, 0u},
          {seg.q_lens, seg.kv_lens, seg.kv_start, key.segments,
           key.mask == SdpaMask::kCausalTopLeft ? Coverage::kSeenKeyRowsTopLeft
                                                : Coverage::kSeenKeyRows},
          "dk/dv");
      if (e.failure()) return e;
    }
    e = RunSdpaGraph(call, key, stream, scratch, std::move(ptrs));
    const void* poison_flag = PoisonFlag(seg, key, poison);
    if (e.success() && tq > 0 && (!into || poison_flag != nullptr)) {
      // Written in place (into): only the poison fills.
      CoveringSegments rows = KeyedQueryRows(seg, key, poison_flag);
      if (into) rows.coverage = Coverage::kAllRows;
      e = FillUncoveredRows(
          libs, device, stream, 0, tq,
          {dq->untyped_data(), static_cast<int64_t>(dq->size_bytes()) / tq,
           0u},
          {}, rows, "dq");
    }
    if (e.success() && tkv > 0 && poison_flag != nullptr) {
      const int64_t row_bytes = static_cast<int64_t>(dk->size_bytes()) / tkv;
      CoveringSegments all{seg.q_lens, seg.kv_lens, seg.kv_start,
                           key.segments, Coverage::kAllRows};
      all.poison = poison_flag;
      e = FillUncoveredRows(libs, device, stream, 0, tkv,
                            {dk->untyped_data(), row_bytes, 0u},
                            {dv->untyped_data(), row_bytes, 0u}, all,
                            "dk/dv");
    }
    return e;
  });
}

ffi::Error SdpaBackward(
    cudaStream_t stream, ffi::ScratchAllocator scratch, int32_t device,
    ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
    ffi::AnyBuffer dout, ffi::AnyBuffer stats, SegmentMeta meta,
    ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
    ffi::Result<ffi::AnyBuffer> dv, int64_t segments, int64_t mask,
    float scale, int64_t max_seqlen_q, int64_t max_seqlen_kv,
    int64_t window_left, int64_t tiled,
    int64_t offset_bits, int64_t poison, int64_t deterministic) {
  return SdpaBackwardImpl(stream, std::move(scratch), device, q, k, v, out,
                          dout, stats, nullptr, meta, dq, dk, dv, segments,
                          mask, scale, max_seqlen_q, max_seqlen_kv,
                          window_left, tiled, offset_bits, poison,
                          deterministic);
}

ffi::Error SdpaBackwardInto(
    cudaStream_t stream, ffi::ScratchAllocator scratch, int32_t device,
    ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
    ffi::AnyBuffer dout, ffi::AnyBuffer stats, ffi::AnyBuffer dq_in,
    SegmentMeta meta, ffi::Result<ffi::AnyBuffer> dq,
    ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
    int64_t segments, int64_t mask, float scale, int64_t max_seqlen_q,
    int64_t max_seqlen_kv, int64_t window_left, int64_t tiled,
    int64_t offset_bits, int64_t poison, int64_t deterministic) {
  return SdpaBackwardImpl(stream, std::move(scratch), device, q, k, v, out,
                          dout, stats, &dq_in, meta, dq, dk, dv, segments,
                          mask, scale, max_seqlen_q, max_seqlen_kv,
                          window_left, tiled, offset_bits, poison,
                          deterministic);
}

}  // namespace
}  // namespace jax_cp

// No kCmdBufferCompatible trait (see sdpa_fwd.cc).
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxCpCudnnSdpaBackward, jax_cp::SdpaBackward,
    jax_cp::BindSdpaAttributes(jax_cp::BindSdpaContext()
        .Arg<ffi::AnyBuffer>()  // q
        .Arg<ffi::AnyBuffer>()  // k
        .Arg<ffi::AnyBuffer>()  // v
        .Arg<ffi::AnyBuffer>()  // out
        .Arg<ffi::AnyBuffer>()  // dout
        .Arg<ffi::AnyBuffer>()  // stats
        .Arg<jax_cp::SegmentMeta>()  // meta [4, W]
        .Ret<ffi::AnyBuffer>()  // dq
        .Ret<ffi::AnyBuffer>()  // dk
        .Ret<ffi::AnyBuffer>()  // dv
    ).Attr<int64_t>("deterministic"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxCpCudnnSdpaBackwardInto, jax_cp::SdpaBackwardInto,
    jax_cp::BindSdpaAttributes(jax_cp::BindSdpaContext()
        .Arg<ffi::AnyBuffer>()  // q
        .Arg<ffi::AnyBuffer>()  // k
        .Arg<ffi::AnyBuffer>()  // v
        .Arg<ffi::AnyBuffer>()  // out
        .Arg<ffi::AnyBuffer>()  // dout
        .Arg<ffi::AnyBuffer>()  // stats
        .Arg<ffi::AnyBuffer>()  // dq_in (aliased)
        .Arg<jax_cp::SegmentMeta>()  // meta [4, W]
        .Ret<ffi::AnyBuffer>()  // dq
        .Ret<ffi::AnyBuffer>()  // dk
        .Ret<ffi::AnyBuffer>()  // dv
    ).Attr<int64_t>("deterministic"));
