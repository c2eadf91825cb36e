// Host-only tests of the extension's C++ (no GPU, no CUDA library loaded):
// the fault injection spec parser and switch (fault_injection.h), the
// per-device memory of failed cudnnCreate calls (cudnn_state.h), driven
// through a CudaLibraries whose entry points are stubs, and the decoding of
// the SDPA handlers' attributes into their structs (sdpa_ffi_common.h).
//
// Built by CMake with -DJAX_CP_BUILD_HOST_TESTS=ON (optionally with
// -DJAX_CP_ASAN=ON) and run by tests/test_host_cc.py. Prints one line per
// failed check and exits 1 if any failed.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cuda_libs.h"
#include "cudnn_state.h"
#include "fault_injection.h"
#include "sdpa_ffi_common.h"

namespace {

int g_failures = 0;

void Check(bool ok, const char* what, int line) {
  if (!ok) {
    std::printf("FAILED line %d: %s\n", line, what);
    ++g_failures;
  }
}
#define CHECK(cond) Check((cond), #cond, __LINE__)

bool Contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// ---- stub CUDA runtime / cuDNN ---------------------------------------------

int g_current_device = 0;
size_t g_free_bytes = size_t{1} << 30;
int g_create_calls = 0;
int g_create_failures_left = 0;  // cudnnCreate fails while > 0

cudaError_t StubGetDevice(int* d) {
  *d = g_current_device;
  return cudaSuccess;
}
cudaError_t StubSetDevice(int d) {
  g_current_device = d;
  return cudaSuccess;
}
const char* StubCudaErrorString(cudaError_t) { return "stub cuda error"; }
const char* StubCudaErrorName(cudaError_t) { return "cudaErrorStub"; }
cudaError_t StubMemGetInfo(size_t* free_bytes, size_t* total) {
  *free_bytes = g_free_bytes;
  *total = size_t{80} << 30;
  return cudaSuccess;
}
cudnnStatus_t StubCreate(cudnnHandle_t* h) {
  ++g_create_calls;
  if (g_create_failures_left > 0) {
    --g_create_failures_left;
    return CUDNN_STATUS_INTERNAL_ERROR;
  }
  static int dummy;
  *h = reinterpret_cast<cudnnHandle_t>(&dummy);
  return CUDNN_STATUS_SUCCESS;
}
const char* StubCudnnErrorString(cudnnStatus_t st) {
  return st == CUDNN_STATUS_INTERNAL_ERROR ? "CUDNN_STATUS_INTERNAL_ERROR"
                                           : "CUDNN_STATUS_OTHER";
}

jax_cp::CudaLibraries StubLibraries() {
  jax_cp::CudaLibraries libs{};
  libs.cudart.GetDevice = StubGetDevice;
  libs.cudart.SetDevice = StubSetDevice;
  libs.cudart.GetErrorString = StubCudaErrorString;
  libs.cudart.GetErrorName = StubCudaErrorName;
  libs.cudart.MemGetInfo = StubMemGetInfo;
  libs.cudnn.Create = StubCreate;
  libs.cudnn.GetErrorString = StubCudnnErrorString;
  return libs;
}

// ---- fault spec -------------------------------------------------------------

void TestParse() {
  using jax_cp::FaultPoint;
  std::vector<jax_cp::FaultSpecEntry> e;
  std::string err;
  CHECK(jax_cp::ParseFaultSpec("", &e, &err) && e.empty());
  CHECK(jax_cp::ParseFaultSpec(" , ,", &e, &err) && e.empty());
  CHECK(jax_cp::ParseFaultSpec("handle", &e, &err) && e.size() == 1 &&
        e[0].point == FaultPoint::kHandle && e[0].count == -1);
  CHECK(jax_cp::ParseFaultSpec(" workspace_alloc : 3 , execute", &e, &err) &&
        e.size() == 2 && e[0].point == FaultPoint::kWorkspaceAlloc &&
        e[0].count == 3 && e[1].point == FaultPoint::kExecute &&
        e[1].count == -1);
  CHECK(jax_cp::ParseFaultSpec("execute:2,execute:5", &e, &err) &&
        e.size() == 1 && e[0].count == 5);
  CHECK(!jax_cp::ParseFaultSpec("nope", &e, &err) &&
        Contains(err, "unknown fault point \"nope\"") &&
        Contains(err, "graph_build_plans"));
  for (const char* bad : {"handle:0", "handle:-1", "handle:x", "handle:",
                          "handle:3x", "handle:99999999999999999999"}) {
    err.clear();
    CHECK(!jax_cp::ParseFaultSpec(bad, &e, &err) &&
          Contains(err, "positive integer"));
  }
  // Every point's name parses back to itself.
  for (int i = 0; i < jax_cp::kFaultPointCount; ++i) {
    const auto p = static_cast<FaultPoint>(i);
    CHECK(jax_cp::ParseFaultSpec(jax_cp::FaultPointName(p), &e, &err) &&
          e.size() == 1 && e[0].point == p);
  }
}

void TestSwitch() {
  using jax_cp::FaultPoint;
  std::string err;
  CHECK(jax_cp::SetFaultInjection("", &err));
  CHECK(!jax_cp::ShouldFail(FaultPoint::kExecute));
  CHECK(jax_cp::SetFaultInjection("execute:2,set_stream", &err));
  CHECK(jax_cp::ShouldFail(FaultPoint::kExecute));
  CHECK(jax_cp::ShouldFail(FaultPoint::kExecute));
  CHECK(!jax_cp::ShouldFail(FaultPoint::kExecute));  // count used up
  for (int i = 0; i < 5; ++i) CHECK(jax_cp::ShouldFail(FaultPoint::kSetStream));
  CHECK(!jax_cp::ShouldFail(FaultPoint::kHandle));
  for (const auto& s : jax_cp::FaultInjectionState()) {
    if (std::string(s.name) == "execute") {
      CHECK(s.remaining == 0 && s.injected == 2);
    } else if (std::string(s.name) == "set_stream") {
      CHECK(s.remaining == -1 && s.injected == 5);
    } else {
      CHECK(s.remaining == 0 && s.injected == 0);
    }
  }
  // A bad spec leaves the active one in place.
  CHECK(!jax_cp::SetFaultInjection("bogus", &err));
  CHECK(jax_cp::ShouldFail(FaultPoint::kSetStream));

  // Counted failures are shared exactly between threads.
  CHECK(jax_cp::SetFaultInjection("kernel_launch:1000", &err));
  std::vector<std::thread> threads;
  std::vector<int> fired(8, 0);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([t, &fired]() {
      for (int i = 0; i < 500; ++i)
        fired[t] += jax_cp::ShouldFail(FaultPoint::kKernelLaunch) ? 1 : 0;
    });
  }
  for (auto& th : threads) th.join();
  int total = 0;
  for (int f : fired) total += f;
  CHECK(total == 1000);
  CHECK(jax_cp::SetFaultInjection("", &err));
}

// ---- cudnnCreate failure memory ----------------------------------------------

void TestHandleFailureMemory() {
  const jax_cp::CudaLibraries libs = StubLibraries();
  std::string err;
  CHECK(jax_cp::SetFaultInjection("", &err));

  // Device 0: a real (stub) failure is remembered; cudnnCreate is not called
  // again until memory is freed.
  g_create_failures_left = 1000;
  g_create_calls = 0;
  g_free_bytes = size_t{1} << 30;
  auto r = jax_cp::GetDeviceCudnn(libs, 0);
  CHECK(!r.has_value());
  if (!r.has_value()) {
    const std::string m = r.error().message();
    CHECK(Contains(m, "cudnnCreate on device 0 failed: "
                      "CUDNN_STATUS_INTERNAL_ERROR"));
    CHECK(Contains(m, "1024 MiB"));
  }
  for (int i = 0; i < 100; ++i) {
    r = jax_cp::GetDeviceCudnn(libs, 0);
    CHECK(!r.has_value() &&
          Contains(r.error().message(),
                   "cudnnCreate failed earlier on device 0 "
                   "(CUDNN_STATUS_INTERNAL_ERROR); not retried"));
  }
  CHECK(g_create_calls == 1);
  CHECK(jax_cp::FailedCudnnHandles().count(0) == 1);

  // A little more free memory is not enough to retry ...
  g_free_bytes += jax_cp::kHandleRetryFreeBytes / 2;
  CHECK(!jax_cp::GetDeviceCudnn(libs, 0).has_value());
  CHECK(g_create_calls == 1);
  // ... enough is: one retry, which fails again and is remembered again.
  g_free_bytes += jax_cp::kHandleRetryFreeBytes;
  r = jax_cp::GetDeviceCudnn(libs, 0);
  CHECK(!r.has_value() &&
        Contains(r.error().message(), "cudnnCreate on device 0 failed"));
  CHECK(g_create_calls == 2);
  CHECK(!jax_cp::GetDeviceCudnn(libs, 0).has_value());
  CHECK(g_create_calls == 2);

  // An explicit reset retries; this time creation succeeds and is kept.
  g_create_failures_left = 0;
  CHECK(jax_cp::ResetFailedCudnnHandles() == 1);
  CHECK(jax_cp::FailedCudnnHandles().empty());
  r = jax_cp::GetDeviceCudnn(libs, 0);
  CHECK(r.has_value() && (*r)->handle != nullptr && (*r)->device == 0);
  jax_cp::DeviceCudnn* first = r.has_value() ? *r : nullptr;
  for (int i = 0; i < 10; ++i) {
    r = jax_cp::GetDeviceCudnn(libs, 0);
    CHECK(r.has_value() && *r == first);
  }
  CHECK(g_create_calls == 3);
  CHECK(jax_cp::ResetFailedCudnnHandles() == 0);  // handles are kept
  r = jax_cp::GetDeviceCudnn(libs, 0);
  CHECK(r.has_value() && *r == first);

  // Device 1: an injected failure takes the same path and never reaches
  // cudnnCreate; the current device is restored.
  g_current_device = 0;
  CHECK(jax_cp::SetFaultInjection("handle", &err));
  for (int i = 0; i < 100; ++i) {
    if (i % 2 == 0) jax_cp::ResetFailedCudnnHandles();
    r = jax_cp::GetDeviceCudnn(libs, 1);
    CHECK(!r.has_value() &&
          Contains(r.error().message(),
                   "CUDNN_STATUS_INTERNAL_ERROR (injected)"));
  }
  CHECK(g_create_calls == 3);
  CHECK(g_current_device == 0);
  for (const auto& s : jax_cp::FaultInjectionState()) {
    if (std::string(s.name) == "handle") CHECK(s.injected == 50);
  }
  CHECK(jax_cp::SetFaultInjection("", &err));
  // Still remembered after the fault is disarmed, until reset.
  CHECK(!jax_cp::GetDeviceCudnn(libs, 1).has_value());
  jax_cp::ResetFailedCudnnHandles();
  r = jax_cp::GetDeviceCudnn(libs, 1);
  CHECK(r.has_value() && (*r)->device == 1 && *r != first);
  CHECK(g_create_calls == 4);
  CHECK(g_current_device == 0);

  // Many threads asking for a new device at once: one handle, one create.
  std::vector<std::thread> threads;
  std::vector<jax_cp::DeviceCudnn*> got(8, nullptr);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([t, &got, &libs]() {
      auto res = jax_cp::GetDeviceCudnn(libs, 2);
      got[t] = res.has_value() ? *res : nullptr;
    });
  }
  for (auto& th : threads) th.join();
  for (auto* p : got) CHECK(p != nullptr && p == got[0]);
  CHECK(g_create_calls == 5);
}

// ---- the SDPA attributes ---------------------------------------------------

// A call frame's attribute dictionary as XLA builds it: scalars, sorted by
// name.
class AttrDict {
 public:
  void Add(std::string name, int64_t v) {
    Put(std::move(name), XLA_FFI_DataType_S64, v, 0.f, 0);
  }
  void AddF32(std::string name, float v) {
    Put(std::move(name), XLA_FFI_DataType_F32, 0, v, 0);
  }
  void AddI32(std::string name, int32_t v) {
    Put(std::move(name), XLA_FFI_DataType_S32, 0, 0.f, v);
  }

  // Decodes the dictionary as the struct T; `error` gets the diagnostics.
  template <typename T>
  std::optional<T> Decode(std::string* error) {
    std::sort(entries_.begin(), entries_.end(),
              [](const Entry& a, const Entry& b) { return a.name < b.name; });
    std::vector<XLA_FFI_AttrType> types;
    std::vector<XLA_FFI_ByteSpan> spans;
    std::vector<XLA_FFI_ByteSpan*> names;
    std::vector<void*> values;
    scalars_.clear();
    scalars_.reserve(entries_.size());
    spans.reserve(entries_.size());
    for (Entry& e : entries_) {
      types.push_back(XLA_FFI_AttrType_SCALAR);
      spans.push_back({e.name.data(), e.name.size()});
      names.push_back(&spans.back());
      void* value = &e.f32;
      if (e.dtype == XLA_FFI_DataType_S64) value = &e.i64;
      if (e.dtype == XLA_FFI_DataType_S32) value = &e.i32;
      scalars_.push_back({e.dtype, value});
      values.push_back(&scalars_.back());
    }
    XLA_FFI_Attrs attrs{XLA_FFI_Attrs_STRUCT_SIZE, nullptr,
                        static_cast<int64_t>(entries_.size()), types.data(),
                        names.data(), values.data()};
    xla::ffi::DiagnosticEngine diagnostic;
    std::optional<T> out = xla::ffi::AttrDecoding<T>::Decode(
        XLA_FFI_AttrType_DICTIONARY, &attrs, diagnostic);
    *error = diagnostic.Result();
    return out;
  }

 private:
  struct Entry {
    std::string name;
    XLA_FFI_DataType dtype;
    int64_t i64;
    float f32;
    int32_t i32;
  };
  void Put(std::string name, XLA_FFI_DataType dtype, int64_t i64, float f32,
           int32_t i32) {
    entries_.push_back({std::move(name), dtype, i64, f32, i32});
  }
  std::vector<Entry> entries_;
  std::vector<XLA_FFI_Scalar> scalars_;
};

// The attributes cudnn.py's _attributes passes, with values that tell the
// members apart.
AttrDict ForwardAttrs(int64_t mask) {
  AttrDict d;
  d.Add("segments", 3);
  d.Add("mask", mask);
  d.AddF32("scale", 0.125f);
  d.Add("max_seqlen_q", 64);
  d.Add("max_seqlen_kv", 96);
  d.Add("window_left", 7);
  d.Add("tiled", 1);
  d.Add("offset_bits", 32);
  d.Add("poison", 0);
  return d;
}

void TestSdpaAttrs() {
  std::string error;
  std::optional<jax_cp::SdpaAttrs> a =
      ForwardAttrs(2).Decode<jax_cp::SdpaAttrs>(&error);
  CHECK(a.has_value());
  if (a.has_value()) {
    CHECK(a->segments == 3);
    CHECK(a->mask == jax_cp::SdpaMask::kCausalBottomRight);
    CHECK(a->scale == 0.125f);
    CHECK(a->max_seqlen_q == 64);
    CHECK(a->max_seqlen_kv == 96);
    CHECK(a->window_left == 7);
    CHECK(a->tiled == 1);
    CHECK(a->offset_bits == 32);
    CHECK(a->poison == 0);
  }

  AttrDict bwd = ForwardAttrs(1);
  bwd.Add("deterministic", 1);
  std::optional<jax_cp::SdpaBackwardAttrs> b =
      bwd.Decode<jax_cp::SdpaBackwardAttrs>(&error);
  CHECK(b.has_value());
  if (b.has_value()) {
    CHECK(b->common.segments == 3);
    CHECK(b->common.mask == jax_cp::SdpaMask::kCausalTopLeft);
    CHECK(b->common.scale == 0.125f);
    CHECK(b->common.max_seqlen_kv == 96);
    CHECK(b->common.offset_bits == 32);
    CHECK(b->common.poison == 0);
    CHECK(b->deterministic == 1);
  }

  // The struct takes every attribute of the call and no other.
  CHECK(!bwd.Decode<jax_cp::SdpaAttrs>(&error).has_value());
  CHECK(Contains(error, "Wrong number of attributes"));
  CHECK(!ForwardAttrs(0).Decode<jax_cp::SdpaBackwardAttrs>(&error));

  // The mask is an int64 scalar (SdpaMask's underlying type); an int32 is
  // refused. Any int64 decodes: MakeSdpaKey checks the value.
  AttrDict wrong;
  for (const char* name : {"segments", "max_seqlen_q", "max_seqlen_kv",
                           "window_left", "tiled", "offset_bits", "poison"}) {
    wrong.Add(name, 1);
  }
  wrong.AddF32("scale", 1.f);
  wrong.AddI32("mask", 1);
  CHECK(!wrong.Decode<jax_cp::SdpaAttrs>(&error).has_value());
  CHECK(Contains(error, "Wrong scalar data type"));
  std::optional<jax_cp::SdpaAttrs> odd =
      ForwardAttrs(9).Decode<jax_cp::SdpaAttrs>(&error);
  CHECK(odd.has_value() && static_cast<int64_t>(odd->mask) == 9);
}

}  // namespace

int main() {
  // The environment variable must not interfere with these checks.
  if (!jax_cp::FaultInjectionEnvSpec().empty()) {
    std::printf("unset JAX_CP_FAULT_INJECT to run the host tests\n");
    return 2;
  }
  TestParse();
  TestSwitch();
  TestHandleFailureMemory();
  TestSdpaAttrs();
  if (g_failures) {
    std::printf("jax_cp_host_tests: %d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("jax_cp_host_tests: all checks passed\n");
  return 0;
}
