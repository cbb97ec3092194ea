// The last error of a C entry point of libmegamoe_marlin_peer.so (per thread), shared by
// moe_shim.cu and repack_shim.cu.
#pragma once

#include <string>

namespace megamoe_marlin_peer {
void set_error(const std::string& message);
}  // namespace megamoe_marlin_peer
