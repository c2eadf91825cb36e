#!/usr/bin/env bash
# Builds jax_cp's cuDNN extension and runs the GPU tests, on an offline CUDA
# machine (python3 with jax + CUDA plugin, nanobind, scikit-build-core, cmake,
# ninja, nvcc, the nvidia-cudnn wheel; the cuDNN frontend wheel is carried in
# .whl/).
#
#   tests/gpu/run_gpu_suite.sh [extra pytest args, e.g. -k one_long -x]
#
# Environment: PYTHON (default python3), OUT (folder for the logs; a temporary
# one otherwise), CUDNN_FRONTEND_INCLUDE (skip the carried wheel),
# JAX_CP_PIP_ARGS (extra pip arguments, e.g. --user).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY="${PYTHON:-python3}"
LOG_DIR="${OUT:-$(mktemp -d /tmp/jax_cp_gpu_logs.XXXXXX)}"
mkdir -p "$LOG_DIR"
echo "jax_cp GPU suite: logs in $LOG_DIR"

# 1. cuDNN frontend headers from the carried wheel (no network here).
if [[ -z "${CUDNN_FRONTEND_INCLUDE:-}" ]]; then
  shopt -s nullglob
  wheels=(.whl/nvidia_cudnn_frontend-*.whl)
  shopt -u nullglob
  if (( ${#wheels[@]} > 0 )); then
    FE_DIR=/tmp/jax_cp_cudnn_frontend
    rm -rf "$FE_DIR"
    "$PY" -m pip install --no-deps --no-index --target "$FE_DIR" \
      "${wheels[0]}" > "$LOG_DIR/frontend_install.log" 2>&1
    export CUDNN_FRONTEND_INCLUDE="$FE_DIR/include"
  else
    echo "no .whl/nvidia_cudnn_frontend-*.whl; relying on an installed" \
         "nvidia-cudnn-frontend" >&2
  fi
fi
echo "CUDNN_FRONTEND_INCLUDE=${CUDNN_FRONTEND_INCLUDE:-<from the installed wheel>}"

# 2. Build and install (editable) the extension; fail loudly if it cannot.
if ! JAX_CP_BUILD_CUDA=1 "$PY" -m pip install --no-build-isolation --no-deps \
    -v ${JAX_CP_PIP_ARGS:-} -e . > "$LOG_DIR/build.log" 2>&1; then
  tail -n 60 "$LOG_DIR/build.log"
  echo "build failed; full log: $LOG_DIR/build.log" >&2
  exit 1
fi
grep -E "jax_cp:|Linking" "$LOG_DIR/build.log" || true

# 3. What we run on.
"$PY" - <<'EOF' 2>&1 | tee "$LOG_DIR/environment.log"
import jax
print("jax", jax.__version__, jax.devices())
import jax_cp.attention.cudnn as c
print("extension", c._jax_cp_cuda.__file__)
print("build_info", c.build_info())
EOF

# 4. The GPU tests (marker gpu) plus whatever the caller passed.
set +e
"$PY" -m pytest -m gpu -v -rs "$@" 2>&1 | tee "$LOG_DIR/pytest_gpu.log"
status=${PIPESTATUS[0]}
set -e
echo "pytest exit status: $status (logs in $LOG_DIR)"
exit "$status"
