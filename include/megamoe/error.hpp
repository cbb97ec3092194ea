// megamoe/error.hpp: the one error type every host-side check throws.
//
// A message always names what was wrong: the argument, the expected value and the actual one,
// e.g. "topk_idx: expected dtype int32, got float32".
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace megamoe {

enum class ErrorCode {
  kInvalidArgument,  // bad shape, dtype, device, value, option or combination
  kOutOfRange,       // an index or count outside its valid range (expert id >= E, T > capacity)
  kFormat,           // malformed file or data (safetensors, prepared weights)
  kIo,               // open/read/write/mmap failures
  kUnsupported,      // valid request this build or machine cannot serve (no GPU, no CUDA)
  kCuda,             // a CUDA runtime/driver call failed
  kTimeout,          // another rank of an EP group did not arrive in time (megamoe/ep.hpp)
  kInternal,         // a broken invariant inside megamoe
};

const char* error_code_name(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message)
      : std::runtime_error(message), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
}  // namespace detail

template <typename... Args>
[[noreturn]] void fail(ErrorCode code, Args&&... args) {
  throw Error(code, detail::concat(std::forward<Args>(args)...));
}

}  // namespace megamoe

// MEGAMOE_CHECK(cond, code, message parts...): throw megamoe::Error when cond is false.
#define MEGAMOE_CHECK(cond, code, ...)                      \
  do {                                                      \
    if (!(cond)) ::megamoe::fail((code), __VA_ARGS__);      \
  } while (0)

#define MEGAMOE_CHECK_ARG(cond, ...) \
  MEGAMOE_CHECK(cond, ::megamoe::ErrorCode::kInvalidArgument, __VA_ARGS__)
