// Checkpoint inspection: layers, shapes, dtypes and UE8M0 scale-exponent statistics.
//
// The statistic that matters for a folded FP8 mode is the spread of scale exponents inside each
// row (max - min over the row's K/32 blocks): a per-row fold into E4M3 relative to the row's
// largest exponent is exact when the spread is <= kMaxExactFoldSpread (docs/layouts.md).
#include <algorithm>
#include <cstring>
#include <iomanip>
#include <sstream>

#include "checkpoint/safetensors_detail.hpp"
#include "megamoe/error.hpp"
#include "megamoe/formats.hpp"
#include "runtime/human_bytes.hpp"

namespace megamoe {

// ---------------------------------------------------------------------------------------------
// ScaleStats
// ---------------------------------------------------------------------------------------------
void ScaleStats::add_rows(const uint8_t* sf, int64_t num_rows, int64_t groups_per_row) {
  for (int64_t r = 0; r < num_rows; ++r) {
    const uint8_t* row = sf + r * groups_per_row;
    int lo = kNumUe8m0Codes, hi = -1;
    for (int64_t g = 0; g < groups_per_row; ++g) {
      const int b = row[g];
      if (b == kUe8m0NaN) {
        ++nan_values;
        continue;
      }
      lo = std::min(lo, b);
      hi = std::max(hi, b);
    }
    values += groups_per_row;
    ++rows;
    if (hi >= 0) {
      min = std::min(min, lo);
      max = std::max(max, hi);
      ++spread_rows[hi - lo];
    } else {
      ++spread_rows[0];  // an all-NaN (or empty) row has no spread
    }
  }
}

void ScaleStats::merge(const ScaleStats& o) {
  rows += o.rows;
  values += o.values;
  nan_values += o.nan_values;
  min = std::min(min, o.min);
  max = std::max(max, o.max);
  for (int i = 0; i < kNumUe8m0Codes; ++i) spread_rows[i] += o.spread_rows[i];
}

int ScaleStats::max_spread() const {
  for (int i = kNumUe8m0Codes - 1; i >= 0; --i)
    if (spread_rows[i] > 0) return i;
  return 0;
}

int ScaleStats::spread_percentile(double fraction) const {
  if (rows == 0) return 0;
  const double needed = fraction * static_cast<double>(rows);
  int64_t seen = 0;
  for (int i = 0; i < kNumUe8m0Codes; ++i) {
    seen += spread_rows[i];
    if (static_cast<double>(seen) >= needed) return i;
  }
  return kNumUe8m0Codes - 1;
}

double ScaleStats::fraction_rows_within(int spread) const {
  if (rows == 0) return 1.0;
  int64_t n = 0;
  for (int i = 0; i <= spread && i < kNumUe8m0Codes; ++i) n += spread_rows[i];
  return static_cast<double>(n) / static_cast<double>(rows);
}

// ---------------------------------------------------------------------------------------------
// inspect_checkpoint
// ---------------------------------------------------------------------------------------------
namespace {

constexpr int64_t kE2m1PerByte = 2;
constexpr int64_t kBf16Bytes = 2;

ExpertScaleSummary summarize(const ScaleStats& s) {
  return {s.min, s.max, s.max_spread()};
}

// Adds expert e's statistics to the matrix, noting the first expert with a serial-path or NaN
// scale byte (a NaN byte is >= 128 too).
void add_expert(InspectMatrix& m, int64_t e, const ScaleStats& expert) {
  m.per_expert.push_back(summarize(expert));
  m.stats.merge(expert);
  if (!m.first_serial.found() && (expert.max >= kSm90SerialScaleByte || expert.nan_values > 0))
    m.first_serial = {e, -1, expert.nan_values > 0 ? kUe8m0NaN : expert.max};
  if (!m.first_nan.found() && expert.nan_values > 0) m.first_nan = {e, -1, kUe8m0NaN};
}

InspectLayer inspect_layer(const Checkpoint& ckpt, const MoeLayerInfo& info, bool with_stats) {
  InspectLayer out;
  out.info = info;
  const int64_t E = info.num_experts, H = info.hidden, I = info.intermediate;
  const int64_t gate_sf = I * H / kScaleBlock, down_sf = H * I / kScaleBlock;
  out.expert_bytes = 2 * I * H / kE2m1PerByte + 2 * gate_sf + H * I / kE2m1PerByte + down_sf +
                     (info.has_bias ? (2 * I + H) * kBf16Bytes : 0);
  if (info.convention == ExpertConvention::kPerExpert) {
    const char* roles[3] = {"gate (w1)", "up (w3)", "down (w2)"};
    const char* mats[3] = {"w1", "w3", "w2"};
    const int64_t groups[3] = {H / kScaleBlock, H / kScaleBlock, I / kScaleBlock};
    const int64_t rows[3] = {I, I, H};
    for (int m = 0; m < 3; ++m) {
      InspectMatrix im;
      im.role = roles[m];
      const auto w0 = ckpt.get(per_expert_tensor_name(info.prefix, 0, mats[m], "weight_packed"));
      const auto s0 = ckpt.get(per_expert_tensor_name(info.prefix, 0, mats[m], "weight_scale"));
      im.weight_desc = detail::concat(w0.info->describe(), " x ", E, " experts");
      im.scale_desc = detail::concat(s0.info->describe(), " x ", E, " experts");
      if (with_stats) {
        for (int64_t e = 0; e < E; ++e) {
          const auto s = ckpt.get(per_expert_tensor_name(info.prefix, e, mats[m], "weight_scale"));
          MEGAMOE_CHECK(s.info->nbytes() == rows[m] * groups[m], ErrorCode::kFormat,
                        s.file->path(), ": tensor ", detail::quote_name(s.info->name),
                        ": unexpected size ", s.info->nbytes());
          ScaleStats expert;
          expert.add_rows(s.data(), rows[m], groups[m]);
          add_expert(im, e, expert);
        }
      }
      out.matrices.push_back(std::move(im));
    }
    return out;
  }
  // Fused: gate rows are the even rows of gate_up, up rows the odd ones.
  const auto gu = ckpt.get(fused_tensor_name(info.prefix, "gate_up_proj_blocks"));
  const auto gu_sf = ckpt.get(fused_tensor_name(info.prefix, "gate_up_proj_scales"));
  const auto dn = ckpt.get(fused_tensor_name(info.prefix, "down_proj_blocks"));
  const auto dn_sf = ckpt.get(fused_tensor_name(info.prefix, "down_proj_scales"));
  MEGAMOE_CHECK(gu_sf.info->nbytes() == E * 2 * gate_sf && dn_sf.info->nbytes() == E * down_sf,
                ErrorCode::kFormat, ckpt.path(), ": layer ", detail::quote_name(info.prefix),
                ": scale tensors do not match E, H, I");
  InspectMatrix gate, up, down;
  gate.role = "gate (even rows of gate_up_proj)";
  up.role = "up (odd rows of gate_up_proj)";
  down.role = "down (down_proj)";
  gate.weight_desc = up.weight_desc = gu.info->describe();
  gate.scale_desc = up.scale_desc = gu_sf.info->describe();
  down.weight_desc = dn.info->describe();
  down.scale_desc = dn_sf.info->describe();
  if (with_stats) {
    const int64_t g1 = H / kScaleBlock, g2 = I / kScaleBlock;
    for (int64_t e = 0; e < E; ++e) {
      ScaleStats eg, eu, ed;
      const uint8_t* p = gu_sf.data() + e * 2 * gate_sf;
      for (int64_t row = 0; row < 2 * I; ++row) (row % 2 == 0 ? eg : eu).add_rows(p + row * g1, 1, g1);
      ed.add_rows(dn_sf.data() + e * down_sf, H, g2);
      add_expert(gate, e, eg);
      add_expert(up, e, eu);
      add_expert(down, e, ed);
    }
  }
  out.matrices = {std::move(gate), std::move(up), std::move(down)};
  return out;
}

}  // namespace

std::string sm90_path_text(const InspectMatrix& m) {
  if (!m.first_serial.found())
    return detail::concat("fast path (every scale byte < ", kSm90SerialScaleByte, ")");
  return detail::concat("serial path: scale byte ", m.first_serial.byte, " >= ",
                        kSm90SerialScaleByte, " in expert ", m.first_serial.expert);
}

std::vector<InspectLayer> inspect_checkpoint(const Checkpoint& ckpt, const InspectOptions& options) {
  const std::vector<MoeLayerInfo> infos = find_moe_layers(ckpt);
  std::vector<InspectLayer> layers;
  layers.reserve(infos.size());
  for (size_t i = 0; i < infos.size(); ++i) {
    layers.push_back(inspect_layer(ckpt, infos[i], options.scale_stats));
    if (options.progress) options.progress(static_cast<int64_t>(i + 1), static_cast<int64_t>(infos.size()));
  }
  return layers;
}

std::string format_inspect_report(const Checkpoint& ckpt, const std::vector<InspectLayer>& layers,
                                  bool per_expert) {
  std::ostringstream os;
  os << "checkpoint " << ckpt.path() << ": " << ckpt.files().size() << " file(s), "
     << ckpt.num_tensors() << " tensors, " << human_bytes(ckpt.total_bytes()) << "\n";
  os << "MoE layers: " << layers.size() << "\n";
  bool any_stats = false, all_foldable = true;
  int worst_spread = 0;
  for (const InspectLayer& l : layers) {
    const MoeLayerInfo& info = l.info;
    os << "\nlayer " << (info.layer_index >= 0 ? std::to_string(info.layer_index) : "?") << "  "
       << info.prefix << "\n  convention " << expert_convention_name(info.convention)
       << ", E = " << info.num_experts << ", H = " << info.hidden << ", I = " << info.intermediate
       << ", bias " << (info.has_bias ? "yes" : "no") << ", " << human_bytes(l.expert_bytes)
       << " per expert (canonical), " << human_bytes(l.expert_bytes * info.num_experts)
       << " per layer\n";
    for (const InspectMatrix& m : l.matrices) {
      os << "  " << std::left << std::setw(34) << m.role << std::right << " weight " << m.weight_desc
         << ", scale " << m.scale_desc << "\n";
      const ScaleStats& s = m.stats;
      if (s.rows == 0) continue;
      any_stats = true;
      const int spread = s.max_spread();
      worst_spread = std::max(worst_spread, spread);
      all_foldable &= s.fold_exact();
      os << "    scale exponent (UE8M0 byte - 127): min " << (s.min <= s.max ? s.min - kUe8m0Bias : 0)
         << ", max " << (s.min <= s.max ? s.max - kUe8m0Bias : 0);
      if (s.nan_values > 0)
        os << ", NaN bytes " << s.nan_values << " (first in expert " << m.first_nan.expert
           << ": loading rejects them)";
      os << "\n    sm90 GEMM: " << sm90_path_text(m);
      os << "\n    row spread (max - min inside a row) over " << s.rows << " rows: p50 "
         << s.spread_percentile(0.5) << ", p90 " << s.spread_percentile(0.9) << ", p99 "
         << s.spread_percentile(0.99) << ", max " << spread << "; rows with spread <= "
         << kMaxExactFoldSpread << ": " << std::fixed << std::setprecision(4)
         << 100.0 * s.fraction_rows_within(kMaxExactFoldSpread) << "%\n";
      os << "    histogram:";
      for (int i = 0; i <= spread; ++i) {
        if (s.spread_rows[i] > 0) os << " " << i << ":" << s.spread_rows[i];
      }
      os << "\n";
      if (!per_expert) continue;
      for (size_t e = 0; e < m.per_expert.size(); ++e) {
        const ExpertScaleSummary& x = m.per_expert[e];
        os << "      expert " << e << ": exponent min "
           << (x.min <= x.max ? x.min - kUe8m0Bias : 0) << ", max "
           << (x.min <= x.max ? x.max - kUe8m0Bias : 0) << ", largest row spread "
           << x.max_row_spread << (x.max_row_spread > kMaxExactFoldSpread ? "  (fold not exact)" : "")
           << "\n";
      }
    }
  }
  if (any_stats) {
    os << "\nfolded FP8 (per-row E4M3 fold of MXFP4 weights): "
       << (all_foldable ? "EXACT" : "NOT exact") << " for this checkpoint (largest row spread "
       << worst_spread << ", exact when <= " << kMaxExactFoldSpread << ")\n";
  }
  return os.str();
}

}  // namespace megamoe
