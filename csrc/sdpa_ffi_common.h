// The call path shared by the forward and backward SDPA handlers
// (RunSdpaCall): their attributes, decoded as one struct, the operand
// checks and the operands' binding. The Python wrapper already validates
// everything; these checks turn a mismatch (e.g. a hand-written custom
// call) into an InvalidArgument error instead of a bad memory access.
#ifndef JAX_CP_CSRC_SDPA_FFI_COMMON_H_
#define JAX_CP_CSRC_SDPA_FFI_COMMON_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <unordered_map>

#include "clear_rows.h"
#include "cuda_libs.h"
#include "ffi_errors.h"
#include "ffi_targets.h"
#include "sdpa_graph.h"
#include "xla/ffi/api/ffi.h"

namespace jax_cp {

// The segment metadata of a call, packed in one int32 operand [4, W] (one
// small array for XLA to build instead of four): row 0 q_lens [S], row 1
// kv_lens [S], rows 2-3 the token offsets q_start, kv_start [S + 1] (where
// each segment starts, then the token count); W >= S + 1 is a multiple of 4
// (kSegmentMetaWidthMultiple), so every row starts 16-byte aligned. S is the
// `segments` attribute. With the attribute poison = 1, entry S of row 0 is
// the poison flag (PoisonFlag). Token offsets fit int32 at any size that fits in
// memory; the element offsets cuDNN reads are built from them by the
// handler, 64-bit where the call asks for it (ragged_offsets.h).
using SegmentMeta = xla::ffi::Buffer<xla::ffi::S32, 2>;
static_assert(kSegmentMetaRows == 4, "SegmentPointers names four rows");

// The operands every SDPA call has, forward and backward alike.
struct SdpaCommonOperands {
  const xla::ffi::AnyBuffer& q;
  const xla::ffi::AnyBuffer& k;
  const xla::ffi::AnyBuffer& v;
  const SegmentMeta& meta;
};

// Device pointers to the rows of a SegmentMeta.
struct SegmentPointers {
  void* q_lens;
  void* kv_lens;
  void* q_start;
  void* kv_start;
};
SegmentPointers MetaPointers(const SegmentMeta& meta);

// The device int32 poison flag of a call (entry S of the metadata's row 0)
// when its `poison` attribute is 1, else null. Where the flag is nonzero
// (a max_seqlen promise the traced metadata broke; jax_cp.cp.guard), the
// handler fills every row of every result with NaN after the graph.
const void* PoisonFlag(const SegmentPointers& seg, const SdpaGraphKey& key,
                       int64_t poison);

// The Q rows of a call that see at least one key, for FillUncoveredRows:
// every other row of out/stats (forward) or dq (backward) is filled, and
// every row where `poison` (PoisonFlag) is set.
CoveringSegments KeyedQueryRows(const SegmentPointers& seg,
                                const SdpaGraphKey& key, const void* poison);

// The attributes of every SDPA call, decoded by XLA as one struct (the
// struct decoding at the end of this file, whose member list follows this
// order): the handler binds `Attrs<SdpaAttrs>()`, and a call must pass
// exactly these names, as cudnn.py's _attributes does.
struct SdpaAttrs {
  int64_t segments;
  SdpaMask mask;        // an int64 scalar (the enum decoding below)
  float scale;
  int64_t max_seqlen_q;
  int64_t max_seqlen_kv;
  int64_t window_left;  // -1: no sliding window
  int64_t tiled;        // 1: SdpaGraphKey::tiled
  int64_t offset_bits;  // 32 or 64: SdpaGraphKey::offset_bits
  int64_t poison;       // 1: the metadata carry a poison flag (PoisonFlag)
};

// The backward's attributes: the common ones and `deterministic` (0 or 1:
// SdpaGraphKey::deterministic). XLA decodes a struct only from all of a
// call's attributes, hence a struct of its own.
struct SdpaBackwardAttrs {
  SdpaAttrs common;
  int64_t deterministic;
};

// The contexts every SDPA handler binds first (BindSdpaContext): the
// stream, the handler's scratch allocator and the device ordinal.
struct SdpaContext {
  cudaStream_t stream;
  xla::ffi::ScratchAllocator* scratch;
  int32_t device;
};

inline auto BindSdpaContext() {
  namespace ffi = xla::ffi;
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::ScratchAllocator>()
      .Ctx<ffi::DeviceOrdinal>();
}

// A call whose common operands and attributes passed the checks, with
// what running its graph needs (StartSdpaCall).
struct SdpaCall {
  const char* target;  // the FFI target: the prefix of every error
  SdpaContext ctx;
  SdpaGraphKey key;
  SegmentPointers seg;
  const CudaLibraries* libs;
  // PoisonFlag: the device flag, or null when the call carries none.
  const void* poison;
  // The graph's tensors by sdpa_uid: q, k, v and, for a ragged call, the
  // lengths and element offsets; the direction adds its own, then hands
  // them to RunSdpaGraph.
  std::unordered_map<int64_t, void*> ptrs;
};

// The shared part of a call once its key is final: the metadata's rows,
// the q/k/v pointers, the CUDA libraries and the ragged offsets
// (BindRaggedOperands, which launch a kernel on the stream).
xla::ffi::ErrorOr<SdpaCall> StartSdpaCall(const char* target,
                                          const SdpaContext& ctx,
                                          const SdpaCommonOperands& ops,
                                          const SdpaGraphKey& key,
                                          int64_t poison);

// Checks q/k/v, lengths, offsets and attributes and returns the graph key.
xla::ffi::ErrorOr<SdpaGraphKey> MakeSdpaKey(const char* call,
                                           SdpaDirection direction, int device,
                                           const SdpaCommonOperands& ops,
                                           const SdpaAttrs& attrs);

// `buf` must have the same dtype and dims as `like` (e.g. out vs q).
xla::ffi::Error CheckSameAs(const char* call, const char* name,
                            const xla::ffi::AnyBuffer& buf, const char* like_name,
                            const xla::ffi::AnyBuffer& like);

// `result` must be the buffer of the aliased operand `in` (the Python
// wrapper passes input_output_aliases; XLA copies first if it must).
xla::ffi::Error CheckAliased(const char* call, const char* name,
                             const xla::ffi::AnyBuffer& result,
                             const xla::ffi::AnyBuffer& in);

// `stats` must be float32 [Tq, Hq].
xla::ffi::Error CheckStats(const char* call, const char* name,
                           const xla::ffi::AnyBuffer& stats,
                           const SdpaGraphKey& key);

// The one call path of every SDPA handler, forward and backward:
//   1. MakeSdpaKey: the common operands and attributes, the graph key;
//   2. `check(SdpaGraphKey&) -> Error`: the direction's own operands and
//      results, and the key's direction fields (stats, deterministic);
//   3. StartSdpaCall;
//   4. `run(SdpaCall&) -> Error`: the direction's tensors, its graph and
//      its fills.
// An exception becomes an error naming the target (GuardFfi).
template <typename Check, typename Run>
xla::ffi::Error RunSdpaCall(const char* target, SdpaDirection direction,
                            const SdpaContext& ctx,
                            const SdpaCommonOperands& ops,
                            const SdpaAttrs& attrs, Check&& check, Run&& run) {
  return GuardFfi(target, [&]() -> xla::ffi::Error {
    auto key_or = MakeSdpaKey(target, direction, ctx.device, ops, attrs);
    if (!key_or.has_value()) return key_or.error();
    SdpaGraphKey key = *key_or;
    xla::ffi::Error e = check(key);
    if (e.failure()) return e;
    auto call_or = StartSdpaCall(target, ctx, ops, key, attrs.poison);
    if (!call_or.has_value()) return call_or.error();
    return run(*call_or);
  });
}

}  // namespace jax_cp

// The mask attribute: an int64 scalar cast to the enum (SdpaMask's
// underlying type; Python passes np.int64). The cast keeps any value;
// MakeSdpaKey rejects the ones SdpaMask does not name.
XLA_FFI_REGISTER_ENUM_ATTR_DECODING(jax_cp::SdpaMask);

// The common attributes' names, in SdpaAttrs's member order (the decoding
// builds the struct from them positionally).
#define JAX_CP_SDPA_ATTR_MEMBERS                          \
  ::xla::ffi::StructMember<int64_t>("segments"),          \
      ::xla::ffi::StructMember<jax_cp::SdpaMask>("mask"), \
      ::xla::ffi::StructMember<float>("scale"),           \
      ::xla::ffi::StructMember<int64_t>("max_seqlen_q"),  \
      ::xla::ffi::StructMember<int64_t>("max_seqlen_kv"), \
      ::xla::ffi::StructMember<int64_t>("window_left"),   \
      ::xla::ffi::StructMember<int64_t>("tiled"),         \
      ::xla::ffi::StructMember<int64_t>("offset_bits"),   \
      ::xla::ffi::StructMember<int64_t>("poison")

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_cp::SdpaAttrs,
                                      JAX_CP_SDPA_ATTR_MEMBERS);
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jax_cp::SdpaBackwardAttrs, JAX_CP_SDPA_ATTR_MEMBERS,
    ::xla::ffi::StructMember<int64_t>("deterministic"));

#undef JAX_CP_SDPA_ATTR_MEMBERS

#endif  // JAX_CP_CSRC_SDPA_FFI_COMMON_H_
