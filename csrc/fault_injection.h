// Test-only fault injection: makes chosen failure points of the extension
// fail on demand, so tests can check that each failure surfaces as a Python
// exception and leaves the process sound.
//
// The switch is the environment variable JAX_CP_FAULT_INJECT, read once per
// process (on the first check, or at module import), holding a
// comma-separated list of point names, each optionally followed by ":N" to
// fail only the next N times the point is reached:
//
//   JAX_CP_FAULT_INJECT="graph_build_plans"        every build_plans fails
//   JAX_CP_FAULT_INJECT="workspace_alloc:3,execute" 3 allocations; every
//                                                   execute
//
// The module function set_fault_injection(spec) replaces the active spec
// within a process ("" turns injection off). When no point is armed,
// ShouldFail is one relaxed atomic load and a predictable branch.
//
// An injected failure goes through the same error path as a real one, with
// the status a real failure of that step would report and " (injected)"
// appended to the status text.
#ifndef JAX_CP_CSRC_FAULT_INJECTION_H_
#define JAX_CP_CSRC_FAULT_INJECTION_H_

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace jax_cp {

enum class FaultPoint : int {
  kHandle,                // cudnnCreate (cudnn_state.cc)
  kGraphValidate,         // graph.validate() (sdpa_graph.cc, cache miss)
  kBuildOperationGraph,   // graph.build_operation_graph()
  kCreateExecutionPlans,  // graph.create_execution_plans()
  kCheckSupport,          // graph.check_support()
  kBuildPlans,            // graph.build_plans()
  kWorkspaceSize,         // graph.get_workspace_size()
  kWorkspaceAlloc,        // the cuDNN workspace from XLA's scratch allocator
  kKernelLoad,            // cudaLibraryLoadData of the embedded PTX
  kKernelLaunch,          // cudaLaunchKernel of our kernels
  kSetStream,             // cudnnSetStream before execute
  kExecute,               // graph.execute()
  kCount,
};

constexpr int kFaultPointCount = static_cast<int>(FaultPoint::kCount);

// The spec name of `p` ("handle", "graph_validate", ...).
const char* FaultPointName(FaultPoint p);

namespace fault_internal {
// True while at least one point is armed. Read by the inline fast path.
extern std::atomic<bool> g_armed;
// Reads JAX_CP_FAULT_INJECT the first time it is called (thread-safe).
void EnsureInitialised();
bool ShouldFailSlow(FaultPoint p);
}  // namespace fault_internal

// True when the caller must fail at `p` now; consumes one of the point's
// remaining failures when the spec gave it a count.
inline bool ShouldFail(FaultPoint p) {
  fault_internal::EnsureInitialised();
  if (!fault_internal::g_armed.load(std::memory_order_relaxed)) return false;
  return fault_internal::ShouldFailSlow(p);
}

// One parsed entry of a spec: the point and how many failures remain
// (-1: every time).
struct FaultSpecEntry {
  FaultPoint point;
  int64_t count;
};

// Parses `spec` ("" is valid: nothing armed). On error returns false and
// sets `error` to a message that lists the valid names.
bool ParseFaultSpec(const std::string& spec, std::vector<FaultSpecEntry>* out,
                    std::string* error);

// Replaces the active spec (resetting every counter). On a parse error the
// active spec is left as it was and false is returned with `error` set.
bool SetFaultInjection(const std::string& spec, std::string* error);

// Per point: how many failures remain (-1: unlimited, 0: not armed) and how
// many were injected since the spec was last set.
struct FaultPointState {
  const char* name;
  int64_t remaining;
  int64_t injected;
};
std::vector<FaultPointState> FaultInjectionState();

// The spec the process started with (the environment variable's value, or
// "" when unset) and the error of parsing it ("" when it parsed). A spec that
// does not parse arms nothing; the module reports the error at import.
const std::string& FaultInjectionEnvSpec();
const std::string& FaultInjectionEnvError();

}  // namespace jax_cp

#endif  // JAX_CP_CSRC_FAULT_INJECTION_H_
