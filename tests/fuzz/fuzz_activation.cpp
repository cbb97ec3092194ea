// libFuzzer target: Activation::parse on arbitrary text (docs/reliability.md, "Fuzzing").
//
// Invariants checked (a violation aborts, which libFuzzer reports as a crash):
//  - parse either returns a valid Activation or throws megamoe::Error (kInvalidArgument); nothing
//    else escapes;
//  - an accepted spec passes validate(), and its canonical spelling to_string() parses back to an
//    identical Activation (the text form round-trips exactly);
//  - evaluating it on a few g/u values (including non-finite ones) does not trap.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "megamoe/activation.hpp"
#include "megamoe/error.hpp"

namespace {

bool same(const megamoe::Activation& a, const megamoe::Activation& b) {
  return a.kind == b.kind && a.has_clamp == b.has_clamp && a.clamp == b.clamp && a.beta == b.beta &&
         a.linear_beta == b.linear_beta && a.alpha == b.alpha;
}

[[noreturn]] void violated(const char* what, std::string_view spec) {
  std::fprintf(stderr, "fuzz_activation: %s for spec '%.*s'\n", what, static_cast<int>(spec.size()),
               spec.data());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view spec(reinterpret_cast<const char*>(data), size);
  megamoe::Activation act;
  try {
    act = megamoe::Activation::parse(spec);
  } catch (const megamoe::Error& e) {
    if (e.code() != megamoe::ErrorCode::kInvalidArgument) violated("unexpected error code", spec);
    return 0;
  }
  try {
    act.validate();
  } catch (const megamoe::Error&) {
    violated("parse accepted a spec that validate() rejects", spec);
  }
  const std::string canonical = act.to_string();
  megamoe::Activation back;
  try {
    back = megamoe::Activation::parse(canonical);
  } catch (const megamoe::Error&) {
    violated("to_string() of an accepted spec does not parse", spec);
  }
  if (!same(act, back)) violated("to_string() does not round-trip", spec);
  const float values[] = {0.0f, -1.22f, 30.0f, 1e30f, -INFINITY, NAN};
  volatile float sink = 0.0f;
  for (float g : values)
    for (float u : values)
      for (bool fast : {false, true}) sink = sink + megamoe::apply_activation(act, g, u, fast);
  (void)sink;
  return 0;
}
