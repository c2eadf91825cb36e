"""Compiles csrc/kernels.cu to PTX with NVRTC (no nvcc): the build-time tool
CMakeLists.txt runs when no CUDA toolkit compiler is found.

  python nvrtc_ptx.py --nvrtc LIB --arch compute_80 [-I DIR]... SRC OUT

LIB is libnvrtc.so.13 (the nvidia-cuda-nvrtc wheel's, or a toolkit's). Headers
named with quotes are looked up next to SRC and in the -I folders; NVRTC's
own built-in headers provide cuda_fp16.h and cuda_bf16.h. Only the Python
standard library is used (ctypes), so it runs in an isolated build
environment. Errors print NVRTC's log and exit with status 1.
"""

import argparse
import ctypes
import os
import re
import sys


def _check(nvrtc, status, what, log=""):
  if status != 0:
    nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
    name = nvrtc.nvrtcGetErrorString(status).decode()
    sys.exit(f"nvrtc_ptx: {what} failed: {name}\n{log}")


def compile_ptx(lib: str, src: str, arch: str, includes) -> bytes:
  # libnvrtc dlopens libnvrtc-builtins.so.<major>.<minor> by name, which the
  # loader does not find in a wheel's folder: load it first from beside lib.
  folder = os.path.dirname(os.path.abspath(lib))
  for name in sorted(os.listdir(folder)):
    if re.fullmatch(r"libnvrtc-builtins\.so\.\d+\.\d+", name):
      ctypes.CDLL(os.path.join(folder, name), mode=ctypes.RTLD_GLOBAL)
  nvrtc = ctypes.CDLL(lib)
  with open(src, "rb") as f:
    source = f.read()
  prog = ctypes.c_void_p()
  _check(nvrtc, nvrtc.nvrtcCreateProgram(
      ctypes.byref(prog), source, os.path.basename(src).encode(), 0, None,
      None), "nvrtcCreateProgram")
  opts = [f"--gpu-architecture={arch}", "--std=c++17",
          f"--include-path={os.path.dirname(os.path.abspath(src))}"]
  opts += [f"--include-path={d}" for d in includes]
  argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
  status = nvrtc.nvrtcCompileProgram(prog, len(opts), argv)
  size = ctypes.c_size_t()
  nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
  log = ctypes.create_string_buffer(size.value)
  nvrtc.nvrtcGetProgramLog(prog, log)
  _check(nvrtc, status, f"compiling {src}", log.value.decode(errors="replace"))
  _check(nvrtc, nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size)),
         "nvrtcGetPTXSize")
  ptx = ctypes.create_string_buffer(size.value)
  _check(nvrtc, nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
  nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
  return ptx.value  # without the terminating NUL


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--nvrtc", required=True, help="path of libnvrtc.so")
  parser.add_argument("--arch", default="compute_80")
  parser.add_argument("-I", dest="includes", action="append", default=[])
  parser.add_argument("src")
  parser.add_argument("out")
  args = parser.parse_args()
  ptx = compile_ptx(args.nvrtc, args.src, args.arch, args.includes)
  with open(args.out, "wb") as f:
    f.write(ptx)


if __name__ == "__main__":
  main()
