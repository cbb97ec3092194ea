// libFuzzer target: weight preparation. The input picks dims, a layout, a scratch bound and
// possibly a corrupted buffer size or layout label, then supplies the bytes. A preparation that
// succeeds must invert bit for bit; a refused one must leave the weights untouched.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "megamoe/error.hpp"
#include "megamoe/prepare.hpp"

namespace {

using namespace megamoe;

struct Reader {
  const uint8_t* data;
  size_t size;
  size_t pos = 0;
  uint8_t byte() { return pos < size ? data[pos++] : 0; }
};

void fill(Buffer& b, Reader& r) {
  auto* p = b.as<uint8_t>();
  for (int64_t i = 0; i < b.size(); ++i) p[i] = r.byte() ^ static_cast<uint8_t>(i * 131);
}

MoeWeights copy_of(const MoeWeights& w) {
  return w.to(Device::cpu());
}

bool same(const Buffer& a, const Buffer& b) {
  return a.size() == b.size() && (a.size() == 0 || std::memcmp(a.data(), b.data(), a.size()) == 0);
}

bool same(const MoeWeights& a, const MoeWeights& b) {
  return a.layout == b.layout && same(a.w13, b.w13) && same(a.w13_sf, b.w13_sf) && same(a.w2, b.w2) &&
         same(a.w2_sf, b.w2_sf) && same(a.w13_bias, b.w13_bias) && same(a.w2_bias, b.w2_bias);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader r{data, size};
  const std::vector<std::string> layouts = layout_names();
  MoeWeights w;
  // Small dims keep runs fast; they include multiples of 64 and 128 (sm90, blackwell-interop)
  // and K % 128 != 0 (scale padding).
  w.num_local_experts = 1 + r.byte() % 3;
  w.first_expert = r.byte() % 8;
  w.hidden = 32 * (1 + r.byte() % 8);
  w.intermediate = 32 * (1 + r.byte() % 8);
  const bool bias = r.byte() & 1;
  const std::string& target = layouts[r.byte() % layouts.size()];
  const uint8_t corrupt = r.byte();
  PrepareOptions opt;
  opt.scratch_bytes = static_cast<int64_t>(r.byte()) * 97;
  const ExpertDims d{w.hidden, w.intermediate};
  const int64_t el = w.num_local_experts;
  w.w13 = Buffer(el * canonical_expert_bytes(WeightBufferKind::kW13, d));
  w.w13_sf = Buffer(el * canonical_expert_bytes(WeightBufferKind::kW13Sf, d));
  w.w2 = Buffer(el * canonical_expert_bytes(WeightBufferKind::kW2, d));
  w.w2_sf = Buffer(el * canonical_expert_bytes(WeightBufferKind::kW2Sf, d));
  if (bias) {
    w.w13_bias = Buffer(el * canonical_expert_bytes(WeightBufferKind::kW13Bias, d));
    w.w2_bias = Buffer(el * canonical_expert_bytes(WeightBufferKind::kW2Bias, d));
  }
  for (int b = 0; b < kNumWeightBuffers; ++b) fill(weight_buffer(w, static_cast<WeightBufferKind>(b)), r);
  // Sometimes lie about the weights: a shrunk buffer, or a layout label that does not match.
  if (corrupt % 8 == 1) w.w2_sf.shrink(w.w2_sf.size() - 1);
  if (corrupt % 8 == 2) w.layout = layouts[corrupt / 8 % layouts.size()];
  if (corrupt % 8 == 3) w.w2_bias.release();
  const MoeWeights original = copy_of(w);
  try {
    prepare(w, target, opt);
  } catch (const Error&) {
    if (!same(w, original)) std::abort();  // a refused preparation changes nothing
    return 0;
  }
  if (w.layout != target) std::abort();
  if (original.layout == kCanonicalLayout) {
    unprepare(w, opt);
    if (!same(w, original)) std::abort();  // exact inverse
  }
  return 0;
}
