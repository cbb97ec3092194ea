// Stand-in for torch's <torch/headeronly/util/Exception.h> when vLLM's Marlin sources are built
// without torch (bench/peers/build_marlin.sh). vLLM's kernel headers use one thing from it:
// STD_TORCH_CHECK(cond, message parts...), which throws std::runtime_error when cond is false.
// The C entry points of the peer library (moe_shim.cu, repack_shim.cu) catch it and hand the
// message back through mmp_last_error().
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace megamoe_marlin_peer {

template <typename... Parts>
std::string check_message(const char* cond, const char* file, int line, const Parts&... parts) {
  std::ostringstream os;
  os << file << ":" << line << ": check `" << cond << "` failed";
  if constexpr (sizeof...(parts) > 0) {
    os << ": ";
    (os << ... << parts);
  }
  return os.str();
}

}  // namespace megamoe_marlin_peer

#define STD_TORCH_CHECK(cond, ...)                                                          \
  if (!(cond)) {                                                                            \
    throw std::runtime_error(                                                               \
        ::megamoe_marlin_peer::check_message(#cond, __FILE__, __LINE__, ##__VA_ARGS__));    \
  }
