#include "sdpa_ffi_common.h"

#include <cstring>
#include <sstream>
#include <utility>

#include "ffi_errors.h"
#include "ragged_offsets.h"

namespace ffi = xla::ffi;

namespace jax_cp {
namespace {

std::string DimsToString(ffi::AnyBuffer::Dimensions dims) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < dims.size(); ++i) os << (i ? "," : "") << dims[i];
  os << "]";
  return os.str();
}

bool SameDims(ffi::AnyBuffer::Dimensions a, ffi::AnyBuffer::Dimensions b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return false;
  return true;
}

constexpr int64_t kInt32Limit = int64_t{1} << 31;

}  // namespace

ffi::ErrorOr<SdpaGraphKey> MakeSdpaKey(const char* call,
                                       SdpaDirection direction, int device,
                                       const SdpaCommonOperands& ops,
                                       const SdpaAttrs& attrs) {
  const auto qd = ops.q.dimensions();
  const auto kd = ops.k.dimensions();
  const auto vd = ops.v.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || vd.size() != 3) {
    return Invalid(call, "q, k, v must be rank 3 [T, H, D]; got q" +
                             DimsToString(qd) + " k" + DimsToString(kd) +
                             " v" + DimsToString(vd));
  }
  const ffi::DataType dtype = ops.q.element_type();
  if (dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16) {
    return Invalid(call, "q must be bfloat16 or float16");
  }
  if (ops.k.element_type() != dtype || ops.v.element_type() != dtype) {
    return Invalid(call, "q, k and v must have the same dtype");
  }
  if (!SameDims(kd, vd) || qd[2] != kd[2]) {
    return Invalid(call, "k and v must have equal shapes and the head dim of "
                         "q; got q" + DimsToString(qd) + " k" +
                         DimsToString(kd) + " v" + DimsToString(vd));
  }
  SdpaGraphKey key;
  key.device = device;
  key.direction = direction;
  key.tokens_q = qd[0];
  key.heads_q = qd[1];
  key.head_dim = qd[2];
  key.tokens_kv = kd[0];
  key.heads_kv = kd[1];
  key.io_type = dtype == ffi::DataType::BF16 ? SdpaIoType::kBFloat16
                                             : SdpaIoType::kFloat16;
  if (key.heads_kv <= 0 || key.heads_q % key.heads_kv != 0) {
    return Invalid(call, "Hq must be a multiple of Hkv; got Hq=" +
                             std::to_string(key.heads_q) +
                             " Hkv=" + std::to_string(key.heads_kv));
  }
  if (key.head_dim % 8 != 0 || key.head_dim <= 0 ||
      key.head_dim > kMaxHeadDim) {
    return Invalid(call, "head dim must be a positive multiple of 8, <= " +
                             std::to_string(kMaxHeadDim) + "; got " +
                             std::to_string(key.head_dim));
  }
  if (attrs.offset_bits != kRaggedOffsetBits32 &&
      attrs.offset_bits != kRaggedOffsetBits64) {
    return Invalid(call, "offset_bits must be 32 or 64; got " +
                             std::to_string(attrs.offset_bits));
  }
  key.offset_bits = attrs.offset_bits;
  // Token offsets are int32 (SegmentMeta); element offsets are int32 only
  // when every one of them fits.
  if (key.tokens_q >= kInt32Limit || key.tokens_kv >= kInt32Limit) {
    return Invalid(call, "token counts must be < 2^31; got q" +
                             DimsToString(qd) + " k" + DimsToString(kd));
  }
  if (key.offset_bits == kRaggedOffsetBits32 &&
      (key.tokens_q * key.heads_q * key.head_dim >= kInt32Limit ||
       key.tokens_kv * key.heads_kv * key.head_dim >= kInt32Limit)) {
    return Invalid(call, "32-bit element offsets overflow for q" +
                             DimsToString(qd) + " k" + DimsToString(kd) +
                             "; the call needs offset_bits = 64");
  }

  key.segments = attrs.segments;
  const auto md = ops.meta.dimensions();
  if (key.segments < 1 || md.size() != 2 || md[0] != kSegmentMetaRows ||
      md[1] < key.segments + 1 || md[1] % kSegmentMetaWidthMultiple != 0) {
    return Invalid(call, "expected segments S >= 1 and metadata int32 [4, W] "
                         "with W >= S + 1 a multiple of 4; got S=" +
                             std::to_string(key.segments) + " meta" +
                             DimsToString(md));
  }

  // The attribute's decoding casts any int64 to the enum.
  const int64_t mask_code = static_cast<int64_t>(attrs.mask);
  if (attrs.mask != SdpaMask::kNoMask &&
      attrs.mask != SdpaMask::kCausalTopLeft &&
      attrs.mask != SdpaMask::kCausalBottomRight) {
    return Invalid(call, "mask must be 0 (no_mask), 1 (causal_top_left) or 2 "
                         "(causal_bottom_right); got " +
                             std::to_string(mask_code));
  }
  key.mask = attrs.mask;
  std::memcpy(&key.scale_bits, &attrs.scale, sizeof(float));
  if (attrs.max_seqlen_q < 1 || attrs.max_seqlen_kv < 1 ||
      attrs.max_seqlen_q > key.tokens_q ||
      attrs.max_seqlen_kv > key.tokens_kv) {
    return Invalid(call, "need 1 <= max_seqlen_q <= Tq and 1 <= max_seqlen_kv "
                         "<= Tkv; got max_seqlen_q=" +
                             std::to_string(attrs.max_seqlen_q) +
                             " max_seqlen_kv=" +
                             std::to_string(attrs.max_seqlen_kv) +
                             " Tq=" + std::to_string(key.tokens_q) +
                             " Tkv=" + std::to_string(key.tokens_kv));
  }
  key.max_seqlen_q = attrs.max_seqlen_q;
  key.max_seqlen_kv = attrs.max_seqlen_kv;
  // cuDNN takes the band's left bound as the int window_left + 1.
  if (attrs.window_left < -1 ||
      (attrs.window_left >= 0 && key.mask == SdpaMask::kNoMask) ||
      attrs.window_left >= kInt32Limit - 1) {
    return Invalid(call, "window_left must be -1 (no window) or a causal "
                         "mask's left bound in [0, 2^31 - 1); got " +
                             std::to_string(attrs.window_left) + " with mask " +
                             std::to_string(mask_code));
  }
  key.window_left = attrs.window_left;
  if (attrs.tiled != 0 && attrs.tiled != 1) {
    return Invalid(call, "tiled must be 0 or 1; got " +
                             std::to_string(attrs.tiled));
  }
  key.tiled = attrs.tiled == 1;
  if (attrs.poison != 0 && attrs.poison != 1) {
    return Invalid(call, "poison must be 0 or 1; got " +
                             std::to_string(attrs.poison));
  }
  if (key.tiled && (key.mask != SdpaMask::kCausalTopLeft ||
                    key.segments * key.max_seqlen_q != key.tokens_q ||
                    key.segments * key.max_seqlen_kv != key.tokens_kv)) {
    return Invalid(call, "a tiled call needs the top-left causal mask and "
                         "S * max_seqlen == T for q and kv; got mask " +
                             std::to_string(mask_code) + " S=" +
                             std::to_string(key.segments) + " max_seqlen_q=" +
                             std::to_string(key.max_seqlen_q) +
                             " max_seqlen_kv=" +
                             std::to_string(key.max_seqlen_kv) + " Tq=" +
                             std::to_string(key.tokens_q) + " Tkv=" +
                             std::to_string(key.tokens_kv));
  }
  return key;
}

ffi::ErrorOr<SdpaCall> StartSdpaCall(const char* target,
                                     const SdpaContext& ctx,
                                     const SdpaCommonOperands& ops,
                                     const SdpaGraphKey& key,
                                     int64_t poison) {
  auto libs_or = GetCudaLibraries();
  if (!libs_or.has_value()) return libs_or.error();
  SdpaCall call{target, ctx, key, MetaPointers(ops.meta), *libs_or, nullptr,
                {{sdpa_uid::kQ, ops.q.untyped_data()},
                 {sdpa_uid::kK, ops.k.untyped_data()},
                 {sdpa_uid::kV, ops.v.untyped_data()}}};
  call.poison = PoisonFlag(call.seg, key, poison);
  ffi::Error e = BindRaggedOperands(target, *call.libs, ctx.device, ctx.stream,
                                    *ctx.scratch, call.seg, key, call.ptrs);
  if (e.failure()) return e;
  return call;
}

SegmentPointers MetaPointers(const SegmentMeta& meta) {
  int32_t* base = meta.typed_data();
  const int64_t w = meta.dimensions()[1];
  return {base, base + w, base + 2 * w, base + 3 * w};
}

const void* PoisonFlag(const SegmentPointers& seg, const SdpaGraphKey& key,
                       int64_t poison) {
  if (poison == 0) return nullptr;
  return static_cast<const int32_t*>(seg.q_lens) + key.segments;
}

CoveringSegments KeyedQueryRows(const SegmentPointers& seg,
                                const SdpaGraphKey& key, const void* poison) {
  const bool bottom_right = key.mask == SdpaMask::kCausalBottomRight;
  return {seg.q_lens, seg.kv_lens, seg.q_start, key.segments,
          bottom_right ? Coverage::kKeyedQueryRowsBottomRight
                       : Coverage::kKeyedQueryRows,
          key.window_left, poison};
}

ffi::Error CheckSameAs(const char* call, const char* name,
                       const ffi::AnyBuffer& buf, const char* like_name,
                       const ffi::AnyBuffer& like) {
  if (buf.element_type() != like.element_type() ||
      !SameDims(buf.dimensions(), like.dimensions())) {
    return Invalid(call, std::string(name) + " must have the dtype and shape "
                         "of " + like_name + "; got " + name +
                         DimsToString(buf.dimensions()) + " " + like_name +
                         DimsToString(like.dimensions()));
  }
  return ffi::Error::Success();
}

ffi::Error CheckAliased(const char* call, const char* name,
                        const ffi::AnyBuffer& result, const ffi::AnyBuffer& in) {
  if (result.untyped_data() != in.untyped_data() ||
      result.size_bytes() != in.size_bytes()) {
    return Invalid(call, std::string(name) + " must alias its input buffer "
                         "(input_output_aliases)");
  }
  return ffi::Error::Success();
}

ffi::Error CheckStats(const char* call, const char* name,
                      const ffi::AnyBuffer& stats, const SdpaGraphKey& key) {
  const auto d = stats.dimensions();
  if (stats.element_type() != ffi::DataType::F32 || d.size() != 2 ||
      d[0] != key.tokens_q || d[1] != key.heads_q) {
    return Invalid(call, std::string(name) + " must be float32 [Tq, Hq] = [" +
                             std::to_string(key.tokens_q) + "," +
                             std::to_string(key.heads_q) + "]; got " +
                             DimsToString(d));
  }
  return ffi::Error::Success();
}

}  // namespace jax_cp
