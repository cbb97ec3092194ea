// test_sm90_mega.cu: the MegaMoE kernel's launcher (src/moe/sm90_mega.hpp) against the chained
// GEMM launches on the same tile and the same K parts: h_q, h_sf, h_act and out bit for bit (the
// same mainloop, the same part order), for every K split of either GEMM and on the prefill tiles
// (staged and asynchronous epilogues), with empty experts and experts over several n-tiles; its
// counters are left zero; its refusals name what is wrong.
// (The layer-level tests are in test_sm90_layer.cu, "The MegaMoE kernel".)
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "ep/ep_protocol.hpp"
#include "megamoe/buffer.hpp"
#include "megamoe/error.hpp"
#include "megamoe/formats.hpp"
#include "moe/sm90_gemm.hpp"
#include "moe/sm90_mega.hpp"
#include "moe/sm90_stages.hpp"
#include "moe/sm90_tile_policy.hpp"
#include "runtime/cuda_check.hpp"
#include "runtime/cuda_device.hpp"
#include "sm90_gemm_test_util.hpp"
#include "sm90_test_util.hpp"

namespace megamoe {
namespace {

constexpr int kMaxE = 64;
constexpr int64_t kH = 1024, kI = 512, kMaxRows = 512;

struct Problem {
  int experts = 0;
  Buffer w13, w13_sf, w2, w2_sf, act, row_weights, offsets;
  std::vector<int32_t> host_offsets;
};

// Random weights (any byte is a valid E2M1 pair; scale bytes < 128: the overlapped tiles), BF16
// token rows of small integers times powers of two, and `counts` rows per expert.
Problem make_problem(const std::vector<int>& counts, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto bytes = [&](int64_t n, int lo, int hi) {
    std::vector<uint8_t> v(static_cast<size_t>(n));
    std::uniform_int_distribution<int> d(lo, hi);
    for (auto& b : v) b = static_cast<uint8_t>(d(rng));
    return to_device(v);
  };
  Problem p;
  const int64_t e = static_cast<int64_t>(counts.size());
  p.experts = static_cast<int>(e);
  p.w13 = bytes(e * 2 * kI * kH / 2, 0, 255);
  p.w13_sf = bytes(e * 2 * kI * kH / 32, 118, 127);
  p.w2 = bytes(e * kH * kI / 2, 0, 255);
  p.w2_sf = bytes(e * kH * kI / 32, 118, 127);
  std::vector<uint16_t> act(static_cast<size_t>((kMaxRows + sm90::kRowSlack) * kH), 0);
  std::uniform_int_distribution<int> v(-8, 8), ex(-3, 2);
  for (int64_t i = 0; i < kMaxRows * kH; ++i) {
    act[i] = bf16_from_f32(std::ldexp(static_cast<float>(v(rng)), ex(rng)));
  }
  p.act = to_device(act);
  std::vector<float> rw(kMaxRows);
  std::uniform_real_distribution<float> w(0.05f, 1.0f);
  for (float& x : rw) x = w(rng);
  p.row_weights = to_device(rw);
  p.host_offsets.assign(e + 1, 0);
  for (int i = 0; i < e; ++i) p.host_offsets[i + 1] = p.host_offsets[i] + counts[i];
  p.offsets = to_device(p.host_offsets);
  return p;
}

struct Outputs {
  Buffer h_q{kMaxRows * kI, Device::cuda()}, h_sf{kMaxRows * kI / 32, Device::cuda()};
  Buffer h_act{(kMaxRows + sm90::kRowSlack) * kI * 2, Device::cuda()};
  Buffer out{kMaxRows * kH * 2, Device::cuda()};
  void poison() {
    for (Buffer* b : {&h_q, &h_sf, &h_act, &out}) MEGAMOE_CUDA_CHECK(cudaMemset(b->data(), 0x7F, b->size()));
  }
};

struct Args {
  sm90::L1Args l1;
  sm90::L2Args l2;
};

Args make_args(const Problem& p, Outputs& o, const std::string& tile, int s1, int s2,
               const sm90::SplitKWorkspace& split) {
  Args a;
  sm90::L1Args& l1 = a.l1;
  l1.num_experts = p.experts;
  l1.hidden = kH;
  l1.intermediate = kI;
  l1.max_rows = kMaxRows;
  l1.rows_hint = p.host_offsets.back();
  l1.row_offsets = p.offsets.as<int32_t>();
  l1.act = p.act.as<uint16_t>();
  l1.row_weights = p.row_weights.as<float>();
  l1.w13 = p.w13.as<uint8_t>();
  l1.w13_sf = p.w13_sf.as<uint8_t>();
  l1.small_scales = true;
  l1.activation = Activation::situ(4.0f, 25.0f);
  l1.h_q = o.h_q.as<uint8_t>();
  l1.h_sf = o.h_sf.as<uint8_t>();
  l1.h_act = o.h_act.as<uint16_t>();
  l1.tile = sm90::parse_tile_request(tile);
  l1.split_k = split;
  l1.k_splits = s1;
  sm90::L2Args& l2 = a.l2;
  l2.num_experts = p.experts;
  l2.hidden = kH;
  l2.intermediate = kI;
  l2.max_rows = kMaxRows;
  l2.rows_hint = l1.rows_hint;
  l2.row_offsets = l1.row_offsets;
  l2.h_act = o.h_act.as<uint16_t>();
  l2.row_weights = l1.row_weights;
  l2.w2 = p.w2.as<uint8_t>();
  l2.w2_sf = p.w2_sf.as<uint8_t>();
  l2.small_scales = true;
  l2.out = o.out.as<uint16_t>();
  l2.tile = l1.tile;
  l2.split_k = split;
  l2.k_splits = s2;
  return a;
}

// The FP8 mode's operands of both GEMMs: L1's E4M3 rows and factors, the weights' row exponents,
// L2's E4M3 rows and factors (the BF16 act / h_act then unused).
void set_fp8_mode(Args& a, const uint8_t* act8, const float* act_factor, const uint8_t* w13_exp,
                  uint8_t* h8, float* h_factor, const uint8_t* w2_exp) {
  a.l1.act = nullptr;
  a.l1.h_act = nullptr;
  a.l1.act_fp8 = act8;
  a.l1.act_row_factor = act_factor;
  a.l1.w13_row_exp = w13_exp;
  a.l2.h_act = nullptr;
  a.l2.h_fp8 = h8;
  a.l2.h_row_factor = h_factor;
  a.l2.w2_row_exp = w2_exp;
}

void expect_equal(const Outputs& a, const Outputs& b, int64_t rows, const std::string& what) {
  EXPECT_EQ(to_host<uint8_t>(a.h_q, rows * kI), to_host<uint8_t>(b.h_q, rows * kI)) << what << ": h_q";
  EXPECT_EQ(to_host<uint8_t>(a.h_sf, rows * kI / 32), to_host<uint8_t>(b.h_sf, rows * kI / 32)) << what << ": h_sf";
  EXPECT_EQ(to_host<uint16_t>(a.h_act, rows * kI), to_host<uint16_t>(b.h_act, rows * kI)) << what << ": h_act";
  EXPECT_EQ(to_host<uint16_t>(a.out, rows * kH), to_host<uint16_t>(b.out, rows * kH)) << what << ": out";
}

TEST(Sm90Mega, EqualsTheChainOnTheSameTileAndPartsBitForBit) {
  MEGAMOE_REQUIRE_SM90();
  const SplitWorkspace split(4096, int64_t(4096) * sm90::kMaxKSplits * 2048);
  MegaBuffers mega(kMaxRows, kMaxE);
  struct Case {
    const char* tile;
    int s1, s2;
  };
  const Case cases[] = {{"decode_128x16_k2_warp_splitk", 1, 1}, {"decode_128x16_k2_warp_splitk", 2, 1},
                        {"decode_128x16_k2_warp_splitk", 1, 3}, {"decode_128x16_k2_warp_splitk", 4, 2},
                        {"decode_128x16_k1_warp_splitk", 3, 4}, {"decode_128x8_k4_warp_splitk", 2, 1},
                        {"decode_128x8_k4_warp_splitk", 4, 2}, {"decode_128x8_k4_warp", 0, 0},
                        {"decode_128x16_k2_warp", 0, 0}, {"prefill_128x192_async", 0, 0},
                        {"prefill_256x64_k2_async", 0, 0}, {"prefill_256x128_k2_staged", 0, 0},
                        {"prefill_256x128_k1_staged", 0, 0}};
  // One row per hit expert (decode), a few, and experts over several 16-row n-tiles; empty ones;
  // and 64 experts of one row each: 512 L1 tiles, in up to 2048 parts, more units than CTA
  // slots (parts taken at run time, L2 tiles waiting on L1 tiles of later waves); and experts
  // over several n-tiles of the prefill tiles (64 to 192 rows), the last one partial.
  const std::vector<std::vector<int>> routings = {{1, 0, 1, 1, 0, 0, 1, 0},
                                                  {3, 2, 0, 5, 1, 1, 0, 4},
                                                  {40, 0, 17, 1, 64, 33, 0, 2},
                                                  std::vector<int>(kMaxE, 1),
                                                  {200, 0, 130, 1, 181}};
  uint64_t seed = 4000;
  for (const auto& counts : routings) {
    const Problem p = make_problem(counts, seed++);
    const int64_t rows = p.host_offsets.back();
    for (const Case& c : cases) {
      const std::string what = std::string(c.tile) + " parts " + std::to_string(c.s1) + "/" +
                               std::to_string(c.s2) + " rows " + std::to_string(rows);
      Outputs chain_out, mega_out;
      chain_out.poison();
      Args chain = make_args(p, chain_out, c.tile, std::max(c.s1, 1), std::max(c.s2, 1), split.ws);
      sm90::launch_l1(chain.l1, nullptr);
      sm90::launch_l2(chain.l2, nullptr);
      MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
      for (int call = 0; call < 2; ++call) {
        mega_out.poison();
        Args fused = make_args(p, mega_out, c.tile, c.s1, c.s2, split.ws);
        ASSERT_TRUE(sm90::launch_mega(fused.l1, fused.l2, mega.ws, nullptr)) << what;
        MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
        expect_equal(mega_out, chain_out, rows, what + " call " + std::to_string(call));
        EXPECT_TRUE(mega.all_zero()) << what << ": counters left set";
      }
    }
  }
}

// The FP8 mode (E4M3 rows): the fused kernel's rebase units write L2's rows and factors from
// L1's h_q / h_sf as the rebase launch between the chained GEMMs does; h_q, h_sf, h_fp8,
// h_factor and out bit for bit against launch_l1, launch_rebase_rows_e4m3, launch_l2 on the same
// tile, on the FP8 tiles the kernel is built for, with empty experts and experts over several n-tiles.
TEST(Sm90Mega, Fp8EqualsTheChainOnTheSameTileBitForBit) {
  MEGAMOE_REQUIRE_SM90();
  const SplitWorkspace split(4096, int64_t(4096) * 2048);
  MegaBuffers mega(kMaxRows, kMaxE);
  constexpr int64_t slack_rows = kMaxRows + sm90::kRowSlack;
  const std::vector<std::vector<int>> routings = {{1, 0, 1, 1, 0, 0, 1, 0},
                                                  {40, 0, 17, 1, 64, 33, 0, 2},
                                                  {200, 0, 130, 1, 181},
                                                  std::vector<int>(kMaxE, 3)};
  uint64_t seed = 4200;
  for (const auto& counts : routings) {
    const Problem p = make_problem(counts, seed);
    const int64_t rows = p.host_offsets.back();
    std::mt19937_64 rng(seed++);
    std::vector<uint8_t> act8(static_cast<size_t>(slack_rows * kH));
    for (auto& b : act8) {
      do b = static_cast<uint8_t>(rng()); while ((b & 0x7F) == 0x7F);  // finite E4M3 codes
    }
    std::vector<float> factor(static_cast<size_t>(slack_rows));
    for (float& f : factor) f = std::ldexp(1.0f, static_cast<int>(rng() % 6) - 3);
    const Buffer d_act8 = to_device(act8), d_factor = to_device(factor);
    Buffer w13_exp(int64_t(p.experts) * 2 * kI, Device::cuda()), w2_exp(int64_t(p.experts) * kH, Device::cuda());
    sm90::weight_row_exponents(p.w13_sf.as<uint8_t>(), p.experts, 2 * kI, kH, w13_exp.as<uint8_t>(), nullptr);
    sm90::weight_row_exponents(p.w2_sf.as<uint8_t>(), p.experts, kH, kI, w2_exp.as<uint8_t>(), nullptr);
    for (const char* tile : {"fp8_128x192_k2_async", "fp8_256x128_k2_staged"}) {
      const std::string what = std::string(tile) + " rows " + std::to_string(rows);
      struct Fp8Out {
        Outputs o;
        Buffer h8{slack_rows * kI, Device::cuda()}, hf{slack_rows * 4, Device::cuda()};
      } chain_out, mega_out;
      auto args = [&](Fp8Out& out) {
        Args a = make_args(p, out.o, tile, 1, 1, split.ws);
        set_fp8_mode(a, d_act8.as<uint8_t>(), d_factor.as<float>(), w13_exp.as<uint8_t>(),
                     out.h8.as<uint8_t>(), out.hf.as<float>(), w2_exp.as<uint8_t>());
        return a;
      };
      auto poison = [](Fp8Out& out) {
        out.o.poison();
        MEGAMOE_CUDA_CHECK(cudaMemset(out.h8.data(), 0x7E, out.h8.size()));
        MEGAMOE_CUDA_CHECK(cudaMemset(out.hf.data(), 0x7F, out.hf.size()));
      };
      poison(chain_out);
      const Args chain = args(chain_out);
      sm90::launch_l1(chain.l1, nullptr);
      sm90::launch_rebase_rows_e4m3(chain.l1.h_q, chain.l1.h_sf, p.offsets.as<int32_t>(), nullptr,
                                    p.experts, 0, kI, kMaxRows, chain_out.h8.as<uint8_t>(),
                                    chain_out.hf.as<float>(), nullptr);
      sm90::launch_l2(chain.l2, nullptr);
      MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
      for (int call = 0; call < 2; ++call) {
        const std::string at = what + " call " + std::to_string(call);
        poison(mega_out);
        const Args fused = args(mega_out);
        ASSERT_TRUE(sm90::launch_mega(fused.l1, fused.l2, mega.ws, nullptr)) << at;
        MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
        EXPECT_EQ(to_host<uint8_t>(mega_out.o.h_q, rows * kI), to_host<uint8_t>(chain_out.o.h_q, rows * kI)) << at << ": h_q";
        EXPECT_EQ(to_host<uint8_t>(mega_out.o.h_sf, rows * kI / 32), to_host<uint8_t>(chain_out.o.h_sf, rows * kI / 32)) << at << ": h_sf";
        EXPECT_EQ(to_host<uint8_t>(mega_out.h8, rows * kI), to_host<uint8_t>(chain_out.h8, rows * kI)) << at << ": h_fp8";
        EXPECT_EQ(to_host<float>(mega_out.hf, rows), to_host<float>(chain_out.hf, rows)) << at << ": h_factor";
        EXPECT_EQ(to_host<uint16_t>(mega_out.o.out, rows * kH), to_host<uint16_t>(chain_out.o.out, rows * kH)) << at << ": out";
        EXPECT_TRUE(mega.all_zero()) << at << ": counters left set";
      }
    }
  }
}

// The dispatch inside the launch (expert parallelism; sm90::MegaGather): received token rows
// (E4M3 codes, UE8M0 scales) of R * T_max tokens, each routed row naming its token place in
// row_slot, arrival words set to the call number, and the window's state (call number, error
// record) in device memory.
struct Received {
  static constexpr int kTopK = 4, kTMax = 64, kRanks = 4;
  static constexpr int64_t kTokens = int64_t{kRanks} * kTMax;
  Buffer x_q, x_sf, row_slot, flags, local;
  std::vector<uint64_t> host_flags;
  Received(int64_t rows, uint64_t call, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<uint8_t> q(static_cast<size_t>(kTokens * kH)), sf(static_cast<size_t>(kTokens * kH / 32));
    for (auto& b : q) {
      do b = static_cast<uint8_t>(rng()); while ((b & 0x7F) == 0x7F);  // finite E4M3 codes
    }
    for (auto& b : sf) b = static_cast<uint8_t>(120 + rng() % 12);
    std::vector<int32_t> slots(static_cast<size_t>(kMaxRows), 0);
    for (int64_t r = 0; r < rows; ++r) slots[r] = static_cast<int32_t>(rng() % (kTokens * kTopK));
    host_flags.assign(static_cast<size_t>(kTokens), call);
    x_q = to_device(q);
    x_sf = to_device(sf);
    row_slot = to_device(slots);
    flags = to_device(host_flags);
    ep::EpLocal state{};
    state.dispatched = call;
    local = Buffer(sizeof state, Device::cuda());
    MEGAMOE_CUDA_CHECK(cudaMemcpy(local.data(), &state, sizeof state, cudaMemcpyHostToDevice));
  }
  sm90::MegaGather gather(uint64_t timeout_ns = 2'000'000'000ull) {
    sm90::MegaGather g;
    g.x_q = x_q.as<uint8_t>();
    g.x_sf = x_sf.as<uint8_t>();
    g.row_slot = row_slot.as<int32_t>();
    g.top_k = kTopK;
    g.arrival.flags = flags.as<uint64_t>();
    g.arrival.local = static_cast<ep::EpLocal*>(local.data());
    g.arrival.timeout_ns = timeout_ns;
    g.arrival.t_max = kTMax;
    return g;
  }
  ep::EpLocal state() const {
    ep::EpLocal s{};
    MEGAMOE_CUDA_CHECK(cudaMemcpy(&s, local.data(), sizeof s, cudaMemcpyDeviceToHost));
    return s;
  }
};

// The gather units write L1's B rows from the received rows as the gather launch (exact mode) or
// the rebase launch (FP8 mode) does, so every output equals gather (or rebase) + L1 + L2 (+ the
// rebase of h) on the same tile bit for bit; counters left zero, no error recorded.
TEST(Sm90Mega, GatherInsideEqualsTheGatherLaunchBitForBit) {
  MEGAMOE_REQUIRE_SM90();
  const SplitWorkspace split(4096, int64_t(4096) * sm90::kMaxKSplits * 2048);
  MegaBuffers mega(kMaxRows, kMaxE);
  constexpr int64_t slack_rows = kMaxRows + sm90::kRowSlack;
  const std::vector<std::vector<int>> routings = {{1, 0, 1, 1, 0, 0, 1, 0},
                                                  {40, 0, 17, 1, 64, 33, 0, 2},
                                                  {200, 0, 130, 1, 181}};
  struct Case {
    const char* tile;
    int splits;
    bool fp8;
  };
  const Case cases[] = {{"decode_128x16_k2_warp", 0, false}, {"decode_128x8_k4_warp_splitk", 2, false},
                        {"prefill_128x192_async", 0, false}, {"prefill_256x64_k2_async", 0, false},
                        {"prefill_256x128_k2_staged", 0, false}, {"fp8_128x192_k2_async", 0, true},
                        {"fp8_256x128_k2_staged", 0, true}};
  uint64_t seed = 4300;
  for (const auto& counts : routings) {
    const Problem p = make_problem(counts, seed);
    const int64_t rows = p.host_offsets.back();
    Received rx(rows, 7, seed++);
    Buffer w13_exp(int64_t(p.experts) * 2 * kI, Device::cuda()), w2_exp(int64_t(p.experts) * kH, Device::cuda());
    sm90::weight_row_exponents(p.w13_sf.as<uint8_t>(), p.experts, 2 * kI, kH, w13_exp.as<uint8_t>(), nullptr);
    sm90::weight_row_exponents(p.w2_sf.as<uint8_t>(), p.experts, kH, kI, w2_exp.as<uint8_t>(), nullptr);
    for (const Case& c : cases) {
      const std::string what = std::string(c.tile) + " rows " + std::to_string(rows);
      struct Run {
        Outputs o;
        Buffer act{slack_rows * kH * 2, Device::cuda()};
        Buffer act8{slack_rows * kH, Device::cuda()}, act_f{slack_rows * 4, Device::cuda()};
        Buffer h8{slack_rows * kI, Device::cuda()}, hf{slack_rows * 4, Device::cuda()};
        void poison() {
          o.poison();
          for (Buffer* b : {&act, &act8, &act_f, &h8, &hf})
            MEGAMOE_CUDA_CHECK(cudaMemset(b->data(), 0x7E, b->size()));
        }
      } chain_run, mega_run;
      auto args = [&](Run& run, int splits) {
        Args a = make_args(p, run.o, c.tile, splits, splits, split.ws);
        a.l1.act = run.act.as<uint16_t>();
        if (c.fp8) {
          set_fp8_mode(a, run.act8.as<uint8_t>(), run.act_f.as<float>(), w13_exp.as<uint8_t>(),
                       run.h8.as<uint8_t>(), run.hf.as<float>(), w2_exp.as<uint8_t>());
        }
        return a;
      };
      chain_run.poison();
      const Args chain = args(chain_run, std::max(c.splits, 1));
      if (c.fp8) {
        sm90::launch_rebase_rows_e4m3(rx.x_q.as<uint8_t>(), rx.x_sf.as<uint8_t>(), p.offsets.as<int32_t>(),
                                      rx.row_slot.as<int32_t>(), p.experts, Received::kTopK, kH, kMaxRows,
                                      chain_run.act8.as<uint8_t>(), chain_run.act_f.as<float>(), nullptr);
        sm90::launch_l1(chain.l1, nullptr);
        sm90::launch_rebase_rows_e4m3(chain.l1.h_q, chain.l1.h_sf, p.offsets.as<int32_t>(), nullptr,
                                      p.experts, 0, kI, kMaxRows, chain_run.h8.as<uint8_t>(),
                                      chain_run.hf.as<float>(), nullptr);
      } else {
        sm90::launch_gather(rx.x_q.as<uint8_t>(), rx.x_sf.as<uint8_t>(), p.offsets.as<int32_t>(),
                            rx.row_slot.as<int32_t>(), p.experts, Received::kTopK, kH, kMaxRows,
                            chain_run.act.as<uint16_t>(), nullptr);
        sm90::launch_l1(chain.l1, nullptr);
      }
      sm90::launch_l2(chain.l2, nullptr);
      MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
      for (int call = 0; call < 2; ++call) {
        const std::string at = what + " call " + std::to_string(call);
        mega_run.poison();
        const Args fused = args(mega_run, c.splits);
        const sm90::MegaGather g = rx.gather();
        ASSERT_TRUE(sm90::launch_mega(fused.l1, fused.l2, mega.ws, nullptr, &g)) << at;
        MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
        if (c.fp8) {
          EXPECT_EQ(to_host<uint8_t>(mega_run.act8, rows * kH), to_host<uint8_t>(chain_run.act8, rows * kH)) << at << ": act_fp8";
          EXPECT_EQ(to_host<float>(mega_run.act_f, rows), to_host<float>(chain_run.act_f, rows)) << at << ": act_factor";
          EXPECT_EQ(to_host<uint8_t>(mega_run.h8, rows * kI), to_host<uint8_t>(chain_run.h8, rows * kI)) << at << ": h_fp8";
          EXPECT_EQ(to_host<uint8_t>(mega_run.o.h_q, rows * kI), to_host<uint8_t>(chain_run.o.h_q, rows * kI)) << at << ": h_q";
          EXPECT_EQ(to_host<uint16_t>(mega_run.o.out, rows * kH), to_host<uint16_t>(chain_run.o.out, rows * kH)) << at << ": out";
        } else {
          EXPECT_EQ(to_host<uint16_t>(mega_run.act, rows * kH), to_host<uint16_t>(chain_run.act, rows * kH)) << at << ": act";
          expect_equal(mega_run.o, chain_run.o, rows, at);
        }
        EXPECT_TRUE(mega.all_zero()) << at << ": counters left set";
        EXPECT_EQ(rx.state().status.code, 0) << at << ": an error was recorded";
      }
    }
  }
}

// Rows whose arrival words come while the kernel runs (the words in mapped host memory, written by
// this thread after the launch, in a shuffled order): the kernel is still waiting 30 ms after the
// launch, then completes with the outputs of the gather launch + GEMMs bit for bit and no error.
TEST(Sm90Mega, GatherWaitsForRowsThatArriveDuringTheLaunch) {
  MEGAMOE_REQUIRE_SM90();
  const SplitWorkspace split(4096, int64_t(4096) * 2048);
  MegaBuffers mega(kMaxRows, kMaxE);
  const Problem p = make_problem({40, 0, 17, 1, 64, 33, 0, 2}, 4500);
  const int64_t rows = p.host_offsets.back();
  Received rx(rows, 11, 4500);
  uint64_t* words = nullptr;
  MEGAMOE_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&words), Received::kTokens * 8,
                                   cudaHostAllocMapped));
  void* dev_words = nullptr;
  MEGAMOE_CUDA_CHECK(cudaHostGetDevicePointer(&dev_words, words, 0));
  std::vector<int64_t> order(static_cast<size_t>(Received::kTokens));
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(4501));
  for (const char* tile : {"decode_128x16_k2_warp", "prefill_256x128_k2_staged"}) {
    SCOPED_TRACE(tile);
    Outputs chain_out, mega_out;
    Buffer chain_act(int64_t{kMaxRows + sm90::kRowSlack} * kH * 2, Device::cuda());
    Buffer mega_act(chain_act.size(), Device::cuda());
    Args chain = make_args(p, chain_out, tile, 1, 1, split.ws);
    chain.l1.act = chain_act.as<uint16_t>();
    sm90::launch_gather(rx.x_q.as<uint8_t>(), rx.x_sf.as<uint8_t>(), p.offsets.as<int32_t>(),
                        rx.row_slot.as<int32_t>(), p.experts, Received::kTopK, kH, kMaxRows,
                        chain_act.as<uint16_t>(), nullptr);
    sm90::launch_l1(chain.l1, nullptr);
    sm90::launch_l2(chain.l2, nullptr);
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
    mega_out.poison();
    Args fused = make_args(p, mega_out, tile, 0, 0, split.ws);
    fused.l1.act = mega_act.as<uint16_t>();
    for (int64_t i = 0; i < Received::kTokens; ++i) words[i] = 10;  // the previous call's
    sm90::MegaGather g = rx.gather();
    g.arrival.flags = static_cast<const uint64_t*>(dev_words);
    const test::Stream stream;
    ASSERT_TRUE(sm90::launch_mega(fused.l1, fused.l2, mega.ws, stream, &g));
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    EXPECT_EQ(cudaStreamQuery(stream), cudaErrorNotReady) << "the kernel did not wait for the rows";
    for (int64_t token : order) {
      std::atomic_thread_fence(std::memory_order_seq_cst);
      reinterpret_cast<volatile uint64_t*>(words)[token] = 11;
    }
    MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_EQ(to_host<uint16_t>(mega_act, rows * kH), to_host<uint16_t>(chain_act, rows * kH)) << "act";
    expect_equal(mega_out, chain_out, rows, tile);
    EXPECT_TRUE(mega.all_zero()) << "counters left set";
    EXPECT_EQ(rx.state().status.code, 0) << "an error was recorded";
  }
  MEGAMOE_CUDA_CHECK(cudaFreeHost(words));
}

// A row whose arrival word never comes: the gather unit gives up after the timeout, records
// kTimeout in stage dispatch naming the source rank, marks the window broken, and the launch
// still completes (no hang, no trap), its counters left zero; the next launch on the broken
// window does not wait again.
TEST(Sm90Mega, GatherWaitTimesOutAndRecordsTheSource) {
  MEGAMOE_REQUIRE_SM90();
  const SplitWorkspace split(4096, int64_t(4096) * 2048);
  MegaBuffers mega(kMaxRows, kMaxE);
  const Problem p = make_problem({40, 0, 17, 1, 64, 33, 0, 2}, 4400);
  const int64_t rows = p.host_offsets.back();
  Received rx(rows, 9, 4400);
  const int32_t late_place = to_host<int32_t>(rx.row_slot, rows)[rows / 2];
  const int64_t late_token = late_place / Received::kTopK;
  rx.host_flags[late_token] = 8;  // the previous call's word
  MEGAMOE_CUDA_CHECK(cudaMemcpy(rx.flags.data(), rx.host_flags.data(), rx.host_flags.size() * 8,
                                cudaMemcpyHostToDevice));
  Outputs o;
  const Args a = make_args(p, o, "decode_128x16_k2_warp", 0, 0, split.ws);
  const sm90::MegaGather g = rx.gather(200'000'000);  // 200 ms
  for (int call = 0; call < 2; ++call) {
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_TRUE(sm90::launch_mega(a.l1, a.l2, mega.ws, nullptr, &g));
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (call == 0) {
      EXPECT_GT(s, 0.15) << "the first launch did not wait for the row";
      EXPECT_LT(s, 2.0) << "the first launch did not give up in time";
    } else {
      EXPECT_LT(s, 0.1) << "the launch on the broken window waited again";
    }
    const ep::EpLocal st = rx.state();
    EXPECT_EQ(st.status.code, static_cast<int32_t>(ep::StatusCode::kTimeout));
    EXPECT_EQ(st.status.stage, static_cast<int32_t>(ep::Stage::kDispatch));
    EXPECT_EQ(st.status.peer, late_token / Received::kTMax);
    EXPECT_EQ(st.status.expected, 9u);
    EXPECT_EQ(st.status.observed, 8u);
    EXPECT_EQ(st.broken, 1u);
    EXPECT_TRUE(mega.all_zero()) << "call " << call << ": counters left set";
  }
}

TEST(Sm90Mega, RefusalsNameWhatIsWrong) {
  MEGAMOE_REQUIRE_SM90();
  const SplitWorkspace split(64, 64 * 2048);
  const Problem p = make_problem({1, 1, 1, 1, 1, 1, 1, 1}, 4100);
  Outputs o;
  auto expect_error = [&](const Args& a, const sm90::MegaWorkspace& ws, const char* text) {
    try {
      (void)sm90::launch_mega(a.l1, a.l2, ws, nullptr);
      ADD_FAILURE() << "no error; expected one naming " << text;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  MegaBuffers mega(kMaxRows, kMaxE);
  // A tile that does not split, asked for parts.
  expect_error(make_args(p, o, "decode_128x16_k2_warp", 2, 1, split.ws), mega.ws, "runs unsplit");
  // Counters too small for the capacity.
  sm90::MegaWorkspace small = mega.ws;
  small.capacity = 3;
  expect_error(make_args(p, o, "decode_128x16_k2_warp", 0, 0, split.ws), small, "mega_counters");
  // No unit counter.
  sm90::SplitKWorkspace no_units = split.ws;
  no_units.unit_counter = nullptr;
  expect_error(make_args(p, o, "decode_128x16_k2_warp", 0, 0, no_units), mega.ws, "unit_counter");
  // The FP8 mode needs both GEMMs' E4M3 rows; a forced exact-mode tile with FP8 rows, and the
  // tiles the kernel is not built for, are chained: nothing launched.
  Args fp8 = make_args(p, o, "auto", 0, 0, split.ws);
  fp8.l1.act_fp8 = p.w13.as<uint8_t>();
  expect_error(fp8, mega.ws, "act_fp8 without h_fp8");
  fp8.l1.tile = sm90::parse_tile_request("prefill_256x128_k2_staged");
  fp8.l2.h_fp8 = p.w13.as<uint8_t>();
  EXPECT_FALSE(sm90::launch_mega(fp8.l1, fp8.l2, mega.ws, nullptr));
  const Args serial = make_args(p, o, "serial_256x128", 0, 0, split.ws);
  EXPECT_FALSE(sm90::launch_mega(serial.l1, serial.l2, mega.ws, nullptr));
}

}  // namespace
}  // namespace megamoe
