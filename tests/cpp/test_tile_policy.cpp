// The Hopper GEMM tile table and policy (kernels/sm90/sm90_tiles.hpp, src/moe/sm90_tile_policy.*):
// pure host code, so these run everywhere (the GPU tests run every tile against the reference).
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <sstream>
#include <string>

#include "megamoe/config.hpp"
#include "megamoe/error.hpp"
#include "moe/sm90_tile_policy.hpp"
#include "sm90/sm90_gemm_config.hpp"

namespace megamoe {
namespace {

using sm90::TileId;

constexpr int kH200Sms = 132;

TEST(TileTable, NamesAreUniqueAndParseBack) {
  std::set<std::string> names;
  for (int i = 0; i < sm90::kNumTiles; ++i) {
    const auto id = static_cast<TileId>(i);
    const sm90::TileConfig& t = sm90::tile_config(id);
    EXPECT_TRUE(names.insert(t.name).second) << t.name;
    const sm90::TileRequest r = sm90::parse_tile_request(t.name);
    EXPECT_EQ(r.mode, sm90::TileRequest::Mode::kForced);
    EXPECT_EQ(r.tile, id);
    EXPECT_EQ(sm90::to_string(r), t.name);
  }
  EXPECT_EQ(sm90::parse_tile_request("auto"), sm90::TileRequest::automatic());
  EXPECT_EQ(sm90::parse_tile_request("serial"), sm90::TileRequest::serial());
  try {
    (void)sm90::parse_tile_request("prefill_256x128");
    FAIL() << "an unknown tile name was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    const std::string what = e.what();
    EXPECT_NE(what.find("prefill_256x128"), std::string::npos) << what;         // names the input
    EXPECT_NE(what.find("prefill_256x128_k2_staged"), std::string::npos) << what;  // and the choices
  }
}

TEST(TileTable, PrintsEveryField) {
  std::ostringstream os;
  os << sm90::tile_config(TileId::kPrefill256x96K2Async2);
  EXPECT_EQ(os.str(),
            "prefill_256x96_k2_async2 {256 x 96 (n step 8), 2 math warpgroups x 2 m-blocks, "
            "3 stages x 2 k-blocks, 1 CTAs/SM, overlap mainloop, wgmma, async epilogue "
            "(2 warpgroups)}");
  std::ostringstream split;
  split << sm90::tile_config(TileId::kDecode128x16K2WarpSplitK);
  EXPECT_NE(split.str().find("warp-mma"), std::string::npos) << split.str();
  EXPECT_NE(split.str().find("split-K"), std::string::npos) << split.str();
  std::ostringstream fp8;
  fp8 << sm90::tile_config(TileId::kFp8Prefill128x192K2Async);
  EXPECT_NE(fp8.str().find("e4m3 operands (FP8 mode)"), std::string::npos) << fp8.str();
}

// What each tile asks of a launch: the serial tiles take any scale byte, the overlapped ones
// scale bytes < 128; K a multiple of 64 x k-blocks per stage, where a shallower sibling takes the
// rest (fit_k).
TEST(TileTable, TraitsAndSiblings) {
  for (TileId id : {TileId::kSerial64x8, TileId::kSerial64x16, TileId::kSerial256x128}) {
    EXPECT_FALSE(sm90::tile_config(id).needs_small_scales()) << id;
  }
  for (TileId id : {TileId::kDecode64x16, TileId::kDecode128x16K2WarpSplitK,
                    TileId::kPrefill256x128K2Staged, TileId::kPrefill128x192Async}) {
    EXPECT_TRUE(sm90::tile_config(id).needs_small_scales()) << id;
  }
  EXPECT_EQ(sm90::tile_config(TileId::kPrefill256x96K2Async2).k_multiple(), 128);
  EXPECT_EQ(sm90::tile_config(TileId::kDecode128x8K4Warp).k_multiple(), 256);
  EXPECT_EQ(sm90::fit_k(TileId::kDecode128x8K4Warp, 3584), TileId::kDecode128x8K4Warp);
  EXPECT_EQ(sm90::fit_k(TileId::kDecode128x8K4Warp, 2880 + 64), TileId::kDecode128x8K2Warp);
  EXPECT_EQ(sm90::fit_k(TileId::kDecode128x8K4Warp, 2880), TileId::kDecode128x8K1Warp);
  EXPECT_EQ(sm90::fit_k(TileId::kPrefill256x128K2Staged, 2880), TileId::kPrefill256x128K1Staged);
  EXPECT_EQ(sm90::fit_k(TileId::kPrefill256x96K2Async2, 2880), TileId::kPrefill256x96K2Async2)
      << "no sibling: the policy does not pick it for K % 128 != 0";
  EXPECT_EQ(sm90::fit_k(TileId::kDecode128x8K4WarpSplitK, 2880), TileId::kDecode128x8K4WarpSplitK)
      << "no sibling: the policy does not pick it for K % 256 != 0";
  EXPECT_EQ(sm90::tile_config(TileId::kDecode128x8K4WarpSplitK).split_unit_floats() * 2,
            sm90::tile_config(TileId::kDecode128x16K2WarpSplitK).split_unit_floats());
  for (int i = 0; i < sm90::kNumTiles; ++i) {  // every tile's constants and layout compile
    const auto id = static_cast<TileId>(i);
    EXPECT_EQ(sm90::tile_config(sm90::fit_k(id, 64 * 45)).k_multiple() == 64 ||
                  sm90::shallower_sibling(id) == id,
              true)
        << id;
  }
  // FP8 tiles: two k-blocks per stage (one 128-byte TMA box of E4M3), no small-scale premise.
  for (TileId id : {TileId::kFp8Prefill128x192K2Async, TileId::kFp8Prefill256x128K2Staged,
                    TileId::kFp8Prefill128x256K2Async}) {
    EXPECT_TRUE(sm90::tile_config(id).fp8()) << id;
    EXPECT_FALSE(sm90::tile_config(id).needs_small_scales()) << id;
    EXPECT_EQ(sm90::tile_config(id).k_multiple(), 128) << id;
  }
  EXPECT_EQ(sm90::GemmConfig<TileId::kFp8Prefill128x192K2Async>::kBoxesPerStage, 1);
  EXPECT_EQ(sm90::GemmConfig<TileId::kFp8Prefill128x192K2Async>::kSmemBBytes, 192 * 128);
  EXPECT_EQ(sm90::GemmConfig<TileId::kPrefill256x96K2Async2>::kSmemBBytes, 2 * 96 * 128);
  // The FP8 plan: 128 x 192 up to 192 rows per expert, 128 x 256 above; exactly one admits any
  // row count (the gates split the axis at one point).
  const sm90::Fp8Plan plan = sm90::plan_fp8_launches(7168);
  EXPECT_EQ(plan.launch[0].tile, TileId::kFp8Prefill128x192K2Async);
  EXPECT_EQ(plan.launch[1].tile, TileId::kFp8Prefill128x256K2Async);
  for (int64_t avg : {1, 100, 192, 193, 256, 5000}) {
    int admitted = 0;
    for (const sm90::Fp8Launch& l : plan.launch) {
      sm90::GemmParams p{};
      p.gate_min_avg = l.gate_min_avg;
      p.gate_max_avg = l.gate_max_avg;
      if (sm90::gate_admits(p, avg * 7, 7)) {
        ++admitted;
        EXPECT_EQ(l.tile, avg <= 192 ? TileId::kFp8Prefill128x192K2Async
                                     : TileId::kFp8Prefill128x256K2Async) << avg;
      }
    }
    EXPECT_EQ(admitted, 1) << avg;
  }
  EXPECT_THROW(sm90::plan_fp8_launches(2880), Error);
  EXPECT_EQ(sm90::GemmConfig<TileId::kPrefill256x96K2Async2>::kThreads, 512);
  EXPECT_EQ(sm90::GemmConfig<TileId::kPrefill256x96K2Async2>::kMathRegs, 168);
  EXPECT_EQ(sm90::GemmConfig<TileId::kDecode128x8K4Warp>::kThreads, 160);
}

// The policy's tile for every shape and token count of targets.md (and Kimi-K3 on one EP8 rank),
// as the layer asks: an H200 (132 SMs), a unit counter and the layer's split-K workspace, scale
// bytes < 128, rows_hint = the rank's expected share of T*K, capacity 8192 tokens; with the
// number of gated launches of the plan for at most T rows per expert.
struct Point {
  const char* shape;
  int ep;
  int64_t tokens;
  int gemm;           // 1: L1 (M = 2I, K = H), 2: L2 (M = H, K = I)
  const char* tile;
  int k_splits;
  int launches;
};
constexpr Point kPoints[] = {
      {"kimi-k3", 1, 1, 1, "decode_128x8_k4_warp", 1, 1},
      {"kimi-k3", 1, 1, 2, "decode_128x8_k4_warp", 1, 1},
      {"kimi-k3", 1, 8, 1, "decode_128x8_k4_warp", 1, 1},
      {"kimi-k3", 1, 8, 2, "decode_128x8_k4_warp", 1, 1},
      {"kimi-k3", 1, 64, 1, "decode_128x8_k4_warp", 1, 3},
      {"kimi-k3", 1, 64, 2, "decode_128x8_k4_warp", 1, 3},
      {"kimi-k3", 1, 512, 1, "decode_128x16_k2_warp", 1, 2},
      {"kimi-k3", 1, 512, 2, "decode_128x16_k2_warp", 1, 2},
      {"kimi-k3", 1, 4096, 1, "prefill_256x96_k2_async2", 1, 1},
      {"kimi-k3", 1, 4096, 2, "prefill_256x96_k2_async2", 1, 1},
      {"kimi-k3", 1, 8192, 1, "prefill_128x192_async", 1, 1},
      {"kimi-k3", 1, 8192, 2, "prefill_128x192_async", 1, 1},
      {"kimi-k3", 8, 1, 1, "decode_128x8_k4_warp_splitk", 4, 1},
      {"kimi-k3", 8, 1, 2, "decode_128x8_k4_warp_splitk", 4, 1},
      {"kimi-k3", 8, 8, 1, "decode_128x8_k4_warp", 1, 1},
      {"kimi-k3", 8, 8, 2, "decode_128x8_k4_warp", 1, 1},
      {"kimi-k3", 8, 64, 1, "decode_128x8_k4_warp", 1, 3},
      {"kimi-k3", 8, 64, 2, "decode_128x8_k4_warp", 1, 3},
      {"kimi-k3", 8, 512, 1, "decode_128x16_k2_warp", 1, 2},
      {"kimi-k3", 8, 512, 2, "decode_128x16_k2_warp", 1, 2},
      {"kimi-k3", 8, 4096, 1, "prefill_256x96_k2_async2", 1, 1},
      {"kimi-k3", 8, 4096, 2, "prefill_256x96_k2_async2", 1, 1},
      {"kimi-k3", 8, 8192, 1, "prefill_128x192_async", 1, 1},
      {"kimi-k3", 8, 8192, 2, "prefill_128x192_async", 1, 1},
      {"deepseek-v3", 1, 1, 1, "decode_128x8_k4_warp_splitk", 2, 1},
      {"deepseek-v3", 1, 1, 2, "decode_128x8_k4_warp", 1, 1},
      {"deepseek-v3", 1, 8, 1, "decode_128x8_k4_warp", 1, 1},
      {"deepseek-v3", 1, 8, 2, "decode_128x8_k4_warp", 1, 1},
      {"deepseek-v3", 1, 64, 1, "decode_128x8_k4_warp", 1, 3},
      {"deepseek-v3", 1, 64, 2, "decode_128x8_k4_warp", 1, 3},
      {"deepseek-v3", 1, 512, 1, "prefill_256x64_k2_async", 1, 1},
      {"deepseek-v3", 1, 512, 2, "prefill_256x64_k2_async", 1, 1},
      {"deepseek-v3", 1, 4096, 1, "prefill_128x192_async", 1, 1},
      {"deepseek-v3", 1, 4096, 2, "prefill_128x192_async", 1, 1},
      {"deepseek-v3", 1, 8192, 1, "prefill_256x128_k2_staged", 1, 1},
      {"deepseek-v3", 1, 8192, 2, "prefill_256x128_k2_staged", 1, 1},
      {"gpt-oss-120b", 1, 1, 1, "decode_128x16_k1_warp_splitk", 2, 1},
      {"gpt-oss-120b", 1, 1, 2, "decode_128x16_k1_warp_splitk", 4, 1},
      {"gpt-oss-120b", 1, 8, 1, "decode_128x8_k1_warp", 1, 1},
      {"gpt-oss-120b", 1, 8, 2, "decode_128x8_k1_warp", 1, 1},
      {"gpt-oss-120b", 1, 64, 1, "decode_128x8_k1_warp", 1, 3},
      {"gpt-oss-120b", 1, 64, 2, "decode_128x8_k1_warp", 1, 3},
      {"gpt-oss-120b", 1, 512, 1, "prefill_256x128_k1_staged", 1, 1},
      {"gpt-oss-120b", 1, 512, 2, "prefill_256x128_k1_staged", 1, 1},
      {"gpt-oss-120b", 1, 4096, 1, "prefill_128x192_async", 1, 1},
      {"gpt-oss-120b", 1, 4096, 2, "prefill_128x192_async", 1, 1},
      {"gpt-oss-120b", 1, 8192, 1, "prefill_256x128_k1_staged", 1, 1},
      {"gpt-oss-120b", 1, 8192, 2, "prefill_256x128_k1_staged", 1, 1},
      {"small", 1, 1, 1, "decode_128x8_k4_warp_splitk", 4, 1},
      {"small", 1, 1, 2, "decode_128x8_k4_warp_splitk", 2, 1},
      {"small", 1, 8, 1, "decode_128x8_k4_warp_splitk", 2, 1},
      {"small", 1, 8, 2, "decode_128x8_k4_warp_splitk", 2, 1},
      {"small", 1, 64, 1, "decode_128x16_k2_warp_splitk", 2, 2},
      {"small", 1, 64, 2, "decode_128x16_k2_warp_splitk", 2, 2},
      {"small", 1, 512, 1, "prefill_256x96_k2_async2", 1, 1},
      {"small", 1, 512, 2, "prefill_256x96_k2_async2", 1, 1},
      {"small", 1, 4096, 1, "prefill_256x128_k2_staged", 1, 1},
      {"small", 1, 4096, 2, "prefill_256x128_k2_staged", 1, 1},
      {"small", 1, 8192, 1, "prefill_256x128_k2_staged", 1, 1},
      {"small", 1, 8192, 2, "prefill_256x128_k2_staged", 1, 1},
};

TEST(TilePolicy, NamesTheTileForEveryShapeAndTokenCount) {
  for (const Point& pt : kPoints) {
    const LayerShape s = shape_preset(pt.shape);
    const int64_t slots = pt.tokens * s.top_k, e_l = s.num_experts / pt.ep;
    const int64_t hint =
        pt.ep <= 1 ? slots : std::max<int64_t>(1, (slots * e_l + s.num_experts - 1) / s.num_experts);
    const int64_t max_rows = 8192 * s.top_k;
    sm90::TileQuery q;
    q.rows_hint = hint;
    q.max_rows = max_rows;
    q.num_experts = static_cast<int>(e_l);
    q.m_rows = pt.gemm == 1 ? 2 * s.intermediate : s.hidden;
    q.k = pt.gemm == 1 ? s.hidden : s.intermediate;
    q.sm_count = kH200Sms;
    q.small_scales = true;
    q.unit_counter = true;
    q.split_allowed = true;
    q.split_counters_capacity = sm90::split_k_counters_for(kH200Sms);
    q.split_partial_floats = sm90::split_k_partial_floats_for(kH200Sms);
    const sm90::TileChoice c = sm90::choose_tile(q);
    const std::string where = std::string(pt.shape) + " EP" + std::to_string(pt.ep) + " T=" +
                              std::to_string(pt.tokens) + " L" + std::to_string(pt.gemm);
    EXPECT_STREQ(sm90::tile_config(c.tile).name, pt.tile) << where << ": " << c.reason;
    EXPECT_EQ(c.k_splits, pt.k_splits) << where;
    EXPECT_NE(std::string(c.reason), "") << where;
    EXPECT_EQ(q.k % sm90::tile_config(c.tile).k_multiple(), 0) << where;
    EXPECT_EQ(sm90::plan_launches(hint, pt.tokens, static_cast<int>(e_l), max_rows).count, pt.launches)
        << where;
  }
}

// Weights with a scale byte >= 128, or the serial request: the serial tiles only, by rows per
// expert (<= 4, <= 16, more).
TEST(TilePolicy, SerialTilesForLargeScalesOrOnRequest) {
  for (bool serial_only : {false, true}) {
    sm90::TileQuery q;
    q.max_rows = 131072;
    q.num_experts = 256;
    q.m_rows = 4096;
    q.k = 7168;
    q.sm_count = kH200Sms;
    q.small_scales = serial_only;
    q.serial_only = serial_only;
    q.unit_counter = true;
    const std::pair<int64_t, TileId> cases[] = {{8, TileId::kSerial64x8},
                                                {256 * 4, TileId::kSerial64x8},
                                                {256 * 16, TileId::kSerial64x16},
                                                {256 * 17, TileId::kSerial256x128},
                                                {65536, TileId::kSerial256x128}};
    for (const auto& [rows, tile] : cases) {
      q.rows_hint = rows;
      EXPECT_EQ(sm90::choose_tile(q).tile, tile) << rows << " rows, serial_only " << serial_only;
    }
  }
}

// Without a split-K workspace or unit counter (a caller of launch_l1 / launch_l2 that passes
// none), the decode picks change the way the policy says: no split, the static split's 3-CTA tile.
TEST(TilePolicy, DecodeWithoutWorkspace) {
  sm90::TileQuery q;
  q.rows_hint = 8;  // DeepSeek-V3 L1 at T = 1
  q.max_rows = 65536;
  q.num_experts = 256;
  q.m_rows = 4096;
  q.k = 7168;
  q.sm_count = kH200Sms;
  q.small_scales = true;
  EXPECT_EQ(sm90::choose_tile(q).tile, TileId::kDecode64x16);  // 256 tiles < 3/4 of 528 slots
  q.rows_hint = 16;  // Kimi-K3 L1 at T = 1 (16 experts x 48 = 768 tiles)
  q.num_experts = 896;
  q.m_rows = 6144;
  q.k = 3584;
  EXPECT_EQ(sm90::choose_tile(q).tile, TileId::kDecode128x16K2Cta3);
  q.unit_counter = true;
  EXPECT_EQ(sm90::choose_tile(q).tile, TileId::kDecode128x8K4Warp);
}

// The MegaMoE kernel's policy (choose_mega_tile): exact-mode calls with small scales; decode
// classes on the decode tile that takes both K, prefill on L1's own tile where it takes both K;
// everything else chained.
// L1's query of a layer call on one H200 (small scales, a unit counter, no split workspace), for
// the MegaMoE kernel's policy: `tokens` of `shape` on one GPU, a capacity of max_tokens.
sm90::TileQuery mega_query(const char* shape, int64_t tokens, int64_t max_tokens = 8192) {
  const LayerShape s = shape_preset(shape);
  sm90::TileQuery q;
  q.rows_hint = tokens * s.top_k;
  q.max_rows = max_tokens * s.top_k;
  q.num_experts = static_cast<int>(s.num_experts);
  q.m_rows = 2 * s.intermediate;
  q.k = s.hidden;
  q.sm_count = kH200Sms;
  q.small_scales = true;
  q.unit_counter = true;
  return q;
}

TEST(TilePolicy, MegaKernelTakesDecodeAndPrefillCalls) {
  const auto query = [](const char* shape, int64_t tokens) { return mega_query(shape, tokens); };
  const auto automatic = sm90::TileRequest::automatic();
  struct Case {
    const char* shape;
    int64_t tokens;
    bool fused;
    TileId tile;
  };
  for (const Case& c : {Case{"kimi-k3", 1, true, TileId::kDecode128x8K4Warp},
                        Case{"kimi-k3", 64, true, TileId::kDecode128x8K4Warp},
                        Case{"kimi-k3", 512, true, TileId::kDecode128x16K2Warp},
                        Case{"kimi-k3", 4096, false, TileId::kPrefill256x96K2Async2},
                        Case{"kimi-k3", 8192, false, TileId::kPrefill128x192Async},
                        Case{"deepseek-v3", 1, true, TileId::kDecode128x8K4Warp},
                        Case{"deepseek-v3", 64, true, TileId::kDecode128x8K4Warp},
                        // the asynchronous prefill tiles: chained unless forced
                        Case{"deepseek-v3", 512, false, TileId::kPrefill256x64K2Async},
                        Case{"deepseek-v3", 4096, false, TileId::kPrefill128x192Async},
                        Case{"deepseek-v3", 8192, true, TileId::kPrefill256x128K2Staged},
                        // H = 2880 = 45 x 64: the k1 sibling takes it (T = 2: 8 rows; T = 1
                        // has 4, fewer than the fused kernel's 8)
                        Case{"gpt-oss-120b", 1, false, TileId::kDecode128x8K1Warp},
                        Case{"gpt-oss-120b", 2, true, TileId::kDecode128x8K1Warp},
                        // and the k1 staged tile at prefill (no two-k-block tile takes 2880)
                        Case{"gpt-oss-120b", 2048, true, TileId::kPrefill256x128K1Staged}}) {
    const LayerShape s = shape_preset(c.shape);
    const sm90::MegaChoice m = sm90::choose_mega_tile(query(c.shape, c.tokens), s.intermediate, true, automatic);
    EXPECT_EQ(m.fused, c.fused) << c.shape << " T=" << c.tokens;
    if (m.fused) EXPECT_EQ(m.tile, c.tile) << c.shape << " T=" << c.tokens << ": " << m.reason;
  }
  const sm90::TileQuery q = query("deepseek-v3", 1);
  EXPECT_FALSE(sm90::choose_mega_tile(q, 2048, false, automatic).fused) << "large L2 scales";
  sm90::TileQuery large = q;
  large.small_scales = false;
  EXPECT_FALSE(sm90::choose_mega_tile(large, 2048, true, automatic).fused) << "large L1 scales";
  EXPECT_FALSE(sm90::choose_mega_tile(q, 2048, true, sm90::TileRequest::serial()).fused);
  const auto forced = [&](TileId id) { return sm90::choose_mega_tile(q, 2048, true, sm90::TileRequest::forced(id)); };
  EXPECT_TRUE(forced(TileId::kDecode128x16K1Warp).fused);
  EXPECT_EQ(forced(TileId::kDecode128x16K1Warp).tile, TileId::kDecode128x16K1Warp);
  EXPECT_TRUE(forced(TileId::kPrefill256x128K2Staged).fused);
  EXPECT_TRUE(forced(TileId::kPrefill128x192Async).fused) << "built: runs when forced";
  EXPECT_FALSE(forced(TileId::kSerial256x128).fused) << "not built for the MegaMoE kernel";
  EXPECT_FALSE(forced(TileId::kPrefill256x96K2Async2).fused) << "not built for the MegaMoE kernel";
  EXPECT_FALSE(forced(TileId::kFp8Prefill128x192K2Async).fused) << "FP8 tiles: chained";
  EXPECT_TRUE(forced(TileId::kDecode128x16K2WarpSplitK).fused);
  EXPECT_EQ(forced(TileId::kDecode128x16K2WarpSplitK).l1_splits, 1) << "a forced tile runs unsplit";
  // With the fused kernel's split workspace, L1 is split where its tiles alone leave CTA slots
  // idle (deepseek-v3 T = 1: 8 experts x 32 m-tiles on 528 slots), as the chained decode launch
  // would.
  sm90::TileQuery split = q;
  split.split_allowed = true;
  split.split_counters_capacity = sm90::mega_split_counters(kH200Sms);
  split.split_partial_floats = sm90::mega_split_partial_floats(kH200Sms);
  const sm90::MegaChoice ds1 = sm90::choose_mega_tile(split, 2048, true, automatic);
  EXPECT_TRUE(ds1.fused);
  EXPECT_EQ(ds1.tile, TileId::kDecode128x8K4WarpSplitK) << ds1.reason;
  EXPECT_EQ(ds1.l1_splits, 2);
  EXPECT_EQ(ds1.l2_splits, 1) << "448 L2 tiles on 528 slots: unsplit";
  // Fewer than 8 estimated rows: chained (one EP8 rank's share at T = 1 and 2 measured slower
  // fused, tuning log v31), also where the split tiles would fill the slots.
  sm90::TileQuery ep8 = query("kimi-k3", 1);
  ep8.num_experts = 112;
  ep8.split_allowed = true;
  ep8.split_counters_capacity = split.split_counters_capacity;
  ep8.split_partial_floats = split.split_partial_floats;
  const int64_t kimi_i = shape_preset("kimi-k3").intermediate;
  for (int64_t rows : {1, 2, 4, 7}) {
    ep8.rows_hint = rows;
    EXPECT_FALSE(sm90::choose_mega_tile(ep8, kimi_i, true, automatic).fused) << rows << " rows";
  }
  // The rows of the launch, not rows per expert times experts: 9 rows over 5 experts are fused.
  sm90::TileQuery five = ep8;
  five.num_experts = 5;
  five.rows_hint = 9;
  EXPECT_TRUE(sm90::choose_mega_tile(five, kimi_i, true, automatic).fused);
  // From 8 rows (one Kimi-K3 EP8 rank at T = 4: 8 of its 112 experts): 384 L1 tiles fill the
  // slots, 224 L2 tiles leave half of them idle: L2 in 2 parts, as its chained launch would be;
  // with a workspace that does not hold them, unsplit.
  ep8.rows_hint = 8;
  const sm90::MegaChoice k8 = sm90::choose_mega_tile(ep8, kimi_i, true, automatic);
  EXPECT_TRUE(k8.fused);
  EXPECT_EQ(k8.tile, TileId::kDecode128x8K4WarpSplitK) << k8.reason;
  EXPECT_EQ(k8.l1_splits, 1);
  EXPECT_EQ(k8.l2_splits, 2);
  ep8.split_partial_floats = (384 + 224) * sm90::tile_config(TileId::kDecode128x8K4WarpSplitK).split_unit_floats();
  const sm90::MegaChoice k8_small = sm90::choose_mega_tile(ep8, kimi_i, true, automatic);
  EXPECT_EQ(k8_small.tile, TileId::kDecode128x8K4Warp) << k8_small.reason;
  EXPECT_EQ(k8_small.l2_splits, 1);
  // The kernel needs a counter for every tile of both GEMMs: with fewer, nothing is split (the
  // chained launches' workspace, 264 counters, against deepseek-v3 T = 1's 256 + 448 tiles).
  sm90::TileQuery few_counters = split;
  few_counters.split_counters_capacity = sm90::split_k_counters_for(kH200Sms);
  const sm90::MegaChoice unsplit = sm90::choose_mega_tile(few_counters, 2048, true, automatic);
  EXPECT_EQ(unsplit.l1_splits, 1) << unsplit.reason;
  EXPECT_EQ(unsplit.l2_splits, 1);
  // The 8-row split tile takes only K that are multiples of 256 (both GEMMs' where one tile runs
  // both); otherwise the 16-row split tile's sibling.
  sm90::TileQuery gpt1 = query("gpt-oss-120b", 2);  // 8 rows: 184 L2 tiles, L2 in 2 parts
  gpt1.split_allowed = true;
  gpt1.split_counters_capacity = split.split_counters_capacity;
  gpt1.split_partial_floats = split.split_partial_floats;
  const sm90::MegaChoice g1 = sm90::choose_mega_tile(gpt1, shape_preset("gpt-oss-120b").intermediate, true, automatic);
  EXPECT_EQ(g1.tile, TileId::kDecode128x16K1WarpSplitK) << g1.reason;
  EXPECT_EQ(sm90::choose_mega_tile(split, 2048 + 128, true, automatic).tile, TileId::kDecode128x16K2WarpSplitK)
      << "I = 2176 is not a multiple of 256";
  sm90::TileQuery kimi1 = query("kimi-k3", 1);  // 16 x 48 L1 tiles fill the slots: unsplit
  kimi1.split_allowed = true;
  kimi1.split_counters_capacity = split.split_counters_capacity;
  kimi1.split_partial_floats = split.split_partial_floats;
  EXPECT_EQ(sm90::choose_mega_tile(kimi1, shape_preset("kimi-k3").intermediate, true, automatic).l1_splits, 1);
  EXPECT_FALSE(sm90::choose_mega_tile(q, 2880, true, sm90::TileRequest::forced(TileId::kDecode128x8K4Warp)).fused)
      << "a forced tile that does not take I";
  for (TileId id : sm90::kMegaTiles) EXPECT_TRUE(sm90::tile_config(id).mega_kernel()) << id;
}

// The FP8 mode's calls in the MegaMoE kernel (choose_mega_fp8_tile): chained by the policy (128 x
// 192 measured slower fused; 128 x 256 above 192 rows per expert is not built fused); a forced
// FP8 tile the kernel is built for runs fused, an exact-mode one (or 128 x 256) is chained, and
// the exact mode's policy never fuses an FP8 tile.
TEST(TilePolicy, MegaKernelTakesFp8Calls) {
  const auto query = [](const char* shape, int64_t tokens) { return mega_query(shape, tokens, 16384); };
  const auto automatic = sm90::TileRequest::automatic();
  struct Case {
    const char* shape;
    int64_t tokens;
    bool fused;
  };
  // Rows per expert: kimi-k3 73 / 146 / 293, deepseek-v3 128 / 256.
  for (const Case& c : {Case{"kimi-k3", 4096, false}, Case{"kimi-k3", 8192, false},
                        Case{"kimi-k3", 16384, false}, Case{"deepseek-v3", 4096, false},
                        Case{"deepseek-v3", 8192, false}}) {
    const LayerShape s = shape_preset(c.shape);
    const sm90::MegaChoice m = sm90::choose_mega_fp8_tile(query(c.shape, c.tokens), s.intermediate, automatic);
    EXPECT_EQ(m.fused, c.fused) << c.shape << " T=" << c.tokens << ": " << m.reason;
    if (m.fused) EXPECT_EQ(m.tile, TileId::kFp8Prefill128x192K2Async) << c.shape << " T=" << c.tokens;
  }
  const sm90::TileQuery q = query("deepseek-v3", 8192);
  const auto fp8_forced = [&](TileId id) { return sm90::choose_mega_fp8_tile(q, 2048, sm90::TileRequest::forced(id)); };
  EXPECT_TRUE(fp8_forced(TileId::kFp8Prefill256x128K2Staged).fused);
  EXPECT_EQ(fp8_forced(TileId::kFp8Prefill256x128K2Staged).tile, TileId::kFp8Prefill256x128K2Staged);
  EXPECT_TRUE(fp8_forced(TileId::kFp8Prefill128x192K2Async).fused);
  EXPECT_FALSE(fp8_forced(TileId::kFp8Prefill128x256K2Async).fused) << "not built fused";
  EXPECT_FALSE(fp8_forced(TileId::kPrefill256x128K2Staged).fused) << "an exact-mode tile";
  EXPECT_FALSE(sm90::choose_mega_tile(q, 2048, true, sm90::TileRequest::forced(TileId::kFp8Prefill256x128K2Staged)).fused)
      << "an FP8 tile in the exact mode";
}

TEST(LayerOptions, TileAndRowsHintAreValidated) {
  LayerConfig c;
  c.shape = shape_preset("small");
  c.validate();
  c.sm90.gemm_tile = "decode_128x16_k2_warp";
  c.validate();
  c.sm90.gemm_tile = "decode_128x16";
  EXPECT_THROW(c.validate(), Error);
  c.sm90.gemm_tile = "fp8_128x192_k2_async";  // an FP8-mode tile: the layer runs the exact mode
  try {
    c.validate();
    ADD_FAILURE() << "an FP8-mode tile was accepted for an exact-mode layer";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("FP8-mode tile"), std::string::npos) << e.what();
  }
  c.precision = Precision::kFp8;  // forced on the FP8 mode's calls
  c.validate();
  EXPECT_EQ(parse_rows_hint_mode("bound"), RowsHintMode::kBound);
  EXPECT_STREQ(to_string(RowsHintMode::kExpected), "expected");
  EXPECT_THROW(parse_rows_hint_mode("upper"), Error);
}

// The plan of gated launches (host only, runs without a GPU): the launches' intervals of rows per
// hit expert cover every average exactly once (else a routing would run no launch, or two), the
// plan is ungated where no prefill tile is possible, and the first launch keeps the estimate.
TEST(TilePolicy, GatedIntervalsCoverEveryAverageOnce) {
  struct Case { int64_t hint, per_expert_max; int experts; int64_t max_rows; };
  const Case cases[] = {
      {128, 8, 896, 131072},       // Kimi-K3 T = 8: no prefill tile possible, ungated
      {128, 64, 112, 131072},      // EP8 rank, T = 64: 128 x 8 .. prefill
      {1024, 64, 112, 131072},     // the former bound: 128 x 16 .. prefill
      {8192, 512, 112, 131072},    // prefill estimate: ungated
      {2, 1, 112, 131072},         // T = 1
      {16, 300, 8, 463},           // the GPU test above
      {0, 64, 112, 131072},        // no estimate: ungated
      {128, 0, 112, 131072}};      // no bound: ungated
  for (const Case& c : cases) {
    SCOPED_TRACE("hint " + std::to_string(c.hint) + " max " + std::to_string(c.per_expert_max) +
                 " E " + std::to_string(c.experts));
    const sm90::LaunchPlan plan = sm90::plan_launches(c.hint, c.per_expert_max, c.experts, c.max_rows);
    ASSERT_GE(plan.count, 1);
    ASSERT_LE(plan.count, 3);
    EXPECT_EQ(plan.launch[0].rows, plan.count == 1 ? c.hint : std::min(c.hint, c.max_rows));
    if (plan.count == 1) {
      EXPECT_EQ(plan.launch[0].gate_min_avg, 0);
      EXPECT_EQ(plan.launch[0].gate_max_avg, 0);
      EXPECT_TRUE(c.hint == 0 || c.per_expert_max <= 12 || c.hint / std::min<int64_t>(c.hint, c.experts) > 12);
      continue;
    }
    EXPECT_GT(c.per_expert_max, 12);  // gated only where a prefill tile is possible
    for (int64_t rows = 0; rows <= 400; ++rows) {
      for (int64_t hits : {int64_t{1}, int64_t{3}, int64_t{8}, int64_t{112}}) {
        if (rows == 0 && hits != 1) continue;
        const int64_t h = rows == 0 ? 0 : hits;
        int running = 0;
        for (int i = 0; i < plan.count; ++i) {
          sm90::GemmParams gate;
          gate.gate_min_avg = plan.launch[i].gate_min_avg;
          gate.gate_max_avg = plan.launch[i].gate_max_avg;
          running += sm90::gate_admits(gate, rows, static_cast<int>(h));
        }
        ASSERT_EQ(running, 1) << "rows " << rows << " over " << h << " hit experts";
      }
    }
  }
}

}  // namespace
}  // namespace megamoe
