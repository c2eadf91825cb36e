// Small device kernels of the extension (row_merge.cu, embedded as PTX):
// the `jax_cp_merge_rows` FFI handler (row_merge.cc) and a float fill the
// SDPA forward uses for its log-sum-exp output.
#ifndef JAX_CP_CSRC_ROW_MERGE_H_
#define JAX_CP_CSRC_ROW_MERGE_H_

#include <cuda_runtime_api.h>

#include <cstddef>

#include "cuda_libs.h"
#include "xla/ffi/api/ffi.h"

namespace jax_cp {

// Enqueues p[0:count] = value on `stream` (device `device`); `what` names
// the buffer in errors.
xla::ffi::Error FillF32Async(const CudaLibraries& libs, int device, float* p,
                             size_t count, float value, cudaStream_t stream,
                             const char* what);

}  // namespace jax_cp

#endif  // JAX_CP_CSRC_ROW_MERGE_H_
