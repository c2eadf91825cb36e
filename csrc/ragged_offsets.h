// The element offsets of a ragged SDPA call, built on the device from the
// token offsets the custom call carries (SegmentMeta).
#ifndef JAX_CP_CSRC_RAGGED_OFFSETS_H_
#define JAX_CP_CSRC_RAGGED_OFFSETS_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <unordered_map>

#include "cuda_libs.h"
#include "sdpa_ffi_common.h"
#include "sdpa_graph.h"
#include "xla/ffi/api/ffi.h"

namespace jax_cp {

// Device arrays of key.segments + 1 element offsets each, int32 or int64 as
// key.offset_bits says: Q (also O, dO, dQ), K (also V, dK, dV), stats.
struct RaggedOffsets {
  void* q = nullptr;
  void* kv = nullptr;
  void* stats = nullptr;
};

// Allocates the three arrays from `scratch` (they live as long as the
// call) and enqueues the kernel that fills them on `stream`.
xla::ffi::ErrorOr<RaggedOffsets> ComputeRaggedOffsets(
    const char* call, const CudaLibraries& libs, int device,
    cudaStream_t stream, xla::ffi::ScratchAllocator& scratch,
    const SegmentPointers& seg, const SdpaGraphKey& key);

// The ragged operands of a call's graph: the lengths (from `seg`) and the
// element offsets (ComputeRaggedOffsets) bound to their uids in `ptrs`.
// Nothing for a tiled call, whose dense graph has none.
xla::ffi::Error BindRaggedOperands(const char* call, const CudaLibraries& libs,
                                   int device, cudaStream_t stream,
                                   xla::ffi::ScratchAllocator& scratch,
                                   const SegmentPointers& seg,
                                   const SdpaGraphKey& key,
                                   std::unordered_map<int64_t, void*>& ptrs);

}  // namespace jax_cp

#endif  // JAX_CP_CSRC_RAGGED_OFFSETS_H_
