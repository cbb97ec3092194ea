// "canonical": the form every backend starts from (weights.md section 2). Every buffer is left as
// it is, so preparing for the reference backend moves no byte.
#include "prep/layouts.hpp"

namespace megamoe::prep {

WeightLayout canonical_weight_layout() {
  WeightLayout layout;
  layout.name = kCanonicalLayout;
  layout.description = "canonical expert form (weights.md section 2): gate rows then up rows";
  return layout;  // every BufferTransform is the identity
}

}  // namespace megamoe::prep
