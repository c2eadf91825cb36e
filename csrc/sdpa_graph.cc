#include "sdpa_graph.h"

#include <cudnn_frontend.h>

#include <cstdio>
#include <cstring>
#include <mutex>

#include "fault_injection.h"
#include "ffi_errors.h"

namespace ffi = xla::ffi;
namespace fe = cudnn_frontend;

namespace jax_cp {
namespace {

using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

// A finalised graph and the workspace its chosen plan needs.
struct BuiltGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace_bytes = 0;
};

const char* MaskName(SdpaMask mask) {
  switch (mask) {
    case SdpaMask::kNoMask:
      return "no_mask";
    case SdpaMask::kCausalTopLeft:
      return "causal_top_left";
    case SdpaMask::kCausalBottomRight:
      return "causal_bottom_right";
  }
  return "invalid";
}

fe::DataType_t FrontendIoType(SdpaIoType t) {
  return t == SdpaIoType::kBFloat16 ? fe::DataType_t::BFLOAT16
                                    : fe::DataType_t::HALF;
}

// Token-major packed layout [T, H, D] seen as {b, H, s, D}: consecutive
// tokens of a segment are H*D elements apart, heads D apart. The batch
// stride is never used with ragged offsets (each segment starts at its
// offset), so the dense value is given.
void SetThdLayout(fe::graph::Tensor_attributes& t, int64_t b, int64_t h,
                  int64_t s, int64_t d) {
  t.set_dim({b, h, s, d}).set_stride({s * h * d, d, h * d, 1});
}

// Packed LSE [T, H] seen as {b, H, s, 1}: token stride H, head stride 1.
// Ragged (per-segment) stats need cuDNN >= 9.6; the offsets are token
// offsets times H (not H*D).
void SetStatsLayout(fe::graph::Tensor_attributes& t, int64_t b, int64_t h,
                    int64_t s) {
  t.set_dim({b, h, s, 1})
      .set_stride({s * h, 1, h, 1})
      .set_data_type(fe::DataType_t::FLOAT);
}

// The backward of a tiled call reads its stats head-major, {b, H, s, 1}
// packed: cuDNN before 9.26 takes no other layout for a non-ragged Stats
// input of sdpa_backward (the Python wrapper transposes them).
void SetHeadMajorStatsLayout(fe::graph::Tensor_attributes& t, int64_t b,
                             int64_t h, int64_t s) {
  t.set_dim({b, h, s, 1})
      .set_stride({s * h, s, 1, 1})
      .set_data_type(fe::DataType_t::FLOAT);
}

// {n, 1, 1, 1} integers: per-segment lengths (n = b, int32) or ragged
// element offsets (n = b + 1, int32 or int64; entry i is where segment i
// starts, the last entry the total).
TensorPtr NewIndexTensor(fe::graph::Graph& g, const char* name, int64_t uid,
                         int64_t n,
                         fe::DataType_t type = fe::DataType_t::INT32) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({n, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_data_type(type));
}

TensorPtr NewThdInput(fe::graph::Graph& g, const char* name, int64_t uid,
                      int64_t b, int64_t h, int64_t s, int64_t d,
                      fe::DataType_t type, const TensorPtr& offset) {
  auto t = g.tensor(fe::graph::Tensor_attributes()
                        .set_name(name)
                        .set_uid(uid)
                        .set_data_type(type));
  SetThdLayout(*t, b, h, s, d);
  if (offset) t->set_ragged_offset(offset);
  return t;
}

void MarkThdOutput(const TensorPtr& t, int64_t uid, int64_t b, int64_t h,
                   int64_t s, int64_t d, fe::DataType_t type,
                   const TensorPtr& offset) {
  t->set_output(true).set_uid(uid).set_data_type(type);
  SetThdLayout(*t, b, h, s, d);
  if (offset) t->set_ragged_offset(offset);
}

// Causal masks are a diagonal band with right bound 0. Bottom-right aligns
// the band per segment with (q_len, kv_len) from the padding-mask lengths:
// row j sees keys <= j + kv_len - q_len. A sliding window adds the left
// bound: cuDNN keeps the keys with col + n > diagonal, i.e. n keys ending at
// the diagonal, so n = window_left + 1 (both alignments, forward and
// backward, ragged with the padding mask; no split or fallback needed).
template <typename Attributes>
void ApplyMask(Attributes& attrs, SdpaMask mask, int64_t window_left) {
  if (window_left >= 0 && mask != SdpaMask::kNoMask) {
    attrs.set_diagonal_band_left_bound(static_cast<int>(window_left + 1));
  }
  switch (mask) {
    case SdpaMask::kNoMask:
      break;
    case SdpaMask::kCausalTopLeft:
      attrs.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
          .set_diagonal_band_right_bound(0);
      break;
    case SdpaMask::kCausalBottomRight:
      attrs.set_diagonal_alignment(fe::DiagonalAlignment_t::BOTTOM_RIGHT)
          .set_diagonal_band_right_bound(0);
      break;
  }
}

// Ragged (THD) offsets require the padding mask; lengths are actual
// per-segment lengths, not cumulative. The token totals size the backward's
// dQ accumulator / softmax-sum / GQA dK,dV workspaces by the packed rows
// instead of b * s (which can be far larger with many segments; the
// frontend drops the hint when D % 16 != 0). A tiled call has neither: its
// graph is the dense one of jax.nn's cuDNN attention.
template <typename Attributes, typename Inputs>
void SetPadding(Attributes& attrs, const SdpaGraphKey& key, const Inputs& in) {
  if (key.tiled) return;
  attrs.set_padding_mask(true)
      .set_seq_len_q(in.seq_q)
      .set_seq_len_kv(in.seq_kv)
      .set_max_total_seq_len_q(key.tokens_q)
      .set_max_total_seq_len_kv(key.tokens_kv);
}

// Common input tensors of both directions.
struct GraphInputs {
  TensorPtr q, k, v, seq_q, seq_kv, off_q, off_k, off_v, off_o, off_stats;
};

GraphInputs AddInputs(fe::graph::Graph& g, const SdpaGraphKey& key) {
  const int64_t b = key.segments, sq = key.max_seqlen_q,
                skv = key.max_seqlen_kv, d = key.head_dim;
  const fe::DataType_t io = FrontendIoType(key.io_type);
  GraphInputs in;
  if (!key.tiled) {
    // Separate offset tensors per operand (bound to the same device buffer)
    // keep each operand's layout independent, as the frontend expects.
    const fe::DataType_t off = key.offset_bits == 64 ? fe::DataType_t::INT64
                                                     : fe::DataType_t::INT32;
    in.off_q = NewIndexTensor(g, "offset_q", sdpa_uid::kOffsetQ, b + 1, off);
    in.off_k = NewIndexTensor(g, "offset_k", sdpa_uid::kOffsetK, b + 1, off);
    in.off_v = NewIndexTensor(g, "offset_v", sdpa_uid::kOffsetV, b + 1, off);
    in.off_o = NewIndexTensor(g, "offset_o", sdpa_uid::kOffsetO, b + 1, off);
    if (key.stats) {
      in.off_stats = NewIndexTensor(g, "offset_stats",
                                    sdpa_uid::kOffsetStats, b + 1, off);
    }
    in.seq_q = NewIndexTensor(g, "seq_len_q", sdpa_uid::kSeqLenQ, b);
    in.seq_kv = NewIndexTensor(g, "seq_len_kv", sdpa_uid::kSeqLenKv, b);
  }
  in.q = NewThdInput(g, "Q", sdpa_uid::kQ, b, key.heads_q, sq, d, io, in.off_q);
  in.k = NewThdInput(g, "K", sdpa_uid::kK, b, key.heads_kv, skv, d, io,
                     in.off_k);
  in.v = NewThdInput(g, "V", sdpa_uid::kV, b, key.heads_kv, skv, d, io,
                     in.off_v);
  return in;
}

std::shared_ptr<fe::graph::Graph> NewGraph(const SdpaGraphKey& key) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(FrontendIoType(key.io_type))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

std::shared_ptr<fe::graph::Graph> DescribeForward(const SdpaGraphKey& key) {
  auto g = NewGraph(key);
  GraphInputs in = AddInputs(*g, key);
  fe::graph::SDPA_attributes attrs;
  attrs.set_name("jax_cp_sdpa_fwd")
      .set_generate_stats(key.stats)
      .set_attn_scale(key.scale());
  SetPadding(attrs, key, in);
  ApplyMask(attrs, key.mask, key.window_left);
  auto [o, stats] = g->sdpa(in.q, in.k, in.v, std::move(attrs));
  const fe::DataType_t io = FrontendIoType(key.io_type);
  MarkThdOutput(o, sdpa_uid::kO, key.segments, key.heads_q, key.max_seqlen_q,
                key.head_dim, io, in.off_o);
  if (!key.stats) return g;  // The inference form: no stats tensor.
  stats->set_output(true).set_uid(sdpa_uid::kStats);
  SetStatsLayout(*stats, key.segments, key.heads_q, key.max_seqlen_q);
  if (in.off_stats) stats->set_ragged_offset(in.off_stats);
  return g;
}

std::shared_ptr<fe::graph::Graph> DescribeBackward(const SdpaGraphKey& key) {
  auto g = NewGraph(key);
  GraphInputs in = AddInputs(*g, key);
  const int64_t b = key.segments, sq = key.max_seqlen_q, d = key.head_dim;
  const fe::DataType_t io = FrontendIoType(key.io_type);
  TensorPtr o =
      NewThdInput(*g, "O", sdpa_uid::kO, b, key.heads_q, sq, d, io, in.off_o);
  TensorPtr d_o =
      NewThdInput(*g, "dO", sdpa_uid::kDO, b, key.heads_q, sq, d, io, in.off_o);
  TensorPtr stats = g->tensor(fe::graph::Tensor_attributes()
                                  .set_name("Stats")
                                  .set_uid(sdpa_uid::kStats));
  if (key.tiled) {
    SetHeadMajorStatsLayout(*stats, b, key.heads_q, sq);
  } else {
    SetStatsLayout(*stats, b, key.heads_q, sq);
    stats->set_ragged_offset(in.off_stats);
  }

  fe::graph::SDPA_backward_attributes attrs;
  attrs.set_name("jax_cp_sdpa_bwd")
      .set_attn_scale(key.scale());
  SetPadding(attrs, key, in);
  // The deterministic algorithm only where the call asks for it (the
  // `deterministic` attribute): on Hopper it trades the float32 dQ
  // accumulator, whose adds race, for a dP buffer of S * Hq * s_q * s_kv
  // values, which the Python side bounds by splitting the call.
  attrs.set_deterministic_algorithm(key.deterministic);
  ApplyMask(attrs, key.mask, key.window_left);
  auto [d_q, d_k, d_v] =
      g->sdpa_backward(in.q, in.k, in.v, o, d_o, stats, std::move(attrs));
  MarkThdOutput(d_q, sdpa_uid::kDQ, b, key.heads_q, sq, d, io, in.off_q);
  MarkThdOutput(d_k, sdpa_uid::kDK, b, key.heads_kv, key.max_seqlen_kv, d, io,
                in.off_k);
  MarkThdOutput(d_v, sdpa_uid::kDV, b, key.heads_kv, key.max_seqlen_kv, d, io,
                in.off_v);
  return g;
}

std::string CallContext(const char* call, const SdpaGraphKey& key) {
  return std::string(call) + " [" + key.ToString() + "]";
}

ffi::Error StepError(const char* call, const SdpaGraphKey& key,
                     const char* step, const std::string& detail) {
  return ffi::Error::Internal(CallContext(call, key) + ": " + step +
                              " failed: " + detail);
}

const char* FrontendCodeName(fe::error_code_t code) {
  switch (code) {
    case fe::error_code_t::OK: return "OK";
    case fe::error_code_t::ATTRIBUTE_NOT_SET: return "ATTRIBUTE_NOT_SET";
    case fe::error_code_t::SHAPE_DEDUCTION_FAILED:
      return "SHAPE_DEDUCTION_FAILED";
    case fe::error_code_t::INVALID_TENSOR_NAME: return "INVALID_TENSOR_NAME";
    case fe::error_code_t::INVALID_VARIANT_PACK: return "INVALID_VARIANT_PACK";
    case fe::error_code_t::GRAPH_NOT_SUPPORTED: return "GRAPH_NOT_SUPPORTED";
    case fe::error_code_t::GRAPH_EXECUTION_PLAN_CREATION_FAILED:
      return "GRAPH_EXECUTION_PLAN_CREATION_FAILED";
    case fe::error_code_t::GRAPH_EXECUTION_FAILED:
      return "GRAPH_EXECUTION_FAILED";
    case fe::error_code_t::HEURISTIC_QUERY_FAILED:
      return "HEURISTIC_QUERY_FAILED";
    case fe::error_code_t::UNSUPPORTED_GRAPH_FORMAT:
      return "UNSUPPORTED_GRAPH_FORMAT";
    case fe::error_code_t::CUDA_API_FAILED: return "CUDA_API_FAILED";
    case fe::error_code_t::CUDNN_BACKEND_API_FAILED:
      return "CUDNN_BACKEND_API_FAILED";
    case fe::error_code_t::INVALID_CUDA_DEVICE: return "INVALID_CUDA_DEVICE";
    case fe::error_code_t::HANDLE_ERROR: return "HANDLE_ERROR";
    case fe::error_code_t::INVALID_VALUE: return "INVALID_VALUE";
    case fe::error_code_t::NVRTC_COMPILATION_FAILED:
      return "NVRTC_COMPILATION_FAILED";
  }
  return "UNKNOWN_ERROR";
}

// Each frontend build step is checked on its own, so the error names the
// step that failed (and later steps never run on a broken graph). The
// detail is "<frontend error code>: <frontend message>".
ffi::Error CheckStep(fe::error_t status, const char* call,
                     const SdpaGraphKey& key, const char* step) {
  if (status.is_good()) return ffi::Error::Success();
  return StepError(call, key, step,
                   std::string(FrontendCodeName(status.get_code())) + ": " +
                       status.get_message());
}

// Runs one frontend step, or, when fault injection arms `point`, fails it
// with `code` and the text of the cuDNN status `st` (what the frontend
// reports when cuDNN returns that status), marked "(injected)".
template <typename Fn>
fe::error_t Step(const CudaLibraries& libs, FaultPoint point,
                 fe::error_code_t code, cudnnStatus_t st, Fn&& fn) {
  if (ShouldFail(point)) {
    return {code, std::string(libs.cudnn.GetErrorString(st)) + " (injected)"};
  }
  return fn();
}

// Describes, validates and builds the graph of `key`. The description and
// validate() use no handle and run unlocked; the steps that use the handle
// hold dev.mu (another thread may be executing on it). A failure returns
// the error and nothing else: the half-built graph is dropped here and
// GetOrBuild caches only successes.
ffi::ErrorOr<std::shared_ptr<const BuiltGraph>> BuildGraph(
    const CudaLibraries& libs, DeviceCudnn& dev, const SdpaGraphKey& key,
    const char* call) {
  auto built = std::make_shared<BuiltGraph>();
  using Code = fe::error_code_t;
  ffi::Error err = WithCudaDevice(libs, key.device, [&]() -> ffi::Error {
    built->graph = key.direction == SdpaDirection::kForward
                       ? DescribeForward(key)
                       : DescribeBackward(key);
    fe::graph::Graph& g = *built->graph;
    ffi::Error e = CheckStep(
        Step(libs, FaultPoint::kGraphValidate, Code::INVALID_VALUE,
             CUDNN_STATUS_BAD_PARAM, [&] { return g.validate(); }),
        call, key, "validate");
    if (e.failure()) return e;
    std::lock_guard<std::mutex> lock(dev.mu);
    cudnnHandle_t h = dev.handle;
    e = CheckStep(Step(libs, FaultPoint::kBuildOperationGraph,
                       Code::CUDNN_BACKEND_API_FAILED,
                       CUDNN_STATUS_INTERNAL_ERROR,
                       [&] { return g.build_operation_graph(h); }),
                  call, key, "build_operation_graph");
    if (e.success())
      e = CheckStep(
          Step(libs, FaultPoint::kCreateExecutionPlans,
               Code::HEURISTIC_QUERY_FAILED, CUDNN_STATUS_INTERNAL_ERROR,
               [&] {
                 return g.create_execution_plans(
                     {fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
               }),
          call, key, "create_execution_plans");
    if (e.success())
      e = CheckStep(Step(libs, FaultPoint::kCheckSupport,
                         Code::GRAPH_NOT_SUPPORTED, CUDNN_STATUS_NOT_SUPPORTED,
                         [&] { return g.check_support(h); }),
                    call, key, "check_support");
    if (e.success())
      e = CheckStep(
          Step(libs, FaultPoint::kBuildPlans,
               Code::GRAPH_EXECUTION_PLAN_CREATION_FAILED,
               CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED,
               [&] {
                 return g.build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE);
               }),
          call, key, "build_plans");
    if (e.success())
      e = CheckStep(Step(libs, FaultPoint::kWorkspaceSize, Code::INVALID_VALUE,
                         CUDNN_STATUS_INTERNAL_ERROR,
                         [&] {
                           return g.get_workspace_size(built->workspace_bytes);
                         }),
                    call, key, "get_workspace_size");
    return e;
  });
  if (err.failure()) return err;
  return std::shared_ptr<const BuiltGraph>(std::move(built));
}

struct GraphCache {
  std::mutex mu;
  std::unordered_map<SdpaGraphKey, std::shared_ptr<const BuiltGraph>,
                     SdpaGraphKeyHash>
      graphs;
  int64_t builds = 0;
  int64_t hits = 0;
};

GraphCache& Cache() {
  static GraphCache* cache = new GraphCache;  // never destroyed
  return *cache;
}

// Cache lookup; on a miss the graph is built outside the cache lock (builds
// take a while; other keys, e.g. other devices, proceed meanwhile).
ffi::ErrorOr<std::shared_ptr<const BuiltGraph>> GetOrBuild(
    const CudaLibraries& libs, DeviceCudnn& dev, const SdpaGraphKey& key,
    const char* call) {
  GraphCache& cache = Cache();
  {
    std::lock_guard<std::mutex> lock(cache.mu);
    auto it = cache.graphs.find(key);
    if (it != cache.graphs.end()) {
      ++cache.hits;
      return it->second;
    }
  }
  auto built = BuildGraph(libs, dev, key, call);
  if (!built.has_value()) return built.error();
  std::lock_guard<std::mutex> lock(cache.mu);
  ++cache.builds;
  // If another thread built the same key meanwhile, keep the first one.
  return cache.graphs.emplace(key, *built).first->second;
}

std::string Gigabytes(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f GB", static_cast<double>(bytes) / 1e9);
  return buf;
}

// What a failed workspace allocation asked for. For the backward, the
// frontend's float32 buffers sized by the packed token totals (set in
// DescribeBackward; jax_cp/attention/cudnn_workspace.py has the same
// formula): the dQ accumulator, dK/dV at the query heads with GQA, and the
// softmax sums.
std::string WorkspaceFailure(const char* call, const SdpaGraphKey& key,
                             int64_t bytes, bool injected) {
  std::string msg = CallContext(call, key) + ": workspace allocation of " +
                    std::to_string(bytes) + " bytes (" + Gigabytes(bytes) +
                    ") failed: RESOURCE_EXHAUSTED (XLA's scratch allocator "
                    "returned no memory)";
  if (injected) msg += " (injected)";
  if (key.direction != SdpaDirection::kBackward) return msg;
  const int64_t f32 = 4, hq = key.heads_q, d = key.head_dim;
  if (key.deterministic) {
    // The frontend's bound on the dP buffer of the deterministic algorithm:
    // s_q rounded up to 64 and s_kv to 128, two bytes a value.
    const int64_t sq = (key.max_seqlen_q + 63) / 64 * 64;
    const int64_t skv = (key.max_seqlen_kv + 127) / 128 * 128;
    const int64_t dp = key.segments * hq * sq * skv * 2;
    return msg + "; the deterministic cuDNN backward keeps a dP buffer " +
           "S*Hq*s_q*s_kv*2 = " + std::to_string(key.segments) + "*" +
           std::to_string(hq) + "*" + std::to_string(sq) + "*" +
           std::to_string(skv) + "*2 = " + Gigabytes(dp) +
           " (jax_cp.attention.cudnn_workspace.backward_workspace with " +
           "deterministic=True); a lower JAX_CP_CUDNN_BWD_SCRATCH_GIB " +
           "splits it into more head groups and K/V slices";
  }
  const int64_t dq = key.tokens_q * hq * d * f32;
  const int64_t dkv =
      key.heads_q != key.heads_kv ? 2 * key.tokens_kv * hq * d * f32 : 0;
  const int64_t sums = key.tokens_q * hq * f32;
  return msg + "; the cuDNN backward keeps float32 buffers sized by the " +
         "call's tokens: dQ accumulator Tq*Hq*D*4 = " + Gigabytes(dq) +
         ", dK/dV at Hq heads (GQA) 2*Tkv*Hq*D*4 = " + Gigabytes(dkv) +
         ", softmax sums Tq*Hq*4 = " + Gigabytes(sums) +
         " (jax_cp.attention.cudnn_workspace.backward_workspace); fewer " +
         "tokens per call (a larger cp size) shrink it";
}

ffi::Error RunSdpaGraphImpl(const char* call, const SdpaGraphKey& key,
                            cudaStream_t stream, ffi::ScratchAllocator& scratch,
                            std::unordered_map<int64_t, void*>& uid_to_ptr) {
  auto libs_or = GetCudaLibraries();
  if (!libs_or.has_value()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      CallContext(call, key) + ": loading CUDA libraries: " +
                          libs_or.error().message());
  }
  const CudaLibraries& libs = **libs_or;
  auto dev_or = GetDeviceCudnn(libs, key.device);
  if (!dev_or.has_value()) {
    return StepError(call, key, "cudnn handle", dev_or.error().message());
  }
  DeviceCudnn& dev = **dev_or;
  auto graph_or = GetOrBuild(libs, dev, key, call);
  if (!graph_or.has_value()) return graph_or.error();
  const BuiltGraph& built = **graph_or;
  void* workspace = nullptr;
  // An injected allocation failure fires even for a graph that needs no
  // workspace, so the point fails on every call.
  const bool inject_alloc = ShouldFail(FaultPoint::kWorkspaceAlloc);
  if (built.workspace_bytes > 0 || inject_alloc) {
    // XLA's FFI allocator rejects alignments above 16 ("Unsupported
    // alignment"); its device allocations are 256-byte aligned anyway.
    std::optional<void*> ws;
    if (!inject_alloc) {
      ws = scratch.Allocate(static_cast<size_t>(built.workspace_bytes), 16);
    }
    if (!ws.has_value()) {
      return ffi::Error(
          ffi::ErrorCode::kResourceExhausted,
          WorkspaceFailure(call, key, built.workspace_bytes, inject_alloc));
    }
    workspace = *ws;
  }
  // The handle holds one stream at a time: setting it and enqueueing the
  // graph happen under its mutex.
  std::lock_guard<std::mutex> lock(dev.mu);
  const bool inject_stream = ShouldFail(FaultPoint::kSetStream);
  cudnnStatus_t st = inject_stream ? CUDNN_STATUS_BAD_PARAM
                                   : libs.cudnn.SetStream(dev.handle, stream);
  if (st != CUDNN_STATUS_SUCCESS) {
    return StepError(call, key, "cudnnSetStream",
                     std::string(libs.cudnn.GetErrorString(st)) +
                         (inject_stream ? " (injected)" : ""));
  }
  return CheckStep(
      Step(libs, FaultPoint::kExecute, fe::error_code_t::GRAPH_EXECUTION_FAILED,
           CUDNN_STATUS_EXECUTION_FAILED,
           [&] {
             return built.graph->execute(dev.handle, uid_to_ptr, workspace);
           }),
      call, key, "execute");
}

}  // namespace

float SdpaGraphKey::scale() const {
  float s;
  std::memcpy(&s, &scale_bits, sizeof(s));
  return s;
}

bool SdpaGraphKey::operator==(const SdpaGraphKey& o) const {
  return device == o.device && direction == o.direction &&
         segments == o.segments && tokens_q == o.tokens_q &&
         tokens_kv == o.tokens_kv && heads_q == o.heads_q &&
         heads_kv == o.heads_kv && head_dim == o.head_dim &&
         io_type == o.io_type && mask == o.mask && scale_bits == o.scale_bits &&
         max_seqlen_q == o.max_seqlen_q && max_seqlen_kv == o.max_seqlen_kv &&
         window_left == o.window_left && tiled == o.tiled &&
         offset_bits == o.offset_bits && stats == o.stats &&
         deterministic == o.deterministic;
}

std::string SdpaGraphKey::ToString() const {
  char buf[512];
  std::snprintf(
      buf, sizeof(buf),
      "%s device=%d S=%lld Tq=%lld Tkv=%lld Hq=%lld Hkv=%lld D=%lld dtype=%s "
      "mask=%s scale=%.9g max_seqlen_q=%lld max_seqlen_kv=%lld "
      "window_left=%lld tiled=%d offset_bits=%lld stats=%d deterministic=%d",
      direction == SdpaDirection::kForward ? "fwd" : "bwd", device,
      static_cast<long long>(segments), static_cast<long long>(tokens_q),
      static_cast<long long>(tokens_kv), static_cast<long long>(heads_q),
      static_cast<long long>(heads_kv), static_cast<long long>(head_dim),
      io_type == SdpaIoType::kBFloat16 ? "bf16" : "f16", MaskName(mask),
      static_cast<double>(scale()), static_cast<long long>(max_seqlen_q),
      static_cast<long long>(max_seqlen_kv),
      static_cast<long long>(window_left), tiled ? 1 : 0,
      static_cast<long long>(offset_bits), stats ? 1 : 0,
      deterministic ? 1 : 0);
  return buf;
}

size_t SdpaGraphKeyHash::operator()(const SdpaGraphKey& k) const {
  size_t h = 0;
  auto mix = [&h](uint64_t v) {
    h ^= std::hash<uint64_t>()(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  };
  mix(static_cast<uint64_t>(k.device));
  mix(static_cast<uint64_t>(k.direction));
  mix(static_cast<uint64_t>(k.segments));
  mix(static_cast<uint64_t>(k.tokens_q));
  mix(static_cast<uint64_t>(k.tokens_kv));
  mix(static_cast<uint64_t>(k.heads_q));
  mix(static_cast<uint64_t>(k.heads_kv));
  mix(static_cast<uint64_t>(k.head_dim));
  mix(static_cast<uint64_t>(k.io_type));
  mix(static_cast<uint64_t>(k.mask));
  mix(k.scale_bits);
  mix(static_cast<uint64_t>(k.max_seqlen_q));
  mix(static_cast<uint64_t>(k.max_seqlen_kv));
  mix(static_cast<uint64_t>(k.window_left));
  mix(static_cast<uint64_t>(k.tiled));
  mix(static_cast<uint64_t>(k.offset_bits));
  mix(static_cast<uint64_t>(k.stats));
  mix(static_cast<uint64_t>(k.deterministic));
  return h;
}

ffi::Error RunSdpaGraph(const char* call, const SdpaGraphKey& key,
                        cudaStream_t stream, ffi::ScratchAllocator& scratch,
                        std::unordered_map<int64_t, void*> uid_to_ptr) {
  // The handlers guard too; this one names the graph key in the message.
  return GuardFfi([&]() { return CallContext(call, key); },
                  [&]() {
                    return RunSdpaGraphImpl(call, key, stream, scratch,
                                            uid_to_ptr);
                  });
}

GraphCacheStats GetGraphCacheStats() {
  GraphCache& cache = Cache();
  std::lock_guard<std::mutex> lock(cache.mu);
  GraphCacheStats s;
  s.builds = cache.builds;
  s.hits = cache.hits;
  s.entries = static_cast<int64_t>(cache.graphs.size());
  return s;
}

void ResetGraphCacheStats() {
  GraphCache& cache = Cache();
  std::lock_guard<std::mutex> lock(cache.mu);
  cache.builds = 0;
  cache.hits = 0;
}

std::vector<std::pair<std::string, int64_t>> BuildVersions() {
  return {{"cudnn_frontend", CUDNN_FRONTEND_VERSION},
          {"cudnn_headers", CUDNN_VERSION},
          {"cuda_runtime_headers", CUDART_VERSION}};
}

}  // namespace jax_cp
