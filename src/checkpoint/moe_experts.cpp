// Recognition of MoE expert tensors (weights.md section 1) and loading into the canonical form
// (weights.md section 2), one layer and one EP rank at a time.
//
//   kPerExpert (Kimi-K3):  {prefix}.experts.{e}.w{1,3,2}.weight_{packed,scale}
//   kFused (GPT-OSS):      {prefix}.experts.{gate_up,down}_proj_{blocks,scales,bias}
//
// Canonical (per local expert j): w13 rows [0, I) = gate (w1 / GPT-OSS even rows),
// rows [I, 2I) = up (w3 / GPT-OSS odd rows); w2 unchanged. Biases follow their rows.
#include <algorithm>
#include <charconv>
#include <cstring>
#include <limits>

#include "checkpoint/safetensors_detail.hpp"
#include "megamoe/error.hpp"
#include "megamoe/formats.hpp"

namespace megamoe {

namespace {

constexpr std::string_view kExpertsInfix = ".experts.";
constexpr std::string_view kLayersInfix = "layers.";
constexpr int64_t kMaxExpertIndex = 1 << 20;   // far above any real model (Kimi-K3: 896)
constexpr int64_t kE2m1PerByte = 2;
constexpr int64_t kGptOssBlockBytes = 16;      // 32 E2M1 codes of one scale block
constexpr int64_t kBf16Bytes = 2;
constexpr int64_t kInterleave = 2;             // GPT-OSS: row 2i gate i, row 2i + 1 up i

// Per-expert convention: matrix x kind.
enum Matrix { kW1 = 0, kW3 = 1, kW2 = 2, kNumMatrices = 3 };
enum Kind { kPacked = 0, kScale = 1, kShape = 2, kNumKinds = 3 };
constexpr const char* kMatrixNames[kNumMatrices] = {"w1", "w3", "w2"};
constexpr const char* kKindSuffixes[kNumKinds] = {"weight_packed", "weight_scale", "weight_shape"};

// Fused convention.
enum Fused { kGateUpBlocks = 0, kGateUpScales, kGateUpBias, kDownBlocks, kDownScales, kDownBias,
             kNumFused };
constexpr const char* kFusedSuffixes[kNumFused] = {
    "gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias",
    "down_proj_blocks",    "down_proj_scales",    "down_proj_bias"};

using TensorRef = Checkpoint::TensorRef;

struct LayerGroup {
  std::map<int64_t, std::array<std::array<TensorRef, kNumKinds>, kNumMatrices>> experts;
  std::array<TensorRef, kNumFused> fused{};
  bool any_fused = false;
};

bool parse_decimal(std::string_view s, int64_t* out) {
  if (s.empty() || (s.size() > 1 && s[0] == '0')) return false;
  int64_t v = 0;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || ptr != s.data() + s.size()) return false;
  *out = v;
  return true;
}

int64_t layer_index_of(std::string_view prefix) {
  // The last "layers.{L}" component: at the start or after a '.'.
  for (size_t pos = prefix.rfind(kLayersInfix); pos != std::string_view::npos;
       pos = pos == 0 ? std::string_view::npos : prefix.rfind(kLayersInfix, pos - 1)) {
    if (pos != 0 && prefix[pos - 1] != '.') continue;
    const size_t begin = pos + kLayersInfix.size();
    size_t end = prefix.find('.', begin);
    if (end == std::string_view::npos) end = prefix.size();
    int64_t v = 0;
    if (parse_decimal(prefix.substr(begin, end - begin), &v)) return v;
  }
  return -1;
}

std::string where(const TensorRef& ref) {
  return detail::concat(ref.file->path(), ": tensor ", detail::quote_name(ref.info->name));
}

void expect_tensor(const TensorRef& ref, std::initializer_list<StDType> dtypes,
                   const std::vector<int64_t>& shape, const char* why) {
  bool dtype_ok = false;
  std::string allowed;
  for (StDType d : dtypes) {
    dtype_ok |= ref.info->dtype == d;
    allowed += allowed.empty() ? "" : " or ";
    allowed += st_dtype_name(d);
  }
  MEGAMOE_CHECK(dtype_ok, ErrorCode::kFormat, where(ref), ": wrong dtype: expected ", allowed,
                ", got ", st_dtype_name(ref.info->dtype));
  MEGAMOE_CHECK(ref.info->shape == shape, ErrorCode::kFormat, where(ref), ": expected shape ",
                detail::shape_string(shape), " ", why, ", got ",
                detail::shape_string(ref.info->shape));
}

void check_dims(const std::string& where_text, int64_t hidden, int64_t intermediate) {
  MEGAMOE_CHECK(hidden > 0 && hidden % kScaleBlock == 0, ErrorCode::kFormat, where_text,
                ": hidden size H = ", hidden, " must be a positive multiple of ", kScaleBlock);
  MEGAMOE_CHECK(intermediate > 0 && intermediate % kScaleBlock == 0, ErrorCode::kFormat,
                where_text, ": intermediate size I = ", intermediate,
                " must be a positive multiple of ", kScaleBlock);
}

// ---------------------------------------------------------------------------------------------
// Per-expert convention
// ---------------------------------------------------------------------------------------------
MoeLayerInfo validate_per_expert(const Checkpoint& ckpt, const std::string& prefix,
                                 const LayerGroup& g) {
  MoeLayerInfo info;
  info.prefix = prefix;
  info.layer_index = layer_index_of(prefix);
  info.convention = ExpertConvention::kPerExpert;
  info.num_experts = g.experts.rbegin()->first + 1;

  // Every expert 0..E-1 with w1/w3/w2 packed + scale (a weight without its scale is a missing
  // partner; an expert with nothing at all is a missing expert).
  for (int64_t e = 0; e < info.num_experts; ++e) {
    const auto it = g.experts.find(e);
    MEGAMOE_CHECK(it != g.experts.end(), ErrorCode::kFormat, ckpt.path(), ": layer ",
                  detail::quote_name(prefix), ": missing expert ", e, " (tensor ",
                  detail::quote_name(per_expert_tensor_name(prefix, e, "w1", "weight_packed")),
                  " not found; experts found up to ", info.num_experts - 1, ")");
    for (int m = 0; m < kNumMatrices; ++m) {
      const auto& t = it->second[m];
      const std::string packed = per_expert_tensor_name(prefix, e, kMatrixNames[m], kKindSuffixes[kPacked]);
      const std::string scale = per_expert_tensor_name(prefix, e, kMatrixNames[m], kKindSuffixes[kScale]);
      if (t[kPacked].info != nullptr && t[kScale].info == nullptr) {
        fail(ErrorCode::kFormat, where(t[kPacked]), ": missing partner tensor ",
             detail::quote_name(scale), " (weight without its scale)");
      }
      if (t[kScale].info != nullptr && t[kPacked].info == nullptr) {
        fail(ErrorCode::kFormat, where(t[kScale]), ": missing partner tensor ",
             detail::quote_name(packed), " (scale without its weight)");
      }
      MEGAMOE_CHECK(t[kPacked].info != nullptr, ErrorCode::kFormat, ckpt.path(), ": layer ",
                    detail::quote_name(prefix), ": expert ", e, " has no ", kMatrixNames[m],
                    " tensors (", detail::quote_name(packed), " not found)");
    }
  }

  // Dimensions from expert 0's w1: [I, H/2].
  const TensorRef& w1 = g.experts.begin()->second[kW1][kPacked];
  MEGAMOE_CHECK(w1.info->shape.size() == 2, ErrorCode::kFormat, where(w1),
                ": expected a 2-D shape [I, H/2], got ", detail::shape_string(w1.info->shape));
  info.intermediate = w1.info->shape[0];
  info.hidden = w1.info->shape[1] * kE2m1PerByte;
  check_dims(where(w1), info.hidden, info.intermediate);
  const int64_t H = info.hidden, I = info.intermediate;
  const std::vector<int64_t> expected[kNumMatrices][2] = {
      {{I, H / kE2m1PerByte}, {I, H / kScaleBlock}},
      {{I, H / kE2m1PerByte}, {I, H / kScaleBlock}},
      {{H, I / kE2m1PerByte}, {H, I / kScaleBlock}}};

  for (const auto& [e, mats] : g.experts) {
    for (int m = 0; m < kNumMatrices; ++m) {
      expect_tensor(mats[m][kPacked], {StDType::kU8}, expected[m][kPacked],
                    "(E2M1 pairs; from expert 0's w1 [I, H/2])");
      expect_tensor(mats[m][kScale], {StDType::kU8, StDType::kF8E8M0}, expected[m][kScale],
                    "(UE8M0 per 32; from expert 0's w1 [I, H/2])");
      // compressed-tensors may record the unpacked shape: it must be [rows, K].
      const TensorRef& ws = mats[m][kShape];
      if (ws.info == nullptr) continue;
      const std::vector<int64_t> two = {2};
      expect_tensor(ws, {StDType::kI32, StDType::kI64}, two, "(the unpacked [rows, K])");
      int64_t v[2];
      for (int i = 0; i < 2; ++i) {
        if (ws.info->dtype == StDType::kI64) {
          std::memcpy(&v[i], ws.data() + i * sizeof(int64_t), sizeof(int64_t));
        } else {
          int32_t x;
          std::memcpy(&x, ws.data() + i * sizeof(int32_t), sizeof(int32_t));
          v[i] = x;
        }
      }
      const int64_t rows = expected[m][kPacked][0], k = expected[m][kPacked][1] * kE2m1PerByte;
      MEGAMOE_CHECK(v[0] == rows && v[1] == k, ErrorCode::kFormat, where(ws), ": records [",
                    v[0], ", ", v[1], "], expected [", rows, ", ", k, "]");
    }
  }
  return info;
}

// ---------------------------------------------------------------------------------------------
// Fused convention
// ---------------------------------------------------------------------------------------------
// Blocks are [E, N, K/32, 16] or, equivalently (the same bytes), [E, N, K/2].
bool blocks_shape(const TensorRef& t, int64_t* e, int64_t* n, int64_t* k) {
  const auto& s = t.info->shape;
  if (s.size() == 4 && s[3] == kGptOssBlockBytes) {
    *e = s[0]; *n = s[1]; *k = s[2] * kScaleBlock;
    return true;
  }
  if (s.size() == 3) {
    *e = s[0]; *n = s[1]; *k = s[2] * kE2m1PerByte;
    return true;
  }
  return false;
}

MoeLayerInfo validate_fused(const Checkpoint& ckpt, const std::string& prefix, const LayerGroup& g) {
  MoeLayerInfo info;
  info.prefix = prefix;
  info.layer_index = layer_index_of(prefix);
  info.convention = ExpertConvention::kFused;
  const auto& f = g.fused;
  auto partner = [&](int a, int b, const char* what) {
    if (f[a].info != nullptr && f[b].info == nullptr) {
      fail(ErrorCode::kFormat, where(f[a]), ": missing partner tensor ",
           detail::quote_name(fused_tensor_name(prefix, kFusedSuffixes[b])), " (", what, ")");
    }
  };
  partner(kGateUpBlocks, kGateUpScales, "weight without its scale");
  partner(kGateUpScales, kGateUpBlocks, "scale without its weight");
  partner(kDownBlocks, kDownScales, "weight without its scale");
  partner(kDownScales, kDownBlocks, "scale without its weight");
  partner(kGateUpBias, kDownBias, "biases come in pairs");
  partner(kDownBias, kGateUpBias, "biases come in pairs");
  partner(kGateUpBlocks, kDownBlocks, "L1 weights without L2 weights");
  partner(kDownBlocks, kGateUpBlocks, "L2 weights without L1 weights");
  partner(kGateUpBias, kGateUpBlocks, "bias without weights");
  partner(kGateUpScales, kDownScales, "L1 scales without L2 scales");

  const TensorRef& gu = f[kGateUpBlocks];
  int64_t E = 0, N = 0, K = 0;
  MEGAMOE_CHECK(blocks_shape(gu, &E, &N, &K), ErrorCode::kFormat, where(gu),
                ": expected shape [E, 2I, H/32, 16] or [E, 2I, H/2], got ",
                detail::shape_string(gu.info->shape));
  MEGAMOE_CHECK(N % kInterleave == 0, ErrorCode::kFormat, where(gu), ": 2I = ", N,
                " rows must be even (interleaved gate/up pairs)");
  MEGAMOE_CHECK(E > 0, ErrorCode::kFormat, where(gu), ": no experts (E = 0)");
  info.num_experts = E;
  info.intermediate = N / kInterleave;
  info.hidden = K;
  check_dims(where(gu), info.hidden, info.intermediate);
  const int64_t H = info.hidden, I = info.intermediate;
  expect_tensor(gu, {StDType::kU8}, gu.info->shape, "");
  expect_tensor(f[kGateUpScales], {StDType::kU8, StDType::kF8E8M0}, {E, 2 * I, H / kScaleBlock},
                "(UE8M0 per 32, from gate_up_proj_blocks)");
  const TensorRef& dn = f[kDownBlocks];
  int64_t de = 0, dn_rows = 0, dk = 0;
  const bool dn_ok = blocks_shape(dn, &de, &dn_rows, &dk) && de == E && dn_rows == H && dk == I;
  MEGAMOE_CHECK(dn_ok, ErrorCode::kFormat, where(dn), ": expected shape [", E, ", ", H, ", ",
                I / kScaleBlock, ", 16] or [", E, ", ", H, ", ", I / kE2m1PerByte,
                "] (from gate_up_proj_blocks: E = ", E, ", H = ", H, ", I = ", I, "), got ",
                detail::shape_string(dn.info->shape));
  expect_tensor(dn, {StDType::kU8}, dn.info->shape, "");
  expect_tensor(f[kDownScales], {StDType::kU8, StDType::kF8E8M0}, {E, H, I / kScaleBlock},
                "(UE8M0 per 32, from gate_up_proj_blocks)");
  info.has_bias = f[kGateUpBias].info != nullptr;
  if (info.has_bias) {
    expect_tensor(f[kGateUpBias], {StDType::kBF16}, {E, 2 * I}, "(one bias per L1 row)");
    expect_tensor(f[kDownBias], {StDType::kBF16}, {E, H}, "(one bias per L2 row)");
  }
  return info;
}

// Groups every expert tensor by layer prefix.
std::map<std::string, LayerGroup> group_expert_tensors(const Checkpoint& ckpt) {
  std::map<std::string, LayerGroup> groups;
  ckpt.for_each([&](const std::string& name, const TensorRef& ref) {
    const size_t pos = name.rfind(kExpertsInfix);
    if (pos == std::string::npos) return;
    const std::string prefix = name.substr(0, pos);
    const std::string_view rest = std::string_view(name).substr(pos + kExpertsInfix.size());
    for (int k = 0; k < kNumFused; ++k) {
      if (rest == kFusedSuffixes[k]) {
        groups[prefix].fused[k] = ref;
        groups[prefix].any_fused = true;
        return;
      }
    }
    // "{e}.{matrix}.{suffix}"
    const size_t dot1 = rest.find('.');
    if (dot1 == std::string_view::npos) return;
    int64_t e = 0;
    if (!parse_decimal(rest.substr(0, dot1), &e)) return;
    const size_t dot2 = rest.find('.', dot1 + 1);
    if (dot2 == std::string_view::npos) return;
    const std::string_view matrix = rest.substr(dot1 + 1, dot2 - dot1 - 1);
    const std::string_view suffix = rest.substr(dot2 + 1);
    for (int m = 0; m < kNumMatrices; ++m) {
      if (matrix != kMatrixNames[m]) continue;
      for (int k = 0; k < kNumKinds; ++k) {
        if (suffix != kKindSuffixes[k]) continue;
        MEGAMOE_CHECK(e < kMaxExpertIndex, ErrorCode::kFormat, where(ref), ": expert index ", e,
                      " is beyond the supported ", kMaxExpertIndex);
        groups[prefix].experts[e][m][k] = ref;
        return;
      }
    }
  });
  return groups;
}

// Copies rows of `bytes_per_row` bytes: dst row r <- src row (first + r * step).
void copy_rows(uint8_t* dst, const uint8_t* src, int64_t rows, int64_t bytes_per_row,
               int64_t first, int64_t step) {
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst + r * bytes_per_row, src + (first + r * step) * bytes_per_row,
                static_cast<size_t>(bytes_per_row));
  }
}

// The tensor `name` with exactly `bytes` bytes (guards against a stale or forged MoeLayerInfo).
const uint8_t* tensor_bytes(const Checkpoint& ckpt, const std::string& name, int64_t bytes) {
  const TensorRef ref = ckpt.get(name);
  MEGAMOE_CHECK(ref.info->nbytes() == bytes, ErrorCode::kFormat, where(ref), ": ",
                ref.info->nbytes(), " bytes, expected ", bytes, " for the layer's dimensions");
  return ref.data();
}

}  // namespace

const char* expert_convention_name(ExpertConvention convention) {
  return convention == ExpertConvention::kPerExpert ? "kimi-k3" : "gpt-oss";
}

std::string per_expert_tensor_name(std::string_view prefix, int64_t expert,
                                   std::string_view matrix, std::string_view suffix) {
  return detail::concat(prefix, kExpertsInfix, expert, '.', matrix, '.', suffix);
}

std::string fused_tensor_name(std::string_view prefix, std::string_view suffix) {
  return detail::concat(prefix, kExpertsInfix, suffix);
}

std::vector<MoeLayerInfo> find_moe_layers(const Checkpoint& ckpt) {
  std::vector<MoeLayerInfo> layers;
  for (const auto& [prefix, group] : group_expert_tensors(ckpt)) {
    const bool per_expert = !group.experts.empty();
    if (!per_expert && !group.any_fused) continue;
    MEGAMOE_CHECK(!(per_expert && group.any_fused), ErrorCode::kFormat, ckpt.path(), ": layer ",
                  detail::quote_name(prefix),
                  " mixes per-expert (Kimi-K3) and fused (GPT-OSS) expert tensors");
    if (per_expert) {
      layers.push_back(validate_per_expert(ckpt, prefix, group));
    } else {
      // A fused layer needs its gate/up blocks; any other lone tensor is a missing partner.
      const auto& f = group.fused;
      if (f[kGateUpBlocks].info == nullptr) {
        for (int k = 0; k < kNumFused; ++k) {
          if (f[k].info == nullptr) continue;
          fail(ErrorCode::kFormat, where(f[k]), ": missing partner tensor ",
               detail::quote_name(fused_tensor_name(prefix, kFusedSuffixes[kGateUpBlocks])));
        }
      }
      layers.push_back(validate_fused(ckpt, prefix, group));
    }
  }
  std::sort(layers.begin(), layers.end(), [](const MoeLayerInfo& a, const MoeLayerInfo& b) {
    return a.layer_index != b.layer_index ? a.layer_index < b.layer_index : a.prefix < b.prefix;
  });
  return layers;
}

namespace {

// kFormat for the first NaN scale byte of the loaded rank, naming the checkpoint tensor it came
// from, the global expert and its position there.
void reject_nan_scales(const Checkpoint& ckpt, const MoeLayerInfo& layer, const MoeWeights& w) {
  const int64_t H = layer.hidden, I = layer.intermediate;
  const int64_t l1_groups = H / kScaleBlock, l2_groups = I / kScaleBlock;
  const ScaleByteHit l1 = find_scale_byte(w.w13_sf, w.num_local_experts, kUe8m0NaN);
  const ScaleByteHit l2 = l1.found() ? ScaleByteHit{}
                                     : find_scale_byte(w.w2_sf, w.num_local_experts, kUe8m0NaN);
  if (!l1.found() && !l2.found()) return;
  const ScaleByteHit& hit = l1.found() ? l1 : l2;
  const int64_t e = w.first_expert + hit.expert;
  const int64_t groups = l1.found() ? l1_groups : l2_groups;
  int64_t row = hit.offset / groups;  // canonical row of the expert: w13 gate rows first
  const int64_t block = hit.offset % groups;
  std::string name;
  if (layer.convention == ExpertConvention::kPerExpert) {
    const char* m = l2.found() ? kMatrixNames[kW2] : (row < I ? kMatrixNames[kW1] : kMatrixNames[kW3]);
    if (l1.found() && row >= I) row -= I;
    name = per_expert_tensor_name(layer.prefix, e, m, kKindSuffixes[kScale]);
  } else {
    if (l1.found()) row = row < I ? kInterleave * row : kInterleave * (row - I) + 1;
    name = fused_tensor_name(layer.prefix, kFusedSuffixes[l1.found() ? kGateUpScales : kDownScales]);
  }
  fail(ErrorCode::kFormat, where(ckpt.get(name)), ": UE8M0 scale byte 0xFF (NaN) in expert ", e,
       ", row ", row, ", block ", block,
       ": every token routed to this expert would be NaN (LoadOptions::allow_nan_scales accepts it)");
}

MoeWeights load_moe_layer_unchecked(const Checkpoint& ckpt, const MoeLayerInfo& layer, int ep_rank,
                                    int ep_size) {
  const std::string lw = detail::concat(ckpt.path(), ": layer ", detail::quote_name(layer.prefix));
  MEGAMOE_CHECK_ARG(ep_size >= 1, lw, ": EP size must be >= 1, got ", ep_size);
  MEGAMOE_CHECK_ARG(ep_rank >= 0 && ep_rank < ep_size, lw, ": EP rank must be in [0, ", ep_size,
                    "), got ", ep_rank);
  MEGAMOE_CHECK_ARG(layer.num_experts > 0 && layer.num_experts % ep_size == 0, lw, ": E = ",
                    layer.num_experts, " experts is not divisible by EP size ", ep_size);
  check_dims(lw, layer.hidden, layer.intermediate);
  const int64_t H = layer.hidden, I = layer.intermediate;
  const int64_t E_l = layer.num_experts / ep_size;

  MoeWeights w;
  w.num_local_experts = E_l;
  w.first_expert = E_l * ep_rank;
  w.hidden = H;
  w.intermediate = I;
  w.layout = kCanonicalLayout;
  // Per expert, in bytes.
  const int64_t gate_bytes = I * H / kE2m1PerByte, gate_sf = I * H / kScaleBlock;
  const int64_t down_bytes = H * I / kE2m1PerByte, down_sf = H * I / kScaleBlock;
  const int64_t l1_row = H / kE2m1PerByte, l1_sf_row = H / kScaleBlock;
  w.w13 = Buffer(E_l * 2 * gate_bytes);
  w.w13_sf = Buffer(E_l * 2 * gate_sf);
  w.w2 = Buffer(E_l * down_bytes);
  w.w2_sf = Buffer(E_l * down_sf);
  if (layer.has_bias) {
    w.w13_bias = Buffer(E_l * 2 * I * kBf16Bytes);
    w.w2_bias = Buffer(E_l * H * kBf16Bytes);
  }
  auto* w13 = w.w13.as<uint8_t>();
  auto* w13_sf = w.w13_sf.as<uint8_t>();
  auto* w2 = w.w2.as<uint8_t>();
  auto* w2_sf = w.w2_sf.as<uint8_t>();

  if (layer.convention == ExpertConvention::kPerExpert) {
    for (int64_t j = 0; j < E_l; ++j) {
      const int64_t e = w.first_expert + j;
      auto name = [&](const char* m, int k) {
        return per_expert_tensor_name(layer.prefix, e, m, kKindSuffixes[k]);
      };
      uint8_t* l1 = w13 + j * 2 * gate_bytes;
      uint8_t* l1_sf = w13_sf + j * 2 * gate_sf;
      std::memcpy(l1, tensor_bytes(ckpt, name("w1", kPacked), gate_bytes), gate_bytes);
      std::memcpy(l1 + gate_bytes, tensor_bytes(ckpt, name("w3", kPacked), gate_bytes), gate_bytes);
      std::memcpy(l1_sf, tensor_bytes(ckpt, name("w1", kScale), gate_sf), gate_sf);
      std::memcpy(l1_sf + gate_sf, tensor_bytes(ckpt, name("w3", kScale), gate_sf), gate_sf);
      std::memcpy(w2 + j * down_bytes, tensor_bytes(ckpt, name("w2", kPacked), down_bytes), down_bytes);
      std::memcpy(w2_sf + j * down_sf, tensor_bytes(ckpt, name("w2", kScale), down_sf), down_sf);
    }
    return w;
  }

  // Fused: slice [first_expert, first_expert + E_l) of each tensor; only those pages are read.
  const int64_t E = layer.num_experts;
  auto fused = [&](int k, int64_t per_expert_bytes) {
    return tensor_bytes(ckpt, fused_tensor_name(layer.prefix, kFusedSuffixes[k]),
                        E * per_expert_bytes) + w.first_expert * per_expert_bytes;
  };
  const uint8_t* gu = fused(kGateUpBlocks, 2 * gate_bytes);
  const uint8_t* gu_sf = fused(kGateUpScales, 2 * gate_sf);
  for (int64_t j = 0; j < E_l; ++j) {
    // NOTES: interleaved rows: source row 2i is gate row i, 2i + 1 is up row i.
    uint8_t* l1 = w13 + j * 2 * gate_bytes;
    uint8_t* l1_sf = w13_sf + j * 2 * gate_sf;
    copy_rows(l1, gu + j * 2 * gate_bytes, I, l1_row, 0, kInterleave);
    copy_rows(l1 + gate_bytes, gu + j * 2 * gate_bytes, I, l1_row, 1, kInterleave);
    copy_rows(l1_sf, gu_sf + j * 2 * gate_sf, I, l1_sf_row, 0, kInterleave);
    copy_rows(l1_sf + gate_sf, gu_sf + j * 2 * gate_sf, I, l1_sf_row, 1, kInterleave);
  }
  std::memcpy(w2, fused(kDownBlocks, down_bytes), E_l * down_bytes);
  std::memcpy(w2_sf, fused(kDownScales, down_sf), E_l * down_sf);
  if (layer.has_bias) {
    const uint8_t* gb = fused(kGateUpBias, 2 * I * kBf16Bytes);
    auto* b13 = w.w13_bias.as<uint8_t>();
    for (int64_t j = 0; j < E_l; ++j) {
      copy_rows(b13 + j * 2 * I * kBf16Bytes, gb + j * 2 * I * kBf16Bytes, I, kBf16Bytes, 0, kInterleave);
      copy_rows(b13 + (j * 2 + 1) * I * kBf16Bytes, gb + j * 2 * I * kBf16Bytes, I, kBf16Bytes, 1, kInterleave);
    }
    std::memcpy(w.w2_bias.data(), fused(kDownBias, H * kBf16Bytes), E_l * H * kBf16Bytes);
  }
  return w;
}

}  // namespace

MoeWeights load_moe_layer(const Checkpoint& ckpt, const MoeLayerInfo& layer, int ep_rank,
                          int ep_size, const LoadOptions& options) {
  MoeWeights w = load_moe_layer_unchecked(ckpt, layer, ep_rank, ep_size);
  if (!options.allow_nan_scales) reject_nan_scales(ckpt, layer, w);
  return w;
}

void add_moe_layer(SafetensorsWriter& writer, std::string_view prefix, const MoeWeights& w,
                   ExpertConvention convention) {
  MEGAMOE_CHECK_ARG(w.layout == kCanonicalLayout, "add_moe_layer: weights must be canonical, got layout '",
                    w.layout, "'");
  MEGAMOE_CHECK_ARG(w.device().type == DeviceType::kCPU, "add_moe_layer: weights must be on the host");
  const int64_t E = w.num_local_experts, H = w.hidden, I = w.intermediate;
  check_dims("add_moe_layer", H, I);
  const int64_t gate_bytes = I * H / kE2m1PerByte, gate_sf = I * H / kScaleBlock;
  const int64_t down_bytes = H * I / kE2m1PerByte, down_sf = H * I / kScaleBlock;
  MEGAMOE_CHECK_ARG(w.w13.size() == E * 2 * gate_bytes && w.w13_sf.size() == E * 2 * gate_sf &&
                        w.w2.size() == E * down_bytes && w.w2_sf.size() == E * down_sf,
                    "add_moe_layer: buffer sizes do not match E_l = ", E, ", H = ", H, ", I = ", I);
  const auto* w13 = w.w13.as<const uint8_t>();
  const auto* w13_sf = w.w13_sf.as<const uint8_t>();
  const auto* w2 = w.w2.as<const uint8_t>();
  const auto* w2_sf = w.w2_sf.as<const uint8_t>();
  const std::string p(prefix);

  if (convention == ExpertConvention::kPerExpert) {
    MEGAMOE_CHECK_ARG(!w.has_bias(), "add_moe_layer: the Kimi-K3 convention has no expert biases");
    for (int64_t e = 0; e < E; ++e) {
      auto name = [&](const char* m, int k) { return per_expert_tensor_name(p, e, m, kKindSuffixes[k]); };
      const uint8_t* l1 = w13 + e * 2 * gate_bytes;
      const uint8_t* l1_sf = w13_sf + e * 2 * gate_sf;
      writer.add_copy(name("w1", kPacked), StDType::kU8, {I, H / kE2m1PerByte}, l1);
      writer.add_copy(name("w1", kScale), StDType::kU8, {I, H / kScaleBlock}, l1_sf);
      writer.add_copy(name("w3", kPacked), StDType::kU8, {I, H / kE2m1PerByte}, l1 + gate_bytes);
      writer.add_copy(name("w3", kScale), StDType::kU8, {I, H / kScaleBlock}, l1_sf + gate_sf);
      writer.add_copy(name("w2", kPacked), StDType::kU8, {H, I / kE2m1PerByte}, w2 + e * down_bytes);
      writer.add_copy(name("w2", kScale), StDType::kU8, {H, I / kScaleBlock}, w2_sf + e * down_sf);
    }
    return;
  }

  // Fused: interleave gate/up rows (row 2i = gate i, 2i + 1 = up i).
  auto interleave = [&](const uint8_t* src, int64_t row_bytes) {
    std::vector<uint8_t> out(static_cast<size_t>(E * 2 * I * row_bytes));
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t i = 0; i < I; ++i) {
        for (int half = 0; half < kInterleave; ++half) {
          std::memcpy(out.data() + ((e * 2 * I) + kInterleave * i + half) * row_bytes,
                      src + ((e * 2 * I) + half * I + i) * row_bytes, static_cast<size_t>(row_bytes));
        }
      }
    }
    return out;
  };
  const auto gu = interleave(w13, H / kE2m1PerByte);
  const auto gu_sf = interleave(w13_sf, H / kScaleBlock);
  writer.add_copy(fused_tensor_name(p, kFusedSuffixes[kGateUpBlocks]), StDType::kU8,
                  {E, 2 * I, H / kScaleBlock, kGptOssBlockBytes}, gu.data());
  writer.add_copy(fused_tensor_name(p, kFusedSuffixes[kGateUpScales]), StDType::kU8,
                  {E, 2 * I, H / kScaleBlock}, gu_sf.data());
  writer.add_copy(fused_tensor_name(p, kFusedSuffixes[kDownBlocks]), StDType::kU8,
                  {E, H, I / kScaleBlock, kGptOssBlockBytes}, w2);
  writer.add_copy(fused_tensor_name(p, kFusedSuffixes[kDownScales]), StDType::kU8,
                  {E, H, I / kScaleBlock}, w2_sf);
  if (w.has_bias()) {
    const auto gb = interleave(w.w13_bias.as<const uint8_t>(), kBf16Bytes);
    writer.add_copy(fused_tensor_name(p, kFusedSuffixes[kGateUpBias]), StDType::kBF16, {E, 2 * I},
                    gb.data());
    writer.add_copy(fused_tensor_name(p, kFusedSuffixes[kDownBias]), StDType::kBF16, {E, H},
                    w.w2_bias.data());
  }
}

}  // namespace megamoe
