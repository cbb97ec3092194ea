// The preparation driver: applies a WeightLayout to MoeWeights in place, buffer by buffer and
// expert chunk by expert chunk, through one bounded scratch buffer (prepare.hpp explains the
// memory bound; tests/cpp/test_prep_memory.cpp measures it).
#include <algorithm>
#include <limits>
#include <sstream>

#include "megamoe/error.hpp"
#include "megamoe/formats.hpp"
#include "megamoe/prepare.hpp"
#include "runtime/human_bytes.hpp"

namespace megamoe {

namespace {

constexpr int64_t kE2m1PerByte = 2;
constexpr int64_t kBf16Bytes = 2;
// H * I above this cannot be a real layer (Kimi-K3: 1.1e7) and would risk int64 overflow in
// byte counts once multiplied by E_l.
constexpr int64_t kMaxExpertElements = int64_t{1} << 40;
constexpr const char* kInterruptedLayout = "invalid (preparation interrupted)";

enum class Direction { kForward, kInverse };

ExpertDims dims_of(const MoeWeights& w) { return {w.hidden, w.intermediate}; }

void check_dims_basic(const MoeWeights& w) {
  MEGAMOE_CHECK_ARG(w.num_local_experts > 0, "weights.num_local_experts: expected > 0, got ",
                    w.num_local_experts);
  MEGAMOE_CHECK_ARG(w.hidden > 0 && w.hidden % kScaleBlock == 0,
                    "weights.hidden: expected a positive multiple of ", kScaleBlock, ", got ",
                    w.hidden);
  MEGAMOE_CHECK_ARG(w.intermediate > 0 && w.intermediate % kScaleBlock == 0,
                    "weights.intermediate: expected a positive multiple of ", kScaleBlock,
                    ", got ", w.intermediate);
  int64_t elements = 0, total = 0;
  const bool overflow = __builtin_mul_overflow(w.hidden, w.intermediate, &elements) ||
                        elements > kMaxExpertElements ||
                        __builtin_mul_overflow(elements, w.num_local_experts, &total);
  MEGAMOE_CHECK_ARG(!overflow, "weights: E_l = ", w.num_local_experts, ", H = ", w.hidden,
                    ", I = ", w.intermediate, " is too large");
}

struct Step {
  WeightBufferKind kind;
  int64_t src_expert_bytes;
  int64_t dst_expert_bytes;
  HostExpertTransform host;
  DeviceExpertTransform device;
};

// Steps of one layout application (non-identity buffers that the weights have).
std::vector<Step> plan(const MoeWeights& w, const WeightLayout& layout, Direction dir) {
  const ExpertDims dims = dims_of(w);
  const bool on_device = w.device().type != DeviceType::kCPU;
  std::vector<Step> steps;
  for (int b = 0; b < kNumWeightBuffers; ++b) {
    const auto kind = static_cast<WeightBufferKind>(b);
    const BufferTransform& t = layout.buffer(kind);
    if (t.is_identity() || weight_buffer(w, kind).empty()) continue;
    const int64_t canonical = canonical_expert_bytes(kind, dims);
    const int64_t prepared = layout.expert_bytes(kind, dims);
    Step s{kind, dir == Direction::kForward ? canonical : prepared,
           dir == Direction::kForward ? prepared : canonical,
           dir == Direction::kForward ? t.forward : t.inverse,
           dir == Direction::kForward ? t.forward_device : t.inverse_device};
    MEGAMOE_CHECK(on_device ? s.device != nullptr : s.host != nullptr, ErrorCode::kUnsupported,
                  "prepare: layout '", layout.name, "' has no ", on_device ? "device" : "host",
                  " transform for ", weight_buffer_name(kind), " (weights on ",
                  device_name(w.device()), ")");
    steps.push_back(s);
  }
  return steps;
}

int64_t plan_bytes(const MoeWeights& w, const std::vector<Step>& steps) {
  int64_t total = 0;
  for (const Step& s : steps) total += s.src_expert_bytes * w.num_local_experts;
  return total;
}

struct Progress {
  const PrepareOptions& options;
  int64_t done = 0;
  int64_t total = 0;
  void advance(int64_t bytes) {
    done += bytes;
    if (options.progress) options.progress(done, total);
  }
};

void run_transform(const Step& s, const uint8_t* src, uint8_t* dst, int64_t n,
                   const ExpertDims& dims, bool on_device, void* stream) {
  if (on_device) s.device(src, dst, n, dims, stream);
  else s.host(src, dst, n, dims);
}

// Applies the steps to `w` in place. Returns the peak extra bytes held.
void apply(MoeWeights& w, const std::vector<Step>& steps, const PrepareOptions& options,
           Progress& progress, PrepareReport& report) {
  const ExpertDims dims = dims_of(w);
  const Device device = w.device();
  const bool on_device = device.type != DeviceType::kCPU;
  const int64_t num_experts = w.num_local_experts;

  // Phase 1: buffers that grow. A new buffer of the prepared size is filled straight from the
  // old one, then the old one is released: extra memory = that buffer (no scratch is held yet).
  for (const Step& s : steps) {
    if (s.dst_expert_bytes <= s.src_expert_bytes) continue;
    Buffer& buf = weight_buffer(w, s.kind);
    Buffer grown(num_experts * s.dst_expert_bytes, device);
    report.peak_extra_bytes = std::max(report.peak_extra_bytes, grown.size());
    run_transform(s, buf.as<const uint8_t>(), grown.as<uint8_t>(), num_experts, dims, on_device,
                  options.stream);
    buf = std::move(grown);  // releases the old buffer
    progress.advance(num_experts * s.src_expert_bytes);
  }

  // Phase 2: buffers transformed in place through one scratch of `chunk` experts.
  int64_t max_src = 0;
  for (const Step& s : steps) {
    if (s.dst_expert_bytes <= s.src_expert_bytes) max_src = std::max(max_src, s.src_expert_bytes);
  }
  if (max_src == 0) return;
  const int64_t chunk = std::clamp<int64_t>(options.scratch_bytes / max_src, 1, num_experts);
  Buffer scratch(chunk * max_src, device);
  report.scratch_bytes = scratch.size();
  report.peak_extra_bytes = std::max(report.peak_extra_bytes, scratch.size());
  for (const Step& s : steps) {
    if (s.dst_expert_bytes > s.src_expert_bytes) continue;
    Buffer& buf = weight_buffer(w, s.kind);
    auto* base = buf.as<uint8_t>();
    // NOTES: front to back is safe in place: the destination of experts [e0, e0 + n) ends at
    // (e0 + n) * dst <= (e0 + n) * src, the start of the first source expert not yet copied out.
    for (int64_t e0 = 0; e0 < num_experts; e0 += chunk) {
      const int64_t n = std::min(chunk, num_experts - e0);
      copy_bytes(scratch.data(), device, base + e0 * s.src_expert_bytes, device,
                 n * s.src_expert_bytes);
      run_transform(s, scratch.as<const uint8_t>(), base + e0 * s.dst_expert_bytes, n, dims,
                    on_device, options.stream);
      progress.advance(n * s.src_expert_bytes);
    }
    if (s.dst_expert_bytes < s.src_expert_bytes) buf.shrink(num_experts * s.dst_expert_bytes);
  }
}

PrepareReport prepare_to_layout(MoeWeights& w, const std::string& target,
                                const PrepareOptions& options) {
  check_weights_layout(w);
  const WeightLayout& to = find_layout(target);
  PrepareReport report;
  report.from_layout = w.layout;
  report.to_layout = target;
  if (w.layout == target) {
    report.no_op = true;
    return report;
  }
  // Every check runs before the first byte moves.
  const ExpertDims dims = dims_of(w);
  if (to.check_dims != nullptr) to.check_dims(dims);
  const WeightLayout& from = find_layout(w.layout);
  const std::vector<Step> undo = plan(w, from, Direction::kInverse);
  const std::vector<Step> redo = plan(w, to, Direction::kForward);
  Progress progress{options, 0, plan_bytes(w, undo) + plan_bytes(w, redo)};
  report.bytes_transformed = progress.total;
  report.converted = from.name != kCanonicalLayout && to.name != kCanonicalLayout;
  try {
    apply(w, undo, options, progress, report);
    w.layout = kCanonicalLayout;
    apply(w, redo, options, progress, report);
    w.layout = target;
  } catch (...) {
    // NOTES: transforms do not fail by contract; this covers allocation and device failures.
    w.layout = kInterruptedLayout;
    throw;
  }
  return report;
}

}  // namespace

Buffer& weight_buffer(MoeWeights& w, WeightBufferKind kind) {
  switch (kind) {
    case WeightBufferKind::kW13: return w.w13;
    case WeightBufferKind::kW13Sf: return w.w13_sf;
    case WeightBufferKind::kW2: return w.w2;
    case WeightBufferKind::kW2Sf: return w.w2_sf;
    case WeightBufferKind::kW13Bias: return w.w13_bias;
    case WeightBufferKind::kW2Bias: return w.w2_bias;
  }
  fail(ErrorCode::kInternal, "weight_buffer: bad kind ", static_cast<int>(kind));
}

const Buffer& weight_buffer(const MoeWeights& w, WeightBufferKind kind) {
  return weight_buffer(const_cast<MoeWeights&>(w), kind);
}

int64_t canonical_expert_bytes(WeightBufferKind kind, const ExpertDims& d) {
  const int64_t H = d.hidden, I = d.intermediate;
  switch (kind) {
    case WeightBufferKind::kW13: return 2 * I * H / kE2m1PerByte;
    case WeightBufferKind::kW13Sf: return 2 * I * H / kScaleBlock;
    case WeightBufferKind::kW2: return H * I / kE2m1PerByte;
    case WeightBufferKind::kW2Sf: return H * I / kScaleBlock;
    case WeightBufferKind::kW13Bias: return 2 * I * kBf16Bytes;
    case WeightBufferKind::kW2Bias: return H * kBf16Bytes;
  }
  fail(ErrorCode::kInternal, "canonical_expert_bytes: bad kind ", static_cast<int>(kind));
}

void check_weights_layout(const MoeWeights& w) {
  check_dims_basic(w);
  const WeightLayout& layout = find_layout(w.layout);
  const ExpertDims dims = dims_of(w);
  // Weights claiming a layout must have dims that layout can hold: its inverse relies on it.
  if (layout.check_dims != nullptr) layout.check_dims(dims);
  MEGAMOE_CHECK_ARG(w.w13_bias.empty() == w.w2_bias.empty(),
                    "weights: w13_bias and w2_bias must both be present or both be empty (got ",
                    w.w13_bias.size(), " and ", w.w2_bias.size(), " bytes)");
  for (int b = 0; b < kNumWeightBuffers; ++b) {
    const auto kind = static_cast<WeightBufferKind>(b);
    const Buffer& buf = weight_buffer(w, kind);
    const bool is_bias = kind == WeightBufferKind::kW13Bias || kind == WeightBufferKind::kW2Bias;
    if (is_bias && !w.has_bias()) continue;
    const int64_t expected = w.num_local_experts * layout.expert_bytes(kind, dims);
    MEGAMOE_CHECK_ARG(buf.size() == expected, "weights.", weight_buffer_name(kind), ": expected ",
                      expected, " bytes for layout '", w.layout, "' (E_l = ", w.num_local_experts,
                      ", H = ", w.hidden, ", I = ", w.intermediate, "), got ", buf.size());
    MEGAMOE_CHECK_ARG(buf.device() == w.device(), "weights.", weight_buffer_name(kind),
                      ": on ", device_name(buf.device()), ", expected ", device_name(w.device()),
                      " like w13");
  }
}

PrepareReport prepare(MoeWeights& weights, std::string_view backend, const PrepareOptions& options) {
  return prepare_to_layout(weights, layout_for_backend(backend), options);
}

PrepareReport unprepare(MoeWeights& weights, const PrepareOptions& options) {
  return prepare_to_layout(weights, kCanonicalLayout, options);
}

PrepareReport prepare_for_fused(MoeWeights& weights, int sm_version, const PrepareOptions& options) {
  return prepare_to_layout(weights, fused_layout_for_arch(sm_version), options);
}

std::string PrepareReport::summary() const {
  std::ostringstream os;
  if (no_op) {
    os << "weights already in layout '" << to_layout << "': nothing done";
    return os.str();
  }
  os << "prepared '" << from_layout << "' -> '" << to_layout << "'"
     << (converted ? " (through canonical)" : "") << ": " << human_bytes(bytes_transformed)
     << " transformed, scratch " << human_bytes(scratch_bytes) << ", peak extra memory "
     << human_bytes(peak_extra_bytes);
  return os.str();
}

}  // namespace megamoe
