#include "megamoe/error.hpp"

namespace megamoe {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "invalid argument";
    case ErrorCode::kOutOfRange: return "out of range";
    case ErrorCode::kFormat: return "format error";
    case ErrorCode::kIo: return "I/O error";
    case ErrorCode::kUnsupported: return "unsupported";
    case ErrorCode::kCuda: return "CUDA error";
    case ErrorCode::kTimeout: return "timeout";
    case ErrorCode::kInternal: return "internal error";
  }
  return "error";
}

}  // namespace megamoe
