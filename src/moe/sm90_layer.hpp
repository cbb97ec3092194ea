// sm90_layer.hpp: the Hopper (sm_90a) MoE layer: weights in the sm90 layout, a workspace sized
// once for the layer's capacity, and a forward pass of six stages on the caller's stream.
//
//   stage      kernel (kernels/sm90/)                   writes (workspace)
//   quantize   sm90_quantize_input.cuh                  x_q [T, H] e4m3, x_sf [T, H/32]
//   dispatch   sm90_dispatch.cuh                        row_offsets, slot_to_row, row_slot, row_weights
//   gather     sm90_gather.cuh                          act [rows, H] bf16 (exact dequantized x_q)
//   l1         sm90::launch_l1 (grouped GEMM + epilogue) h_q, h_sf, h_act
//   l2         sm90::launch_l2 (grouped GEMM)           out [rows, H] bf16 (aliases act)
//   combine    sm90_combine.cuh                         y [T, H] bf16 (the caller's)
//
// forward() allocates nothing and never synchronizes with the host, so a call can be captured in
// a CUDA graph and replayed. Rows: the (token, slot) pairs routed to this rank, grouped by local
// expert in ascending slot order (deterministic).
//
// Invalid expert ids (outside [0, E), not -1) are never used as indices: their slots count as
// empty, and the dispatch kernel records them in device memory and raises a flag in mapped host
// memory. They are reported (kOutOfRange naming the first bad token/slot) by check_errors(),
// which synchronizes the stream, reads and clears the record; by the next forward(), which
// reads the flag without waiting and, when it is up, calls check_errors() before launching
// anything; and, with config.sync_error_check, by the call itself (docs/design.md, "Errors
// raised inside a layer call").
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "megamoe/buffer.hpp"
#include "megamoe/config.hpp"
#include "megamoe/ep.hpp"
#include "megamoe/weights.hpp"
#include "moe/sm90_gemm.hpp"
#include "moe/sm90_mega.hpp"

#if defined(MEGAMOE_WITH_CUDA)
#include <cuda_runtime.h>

namespace megamoe::sm90 {

struct DispatchError;

// The weight layout the Hopper kernels read (src/prep/sm90_layout.*, docs/layouts.md).
constexpr const char* kSm90LayoutName = "sm90";

enum class Stage : int { kQuantize = 0, kDispatch, kGather, kL1, kL2, kCombine };
constexpr int kNumLayerStages = 6;
const char* stage_name(Stage stage);

// Device pointers into the workspace (valid until the layer is destroyed). `rows` buffers hold
// max_rows() rows plus kRowSlack. act and out share storage: L2 overwrites act.
struct WorkspaceView {
  uint8_t* x_q = nullptr;          // [T_max, H]
  uint8_t* x_sf = nullptr;         // [T_max, H/32]
  int32_t* slot_to_row = nullptr;  // [T_max * K]
  int32_t* row_offsets = nullptr;  // [E_l + 1]
  int32_t* row_slot = nullptr;     // [rows]
  float* row_weights = nullptr;    // [rows]
  uint16_t* act = nullptr;         // [rows, H]   L1 input, then L2 output (out)
  uint16_t* out = nullptr;         // == act
  uint8_t* h_q = nullptr;          // [rows, I]
  uint8_t* h_sf = nullptr;         // [rows, I/32]
  uint16_t* h_act = nullptr;       // [rows, I]
  // Under expert parallelism: row r's destination, its source rank's combine slot (written by the
  // EP dispatch; L2Args::out_rows, so L2 returns the rows itself); null on one GPU.
  uint16_t** row_dst = nullptr;    // [rows]
  // FP8 mode (config.precision fp8; null otherwise): the E4M3 rows of the FP8 GEMM tiles and
  // their row factors (launch_rebase_rows_e4m3), and the weights' row exponents.
  uint8_t* act_fp8 = nullptr;      // [rows, H]
  float* act_factor = nullptr;     // [rows]
  uint8_t* h_fp8 = nullptr;        // [rows, I]
  float* h_factor = nullptr;       // [rows]
  uint8_t* w13_row_exp = nullptr;  // [E_l, 2I]
  uint8_t* w2_row_exp = nullptr;   // [E_l, H]
  DispatchError* error = nullptr;
  SplitKWorkspace split_k;         // L1 and L2 in turn (one stream); counters zeroed once
  MegaWorkspace mega;              // the MegaMoE kernel's counters (config.sm90.mega_kernel; empty
                                   // otherwise); zeroed once
};

// Whether the MegaMoE kernel, where it runs a call of `tokens` tokens, also sums y
// (LayerConfig::sm90.mega_combine and the size rule of sm90_layer.cu; one_cta: several EP ranks on
// one GPU, where the last CTA alone sums).
bool mega_combine_inside(const LayerConfig& config, int64_t tokens, bool one_cta);

class Sm90Layer {
 public:
  // `weights`: canonical (host or device; copied to the current device and prepared there) or
  // already in the sm90 layout on the current device. Throws kUnsupported without an sm_90 GPU.
  Sm90Layer(const LayerConfig& config, MoeWeights weights);
  // Borrows weights already returned by prepare_device_weights(); they must outlive the layer
  // (the MoeLayer backend owns them in its LayerBackend base), and their scale bytes must not
  // change under it (the constructor reads whether they are all < 128: w13_small_scales()).
  Sm90Layer(const LayerConfig& config, const MoeWeights* prepared);
  // The same as one rank of an EP group (megamoe/ep.hpp): forward() then sends the tokens to the
  // ranks owning their experts and sums the results back (docs/design.md, "Expert
  // parallelism"). config.ep_size/ep_rank must be the group's size/rank.
  Sm90Layer(const LayerConfig& config, const MoeWeights* prepared, std::shared_ptr<EpGroup> ep);

  // Moves `weights` to the current device in the sm90 layout (see the constructor).
  static MoeWeights prepare_device_weights(const LayerConfig& config, MoeWeights weights);
  ~Sm90Layer();
  Sm90Layer(const Sm90Layer&) = delete;
  Sm90Layer& operator=(const Sm90Layer&) = delete;

  // x bf16 [T, H], topk_idx int32 [T, K], topk_weights fp32 [T, K], y bf16 [T, H]: device
  // pointers. Runs the stages up to and including `last` (the benchmark times stage prefixes;
  // an EP layer always runs them all). With an EP group, T above max_tokens_per_rank still takes
  // part in the call (as T = 0, so no rank waits for it) and then throws kOutOfRange.
  void forward(const uint16_t* x, const int32_t* topk_idx, const float* topk_weights,
               int64_t num_tokens, uint16_t* y, cudaStream_t stream,
               Stage last = Stage::kCombine);

  // Synchronizes `stream`, then throws kOutOfRange if a forward since the last check saw invalid
  // expert ids (the record is cleared first, so the next check starts clean).
  void check_errors(cudaStream_t stream);
  // Whether a finished kernel has recorded an invalid expert id that no check has reported yet
  // (reads host memory; never waits, so a call still running may not show up yet).
  bool error_pending() const;
  // Rows each local expert received in the last call (synchronizes `stream`).
  std::vector<int64_t> expert_rows(cudaStream_t stream) const;
  const std::shared_ptr<EpGroup>& ep_group() const { return ep_; }

  // Programmatic dependent launch of the six kernels (runtime/cuda_launch.hpp; docs/design.md):
  // each waits for its predecessor on the device, some start before it ends; results are the
  // same bit for bit. Starts as config.sm90.programmatic_launch.
  void set_programmatic_launch(bool on) { programmatic_ = on; }
  bool programmatic_launch() const { return programmatic_; }
  // The exact mode's GEMM tile request (config.sm90.gemm_tile; automatic when that names an FP8
  // tile, which applies to the FP8 mode's calls).
  const TileRequest& tile_request() const { return tile_; }
  // Whether the last call's two GEMMs ran in the MegaMoE kernel (launch_mega), for tests and
  // benchmarks that compare it with the chain.
  bool last_gemms_fused() const { return last_gemms_fused_; }
  // Whether that launch also gathered the received rows (config.sm90.mega_dispatch), and whether
  // it also summed y (config.sm90.mega_combine).
  bool last_dispatch_fused() const { return last_dispatch_fused_; }
  bool last_combine_fused() const { return last_combine_fused_; }

  const LayerConfig& config() const { return config_; }
  const MoeWeights& weights() const { return *weights_; }
  int device() const { return device_; }
  int64_t max_rows() const { return max_rows_; }
  int64_t workspace_bytes() const { return workspace_.size(); }
  const WorkspaceView& workspace() const { return view_; }
  // Whether every scale byte of w13_sf / w2_sf is < 128 (sm90::scales_all_small, read once at
  // construction): the GEMMs run their faster overlapped tiles only then.
  bool w13_small_scales() const { return w13_small_scales_; }
  bool w2_small_scales() const { return w2_small_scales_; }

 private:
  void init_workspace();
  // The GEMMs' arguments of a call: the workspace, the weights and the layer's options, with the
  // policy's row estimates (L1Args).
  // fp8: the call runs the FP8 mode (LayerConfig::fp8_for_tokens). topk_idx (T*K = topk_slots
  // ids): L1's schedule is counted from the caller's ids (after the decode front, which writes
  // row_offsets itself; L1Args::topk_idx).
  L1Args l1_args(int64_t rows_hint, int64_t per_expert_max, bool pdl, bool fp8 = false,
                 const int32_t* topk_idx = nullptr, int64_t topk_slots = 0) const;
  L2Args l2_args(int64_t rows_hint, int64_t per_expert_max, bool pdl, bool fp8 = false) const;
  // Both GEMMs (l1, l2: the chain's arguments) in one launch of the MegaMoE kernel where
  // config.sm90.mega_kernel is on and its policy takes the call (launch_mega), with `gather` and
  // `combine` inside where given; false: nothing launched, the caller chains them. Sets the
  // last_*_fused flags.
  bool launch_gemms_fused(const L1Args& l1, const L2Args& l2, cudaStream_t stream,
                          const MegaGather* gather = nullptr, const MegaCombine* combine = nullptr);
  void forward_ep(const uint16_t* x, const int32_t* topk_idx, const float* topk_weights,
                  int64_t num_tokens, uint16_t* y, cudaStream_t stream);

  LayerConfig config_;
  MoeWeights owned_weights_;           // empty when borrowing
  const MoeWeights* weights_ = nullptr;
  int device_ = 0;
  int64_t max_rows_ = 0;
  Buffer workspace_;
  WorkspaceView view_;
  bool w13_small_scales_ = false;
  bool w2_small_scales_ = false;
  bool programmatic_ = true;
  TileRequest tile_;      // the exact mode's calls
  TileRequest fp8_tile_;  // the FP8 mode's: automatic, or a forced FP8 tile (config.sm90.gemm_tile)
  bool last_gemms_fused_ = false;
  bool last_dispatch_fused_ = false;
  bool last_combine_fused_ = false;
  std::shared_ptr<EpGroup> ep_;        // null: one GPU (ep_size > 1 computes this rank's slice)
  volatile int32_t* error_flag_host_ = nullptr;  // mapped pinned host memory (DispatchParams)
  int32_t* error_flag_dev_ = nullptr;
};

}  // namespace megamoe::sm90
#endif  // MEGAMOE_WITH_CUDA
