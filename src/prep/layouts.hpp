// Built-in weight layouts (src/prep/), registered by registry.cpp. docs/layouts.md documents each.
#pragma once

#include "megamoe/prepare.hpp"

namespace megamoe::prep {

// "canonical": weights.md section 2, every buffer unchanged.
WeightLayout canonical_weight_layout();
// "blackwell-interop": weights.md section 3 (DeepGEMM SM100 fp8_fp4_mega_moe).
WeightLayout blackwell_interop_weight_layout();

}  // namespace megamoe::prep
