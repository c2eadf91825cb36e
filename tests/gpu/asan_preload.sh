#!/usr/bin/env bash
# Prints the LD_PRELOAD value under which an AddressSanitizer build of the
# extension (CMakeLists.txt, JAX_CP_ASAN) runs in an uninstrumented Python:
# the absolute paths of ASan's runtime and of a C++ runtime, in that order.
#
#   tests/gpu/asan_preload.sh [MODULE]
#
# CXX: the compiler that built MODULE (default c++). MODULE: the built
# extension (any shared object); it decides which C++ runtime is preloaded.
#
# * ASan's runtime is the compiler's own (`-print-file-name=libasan.so`):
#   the instrumented code and its runtime must come from one compiler.
# * The C++ runtime must be in the process when ASan starts: ASan finds
#   the real `__cxa_throw` then, and stops the process at the first C++
#   exception if there was none. It is, in order: the compiler's
#   `libstdc++.so` or `libstdc++.so.6`; else the one MODULE loads (`ldd`),
#   where MODULE links one; else the one the dynamic loader's cache lists
#   (the one Python's other extensions load). A compiler can know its ASan
#   runtime and no shared C++ runtime (a toolchain installed beside the
#   system's), in which case its `-print-file-name` answers a bare name.
#
# Exits 1 with a message naming what is missing when either path cannot be
# found.
set -euo pipefail

cxx=${CXX:-c++}
module=${1:-}

# The first of the names that the compiler resolves to a file.
from_compiler() {
  local name path
  for name in "$@"; do
    path=$("$cxx" -print-file-name="$name" 2> /dev/null) || continue
    if [[ "$path" == /* && -e "$path" ]]; then
      echo "$path"
      return 0
    fi
  done
  return 1
}

# The file that MODULE's dependency NAME resolves to for the loader.
from_module() {
  local name=$1 lines
  [[ -n "$module" && -e "$module" ]] || return 1
  command -v ldd > /dev/null || return 1
  lines=$(ldd "$module" 2> /dev/null) || return 1
  awk -v n="$name" '$1 == n && $3 ~ /^\// {print $3; exit}' <<< "$lines" |
    grep .
}

# The file that the loader's cache lists for NAME.
from_loader_cache() {
  local name=$1 ldconfig lines
  ldconfig=$(command -v ldconfig || echo /sbin/ldconfig)
  [[ -x "$ldconfig" ]] || return 1
  lines=$("$ldconfig" -p 2> /dev/null) || return 1
  awk -v n="$name" '$1 == n {print $NF; exit}' <<< "$lines" | grep .
}

if ! asan=$(from_compiler libasan.so); then
  echo "asan_preload: $cxx knows no libasan.so (-print-file-name); build" \
       "with a compiler that has AddressSanitizer (CXX=...)" >&2
  exit 1
fi
if ! cxxrt=$(from_compiler libstdc++.so libstdc++.so.6 ||
             from_module libstdc++.so.6 ||
             from_loader_cache libstdc++.so.6); then
  echo "asan_preload: no libstdc++.so.6 found (not by $cxx" \
       "-print-file-name, not among ${module:-the module}'s dependencies," \
       "not in the loader's cache)" >&2
  exit 1
fi
echo "$asan $cxxrt"
