// Device code of `jax_cp_merge_rows` (row_merge.cc). Part of the kernels.cu
// PTX module.
//
// dst [B, Td, X] and src [B, Ts, X] flattened: for every b, t < Ts, x < X,
//   dst[b, offset + t, x] = op(dst[b, offset + t, x], src[b, t, x])
// computed in float32, op = add or max. `dst_batch` and `src_batch` are the
// per-batch element counts Td*X and Ts*X; `offset` is offset*X elements.
// Batch entry b is blockIdx.y. The `_vec` kernels move 16 bytes per thread
// and need src_batch, dst_batch and offset to be multiples of 16 bytes'
// worth of elements (the launcher checks).
#ifndef JAX_CP_CSRC_ROW_MERGE_KERNELS_CUH_
#define JAX_CP_CSRC_ROW_MERGE_KERNELS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace jax_cp_merge {

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) {
  return __float2half_rn(x);
}

template <typename T, bool kMax>
__device__ __forceinline__ T Combine(T a, T b) {
  const float x = ToFloat(a), y = ToFloat(b);
  return FromFloat<T>(kMax ? fmaxf(x, y) : x + y);
}

template <typename T, bool kMax>
__device__ __forceinline__ void MergeRows(T* dst, const T* src,
                                          long long dst_batch,
                                          long long src_batch,
                                          long long offset) {
  const long long b = blockIdx.y;
  T* d = dst + b * dst_batch + offset;
  const T* s = src + b * src_batch;
  const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x +
                     threadIdx.x;
       i < src_batch; i += step) {
    d[i] = Combine<T, kMax>(d[i], s[i]);
  }
}

// 16 bytes per thread; counts and offset in elements, multiples of
// 16 / sizeof(T).
template <typename T, bool kMax>
__device__ __forceinline__ void MergeRowsVec(T* dst, const T* src,
                                             long long dst_batch,
                                             long long src_batch,
                                             long long offset) {
  constexpr int kPer = 16 / sizeof(T);
  union Pack {
    uint4 raw;
    T v[kPer];
  };
  const long long b = blockIdx.y;
  uint4* d = reinterpret_cast<uint4*>(dst + b * dst_batch + offset);
  const uint4* s = reinterpret_cast<const uint4*>(src + b * src_batch);
  const long long n = src_batch / kPer;
  const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x +
                     threadIdx.x;
       i < n; i += step) {
    Pack x, y;
    x.raw = d[i];
    y.raw = s[i];
#pragma unroll
    for (int j = 0; j < kPer; ++j) x.v[j] = Combine<T, kMax>(x.v[j], y.v[j]);
    d[i] = x.raw;
  }
}

}  // namespace jax_cp_merge

#define JAX_CP_MERGE_KERNEL(NAME, T, IS_MAX)                                 \
  extern "C" __global__ void NAME(T* dst, const T* src, long long dst_batch, \
                                  long long src_batch, long long offset) {   \
    jax_cp_merge::MergeRows<T, IS_MAX>(dst, src, dst_batch, src_batch,      \
                                       offset);                             \
  }                                                                          \
  extern "C" __global__ void NAME##_vec(T* dst, const T* src,               \
                                        long long dst_batch,                 \
                                        long long src_batch,                 \
                                        long long offset) {                  \
    jax_cp_merge::MergeRowsVec<T, IS_MAX>(dst, src, dst_batch, src_batch,   \
                                          offset);                          \
  }

JAX_CP_MERGE_KERNEL(jax_cp_merge_add_f32, float, false)
JAX_CP_MERGE_KERNEL(jax_cp_merge_max_f32, float, true)
JAX_CP_MERGE_KERNEL(jax_cp_merge_add_bf16, __nv_bfloat16, false)
JAX_CP_MERGE_KERNEL(jax_cp_merge_max_bf16, __nv_bfloat16, true)
JAX_CP_MERGE_KERNEL(jax_cp_merge_add_f16, __half, false)
JAX_CP_MERGE_KERNEL(jax_cp_merge_max_f16, __half, true)

#endif  // JAX_CP_CSRC_ROW_MERGE_KERNELS_CUH_
