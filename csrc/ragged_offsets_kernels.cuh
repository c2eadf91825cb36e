// Device code of ComputeRaggedOffsets (ragged_offsets.cc). Part of the
// kernels.cu PTX module.
//
// cuDNN's ragged (THD) tensors are addressed by element offsets: where
// segment i starts, in elements of its tensor. The custom call carries
// token offsets (int32, [n] = S + 1 entries); this kernel multiplies them
// by each tensor's elements per token, in 64-bit arithmetic, into three
// rows of `out` (each `row_stride` entries apart): Q/O/dQ/dO (q_row
// elements per token), K/V/dK/dV (kv_row) and the stats (stats_row). With
// `wide` the rows are int64, otherwise int32 (the caller has checked that
// every product fits).
#ifndef JAX_CP_CSRC_RAGGED_OFFSETS_KERNELS_CUH_
#define JAX_CP_CSRC_RAGGED_OFFSETS_KERNELS_CUH_

extern "C" __global__ void jax_cp_ragged_offsets(
    const int* q_start, const int* kv_start, long long n, long long q_row,
    long long kv_row, long long stats_row, void* out, long long row_stride,
    int wide) {
  const long long i =
      static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const long long q = q_start[i], kv = kv_start[i];
  const long long values[3] = {q * q_row, kv * kv_row, q * stats_row};
  for (int r = 0; r < 3; ++r) {
    if (wide) {
      static_cast<long long*>(out)[r * row_stride + i] = values[r];
    } else {
      static_cast<int*>(out)[r * row_stride + i] = static_cast<int>(values[r]);
    }
  }
}

#endif  // JAX_CP_CSRC_RAGGED_OFFSETS_KERNELS_CUH_
