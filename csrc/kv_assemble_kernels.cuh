// Device code of `jax_cp_assemble_kv` (kv_assemble.cc). Part of the
// kernels.cu PTX module.
//
// Builds the K and V buffers of NO_LOAD_BALANCE's straddle call from the
// received halo and the local chunk, copying only the rows the call reads.
// With row = one token's Hkv*D elements (`row_vecs` 16-byte vectors):
//
//   halo  [B, halo_rows, 2 * row]   K heads first, then V heads
//   k, v  [B, local_rows, row]
//   kx, vx [B, rows, row]           rows <= halo_rows + local_rows
//
// Buffer row r of batch entry b is halo row r (r < halo_rows) or local row
// r - halo_rows. For every b, rows [first, first + count) are copied
// (ranges[b] = first, ranges[B + b] = count, clamped to the buffer), the
// next `tail` rows are set to zero, and every other row is left as it was.
// The zero tail keeps an attention kernel that reads whole tiles past a
// segment's end from meeting NaN bit patterns in uninitialised memory.
//
// Grid: (x blocks, B, 2); blockIdx.z picks K (0) or V (1). The copy is
// untyped: 16 bytes per thread.
#ifndef JAX_CP_CSRC_KV_ASSEMBLE_KERNELS_CUH_
#define JAX_CP_CSRC_KV_ASSEMBLE_KERNELS_CUH_

extern "C" __global__ void jax_cp_assemble_kv(
    uint4* kx, uint4* vx, const uint4* halo, const uint4* k, const uint4* v,
    const int* ranges, long long batch, long long halo_rows,
    long long local_rows, long long rows, long long row_vecs,
    long long tail) {
  const long long b = blockIdx.y;
  const bool is_v = blockIdx.z == 1;
  const long long first = min(max(static_cast<long long>(ranges[b]), 0LL),
                              rows);
  const long long count = max(static_cast<long long>(ranges[batch + b]), 0LL);
  const long long end = min(first + count, rows);
  const long long stop = min(end + tail, rows);
  uint4* dst = (is_v ? vx : kx) + b * rows * row_vecs;
  const uint4* own = (is_v ? v : k) + b * local_rows * row_vecs;
  const uint4* ring = halo + b * halo_rows * 2 * row_vecs +
                      (is_v ? row_vecs : 0);
  const long long n = (stop - first) * row_vecs;
  const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x +
                     threadIdx.x;
       i < n; i += step) {
    const long long r = first + i / row_vecs;
    const long long c = i % row_vecs;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (r < end) {
      x = r < halo_rows ? ring[r * 2 * row_vecs + c]
                        : own[(r - halo_rows) * row_vecs + c];
    }
    dst[r * row_vecs + c] = x;
  }
}

#endif  // JAX_CP_CSRC_KV_ASSEMBLE_KERNELS_CUH_
