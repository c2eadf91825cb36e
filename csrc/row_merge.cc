// XLA FFI handler `jax_cp_merge_rows`: merge a few rows into a buffer in
// place.
//
// Operands: dst [B, Td, ...] and src [B, Ts, ...] (same dtype: f32, bf16 or
// f16; same leading and trailing dims). Result: out, which must be dst's
// buffer (the Python wrapper aliases operand 0 to result 0). Attributes:
// row_offset (int64, 0 <= row_offset <= Td - Ts) and op (int64: 0 add,
// 1 max). Rows [row_offset, row_offset + Ts) of every batch entry become
// op(dst, src), computed in float32; every other element is left untouched.
//
// This replaces "pad the small part to full size and add" (a pass over the
// whole buffer) and XLA's dynamic-update-slice, which copies a custom call's
// result before updating it: merging the small straddle outputs of context
// parallel attention then costs time proportional to their size only.
//
// The kernels are in row_merge_kernels.cuh (the kernels.cu PTX module, see
// device_kernels.h).
#include <cstdint>
#include <string>


#include "cuda_libs.h"
#include "device_kernels.h"
#include "ffi_errors.h"
#include "ffi_targets.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_cp {

namespace {

constexpr const char* kCall = kMergeRowsTarget;
constexpr int kElementBytes[kKernelDtypes] = {4, 2, 2};

int DtypeIndex(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return 0;
    case ffi::DataType::BF16: return 1;
    case ffi::DataType::F16: return 2;
    default: return -1;
  }
}

ffi::Error MergeRows(cudaStream_t stream, int32_t device, ffi::AnyBuffer dst,
                     ffi::AnyBuffer src, ffi::Result<ffi::AnyBuffer> out,
                     int64_t row_offset, int64_t op) {
  return GuardFfi(kCall, [&]() -> ffi::Error {
    const auto dd = dst.dimensions();
    const auto sd = src.dimensions();
    const int dtype = DtypeIndex(dst.element_type());
    if (dtype < 0 || src.element_type() != dst.element_type() ||
        out->element_type() != dst.element_type()) {
      return Invalid(kCall, "dst, src and out must share one dtype: "
                            "float32, bfloat16 or float16");
    }
    if (dd.size() < 2 || sd.size() != dd.size() || sd[0] != dd[0]) {
      return Invalid(kCall, "dst and src must be [B, T, ...] with the same "
                            "rank and B");
    }
    int64_t inner = 1;
    for (size_t i = 2; i < dd.size(); ++i) {
      if (sd[i] != dd[i]) {
        return Invalid(kCall, "dst and src trailing dims differ");
      }
      inner *= dd[i];
    }
    if (row_offset < 0 || row_offset + sd[1] > dd[1]) {
      return Invalid(kCall, "need 0 <= row_offset <= Td - Ts; got "
                            "row_offset=" + std::to_string(row_offset) +
                                " Td=" + std::to_string(dd[1]) +
                                " Ts=" + std::to_string(sd[1]));
    }
    if (op != static_cast<int64_t>(MergeOp::kAdd) &&
        op != static_cast<int64_t>(MergeOp::kMax)) {
      return Invalid(kCall, "op must be 0 (add) or 1 (max); got " +
                                std::to_string(op));
    }
    if (out->untyped_data() != dst.untyped_data()) {
      return Invalid(kCall, "out must alias dst (call it with "
                            "input_output_aliases={0: 0})");
    }
    const long long batch = dd[0];
    long long dst_batch = dd[1] * inner;
    long long src_batch = sd[1] * inner;
    long long offset = row_offset * inner;
    if (batch * src_batch == 0) return ffi::Error::Success();
    if (batch > 65535) {
      return Invalid(kCall, "batch (dim 0) must be <= 65535");
    }

    auto libs_or = GetCudaLibraries();
    if (!libs_or.has_value()) return libs_or.error();
    const CudaLibraries& libs = **libs_or;
    const DeviceKernels& kernels = LoadDeviceKernels(libs);
    if (!kernels.error.empty()) {
      return ffi::Error::Internal(std::string(kCall) + ": " + kernels.error);
    }
    void* dst_ptr = dst.untyped_data();
    const void* src_ptr = src.untyped_data();
    void* args[] = {&dst_ptr, &src_ptr, &dst_batch, &src_batch, &offset};
    // 16 bytes per thread when every per-batch start is 16-byte aligned
    // (XLA's buffers are).
    const long long per = 16 / kElementBytes[dtype];
    const bool vec = src_batch % per == 0 && dst_batch % per == 0 &&
                     offset % per == 0 &&
                     reinterpret_cast<uintptr_t>(dst_ptr) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(src_ptr) % 16 == 0;
    constexpr long long kThreads = 256;
    constexpr long long kMaxBlocks = 4096;  // per batch entry; grid-stride
    const long long items = vec ? src_batch / per : src_batch;
    long long blocks = (items + kThreads - 1) / kThreads;
    if (blocks > kMaxBlocks) blocks = kMaxBlocks;
    return LaunchDeviceKernel(
        libs, device, kernels.merge[dtype][op][vec ? 1 : 0],
        dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(batch)),
        dim3(static_cast<unsigned>(kThreads)), args, stream, kCall);
  });
}

}  // namespace
}  // namespace jax_cp

// No CUDA-graph trait: the first call loads the PTX on the host.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxCpMergeRows, jax_cp::MergeRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // dst
                                  .Arg<ffi::AnyBuffer>()  // src
                                  .Ret<ffi::AnyBuffer>()  // out (= dst)
                                  .Attr<int64_t>("row_offset")
                                  .Attr<int64_t>("op"));
