// Errors returned by the FFI handlers: one helper for invalid operands and
// one guard that keeps C++ exceptions from crossing the FFI boundary (the
// cuDNN frontend throws on some failures, the standard library on OOM).
#ifndef JAX_CP_CSRC_FFI_ERRORS_H_
#define JAX_CP_CSRC_FFI_ERRORS_H_

#include <exception>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jax_cp {

// InvalidArgument "<call>: <what>".
inline xla::ffi::Error Invalid(std::string_view call, std::string_view what) {
  std::string message(call);
  message += ": ";
  message += what;
  return xla::ffi::Error::InvalidArgument(std::move(message));
}

// Returns body() (an xla::ffi::Error); a C++ exception becomes an Internal
// error "<where>: C++ exception: <what()>". `where` is a string or a callable
// returning one, evaluated only when something was thrown.
template <typename Where, typename Body>
xla::ffi::Error GuardFfi(const Where& where, Body&& body) noexcept {
  auto fail = [&where](std::string_view what) noexcept {
    try {
      std::string message;
      if constexpr (std::is_invocable_v<const Where&>) {
        message = where();
      } else {
        message = std::string(where);
      }
      message += ": ";
      message += what;
      return xla::ffi::Error::Internal(std::move(message));
    } catch (...) {
      return xla::ffi::Error::Internal("jax_cp: C++ exception");
    }
  };
  try {
    return body();
  } catch (const std::exception& e) {
    return fail(std::string("C++ exception: ") + e.what());
  } catch (...) {
    return fail("unknown C++ exception");
  }
}

}  // namespace jax_cp

#endif  // JAX_CP_CSRC_FFI_ERRORS_H_
