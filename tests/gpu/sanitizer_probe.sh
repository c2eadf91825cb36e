#!/usr/bin/env bash
# Runs compute-sanitizer's memcheck over programs of growing size, from one
# CUDA driver call (the sanitizer refuses a program that makes none) to
# every custom call of the extension (tests/gpu/sanitize_calls.py),
# to find where the sanitizer stops working under this machine's Python and
# JAX and, where it works, what it finds in our calls.
#
#   tests/gpu/sanitizer_probe.sh [LOG_DIR]
#
# Each step runs under a time limit (STEP_TIMEOUT, default 180 s) with XLA's
# platform allocator (one allocation per buffer, so memcheck sees accesses
# past a buffer's end) and without XLA's GPU autotuning (memcheck can crash
# itself while XLA autotunes a GEMM fusion; the extension's step compiles
# no GEMM on the GPU). The first step that fails is retried with variants
# (eager module loading; no device-heap and API-error checks) to narrow the
# cause. Prints one line per step: its exit status and the sanitizer's
# summary line; the full output of each step is in LOG_DIR.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
LOG_DIR="${1:-$(mktemp -d /tmp/jax_cp_sanitizer.XXXXXX)}"
mkdir -p "$LOG_DIR"
PY=$(command -v "${PYTHON:-python3}")
STEP_TIMEOUT="${STEP_TIMEOUT:-180}"
export XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false
export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_autotune_level=0"

if ! command -v compute-sanitizer > /dev/null; then
  echo "compute-sanitizer: not found"; exit 2
fi
compute-sanitizer --version | tail -n 1

steps=(
  "cu_init:$PY -c 'import ctypes; print(ctypes.CDLL(\"libcuda.so.1\").cuInit(0))'"
  "devices:$PY -c 'import jax; print(jax.devices())'"
  "jnp_add:$PY -c 'import jax.numpy as jnp; print(float((jnp.ones(8) + 1).sum()))'"
  "extension_calls:$PY -m tests.gpu.sanitize_calls"
)

run_step() {  # name, extra sanitizer options, extra env, command
  local name=$1 opts=$2 env=$3 cmd=$4
  local log="$LOG_DIR/sanitizer_$name.log"
  env $env timeout "$STEP_TIMEOUT" compute-sanitizer --tool memcheck $opts \
    bash -c "$cmd" > "$log" 2>&1
  local rc=$?
  local summary
  summary=$(grep -E "ERROR SUMMARY|Segmentation|Error:|error:" "$log" |
            tail -n 2 | tr '\n' ' ')
  echo "step $name [$opts $env]: exit $rc; ${summary:-no summary line}"
  return $rc
}

failed=""
for step in "${steps[@]}"; do
  name=${step%%:*}
  cmd=${step#*:}
  if ! run_step "$name" "" "" "$cmd"; then
    failed=$step
    break
  fi
done

if [[ -n "$failed" ]]; then
  name=${failed%%:*}
  cmd=${failed#*:}
  echo "first failing step: $name; last lines:"
  tail -n 15 "$LOG_DIR/sanitizer_$name.log"
  run_step "${name}_eager" "" "CUDA_MODULE_LOADING=EAGER" "$cmd"
  run_step "${name}_lean" \
    "--check-device-heap no --report-api-errors no --check-api-memory-access no" \
    "CUDA_MODULE_LOADING=EAGER" "$cmd"
  exit 1
fi
echo "every step ran under memcheck"
