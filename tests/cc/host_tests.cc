// Host-only tests of the extension's C++ (no GPU, no CUDA library loaded):
// the fault injection spec parser and switch (fault_injection.h), and the
// per-device memory of failed cudnnCreate calls (cudnn_state.h), driven
// through a CudaLibraries whose entry points are stubs.
//
// Built by CMake with -DJAX_CP_BUILD_HOST_TESTS=ON (optionally with
// -DJAX_CP_ASAN=ON) and run by tests/test_host_cc.py. Prints one line per
// failed check and exits 1 if any failed.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "cuda_libs.h"
#include "cudnn_state.h"
#include "fault_injection.h"

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
  if (g_failures) {
    std::printf("jax_cp_host_tests: %d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("jax_cp_host_tests: all checks passed\n");
  return 0;
}
