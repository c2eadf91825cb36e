// cuDNN SDPA graphs over packed (THD, ragged) segments: key, process-wide
// cache, and execution. Only sdpa_graph.cc includes the cuDNN frontend.
//
// Layout shared by the forward and backward graphs (b = number of segments):
//   Q, O, dO, dQ : [Tq, Hq, D]   viewed as {b, Hq, s_q, D}, ragged by q_off
//   K, V, dK, dV : [Tkv, Hkv, D] viewed as {b, Hkv, s_kv, D}, ragged by kv_off
//   Stats (LSE)  : [Tq, Hq] f32  viewed as {b, Hq, s_q, 1}, ragged by stats_off
//   q_lens, kv_lens : int32 [b]   actual lengths (padding mask)
//   q_off, kv_off, stats_off : int32 or int64 [b + 1] element offsets of
//                   each segment (SdpaGraphKey::offset_bits; built by the
//                   handler from token offsets, ragged_offsets.h)
// s_q / s_kv (the graph's sequence dims) bound every segment's length.
#ifndef JAX_CP_CSRC_SDPA_GRAPH_H_
#define JAX_CP_CSRC_SDPA_GRAPH_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cudnn_state.h"
#include "ffi_targets.h"
#include "xla/ffi/api/ffi.h"

namespace jax_cp {

enum class SdpaDirection { kForward, kBackward };

enum class SdpaIoType { kBFloat16, kFloat16 };

// Everything a built graph depends on. Two calls with equal keys share one
// graph; the key never holds device data (lengths and offsets are buffers).
struct SdpaGraphKey {
  int device = 0;
  SdpaDirection direction = SdpaDirection::kForward;
  int64_t segments = 0;   // b
  int64_t tokens_q = 0;   // Tq
  int64_t tokens_kv = 0;  // Tkv
  int64_t heads_q = 0;
  int64_t heads_kv = 0;
  int64_t head_dim = 0;
  SdpaIoType io_type = SdpaIoType::kBFloat16;
  SdpaMask mask = SdpaMask::kNoMask;
  uint32_t scale_bits = 0;  // bit pattern of the float scale
  int64_t max_seqlen_q = 0;
  int64_t max_seqlen_kv = 0;
  // Left bound of a causal sliding window: a row sees the keys at most
  // window_left before its diagonal; -1: no bound.
  int64_t window_left = -1;
  // The segments tile the buffers (segment i holds rows [i*s, (i+1)*s) with
  // s = max_seqlen_q = max_seqlen_kv), top-left causal, q_len <= kv_len:
  // the dense graph without ragged offsets and without the padding mask
  // (rows past a segment's length are handled by the handlers and the
  // Python wrapper; docs/internals.md, Tiled calls).
  bool tiled = false;
  // Width of the ragged element offsets (32 or 64). cuDNN addresses its
  // own float32 buffers of a ragged backward (the dQ accumulator, dK/dV at
  // the query heads with GQA) through the same offsets; 64-bit offsets keep
  // that addressing exact past 2^30 elements (docs/internals.md, Ragged
  // offsets).
  int64_t offset_bits = 32;
  // Forward only: the graph also writes the softmax stats (the LSE a
  // backward or a merge reads). false is the inference form: cuDNN
  // computes and writes no stats.
  bool stats = true;
  // Backward only: the frontend's deterministic algorithm
  // (set_deterministic_algorithm): bitwise the same results run to run. On
  // Hopper with cuDNN 9.19 it replaces the float32 dQ accumulator by a dP
  // buffer of S * Hq * s_q * s_kv bf16 values in the workspace
  // (jax_cp/attention/cudnn_workspace.py has the formula).
  bool deterministic = false;

  float scale() const;
  bool operator==(const SdpaGraphKey& other) const;
  // "fwd device=0 S=3 Tq=... dtype=bf16 mask=causal_bottom_right ...".
  std::string ToString() const;
};

struct SdpaGraphKeyHash {
  size_t operator()(const SdpaGraphKey& key) const;
};

// Tensor uids: the handlers bind device pointers to these.
namespace sdpa_uid {
constexpr int64_t kQ = 1;
constexpr int64_t kK = 2;
constexpr int64_t kV = 3;
constexpr int64_t kO = 4;
constexpr int64_t kStats = 5;
constexpr int64_t kDO = 6;
constexpr int64_t kDQ = 7;
constexpr int64_t kDK = 8;
constexpr int64_t kDV = 9;
constexpr int64_t kSeqLenQ = 10;
constexpr int64_t kSeqLenKv = 11;
constexpr int64_t kOffsetQ = 12;  // Q and dQ
constexpr int64_t kOffsetK = 13;  // K and dK
constexpr int64_t kOffsetV = 14;  // V and dV
constexpr int64_t kOffsetO = 15;  // O and dO
constexpr int64_t kOffsetStats = 16;
}  // namespace sdpa_uid

// Runs one SDPA call: looks the graph up in the cache (building it on the
// first call for this key), allocates the workspace from
// `scratch` and enqueues the graph on `stream`. Builds nothing and reads no
// device memory when the key is cached. `call` ("jax_cp_cudnn_sdpa_fwd")
// prefixes every error message, which also names the failing step and key.
xla::ffi::Error RunSdpaGraph(const char* call, const SdpaGraphKey& key,
                             cudaStream_t stream,
                             xla::ffi::ScratchAllocator& scratch,
                             std::unordered_map<int64_t, void*> uid_to_ptr);

struct GraphCacheStats {
  int64_t builds = 0;
  int64_t hits = 0;
  int64_t entries = 0;
};
GraphCacheStats GetGraphCacheStats();
void ResetGraphCacheStats();

// Compile-time versions, for diagnostics: {"cudnn_frontend", "cudnn_headers",
// "cuda_runtime_headers"}.
std::vector<std::pair<std::string, int64_t>> BuildVersions();

}  // namespace jax_cp

#endif  // JAX_CP_CSRC_SDPA_GRAPH_H_
