// gemm_bench.cu: GEMM-only times of the Hopper grouped expert GEMMs (src/moe/sm90_gemm.hpp) for
// the Kimi-K3 and DeepSeek-V3 shapes: the policy's choice in its four launch modes, the serial
// policy, and every shipped tile forced where it could be chosen. Built as megamoe_gemm_bench
// with the GPU tests (it shares their helpers); not a test:
//
//   [MEGAMOE_BENCH_TOKENS=1,8] [MEGAMOE_BENCH_TILES=auto,prefill_256x96_k2_async2]
//   [MEGAMOE_BENCH_ORDER=reverse] [MEGAMOE_BENCH_MEGA=chain,auto,TILE/S1/S2] build/tests/megamoe_gemm_bench
//
// Prints one "[bench]" line per (shape, T, GEMM, tile, mode); bench/gemm_ab.sh compares builds.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "megamoe/activation.hpp"
#include "megamoe/buffer.hpp"
#include "moe/sm90_gemm.hpp"
#include "moe/sm90_mega.hpp"
#include "runtime/cuda_check.hpp"
#include "runtime/cuda_device.hpp"
#include "sm90/sm90_diag.hpp"
#include "sm90_gemm_test_util.hpp"
#include "sm90_test_util.hpp"
#if MEGAMOE_DIAG_TIMELINE
#include "sm90/sm90_diag_timeline.cuh"
#endif

namespace megamoe {
namespace {

__global__ void fill_random_kernel(uint8_t* p, int64_t n, uint32_t seed, int mode) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
    // mode 0: any byte; 1: scale bytes 118..125; 2: E4M3 codes of magnitude below 2 (no NaN)
    p[i] = mode == 0 ? static_cast<uint8_t>(h)
           : mode == 1 ? static_cast<uint8_t>(118 + (h & 7))
                       : static_cast<uint8_t>(h & 0xBF);
  }
}
__global__ void fill_bf16_kernel(uint16_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
    p[i] = static_cast<uint16_t>(0x3C00 | (h & 0x80FF));  // |x| in [2^-7, 2^-6): finite, nonzero
  }
}

struct BenchShape { const char* name; int64_t H, I, E, K; };

#if MEGAMOE_DIAG_TIMELINE
// Prints the stamps of the last launch (kernels/sm90/sm90_diag_timeline.cuh) as distributions
// over its CTAs, in us from the first CTA's entry, and clears them.
void print_timeline(const std::string& label, double event_us) {
  namespace d = sm90::diag;
  const std::vector<uint64_t> tab = sm90::diag_read_timeline();
  auto at = [&](int cta, int ev) { return tab[size_t(cta) * d::kNumEvents + ev]; };
  int ctas = 0;
  uint64_t t0 = ~uint64_t(0);
  while (ctas < d::kTimelineCtas && at(ctas, d::kEntry) != 0) t0 = std::min(t0, at(ctas++, d::kEntry));
  if (ctas == 0) { printf("[timeline] %s: no CTA recorded\n", label.c_str()); return; }
  auto dist = [&](int ev, bool from_entry) {
    std::vector<double> v;
    for (int c = 0; c < ctas; ++c) {
      if (at(c, ev) == 0) continue;
      v.push_back((at(c, ev) - (from_entry ? at(c, d::kEntry) : t0)) * 1e-3);
    }
    std::sort(v.begin(), v.end());
    char buf[128];
    if (v.empty()) return std::string("-");
    auto q = [&](double f) { return v[std::min(v.size() - 1, size_t(f * double(v.size())))]; };
    snprintf(buf, sizeof(buf), "%.1f/%.1f/%.1f/%.1f/%.1f", v.front(), q(0.1), q(0.5), q(0.9), v.back());
    return std::string(buf);
  };
  printf("[timeline] %s: %d CTAs, events %.1f us; us from the first entry, min/p10/p50/p90/max:\n",
         label.c_str(), ctas, event_us);
  printf("[timeline]   entry %s | schedule (from own entry) %s | first unit done %s\n",
         dist(d::kEntry, false).c_str(), dist(d::kScheduleBuilt, true).c_str(),
         dist(d::kFirstUnitDone, false).c_str());
  printf("[timeline]   producer done %s | math done %s\n", dist(d::kProducerDone, false).c_str(),
         dist(d::kMathDone, false).c_str());
  // Per unit count: CTAs and their mean end; per SM: the last end of its CTAs.
  std::vector<int> n_units(64, 0);
  std::vector<double> end_sum(64, 0);
  std::vector<double> sm_end(1024, 0);
  int max_sm = 0;
  for (int c = 0; c < ctas; ++c) {
    const int u = int(std::min<uint64_t>(63, at(c, d::kUnits)));
    const double end = at(c, d::kMathDone) ? (at(c, d::kMathDone) - t0) * 1e-3 : 0;
    ++n_units[u];
    end_sum[u] += end;
    const int sm = int(at(c, d::kSmid)) & 1023;
    sm_end[sm] = std::max(sm_end[sm], end);
    max_sm = std::max(max_sm, sm);
  }
  double sums[4] = {0, 0, 0, 0}, lasts = 0;
  for (int c = 0; c < ctas; ++c) {
    for (int k = 0; k < 4; ++k) sums[k] += at(c, d::kReduceStoreNs + k) * 1e-3;
    lasts += double(at(c, d::kLastArrivals));
  }
  printf("[timeline]   per CTA, mean us: hand-off store+fence %.2f, barrier+arrival %.2f, sum of parts %.2f "
         "(last arrivals %.2f per CTA), epilogues %.2f\n",
         sums[0] / ctas, sums[1] / ctas, sums[2] / ctas, lasts / ctas, sums[3] / ctas);
  printf("[timeline]   units per CTA (count, mean end us):");
  for (int u = 0; u < 64; ++u) if (n_units[u]) printf(" %d:(%d, %.1f)", u, n_units[u], end_sum[u] / n_units[u]);
  std::vector<double> ends(sm_end.begin(), sm_end.begin() + max_sm + 1);
  std::sort(ends.begin(), ends.end());
  printf("\n[timeline]   last end per SM: min %.1f p50 %.1f max %.1f (%d SMs)\n", ends.front(),
         ends[ends.size() / 2], ends.back(), max_sm + 1);
  // SMs grouped by the units their CTAs ran: whether the SMs with more units end last.
  std::vector<int> sm_units(max_sm + 1, 0);
  for (int c = 0; c < ctas; ++c) sm_units[int(at(c, d::kSmid)) & 1023] += int(at(c, d::kUnits));
  std::vector<int> g_count(64, 0);
  std::vector<double> g_end(64, 0), g_max(64, 0);
  for (int sm = 0; sm <= max_sm; ++sm) {
    const int g = std::min(63, sm_units[sm]);
    ++g_count[g];
    g_end[g] += sm_end[sm];
    g_max[g] = std::max(g_max[g], sm_end[sm]);
  }
  printf("[timeline]   SMs by units run (units: SMs, mean / max last end us):");
  for (int g = 0; g < 64; ++g) {
    if (g_count[g]) printf(" %d:(%d, %.1f / %.1f)", g, g_count[g], g_end[g] / g_count[g], g_max[g]);
  }
  printf("\n");
}
#endif

// The integers of a comma-separated environment variable (empty when unset or empty).
static std::vector<long> env_int_list(const char* name) {
  std::vector<long> list;
  const char* env = std::getenv(name);
  for (const char* c = env != nullptr ? env : ""; *c != 0;) {
    char* end = nullptr;
    const long v = std::strtol(c, &end, 10);
    if (end == c) { ++c; continue; }
    list.push_back(v);
    c = end;
  }
  return list;
}

// MEGAMOE_BENCH_TOKENS="1,8" replaces the GEMM benchmark's token counts (default 1, 8, 64, 512,
// 4096, 8192; any count up to 8192).
static std::vector<int> bench_token_list() {
  const std::vector<long> env = env_int_list("MEGAMOE_BENCH_TOKENS");
  if (env.empty()) return {1, 8, 64, 512, 4096, 8192};
  std::vector<int> list;
  for (long t : env) {
    if (t >= 1 && t <= 8192) list.push_back(static_cast<int>(t));
  }
  return list;
}

// The names of a comma-separated environment variable (empty when unset or empty).
static std::vector<std::string> env_name_list(const char* name) {
  std::vector<std::string> list;
  std::string cur;
  const char* env = std::getenv(name);
  for (const char* c = env != nullptr ? env : "";; ++c) {
    if (*c == ',' || *c == 0) {
      if (!cur.empty()) list.push_back(cur);
      cur.clear();
      if (*c == 0) break;
    } else if (*c != ' ') {
      cur += *c;
    }
  }
  return list;
}

// MEGAMOE_BENCH_TILES="auto,prefill_256x128_k2_staged" restricts it to those tile requests ("auto"
// with its four launch modes, "auto_fp8" (the FP8 mode's policy), "serial", or tile names;
// default: all).
static bool bench_name_selected(const std::string& name) {
  static const std::vector<std::string> names = env_name_list("MEGAMOE_BENCH_TILES");
  return names.empty() || std::find(names.begin(), names.end(), name) != names.end();
}
static bool bench_tile_selected(const sm90::TileRequest& tile) {
  return bench_name_selected(sm90::to_string(tile));
}

// MEGAMOE_BENCH_ORDER=reverse times each point's rows last to first. Rows timed later in a call
// read slower (clocks under sustained load: docs/perf.md), so an A/B of two tiles
// runs the benchmark once in each order and compares the means.
static bool bench_reverse_order() {
  const char* v = std::getenv("MEGAMOE_BENCH_ORDER");
  return v != nullptr && std::string(v) == "reverse";
}

TEST(Sm90GemmBench, Shapes) {
  MEGAMOE_REQUIRE_SM90();
  const auto& dev = cuda::device_info();
  // Copy ceiling in the same run.
  printf("[bench] %s: device copy %.2f TB/s (read + write)\n", dev.name.c_str(), test::device_copy_tbs());
  const BenchShape shapes[] = {{"kimi-k3", 3584, 3072, 896, 16}, {"deepseek-v3", 7168, 2048, 256, 8}};
  const std::vector<int> tokens = bench_token_list();
  for (const auto& s : shapes) {
    const int64_t max_rows = 8192 * s.K;
    Buffer w13(s.E * 2 * s.I * s.H / 2, Device::cuda()), w13sf(s.E * 2 * s.I * s.H / 32, Device::cuda());
    Buffer w2(s.E * s.H * s.I / 2, Device::cuda()), w2sf(s.E * s.H * s.I / 32, Device::cuda());
    fill_random_kernel<<<4096, 256>>>(w13.as<uint8_t>(), w13.size(), 1, 0);
    fill_random_kernel<<<4096, 256>>>(w13sf.as<uint8_t>(), w13sf.size(), 2, 1);
    fill_random_kernel<<<4096, 256>>>(w2.as<uint8_t>(), w2.size(), 3, 0);
    fill_random_kernel<<<4096, 256>>>(w2sf.as<uint8_t>(), w2sf.size(), 4, 1);
    Buffer x((max_rows + sm90::kRowSlack) * s.H * 2, Device::cuda());
    Buffer hact((max_rows + sm90::kRowSlack) * s.I * 2, Device::cuda());
    fill_bf16_kernel<<<4096, 256>>>(x.as<uint16_t>(), x.size() / 2, 5);
    fill_bf16_kernel<<<4096, 256>>>(hact.as<uint16_t>(), hact.size() / 2, 6);
    // FP8 mode inputs (the FP8 tiles): E4M3 rows, row factors 1, the weights' row exponents.
    Buffer x8((max_rows + sm90::kRowSlack) * s.H, Device::cuda());
    Buffer h8((max_rows + sm90::kRowSlack) * s.I, Device::cuda());
    fill_random_kernel<<<4096, 256>>>(x8.as<uint8_t>(), x8.size(), 7, 2);
    fill_random_kernel<<<4096, 256>>>(h8.as<uint8_t>(), h8.size(), 8, 2);
    const Buffer ones = to_device(std::vector<float>(max_rows + sm90::kRowSlack, 1.0f));
    Buffer w13_rx(s.E * 2 * s.I, Device::cuda()), w2_rx(s.E * s.H, Device::cuda());
    sm90::weight_row_exponents(w13sf.as<uint8_t>(), int(s.E), 2 * s.I, s.H, w13_rx.as<uint8_t>(), nullptr);
    sm90::weight_row_exponents(w2sf.as<uint8_t>(), int(s.E), s.H, s.I, w2_rx.as<uint8_t>(), nullptr);
    Buffer hq(max_rows * s.I, Device::cuda()), hsf(max_rows * s.I / 32, Device::cuda());
    Buffer hact_out((max_rows + sm90::kRowSlack) * s.I * 2, Device::cuda());
    Buffer out(max_rows * s.H * 2, Device::cuda());
    std::vector<float> rw(max_rows, 0.5f);
    Buffer d_rw = to_device(rw);
    const int bench_split_tiles = int(8 * s.K * (std::max(s.H, 2 * s.I) / 128));  // T <= 8
    const SplitWorkspace bench_split(bench_split_tiles,
                                     int64_t(bench_split_tiles) * sm90::kMaxKSplits * 128 * 16);
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
    // The MegaMoE kernel's counters and split-K area (MEGAMOE_BENCH_MEGA).
    const MegaBuffers mega(max_rows, int(s.E));
    const bool w13_small = sm90::scales_all_small(w13sf.as<uint8_t>(), w13sf.size(), nullptr);
    const bool w2_small = sm90::scales_all_small(w2sf.as<uint8_t>(), w2sf.size(), nullptr);
    printf("[bench] %s: scale bytes all < 128: w13 %d, w2 %d\n", s.name, int(w13_small), int(w2_small));
    for (int T : tokens) {
      // Uniform top-k routing without repeats, 4 seeds rotated (different experts each launch).
      constexpr int kRot = 4;
      std::vector<Buffer> offs;
      double active_avg = 0;
      for (int rot = 0; rot < kRot; ++rot) {
        std::mt19937 rng(1000 * T + rot);
        std::vector<int> cnt(s.E, 0), perm(s.E);
        for (int t = 0; t < T; ++t) {
          std::iota(perm.begin(), perm.end(), 0);
          for (int k = 0; k < s.K; ++k) {
            std::swap(perm[k], perm[k + rng() % (s.E - k)]);
            ++cnt[perm[k]];
          }
        }
        std::vector<int32_t> o(s.E + 1, 0);
        for (int e = 0; e < s.E; ++e) o[e + 1] = o[e] + cnt[e];
        active_avg += std::count_if(cnt.begin(), cnt.end(), [](int c) { return c > 0; }) / double(kRot);
        offs.push_back(to_device(o));
      }
      const int64_t rows = int64_t(T) * s.K;
      sm90::L1Args a1;
      a1.num_experts = int(s.E); a1.hidden = s.H; a1.intermediate = s.I; a1.max_rows = max_rows;
      a1.rows_hint = rows; a1.act = x.as<uint16_t>(); a1.row_weights = d_rw.as<float>();
      a1.w13 = w13.as<uint8_t>(); a1.w13_sf = w13sf.as<uint8_t>(); a1.small_scales = w13_small;
      a1.activation = std::string(s.name) == "kimi-k3" ? Activation::situ(4.0f, 25.0f) : Activation::swiglu();
      a1.h_q = hq.as<uint8_t>(); a1.h_sf = hsf.as<uint8_t>(); a1.h_act = hact_out.as<uint16_t>();
      sm90::L2Args a2;
      a2.num_experts = int(s.E); a2.hidden = s.H; a2.intermediate = s.I; a2.max_rows = max_rows;
      a2.rows_hint = rows; a2.h_act = hact.as<uint16_t>(); a2.row_weights = d_rw.as<float>();
      a2.w2 = w2.as<uint8_t>(); a2.w2_sf = w2sf.as<uint8_t>(); a2.out = out.as<uint16_t>();
      a2.small_scales = w2_small;
      // The policy ("auto", what the layer runs) in four launch modes; the serial policy; every
      // shipped tile forced where it could be chosen (decode tiles up to T = 512, prefill tiles
      // from T = 512; the split tiles with 1..kMaxKSplits parts at T <= 8), except the shallower
      // siblings of tiles that take this K.
      // Modes (auto only; every other row is mode 0):
      //   0 units taken at run time (the workspace's unit counter, as in the layer), plain launches;
      //   1 the static split of the units (no unit counter), plain launches;
      //   2 units taken at run time, programmatic launches (each launch may start while the
      //     previous one ends, as the layer's launches do);
      //   3 the static split, programmatic launches.
      struct Run { sm90::TileRequest tile; int parts; int mode; };
      std::vector<Run> runs;
      if (bench_tile_selected(sm90::TileRequest::automatic())) {
        for (int mode = 0; mode < 4; ++mode) runs.push_back({sm90::TileRequest::automatic(), 0, mode});
      }
      if (bench_tile_selected(sm90::TileRequest::serial())) runs.push_back({sm90::TileRequest::serial(), 0, 0});
      auto deeper_sibling_fits = [&](sm90::TileId id) {
        for (int j = 0; j < sm90::kNumTiles; ++j) {
          const auto other = static_cast<sm90::TileId>(j);
          if (other != id && sm90::shallower_sibling(other) == id &&
              sm90::fit_k(other, s.H) == other && sm90::fit_k(other, s.I) == other) {
            return true;
          }
        }
        return false;
      };
      for (int j = 0; j < sm90::kNumTiles; ++j) {
        const auto id = static_cast<sm90::TileId>(j);
        const sm90::TileConfig& t = sm90::tile_config(id);
        const bool decode = t.ctas_per_sm > 1;
        if (t.mainloop == sm90::MainloopKind::kSerial || deeper_sibling_fits(id)) continue;
        if (s.H % t.k_multiple() != 0 || s.I % t.k_multiple() != 0) continue;
        if ((decode && T > 512) || (!decode && T < 512)) continue;
        if (!bench_tile_selected(sm90::TileRequest::forced(id))) continue;
        if (t.split_k) {
          if (T <= 8) for (int parts = 1; parts <= sm90::kMaxKSplits; ++parts) runs.push_back({sm90::TileRequest::forced(id), parts, 0});
        } else {
          runs.push_back({sm90::TileRequest::forced(id), 0, 0});
        }
      }
      if (bench_reverse_order()) std::reverse(runs.begin(), runs.end());
      // MEGAMOE_BENCH_MEGA="chain,auto,decode_128x16_k2_warp_splitk/2/2": both GEMMs of a call
      // timed together, as the layer runs them: "chain" (launch_l1 then launch_l2, programmatic,
      // the policy's tiles), or the MegaMoE kernel with the policy's tile and parts ("auto") or a
      // tile with L1 / L2 parts (TILE/S1/S2). Rows "[bench] ... L1+L2 mega=SPEC".
      for (const std::string& spec : env_name_list("MEGAMOE_BENCH_MEGA")) {
        const bool chain = spec == "chain";
        std::string tile_name = spec;
        int s1 = 0, s2 = 0;
        if (const size_t slash = spec.find('/'); slash != std::string::npos) {
          tile_name = spec.substr(0, slash);
          std::sscanf(spec.c_str() + slash + 1, "%d/%d", &s1, &s2);
        }
        a1.tile = a2.tile = chain ? sm90::TileRequest::automatic() : sm90::parse_tile_request(tile_name);
        a1.act_fp8 = nullptr; a1.act_row_factor = nullptr; a1.w13_row_exp = nullptr;
        a2.h_fp8 = nullptr; a2.h_row_factor = nullptr; a2.w2_row_exp = nullptr;
        a1.k_splits = chain ? 0 : s1;
        a2.k_splits = chain ? 0 : s2;
        a1.split_k = a2.split_k = bench_split.ws;
        a1.programmatic = a2.programmatic = true;
        a2.h_act = hact_out.as<uint16_t>();  // L2 reads what L1 writes, as in the layer
        auto launch = [&](int it, cudaStream_t st) {
          a1.row_offsets = a2.row_offsets = offs[it % kRot].as<int32_t>();
          if (chain || !sm90::launch_mega(a1, a2, mega.ws, st)) {
            sm90::launch_l1(a1, st);
            sm90::launch_l2(a2, st);
          }
        };
        for (int it = 0; it < 3; ++it) launch(it, nullptr);
        // The graph runs on a non-blocking stream: the warm-up launches (legacy stream) must be
        // done first (two launches at once on one workspace would share its counters).
        MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
        test::GraphTiming timing;
        {
          const test::Stream st;
          const test::StreamGraph graph(st, [&] { for (int it = 0; it < kRot; ++it) launch(it, st); });
          graph.launch(st);
          MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(st));
          timing = test::time_graph_launches(graph, st, kRot, T >= 4096 ? 6 : 20);
        }
        MEGAMOE_CUDA_CHECK(cudaGetLastError());
        a2.h_act = hact.as<uint16_t>();
        const double wbytes = active_avg * 3.0 * s.I * s.H * (0.5 + 1.0 / 32);
        printf("[bench] %-11s T=%5d L1+L2 mega=%s rows=%6lld experts=%6.1f  median %9.1f us (min %9.1f)  weights %6.0f GB/s\n",
               s.name, T, spec.c_str(), (long long)rows, active_avg, timing.median_us, timing.min_us,
               wbytes / (timing.median_us * 1e-6) / 1e9);
      }
      // (The forced splits get a workspace for every tile of these launches; the layer's covers
      // only what the policy splits.)
      if (T >= 512 && bench_name_selected("auto_fp8")) runs.push_back({sm90::TileRequest::automatic(), 0, 4});
      for (const auto& [tile, parts, mode] : runs)
      for (int which = 0; which < 2; ++which) {
        a1.tile = tile;
        a2.tile = tile;
        // FP8 mode: the FP8 tiles forced, and the FP8 policy (mode 4, "auto fp8").
        const bool fp8 = mode == 4 || (tile.mode == sm90::TileRequest::Mode::kForced &&
                                       sm90::tile_config(tile.tile).fp8());
        a1.act_fp8 = fp8 ? x8.as<uint8_t>() : nullptr;
        a1.act_row_factor = fp8 ? ones.as<float>() : nullptr;
        a1.w13_row_exp = fp8 ? w13_rx.as<uint8_t>() : nullptr;
        a2.h_fp8 = fp8 ? h8.as<uint8_t>() : nullptr;
        a2.h_row_factor = fp8 ? ones.as<float>() : nullptr;
        a2.w2_row_exp = fp8 ? w2_rx.as<uint8_t>() : nullptr;
        a1.k_splits = parts;
        a2.k_splits = parts;
        a1.split_k = bench_split.ws;
        a2.split_k = bench_split.ws;
        if (mode == 1 || mode == 3) a1.split_k.unit_counter = a2.split_k.unit_counter = nullptr;
        a1.programmatic = a2.programmatic = mode == 2 || mode == 3;
        auto launch = [&](int it, cudaStream_t st) {
          if (which == 0) { a1.row_offsets = offs[it % kRot].as<int32_t>(); sm90::launch_l1(a1, st); }
          else { a2.row_offsets = offs[it % kRot].as<int32_t>(); sm90::launch_l2(a2, st); }
        };
        for (int it = 0; it < 3; ++it) launch(it, nullptr);
        // Timed as the protocol of targets.md asks (test::time_graph_launches): a CUDA graph of
        // kRot launches (one per routing seed, back to back as in the layer), events around
        // several replays enqueued behind an untimed one; time per launch = sample / launches.
        // Printed beside it: "single", an older timing (events around one replay submitted
        // to an idle GPU, which counts the host's submission gap), and "eager" (events around one
        // eagerly launched kernel, the launcher's host work included).
        const int iters = T >= 4096 ? 6 : 20;
        std::vector<float> eager(iters);
        cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
        for (int it = 0; it < iters; ++it) {
          cudaEventRecord(e0); launch(it, nullptr); cudaEventRecord(e1);
          MEGAMOE_CUDA_CHECK(cudaEventSynchronize(e1));
          cudaEventElapsedTime(&eager[it], e0, e1);
        }
        cudaEventDestroy(e0); cudaEventDestroy(e1);
        test::GraphTiming timing;
        {
          const test::Stream st;
          const test::StreamGraph graph(st, [&] { for (int it = 0; it < kRot; ++it) launch(it, st); });
          graph.launch(st);
          MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(st));
          timing = test::time_graph_launches(graph, st, kRot, iters);
        }
        MEGAMOE_CUDA_CHECK(cudaGetLastError());
        std::sort(eager.begin(), eager.end());
        const double med = timing.median_us, mn = timing.min_us;
        const double single_med = timing.single_median_us, eager_med = eager[iters / 2] * 1e3;
        const double n_rows = which == 0 ? 2.0 * s.I : double(s.H);
        const double k_red = which == 0 ? double(s.H) : double(s.I);
        const double wbytes = active_avg * n_rows * k_red * (0.5 + 1.0 / 32);
        const double flops = 2.0 * rows * n_rows * k_red;
        static const char* const kModeLabel[] = {"", " static", " pdl", " static pdl", " fp8"};
        const std::string split_label =
            (parts > 0 ? " split=" + std::to_string(parts) : "") + kModeLabel[mode];
#if MEGAMOE_DIAG_TIMELINE
        if (T <= 64 && tile == sm90::TileRequest::automatic() && (mode == 0 || mode == 1)) {
          (void)sm90::diag_read_timeline();  // clears the warm-up's stamps
          float one = 0;
          cudaEvent_t t0, t1; cudaEventCreate(&t0); cudaEventCreate(&t1);
          cudaEventRecord(t0); launch(0, nullptr); cudaEventRecord(t1);
          MEGAMOE_CUDA_CHECK(cudaEventSynchronize(t1));
          cudaEventElapsedTime(&one, t0, t1);
          cudaEventDestroy(t0); cudaEventDestroy(t1);
          print_timeline(std::string(s.name) + " T=" + std::to_string(T) + (which == 0 ? " L1" : " L2") + " tile=" + sm90::to_string(tile) + kModeLabel[mode], one * 1e3);
        }
#endif
        printf("[bench] %-11s T=%5d %s tile=%s%s rows=%6lld experts=%6.1f  median %9.1f us (min %9.1f)  %7.1f TFLOP/s  weights %6.0f GB/s  single %9.1f us  eager %9.1f us\n",
               s.name, T, which == 0 ? "L1" : "L2", sm90::to_string(tile).c_str(), split_label.c_str(), (long long)rows, active_avg, med, mn,
               flops / (med * 1e-6) / 1e12, wbytes / (med * 1e-6) / 1e9, single_med, eager_med);
      }
    }
  }
}

}  // namespace
}  // namespace megamoe
