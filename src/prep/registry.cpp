// The registry of weight layouts and the backend -> layout mapping.
#include <deque>
#include <mutex>

#include "megamoe/error.hpp"
#include "prep/layouts.hpp"

// The Hopper layout is owned by the GPU backend (src/prep/sm90_layout.{hpp,cpp}); it is built in
// as soon as its header exists, with no edit here.
#if __has_include("prep/sm90_layout.hpp")
#include "prep/sm90_layout.hpp"
#define MEGAMOE_HAS_SM90_LAYOUT 1
#endif

namespace megamoe {

namespace {

// NOTES: find_layout hands out references, so layouts live in an append-only std::deque (whose
// elements never move on push_back).
struct Registry {
  std::mutex mutex;
  std::deque<WeightLayout> layouts;
};

void check_layout_definition(const WeightLayout& layout) {
  MEGAMOE_CHECK_ARG(!layout.name.empty(), "register_layout: empty layout name");
  for (int b = 0; b < kNumWeightBuffers; ++b) {
    const BufferTransform& t = layout.buffers[b];
    const char* buf = weight_buffer_name(static_cast<WeightBufferKind>(b));
    MEGAMOE_CHECK_ARG((t.forward == nullptr) == (t.inverse == nullptr), "register_layout: layout '",
                      layout.name, "' buffer ", buf, ": forward and inverse must both be given or both be null");
    MEGAMOE_CHECK_ARG((t.forward_device == nullptr) == (t.inverse_device == nullptr),
                      "register_layout: layout '", layout.name, "' buffer ", buf,
                      ": forward_device and inverse_device must both be given or both be null");
    MEGAMOE_CHECK_ARG(t.prepared_expert_bytes == nullptr || t.forward != nullptr ||
                          t.forward_device != nullptr,
                      "register_layout: layout '", layout.name, "' buffer ", buf,
                      ": a size change needs a transform");
  }
}

Registry& registry() {
  static Registry* r = [] {
    auto* reg = new Registry;
    reg->layouts.push_back(prep::canonical_weight_layout());
    reg->layouts.push_back(prep::blackwell_interop_weight_layout());
#if defined(MEGAMOE_HAS_SM90_LAYOUT)
    reg->layouts.push_back(prep::sm90_weight_layout());
#endif
    for (const auto& l : reg->layouts) check_layout_definition(l);
    return reg;
  }();
  return *r;
}

std::string known_names(Registry& r) {
  std::string s;
  for (const auto& l : r.layouts) s += (s.empty() ? "" : ", ") + l.name;
  return s;
}

}  // namespace

const char* weight_buffer_name(WeightBufferKind kind) {
  switch (kind) {
    case WeightBufferKind::kW13: return "w13";
    case WeightBufferKind::kW13Sf: return "w13_sf";
    case WeightBufferKind::kW2: return "w2";
    case WeightBufferKind::kW2Sf: return "w2_sf";
    case WeightBufferKind::kW13Bias: return "w13_bias";
    case WeightBufferKind::kW2Bias: return "w2_bias";
  }
  return "unknown";
}

void register_layout(const WeightLayout& layout) {
  check_layout_definition(layout);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& l : r.layouts) {
    MEGAMOE_CHECK_ARG(l.name != layout.name, "register_layout: layout '", layout.name,
                      "' is already registered");
  }
  r.layouts.push_back(layout);
}

const WeightLayout& find_layout(std::string_view name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& l : r.layouts) {
    if (l.name == name) return l;
  }
  fail(ErrorCode::kInvalidArgument, "layout '", name, "' is not registered (known: ",
       known_names(r), ")",
       name == "sm90" ? "; the Hopper layout comes with src/prep/sm90_layout.cpp" : "");
}

bool has_layout(std::string_view name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& l : r.layouts) {
    if (l.name == name) return true;
  }
  return false;
}

std::vector<std::string> layout_names() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::string> names;
  for (const auto& l : r.layouts) names.push_back(l.name);
  return names;
}

std::string layout_for_backend(std::string_view backend) {
  if (backend == "reference" || backend == "cpu" || backend == kCanonicalLayout) {
    return kCanonicalLayout;
  }
  if (has_layout(backend)) return std::string(backend);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  fail(ErrorCode::kInvalidArgument, "backend: unknown backend '", backend,
       "' (expected reference, cpu or a layout: ", known_names(r), ")");
}

std::string fused_layout_for_arch(int sm_version) {
  constexpr int kHopper = 90, kBlackwellB200 = 100, kBlackwellB300 = 103;
  if (sm_version == kHopper) return "sm90";
  if (sm_version == kBlackwellB200 || sm_version == kBlackwellB300) return "blackwell-interop";
  fail(ErrorCode::kUnsupported, "prepare_for_fused: no fused MegaMoE kernel for sm_", sm_version,
       " (expected 90 for Hopper, 100 or 103 for Blackwell)");
}

int64_t WeightLayout::expert_bytes(WeightBufferKind kind, const ExpertDims& dims) const {
  const BufferTransform& t = buffer(kind);
  return t.prepared_expert_bytes != nullptr ? t.prepared_expert_bytes(dims)
                                            : canonical_expert_bytes(kind, dims);
}

}  // namespace megamoe
