// Operand checks shared by the forward and backward FFI handlers. The Python
// wrapper already validates everything; these checks turn a mismatch (e.g. a
// hand-written custom call) into an InvalidArgument error instead of a bad
// memory access.
#ifndef JAX_CP_CSRC_SDPA_FFI_COMMON_H_
#define JAX_CP_CSRC_SDPA_FFI_COMMON_H_

#include <cstdint>
#include <string>
#include <utility>

#include "clear_rows.h"
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

// The attributes of both custom calls.
struct SdpaAttributes {
  int64_t segments;
  int64_t mask;
  float scale;
  int64_t max_seqlen_q;
  int64_t max_seqlen_kv;
  int64_t window_left;  // -1: no sliding window
  int64_t tiled;        // 1: SdpaGraphKey::tiled
  int64_t offset_bits;  // 32 or 64: SdpaGraphKey::offset_bits
  int64_t poison;       // 1: the metadata carry a poison flag (PoisonFlag)
};

// The contexts every SDPA handler binds first (stream, scratch allocator,
// device ordinal); the handler then binds its buffers.
inline auto BindSdpaContext() {
  namespace ffi = xla::ffi;
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::ScratchAllocator>()
      .Ctx<ffi::DeviceOrdinal>();
}

// Appends the attributes every SDPA handler binds last (SdpaAttributes).
template <typename Binding>
auto BindSdpaAttributes(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Attr<int64_t>("segments")
      .template Attr<int64_t>("mask")
      .template Attr<float>("scale")
      .template Attr<int64_t>("max_seqlen_q")
      .template Attr<int64_t>("max_seqlen_kv")
      .template Attr<int64_t>("window_left")
      .template Attr<int64_t>("tiled")
      .template Attr<int64_t>("offset_bits")
      .template Attr<int64_t>("poison");
}

// Checks q/k/v, lengths, offsets and attributes and returns the graph key.
xla::ffi::ErrorOr<SdpaGraphKey> MakeSdpaKey(const char* call,
                                           SdpaDirection direction, int device,
                                           const SdpaCommonOperands& ops,
                                           const SdpaAttributes& attrs);

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

}  // namespace jax_cp

#endif  // JAX_CP_CSRC_SDPA_FFI_COMMON_H_
