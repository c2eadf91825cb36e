// FillUncoveredRows (clear_rows.h): launches jax_cp_clear_uncovered_rows.
#include "clear_rows.h"

#include <string>

#include "device_kernels.h"

namespace ffi = xla::ffi;

namespace jax_cp {

ffi::Error FillUncoveredRows(const CudaLibraries& libs, int device,
                             cudaStream_t stream, int64_t row_begin,
                             int64_t row_end,
                             const RowFill& a, const RowFill& b,
                             const CoveringSegments& segments,
                             const char* what) {
  if (row_end <= row_begin) return ffi::Error::Success();
  if (a.row_bytes % 4 != 0 || b.row_bytes % 4 != 0) {
    return ffi::Error::Internal(std::string("filling uncovered rows of ") +
                                what + ": rows must be whole 32-bit words");
  }
  const DeviceKernels& kernels = LoadDeviceKernels(libs);
  if (!kernels.error.empty()) {
    return ffi::Error::Internal(std::string("filling uncovered rows of ") +
                                what + ": " + kernels.error);
  }
  void* a_ptr = a.data;
  void* b_ptr = b.data;
  long long a_words = a.row_bytes / 4, b_words = b.row_bytes / 4;
  unsigned a_fill = a.fill, b_fill = b.fill;
  long long first = row_begin, n_rows = row_end, n_seg = segments.segments;
  const void* q_lens = segments.q_lens;
  const void* kv_lens = segments.kv_lens;
  const void* starts = segments.starts;
  int mode = static_cast<int>(segments.coverage);
  long long window_left = segments.window_left;
  const void* poison = segments.poison;
  void* args[] = {&a_ptr,   &a_words, &a_fill, &b_ptr,       &b_words,
                  &b_fill,  &first,   &n_rows, &q_lens,      &kv_lens,
                  &starts,  &n_seg,   &mode,   &window_left, &poison};
  constexpr long long kTile = 128;  // rows per block, as in the kernel
  const long long blocks = (row_end - row_begin + kTile - 1) / kTile;
  if (blocks > 0x7fffffffLL) {
    return ffi::Error::Internal(std::string("filling uncovered rows of ") +
                                what + ": too many rows");
  }
  return LaunchDeviceKernel(libs, device, kernels.clear_uncovered_rows,
                            dim3(static_cast<unsigned>(blocks)), dim3(256),
                            args, stream,
                            std::string("filling uncovered rows of ") + what);
}

}  // namespace jax_cp
