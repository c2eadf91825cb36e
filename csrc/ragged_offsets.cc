// ComputeRaggedOffsets (ragged_offsets.h): launches jax_cp_ragged_offsets.
#include "ragged_offsets.h"

#include <string>

#include "device_kernels.h"
#include "ffi_errors.h"

namespace ffi = xla::ffi;

namespace jax_cp {

ffi::ErrorOr<RaggedOffsets> ComputeRaggedOffsets(
    const char* call, const CudaLibraries& libs, int device,
    cudaStream_t stream, ffi::ScratchAllocator& scratch,
    const SegmentPointers& seg, const SdpaGraphKey& key) {
  const std::string what = std::string(call) + ": ragged offsets";
  const DeviceKernels& kernels = LoadDeviceKernels(libs);
  if (!kernels.error.empty()) {
    return ffi::Error::Internal(what + ": " + kernels.error);
  }
  const bool wide = key.offset_bits == 64;
  const int64_t entry = wide ? 8 : 4;
  const int64_t n = key.segments + 1;
  // Each row starts 16-byte aligned, as cuDNN's tensors should.
  const int64_t per_16 = 16 / entry;
  const int64_t row_stride = (n + per_16 - 1) / per_16 * per_16;
  std::optional<void*> buf =
      scratch.Allocate(static_cast<size_t>(3 * row_stride * entry), 16);
  if (!buf.has_value()) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      what + ": allocating " +
                          std::to_string(3 * row_stride * entry) +
                          " bytes of scratch failed");
  }
  char* base = static_cast<char*>(*buf);
  RaggedOffsets offsets{base, base + row_stride * entry,
                        base + 2 * row_stride * entry};

  const void* q_start = seg.q_start;
  const void* kv_start = seg.kv_start;
  long long count = n, q_row = key.heads_q * key.head_dim,
            kv_row = key.heads_kv * key.head_dim, stats_row = key.heads_q,
            stride = row_stride;
  void* out = base;
  int wide_arg = wide ? 1 : 0;
  void* args[] = {&q_start, &kv_start, &count, &q_row,  &kv_row,
                  &stats_row, &out,    &stride, &wide_arg};
  constexpr long long kThreads = 256;
  const long long blocks = (count + kThreads - 1) / kThreads;
  ffi::Error e = LaunchDeviceKernel(
      libs, device, kernels.ragged_offsets,
      dim3(static_cast<unsigned>(blocks)), dim3(kThreads), args, stream, what);
  if (e.failure()) return e;
  return offsets;
}

ffi::Error BindRaggedOperands(const char* call, const CudaLibraries& libs,
                              int device, cudaStream_t stream,
                              ffi::ScratchAllocator& scratch,
                              const SegmentPointers& seg,
                              const SdpaGraphKey& key,
                              std::unordered_map<int64_t, void*>& ptrs) {
  if (key.tiled) return ffi::Error::Success();
  auto off_or =
      ComputeRaggedOffsets(call, libs, device, stream, scratch, seg, key);
  if (!off_or.has_value()) return off_or.error();
  const RaggedOffsets& off = *off_or;
  ptrs.insert({{sdpa_uid::kSeqLenQ, seg.q_lens},
               {sdpa_uid::kSeqLenKv, seg.kv_lens},
               {sdpa_uid::kOffsetQ, off.q},
               {sdpa_uid::kOffsetO, off.q},
               {sdpa_uid::kOffsetK, off.kv},
               {sdpa_uid::kOffsetV, off.kv}});
  if (key.stats) ptrs.insert({sdpa_uid::kOffsetStats, off.stats});
  return ffi::Error::Success();
}

}  // namespace jax_cp
