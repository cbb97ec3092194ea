// sm90_gemm.hpp: launchers of the Hopper expert GEMMs (the interface between the layer pipeline
// and the grouped-GEMM kernels). Kernels: kernels/sm90/.
//
// Both GEMMs are grouped over the rank's local experts. Their "rows" are the routed (token, slot)
// pairs sorted by local expert: rows of local expert e are [row_offsets[e], row_offsets[e+1]).
// Row buffers are allocated for `max_rows` rows plus kRowSlack extra rows, so a tile may read
// past the last row without leaving the allocation (those rows are never written back).
//
//   L1:  acc[r, n] = sum_k act[r, k] * W13_e[n, k]         n in [0, 2I), k in [0, H)
//        epilogue (numerics.md sections 4-5): g/u to BF16, activation, * row_weight[r],
//        per-32 requantization -> h_q[r, I] (e4m3), h_sf[r, I/32] (ue8m0), and h_act[r, I], the
//        same values dequantized to BF16 (exact), which is L2's operand.
//   L2:  out[r, n] = bf16( sum_j h_act[r, j] * W2_e[n, j] )   n in [0, H), j in [0, I)
//
// Requirements (checked, kInvalidArgument/kUnsupported naming the field): H % 64 == 0,
// I % 64 == 0, 1 <= E_l <= 1024, weights in the "sm90" layout (src/prep/sm90_layout.hpp),
// row_offsets non-decreasing with row_offsets[E_l] <= max_rows (checked on the device: a bad
// offset traps with a printed message). max_rows == 0 and experts without rows are valid.
// Bias: L1 adds the fp32 bias to the accumulators before the BF16 rounding of g/u; L2 computes
// out = bf16(acc + row_weight * bias).
//
// Operands in exact mode are BF16 values that carry E4M3 x 2^s and E2M1 x 2^s exactly; the
// products are exact and accumulation is FP32 (wgmma), so only summation order differs from the
// CPU reference.
#pragma once

#include <cstdint>
#include <vector>

#include "megamoe/activation.hpp"
#include "moe/sm90_tile_policy.hpp"

#if defined(MEGAMOE_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace megamoe::sm90 {

constexpr int64_t kRowSlack = 256;  // extra rows allocated after max_rows in every row buffer

// Split-K workspace (optional). The policy cuts the K loop of a decode launch into parts run as
// separate work units when its tiles would leave CTA slots idle (few experts hit, e.g.
// DeepSeek-V3 / Kimi-K3 at T = 1): each part stores FP32 partial accumulators here and the
// tile's last part adds them in part order (deterministic) before the epilogue. Owned by the
// caller: `counters` zero-initialized once (every launch leaves them zero); one workspace serves
// the launches of one stream in turn, not two launches running at the same time. Sizes:
// split_k_counters() / split_k_partial_floats() cover every split the policy picks; a launch that
// would need more runs unsplit.
//
// unit_counter (optional, 2 int32, zero-initialized once, left zero by every launch): the decode
// tiles then take their work units at run time (the first one per CTA fixed, every further one
// from this counter), so a launch stays balanced wherever its CTAs were placed; with it, they
// also let the next kernel of the stream start early (programmatic launches). Launches of one
// stream may share it (a launch takes units only after the previous kernel has completed).
struct SplitKWorkspace {
  float* partials = nullptr;
  int64_t partial_floats = 0;
  int32_t* counters = nullptr;
  int counters_capacity = 0;
  int32_t* unit_counter = nullptr;
  bool empty() const { return partials == nullptr || counters == nullptr; }
};
#if defined(MEGAMOE_WITH_CUDA)
int split_k_counters();            // on the current device
int64_t split_k_partial_floats();  // on the current device
#endif

struct L1Args {
  int num_experts = 0;                  // E_l
  int64_t hidden = 0;                   // H (reduction)
  int64_t intermediate = 0;             // I (output: 2I accumulators, I activations)
  int64_t max_rows = 0;                 // capacity in rows (host-known upper bound of routed rows)
  int64_t rows_hint = 0;                // the policy's estimate of this call's routed rows (0 =
                                        // max_rows); picks the tile config only, never a limit:
                                        // any number of rows up to max_rows runs correctly.
                                        // Sm90Layer passes T*K on one GPU and the rank's
                                        // expected share T*K*E_l/E under expert parallelism
  int64_t rows_per_expert_max = 0;      // optional: the most rows one expert can get (T: one
                                        // slot per token; 0: unknown). When the policy would
                                        // pick another kind of tile for that many than for
                                        // rows_hint, it launches one per kind, each gated on the
                                        // actual rows per hit expert (only one runs;
                                        // plan_launches)
  const int32_t* row_offsets = nullptr; // device int32 [E_l + 1]
  const uint16_t* act = nullptr;        // device bf16 [max_rows + kRowSlack, H] (exact mode)
  // FP8 mode (docs/numerics.md "FP8 mode"; given act_fp8, act is not read and an FP8 tile runs):
  // token rows in E4M3 with one power-of-two factor per row, each 32-group of a row stored in
  // sm90_layout::fp8_row_slot order; the weights' row exponents from weight_row_exponents.
  const uint8_t* act_fp8 = nullptr;     // device e4m3 [max_rows + kRowSlack, H]
  const float* act_row_factor = nullptr;  // device fp32 [max_rows + kRowSlack]
  const uint8_t* w13_row_exp = nullptr; // device [E_l, 2I]
  const float* row_weights = nullptr;   // device fp32 [max_rows]
  const uint8_t* w13 = nullptr;         // device, sm90 prepared layout
  const uint8_t* w13_sf = nullptr;      // device, sm90 prepared layout
  bool small_scales = false;            // every scale byte of w13_sf is < 128 (scale <= 2^0;
                                        // scales_all_small). The overlapped configs need it
                                        // (one exact multiply per converted register); without
                                        // it the policy runs the serial tiles (any scale,
                                        // slower) and a forced overlapped tile is refused
  const uint16_t* w13_bias = nullptr;   // device bf16 [E_l, 2I] canonical row order, or nullptr
  Activation activation;
  bool fast_math = true;
  uint8_t* h_q = nullptr;               // device e4m3 [max_rows, I], 8-byte aligned
  uint8_t* h_sf = nullptr;              // device ue8m0 [max_rows, I/32]
  uint16_t* h_act = nullptr;            // device bf16 [max_rows + kRowSlack, I], 16-byte aligned
  TileRequest tile;                     // the policy (default), serial-only, or one tile
  SplitKWorkspace split_k;              // optional (empty: never split)
  int k_splits = 0;                     // 0: the policy's choice; 1: unsplit; n in
                                        // [2, kMaxKSplits]: n parts (the *_splitk tiles; needs
                                        // split_k)
  // Programmatic dependent launch (runtime/cuda_launch.hpp): the kernel may start while the
  // previous kernel of the stream still runs; it builds its tile schedule from row_offsets and
  // issues its first weight copies at once, and waits for that kernel before it reads act /
  // h_act, row_weights or the split-K workspace and before it writes anything. So row_offsets
  // must not be written by the previous kernel itself: Sm90Layer's dispatch runs two launches
  // earlier (dispatch, gather, L1, L2), and a megamoe kernel that lets its successor start early
  // does so only after its own wait, so dispatch has completed when L1 or L2 starts. Where the
  // previous kernel does write row_offsets (the decode front: quantize, dispatch and gather in
  // one launch), topk_idx lets the decode tiles count the schedule from the caller's ids, which
  // the launch before it has written.
  bool programmatic = false;
  // Optional (nullptr: the schedule reads row_offsets): the caller's top-k ids, device int32
  // [topk_slots] (T*K), with the local experts [topk_first_local, topk_first_local + E_l);
  // the rows they give must be those of row_offsets (the dispatch's rule; GemmParams::topk_idx).
  const int32_t* topk_idx = nullptr;
  int64_t topk_slots = 0;
  int64_t topk_first_local = 0;
};

struct L2Args {
  int num_experts = 0;
  int64_t hidden = 0;                   // H (output)
  int64_t intermediate = 0;             // I (reduction)
  int64_t max_rows = 0;
  int64_t rows_hint = 0;                // as in L1Args
  int64_t rows_per_expert_max = 0;      // as in L1Args
  const int32_t* row_offsets = nullptr; // device int32 [E_l + 1]
  const uint16_t* h_act = nullptr;      // device bf16 [max_rows + kRowSlack, I]
  const uint8_t* h_fp8 = nullptr;       // FP8 mode, as L1Args::act_fp8: [max_rows + kRowSlack, I]
  const float* h_row_factor = nullptr;  // FP8 mode: [max_rows + kRowSlack]
  const uint8_t* w2_row_exp = nullptr;  // FP8 mode: [E_l, H]
  const float* row_weights = nullptr;   // device fp32 [max_rows] (scales the L2 bias only)
  const uint8_t* w2 = nullptr;          // device, sm90 prepared layout
  const uint8_t* w2_sf = nullptr;       // device, sm90 prepared layout
  bool small_scales = false;            // as in L1Args, for w2_sf
  const uint16_t* w2_bias = nullptr;    // device bf16 [E_l, H], or nullptr
  uint16_t* out = nullptr;              // device bf16 [max_rows, H]
  // Optional device [max_rows]: row r's destination instead of out + r * H (GemmParams::out_rows:
  // under expert parallelism, its source rank's combine slot).
  uint16_t* const* out_rows = nullptr;
  TileRequest tile;                     // as in L1Args
  SplitKWorkspace split_k;              // as in L1Args
  int k_splits = 0;                     // as in L1Args
  bool programmatic = false;            // as in L1Args
};

#if defined(MEGAMOE_WITH_CUDA)
// Whether every one of `bytes` scale bytes at device pointer `sf` is < 128 (weight scales
// <= 2^0: L1Args / L2Args::small_scales). One pass over the bytes on `stream`, then a host
// synchronization of it: for weight loading, not inside a layer call.
bool scales_all_small(const uint8_t* sf, int64_t bytes, cudaStream_t stream);

// FP8 mode: out[e, m] = the largest scale byte of prepared row m of expert e of an sm90-layout
// scale tensor (E experts x m_rows rows x k / 32 groups), asynchronously on `stream`.
void weight_row_exponents(const uint8_t* sf, int num_experts, int64_t m_rows, int64_t k,
                          uint8_t* out, cudaStream_t stream);

// Asynchronous on `stream`; no host synchronization and no allocation (CUDA-graph capturable).
void launch_l1(const L1Args& args, cudaStream_t stream);

// Loads every GEMM kernel of the tile table into the current context. CUDA loads a kernel at its
// first launch by default (lazy loading), and a load waits until the device is idle: with
// several EP ranks in one process, a load behind a rank that waits on the device for another
// rank's launch would never finish. EP layers call this (and the stages' and EP kernels'
// loaders) at construction.
void load_gemm_kernels();
void launch_l2(const L2Args& args, cudaStream_t stream);

#if defined(MEGAMOE_DIAG_TIMELINE) && MEGAMOE_DIAG_TIMELINE
// Measurement builds only (kernels/sm90/sm90_diag_timeline.cuh): the stamps of the last GEMM
// launch, [CTA][diag::kNumEvents] (zeros for CTAs that did not run), and the table cleared.
// Synchronizes the device.
std::vector<uint64_t> diag_read_timeline();
#endif
#endif

}  // namespace megamoe::sm90
