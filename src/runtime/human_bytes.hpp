// runtime/human_bytes.hpp: byte counts as text for reports ("10.50 MiB"; binary units, two
// decimals above bytes). Used by the checkpoint inspection and the preparation reports.
#pragma once

#include <cstdint>
#include <iomanip>
#include <sstream>
#include <string>

namespace megamoe {

inline std::string human_bytes(int64_t bytes) {
  constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  constexpr int kLastUnit = 4;
  constexpr double kStep = 1024.0;
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= kStep && u < kLastUnit) {
    v /= kStep;
    ++u;
  }
  std::ostringstream os;
  os << std::fixed << std::setprecision(u == 0 ? 0 : 2) << v << ' ' << kUnits[u];
  return os.str();
}

}  // namespace megamoe
