// sm90_layer.cu: the Hopper layer (see sm90_layer.hpp): construction (weights to the device and
// into the sm90 layout, one workspace for the capacity) and the six-stage forward pass.
#include "moe/sm90_layer.hpp"

#include <algorithm>

#include "ep/ep_group.hpp"
#include "ep/ep_launch.hpp"
#include "megamoe/error.hpp"
#include "moe/sm90_gemm.hpp"
#include "moe/sm90_stages.hpp"
#include "sm90/sm90_combine_chunk.cuh"
#include "megamoe/prepare.hpp"
#include "moe/backend.hpp"
#include "runtime/cuda_check.hpp"
#include "runtime/cuda_device.hpp"

namespace megamoe::sm90 {

namespace {

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  MEGAMOE_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

// Every workspace region starts on a 256-byte boundary (TMA needs 16, wide loads 16; 256 keeps
// regions on separate cache-line groups).
constexpr int64_t kWorkspaceAlign = 256;

int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// Carves named regions out of one allocation: first pass sizes, second pass hands out pointers.
class Carver {
 public:
  explicit Carver(uint8_t* base) : base_(base) {}
  template <typename T>
  T* take(int64_t count) {
    T* p = base_ ? reinterpret_cast<T*>(base_ + offset_) : nullptr;
    offset_ = align_up(offset_ + count * static_cast<int64_t>(sizeof(T)), kWorkspaceAlign);
    return p;
  }
  int64_t bytes() const { return offset_; }

 private:
  uint8_t* base_;
  int64_t offset_ = 0;
};

WorkspaceView carve(uint8_t* base, const LayerConfig& c, int64_t max_rows, bool ep,
                    int64_t* bytes) {
  const int64_t h = c.shape.hidden, inter = c.shape.intermediate, k = c.shape.top_k;
  const int64_t t_max = c.max_tokens_per_rank;
  const int64_t rows = max_rows + kRowSlack;
  Carver carver(base);
  WorkspaceView v;
  v.x_q = carver.take<uint8_t>(t_max * h);
  v.x_sf = carver.take<uint8_t>(t_max * h / kScaleBlock);
  v.slot_to_row = carver.take<int32_t>(t_max * k);
  v.row_offsets = carver.take<int32_t>(c.num_local_experts() + 1);
  v.row_slot = carver.take<int32_t>(rows);
  v.row_weights = carver.take<float>(rows);
  // NOTES: act (L1's input) is dead once L1 has run, and out (L2's output) has the same shape,
  // so they share storage: at Kimi-K3 capacity that saves ~0.9 GB of workspace.
  v.act = carver.take<uint16_t>(rows * h);
  v.out = v.act;
  v.h_q = carver.take<uint8_t>(rows * inter);
  v.h_sf = carver.take<uint8_t>(rows * inter / kScaleBlock);
  v.h_act = carver.take<uint16_t>(rows * inter);
  if (ep) v.row_dst = carver.take<uint16_t*>(rows);
  if (c.precision == Precision::kFp8) {
    const int64_t e_l = c.num_local_experts();
    v.act_fp8 = carver.take<uint8_t>(rows * h);
    v.act_factor = carver.take<float>(rows);
    v.h_fp8 = carver.take<uint8_t>(rows * inter);
    v.h_factor = carver.take<float>(rows);
    v.w13_row_exp = carver.take<uint8_t>(e_l * 2 * inter);
    v.w2_row_exp = carver.take<uint8_t>(e_l * h);
  }
  v.error = carver.take<DispatchError>(1);
  // Split-K partials and counters (decode launches with few tiles; the memset below zeroes the
  // counters once, every launch leaves them zero).
  v.split_k.partial_floats = split_k_partial_floats();
  v.split_k.partials = carver.take<float>(v.split_k.partial_floats);
  v.split_k.counters_capacity = split_k_counters();
  v.split_k.counters = carver.take<int32_t>(v.split_k.counters_capacity);
  v.split_k.unit_counter = carver.take<int32_t>(2);  // decode launches take units at run time
  if (c.sm90.mega_kernel) {  // the fused kernel's slot counters and split-K parts
    v.mega.capacity = mega_counters(rows, static_cast<int>(c.num_local_experts()));
    v.mega.ready = carver.take<int32_t>(v.mega.capacity);
    v.mega.consumed = carver.take<int32_t>(v.mega.capacity);
    const int sms = cuda::device_info().sm_count;
    v.mega.split_partial_floats = mega_split_partial_floats(sms);
    v.mega.split_partials = carver.take<float>(v.mega.split_partial_floats);
    v.mega.split_counters_capacity = mega_split_counters(sms);
    v.mega.split_counters = carver.take<int32_t>(v.mega.split_counters_capacity);
    v.mega.combine_counters = carver.take<uint32_t>(2);
  }
  *bytes = carver.bytes();
  return v;
}

// The tile policy's estimates of the rows routed to this rank (L1Args::rows_hint,
// rows_per_expert_max), by config.sm90.rows_hint: T*K slots on one GPU; under expert parallelism
// the rank's expected share T*K*E_l/E (balanced routing, rounded up). Any expert can get up to T
// rows (one slot per token): where that calls for another tile than the estimate, the GEMMs
// launch one per tile, each gated on the actual rows (only one runs).
// NOTES: T*K under expert parallelism made the policy take prefill tiles for decode-sized work,
// and the share without the gate made adversarial routing up to 3x slower (docs/tuning-log.md);
// `bound` and `expected` keep those two for measuring them.
struct RowsHint {
  int64_t hint, per_expert_max;
};
RowsHint rows_hint(const LayerConfig& c, int64_t num_tokens, int64_t slots) {
  if (c.sm90.rows_hint == RowsHintMode::kBound) return {slots, 0};
  const int64_t e = c.shape.num_experts, e_l = c.num_local_experts();
  const int64_t share = c.ep_size <= 1 ? slots : std::max<int64_t>(1, (slots * e_l + e - 1) / e);
  return {share, c.sm90.rows_hint == RowsHintMode::kExpected ? 0 : num_tokens};
}

// The same under expert parallelism with a group: every rank sends about T*K*E_l/E slots here,
// T*K in all when the ranks have similar T (this rank's T stands for theirs); any local expert
// may get up to one row per token of every rank. `bound`: every rank's T*K slots.
RowsHint ep_rows_hint(const LayerConfig& c, int64_t num_tokens, int ranks, int64_t max_rows) {
  const int64_t t = std::max<int64_t>(num_tokens, 1);
  if (c.sm90.rows_hint == RowsHintMode::kBound) return {std::min(max_rows, ranks * t * c.shape.top_k), 0};
  const int64_t per_expert_max = c.sm90.rows_hint == RowsHintMode::kGated ? std::min(max_rows, ranks * t) : 0;
  return {t * c.shape.top_k, per_expert_max};
}

// The combine inside the MegaMoE kernel (MegaCombine) for calls of at most this many items
// (T * H / 8, each K loads; mega_combine_inside): by up to 64 CTAs (kMegaCombineCtas) alone on a
// GPU, two items per math thread of a decode tile; by the last CTA alone with several ranks on
// one GPU, eight. Larger calls run the combine launch (over the whole GPU; the launch gap is
// small beside their sum).
constexpr int64_t kCombineInsideMaxItems = 16384;
constexpr int64_t kLastCtaCombineMaxItems = 1024;

}  // namespace

bool mega_combine_inside(const LayerConfig& c, int64_t tokens, bool one_cta) {
  const int64_t items = tokens * c.shape.hidden / kCombineVec;
  return c.sm90.mega_combine && items <= (one_cta ? kLastCtaCombineMaxItems : kCombineInsideMaxItems);
}

const char* stage_name(Stage stage) {
  switch (stage) {
    case Stage::kQuantize: return "quantize";
    case Stage::kDispatch: return "dispatch";
    case Stage::kGather: return "gather";
    case Stage::kL1: return "l1";
    case Stage::kL2: return "l2";
    case Stage::kCombine: return "combine";
  }
  return "?";
}

MoeWeights Sm90Layer::prepare_device_weights(const LayerConfig& config, MoeWeights weights) {
  config.validate();
  MEGAMOE_CHECK(sm90_available(cuda::current_device()), ErrorCode::kUnsupported,
                "sm90 backend: needs a compute capability 9.0 GPU (H100/H200); ",
                cuda_available() ? "the current device is " + cuda::device_info().name
                                 : std::string("no CUDA device is available"));
  weights.check_matches(config);
  const Device here = Device::cuda(cuda::current_device());
  if (weights.layout == kSm90LayoutName) {
    MEGAMOE_CHECK_ARG(weights.device() == here, "sm90 backend: prepared weights must be on ",
                      device_name(here), ", got ", device_name(weights.device()));
    check_weights_layout(weights);
    return weights;
  }
  // NOTES: the layout transform runs on the GPU when the sm90 layout has a device
  // implementation (upload first, then prepare in place with a bounded scratch); otherwise it
  // runs on the host before the upload. Either way no second copy of the layer survives: each
  // host buffer is released as soon as its device copy exists.
  const WeightLayout& layout = find_layout(kSm90LayoutName);
  const bool device_prep = layout.buffer(WeightBufferKind::kW13).forward_device != nullptr ||
                           layout.buffer(WeightBufferKind::kW13).is_identity();
  if (weights.device() != here && !device_prep) prepare(weights, kSm90LayoutName);
  if (weights.device() != here) {
    for (int b = 0; b < kNumWeightBuffers; ++b) {
      Buffer& buf = weight_buffer(weights, static_cast<WeightBufferKind>(b));
      if (buf.empty()) continue;
      Buffer moved = buf.to(here);
      buf = std::move(moved);
    }
  }
  if (weights.layout != kSm90LayoutName) {
    PrepareOptions options;
    options.stream = nullptr;
    prepare(weights, kSm90LayoutName, options);
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  }
  return weights;
}

Sm90Layer::Sm90Layer(const LayerConfig& config, MoeWeights weights) : config_(config) {
  owned_weights_ = prepare_device_weights(config, std::move(weights));
  weights_ = &owned_weights_;
  init_workspace();
}

Sm90Layer::Sm90Layer(const LayerConfig& config, const MoeWeights* prepared)
    : Sm90Layer(config, prepared, nullptr) {}

Sm90Layer::Sm90Layer(const LayerConfig& config, const MoeWeights* prepared,
                     std::shared_ptr<EpGroup> ep)
    : config_(config), ep_(std::move(ep)) {
  MEGAMOE_CHECK_ARG(prepared != nullptr && prepared->layout == kSm90LayoutName,
                    "Sm90Layer: expected weights in the '", kSm90LayoutName, "' layout");
  weights_ = prepared;
  init_workspace();
}

void Sm90Layer::init_workspace() {
  config_.validate();
  if (config_.precision == Precision::kFp8) {
    MEGAMOE_CHECK(config_.shape.hidden % 128 == 0 && config_.shape.intermediate % 128 == 0,
                  ErrorCode::kUnsupported, "Sm90Layer: precision fp8 needs H and I multiples of 128 "
                  "(the FP8 tiles' two k-blocks per stage), got H ", config_.shape.hidden, " I ",
                  config_.shape.intermediate);
  }
  tile_ = parse_tile_request(config_.sm90.gemm_tile);
  fp8_tile_ = TileRequest::automatic();
  if (tile_.mode == TileRequest::Mode::kForced && tile_config(tile_.tile).fp8()) {
    fp8_tile_ = tile_;  // forced on the FP8 mode's calls; the exact mode's take the policy
    tile_ = TileRequest::automatic();
  }
  programmatic_ = config_.sm90.programmatic_launch;
  device_ = cuda::current_device();
  weights_->check_matches(config_);
  MEGAMOE_CHECK_ARG(weights_->device() == Device::cuda(device_),
                    "sm90 backend: weights must be on the current device ",
                    device_name(Device::cuda(device_)), ", got ", device_name(weights_->device()));
  MEGAMOE_CHECK_ARG(config_.shape.top_k <= config_.shape.num_experts,
                    "sm90 backend: expected top_k <= num_experts, got top_k ",
                    config_.shape.top_k, " and ", config_.shape.num_experts, " experts");
  const int64_t slots = config_.max_tokens_per_rank * config_.shape.top_k;
  MEGAMOE_CHECK_ARG(slots <= INT32_MAX, "sm90 backend: max_tokens_per_rank * top_k = ", slots,
                    " exceeds the int32 row index range");
  // Throws when the histograms cannot fit; raises the kernel's shared-memory limit now so that
  // forward() makes no attribute call (graph capture).
  const int dispatch_warps = dispatch_num_warps(config_.num_local_experts());
  configure_dispatch_smem(static_cast<size_t>(dispatch_warps) * config_.num_local_experts() *
                          sizeof(int32_t));

  // ---- workspace, once, for the capacity ----
  const Device here = Device::cuda(device_);
  max_rows_ = slots;
  if (ep_ != nullptr) {
    ep_->impl().check_layer(config_);
    MEGAMOE_CHECK_ARG(ep_->device() == device_, "sm90 backend: the EP group lives on device ",
                      ep_->device(), ", the layer on ", device_);
    // Rows are the slots other ranks send here: up to the group's receive capacity.
    max_rows_ = ep_->max_recv_rows();
    ep::configure_dispatch(config_.num_local_experts());
    // Every kernel a call may launch is loaded now, not lazily at its first launch (whose load
    // would wait for the device: ranks waiting on each other there never let it finish).
    load_stage_kernels();
    load_gemm_kernels();
    load_mega_kernels();
    ep::load_kernels();
  }
  int64_t bytes = 0;
  carve(nullptr, config_, max_rows_, ep_ != nullptr, &bytes);
  workspace_ = Buffer(bytes, here);
  view_ = carve(workspace_.as<uint8_t>(), config_, max_rows_, ep_ != nullptr, &bytes);
  // Slack rows are read (never written back) by GEMM tiles past the last row: keep them finite.
  MEGAMOE_CUDA_CHECK(cudaMemset(workspace_.data(), 0, static_cast<size_t>(bytes)));
  const DispatchError clean{kDispatchNoError, 0};
  MEGAMOE_CUDA_CHECK(cudaMemcpy(view_.error, &clean, sizeof clean, cudaMemcpyHostToDevice));
  // The pending-error word: mapped pinned host memory the dispatch kernel sets (check_errors).
  void* flag = nullptr;
  MEGAMOE_CUDA_CHECK(cudaHostAlloc(&flag, sizeof(int32_t), cudaHostAllocMapped));
  error_flag_host_ = static_cast<volatile int32_t*>(flag);
  *error_flag_host_ = 0;
  void* flag_dev = nullptr;
  MEGAMOE_CUDA_CHECK(cudaHostGetDevicePointer(&flag_dev, flag, 0));
  error_flag_dev_ = static_cast<int32_t*>(flag_dev);
  if (config_.precision == Precision::kFp8) {  // the weights' row exponents, once
    const int e_l = static_cast<int>(config_.num_local_experts());
    const int64_t h = config_.shape.hidden, inter = config_.shape.intermediate;
    weight_row_exponents(weights_->w13_sf.as<uint8_t>(), e_l, 2 * inter, h, view_.w13_row_exp, nullptr);
    weight_row_exponents(weights_->w2_sf.as<uint8_t>(), e_l, h, inter, view_.w2_row_exp, nullptr);
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  }
  // The scales decide between the GEMMs' overlapped tiles (one multiply per converted register,
  // scale bytes < 128) and the serial ones (any scale): read once here, not per call.
  w13_small_scales_ = scales_all_small(weights_->w13_sf.as<uint8_t>(), weights_->w13_sf.size(), nullptr);
  w2_small_scales_ = scales_all_small(weights_->w2_sf.as<uint8_t>(), weights_->w2_sf.size(), nullptr);
}

Sm90Layer::~Sm90Layer() {
  if (error_flag_host_ != nullptr) cudaFreeHost(const_cast<int32_t*>(error_flag_host_));
}

L1Args Sm90Layer::l1_args(int64_t rows_hint, int64_t per_expert_max, bool pdl, bool fp8,
                           const int32_t* topk_idx, int64_t topk_slots) const {
  L1Args l1;
  l1.topk_idx = topk_idx;
  l1.topk_slots = topk_slots;
  l1.topk_first_local = config_.first_local_expert();
  l1.num_experts = static_cast<int>(config_.num_local_experts());
  l1.hidden = config_.shape.hidden;
  l1.intermediate = config_.shape.intermediate;
  l1.max_rows = max_rows_;
  l1.rows_hint = rows_hint;
  l1.rows_per_expert_max = per_expert_max;
  l1.row_offsets = view_.row_offsets;
  l1.act = view_.act;
  l1.row_weights = view_.row_weights;
  l1.w13 = weights_->w13.as<uint8_t>();
  l1.w13_sf = weights_->w13_sf.as<uint8_t>();
  l1.small_scales = w13_small_scales_;
  l1.w13_bias = weights_->has_bias() ? weights_->w13_bias.as<uint16_t>() : nullptr;
  l1.activation = config_.activation;
  l1.fast_math = config_.fast_math;
  l1.h_q = view_.h_q;
  l1.h_sf = view_.h_sf;
  l1.h_act = view_.h_act;
  l1.split_k = view_.split_k;
  l1.tile = tile_;
  if (fp8) {  // the FP8 policy's tile, or a forced FP8 tile (config.sm90.gemm_tile)
    l1.act_fp8 = view_.act_fp8;
    l1.act_row_factor = view_.act_factor;
    l1.w13_row_exp = view_.w13_row_exp;
    l1.h_act = nullptr;  // the FP8 L2 reads h_fp8 (rebased from h_q / h_sf)
    l1.tile = fp8_tile_;
  }
  l1.programmatic = pdl;
  return l1;
}

L2Args Sm90Layer::l2_args(int64_t rows_hint, int64_t per_expert_max, bool pdl, bool fp8) const {
  L2Args l2;
  l2.num_experts = static_cast<int>(config_.num_local_experts());
  l2.hidden = config_.shape.hidden;
  l2.intermediate = config_.shape.intermediate;
  l2.max_rows = max_rows_;
  l2.rows_hint = rows_hint;
  l2.rows_per_expert_max = per_expert_max;
  l2.row_offsets = view_.row_offsets;
  l2.h_act = view_.h_act;
  l2.row_weights = view_.row_weights;
  l2.w2 = weights_->w2.as<uint8_t>();
  l2.w2_sf = weights_->w2_sf.as<uint8_t>();
  l2.small_scales = w2_small_scales_;
  l2.w2_bias = weights_->has_bias() ? weights_->w2_bias.as<uint16_t>() : nullptr;
  l2.out = view_.out;
  l2.out_rows = view_.row_dst;  // under expert parallelism: straight to the sources' combine slots
  l2.split_k = view_.split_k;
  l2.tile = tile_;
  if (fp8) {
    l2.h_fp8 = view_.h_fp8;
    l2.h_row_factor = view_.h_factor;
    l2.w2_row_exp = view_.w2_row_exp;
    l2.tile = fp8_tile_;
  }
  l2.programmatic = pdl;
  return l2;
}

bool Sm90Layer::launch_gemms_fused(const L1Args& l1, const L2Args& l2, cudaStream_t stream,
                                   const MegaGather* gather, const MegaCombine* combine) {
  // (FP8 mode: the kernel also rebases L1's rows into L2's, the rebase launch between the
  // chained GEMMs.)
  last_gemms_fused_ = config_.sm90.mega_kernel &&
                      launch_mega(l1, l2, view_.mega, stream, gather, combine);
  last_dispatch_fused_ = last_gemms_fused_ && gather != nullptr;
  last_combine_fused_ = last_gemms_fused_ && combine != nullptr;
  return last_gemms_fused_;
}

void Sm90Layer::forward(const uint16_t* x, const int32_t* topk_idx, const float* topk_weights,
                        int64_t num_tokens, uint16_t* y, cudaStream_t stream, Stage last) {
  if (ep_ != nullptr) return forward_ep(x, topk_idx, topk_weights, num_tokens, y, stream);
  MEGAMOE_CHECK(num_tokens >= 0 && num_tokens <= config_.max_tokens_per_rank,
                ErrorCode::kOutOfRange, "forward: expected 0 <= T <= max_tokens_per_rank (",
                config_.max_tokens_per_rank, "), got T = ", num_tokens);
  if (num_tokens == 0) return;  // nothing to read or write; every stage would be empty
  const LayerShape& s = config_.shape;
  const int64_t num_local = config_.num_local_experts();
  const int64_t slots = num_tokens * s.top_k;
  auto done = [&](Stage stage) { return static_cast<int>(stage) >= static_cast<int>(last); };

  // The launches (six; four with the decode front) form a programmatic-dependent-launch chain
  // (config.sm90.programmatic_launch): each kernel waits for its predecessor on the device before
  // touching its data; every kernel but the prefill GEMM tiles lets its successor start early
  // (after its own wait), and the decode GEMMs build their schedules and start streaming weights
  // before their wait and take their work units at run time (L1Args::programmatic,
  // SplitKWorkspace::unit_counter; docs/design.md).
  const bool pdl = programmatic_;
  // An invalid expert id seen by an earlier call (the flag is host memory: no wait) is reported
  // now, before anything is launched; under graph capture nothing may synchronize, so the check
  // waits for check_errors() or the next eager call.
  if (error_pending() && !capturing(stream)) check_errors(stream);

  DispatchParams rp{};
  rp.topk_idx = topk_idx;
  rp.topk_weights = topk_weights;
  rp.num_slots = slots;
  rp.num_experts = static_cast<int32_t>(s.num_experts);
  rp.first_local = static_cast<int32_t>(config_.first_local_expert());
  rp.num_local = static_cast<int32_t>(num_local);
  rp.row_offsets = view_.row_offsets;
  rp.slot_to_row = view_.slot_to_row;
  rp.row_slot = view_.row_slot;
  rp.row_weights = view_.row_weights;
  rp.error = view_.error;
  rp.error_flag = error_flag_dev_;
  // FP8 mode (config.precision, per call: LayerConfig::fp8_for_tokens): L1's and L2's token rows
  // are E4M3 rebased per row (launch_rebase_rows_e4m3) instead of BF16.
  const bool fp8 = config_.fp8_for_tokens(num_tokens);

  // Decode calls (config.sm90.decode_front): quantize, dispatch and gather in one launch, which
  // every stage prefix up to the gather runs whole.
  const bool front = config_.sm90.decode_front && !fp8 && decode_front_takes(slots, num_local);
  if (front) {
    launch_decode_front(x, num_tokens, s.top_k, s.hidden, rp, view_.x_q, view_.x_sf, view_.act,
                        stream, pdl);
    if (done(Stage::kGather)) return;
  } else {
    launch_quantize_input(x, num_tokens, s.hidden, view_.x_q, view_.x_sf, stream, pdl);
    if (done(Stage::kQuantize)) return;
    launch_dispatch(rp, stream, pdl);
    if (done(Stage::kDispatch)) return;
    if (fp8) {
      launch_rebase_rows_e4m3(view_.x_q, view_.x_sf, view_.row_offsets, view_.row_slot, num_local,
                              s.top_k, s.hidden, slots, view_.act_fp8, view_.act_factor, stream,
                              pdl);
    } else {
      launch_gather(view_.x_q, view_.x_sf, view_.row_offsets, view_.row_slot, num_local, s.top_k,
                    s.hidden, slots, view_.act, stream, pdl);
    }
    if (done(Stage::kGather)) return;
  }

  // The MegaMoE kernel (config.sm90.mega_kernel) runs both GEMMs where its policy takes the
  // call; the stage prefix "l1" then times both. After the decode front (the launch just before
  // writes row_offsets) L1's schedule is counted from the ids (L1Args::topk_idx).
  const RowsHint rows = rows_hint(config_, num_tokens, slots);
  const int32_t* schedule_ids = front ? topk_idx : nullptr;
  const L1Args l1 = l1_args(rows.hint, rows.per_expert_max, pdl, fp8, schedule_ids, slots);
  const L2Args l2 = l2_args(rows.hint, rows.per_expert_max, pdl, fp8);
  // The combine inside the kernel (config.sm90.mega_combine) on whole calls (a stage prefix up to
  // "l2" times the GEMMs).
  MegaCombine combine;
  combine.rows = view_.out;
  combine.slot_to_row = view_.slot_to_row;
  combine.y = y;
  combine.num_tokens = static_cast<int32_t>(num_tokens);
  combine.top_k = static_cast<int32_t>(s.top_k);
  combine.all_ctas = 1;  // one grid alone: every CTA sums its share
  const bool inside = mega_combine_inside(config_, num_tokens, false) && !done(Stage::kL2);
  if (!launch_gemms_fused(l1, l2, stream, nullptr, inside ? &combine : nullptr)) {
    launch_l1(l1, stream);
    if (fp8) {
      launch_rebase_rows_e4m3(view_.h_q, view_.h_sf, view_.row_offsets, nullptr, num_local, 0,
                              s.intermediate, slots, view_.h_fp8, view_.h_factor, stream, pdl);
    }
    if (done(Stage::kL1)) return;
    launch_l2(l2, stream);
  }
  if (done(Stage::kL2)) return;

  if (!last_combine_fused_)
    launch_combine(view_.out, view_.slot_to_row, num_tokens, s.top_k, s.hidden, y, stream, pdl);
  if (config_.sync_error_check) {
    MEGAMOE_CHECK_ARG(!capturing(stream), "forward: config.sync_error_check waits for every call, "
                      "which a stream under CUDA-graph capture cannot; turn it off to capture");
    check_errors(stream);
  }
}

// One rank's layer call under expert parallelism (docs/design.md, "Expert parallelism"):
//
//   quantize        x -> x_q, x_sf                         (this rank's tokens)
//   ep send         rows to the owners' recv_xq/recv_sf, ids and weights to every rank (calls
//                   of up to kFusedSendMaxTokens tokens: these two stages are done inside ep
//                   dispatch, which quantizes each token's row and stores it to its owners)
//   ep dispatch     wait for every rank's tokens; row lists of the received slots
//   gather, L1, L2  on the received rows (the one-GPU kernels, or the MegaMoE kernel for both
//                   GEMMs); L2's epilogue writes each row to its source's combine slot t*K + k
//                   (L2Args::out_rows, the dispatch's row_dst)
//   ep return       publish that this rank's rows are in place; wait for every rank's
//   combine         y from this rank's combine slots, ascending k (the one-GPU kernel)
void Sm90Layer::forward_ep(const uint16_t* x, const int32_t* topk_idx, const float* topk_weights,
                           int64_t num_tokens, uint16_t* y, cudaStream_t stream) {
  detail::EpGroupImpl& g = ep_->impl();
  MEGAMOE_CHECK(!g.broken, ErrorCode::kTimeout, "forward: EP rank ", g.rank, " of ", g.size,
                ": the group timed out in an earlier call and is unusable; recreate it");
  MEGAMOE_CHECK(num_tokens >= 0, ErrorCode::kOutOfRange, "forward: expected T >= 0, got ",
                num_tokens);
  if ((error_pending() || g.error_pending()) && !capturing(stream)) check_errors(stream);
  const bool over = num_tokens > config_.max_tokens_per_rank;
  const int64_t t = over ? 0 : num_tokens;  // above capacity: take part with no tokens
  const LayerShape& s = config_.shape;
  const int64_t num_local = config_.num_local_experts();
  ep::EpParams p = g.params(t, num_tokens, s.num_experts);
  // Arrival words after every sent row, for the ranks that gather inside the MegaMoE kernel (the
  // group's ranks share the option: docs/design.md).
  p.row_flags = config_.sm90.mega_dispatch ? 1 : 0;
  const ep::WindowLayout& w = p.layout;
  uint8_t* window = p.peers[g.rank];
  const bool pdl = programmatic_;

  // Small calls (ep::fused_send) are quantized and sent by the dispatch kernel itself.
  const bool fused_send = ep::fused_send(p);
  if (t > 0 && !fused_send)
    launch_quantize_input(x, t, s.hidden, view_.x_q, view_.x_sf, stream, pdl);
  ep::SendInputs send;
  send.x = x;
  send.x_q = view_.x_q;
  send.x_sf = view_.x_sf;
  send.topk_idx = topk_idx;
  send.topk_weights = topk_weights;
  send.slot_map = view_.slot_to_row;
  send.error = view_.error;
  send.error_flag = error_flag_dev_;
  if (!fused_send) ep::launch_send(p, send, stream, pdl);
  // The FP8 mode by the group's tokens, estimated as this rank's T times the ranks (each local
  // expert expects T*R*K/E rows): ranks with similar T decide alike, and EP = R decides as EP = 1
  // does on the R ranks' tokens together (LayerConfig::fp8_min_rows_per_expert).
  const bool fp8 = config_.fp8_for_tokens(t * g.size);
  const int64_t grid_rows = std::max<int64_t>(1, t * s.top_k);
  const RowsHint rows = ep_rows_hint(config_, t, g.size, max_rows_);
  const L1Args l1 = l1_args(rows.hint, rows.per_expert_max, pdl, fp8);
  const L2Args l2 = l2_args(rows.hint, rows.per_expert_max, pdl, fp8);
  // The dispatch inside the MegaMoE kernel (config.sm90.mega_dispatch), where its policy runs the
  // call fused and this rank sends with ep_send (its ranks publish their slot ids before their
  // rows; a fused send publishes after them, so a small call has nothing to overlap and the
  // gather units would only cost: docs/perf.md): its gather units take each received row as it
  // arrives, so the dispatch kernel does not wait for the rows (only for every rank's slot ids,
  // to sort them).
  const bool gather_inside = config_.sm90.mega_dispatch && !fused_send &&
                             mega_fuses(l1, l2, view_.mega);  // (mega_dispatch needs mega_kernel)
  MegaGather gather;
  if (gather_inside) {
    gather.x_q = window + w.recv_xq;
    gather.x_sf = window + w.recv_sf;
    gather.row_slot = view_.row_slot;
    gather.top_k = static_cast<int32_t>(s.top_k);
    gather.arrival.flags = reinterpret_cast<const uint64_t*>(window + w.recv_flag);
    gather.arrival.local = reinterpret_cast<ep::EpLocal*>(window + w.local);
    gather.arrival.error_flag = p.error_flag;
    // Below the kernels' trap deadline (kWaitTimeoutCycles), which the L1 and L2 waits behind a
    // late row would otherwise reach first (docs/design.md, "The dispatch inside the launch").
    gather.arrival.timeout_ns = std::min<uint64_t>(p.timeout_ns, ep::kMaxRowWaitNs);
    gather.arrival.t_max = static_cast<int32_t>(w.t_max);
    check_mega_gather(gather, l1);  // before the dispatch: a refusal after it would leave the
                                    // peers waiting for this rank's return
  }
  // row_dst: each received row's destination, its source's combine slot, where L2 writes it.
  ep::launch_dispatch(p, send, view_.row_offsets, view_.row_slot, view_.row_weights,
                      view_.row_dst, stream, pdl, /*wait_rows=*/!gather_inside);
  // The combine inside the kernel (config.sm90.mega_combine, calls up to kCombineInsideMaxItems):
  // it returns this rank's rows' signal and waits for every rank's as ep_return does, then sums
  // y. Alone on its GPU up to 64 CTAs sum; with several ranks on one GPU only the last CTA out (a
  // rank waiting for the others must hold no more than one CTA), so only for the smallest calls.
  // Each rank decides for itself: the signals are the same either way.
  MegaCombine combine;
  combine.rows = reinterpret_cast<const uint16_t*>(window + w.combine);
  combine.slot_to_row = view_.slot_to_row;
  combine.y = t > 0 ? y : nullptr;
  combine.num_tokens = static_cast<int32_t>(t);
  combine.top_k = static_cast<int32_t>(s.top_k);
  combine.all_ctas = p.early_launch;
  combine.expert_parallel = 1;
  combine.ep = p;
  const MegaCombine* combine_arg =
      mega_combine_inside(config_, t, p.early_launch == 0) ? &combine : nullptr;
  if (gather_inside) {
    MEGAMOE_CHECK(launch_gemms_fused(l1, l2, stream, &gather, combine_arg), ErrorCode::kInternal,
                  "forward: the MegaMoE kernel declined a call its policy had taken");
  } else if (fp8) {
    launch_rebase_rows_e4m3(window + w.recv_xq, window + w.recv_sf, view_.row_offsets,
                            view_.row_slot, num_local, s.top_k, s.hidden, max_rows_, view_.act_fp8,
                            view_.act_factor, stream, pdl, grid_rows);
  } else {
    launch_gather(window + w.recv_xq, window + w.recv_sf, view_.row_offsets, view_.row_slot,
                  num_local, s.top_k, s.hidden, max_rows_, view_.act, stream, pdl, grid_rows);
  }

  // L2 (chained or in the MegaMoE kernel) writes its rows straight into their sources' combine
  // slots (l2_args: out_rows = row_dst); the return then only signals and waits.
  if (!gather_inside && !launch_gemms_fused(l1, l2, stream, nullptr, combine_arg)) {
    launch_l1(l1, stream);
    if (fp8) {
      launch_rebase_rows_e4m3(view_.h_q, view_.h_sf, view_.row_offsets, nullptr, num_local, 0,
                              s.intermediate, max_rows_, view_.h_fp8, view_.h_factor, stream, pdl,
                              grid_rows);
    }
    launch_l2(l2, stream);
  }

  if (!last_combine_fused_) {
    ep::launch_return(p, nullptr, view_.row_offsets, view_.row_slot, stream, pdl);
    if (t > 0)
      launch_combine(reinterpret_cast<const uint16_t*>(window + w.combine), view_.slot_to_row, t,
                     s.top_k, s.hidden, y, stream, pdl);
  }
  MEGAMOE_CHECK(!over, ErrorCode::kOutOfRange, "forward: EP rank ", g.rank, " of ", g.size,
                ": num_tokens ", num_tokens, " exceeds the layer capacity max_tokens_per_rank = ",
                config_.max_tokens_per_rank, " (this rank took part with no tokens; every other "
                "rank reports the error at its next check)");
  if (config_.sync_error_check) {
    MEGAMOE_CHECK_ARG(!capturing(stream), "forward: config.sync_error_check waits for every call, "
                      "which a stream under CUDA-graph capture cannot; turn it off to capture");
    check_errors(stream);
  }
}

std::vector<int64_t> Sm90Layer::expert_rows(cudaStream_t stream) const {
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const int64_t n = config_.num_local_experts();
  std::vector<int32_t> offsets(static_cast<size_t>(n + 1));
  MEGAMOE_CUDA_CHECK(cudaMemcpy(offsets.data(), view_.row_offsets, sizeof(int32_t) * (n + 1),
                                cudaMemcpyDeviceToHost));
  std::vector<int64_t> rows(static_cast<size_t>(n));
  for (int64_t e = 0; e < n; ++e) rows[e] = offsets[e + 1] - offsets[e];
  return rows;
}

bool Sm90Layer::error_pending() const { return *error_flag_host_ != 0; }

void Sm90Layer::check_errors(cudaStream_t stream) {
  MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  // Errors of the EP protocol first: they make the call's output invalid on every rank.
  if (ep_ != nullptr) ep_->impl().check_errors(stream);
  DispatchError record{};
  MEGAMOE_CUDA_CHECK(cudaMemcpy(&record, view_.error, sizeof record, cudaMemcpyDeviceToHost));
  *error_flag_host_ = 0;
  if (record.num_bad == 0) return;
  const DispatchError clean{kDispatchNoError, 0};
  MEGAMOE_CUDA_CHECK(cudaMemcpy(view_.error, &clean, sizeof clean, cudaMemcpyHostToDevice));
  const int64_t slot = static_cast<int64_t>(record.first_bad >> 32);
  const int32_t id = static_cast<int32_t>(static_cast<uint32_t>(record.first_bad & 0xFFFFFFFFu));
  const int64_t k = config_.shape.top_k;
  fail(ErrorCode::kOutOfRange, "topk_idx: expected global expert ids in [0, ",
       config_.shape.num_experts, ") or -1, got ", id, " at token ", slot / k, " slot ", slot % k,
       " (", record.num_bad, " invalid slot(s) since the last check; they were treated as empty)");
}

}  // namespace megamoe::sm90

// ---------------------------------------------------------------------------------------------
// The "sm90" MoeLayer backend (src/moe/backend.hpp)
// ---------------------------------------------------------------------------------------------
namespace megamoe::detail {

namespace {

class Sm90Backend final : public LayerBackend {
 public:
  // The LayerBackend base owns the prepared device weights; the layer borrows them (the base is
  // constructed first, and the backend never moves: MoeLayer holds it by unique_ptr).
  Sm90Backend(const LayerConfig& config, MoeWeights prepared, std::shared_ptr<EpGroup> ep)
      : LayerBackend("sm90", config, std::move(prepared), Device::cuda(cuda::current_device())),
        layer_(config_, &weights_, std::move(ep)) {}

  void forward(const uint16_t* x, const int32_t* topk_idx, const float* topk_weights,
               int64_t num_tokens, uint16_t* y, void* stream) override {
    layer_.forward(x, topk_idx, topk_weights, num_tokens, y, static_cast<cudaStream_t>(stream));
  }

  // Synchronizes `stream` and throws kOutOfRange for invalid expert ids seen since the last
  // check (see Sm90Layer::check_errors).
  void check_errors(void* stream) override {
    layer_.check_errors(static_cast<cudaStream_t>(stream));
  }

  std::vector<int64_t> expert_rows(void* stream) override {
    return layer_.expert_rows(static_cast<cudaStream_t>(stream));
  }
  const std::shared_ptr<EpGroup>& ep_group() const override { return layer_.ep_group(); }
  std::string last_call_kernels() const override {
    if (!layer_.last_gemms_fused()) return "chain";
    std::string kernels = "mega";
    if (layer_.last_dispatch_fused()) kernels += "+dispatch";
    if (layer_.last_combine_fused()) kernels += "+combine";
    return kernels;
  }

 private:
  sm90::Sm90Layer layer_;
};

}  // namespace

std::unique_ptr<LayerBackend> make_sm90_backend(const LayerConfig& config, MoeWeights&& weights,
                                                std::shared_ptr<EpGroup> ep) {
  if (ep != nullptr) {
    ep->impl().check_layer(config);
    MEGAMOE_CHECK_ARG(ep->device() == cuda::current_device(), "sm90 backend: the EP group lives on "
                      "device ", ep->device(), ", the current device is ", cuda::current_device());
  }
  MoeWeights prepared = sm90::Sm90Layer::prepare_device_weights(config, std::move(weights));
  return std::make_unique<Sm90Backend>(config, std::move(prepared), std::move(ep));
}

}  // namespace megamoe::detail
