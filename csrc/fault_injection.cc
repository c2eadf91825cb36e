#include "fault_injection.h"

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <mutex>

namespace jax_cp {
namespace {

constexpr const char* kNames[kFaultPointCount] = {
    "handle",
    "graph_validate",
    "graph_build_operation_graph",
    "graph_create_execution_plans",
    "graph_check_support",
    "graph_build_plans",
    "workspace_size",
    "workspace_alloc",
    "kernel_load",
    "kernel_launch",
    "set_stream",
    "execute",
};

// Per point: failures left (-1 every time, 0 not armed) and failures
// injected. Constant-initialised, so usable before any dynamic initialiser.
std::atomic<int64_t> g_remaining[kFaultPointCount];
std::atomic<int64_t> g_injected[kFaultPointCount];
// Serialises SetFaultInjection (readers only use the atomics).
std::mutex g_set_mu;

struct EnvSpec {
  std::string spec;
  std::string error;
};

std::string Trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

std::string ValidNames() {
  std::string names;
  for (int i = 0; i < kFaultPointCount; ++i) {
    if (i) names += ", ";
    names += kNames[i];
  }
  return names;
}

// Installs `entries` (all other points disarmed). Caller holds g_set_mu.
void Install(const std::vector<FaultSpecEntry>& entries) {
  fault_internal::g_armed.store(false, std::memory_order_relaxed);
  for (int i = 0; i < kFaultPointCount; ++i) {
    g_remaining[i].store(0, std::memory_order_relaxed);
    g_injected[i].store(0, std::memory_order_relaxed);
  }
  for (const FaultSpecEntry& e : entries) {
    g_remaining[static_cast<int>(e.point)].store(e.count,
                                                 std::memory_order_relaxed);
  }
  // Release: a thread that sees g_armed also sees the counts.
  fault_internal::g_armed.store(!entries.empty(), std::memory_order_release);
}

// Read once: the first call parses JAX_CP_FAULT_INJECT and installs it.
const EnvSpec& Env() {
  static const EnvSpec* env = []() {
    auto* e = new EnvSpec;  // never destroyed (read by late callers)
    const char* value = std::getenv("JAX_CP_FAULT_INJECT");
    if (value == nullptr) return e;
    e->spec = value;
    std::vector<FaultSpecEntry> entries;
    if (!ParseFaultSpec(e->spec, &entries, &e->error)) {
      e->error = "JAX_CP_FAULT_INJECT=\"" + e->spec + "\": " + e->error;
      return e;
    }
    std::lock_guard<std::mutex> lock(g_set_mu);
    Install(entries);
    return e;
  }();
  return *env;
}

}  // namespace

namespace fault_internal {

std::atomic<bool> g_armed{false};

void EnsureInitialised() { (void)Env(); }

bool ShouldFailSlow(FaultPoint p) {
  const int i = static_cast<int>(p);
  std::atomic<int64_t>& remaining = g_remaining[i];
  int64_t r = remaining.load(std::memory_order_acquire);
  while (true) {
    if (r == 0) return false;
    if (r < 0) break;  // unlimited
    // Take one of the remaining failures; retry if another thread did.
    if (remaining.compare_exchange_weak(r, r - 1, std::memory_order_acq_rel))
      break;
  }
  g_injected[i].fetch_add(1, std::memory_order_relaxed);
  return true;
}

}  // namespace fault_internal

const char* FaultPointName(FaultPoint p) {
  const int i = static_cast<int>(p);
  return i >= 0 && i < kFaultPointCount ? kNames[i] : "invalid";
}

bool ParseFaultSpec(const std::string& spec, std::vector<FaultSpecEntry>* out,
                    std::string* error) {
  out->clear();
  size_t start = 0;
  while (start <= spec.size()) {
    size_t comma = spec.find(',', start);
    if (comma == std::string::npos) comma = spec.size();
    const std::string item = Trim(spec.substr(start, comma - start));
    start = comma + 1;
    if (item.empty()) continue;  // "" and stray commas arm nothing
    std::string name = item;
    int64_t count = -1;
    const size_t colon = item.find(':');
    if (colon != std::string::npos) {
      name = Trim(item.substr(0, colon));
      const std::string digits = Trim(item.substr(colon + 1));
      char* end = nullptr;
      errno = 0;
      const long long n = digits.empty()
                              ? -1
                              : std::strtoll(digits.c_str(), &end, 10);
      if (digits.empty() || errno != 0 || *end != '\0' || n <= 0) {
        *error = "fault point \"" + name +
                 "\": the count after ':' must be a positive integer; got \"" +
                 digits + "\"";
        return false;
      }
      count = n;
    }
    int found = -1;
    for (int i = 0; i < kFaultPointCount; ++i) {
      if (name == kNames[i]) found = i;
    }
    if (found < 0) {
      *error = "unknown fault point \"" + name + "\" (valid: " + ValidNames() +
               ")";
      return false;
    }
    // A point named twice keeps its last count.
    bool replaced = false;
    for (FaultSpecEntry& e : *out) {
      if (static_cast<int>(e.point) == found) {
        e.count = count;
        replaced = true;
      }
    }
    if (!replaced) out->push_back({static_cast<FaultPoint>(found), count});
  }
  return true;
}

bool SetFaultInjection(const std::string& spec, std::string* error) {
  fault_internal::EnsureInitialised();  // the environment is read first
  std::vector<FaultSpecEntry> entries;
  if (!ParseFaultSpec(spec, &entries, error)) return false;
  std::lock_guard<std::mutex> lock(g_set_mu);
  Install(entries);
  return true;
}

std::vector<FaultPointState> FaultInjectionState() {
  fault_internal::EnsureInitialised();
  std::vector<FaultPointState> states;
  for (int i = 0; i < kFaultPointCount; ++i) {
    states.push_back({kNames[i], g_remaining[i].load(std::memory_order_relaxed),
                      g_injected[i].load(std::memory_order_relaxed)});
  }
  return states;
}

const std::string& FaultInjectionEnvSpec() { return Env().spec; }
const std::string& FaultInjectionEnvError() { return Env().error; }

}  // namespace jax_cp
