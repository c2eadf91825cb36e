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
// Both take one attribute more than the forward (SdpaBackwardAttrs, in
// sdpa_ffi_common.h): deterministic = 1 runs the frontend's deterministic
// algorithm (SdpaGraphKey::deterministic), bitwise the same results run to
// run.
//
// One body (SdpaBackwardCall) serves both handlers, on the call path shared
// with the forward (RunSdpaCall).
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

// The backward's own operands and results. `dq_in`: dq's buffer (aliased),
// or null for a fresh dq, whose uncovered rows are set to zero.
struct BackwardBuffers {
  const ffi::AnyBuffer* out;
  const ffi::AnyBuffer* dout;
  const ffi::AnyBuffer* stats;
  const ffi::AnyBuffer* dq_in;
  ffi::AnyBuffer* dq;
  ffi::AnyBuffer* dk;
  ffi::AnyBuffer* dv;
};

ffi::Error SdpaBackwardCall(const char* target, const SdpaContext& ctx,
                            const SdpaCommonOperands& ops,
                            const BackwardBuffers& b,
                            const SdpaBackwardAttrs& attrs) {
  const bool into = b.dq_in != nullptr;
  auto check = [&](SdpaGraphKey& key) -> ffi::Error {
    if (attrs.deterministic != 0 && attrs.deterministic != 1) {
      return Invalid(target, "deterministic must be 0 or 1; got " +
                                 std::to_string(attrs.deterministic));
    }
    key.deterministic = attrs.deterministic == 1;
    ffi::Error e = CheckSameAs(target, "out", *b.out, "q", ops.q);
    if (e.success()) e = CheckSameAs(target, "dout", *b.dout, "q", ops.q);
    if (e.success()) e = CheckStats(target, "stats", *b.stats, key);
    if (e.success()) e = CheckSameAs(target, "dq", *b.dq, "q", ops.q);
    if (e.success()) e = CheckSameAs(target, "dk", *b.dk, "k", ops.k);
    if (e.success()) e = CheckSameAs(target, "dv", *b.dv, "v", ops.v);
    if (e.success() && into) e = CheckAliased(target, "dq", *b.dq, *b.dq_in);
    if (e.success() && into && key.tiled) {
      e = Invalid(target,
                  "a tiled call cannot write dq into an aliased buffer");
    }
    return e;
  };
  auto run = [&](SdpaCall& call) -> ffi::Error {
    const SdpaGraphKey& key = call.key;
    const CudaLibraries& libs = *call.libs;
    const int device = call.ctx.device;
    const cudaStream_t stream = call.ctx.stream;
    call.ptrs.insert({{sdpa_uid::kO, b.out->untyped_data()},
                      {sdpa_uid::kDO, b.dout->untyped_data()},
                      {sdpa_uid::kStats, b.stats->untyped_data()},
                      {sdpa_uid::kDQ, b.dq->untyped_data()},
                      {sdpa_uid::kDK, b.dk->untyped_data()},
                      {sdpa_uid::kDV, b.dv->untyped_data()}});
    const int64_t tq = key.tokens_q, tkv = key.tokens_kv;
    const int64_t kv_row_bytes =
        tkv > 0 ? static_cast<int64_t>(b.dk->size_bytes()) / tkv : 0;
    ffi::Error e = ffi::Error::Success();
    if (tkv > 0) {
      e = FillUncoveredRows(
          libs, device, stream, 0, tkv,
          {b.dk->untyped_data(), kv_row_bytes, 0u},
          {b.dv->untyped_data(), kv_row_bytes, 0u},
          {call.seg.q_lens, call.seg.kv_lens, call.seg.kv_start, key.segments,
           key.mask == SdpaMask::kCausalTopLeft ? Coverage::kSeenKeyRowsTopLeft
                                                : Coverage::kSeenKeyRows},
          "dk/dv");
      if (e.failure()) return e;
    }
    e = RunSdpaGraph(target, key, stream, *call.ctx.scratch,
                     std::move(call.ptrs));
    if (e.success() && tq > 0 && (!into || call.poison != nullptr)) {
      // Written in place (into): only the poison fills.
      CoveringSegments rows = KeyedQueryRows(call.seg, key, call.poison);
      if (into) rows.coverage = Coverage::kAllRows;
      e = FillUncoveredRows(
          libs, device, stream, 0, tq,
          {b.dq->untyped_data(), static_cast<int64_t>(b.dq->size_bytes()) / tq,
           0u},
          {}, rows, "dq");
    }
    if (e.success() && tkv > 0 && call.poison != nullptr) {
      CoveringSegments all{call.seg.q_lens, call.seg.kv_lens,
                           call.seg.kv_start, key.segments, Coverage::kAllRows};
      all.poison = call.poison;
      e = FillUncoveredRows(libs, device, stream, 0, tkv,
                            {b.dk->untyped_data(), kv_row_bytes, 0u},
                            {b.dv->untyped_data(), kv_row_bytes, 0u}, all,
                            "dk/dv");
    }
    return e;
  };
  return RunSdpaCall(target, SdpaDirection::kBackward, ctx, ops, attrs.common,
                     check, run);
}

ffi::Error SdpaBackward(cudaStream_t stream, ffi::ScratchAllocator scratch,
                        int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::AnyBuffer out,
                        ffi::AnyBuffer dout, ffi::AnyBuffer stats,
                        SegmentMeta meta, ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk,
                        ffi::Result<ffi::AnyBuffer> dv,
                        SdpaBackwardAttrs attrs) {
  return SdpaBackwardCall(kSdpaBackwardTarget, {stream, &scratch, device},
                          {q, k, v, meta},
                          {&out, &dout, &stats, nullptr, &*dq, &*dk, &*dv},
                          attrs);
}

ffi::Error SdpaBackwardInto(
    cudaStream_t stream, ffi::ScratchAllocator scratch, int32_t device,
    ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
    ffi::AnyBuffer dout, ffi::AnyBuffer stats, ffi::AnyBuffer dq_in,
    SegmentMeta meta, ffi::Result<ffi::AnyBuffer> dq,
    ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
    SdpaBackwardAttrs attrs) {
  return SdpaBackwardCall(kSdpaBackwardIntoTarget, {stream, &scratch, device},
                          {q, k, v, meta},
                          {&out, &dout, &stats, &dq_in, &*dq, &*dk, &*dv},
                          attrs);
}

// The operands q, k, v, out, dout and stats of both handlers.
auto BindBackwardOperands() {
  return BindSdpaContext()
      .Arg<ffi::AnyBuffer>()   // q
      .Arg<ffi::AnyBuffer>()   // k
      .Arg<ffi::AnyBuffer>()   // v
      .Arg<ffi::AnyBuffer>()   // out
      .Arg<ffi::AnyBuffer>()   // dout
      .Arg<ffi::AnyBuffer>();  // stats
}

}  // namespace
}  // namespace jax_cp

// No kCmdBufferCompatible trait (see sdpa_fwd.cc).
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxCpCudnnSdpaBackward, jax_cp::SdpaBackward,
    jax_cp::BindBackwardOperands()
        .Arg<jax_cp::SegmentMeta>()  // meta [4, W]
        .Ret<ffi::AnyBuffer>()       // dq
        .Ret<ffi::AnyBuffer>()       // dk
        .Ret<ffi::AnyBuffer>()       // dv
        .Attrs<jax_cp::SdpaBackwardAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxCpCudnnSdpaBackwardInto, jax_cp::SdpaBackwardInto,
    jax_cp::BindBackwardOperands()
        .Arg<ffi::AnyBuffer>()       // dq_in (aliased)
        .Arg<jax_cp::SegmentMeta>()  // meta [4, W]
        .Ret<ffi::AnyBuffer>()       // dq
        .Ret<ffi::AnyBuffer>()       // dk
        .Ret<ffi::AnyBuffer>()       // dv
        .Attrs<jax_cp::SdpaBackwardAttrs>());
