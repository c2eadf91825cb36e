// XLA FFI handler `jax_cp_assemble_kv`: the K and V buffers of a
// NO_LOAD_BALANCE straddle call, built from the received halo and the local
// chunk by copying only the rows the call reads.
//
// Operands: halo [B, H0, 2*Hkv, D] (K heads first), k and v [B, Tl, Hkv, D]
// (one dtype; Hkv*D*itemsize a multiple of 16 bytes), ranges int32 [2, B]
// (first buffer row and row count per batch entry). Results: kx and vx
// [B, R, Hkv, D], R <= H0 + Tl. Attribute: tail (int64 >= 0).
//
// Buffer row r is halo row r (r < H0) or local row r - H0. Rows
// [first, first + count) of each batch entry are copied, the next `tail`
// rows zeroed, and the rest of the results is left uninitialised: the
// straddle call's segments read only the copied rows (the zero tail covers
// whole-tile reads past a segment's end). XLA's concatenation would write
// every row: 2 * (H0 + W-1) rows per buffer where the straddling document
// needs at most W, and nothing on rank 0.
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

constexpr const char* kCall = kAssembleKvTarget;

std::string Dims(ffi::Span<const int64_t> d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) {
    s += (i ? "," : "") + std::to_string(d[i]);
  }
  return s + "]";
}

ffi::Error AssembleKv(cudaStream_t stream, int32_t device, ffi::AnyBuffer halo,
                      ffi::AnyBuffer k, ffi::AnyBuffer v,
                      ffi::Buffer<ffi::S32> ranges,
                      ffi::Result<ffi::AnyBuffer> kx,
                      ffi::Result<ffi::AnyBuffer> vx, int64_t tail) {
  return GuardFfi(kCall, [&]() -> ffi::Error {
    const auto hd = halo.dimensions();
    const auto kd = k.dimensions();
    const auto xd = kx->dimensions();
    const ffi::DataType t = k.element_type();
    if (halo.element_type() != t || v.element_type() != t ||
        kx->element_type() != t || vx->element_type() != t) {
      return Invalid(kCall, "halo, k, v, kx and vx must share one dtype");
    }
    if (hd.size() != 4 || kd.size() != 4 || xd.size() != 4) {
      return Invalid(kCall, "halo, k and kx must be rank 4 [B, T, H, D]; got "
                            "halo " + Dims(hd) + " k " + Dims(kd) + " kx " +
                                Dims(xd));
    }
    if (Dims(v.dimensions()) != Dims(kd) ||
        Dims(vx->dimensions()) != Dims(xd)) {
      return Invalid(kCall, "v must be shaped like k and vx like kx");
    }
    const int64_t batch = kd[0], halo_rows = hd[1], local_rows = kd[1],
                  rows = xd[1];
    if (hd[0] != batch || xd[0] != batch || hd[2] != 2 * kd[2] ||
        hd[3] != kd[3] || xd[2] != kd[2] || xd[3] != kd[3]) {
      return Invalid(kCall, "need halo [B, H0, 2*Hkv, D], k [B, Tl, Hkv, D], "
                            "kx [B, R, Hkv, D]; got halo " + Dims(hd) +
                                " k " + Dims(kd) + " kx " + Dims(xd));
    }
    if (rows > halo_rows + local_rows) {
      return Invalid(kCall, "kx has " + std::to_string(rows) +
                                " rows, more than halo + local = " +
                                std::to_string(halo_rows + local_rows));
    }
    const auto rd = ranges.dimensions();
    if (rd.size() != 2 || rd[0] != 2 || rd[1] != batch) {
      return Invalid(kCall, "ranges must be int32 [2, B] = [2, " +
                                std::to_string(batch) + "]; got " + Dims(rd));
    }
    if (tail < 0) return Invalid(kCall, "tail must be >= 0");
    const int64_t row_bytes = kx->size_bytes() / (batch * rows > 0
                                                      ? batch * rows : 1);
    if (batch * rows == 0) return ffi::Error::Success();
    if (row_bytes % 16 != 0) {
      return Invalid(kCall, "a row (Hkv * D elements) must be a multiple of "
                            "16 bytes; got " + std::to_string(row_bytes));
    }
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
    void* kx_ptr = kx->untyped_data();
    void* vx_ptr = vx->untyped_data();
    const void* halo_ptr = halo.untyped_data();
    const void* k_ptr = k.untyped_data();
    const void* v_ptr = v.untyped_data();
    const void* ranges_ptr = ranges.typed_data();
    long long b = batch, h0 = halo_rows, tl = local_rows, r = rows;
    long long row_vecs = row_bytes / 16, zero_tail = tail;
    void* args[] = {&kx_ptr, &vx_ptr, &halo_ptr, &k_ptr,    &v_ptr,
                    &ranges_ptr, &b, &h0,      &tl,        &r,
                    &row_vecs,  &zero_tail};
    // The row count is on the device: size the grid for the largest range
    // (grid-stride loop), capped.
    constexpr long long kThreads = 256;
    constexpr long long kMaxBlocks = 1024;
    long long blocks = (rows * row_vecs + kThreads - 1) / kThreads;
    if (blocks > kMaxBlocks) blocks = kMaxBlocks;
    return LaunchDeviceKernel(
        libs, device, kernels.assemble_kv,
        dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(batch), 2),
        dim3(static_cast<unsigned>(kThreads)), args, stream, kCall);
  });
}

}  // namespace
}  // namespace jax_cp

// No CUDA-graph trait: the first call loads the PTX on the host.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxCpAssembleKv, jax_cp::AssembleKv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()      // halo
                                  .Arg<ffi::AnyBuffer>()      // k
                                  .Arg<ffi::AnyBuffer>()      // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ranges
                                  .Ret<ffi::AnyBuffer>()      // kx
                                  .Ret<ffi::AnyBuffer>()      // vx
                                  .Attr<int64_t>("tail"));
