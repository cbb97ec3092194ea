// Hopper pipeline stages (quantize, dispatch, gather, combine) against their CPU definitions.
// Each stage runs alone through its launcher (src/moe/sm90_stages.hpp); the CPU side is the
// shared quantizer of megamoe/quantize.hpp or a direct transcription of the stage's contract.
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <limits>
#include <memory>
#include <string>
#include <random>
#include <vector>

#include "megamoe/formats.hpp"
#include "megamoe/quantize.hpp"
#include "layout/sm90_weight_layout.hpp"
#include "moe/sm90_stages.hpp"
#include "sm90_test_util.hpp"

namespace megamoe::sm90 {
namespace {

using test::DeviceArray;
using test::Routing;

// ---------------------------------------------------------------------------------------------
// quantize: bit-exact against megamoe::quantize_input
// ---------------------------------------------------------------------------------------------
void check_quantize(int64_t num_tokens, int64_t hidden, std::vector<uint16_t> x) {
  std::vector<uint8_t> q_ref(x.size()), sf_ref(x.size() / kScaleBlock);
  quantize_input(x.data(), num_tokens, hidden, q_ref.data(), sf_ref.data());
  DeviceArray<uint16_t> dx(x);
  DeviceArray<uint8_t> dq(num_tokens * hidden), dsf(num_tokens * hidden / kScaleBlock);
  dq.fill_bytes(0xAB);
  dsf.fill_bytes(0xAB);
  launch_quantize_input(dx.get(), num_tokens, hidden, dq.get(), dsf.get(), nullptr);
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
  const auto q = dq.download(), sf = dsf.download();
  int64_t bad_q = 0, bad_sf = 0, first = -1;
  for (size_t i = 0; i < q.size(); ++i)
    if (q[i] != q_ref[i] && bad_q++ == 0) first = static_cast<int64_t>(i);
  for (size_t i = 0; i < sf.size(); ++i) bad_sf += sf[i] != sf_ref[i];
  EXPECT_EQ(bad_q, 0) << "T=" << num_tokens << " H=" << hidden << ": first differing code at "
                      << first << " (gpu " << (first >= 0 ? int(q[first]) : -1) << ", cpu "
                      << (first >= 0 ? int(q_ref[first]) : -1) << ")";
  EXPECT_EQ(bad_sf, 0) << "T=" << num_tokens << " H=" << hidden;
}

TEST(Sm90Stages, QuantizeMatchesCpuBitForBit) {
  MEGAMOE_REQUIRE_SM90();
  const int64_t hiddens[] = {1024, 3584, 7168};
  const int64_t tokens[] = {1, 7, 64, 513, 4096};
  for (int64_t h : hiddens)
    for (int64_t t : tokens) check_quantize(t, h, test::make_inputs(t, h, 1000 + t + h));
}

TEST(Sm90Stages, QuantizeNonFiniteInputs) {
  MEGAMOE_REQUIRE_SM90();
  const int64_t t = 9, h = 1024;
  auto x = test::make_inputs(t, h, 7);
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), 3.0e38f, -1.0e30f, 1e-30f};
  for (int i = 0; i < 6; ++i) x[static_cast<size_t>(i * 1000 + 3)] = bf16_from_f32(specials[i]);
  // A whole group of NaN, and a group mixing NaN with finite values.
  for (int i = 0; i < kScaleBlock; ++i) x[static_cast<size_t>(2 * h + i)] = bf16_from_f32(specials[0]);
  x[static_cast<size_t>(3 * h + 5)] = bf16_from_f32(specials[0]);
  check_quantize(t, h, x);
}

// ---------------------------------------------------------------------------------------------
// dispatch: the stable counting sort, on the CPU
// ---------------------------------------------------------------------------------------------
struct DispatchCpu {
  std::vector<int32_t> row_offsets, slot_to_row, row_slot;
  std::vector<float> row_weights;
  int64_t num_bad = 0;
  int64_t first_bad_slot = -1;
  int32_t first_bad_id = 0;
};

DispatchCpu dispatch_cpu(const std::vector<int32_t>& idx, const std::vector<float>& w,
                         int64_t num_experts, int64_t first_local, int64_t num_local) {
  DispatchCpu r;
  const int64_t slots = static_cast<int64_t>(idx.size());
  r.row_offsets.assign(static_cast<size_t>(num_local + 1), 0);
  r.slot_to_row.assign(static_cast<size_t>(slots), -1);
  auto local_of = [&](int64_t s) -> int64_t {
    const int32_t id = idx[s];
    if (id == -1) return -1;
    if (id < 0 || id >= num_experts) {
      if (r.num_bad++ == 0) {
        r.first_bad_slot = s;
        r.first_bad_id = id;
      }
      return -1;
    }
    const int64_t l = id - first_local;
    return (l >= 0 && l < num_local) ? l : -1;
  };
  std::vector<int64_t> local(static_cast<size_t>(slots));
  for (int64_t s = 0; s < slots; ++s) {
    local[s] = local_of(s);
    if (local[s] >= 0) ++r.row_offsets[local[s] + 1];
  }
  for (int64_t e = 0; e < num_local; ++e) r.row_offsets[e + 1] += r.row_offsets[e];
  std::vector<int32_t> cursor(r.row_offsets.begin(), r.row_offsets.end() - 1);
  r.row_slot.resize(static_cast<size_t>(r.row_offsets[num_local]));
  r.row_weights.resize(r.row_slot.size());
  for (int64_t s = 0; s < slots; ++s) {
    if (local[s] < 0) continue;
    const int32_t row = cursor[local[s]]++;
    r.slot_to_row[s] = row;
    r.row_slot[row] = static_cast<int32_t>(s);
    r.row_weights[row] = w[s];
  }
  return r;
}

struct DispatchCase {
  int64_t tokens, num_experts, top_k, ep_size, ep_rank;
  Routing routing;
  double empty_fraction;
  int num_invalid;  // ids planted outside [0, E)
};

void check_dispatch(const DispatchCase& c, uint64_t seed) {
  const int64_t num_local = c.num_experts / c.ep_size;
  const int64_t first_local = num_local * c.ep_rank;
  auto routing = test::make_routing(c.routing, c.tokens, c.num_experts, c.top_k, seed,
                                    c.empty_fraction, first_local);
  const int64_t slots = c.tokens * c.top_k;
  detail::SplitMix64 rng(seed);
  for (int i = 0; i < c.num_invalid && slots > 0; ++i) {
    const int64_t s = static_cast<int64_t>(rng.below(slots));
    routing.idx[s] = (i % 2 == 0) ? static_cast<int32_t>(c.num_experts + i) : -7 - i;
  }
  const DispatchCpu ref =
      dispatch_cpu(routing.idx, routing.weights, c.num_experts, first_local, num_local);

  DeviceArray<int32_t> didx(routing.idx);
  DeviceArray<float> dw(routing.weights);
  DeviceArray<int32_t> offsets(num_local + 1), s2r(slots), row_slot(slots);
  DeviceArray<float> row_w(slots);
  DeviceArray<DispatchError> err(1);
  s2r.fill_bytes(0x5A);
  row_slot.fill_bytes(0x5A);
  const DispatchError clean{kDispatchNoError, 0};
  err.upload({clean});
  DispatchParams p{};
  p.topk_idx = didx.get();
  p.topk_weights = dw.get();
  p.num_slots = slots;
  p.num_experts = static_cast<int32_t>(c.num_experts);
  p.first_local = static_cast<int32_t>(first_local);
  p.num_local = static_cast<int32_t>(num_local);
  p.row_offsets = offsets.get();
  p.slot_to_row = s2r.get();
  p.row_slot = row_slot.get();
  p.row_weights = row_w.get();
  p.error = err.get();
  launch_dispatch(p, nullptr);
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());

  const std::string what = "T=" + std::to_string(c.tokens) + " E=" + std::to_string(c.num_experts) +
                           " K=" + std::to_string(c.top_k) + " ep " + std::to_string(c.ep_rank) +
                           "/" + std::to_string(c.ep_size) + " routing " +
                           test::routing_name(c.routing) + " seed " + std::to_string(seed);
  ASSERT_EQ(offsets.download(), ref.row_offsets) << what;
  ASSERT_EQ(s2r.download(), ref.slot_to_row) << what;
  const int64_t rows = ref.row_offsets.back();
  ASSERT_EQ(row_slot.download(rows), ref.row_slot) << what;
  ASSERT_EQ(row_w.download(rows), ref.row_weights) << what;
  const DispatchError got = err.download()[0];
  EXPECT_EQ(static_cast<int64_t>(got.num_bad), ref.num_bad) << what;
  if (ref.num_bad > 0) {
    EXPECT_EQ(static_cast<int64_t>(got.first_bad >> 32), ref.first_bad_slot) << what;
    EXPECT_EQ(static_cast<int32_t>(got.first_bad & 0xFFFFFFFFu), ref.first_bad_id) << what;
  } else {
    EXPECT_EQ(got.first_bad, kDispatchNoError) << what;
  }
}

TEST(Sm90Stages, DispatchMatchesStableCountingSort) {
  MEGAMOE_REQUIRE_SM90();
  const Routing kinds[] = {Routing::kUniform, Routing::kSkewed, Routing::kAdversarial};
  uint64_t seed = 1;
  for (Routing r : kinds) {
    // small, deepseek-v3, kimi-k3 (EP1: 896 local experts) and kimi-k3 EP8 rank 3.
    const DispatchCase cases[] = {
        {0, 32, 4, 1, 0, r, 0.0, 0},       {1, 32, 4, 1, 0, r, 0.0, 0},
        {7, 32, 4, 1, 0, r, 0.1, 0},       {513, 32, 4, 1, 0, r, 0.05, 0},
        {64, 256, 8, 1, 0, r, 0.0, 0},     {4096, 256, 8, 1, 0, r, 0.02, 0},
        {1, 896, 16, 1, 0, r, 0.0, 0},     {8192, 896, 16, 1, 0, r, 0.0, 0},
        {513, 896, 16, 8, 3, r, 0.1, 0},   {4096, 896, 16, 8, 3, r, 0.0, 0},
        {8192, 896, 16, 8, 7, r, 0.0, 0},
    };
    for (const auto& c : cases) check_dispatch(c, seed++);
  }
}

TEST(Sm90Stages, DispatchRecordsInvalidIdsWithoutReadingThem) {
  MEGAMOE_REQUIRE_SM90();
  check_dispatch({64, 32, 4, 1, 0, Routing::kUniform, 0.1, 5}, 11);
  check_dispatch({4096, 896, 16, 8, 2, Routing::kSkewed, 0.0, 33}, 12);
  check_dispatch({1, 256, 8, 1, 0, Routing::kUniform, 0.0, 1}, 13);
}

// ---------------------------------------------------------------------------------------------
// gather: act[r] = bf16(e4m3(x_q[t]) * 2^(sf - 127)), exact
// ---------------------------------------------------------------------------------------------
TEST(Sm90Stages, GatherDequantizesRoutedRowsExactly) {
  MEGAMOE_REQUIRE_SM90();
  struct Case { int64_t tokens, hidden, num_experts, top_k, ep_size, ep_rank; Routing routing; };
  const Case cases[] = {{7, 1024, 32, 4, 1, 0, Routing::kUniform},
                        {513, 7168, 256, 8, 1, 0, Routing::kSkewed},
                        {64, 3584, 896, 16, 8, 5, Routing::kUniform},
                        {300, 3584, 896, 16, 8, 0, Routing::kAdversarial}};
  uint64_t seed = 100;
  for (const Case& c : cases) {
    const int64_t num_local = c.num_experts / c.ep_size, first_local = num_local * c.ep_rank;
    const auto x = test::make_inputs(c.tokens, c.hidden, seed);
    std::vector<uint8_t> xq(x.size()), xsf(x.size() / kScaleBlock);
    quantize_input(x.data(), c.tokens, c.hidden, xq.data(), xsf.data());
    auto routing = test::make_routing(c.routing, c.tokens, c.num_experts, c.top_k, seed++, 0.05,
                                      first_local);
    const DispatchCpu ref =
        dispatch_cpu(routing.idx, routing.weights, c.num_experts, first_local, num_local);
    const int64_t slots = c.tokens * c.top_k, rows = ref.row_offsets.back();

    DeviceArray<uint8_t> dq(xq), dsf(xsf);
    DeviceArray<int32_t> doff(ref.row_offsets), drs(slots);
    if (rows > 0) drs.upload(ref.row_slot);
    DeviceArray<uint16_t> act(slots * c.hidden);
    act.fill_bytes(0xFF);
    launch_gather(dq.get(), dsf.get(), doff.get(), drs.get(), num_local, c.top_k, c.hidden, slots,
                  act.get(), nullptr);
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
    const auto got = act.download(rows * c.hidden);
    int64_t bad = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = ref.row_slot[r] / c.top_k;
      for (int64_t i = 0; i < c.hidden; ++i) {
        const float v = e4m3_to_f32(xq[t * c.hidden + i]) * ue8m0_to_f32(xsf[(t * c.hidden + i) / kScaleBlock]);
        const uint16_t want = bf16_from_f32(v);
        EXPECT_EQ(bf16_to_f32(want), v) << "dequantized value not exact in BF16";
        bad += got[r * c.hidden + i] != want;
      }
    }
    EXPECT_EQ(bad, 0) << "T=" << c.tokens << " H=" << c.hidden << " E=" << c.num_experts
                      << " rows=" << rows;
  }
}

// ---------------------------------------------------------------------------------------------
// FP8 mode: E4M3 token rows rebased per row (docs/numerics.md "FP8 mode"), against the host's
// fp8_mode_rebase_rows and the slot permutation, byte for byte; gathered (top_k > 0) and direct
// (top_k = 0) rows; scale spreads of 0..24 binades within a row (rounding below the window).
// ---------------------------------------------------------------------------------------------
TEST(Sm90Stages, RebaseRowsE4m3MatchesTheHostByteForByte) {
  MEGAMOE_REQUIRE_SM90();
  struct Case { int64_t tokens, hidden, num_experts, top_k; int spread; };
  const Case cases[] = {{7, 1024, 32, 4, 0}, {300, 7168, 256, 8, 12}, {64, 3584, 896, 16, 24},
                        {50, 2048, 16, 0, 6}};
  uint64_t seed = 300;
  for (const Case& c : cases) {
    const auto x = test::make_inputs(c.tokens, c.hidden, seed);
    std::vector<uint8_t> xq(x.size()), xsf(x.size() / kScaleBlock);
    quantize_input(x.data(), c.tokens, c.hidden, xq.data(), xsf.data());
    std::mt19937 rng(static_cast<uint32_t>(seed++));
    for (auto& b : xsf) {
      if (c.spread > 0) b = static_cast<uint8_t>(std::clamp(int(b) - int(rng() % (c.spread + 1)), 1, 254));
    }
    const int64_t k = std::max<int64_t>(c.top_k, 1);
    std::vector<int32_t> row_slot(c.tokens * k), offsets = {0, static_cast<int32_t>(c.tokens * k)};
    for (int64_t r = 0; r < c.tokens * k; ++r) row_slot[r] = static_cast<int32_t>((r * 7919) % (c.tokens * k));
    const int64_t rows = c.top_k > 0 ? c.tokens * k : c.tokens;
    offsets[1] = static_cast<int32_t>(rows);
    DeviceArray<uint8_t> dq(xq), dsf(xsf);
    DeviceArray<int32_t> doff(offsets), drs(row_slot);
    DeviceArray<uint8_t> dst(rows * c.hidden + 64);
    DeviceArray<float> fac(rows + 1);
    dst.fill_bytes(0xA5);
    launch_rebase_rows_e4m3(dq.get(), dsf.get(), doff.get(), drs.get(), 1, c.top_k, c.hidden, rows,
                            dst.get(), fac.get(), nullptr);
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
    const auto got = dst.download(rows * c.hidden);
    const auto got_f = fac.download(rows);
    int64_t bad = 0, bad_f = 0, rounded = 0;
    std::vector<float> vals(c.hidden);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = c.top_k > 0 ? row_slot[r] / c.top_k : r;
      const uint8_t* sf = xsf.data() + t * (c.hidden / kScaleBlock);
      dequantize_fp8(xq.data() + t * c.hidden, sf, 1, c.hidden, vals.data());
      std::vector<float> before = vals;
      fp8_mode_rebase_rows(vals.data(), sf, 1, c.hidden);
      int s_max = 0;
      for (int64_t g = 0; g < c.hidden / kScaleBlock; ++g) s_max = std::max(s_max, int(sf[g]));
      const float f = std::ldexp(1.0f, s_max - 127);
      bad_f += got_f[r] != f;
      for (int64_t i = 0; i < c.hidden; ++i) {
        rounded += vals[i] != before[i];
        const int64_t slot = i / 32 * 32 + sm90_layout::fp8_row_slot(static_cast<int>(i % 32));
        const uint8_t code = got[r * c.hidden + slot];
        const float want = vals[i] / f;
        const float have = e4m3_to_f32(code);
        if (!(have == want || (std::isnan(have) && std::isnan(want))) && ++bad <= 5)
          ADD_FAILURE() << "row " << r << " col " << i << ": code " << int(code) << " = " << have
                        << ", expected " << want;
      }
    }
    std::printf("[rebase] T=%lld H=%lld top_k=%lld spread %d: rows %lld, values rounded below the "
                "window %lld\n", (long long)c.tokens, (long long)c.hidden, (long long)c.top_k,
                c.spread, (long long)rows, (long long)rounded);
    EXPECT_EQ(bad, 0);
    EXPECT_EQ(bad_f, 0);
  }
}

// ---------------------------------------------------------------------------------------------
// combine: y[t] = bf16(sum over k ascending of float(out[slot_to_row[t, k]]))
// ---------------------------------------------------------------------------------------------
TEST(Sm90Stages, CombineSumsSlotsInOrderBitForBit) {
  MEGAMOE_REQUIRE_SM90();
  struct Case { int64_t tokens, hidden, num_experts, top_k, ep_size; Routing routing; double empty; };
  const Case cases[] = {{1, 1024, 32, 4, 1, Routing::kUniform, 0.0},
                        {513, 1024, 32, 4, 1, Routing::kSkewed, 0.3},
                        {64, 7168, 256, 8, 1, Routing::kUniform, 0.1},
                        {4096, 3584, 896, 16, 8, Routing::kUniform, 0.0}};
  uint64_t seed = 200;
  for (const Case& c : cases) {
    const int64_t num_local = c.num_experts / c.ep_size;
    auto routing = test::make_routing(c.routing, c.tokens, c.num_experts, c.top_k, seed, c.empty);
    const DispatchCpu ref = dispatch_cpu(routing.idx, routing.weights, c.num_experts, 0, num_local);
    const int64_t rows = ref.row_offsets.back();
    // Per-row outputs of unit order with mixed signs, so the summation order matters.
    detail::SplitMix64 rng(seed++);
    std::vector<uint16_t> out(static_cast<size_t>(std::max<int64_t>(rows, 1) * c.hidden));
    for (auto& v : out) v = bf16_from_f32(static_cast<float>(rng.normal() * std::ldexp(1.0, int(rng.below(8)))));
    DeviceArray<uint16_t> dout(out), y(c.tokens * c.hidden);
    DeviceArray<int32_t> ds2r(ref.slot_to_row);
    y.fill_bytes(0xFF);
    launch_combine(dout.get(), ds2r.get(), c.tokens, c.top_k, c.hidden, y.get(), nullptr);
    MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());
    const auto got = y.download();
    int64_t bad = 0;
    for (int64_t t = 0; t < c.tokens; ++t)
      for (int64_t n = 0; n < c.hidden; ++n) {
        float acc = 0.0f;
        for (int64_t k = 0; k < c.top_k; ++k) {
          const int32_t r = ref.slot_to_row[t * c.top_k + k];
          if (r >= 0) acc += bf16_to_f32(out[r * c.hidden + n]);
        }
        bad += got[t * c.hidden + n] != bf16_from_f32(acc);
      }
    EXPECT_EQ(bad, 0) << "T=" << c.tokens << " H=" << c.hidden << " K=" << c.top_k;
  }
}

// ---------------------------------------------------------------------------------------------
// decode front: one launch with the same outputs as quantize + dispatch + gather, bit for bit
// (routing of every kind, empty slots, invalid ids, a rank's share of the experts, non-finite
// inputs, T*K from 1 to the launcher's bound); and the bound itself.
// ---------------------------------------------------------------------------------------------
struct FrontCase {
  int64_t tokens, hidden, num_experts, top_k, ep_size, ep_rank;
  Routing routing;
  double empty_fraction;
  int num_invalid;
};

void check_decode_front(const FrontCase& c, uint64_t seed) {
  const int64_t num_local = c.num_experts / c.ep_size, first_local = num_local * c.ep_rank;
  const int64_t slots = c.tokens * c.top_k;
  auto x = test::make_inputs(c.tokens, c.hidden, seed);
  x[0] = bf16_from_f32(std::numeric_limits<float>::quiet_NaN());
  x[static_cast<size_t>(c.hidden / 2 + 1)] = bf16_from_f32(-std::numeric_limits<float>::infinity());
  auto routing = test::make_routing(c.routing, c.tokens, c.num_experts, c.top_k, seed,
                                    c.empty_fraction, first_local);
  detail::SplitMix64 rng(seed);
  for (int i = 0; i < c.num_invalid; ++i) {
    const int64_t s = static_cast<int64_t>(rng.below(slots));
    routing.idx[s] = (i % 2 == 0) ? static_cast<int32_t>(c.num_experts + i) : -7 - i;
  }
  DeviceArray<uint16_t> dx(x);
  DeviceArray<int32_t> didx(routing.idx);
  DeviceArray<float> dw(routing.weights);
  // Two workspaces, filled with different garbage: [0] the three launches, [1] the front.
  struct Outputs {
    DeviceArray<uint8_t> xq, xsf;
    DeviceArray<int32_t> offsets, s2r, row_slot;
    DeviceArray<float> row_w;
    DeviceArray<DispatchError> err;
    DeviceArray<uint16_t> act;
  };
  std::vector<std::unique_ptr<Outputs>> o;
  DispatchParams p[2];
  for (int i = 0; i < 2; ++i) {
    o.push_back(std::make_unique<Outputs>(Outputs{
        DeviceArray<uint8_t>(c.tokens * c.hidden), DeviceArray<uint8_t>(c.tokens * c.hidden / kScaleBlock),
        DeviceArray<int32_t>(num_local + 1), DeviceArray<int32_t>(slots), DeviceArray<int32_t>(slots),
        DeviceArray<float>(slots), DeviceArray<DispatchError>(1), DeviceArray<uint16_t>(slots * c.hidden)}));
    Outputs& w = *o.back();
    for (auto* a : {&w.xq, &w.xsf}) a->fill_bytes(i == 0 ? 0x5A : 0xA5);
    w.offsets.fill_bytes(i == 0 ? 0x5A : 0xA5);
    w.s2r.fill_bytes(i == 0 ? 0x5A : 0xA5);
    w.row_slot.fill_bytes(i == 0 ? 0x5A : 0xA5);
    w.row_w.fill_bytes(i == 0 ? 0x5A : 0xA5);
    w.act.fill_bytes(i == 0 ? 0x5A : 0xA5);
    w.err.upload({DispatchError{kDispatchNoError, 0}});
    p[i] = DispatchParams{};
    p[i].topk_idx = didx.get();
    p[i].topk_weights = dw.get();
    p[i].num_slots = slots;
    p[i].num_experts = static_cast<int32_t>(c.num_experts);
    p[i].first_local = static_cast<int32_t>(first_local);
    p[i].num_local = static_cast<int32_t>(num_local);
    p[i].row_offsets = w.offsets.get();
    p[i].slot_to_row = w.s2r.get();
    p[i].row_slot = w.row_slot.get();
    p[i].row_weights = w.row_w.get();
    p[i].error = w.err.get();
  }
  launch_quantize_input(dx.get(), c.tokens, c.hidden, o[0]->xq.get(), o[0]->xsf.get(), nullptr);
  launch_dispatch(p[0], nullptr);
  launch_gather(o[0]->xq.get(), o[0]->xsf.get(), o[0]->offsets.get(), o[0]->row_slot.get(),
                num_local, c.top_k, c.hidden, slots, o[0]->act.get(), nullptr);
  ASSERT_TRUE(decode_front_takes(slots, num_local));
  launch_decode_front(dx.get(), c.tokens, c.top_k, c.hidden, p[1], o[1]->xq.get(), o[1]->xsf.get(),
                      o[1]->act.get(), nullptr);
  MEGAMOE_CUDA_CHECK(cudaDeviceSynchronize());

  const std::string what = "T=" + std::to_string(c.tokens) + " H=" + std::to_string(c.hidden) +
                           " E=" + std::to_string(c.num_experts) + " K=" + std::to_string(c.top_k) +
                           " ep " + std::to_string(c.ep_rank) + "/" + std::to_string(c.ep_size) +
                           " routing " + test::routing_name(c.routing) + " invalid " +
                           std::to_string(c.num_invalid);
  EXPECT_EQ(o[1]->xq.download(), o[0]->xq.download()) << what;
  EXPECT_EQ(o[1]->xsf.download(), o[0]->xsf.download()) << what;
  const auto offsets = o[0]->offsets.download();
  ASSERT_EQ(o[1]->offsets.download(), offsets) << what;
  EXPECT_EQ(o[1]->s2r.download(), o[0]->s2r.download()) << what;
  const int64_t rows = offsets.back();
  EXPECT_EQ(o[1]->row_slot.download(rows), o[0]->row_slot.download(rows)) << what;
  EXPECT_EQ(o[1]->row_w.download(rows), o[0]->row_w.download(rows)) << what;
  EXPECT_EQ(o[1]->act.download(rows * c.hidden), o[0]->act.download(rows * c.hidden)) << what;
  const DispatchError e0 = o[0]->err.download()[0], e1 = o[1]->err.download()[0];
  EXPECT_EQ(e1.first_bad, e0.first_bad) << what;
  EXPECT_EQ(e1.num_bad, e0.num_bad) << what;
  if (c.num_invalid > 0) EXPECT_GT(e0.num_bad, 0u) << what;
}

TEST(Sm90Stages, DecodeFrontEqualsQuantizeDispatchGather) {
  MEGAMOE_REQUIRE_SM90();
  uint64_t seed = 300;
  const Routing kinds[] = {Routing::kUniform, Routing::kSkewed, Routing::kAdversarial};
  for (Routing r : kinds) {
    const FrontCase cases[] = {
        {1, 1024, 32, 4, 1, 0, r, 0.0, 0},     {7, 1024, 32, 4, 1, 0, r, 0.2, 0},
        {1, 7168, 256, 8, 1, 0, r, 0.0, 0},    {8, 7168, 256, 8, 1, 0, r, 0.0, 0},
        {128, 7168, 256, 8, 1, 0, r, 0.05, 0}, {1, 3584, 896, 16, 1, 0, r, 0.0, 0},
        {64, 3584, 896, 16, 1, 0, r, 0.0, 0},  {37, 3584, 896, 16, 8, 3, r, 0.1, 0},
        {3, 1056, 64, 1, 1, 0, r, 0.0, 0},
    };
    for (const auto& c : cases) check_decode_front(c, seed++);
  }
  check_decode_front({64, 1024, 32, 4, 1, 0, Routing::kUniform, 0.1, 5}, seed++);
  check_decode_front({1, 7168, 256, 8, 1, 0, Routing::kUniform, 0.0, 1}, seed++);
  check_decode_front({64, 3584, 896, 16, 8, 2, Routing::kSkewed, 0.0, 9}, seed++);
}

TEST(Sm90Stages, DecodeFrontRefusesCallsAboveItsBound) {
  MEGAMOE_REQUIRE_SM90();
  EXPECT_TRUE(decode_front_takes(kFrontMaxSlots, 896));
  EXPECT_FALSE(decode_front_takes(kFrontMaxSlots + 1, 896));
  EXPECT_FALSE(decode_front_takes(0, 896));
  EXPECT_FALSE(decode_front_takes(16, 1 << 20));  // the dispatch histogram does not fit
  DispatchParams p{};
  p.num_slots = (kFrontMaxSlots / 16 + 1) * 16;
  p.num_experts = 896;
  p.num_local = 896;
  try {
    launch_decode_front(nullptr, p.num_slots / 16, 16, 3584, p, nullptr, nullptr, nullptr, nullptr);
    FAIL() << "expected InvalidArgument";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("T*K <= 1024"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace megamoe::sm90
