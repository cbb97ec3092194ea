// LayerShape / LayerConfig: validation and the named shapes of targets.md.
#include "megamoe/config.hpp"

#include <array>
#include <sstream>

#include "megamoe/error.hpp"
#include "megamoe/formats.hpp"
#include "moe/sm90_tile_policy.hpp"

namespace megamoe {

namespace {

struct ShapePreset {
  const char* name;
  LayerShape shape;
};

// targets.md, "Shapes". Order = the order shape_preset_names() lists them.
constexpr std::array<ShapePreset, 4> kShapePresets = {{
    {"kimi-k3", {3584, 3072, 896, 16}},      // latent H; situ(4, 25); EP8 in production
    {"deepseek-v3", {7168, 2048, 256, 8}},   // swiglu
    {"gpt-oss-120b", {2880, 2880, 128, 4}},  // swiglu_oai + bias; 2880 is not a multiple of 128
    {"small", {1024, 512, 32, 4}},           // quick tests, CPU CI
}};

std::string preset_list() {
  std::string s;
  for (const auto& p : kShapePresets) s += (s.empty() ? "" : ", ") + std::string(p.name);
  return s;
}

}  // namespace

void LayerShape::validate() const {
  MEGAMOE_CHECK_ARG(hidden > 0 && hidden % kScaleBlock == 0, "shape: hidden (H) must be a positive ",
                    "multiple of ", kScaleBlock, ", got ", hidden);
  MEGAMOE_CHECK_ARG(intermediate > 0 && intermediate % kScaleBlock == 0,
                    "shape: intermediate (I) must be a positive multiple of ", kScaleBlock, ", got ",
                    intermediate);
  MEGAMOE_CHECK_ARG(num_experts > 0, "shape: num_experts (E) must be > 0, got ", num_experts);
  MEGAMOE_CHECK_ARG(top_k > 0 && top_k <= num_experts, "shape: top_k (K) must be in [1, E=",
                    num_experts, "], got ", top_k);
}

std::string LayerShape::to_string() const {
  std::ostringstream os;
  os << "H=" << hidden << " I=" << intermediate << " E=" << num_experts << " K=" << top_k;
  return os.str();
}

LayerShape shape_preset(std::string_view name) {
  for (const auto& p : kShapePresets)
    if (name == p.name) return p.shape;
  fail(ErrorCode::kInvalidArgument, "shape: unknown preset '", name, "' (expected one of ",
       preset_list(), ")");
}

Activation activation_preset(std::string_view shape_name) {
  (void)shape_preset(shape_name);  // rejects unknown names
  if (shape_name == "kimi-k3") return Activation::situ(4.0f, 25.0f);
  if (shape_name == "gpt-oss-120b") return Activation::swiglu_oai(1.702f, 7.0f);
  return Activation::swiglu();
}

std::vector<std::string> shape_preset_names() {
  std::vector<std::string> names;
  for (const auto& p : kShapePresets) names.emplace_back(p.name);
  return names;
}

Precision parse_precision(std::string_view name) {
  if (name == "exact") return Precision::kExact;
  if (name == "fp8") return Precision::kFp8;
  fail(ErrorCode::kInvalidArgument, "precision: expected exact or fp8, got '", name, "'");
}

const char* to_string(Precision precision) {
  switch (precision) {
    case Precision::kExact: return "exact";
    case Precision::kFp8: return "fp8";
  }
  return "?";
}

RowsHintMode parse_rows_hint_mode(std::string_view name) {
  if (name == "gated") return RowsHintMode::kGated;
  if (name == "bound") return RowsHintMode::kBound;
  if (name == "expected") return RowsHintMode::kExpected;
  fail(ErrorCode::kInvalidArgument, "rows_hint: expected gated, bound or expected, got '", name,
       "'");
}

const char* to_string(RowsHintMode mode) {
  switch (mode) {
    case RowsHintMode::kGated: return "gated";
    case RowsHintMode::kBound: return "bound";
    case RowsHintMode::kExpected: return "expected";
  }
  return "?";
}

void LayerConfig::validate() const {
  shape.validate();
  const sm90::TileRequest tile = sm90::parse_tile_request(sm90.gemm_tile);  // throws naming the valid tiles
  MEGAMOE_CHECK_ARG(tile.mode != sm90::TileRequest::Mode::kForced ||
                        !sm90::tile_config(tile.tile).fp8() || precision == Precision::kFp8,
                    "config: sm90.gemm_tile: '", sm90.gemm_tile, "' is an FP8-mode tile, for the "
                    "FP8 mode's calls; the layer runs the exact mode (precision exact)");
  MEGAMOE_CHECK_ARG(static_cast<unsigned>(precision) <= static_cast<unsigned>(Precision::kFp8),
                    "config: precision: expected exact or fp8, got value ",
                    static_cast<int>(precision));
  MEGAMOE_CHECK_ARG(fp8_min_rows_per_expert >= 0,
                    "config: fp8_min_rows_per_expert: expected >= 0, got ", fp8_min_rows_per_expert);
  constexpr auto kLastRowsHint = static_cast<unsigned>(RowsHintMode::kExpected);
  MEGAMOE_CHECK_ARG(static_cast<unsigned>(sm90.rows_hint) <= kLastRowsHint,
                    "config: sm90.rows_hint: expected gated, bound or expected, got value ",
                    static_cast<int>(sm90.rows_hint));
  MEGAMOE_CHECK_ARG(!sm90.mega_combine || sm90.mega_kernel,
                    "config: sm90.mega_combine (the combine inside the MegaMoE kernel) needs "
                    "sm90.mega_kernel");
  MEGAMOE_CHECK_ARG(!sm90.mega_dispatch || sm90.mega_kernel,
                    "config: sm90.mega_dispatch (the dispatch inside the MegaMoE kernel) needs "
                    "sm90.mega_kernel");
  MEGAMOE_CHECK_ARG(ep_size >= 1, "config: ep_size must be >= 1, got ", ep_size);
  MEGAMOE_CHECK_ARG(shape.num_experts % ep_size == 0, "config: ep_size ", ep_size,
                    " must divide num_experts ", shape.num_experts);
  MEGAMOE_CHECK_ARG(ep_rank >= 0 && ep_rank < ep_size, "config: ep_rank must be in [0, ep_size=",
                    ep_size, "), got ", ep_rank);
  MEGAMOE_CHECK_ARG(max_tokens_per_rank >= 0, "config: max_tokens_per_rank must be >= 0, got ",
                    max_tokens_per_rank);
  activation.validate();
}

}  // namespace megamoe
