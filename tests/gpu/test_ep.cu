// test_ep.cu: expert parallelism (megamoe/ep.hpp) with R virtual ranks on one GPU and with the
// NCCL transport at one rank: equality with the one-GPU layer, the error protocol (capacity,
// receive overflow, a rank that never arrives), CUDA-graph capture, per-expert row counts.
#include <chrono>
#include <string>

#include "ep_test_util.hpp"
#include "megamoe/error.hpp"
#include "megamoe/reference.hpp"
#include "moe/sm90_layer.hpp"

namespace megamoe::test {
namespace {

// A tile without split-K: every output element is summed in the same order whatever rows share
// its launch, so EP = R equals EP = 1 bit for bit (docs/design.md, "Expert parallelism").
constexpr const char* kFixedTile = "prefill_256x128_k2_staged";

LayerConfig ep_config(const char* shape, int64_t capacity, const char* tile = kFixedTile,
                      Precision precision = Precision::kExact, bool mega = false,
                      bool mega_dispatch = false, bool mega_combine = true) {
  LayerConfig c;
  c.shape = shape_preset(shape);
  c.activation = activation_preset(shape);
  c.max_tokens_per_rank = capacity;
  c.sm90.gemm_tile = tile;
  c.precision = precision;
  c.fp8_min_rows_per_expert = 0;  // with precision fp8: every call (one FP8 tile, no split-K)
  c.sm90.mega_kernel = mega;
  c.sm90.mega_dispatch = mega_dispatch;
  c.sm90.mega_combine = mega && mega_combine;
  return c;
}

// What a virtual rank's call of T tokens runs with the MegaMoE kernel on a forced tile: the
// dispatch inside where it sends with ep_send (T > 32), the combine inside (by its last CTA)
// where the call is small enough (sm90::mega_combine_inside).
std::string virtual_rank_kernels(const LayerConfig& c, int64_t t) {
  if (!c.sm90.mega_kernel) return "chain";
  std::string k = "mega";
  if (c.sm90.mega_dispatch && t > 32) k += "+dispatch";
  if (sm90::mega_combine_inside(c, t, true)) k += "+combine";
  return k;
}

int64_t count_mismatches(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
  return n;
}

std::string describe(const std::vector<int64_t>& tokens) {
  std::string s;
  for (int64_t t : tokens) s += (s.empty() ? "" : ",") + std::to_string(t);
  return s;
}

// Every rank's output equals the one-GPU layer's on the concatenated tokens, bit for bit, and
// the rows each rank's experts received match the routing.
void expect_equal_to_one_gpu(const char* shape, int ranks, const std::vector<int64_t>& tokens,
                             Routing routing, uint64_t seed, const char* tile = kFixedTile,
                             Precision precision = Precision::kExact, bool mega = false,
                             bool mega_dispatch = false, bool mega_combine = true) {
  const int64_t cap = *std::max_element(tokens.begin(), tokens.end());
  const LayerConfig c = ep_config(shape, std::max<int64_t>(cap, 1), tile, precision, mega,
                                  mega_dispatch, mega_combine);
  SCOPED_TRACE(std::string(shape) + " EP=" + std::to_string(ranks) + " T=" + describe(tokens) +
               " routing " + routing_name(routing) + " tile " + tile + " precision " +
               to_string(precision) + (mega ? " MegaMoE kernel" : "") +
               (mega_dispatch ? " with the dispatch inside" : "") +
               (mega && !mega_combine ? " without the combine inside" : ""));
  const EpInputs in = make_ep_inputs(c, tokens, routing, seed, 0.1);
  OneGpu one(c, in.total(), seed);
  const std::vector<uint16_t> expected = one.run(in);

  EpRanks ep(c, ranks, seed);
  ep.upload(in);
  for (int rep = 0; rep < 2; ++rep) {  // the second call reuses the windows (call counter 2)
    ep.forward();
    ep.sync();
    for (int r = 0; r < ranks; ++r) ASSERT_NO_THROW(ep.layer(r).check_errors(ep.stream(r)));
    if (mega) {  // (forced tiles: the policy fuses every call)
      for (int r = 0; r < ranks; ++r)
        EXPECT_EQ(ep.layer(r).last_call_kernels(), virtual_rank_kernels(c, tokens[r])) << "rank " << r;
    }
    const std::vector<uint16_t> y = ep.output();
    ASSERT_EQ(y.size(), expected.size());
    EXPECT_EQ(count_mismatches(y, expected), 0) << "call " << rep;
  }
  // Rows per local expert: every valid slot of every rank routed to it.
  const int64_t el = c.shape.num_experts / ranks;
  std::vector<int64_t> want(static_cast<size_t>(c.shape.num_experts), 0);
  for (int32_t id : in.all_idx)
    if (id >= 0) ++want[id];
  for (int r = 0; r < ranks; ++r) {
    const std::vector<int64_t> got = ep.layer(r).expert_rows(ep.stream(r));
    ASSERT_EQ(static_cast<int64_t>(got.size()), el);
    for (int64_t e = 0; e < el; ++e) EXPECT_EQ(got[e], want[r * el + e]) << "rank " << r << " expert " << e;
  }
}

TEST(Ep, VirtualRanksEqualOneGpuSmall) {
  MEGAMOE_REQUIRE_SM90();
  uint64_t seed = 900;
  for (Routing routing : {Routing::kUniform, Routing::kSkewed, Routing::kAdversarial}) {
    expect_equal_to_one_gpu("small", 2, {37, 64}, routing, seed++);
    expect_equal_to_one_gpu("small", 4, {5, 0, 64, 1}, routing, seed++);
    // 32: the largest call ep_dispatch quantizes and sends itself (ep::fused_send), 40 and 64
    // above it (the quantize and ep_send launches).
    expect_equal_to_one_gpu("small", 8, {16, 3, 0, 64, 32, 0, 1, 40}, routing, seed++);
  }
}

// The FP8 mode (docs/numerics.md): its one tile has no split-K, so EP = R equals EP = 1 bit for
// bit there too.
TEST(Ep, VirtualRanksFp8ModeEqualOneGpu) {
  MEGAMOE_REQUIRE_SM90();
  uint64_t seed = 1900;
  for (Routing routing : {Routing::kUniform, Routing::kSkewed, Routing::kAdversarial}) {
    expect_equal_to_one_gpu("small", 2, {37, 64}, routing, seed++, kFixedTile, Precision::kFp8);
    expect_equal_to_one_gpu("small", 8, {16, 3, 0, 64, 7, 0, 1, 40}, routing, seed++, kFixedTile,
                            Precision::kFp8);
  }
  expect_equal_to_one_gpu("deepseek-v3", 8, {33, 1, 0, 64, 8, 17, 64, 2}, Routing::kUniform, 1990,
                          kFixedTile, Precision::kFp8);
}

// The MegaMoE kernel (LayerConfig::sm90.mega_kernel) on every virtual rank and on the one GPU:
// R persistent kernels sharing the SMs, each taking its units at run time, equal EP = 1 bit for
// bit (issue 32's EP = 8 target).
TEST(Ep, VirtualRanksMegaKernelEqualOneGpu) {
  MEGAMOE_REQUIRE_SM90();
  uint64_t seed = 3500;
  for (Routing routing : {Routing::kUniform, Routing::kSkewed, Routing::kAdversarial}) {
    expect_equal_to_one_gpu("small", 2, {37, 64}, routing, seed++, "decode_128x16_k2_warp",
                            Precision::kExact, true);
    expect_equal_to_one_gpu("small", 8, {16, 3, 0, 64, 7, 0, 1, 40}, routing, seed++,
                            "decode_128x8_k4_warp", Precision::kExact, true);
  }
  expect_equal_to_one_gpu("deepseek-v3", 8, {1, 1, 0, 8, 8, 1, 64, 2}, Routing::kUniform, 3590,
                          "decode_128x8_k4_warp", Precision::kExact, true);
  expect_equal_to_one_gpu("kimi-k3", 8, {1, 1, 1, 1, 1, 1, 1, 1}, Routing::kUniform, 3591,
                          "decode_128x16_k2_warp", Precision::kExact, true);
  // The return and combine launches after the kernel (LayerConfig::sm90.mega_combine off).
  expect_equal_to_one_gpu("small", 8, {16, 3, 0, 64, 7, 0, 1, 40}, Routing::kSkewed, 3592,
                          "decode_128x8_k4_warp", Precision::kExact, true, false, false);
  // The prefill tiles (one CTA per SM with setmaxnreg, the asynchronous epilogue's warps
  // publishing L1 tiles): R kernels that each fill every SM.
  for (Routing routing : {Routing::kUniform, Routing::kSkewed}) {
    expect_equal_to_one_gpu("small", 2, {300, 513}, routing, seed++, "prefill_128x192_async",
                            Precision::kExact, true);
    expect_equal_to_one_gpu("small", 8, {64, 3, 0, 200, 7, 0, 1, 40}, routing, seed++,
                            "prefill_256x64_k2_async", Precision::kExact, true);
    expect_equal_to_one_gpu("small", 4, {100, 0, 257, 64}, routing, seed++,
                            "prefill_256x128_k2_staged", Precision::kExact, true);
    // The FP8 mode, L1's rows rebased into L2's inside the kernel (forced FP8 tiles).
    expect_equal_to_one_gpu("small", 2, {300, 513}, routing, seed++, "fp8_128x192_k2_async",
                            Precision::kFp8, true);
    expect_equal_to_one_gpu("small", 8, {64, 3, 0, 200, 7, 0, 1, 40}, routing, seed++,
                            "fp8_256x128_k2_staged", Precision::kFp8, true);
  }
}

// The dispatch inside the MegaMoE kernel (LayerConfig::sm90.mega_dispatch), on the ranks that send
// with ep_send (T > 32): the dispatch kernel sorts once every rank's slot ids are in, and the
// kernel's gather units take each received row once its arrival word is there, while the ranks
// above the fused-send size still send theirs; R persistent kernels waiting for rows on one GPU,
// mixed with ranks that gather by launch, equal to EP = 1 bit for bit on the decode, prefill and
// FP8 tiles.
TEST(Ep, VirtualRanksMegaDispatchEqualOneGpu) {
  MEGAMOE_REQUIRE_SM90();
  uint64_t seed = 3700;
  auto run = [&](const char* shape, int ranks, const std::vector<int64_t>& tokens, Routing routing,
                 const char* tile, Precision precision) {
    expect_equal_to_one_gpu(shape, ranks, tokens, routing, seed++, tile, precision, true, true);
  };
  for (Routing routing : {Routing::kUniform, Routing::kSkewed, Routing::kAdversarial}) {
    run("small", 2, {37, 64}, routing, "decode_128x16_k2_warp", Precision::kExact);
    run("small", 8, {16, 3, 0, 64, 7, 0, 1, 40}, routing, "decode_128x8_k4_warp", Precision::kExact);
  }
  run("kimi-k3", 8, {33, 40, 33, 64, 48, 33, 33, 33}, Routing::kUniform, "decode_128x16_k2_warp",
      Precision::kExact);
  for (Routing routing : {Routing::kUniform, Routing::kSkewed}) {
    run("small", 2, {300, 513}, routing, "prefill_128x192_async", Precision::kExact);
    run("small", 8, {64, 3, 0, 200, 7, 0, 1, 40}, routing, "prefill_256x64_k2_async", Precision::kExact);
    run("small", 4, {100, 0, 257, 64}, routing, "prefill_256x128_k2_staged", Precision::kExact);
    run("small", 2, {300, 513}, routing, "fp8_128x192_k2_async", Precision::kFp8);
    run("small", 8, {64, 3, 0, 200, 7, 0, 1, 40}, routing, "fp8_256x128_k2_staged", Precision::kFp8);
  }
  run("deepseek-v3", 8, {256, 100, 0, 64, 300, 17, 64, 2}, Routing::kUniform,
      "prefill_256x128_k2_staged", Precision::kExact);
}

TEST(Ep, VirtualRanksAllEmpty) {
  MEGAMOE_REQUIRE_SM90();
  expect_equal_to_one_gpu("small", 4, {0, 0, 0, 0}, Routing::kUniform, 950);
}

// The default tile policy: ranks and the one-GPU layer may pick different tiles (split-K
// changes the order of the FP32 sums), so the outputs agree to the last bits only.
TEST(Ep, VirtualRanksDefaultPolicyCloseToOneGpu) {
  MEGAMOE_REQUIRE_SM90();
  const std::vector<int64_t> tokens = {1, 8, 64, 0};
  const LayerConfig c = ep_config("small", 64, "auto");
  const EpInputs in = make_ep_inputs(c, tokens, Routing::kUniform, 960, 0.0);
  OneGpu one(c, in.total(), 960);
  const std::vector<uint16_t> expected = one.run(in);
  EpRanks ep(c, 4, 960);
  ep.upload(in);
  ep.forward();
  ep.sync();
  const std::vector<uint16_t> y = ep.output();
  std::vector<double> a(y.size()), b(y.size());
  for (size_t i = 0; i < y.size(); ++i) {
    a[i] = bf16_to_f32(y[i]);
    b[i] = bf16_to_f32(expected[i]);
  }
  const double diff = diff_metric(a.data(), b.data(), static_cast<int64_t>(a.size()));
  std::printf("[ INFO     ] default policy EP=4 vs one GPU: %lld of %zu outputs differ, diff %.3e\n",
              static_cast<long long>(count_mismatches(y, expected)), y.size(), diff);
  EXPECT_LT(diff, 1e-5);
}

TEST(Ep, VirtualRanksDeepseekV3Ep8) {
  MEGAMOE_REQUIRE_SM90();
  expect_equal_to_one_gpu("deepseek-v3", 8, {33, 1, 0, 64, 8, 17, 64, 2}, Routing::kUniform, 970);
}

TEST(Ep, VirtualRanksKimiK3Ep8Decode) {
  MEGAMOE_REQUIRE_SM90();
  expect_equal_to_one_gpu("kimi-k3", 8, {1, 1, 1, 1, 1, 1, 1, 1}, Routing::kUniform, 975,
                          "decode_128x16_k1_warp");
}

// A call of every rank on `in` works: no rank reports an error and the outputs equal the one-GPU
// layer's (weights of `weight_seed`) bit for bit. After an error, it shows the group is intact.
void expect_call_equals_one_gpu(EpRanks& ep, const LayerConfig& c, const EpInputs& in,
                                uint64_t weight_seed) {
  OneGpu one(c, in.total(), weight_seed);
  const std::vector<uint16_t> expected = one.run(in);
  ep.upload(in);
  ep.forward();
  ep.sync();
  for (int r = 0; r < ep.size(); ++r) EXPECT_NO_THROW(ep.layer(r).check_errors(ep.stream(r)));
  EXPECT_EQ(count_mismatches(ep.output(), expected), 0);
}

// A rank called above its capacity throws at once and still takes part (as T = 0); the others
// report it at their check, naming it; the next call works everywhere.
TEST(Ep, CapacityOverflowFailsOnEveryRank) {
  MEGAMOE_REQUIRE_SM90();
  const LayerConfig c = ep_config("small", 16);
  const EpInputs in = make_ep_inputs(c, {16, 16}, Routing::kUniform, 980);
  const EpInputs over = make_ep_inputs(c, {17, 16}, Routing::kUniform, 980);
  EpRanks ep(c, 2, 980, EpOptions{}, /*buffer_tokens=*/17);
  ep.upload(over);
  try {
    ep.forward_rank(0);
    FAIL() << "rank 0 above capacity did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kOutOfRange);
    EXPECT_NE(std::string(e.what()).find("exceeds the layer capacity"), std::string::npos) << e.what();
  }
  ep.forward_rank(1);
  ep.sync();
  try {
    ep.layer(1).check_errors(ep.stream(1));
    FAIL() << "rank 1 did not report rank 0's overflow";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kOutOfRange);
    EXPECT_NE(std::string(e.what()).find("rank 0 called the layer with T = 17"), std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(ep.layer(0).check_errors(ep.stream(0)));
  // The group is intact: the next call computes the right answer.
  expect_call_equals_one_gpu(ep, c, in, 980);
}

// More rows for one rank than its max_recv_rows: nothing is computed there and every rank's
// check reports it, naming the rank; a call that fits works afterwards. Both sorts of
// ep_dispatch: 1024 received slots (the counting sort) and 128 (dispatch_sort_small, at most
// kDispatchSmallSlots).
TEST(Ep, ReceiveOverflowFailsOnEveryRank) {
  MEGAMOE_REQUIRE_SM90();
  const LayerConfig c = ep_config("small", 64);
  // The next call: T tokens per rank whose rows fit whatever the routing (4 x T x K <= max_rows).
  const struct {
    int64_t tokens, max_rows, next_tokens;
  } cases[] = {{64, 100, 4}, {8, 20, 1}};
  for (const auto& cs : cases) {
    SCOPED_TRACE("tokens per rank " + std::to_string(cs.tokens));
    EpOptions options;
    options.max_recv_rows = cs.max_rows;
    EpRanks ep(c, 4, 990, options);
    // Adversarial routing: every slot of every rank goes to experts [0, K), all on rank 0:
    // 4 ranks x T tokens x K = 4 slots (1024 or 128 rows) > max_recv_rows.
    ep.upload(make_ep_inputs(c, std::vector<int64_t>(4, cs.tokens), Routing::kAdversarial, 990));
    ep.forward();
    ep.sync();
    const std::string expected_message =
        "rank 0 received more rows than its max_recv_rows = " + std::to_string(cs.max_rows);
    for (int r = 0; r < 4; ++r) {
      try {
        ep.layer(r).check_errors(ep.stream(r));
        FAIL() << "rank " << r << " did not report the overflow";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kOutOfRange);
        EXPECT_NE(std::string(e.what()).find(expected_message), std::string::npos) << e.what();
      }
    }
    expect_call_equals_one_gpu(
        ep, c, make_ep_inputs(c, std::vector<int64_t>(4, cs.next_tokens), Routing::kUniform, 991),
        990);
  }
}

// A rank that never calls: the others give up after the timeout, report kTimeout naming it, the
// stage and the call number, and refuse later calls.
TEST(Ep, MissingRankTimesOut) {
  MEGAMOE_REQUIRE_SM90();
  // The chain, and the MegaMoE kernel with the combine inside (its wait for the missing rank's
  // return finds the window broken and gives up at once).
  for (bool mega : {false, true}) {
  SCOPED_TRACE(mega ? "MegaMoE kernel, combine inside" : "chain");
  const LayerConfig c = ep_config("small", 8, mega ? "decode_128x16_k2_warp" : kFixedTile,
                                  Precision::kExact, mega);
  EpOptions options;
  options.timeout_s = 0.2;
  EpRanks ep(c, 4, 995, options);
  ep.upload(make_ep_inputs(c, {8, 8, 8, 8}, Routing::kUniform, 995));
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < 3; ++r) ep.forward_rank(r);  // rank 3 never arrives
  for (int r = 0; r < 3; ++r) MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(ep.stream(r)));
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(waited, 5.0) << "the waits did not give up in time";
  for (int r = 0; r < 3; ++r) {
    try {
      ep.layer(r).check_errors(ep.stream(r));
      FAIL() << "rank " << r << " did not time out";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kTimeout);
      const std::string what = e.what();
      EXPECT_NE(what.find("in stage 'dispatch' waiting for rank 3 to publish call #1"),
                std::string::npos) << what;
    }
    EXPECT_TRUE(ep.group(r).broken());
    try {
      ep.forward_rank(r);
      FAIL() << "a broken group accepted a call";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kTimeout);
    }
    if (mega) EXPECT_EQ(ep.layer(r).last_call_kernels(), "mega+combine") << "rank " << r;
  }
  }
}

// The R ranks' calls captured in one CUDA graph (a fork/join over their streams) and replayed
// equal eager calls; the call counter lives on the device, so replays keep the protocol going.
// mega: the MegaMoE kernel (its rows straight into the sources' combine slots, the return only
// signalling) where its policy takes the call.
void expect_graph_replay_equals_eager(bool mega, bool mega_dispatch = false) {
  SCOPED_TRACE(mega_dispatch ? "MegaMoE kernel with the dispatch inside" : mega ? "MegaMoE kernel" : "chain");
  const LayerConfig c = ep_config("small", 48, mega_dispatch ? "decode_128x16_k2_warp" : "auto",
                                  Precision::kExact, mega, mega_dispatch);
  const int ranks = 4;
  // (48: a rank sending with ep_send, and with the dispatch inside gathering in the kernel)
  const EpInputs a = make_ep_inputs(c, {48, 5, 0, 17}, Routing::kSkewed, 1000);
  const EpInputs b = make_ep_inputs(c, {48, 5, 0, 17}, Routing::kUniform, 1001);
  EpRanks ep(c, ranks, 1000);
  ep.upload(a);
  ep.forward();
  ep.sync();
  const std::vector<uint16_t> eager_a = ep.output();
  ep.upload(b);
  ep.forward();
  ep.sync();
  const std::vector<uint16_t> eager_b = ep.output();

  Stream origin;
  std::vector<cudaEvent_t> events(ranks + 1);
  for (auto& e : events) MEGAMOE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  StreamGraph graph(origin, [&] {
    MEGAMOE_CUDA_CHECK(cudaEventRecord(events[ranks], origin));
    for (int r = 0; r < ranks; ++r) {
      MEGAMOE_CUDA_CHECK(cudaStreamWaitEvent(ep.stream(r), events[ranks]));
      ep.forward_rank(r);
      MEGAMOE_CUDA_CHECK(cudaEventRecord(events[r], ep.stream(r)));
    }
    for (int r = 0; r < ranks; ++r) MEGAMOE_CUDA_CHECK(cudaStreamWaitEvent(origin, events[r]));
  });
  if (mega_dispatch) {
    EXPECT_EQ(ep.layer(0).last_call_kernels(), "mega+dispatch") << "the captured call of rank 0";
    EXPECT_EQ(ep.layer(1).last_call_kernels(), "mega+combine") << "the captured call of rank 1";
  }
  for (int rep = 0; rep < 3; ++rep) {
    for (const EpInputs* in : {&a, &b}) {
      ep.upload(*in);
      graph.launch(origin);
      MEGAMOE_CUDA_CHECK(cudaStreamSynchronize(origin));
      EXPECT_EQ(count_mismatches(ep.output(), in == &a ? eager_a : eager_b), 0) << "replay " << rep;
    }
  }
  for (int r = 0; r < ranks; ++r) EXPECT_NO_THROW(ep.layer(r).check_errors(ep.stream(r)));
  for (auto& e : events) cudaEventDestroy(e);
}

TEST(Ep, GraphCaptureReplayEqualsEager) {
  MEGAMOE_REQUIRE_SM90();
  expect_graph_replay_equals_eager(false);
  expect_graph_replay_equals_eager(true);
  expect_graph_replay_equals_eager(true, true);
}

// Invalid expert ids on one rank are reported by that rank (token and slot), count as empty,
// and do not disturb the other ranks.
TEST(Ep, InvalidIdsReportedBySourceRank) {
  MEGAMOE_REQUIRE_SM90();
  const LayerConfig c = ep_config("small", 8);
  EpInputs in = make_ep_inputs(c, {8, 8}, Routing::kUniform, 1010);
  EpInputs clean = in;
  in.idx[1][5 * c.shape.top_k + 2] = 4096;  // rank 1, token 5, slot 2
  clean.idx[1][5 * c.shape.top_k + 2] = -1;
  clean.all_idx[(8 + 5) * c.shape.top_k + 2] = -1;
  OneGpu one(c, clean.total(), 1010);
  const std::vector<uint16_t> expected = one.run(clean);
  EpRanks ep(c, 2, 1010);
  ep.upload(in);
  ep.forward();
  ep.sync();
  EXPECT_NO_THROW(ep.layer(0).check_errors(ep.stream(0)));
  try {
    ep.layer(1).check_errors(ep.stream(1));
    FAIL() << "rank 1 did not report the invalid id";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kOutOfRange);
    EXPECT_NE(std::string(e.what()).find("got 4096 at token 5 slot 2"), std::string::npos) << e.what();
  }
  EXPECT_EQ(count_mismatches(ep.output(), expected), 0);
}

void expect_nccl_one_rank_equals_plain(const LayerConfig& c, const char* kernels = nullptr) {
  const EpInputs in = make_ep_inputs(c, {64}, Routing::kSkewed, 1020, 0.1);
  OneGpu one(c, in.total(), 1020);
  const std::vector<uint16_t> expected = one.run(in);
  std::shared_ptr<EpGroup> group = EpGroup::create_nccl(nccl_unique_id(), 1, 0, c);
  EXPECT_EQ(group->transport(), "nccl");
  MoeLayer layer(c, synthetic_weights(c, 1020), group, "sm90");
  const int64_t t = in.total(), h = c.shape.hidden, k = c.shape.top_k;
  DeviceArray<uint16_t> x(in.all_x), y(t * h);
  DeviceArray<int32_t> idx(in.all_idx);
  DeviceArray<float> w(in.all_weights);
  const Device dev = Device::cuda();
  for (int rep = 0; rep < 3; ++rep) {
    layer.forward(TensorView::contiguous(x.get(), DType::kBF16, {t, h}, dev),
                  TensorView::contiguous(idx.get(), DType::kI32, {t, k}, dev),
                  TensorView::contiguous(w.get(), DType::kF32, {t, k}, dev),
                  TensorView::contiguous(y.get(), DType::kBF16, {t, h}, dev));
    layer.check_errors();
    EXPECT_EQ(count_mismatches(y.download(), expected), 0) << "call " << rep;
    if (kernels != nullptr) EXPECT_EQ(layer.last_call_kernels(), kernels) << "call " << rep;
  }
}

// The NCCL transport with one rank: window registration, device communicator, LSA barrier and
// the same kernels; equal to the layer without a group. Also with the MegaMoE kernel on a
// decode tile (its L2 rows written through the NCCL window's LSA pointer).
TEST(EpNccl, OneRankEqualsPlainLayer) {
  MEGAMOE_REQUIRE_SM90();
  if (!nccl_available()) {
    std::printf("[  SKIPPED ] NCCL: no usable libnccl.so.2 of version >= the build's headers "
                "(put a newer one first on LD_LIBRARY_PATH)\n");
    GTEST_SKIP() << "no usable libnccl";
  }
  // The chain; the MegaMoE kernel with the combine inside (alone on the GPU: every CTA waits
  // for the ranks' returns and sums its share), also with the dispatch inside, and without the
  // combine inside.
  const char* kernels[] = {"chain", "mega+combine", "mega+dispatch+combine", "mega"};
  for (int mode = 0; mode < 4; ++mode) {
    SCOPED_TRACE(kernels[mode]);
    expect_nccl_one_rank_equals_plain(mode == 0 ? ep_config("small", 64)
                                                : ep_config("small", 64, "decode_128x16_k2_warp",
                                                            Precision::kExact, true, mode == 2,
                                                            mode != 3),
                                      kernels[mode]);
  }
}

}  // namespace
}  // namespace megamoe::test
