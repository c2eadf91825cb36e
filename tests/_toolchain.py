"""The host C++ toolchain the tests build with: which compiler, and
whether it has an AddressSanitizer runtime."""

from __future__ import annotations

import os
import shutil
import subprocess


def cxx() -> str | None:
  """The C++ compiler (``$CXX``, else ``g++``, else ``c++``), or None."""
  return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


def asan_runtime(compiler: str | None) -> str | None:
  """The absolute path of ``compiler``'s ``libasan.so``, or None when it
  has none (``-print-file-name`` answers the bare name then)."""
  if compiler is None:
    return None
  try:
    lib = subprocess.run([compiler, "-print-file-name=libasan.so"],
                         capture_output=True, text=True, check=True,
                         timeout=60).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None
  return lib if os.path.isabs(lib) and os.path.exists(lib) else None
