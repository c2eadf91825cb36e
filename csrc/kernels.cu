// The extension's own device code, compiled to one PTX module for
// compute_80 at build time (CMakeLists.txt, BUILD), embedded as a string and
// loaded at run time (device_kernels.cc). One header per kernel family.
#include "clear_rows_kernels.cuh"
#include "ragged_offsets_kernels.cuh"
#include "row_merge_kernels.cuh"
