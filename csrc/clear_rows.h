// Filling the rows of an SDPA output that no ragged segment covers (the
// rows cuDNN leaves unwritten), instead of clearing the whole buffer first.
#ifndef JAX_CP_CSRC_CLEAR_ROWS_H_
#define JAX_CP_CSRC_CLEAR_ROWS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda_libs.h"
#include "xla/ffi/api/ffi.h"

namespace jax_cp {

// Which rows a segment covers (see clear_rows_kernels.cuh).
enum class Coverage : int {
  kQueryRows = 0,         // [q_off, q_off + q_len)
  kSeenKeyRows = 1,       // the KV range, if the segment has a query
  kSeenKeyRowsTopLeft = 2,  // its first min(kv_len, q_len) rows, likewise
  kKeyedQueryRows = 3,      // Q rows that see a key: no mask, top-left
  kKeyedQueryRowsBottomRight = 4,  // Q rows that see a key: bottom-right
  kAllRows = 5,  // every row: nothing is filled unless the call is poisoned
};

// The 32-bit pattern a poisoned call writes into every row of its results:
// a NaN in float32 and in each half as bfloat16 or float16.
constexpr uint32_t kPoisonWord = 0xffffffffu;

// A buffer of `rows` rows of `row_bytes` bytes (a multiple of 4), whose
// uncovered rows get the 32-bit pattern `fill`.
struct RowFill {
  void* data = nullptr;
  int64_t row_bytes = 0;
  uint32_t fill = 0;
};

// The segments: device int32 arrays of `segments` entries (q_lens, kv_lens,
// and `starts`, the token offset of each segment's first row).
struct CoveringSegments {
  const void* q_lens;
  const void* kv_lens;
  const void* starts;
  int64_t segments;
  Coverage coverage;
  int64_t window_left = -1;  // kKeyedQueryRows: the window, -1 for none
  // Device int32 or null: where it is nonzero, every row in the range gets
  // kPoisonWord instead (a broken max_seqlen promise, SdpaAttrs::poison).
  const void* poison = nullptr;
};

// Enqueues on `stream` (device `device`): every row in [row_begin, row_end)
// of `a` and `b` (b may have null data) that no segment covers gets its
// buffer's fill; every row gets kPoisonWord where `segments.poison` holds a
// nonzero flag. `what` names the buffers in errors.
xla::ffi::Error FillUncoveredRows(const CudaLibraries& libs, int device,
                                  cudaStream_t stream, int64_t row_begin,
                                  int64_t row_end,
                                  const RowFill& a, const RowFill& b,
                                  const CoveringSegments& segments,
                                  const char* what);

}  // namespace jax_cp

#endif  // JAX_CP_CSRC_CLEAR_ROWS_H_
