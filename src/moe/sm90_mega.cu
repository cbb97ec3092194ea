// sm90_mega.cu: the MegaMoE launcher (sm90_mega.hpp): the call's two GemmParams (launch_l1's and
// launch_l2's checks), the policy's tile, and the per-tile launchers of the generated units.
#include "moe/sm90_mega.hpp"

#include <algorithm>
#include <array>
#include <utility>

#include "megamoe/error.hpp"
#include "moe/sm90_gemm_launch.hpp"
#include "moe/sm90_tile_policy.hpp"
#include "runtime/cuda_device.hpp"
#include "sm90/sm90_combine_chunk.cuh"
#include "sm90/sm90_tile_schedule.hpp"

namespace megamoe::sm90 {
namespace {

using MegaLauncher = void (*)(const MegaParams&, const void*, const void*, cudaStream_t);
template <size_t kI>
constexpr TileId mega_tile_at() {
  return kMegaTiles[kI];
}
template <size_t kI>
constexpr MegaLauncher mega_launcher_of() {
  return &launch_mega_tile<mega_tile_at<kI>()>;
}
template <size_t... kI>
constexpr std::array<MegaLauncher, kNumMegaTiles> make_mega_launchers(std::index_sequence<kI...>) {
  return {mega_launcher_of<kI>()...};
}
constexpr auto kMegaLaunchers = make_mega_launchers(std::make_index_sequence<kNumMegaTiles>{});

template <size_t... kI>
void load_mega_tiles(std::index_sequence<kI...>) {
  (load_mega_tile<mega_tile_at<kI>()>(), ...);
}

}  // namespace

int64_t mega_counters(int64_t max_rows, int num_experts) {
  int block_n = tile_config(kMegaTiles[0]).block_n;
  for (TileId id : kMegaTiles) block_n = std::min(block_n, tile_config(id).block_n);
  return max_schedule_slots(max_rows, num_experts, block_n);
}

namespace {
MegaChoice mega_choice(const L1Args& a1, const L2Args& a2, const MegaWorkspace& ws) {
  const bool fp8 = a1.act_fp8 != nullptr;
  MEGAMOE_CHECK_ARG(fp8 == (a2.h_fp8 != nullptr),
                    "launch_mega: the FP8 mode takes L1's act_fp8 and L2's h_fp8 together, got ",
                    fp8 ? "act_fp8 without h_fp8" : "h_fp8 without act_fp8");
  TileQuery q;
  q.rows_hint = a1.rows_hint;
  q.max_rows = a1.max_rows;
  q.num_experts = a1.num_experts;
  q.m_rows = 2 * a1.intermediate;
  q.k = a1.hidden;
  q.sm_count = cuda::device_info().sm_count;
  q.small_scales = a1.small_scales;
  q.unit_counter = a1.split_k.unit_counter != nullptr;
  q.split_allowed = a1.k_splits == 0 && a2.k_splits == 0 && ws.split_partials != nullptr &&
                    ws.split_counters != nullptr;
  q.split_counters_capacity = ws.split_counters_capacity;
  q.split_partial_floats = ws.split_partial_floats;
  return fp8 ? choose_mega_fp8_tile(q, a2.intermediate, a1.tile)
             : choose_mega_tile(q, a2.intermediate, a2.small_scales, a1.tile);
}

// What launch_mega checks of `combine` (ws: its counters).
void check_mega_combine(const MegaCombine& c, const L1Args& a1, const MegaWorkspace& ws) {
  MEGAMOE_CHECK_ARG(ws.combine_counters != nullptr,
                    "launch_mega: the combine inside the launch needs the workspace's "
                    "combine_counters, got null");
  MEGAMOE_CHECK_ARG(c.num_tokens >= 0 && c.top_k > 0 && a1.hidden % kCombineVec == 0 &&
                        static_cast<int64_t>(c.num_tokens) * a1.hidden / kCombineVec <= UINT32_MAX,
                    "launch_mega: the combine takes T >= 0, top_k > 0, H a multiple of ",
                    kCombineVec, " and T * H / ", kCombineVec, " < 2^32, got T = ", c.num_tokens,
                    ", top_k = ", c.top_k, ", H = ", a1.hidden);
  MEGAMOE_CHECK_ARG(c.num_tokens == 0 ||
                        (c.rows != nullptr && c.slot_to_row != nullptr && c.y != nullptr &&
                         reinterpret_cast<uintptr_t>(c.rows) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(c.y) % 16 == 0),
                    "launch_mega: the combine reads rows and writes y 16 bytes at a time: expected "
                    "16-byte aligned rows and y and a slot_to_row map, got rows ",
                    static_cast<const void*>(c.rows), ", y ", static_cast<const void*>(c.y),
                    ", slot_to_row ", static_cast<const void*>(c.slot_to_row));
  MEGAMOE_CHECK_ARG(c.expert_parallel == 0 || (c.ep.size >= 1 && c.ep.peers[c.ep.rank] != nullptr),
                    "launch_mega: the combine under expert parallelism needs the rank's EpParams");
  MEGAMOE_CHECK_ARG(c.all_ctas != 0 || c.expert_parallel != 0,
                    "launch_mega: the combine by the last CTA alone is for several ranks on one "
                    "GPU (expert parallelism)");
}
}  // namespace

bool mega_fuses(const L1Args& a1, const L2Args& a2, const MegaWorkspace& ws) {
  return mega_choice(a1, a2, ws).fused;
}

void check_mega_gather(const MegaGather& g, const L1Args& a1) {
  MEGAMOE_CHECK_ARG(g.x_q != nullptr && g.x_sf != nullptr && g.row_slot != nullptr &&
                        g.arrival.flags != nullptr && g.arrival.local != nullptr && g.top_k > 0 &&
                        g.arrival.t_max > 0,
                    "launch_mega: the gather inside the launch needs the received rows, scales, "
                    "row_slot, arrival words, the window's state, top_k > 0 and t_max > 0");
  MEGAMOE_CHECK_ARG(reinterpret_cast<uintptr_t>(g.x_q) % 16 == 0 && a1.hidden % kScaleBlock == 0,
                    "launch_mega: the gather reads 16-byte aligned rows of whole 32-groups, got "
                    "x_q ", static_cast<const void*>(g.x_q), " and H = ", a1.hidden);
  MEGAMOE_CHECK_ARG(a1.act_fp8 != nullptr ? a1.act_row_factor != nullptr : a1.act != nullptr,
                    "launch_mega: the gather inside the launch writes L1's rows: expected ",
                    a1.act_fp8 != nullptr ? "act_row_factor with act_fp8" : "act", ", got null");
}

bool launch_mega(const L1Args& a1, const L2Args& a2, const MegaWorkspace& ws, cudaStream_t stream,
                 const MegaGather* gather, const MegaCombine* combine) {
  const bool fp8 = a1.act_fp8 != nullptr;
  const MegaChoice choice = mega_choice(a1, a2, ws);
  if (!choice.fused) return false;
  MegaParams mp;
  mp.l1 = l1_params(a1);
  mp.l2 = l2_params(a2);
  if (fp8) {
    // The kernel writes L2's operand itself (its rebase units: launch_rebase_rows_e4m3 of
    // L1's h_q / h_sf), which L2Args names as an input.
    mp.h_fp8 = const_cast<uint8_t*>(a2.h_fp8);
    mp.h_factor = const_cast<float*>(a2.h_row_factor);
  }
  if (gather != nullptr) {
    const MegaGather& g = *gather;
    check_mega_gather(g, a1);
    mp.gather = g;
    // Its outputs are L1's B operand: what the gather or rebase launch would write.
    mp.gather.act = fp8 ? nullptr : const_cast<uint16_t*>(a1.act);
    mp.gather.act_fp8 = fp8 ? const_cast<uint8_t*>(a1.act_fp8) : nullptr;
    mp.gather.act_factor = fp8 ? const_cast<float*>(a1.act_row_factor) : nullptr;
  }
  if (combine != nullptr) {
    check_mega_combine(*combine, a1, ws);
    mp.combine = *combine;
    mp.combine.counters = ws.combine_counters;
  }
  // No rows can exist: nothing to run (unless the combine has to: it zeroes y, and under expert
  // parallelism returns this rank's signal).
  if (a1.max_rows == 0 && combine == nullptr) return true;
  MEGAMOE_CHECK_ARG(a2.num_experts == a1.num_experts && a2.max_rows == a1.max_rows &&
                        a2.row_offsets == a1.row_offsets && a2.hidden == a1.hidden &&
                        a2.intermediate == a1.intermediate,
                    "launch_mega: L1 and L2 must cover the same experts, rows and row_offsets");
  MEGAMOE_CHECK_ARG(a1.split_k.unit_counter != nullptr,
                    "launch_mega: split_k.unit_counter: expected the 2-word unit counter, got null");
  MEGAMOE_CHECK_ARG(!ws.empty() && ws.capacity >= mega_counters(a1.max_rows, a1.num_experts),
                    "launch_mega: the workspace's counters must hold ",
                    mega_counters(a1.max_rows, a1.num_experts), " slots each (mega_counters), got ",
                    ws.empty() ? 0 : ws.capacity);
  for (GemmParams* p : {&mp.l1, &mp.l2}) {
    p->gate_min_avg = p->gate_max_avg = 0;
    p->unit_counter = a1.split_k.unit_counter;
  }
  // The policy's parts, or the caller's (k_splits >= 1).
  mp.l1.k_splits = a1.k_splits > 0 ? a1.k_splits : choice.l1_splits;
  mp.l2.k_splits = a2.k_splits > 0 ? a2.k_splits : choice.l2_splits;
  MEGAMOE_CHECK_ARG((mp.l1.k_splits <= 1 && mp.l2.k_splits <= 1) ||
                        (ws.split_partials != nullptr && ws.split_counters != nullptr),
                    "launch_mega: k_splits ", mp.l1.k_splits, " / ", mp.l2.k_splits,
                    " need the workspace's split-K area, got none");
  mp.l1.split_partials = ws.split_partials;
  mp.l1.split_partial_floats = ws.split_partial_floats;
  mp.l1.split_counters = ws.split_counters;
  mp.l1.split_counters_capacity = static_cast<int>(std::min<int64_t>(ws.split_counters_capacity, INT32_MAX));
  mp.ready = ws.ready;
  mp.consumed = ws.consumed;
  mp.ready_capacity = static_cast<int>(std::min<int64_t>(ws.capacity, INT32_MAX));
  kMegaLaunchers[mega_tile_index(choice.tile)](
      mp, fp8 ? static_cast<const void*>(a1.act_fp8) : a1.act,
      fp8 ? static_cast<const void*>(a2.h_fp8) : a2.h_act, stream);
  return true;
}

void load_mega_kernels() { load_mega_tiles(std::make_index_sequence<kNumMegaTiles>{}); }

}  // namespace megamoe::sm90
