#!/usr/bin/env bash
# Builds jax_cp's cuDNN extension the README's pip-only way, from a folder of
# carried wheels with the CUDA toolkit hidden, and runs the GPU tests, on an
# offline CUDA machine (python3 with jax[cuda13] 0.11.2, nvidia-cudnn-cu13,
# nvidia-cuda-runtime, nvidia-cuda-nvrtc, nanobind, scikit-build-core, cmake,
# ninja; the wheels it lacks, e.g. nvidia-cudnn-frontend, nvidia-cuda-crt
# and nvidia-cuda-cccl, and grain with array_record and portpicker (the test
# extra's data loader), carried in .whl/).
#
#   tests/gpu/run_gpu_suite.sh [extra pytest args, e.g. -k one_long -x]
#
# Any pytest -n N works: the test processes share the GPU
# (XLA_PYTHON_CLIENT_PREALLOCATE=false, set here and by tests/conftest.py,
# unless the caller sets it).
#
# Environment: PYTHON (default python3), OUT (folder for the logs; a temporary
# one otherwise), WHEELS (default .whl), JAX_CP_PIP_ARGS (extra pip
# arguments, e.g. --user), JAX_CP_USE_TOOLKIT=1 (build with the toolkit's
# nvcc instead, for comparison), JAX_CP_ASAN=1 (build the extension with
# AddressSanitizer, -DJAX_CP_ASAN=ON, in a build folder of its own, and run
# the tests with ASan's runtime preloaded), JAX_CP_INSTALL_ONLY=1 (build and
# install, print the environment, run no test).
#
#   JAX_CP_ASAN=1 tests/gpu/run_gpu_suite.sh tests/gpu/test_fault_injection.py
#
# The ASan build stays installed (editable) until the next run without
# JAX_CP_ASAN reinstalls the normal one; its module loads only with
# libasan preloaded, as this script does.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"
PY=$(command -v "${PYTHON:-python3}")
WHEELS="${WHEELS:-.whl}"
LOG_DIR="${OUT:-$(mktemp -d /tmp/jax_cp_gpu_logs.XXXXXX)}"
mkdir -p "$LOG_DIR"
echo "jax_cp GPU suite: logs in $LOG_DIR"
pip_offline=("$PY" -m pip install --no-index --find-links "$WHEELS"
             ${JAX_CP_PIP_ARGS:-})

# 1. Build wheels of the cuda13 extra that are not installed yet (header-only
#    ones; --no-deps: the frontend's Python dependencies are not needed).
if ! "${pip_offline[@]}" --no-deps nvidia-cudnn-frontend nvidia-cuda-crt \
    nvidia-cuda-cccl > "$LOG_DIR/wheels_install.log" 2>&1; then
  cat "$LOG_DIR/wheels_install.log"
  echo "missing wheels: carry them in $WHEELS/" >&2
  exit 1
fi

# The test extra's data loader (the example and its tests import grain):
# installed from the same folder when the interpreter lacks it.
if ! "$PY" -c "import grain" > /dev/null 2>&1; then
  if ! "${pip_offline[@]}" --no-deps grain array_record portpicker \
      >> "$LOG_DIR/wheels_install.log" 2>&1; then
    cat "$LOG_DIR/wheels_install.log"
    echo "missing wheels: carry grain, array_record and portpicker in $WHEELS/" >&2
    exit 1
  fi
fi

# 2. Build and install (editable) the extension: -C cuda=13 makes any missing
#    piece an error. The toolkit is hidden (.ci/hide_cuda_toolkit: no nvcc
#    on PATH, CUDA_HOME/CUDA_PATH unset) and CMake told not to look for it.
build_env=()
build_args=(-C cuda=13)
build_dir=""
if [[ "${JAX_CP_USE_TOOLKIT:-0}" != 1 ]]; then
  build_env=(.ci/hide_cuda_toolkit)
  build_args+=(-C cmake.define.JAX_CP_USE_CUDA_TOOLKIT=OFF)
  build_dir="build/pip-only-{wheel_tag}"
fi
# The ASan variant gets a build folder of its own, whichever compiler
# path, so that no other build picks up its CMake cache.
if [[ "${JAX_CP_ASAN:-0}" == 1 ]]; then
  build_args+=(-C cmake.define.JAX_CP_ASAN=ON)
  build_dir="build/asan-{wheel_tag}"
fi
if [[ -n "$build_dir" ]]; then build_args+=(-C "build-dir=$build_dir"); fi
if ! ${build_env[@]+"${build_env[@]}"} "${pip_offline[@]}" --no-build-isolation --no-deps \
    -v "${build_args[@]}" -e . > "$LOG_DIR/build.log" 2>&1; then
  tail -n 60 "$LOG_DIR/build.log"
  echo "build failed; full log: $LOG_DIR/build.log" >&2
  exit 1
fi
grep -E -- "-- jax_cp:|Linking" "$LOG_DIR/build.log" || true
if [[ "${JAX_CP_USE_TOOLKIT:-0}" != 1 ]]; then
  grep -q -- "kernels.cu: NVRTC" "$LOG_DIR/build.log" ||
    { echo "kernels.cu was not compiled with NVRTC" >&2; exit 1; }
  # The lines first, then `grep -q` on them: no grep reads a pipe, which
  # under pipefail could fail by SIGPIPE and let the check pass.
  dirs=$(grep -E -- "-- jax_cp: (building|include directories)" \
      "$LOG_DIR/build.log") || (( $? == 1 ))
  if grep -qi -- "/cuda[-/0-9.]*include" <<< "$dirs"; then
    echo "the build used a CUDA toolkit's headers" >&2; exit 1
  fi
  echo "pip-only build: wheel headers, kernels.cu compiled with NVRTC"
fi

# An AddressSanitizer build runs under ASan's runtime and a C++ runtime,
# preloaded (CMakeLists.txt, JAX_CP_ASAN; tests/gpu/asan_preload.sh says
# which): the Python process is not instrumented. protect_shadow_gap=0
# leaves the address range the CUDA driver maps; detect_leaks=0 because
# Python keeps memory until exit.
if [[ "${JAX_CP_ASAN:-0}" == 1 ]]; then
  modules=(build/asan-*/_jax_cp_cuda*.so)
  if ! LD_PRELOAD=$(tests/gpu/asan_preload.sh "${modules[0]}"); then
    echo "JAX_CP_ASAN=1: no runtime to preload (tests/gpu/asan_preload.sh)" >&2
    exit 1
  fi
  export LD_PRELOAD
  export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:protect_shadow_gap=0:abort_on_error=0:halt_on_error=1}"
  grep -q -- "AddressSanitizer build" "$LOG_DIR/build.log" ||
    { echo "JAX_CP_ASAN=1 but the build was not an ASan build" >&2; exit 1; }
  echo "AddressSanitizer: LD_PRELOAD=$LD_PRELOAD ASAN_OPTIONS=$ASAN_OPTIONS"
fi

# 3. What we run on.
"$PY" - <<'PYEOF' 2>&1 | tee "$LOG_DIR/environment.log"
import jax
print("jax", jax.__version__, jax.devices())
import jax_cp.attention.cudnn.backend as c
print("extension", c._jax_cp_cuda.__file__)
print("build_info", c.build_info())
PYEOF
if [[ "${JAX_CP_INSTALL_ONLY:-0}" == 1 ]]; then exit 0; fi

# 4. The GPU tests (marker gpu), the C++/Python contract and CUDA lowering
#    tests, plus whatever the caller passed. A test that needs more GPUs
#    than the machine has (cp >= 2 on one GPU) is skipped, which pytest
#    counts as a success; the summary counts those skips
#    (tests/gpu/skip_summary.py reads the JUnit reports).
set +e
"$PY" -m pytest -v -rs --junitxml "$LOG_DIR/junit_contract.xml" \
  tests/test_cuda_contract.py tests/test_cudnn_lowering.py 2>&1 |
  tee "$LOG_DIR/pytest_contract.log"
contract=${PIPESTATUS[0]}
"$PY" -m pytest -m gpu -v -rs --junitxml "$LOG_DIR/junit_gpu.xml" "$@" 2>&1 |
  tee "$LOG_DIR/pytest_gpu.log"
status=${PIPESTATUS[0]}
set -e
"$PY" tests/gpu/skip_summary.py \
  "contract/lowering tests=$LOG_DIR/junit_contract.xml" \
  "gpu tests=$LOG_DIR/junit_gpu.xml" | tee "$LOG_DIR/summary.log" ||
  echo "(no test summary: tests/gpu/skip_summary.py failed)" >&2
echo "contract/lowering tests exit status: $contract"
echo "pytest exit status: $status (logs in $LOG_DIR)"
if (( status == 0 )); then status=$contract; fi
exit "$status"
