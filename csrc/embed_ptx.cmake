# cmake -DPTX=<in.ptx> -DOUT=<out.cc> -DSYMBOL=<name> -P embed_ptx.cmake
# Writes a C++ file defining `extern const char jax_cp::<SYMBOL>[]` holding
# the PTX text (a raw string literal; PTX never contains the delimiter).
file(READ "${PTX}" _ptx)
file(WRITE "${OUT}"
  "// Generated from csrc/kernels.cu by csrc/embed_ptx.cmake; do not edit.\n"
  "namespace jax_cp {\n"
  "extern const char ${SYMBOL}[];\n"
  "const char ${SYMBOL}[] = R\"jaxcpptx(${_ptx})jaxcpptx\";\n"
  "}  // namespace jax_cp\n")
