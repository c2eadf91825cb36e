// Device code of FillUncoveredRows (clear_rows.cc). Part of the kernels.cu
// PTX module.
//
// cuDNN's ragged (THD) SDPA writes only the rows its segments cover. The
// other rows of an output (padding tokens, rows a later call fills, KV rows
// no query reads) must hold a defined value: 0 (out, dQ, dK, dV) or -inf
// (the log-sum-exp). Clearing the whole buffer first costs a pass over it;
// this kernel writes only the rows no segment covers, usually none.
//
// Only rows [first_row, rows) are considered (a call may leave the others to
// a later call). One block per tile of 128 rows. The block marks the rows of
// its tile that
// a segment covers in a shared bitmap (every thread tests a stride of the S
// segments), then one warp per uncovered row fills it. Up to two buffers of
// the same rows are filled at once (out and stats), each with its own
// 32-bit pattern and row length in 32-bit words.
//
// Segment s (q = q_len[s], kv = kv_len[s]) covers rows
// [start[s] + skip, start[s] + n) with skip = 0 except in mode 4:
//   mode 0 (Q rows):                        n = q
//   mode 1 (KV rows, no mask or
//           bottom-right causal):           n = q > 0 ? kv : 0
//   mode 2 (KV rows, top-left causal):      n = q > 0 ? min(kv, q) : 0
//   mode 3 (Q rows that see a key, no mask
//           or top-left causal):            n = kv > 0 ? q : 0, and with a
//                                           window of `window_left` keys
//                                           min(q, kv + window_left)
//   mode 4 (Q rows that see a key,
//           bottom-right causal):           n = q, skip = clamp(q - kv, 0, q)
// Modes 1 and 2 count only KV rows some query sees: the backward surely
// writes their dK/dV; rows no query sees may be skipped by the kernel.
// Modes 3 and 4 count only Q rows that see at least one key: cuDNN writes
// the others too (a softmax over no score), so the fill runs after it and
// gives them 0 and -inf, as for rows outside every segment. A bottom-right
// row j sees its diagonal key j + kv - q whenever that is >= 0, window or
// not; a top-left row j sees keys [j - window_left, j] of [0, kv).
//   mode 5 (every row):                     nothing to fill
// With `poison` non-null and *poison nonzero (a broken max_seqlen promise),
// every row of the range gets 0xffffffff words instead, a NaN in every
// float format: the call's results are all NaN. Mode 5 exists for this: a
// call that fills no row launches it only to poison.
#ifndef JAX_CP_CSRC_CLEAR_ROWS_KERNELS_CUH_
#define JAX_CP_CSRC_CLEAR_ROWS_KERNELS_CUH_

extern "C" __global__ void jax_cp_clear_uncovered_rows(
    unsigned* a, long long a_row_words, unsigned a_fill, unsigned* b,
    long long b_row_words, unsigned b_fill, long long first_row,
    long long rows,
    const int* q_lens, const int* kv_lens, const int* starts,
    long long segments, int mode, long long window_left, const int* poison) {
  constexpr int kTile = 128;
  __shared__ unsigned covered[kTile / 32];
  const long long t0 = first_row + static_cast<long long>(blockIdx.x) * kTile;
  const int lane = threadIdx.x % 32;
  const int warps = blockDim.x / 32;
  if (poison != nullptr && *poison != 0) {
    for (int r = threadIdx.x / 32; r < kTile && t0 + r < rows; r += warps) {
      const long long row = t0 + r;
      for (long long i = lane; i < a_row_words; i += 32) {
        a[row * a_row_words + i] = 0xffffffffu;
      }
      if (b != nullptr) {
        for (long long i = lane; i < b_row_words; i += 32) {
          b[row * b_row_words + i] = 0xffffffffu;
        }
      }
    }
    return;
  }
  if (mode == 5) return;
  if (threadIdx.x < kTile / 32) covered[threadIdx.x] = 0u;
  __syncthreads();
  for (long long s = threadIdx.x; s < segments; s += blockDim.x) {
    const long long q = q_lens[s], kv = kv_lens[s];
    long long n = q, skip = 0;
    if (mode == 1 || mode == 2) {
      n = q > 0 ? kv : 0;
      if (mode == 2 && q < n) n = q;
    } else if (mode == 3) {
      n = kv > 0 ? q : 0;
      if (window_left >= 0 && kv + window_left < n) n = kv + window_left;
    } else if (mode == 4) {
      skip = min(max(q - kv, 0LL), q);
    }
    if (n <= skip) continue;
    const long long start = starts[s] + skip;
    n -= skip;
    const long long lo = max(start, t0) - t0;
    const long long hi = min(start + n, t0 + kTile) - t0;
    if (lo >= hi) continue;
    for (long long w = lo / 32; w * 32 < hi; ++w) {
      const long long b0 = max(lo, w * 32) - w * 32;
      const long long b1 = min(hi, w * 32 + 32) - w * 32;
      const unsigned mask = (b1 - b0 == 32)
                                ? 0xffffffffu
                                : (((1u << (b1 - b0)) - 1u) << b0);
      atomicOr(&covered[w], mask);
    }
  }
  __syncthreads();
  for (int r = threadIdx.x / 32; r < kTile; r += warps) {
    const long long row = t0 + r;
    if (row >= rows || (covered[r / 32] >> (r % 32)) & 1u) continue;
    for (long long i = lane; i < a_row_words; i += 32) {
      a[row * a_row_words + i] = a_fill;
    }
    if (b != nullptr) {
      for (long long i = lane; i < b_row_words; i += 32) {
        b[row * b_row_words + i] = b_fill;
      }
    }
  }
}

#endif  // JAX_CP_CSRC_CLEAR_ROWS_KERNELS_CUH_
