// XLA FFI handler `jax_cp_cudnn_sdpa_bwd`: packed varlen attention backward.
//
// Operands: q, k, v, out, dout, stats, meta (layouts as in sdpa_fwd.cc;
// out/dout like q, stats float32 [Tq,Hq] from the forward). Results: dq
// (like q), dk, dv (like k). Attributes as in the forward.
//
// dq, dk and dv are cleared first: Q rows outside every segment and KV rows
// no segment reads stay zero. cuDNN writes dK/dV per segment (no
// accumulation across segments), so segments' KV ranges must not overlap.
//
// `jax_cp_cudnn_sdpa_bwd_into` takes one more operand after stats, dq_in,
// aliased to dq: dq is not cleared, the call writes the Q rows its segments
// cover and every other row keeps its value (dk, dv are cleared as usual).
#include <exception>
#include <utility>
#include <vector>

#include "sdpa_ffi_common.h"
#include "sdpa_graph.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_cp {
namespace {

constexpr const char* kFresh = "jax_cp_cudnn_sdpa_bwd";
constexpr const char* kInto = "jax_cp_cudnn_sdpa_bwd_into";

// `dq_in`: dq's buffer (aliased), not cleared; null: dq is cleared first.
ffi::Error SdpaBackwardImpl(
    cudaStream_t stream, ffi::ScratchAllocator scratch, int32_t device,
    ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
    ffi::AnyBuffer dout, ffi::AnyBuffer stats, const ffi::AnyBuffer* dq_in,
    SegmentMeta meta, ffi::Result<ffi::AnyBuffer> dq,
    ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
    int64_t segments, int64_t mask, float scale, int64_t max_seqlen_q,
    int64_t max_seqlen_kv) {
  const bool into = dq_in != nullptr;
  const char* call = into ? kInto : kFresh;
  try {
    const SdpaCommonOperands ops{q, k, v, meta};
    auto key_or = MakeSdpaKey(call, SdpaDirection::kBackward, device, ops,
                              {segments, mask, scale, max_seqlen_q,
                               max_seqlen_kv});
    if (!key_or.has_value()) return key_or.error();
    const SdpaGraphKey& key = *key_or;
    ffi::Error e = CheckSameAs(call, "out", out, "q", q);
    if (e.success()) e = CheckSameAs(call, "dout", dout, "q", q);
    if (e.success()) e = CheckStats(call, "stats", stats, key);
    if (e.success()) e = CheckSameAs(call, "dq", *dq, "q", q);
    if (e.success()) e = CheckSameAs(call, "dk", *dk, "k", k);
    if (e.success()) e = CheckSameAs(call, "dv", *dv, "v", v);
    if (e.success() && into) e = CheckAliased(call, "dq", *dq, *dq_in);
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
        {sdpa_uid::kSeqLenQ, seg.q_lens},
        {sdpa_uid::kSeqLenKv, seg.kv_lens},
        {sdpa_uid::kOffsetQ, seg.q_off},
        {sdpa_uid::kOffsetO, seg.q_off},
        {sdpa_uid::kOffsetK, seg.kv_off},
        {sdpa_uid::kOffsetV, seg.kv_off},
        {sdpa_uid::kOffsetStats, seg.stats_off},
    };
    std::vector<ZeroFill> zero_fills = {
        {dk->untyped_data(), dk->size_bytes(), "dk"},
        {dv->untyped_data(), dv->size_bytes(), "dv"},
    };
    if (!into) {
      zero_fills.push_back({dq->untyped_data(), dq->size_bytes(), "dq"});
    }
    return RunSdpaGraph(call, key, stream, scratch, std::move(ptrs),
                        zero_fills);
  } catch (const std::exception& ex) {
    return ffi::Error::Internal(std::string(call) + ": " + ex.what());
  } catch (...) {
    return ffi::Error::Internal(std::string(call) + ": unknown exception");
  }
}

ffi::Error SdpaBackward(
    cudaStream_t stream, ffi::ScratchAllocator scratch, int32_t device,
    ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
    ffi::AnyBuffer dout, ffi::AnyBuffer stats, SegmentMeta meta,
    ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
    ffi::Result<ffi::AnyBuffer> dv, int64_t segments, int64_t mask,
    float scale, int64_t max_seqlen_q, int64_t max_seqlen_kv) {
  return SdpaBackwardImpl(stream, std::move(scratch), device, q, k, v, out,
                          dout, stats, nullptr, meta, dq, dk, dv, segments,
                          mask, scale, max_seqlen_q, max_seqlen_kv);
}

ffi::Error SdpaBackwardInto(
    cudaStream_t stream, ffi::ScratchAllocator scratch, int32_t device,
    ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
    ffi::AnyBuffer dout, ffi::AnyBuffer stats, ffi::AnyBuffer dq_in,
    SegmentMeta meta, ffi::Result<ffi::AnyBuffer> dq,
    ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
    int64_t segments, int64_t mask, float scale, int64_t max_seqlen_q,
    int64_t max_seqlen_kv) {
  return SdpaBackwardImpl(stream, std::move(scratch), device, q, k, v, out,
                          dout, stats, &dq_in, meta, dq, dk, dv, segments,
                          mask, scale, max_seqlen_q, max_seqlen_kv);
}

}  // namespace

// No kCmdBufferCompatible trait (see sdpa_fwd.cc).
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxCpCudnnSdpaBackward, SdpaBackward,
    BindSdpaAttributes(BindSdpaContext()
        .Arg<ffi::AnyBuffer>()  // q
        .Arg<ffi::AnyBuffer>()  // k
        .Arg<ffi::AnyBuffer>()  // v
        .Arg<ffi::AnyBuffer>()  // out
        .Arg<ffi::AnyBuffer>()  // dout
        .Arg<ffi::AnyBuffer>()  // stats
        .Arg<SegmentMeta>()     // meta [5, W]
        .Ret<ffi::AnyBuffer>()  // dq
        .Ret<ffi::AnyBuffer>()  // dk
        .Ret<ffi::AnyBuffer>()  // dv
    ));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxCpCudnnSdpaBackwardInto, SdpaBackwardInto,
    BindSdpaAttributes(BindSdpaContext()
        .Arg<ffi::AnyBuffer>()  // q
        .Arg<ffi::AnyBuffer>()  // k
        .Arg<ffi::AnyBuffer>()  // v
        .Arg<ffi::AnyBuffer>()  // out
        .Arg<ffi::AnyBuffer>()  // dout
        .Arg<ffi::AnyBuffer>()  // stats
        .Arg<ffi::AnyBuffer>()  // dq_in (aliased)
        .Arg<SegmentMeta>()     // meta [5, W]
        .Ret<ffi::AnyBuffer>()  // dq
        .Ret<ffi::AnyBuffer>()  // dk
        .Ret<ffi::AnyBuffer>()  // dv
    ));

}  // namespace jax_cp
