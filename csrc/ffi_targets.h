// The contract between the extension and jax_cp/attention/cudnn.py: the FFI
// target names, the handler symbols registered under them, and the integer
// codes of the attributes. module.cc exports all of it to Python
// (FFI_TARGETS, MASK_CODES, MERGE_OP_CODES, ...), which reads them from there.
#ifndef JAX_CP_CSRC_FFI_TARGETS_H_
#define JAX_CP_CSRC_FFI_TARGETS_H_

#include <cstdint>

#include "xla/ffi/api/ffi.h"

// The handlers (defined at global scope in sdpa_fwd.cc, sdpa_bwd.cc and
// row_merge.cc).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxCpCudnnSdpaForward);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxCpCudnnSdpaForwardOut);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxCpCudnnSdpaForwardInto);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxCpCudnnSdpaBackward);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxCpCudnnSdpaBackwardInto);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxCpMergeRows);

namespace jax_cp {

// FFI target names (also the prefix of each handler's error messages).
inline constexpr char kSdpaForwardTarget[] = "jax_cp_cudnn_sdpa_fwd";
inline constexpr char kSdpaForwardOutTarget[] = "jax_cp_cudnn_sdpa_fwd_out";
inline constexpr char kSdpaForwardIntoTarget[] = "jax_cp_cudnn_sdpa_fwd_into";
inline constexpr char kSdpaBackwardTarget[] = "jax_cp_cudnn_sdpa_bwd";
inline constexpr char kSdpaBackwardIntoTarget[] = "jax_cp_cudnn_sdpa_bwd_into";
inline constexpr char kMergeRowsTarget[] = "jax_cp_merge_rows";

// Values of the SDPA calls' `mask` attribute.
enum class SdpaMask : int64_t {
  kNoMask = 0,
  kCausalTopLeft = 1,
  kCausalBottomRight = 2,
};

// Values of jax_cp_merge_rows' `op` attribute.
enum class MergeOp : int64_t {
  kAdd = 0,
  kMax = 1,
};

// The largest head dim the SDPA handlers take (a positive multiple of 8).
inline constexpr int64_t kMaxHeadDim = 256;

// The SDPA calls' segment metadata operand is int32 [kSegmentMetaRows, W],
// W >= S + 1 a multiple of kSegmentMetaWidthMultiple (see SegmentMeta).
inline constexpr int64_t kSegmentMetaRows = 4;
inline constexpr int64_t kSegmentMetaWidthMultiple = 4;

// Values of the SDPA calls' `offset_bits` attribute: the width of the
// ragged element offsets the handler builds from the token offsets and
// hands to cuDNN (ragged_offsets.h).
inline constexpr int64_t kRaggedOffsetBits32 = 32;
inline constexpr int64_t kRaggedOffsetBits64 = 64;

}  // namespace jax_cp

#endif  // JAX_CP_CSRC_FFI_TARGETS_H_
