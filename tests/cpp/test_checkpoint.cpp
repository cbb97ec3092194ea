// MoE expert recognition and loading (weights.md sections 1-2): Kimi-K3-style and GPT-OSS-style
// checkpoints written by the writer load into identical canonical weights, run through the CPU
// layer, slice correctly for expert parallelism, and every malformed layer is rejected with its
// own message naming file and tensor.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <random>

#include "megamoe/checkpoint.hpp"
#include "megamoe/reference.hpp"
#include "test_checkpoint_fixtures.hpp"

namespace megamoe {
namespace {

using testing_ckpt::clone;
using testing_ckpt::random_weights;
using testing_ckpt::TempDir;
using testing_ckpt::throws_error;
using testing_ckpt::weights_equal;

constexpr int64_t kH = 128, kI = 64, kE = 8;
const std::string kKimiPrefix = "language_model.model.layers.3.block_sparse_moe";
const std::string kGptPrefix = "model.layers.7.mlp";

std::string write_checkpoint(const TempDir& dir, const std::string& file, const std::string& prefix,
                             const MoeWeights& w, ExpertConvention convention) {
  SafetensorsWriter writer;
  add_moe_layer(writer, prefix, w, convention);
  // Non-expert tensors of a real MoE block are ignored by the expert loader.
  std::vector<uint16_t> gate(static_cast<size_t>(w.num_local_experts * 16), 0x3F80);
  writer.add_copy(prefix + ".gate.weight", StDType::kBF16, {w.num_local_experts, 16}, gate.data());
  writer.set_metadata("format", "pt");
  const std::string path = dir.file(file);
  writer.write(path);
  return path;
}

// Reads every tensor of `in` and writes `out` with `mutate` applied (return false to drop it).
using Mutation = std::function<bool(std::string& name, StDType& dtype, std::vector<int64_t>& shape,
                                    std::vector<uint8_t>& bytes)>;
std::string rewrite(const std::string& in, const std::string& out, const Mutation& mutate) {
  const SafetensorsFile f = SafetensorsFile::open(in);
  SafetensorsWriter w;
  for (const TensorInfo& t : f.tensors()) {
    std::string name = t.name;
    StDType dtype = t.dtype;
    std::vector<int64_t> shape = t.shape;
    std::vector<uint8_t> bytes(f.data(t), f.data(t) + t.nbytes());
    if (!mutate(name, dtype, shape, bytes)) continue;
    w.add_copy(name, dtype, shape, bytes.data());
  }
  w.write(out);
  return out;
}

TEST(CheckpointMoe, TensorNamesOfBothConventions) {
  EXPECT_EQ(per_expert_tensor_name(kKimiPrefix, 5, "w1", "weight_packed"),
            "language_model.model.layers.3.block_sparse_moe.experts.5.w1.weight_packed");
  EXPECT_EQ(fused_tensor_name(kGptPrefix, "gate_up_proj_blocks"),
            "model.layers.7.mlp.experts.gate_up_proj_blocks");
}

TEST(CheckpointMoe, KimiAndGptOssLoadIntoIdenticalCanonicalWeights) {
  TempDir dir;
  for (bool with_bias : {false, true}) {
    SCOPED_TRACE(with_bias ? "with bias" : "no bias");
    const MoeWeights original = random_weights(kE, 0, kH, kI, with_bias, 11);
    // GPT-OSS carries biases; the Kimi-K3 convention has none.
    const std::string gpt = write_checkpoint(dir, "gpt.safetensors", kGptPrefix, original, ExpertConvention::kFused);
    const Checkpoint gpt_ckpt = Checkpoint::open(gpt);
    const auto gpt_layers = find_moe_layers(gpt_ckpt);
    ASSERT_EQ(gpt_layers.size(), 1u);
    EXPECT_EQ(gpt_layers[0].prefix, kGptPrefix);
    EXPECT_EQ(gpt_layers[0].layer_index, 7);
    EXPECT_EQ(gpt_layers[0].convention, ExpertConvention::kFused);
    EXPECT_EQ(gpt_layers[0].num_experts, kE);
    EXPECT_EQ(gpt_layers[0].hidden, kH);
    EXPECT_EQ(gpt_layers[0].intermediate, kI);
    EXPECT_EQ(gpt_layers[0].has_bias, with_bias);
    const MoeWeights from_gpt = load_moe_layer(gpt_ckpt, gpt_layers[0], 0, 1);
    EXPECT_TRUE(weights_equal(from_gpt, original)) << "GPT-OSS de-interleaving";

    if (with_bias) continue;
    const std::string kimi = write_checkpoint(dir, "kimi.safetensors", kKimiPrefix, original, ExpertConvention::kPerExpert);
    const Checkpoint kimi_ckpt = Checkpoint::open(kimi);
    const auto kimi_layers = find_moe_layers(kimi_ckpt);
    ASSERT_EQ(kimi_layers.size(), 1u);
    EXPECT_EQ(kimi_layers[0].layer_index, 3);
    EXPECT_EQ(kimi_layers[0].convention, ExpertConvention::kPerExpert);
    EXPECT_EQ(kimi_layers[0].num_experts, kE);
    const MoeWeights from_kimi = load_moe_layer(kimi_ckpt, kimi_layers[0], 0, 1);
    EXPECT_TRUE(weights_equal(from_kimi, original));
    EXPECT_TRUE(weights_equal(from_kimi, from_gpt));
  }
}

TEST(CheckpointMoe, GptOssRowsAreDeinterleavedEvenGateOddUp) {
  // Hand-built fused tensor: row r of expert e filled with byte (e * 16 + r); after loading, gate
  // row i must hold 2i and up row i must hold 2i + 1.
  TempDir dir;
  const int64_t E = 2, H = 32, I = 32, N = 2 * I;
  std::vector<uint8_t> blocks(E * N * H / 2), scales(E * N * H / 32), down(E * H * I / 2), down_sf(E * H * I / 32);
  std::vector<uint16_t> bias(E * N), down_bias(E * H);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t r = 0; r < N; ++r) {
      std::memset(&blocks[(e * N + r) * H / 2], static_cast<int>(e * 100 + r), H / 2);
      scales[e * N + r] = static_cast<uint8_t>(e * 100 + r);
      bias[e * N + r] = static_cast<uint16_t>(e * 1000 + r);
    }
  }
  SafetensorsWriter w;
  w.add("m.experts.gate_up_proj_blocks", StDType::kU8, {E, N, H / 32, 16}, blocks.data());
  w.add("m.experts.gate_up_proj_scales", StDType::kU8, {E, N, H / 32}, scales.data());
  w.add("m.experts.gate_up_proj_bias", StDType::kBF16, {E, N}, bias.data());
  w.add("m.experts.down_proj_blocks", StDType::kU8, {E, H, I / 2}, down.data());  // 3-D form
  w.add("m.experts.down_proj_scales", StDType::kU8, {E, H, I / 32}, down_sf.data());
  w.add("m.experts.down_proj_bias", StDType::kBF16, {E, H}, down_bias.data());
  w.write(dir.file("m.safetensors"));
  const Checkpoint ckpt = Checkpoint::open(dir.file("m.safetensors"));
  const auto layers = find_moe_layers(ckpt);
  ASSERT_EQ(layers.size(), 1u);
  EXPECT_EQ(layers[0].layer_index, -1);
  const MoeWeights c = load_moe_layer(ckpt, layers[0], 1, 2);  // rank 1 of 2: expert 1 only
  ASSERT_EQ(c.num_local_experts, 1);
  EXPECT_EQ(c.first_expert, 1);
  for (int64_t i = 0; i < I; ++i) {
    EXPECT_EQ(c.w13.as<uint8_t>()[i * H / 2], 100 + 2 * i) << "gate row " << i;
    EXPECT_EQ(c.w13.as<uint8_t>()[(I + i) * H / 2 + H / 2 - 1], 100 + 2 * i + 1) << "up row " << i;
    EXPECT_EQ(c.w13_sf.as<uint8_t>()[i], 100 + 2 * i);
    EXPECT_EQ(c.w13_sf.as<uint8_t>()[I + i], 100 + 2 * i + 1);
    EXPECT_EQ(c.w13_bias.as<uint16_t>()[i], 1000 + 2 * i);
    EXPECT_EQ(c.w13_bias.as<uint16_t>()[I + i], 1000 + 2 * i + 1);
  }
}

TEST(CheckpointMoe, ExpertParallelSliceEqualsTheFullLoadSlice) {
  TempDir dir;
  const MoeWeights original = random_weights(kE, 0, kH, kI, true, 5);
  const MoeWeights no_bias = random_weights(kE, 0, kH, kI, false, 5);
  const Checkpoint gpt = Checkpoint::open(write_checkpoint(dir, "g.safetensors", kGptPrefix, original, ExpertConvention::kFused));
  const Checkpoint kimi = Checkpoint::open(write_checkpoint(dir, "k.safetensors", kKimiPrefix, no_bias, ExpertConvention::kPerExpert));
  for (const Checkpoint* ckpt : {&gpt, &kimi}) {
    const MoeLayerInfo layer = find_moe_layers(*ckpt)[0];
    const MoeWeights full = load_moe_layer(*ckpt, layer, 0, 1);
    for (int ep_size : {1, 2, 4, 8}) {
      for (int r = 0; r < ep_size; ++r) {
        SCOPED_TRACE(testing::Message() << ckpt->path() << " rank " << r << " of " << ep_size);
        const MoeWeights part = load_moe_layer(*ckpt, layer, r, ep_size);
        const int64_t el = kE / ep_size;
        EXPECT_EQ(part.num_local_experts, el);
        EXPECT_EQ(part.first_expert, r * el);
        // The rank's draw from the generator equals its slice of the checkpoint...
        const MoeWeights expect = random_weights(el, r * el, kH, kI, layer.has_bias, 5);
        EXPECT_TRUE(weights_equal(part, expect));
        // ...and its slice of the full load.
        auto slice_equal = [&](const Buffer& a, const Buffer& b) {
          const int64_t per = b.size() / kE;
          return a.size() == per * el && std::memcmp(a.data(), b.as<uint8_t>() + r * el * per, a.size()) == 0;
        };
        EXPECT_TRUE(slice_equal(part.w13, full.w13));
        EXPECT_TRUE(slice_equal(part.w13_sf, full.w13_sf));
        EXPECT_TRUE(slice_equal(part.w2, full.w2));
        EXPECT_TRUE(slice_equal(part.w2_sf, full.w2_sf));
        if (layer.has_bias) EXPECT_TRUE(slice_equal(part.w13_bias, full.w13_bias));
      }
    }
  }
}

// Fraction of the pages of [p, p + bytes) mapped in this process's page table (bit 63 of
// /proc/self/pagemap), i.e. pages this process has touched (plus the kernel's fault-around of at
// most 64 KiB next to a touched page); -1 when pagemap cannot be read.
double mapped_fraction(const uint8_t* p, int64_t bytes) {
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) / page;
  const uintptr_t last = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes) - 1) / page;
  const int fd = ::open("/proc/self/pagemap", O_RDONLY);
  if (fd < 0) return -1.0;
  std::vector<uint64_t> entries(last - first + 1);
  const ssize_t want = static_cast<ssize_t>(entries.size() * sizeof(uint64_t));
  const ssize_t got = ::pread(fd, entries.data(), static_cast<size_t>(want), static_cast<off_t>(first * sizeof(uint64_t)));
  ::close(fd);
  if (got != want) return -1.0;
  constexpr uint64_t kPresent = uint64_t{1} << 63;
  int64_t present = 0;
  for (uint64_t e : entries) present += (e & kPresent) != 0;
  return static_cast<double>(present) / static_cast<double>(entries.size());
}

TEST(CheckpointMoe, ExpertParallelLoadReadsOnlyTheRanksPages) {
  // Rank 1 of 2 loads its experts from a fresh mapping: the pages of its experts get mapped, the
  // pages of rank 0's experts must not (the 5% allowance covers the kernel's fault-around next
  // to the rank's first tensor and the header page).
  TempDir dir;
  const int64_t H = 1024, I = 1024;
  const MoeWeights w = random_weights(kE, 0, H, I, false, 17);
  const std::string path = write_checkpoint(dir, "k.safetensors", kKimiPrefix, w, ExpertConvention::kPerExpert);
  const Checkpoint ckpt = Checkpoint::open(path);
  // Bytes of experts [first, first + count) whose pages are mapped (-1 without pagemap).
  auto mapped = [&](int64_t first, int64_t count) {
    double sum = 0;
    for (int64_t e = first; e < first + count; ++e) {
      for (const char* m : {"w1", "w3", "w2"}) {
        for (const char* k : {"weight_packed", "weight_scale"}) {
          const auto ref = ckpt.get(per_expert_tensor_name(kKimiPrefix, e, m, k));
          const double f = mapped_fraction(ref.data(), ref.info->nbytes());
          if (f < 0) return -1.0;
          sum += f * static_cast<double>(ref.info->nbytes());
        }
      }
    }
    return sum;
  };
  auto bytes_of = [&](int64_t first, int64_t count) {
    double sum = 0;
    for (int64_t e = first; e < first + count; ++e)
      for (const char* m : {"w1", "w3", "w2"})
        for (const char* k : {"weight_packed", "weight_scale"})
          sum += static_cast<double>(ckpt.get(per_expert_tensor_name(kKimiPrefix, e, m, k)).info->nbytes());
    return sum;
  };
  const double before = mapped(0, kE);
  if (before < 0) GTEST_SKIP() << "/proc/self/pagemap is not readable here";
  EXPECT_LT(before / bytes_of(0, kE), 0.05) << "opening and validating reads the header only";
  const MoeWeights part = load_moe_layer(ckpt, find_moe_layers(ckpt)[0], 1, 2);
  EXPECT_EQ(part.first_expert, kE / 2);
  EXPECT_GT(mapped(kE / 2, kE / 2) / bytes_of(kE / 2, kE / 2), 0.99) << "the rank's experts were read";
  EXPECT_LT(mapped(0, kE / 2) / bytes_of(0, kE / 2), 0.05) << "other ranks' experts must not be read";
}

TEST(CheckpointMoe, ShardedKimiCheckpointWithSeveralLayers) {
  TempDir dir;
  std::vector<MoeWeights> layers;
  std::string weight_map;
  for (int L = 0; L < 3; ++L) {
    layers.push_back(random_weights(4, 0, 64, 32, false, 100 + L));
    const std::string prefix = "language_model.model.layers." + std::to_string(10 - L) + ".block_sparse_moe";
    const std::string shard = "model-0000" + std::to_string(L + 1) + "-of-00003.safetensors";
    write_checkpoint(dir, shard, prefix, layers.back(), ExpertConvention::kPerExpert);
    const SafetensorsFile written = SafetensorsFile::open(dir.file(shard));
    for (const auto& name : written.tensors()) {
      weight_map += (weight_map.empty() ? "" : ",") + std::string("\"") + name.name + "\":\"" + shard + "\"";
    }
  }
  testing_ckpt::write_bytes(dir.file(kSafetensorsIndexName), [&] {
    const std::string s = "{\"weight_map\":{" + weight_map + "}}";
    return std::vector<uint8_t>(s.begin(), s.end());
  }());
  const Checkpoint ckpt = Checkpoint::open(dir.path().string());
  const auto found = find_moe_layers(ckpt);
  ASSERT_EQ(found.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(found[i].layer_index, 8 + i) << "ordered by layer index";
    EXPECT_TRUE(weights_equal(load_moe_layer(ckpt, found[i], 0, 1), layers[2 - i]));
  }
}

// A UE8M0 NaN byte (0xFF) poisons every token of its expert: loading rejects it, naming the
// checkpoint tensor, the global expert and the position there, unless allow_nan_scales is set.
// Only the loaded rank's experts are checked.
TEST(CheckpointMoe, NanScalesAreRejectedAtLoadNamingTensorAndExpert) {
  TempDir dir;
  constexpr int64_t kNanExpert = 5, kRow = 2, kBlock = 1;
  constexpr int64_t kL1Groups = kH / kScaleBlock, kL2Groups = kI / kScaleBlock;
  struct Case {
    const char* what;
    bool up;          // true: up row kRow of w13 (canonical row I + kRow); false: w2 row kRow
    ExpertConvention convention;
    std::vector<std::string> parts;
  };
  const Case cases[] = {
      {"kimi up", true, ExpertConvention::kPerExpert,
       {"experts.5.w3.weight_scale'", "scale byte 0xFF (NaN) in expert 5, row 2, block 1",
        "allow_nan_scales"}},
      {"kimi down", false, ExpertConvention::kPerExpert,
       {"experts.5.w2.weight_scale'", "expert 5, row 2, block 1"}},
      {"gpt-oss up (odd interleaved row)", true, ExpertConvention::kFused,
       {"experts.gate_up_proj_scales'", "expert 5, row 5, block 1"}},
      {"gpt-oss down", false, ExpertConvention::kFused,
       {"experts.down_proj_scales'", "expert 5, row 2, block 1"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const bool fused = c.convention == ExpertConvention::kFused;
    MoeWeights w = random_weights(kE, 0, kH, kI, fused, 17);
    if (c.up) {
      w.w13_sf.as<uint8_t>()[(kNanExpert * 2 * kI + kI + kRow) * kL1Groups + kBlock] = kUe8m0NaN;
    } else {
      w.w2_sf.as<uint8_t>()[(kNanExpert * kH + kRow) * kL2Groups + kBlock] = kUe8m0NaN;
    }
    const Checkpoint ckpt = Checkpoint::open(write_checkpoint(
        dir, fused ? "g.safetensors" : "k.safetensors", fused ? kGptPrefix : kKimiPrefix, w,
        c.convention));
    const MoeLayerInfo layer = find_moe_layers(ckpt).at(0);
    EXPECT_TRUE(throws_error([&] { load_moe_layer(ckpt, layer, 0, 1); }, ErrorCode::kFormat, c.parts));
    EXPECT_TRUE(throws_error([&] { load_moe_layer(ckpt, layer, 1, 2); }, ErrorCode::kFormat, c.parts))
        << "rank 1 of 2 holds expert 5";
    EXPECT_NO_THROW(load_moe_layer(ckpt, layer, 0, 2)) << "rank 0 of 2 does not hold expert 5";
    LoadOptions allow;
    allow.allow_nan_scales = true;
    EXPECT_TRUE(weights_equal(load_moe_layer(ckpt, layer, 0, 1, allow), w));
  }
}

// ---------------------------------------------------------------------------------------------
// Through the CPU layer
// ---------------------------------------------------------------------------------------------
TEST(CheckpointMoe, LoadedWeightsRunThroughTheCpuLayer) {
  TempDir dir;
  LayerConfig config;
  config.shape = {256, 128, 8, 2};
  config.activation = Activation::swiglu_oai();
  const MoeWeights original = synthetic_weights(config, 21, /*with_bias=*/true);
  const Checkpoint gpt = Checkpoint::open(write_checkpoint(dir, "g.safetensors", kGptPrefix, original, ExpertConvention::kFused));
  const MoeWeights loaded = load_moe_layer(gpt, find_moe_layers(gpt)[0], 0, 1);
  ASSERT_TRUE(weights_equal(loaded, original));

  const int64_t T = 16, H = config.shape.hidden, K = config.shape.top_k;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> x(static_cast<size_t>(T * H));
  for (auto& v : x) v = bf16_from_f32(normal(rng));
  std::vector<int32_t> idx(static_cast<size_t>(T * K));
  std::vector<float> wts(static_cast<size_t>(T * K), 0.5f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) idx[t * K + k] = static_cast<int32_t>((t + 3 * k) % config.shape.num_experts);
  std::vector<uint16_t> y_loaded(static_cast<size_t>(T * H)), y_orig(static_cast<size_t>(T * H));
  reference_forward(config, loaded, x.data(), idx.data(), wts.data(), T, y_loaded.data());
  reference_forward(config, original, x.data(), idx.data(), wts.data(), T, y_orig.data());
  EXPECT_EQ(std::memcmp(y_loaded.data(), y_orig.data(), y_orig.size() * 2), 0);
  // The result is a real MoE output: finite, not all zero, and close to the FP64 ideal.
  std::vector<double> ideal(static_cast<size_t>(T * H)), y64(static_cast<size_t>(T * H));
  ideal_forward(config, loaded, x.data(), idx.data(), wts.data(), T, ideal.data());
  int64_t nonzero = 0;
  for (size_t i = 0; i < y64.size(); ++i) {
    y64[i] = bf16_to_f32(y_loaded[i]);
    ASSERT_TRUE(std::isfinite(y64[i]));
    nonzero += y64[i] != 0.0;
  }
  EXPECT_GT(nonzero, static_cast<int64_t>(y64.size()) / 2);
  EXPECT_LT(diff_metric(y64.data(), ideal.data(), T * H), 0.05);

  // Kimi-K3 convention (no bias, situ), rank 1 of 2: per-slot outputs of the rank's experts equal
  // the single-rank run's.
  LayerConfig kc = config;
  kc.activation = Activation::situ();
  const MoeWeights kimi_w = synthetic_weights(kc, 22, false);
  const Checkpoint kimi = Checkpoint::open(write_checkpoint(dir, "k.safetensors", kKimiPrefix, kimi_w, ExpertConvention::kPerExpert));
  const MoeLayerInfo layer = find_moe_layers(kimi)[0];
  ReferenceTrace full_trace, rank_trace;
  reference_forward(kc, load_moe_layer(kimi, layer, 0, 1), x.data(), idx.data(), wts.data(), T, y_orig.data(), &full_trace);
  LayerConfig rc = kc;
  rc.ep_size = 2;
  rc.ep_rank = 1;
  reference_forward(rc, load_moe_layer(kimi, layer, 1, 2), x.data(), idx.data(), wts.data(), T, y_loaded.data(), &rank_trace);
  int64_t checked = 0;
  for (int64_t s = 0; s < T * K; ++s) {
    if (idx[s] < config.shape.num_experts / 2) continue;
    ++checked;
    EXPECT_EQ(std::memcmp(&rank_trace.o[s * H], &full_trace.o[s * H], H * 2), 0) << "slot " << s;
  }
  EXPECT_GT(checked, 0);
}

// ---------------------------------------------------------------------------------------------
// Malformed layers (docs/reliability.md, "MoE expert tensors")
// ---------------------------------------------------------------------------------------------
struct BadLayer {
  const char* kind;
  ExpertConvention convention;
  Mutation mutate;
  ErrorCode code;
  std::vector<std::string> parts;
  int ep_rank = 0, ep_size = 1;
};

bool ends(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::vector<BadLayer> bad_layers() {
  const std::string k = kKimiPrefix + ".experts.";
  const std::string g = kGptPrefix + ".experts.";
  auto keep = [](std::string&, StDType&, std::vector<int64_t>&, std::vector<uint8_t>&) { return true; };
  std::vector<BadLayer> t;
  t.push_back({"scale_missing", ExpertConvention::kPerExpert,
               [k](std::string& n, StDType&, std::vector<int64_t>&, std::vector<uint8_t>&) {
                 return n != k + "2.w3.weight_scale";
               },
               ErrorCode::kFormat, {"tensor '" + k + "2.w3.weight_packed'", "missing partner tensor '" + k + "2.w3.weight_scale'"}});
  t.push_back({"weight_missing", ExpertConvention::kPerExpert,
               [k](std::string& n, StDType&, std::vector<int64_t>&, std::vector<uint8_t>&) {
                 return n != k + "1.w2.weight_packed";
               },
               ErrorCode::kFormat, {"tensor '" + k + "1.w2.weight_scale'", "scale without its weight"}});
  t.push_back({"matrix_missing", ExpertConvention::kPerExpert,
               [k](std::string& n, StDType&, std::vector<int64_t>&, std::vector<uint8_t>&) {
                 return n.rfind(k + "4.w3.", 0) != 0;
               },
               ErrorCode::kFormat, {"expert 4 has no w3 tensors"}});
  t.push_back({"missing_expert", ExpertConvention::kPerExpert,
               [k](std::string& n, StDType&, std::vector<int64_t>&, std::vector<uint8_t>&) {
                 return n.rfind(k + "5.", 0) != 0;
               },
               ErrorCode::kFormat, {"missing expert 5", "'" + k + "5.w1.weight_packed' not found"}});
  t.push_back({"wrong_dtype", ExpertConvention::kPerExpert,
               [k](std::string& n, StDType& d, std::vector<int64_t>&, std::vector<uint8_t>&) {
                 if (n == k + "3.w1.weight_packed") d = StDType::kI8;
                 return true;
               },
               ErrorCode::kFormat, {"tensor '" + k + "3.w1.weight_packed'", "wrong dtype: expected U8, got I8"}});
  t.push_back({"wrong_scale_dtype", ExpertConvention::kPerExpert,
               [k](std::string& n, StDType& d, std::vector<int64_t>& s, std::vector<uint8_t>& b) {
                 if (n == k + "0.w2.weight_scale") { d = StDType::kBF16; s.back() /= 2; }
                 return true;
               },
               ErrorCode::kFormat, {"tensor '" + k + "0.w2.weight_scale'", "expected U8 or F8_E8M0, got BF16"}});
  t.push_back({"inconsistent_expert_shapes", ExpertConvention::kPerExpert,
               [k](std::string& n, StDType&, std::vector<int64_t>& s, std::vector<uint8_t>& b) {
                 if (n == k + "6.w2.weight_packed") { s = {kH / 2, kI}; }
                 return true;
               },
               ErrorCode::kFormat, {"tensor '" + k + "6.w2.weight_packed'", "expected shape [128, 32]", "got [64, 64]"}});
  t.push_back({"inconsistent_scale_shape", ExpertConvention::kPerExpert,
               [k](std::string& n, StDType&, std::vector<int64_t>& s, std::vector<uint8_t>& b) {
                 if (n == k + "7.w1.weight_scale") { s = {kI / 2, kH / 16}; }
                 return true;
               },
               ErrorCode::kFormat, {"tensor '" + k + "7.w1.weight_scale'", "expected shape [64, 4]"}});
  t.push_back({"hidden_not_multiple_of_32", ExpertConvention::kPerExpert,
               [k](std::string& n, StDType&, std::vector<int64_t>& s, std::vector<uint8_t>& b) {
                 if (n == k + "0.w1.weight_packed") { s = {kI * 4, 8}; }
                 return true;
               },
               ErrorCode::kFormat, {"tensor '" + k + "0.w1.weight_packed'", "H = 16 must be a positive multiple of 32"}});
  t.push_back({"weight_shape_mismatch", ExpertConvention::kPerExpert,
               [k](std::string& n, StDType&, std::vector<int64_t>&, std::vector<uint8_t>&) { return true; },
               ErrorCode::kFormat, {}});  // set below: adds a wrong weight_shape tensor
  t.push_back({"mixed_conventions", ExpertConvention::kPerExpert,
               [k](std::string& n, StDType&, std::vector<int64_t>&, std::vector<uint8_t>&) {
                 if (n == k + "0.w1.weight_scale") n = k + "gate_up_proj_blocks";
                 return true;
               },
               ErrorCode::kFormat, {"mixes per-expert (Kimi-K3) and fused (GPT-OSS)"}});
  t.push_back({"ep_size_does_not_divide", ExpertConvention::kPerExpert, keep, ErrorCode::kInvalidArgument,
               {"E = 8 experts is not divisible by EP size 3"}, 0, 3});
  t.push_back({"ep_rank_out_of_range", ExpertConvention::kPerExpert, keep, ErrorCode::kInvalidArgument,
               {"EP rank must be in [0, 2), got 2"}, 2, 2});
  t.push_back({"gpt_scales_missing", ExpertConvention::kFused,
               [g](std::string& n, StDType&, std::vector<int64_t>&, std::vector<uint8_t>&) {
                 return n != g + "down_proj_scales";
               },
               ErrorCode::kFormat, {"tensor '" + g + "down_proj_blocks'", "missing partner tensor '" + g + "down_proj_scales'"}});
  t.push_back({"gpt_bias_unpaired", ExpertConvention::kFused,
               [g](std::string& n, StDType&, std::vector<int64_t>&, std::vector<uint8_t>&) {
                 return n != g + "down_proj_bias";
               },
               ErrorCode::kFormat, {"tensor '" + g + "gate_up_proj_bias'", "biases come in pairs"}});
  t.push_back({"gpt_blocks_missing", ExpertConvention::kFused,
               [g](std::string& n, StDType&, std::vector<int64_t>&, std::vector<uint8_t>&) {
                 return n.rfind(g + "gate_up_proj_", 0) != 0 || ends(n, "_scales");
               },
               ErrorCode::kFormat, {"missing partner tensor '" + g + "gate_up_proj_blocks'"}});
  t.push_back({"gpt_bias_wrong_dtype", ExpertConvention::kFused,
               [g](std::string& n, StDType& d, std::vector<int64_t>&, std::vector<uint8_t>&) {
                 if (n == g + "down_proj_bias") d = StDType::kF16;
                 return true;
               },
               ErrorCode::kFormat, {"tensor '" + g + "down_proj_bias'", "expected BF16, got F16"}});
  t.push_back({"gpt_down_inconsistent", ExpertConvention::kFused,
               [g](std::string& n, StDType&, std::vector<int64_t>& s, std::vector<uint8_t>&) {
                 if (n == g + "down_proj_blocks") s = {kE, kH / 2, kI / 16, 16};
                 return true;
               },
               ErrorCode::kFormat, {"tensor '" + g + "down_proj_blocks'", "expected shape [8, 128, 2, 16]"}});
  t.push_back({"gpt_bad_block_shape", ExpertConvention::kFused,
               [g](std::string& n, StDType&, std::vector<int64_t>& s, std::vector<uint8_t>&) {
                 if (n == g + "gate_up_proj_blocks") s = {kE, 2 * kI, kH / 16, 8};
                 return true;
               },
               ErrorCode::kFormat, {"tensor '" + g + "gate_up_proj_blocks'", "expected shape [E, 2I, H/32, 16]"}});
  t.push_back({"gpt_scale_shape", ExpertConvention::kFused,
               [g](std::string& n, StDType&, std::vector<int64_t>& s, std::vector<uint8_t>&) {
                 if (n == g + "gate_up_proj_scales") s = {kE, kI, 2 * kH / 32};
                 return true;
               },
               ErrorCode::kFormat, {"tensor '" + g + "gate_up_proj_scales'", "expected shape [8, 128, 4]", "got [8, 64, 8]"}});
  t.push_back({"gpt_ep_not_divisible", ExpertConvention::kFused, keep, ErrorCode::kInvalidArgument,
               {"E = 8 experts is not divisible by EP size 5"}, 1, 5});
  return t;
}

TEST(CheckpointMalformed, EveryLayerDefectGetsItsOwnError) {
  TempDir dir;
  const MoeWeights w = random_weights(kE, 0, kH, kI, false, 9);
  const MoeWeights wb = random_weights(kE, 0, kH, kI, true, 9);
  const std::string kimi = write_checkpoint(dir, "kimi.safetensors", kKimiPrefix, w, ExpertConvention::kPerExpert);
  const std::string gpt = write_checkpoint(dir, "gpt.safetensors", kGptPrefix, wb, ExpertConvention::kFused);
  auto table = bad_layers();
  ASSERT_GE(table.size(), 12u);
  for (BadLayer& bad : table) {
    SCOPED_TRACE(bad.kind);
    const std::string out = dir.file(std::string(bad.kind) + ".safetensors");
    const std::string& in = bad.convention == ExpertConvention::kPerExpert ? kimi : gpt;
    if (std::string(bad.kind) == "weight_shape_mismatch") {
      // compressed-tensors records the unpacked shape; a wrong record is rejected.
      rewrite(in, out, bad.mutate);
      SafetensorsWriter extra;
      const SafetensorsFile f = SafetensorsFile::open(out);
      for (const TensorInfo& t : f.tensors()) extra.add(t.name, t.dtype, t.shape, f.data(t));
      const int64_t shape_rec[2] = {kI, kH / 2};  // K must be H, not H/2
      const std::string name = kKimiPrefix + ".experts.2.w1.weight_shape";
      extra.add(name, StDType::kI64, {2}, shape_rec);
      extra.write(out + ".2");
      bad.parts = {"tensor '" + name + "'", "records [64, 64], expected [64, 128]"};
      EXPECT_TRUE(throws_error([&] { find_moe_layers(Checkpoint::open(out + ".2")); }, bad.code, bad.parts));
      continue;
    }
    rewrite(in, out, bad.mutate);
    std::vector<std::string> parts = bad.parts;
    parts.push_back(out);
    EXPECT_TRUE(throws_error(
        [&] {
          const Checkpoint ckpt = Checkpoint::open(out);
          const auto layers = find_moe_layers(ckpt);
          if (layers.size() != 1) throw std::runtime_error("expected exactly one layer");
          load_moe_layer(ckpt, layers[0], bad.ep_rank, bad.ep_size);
        },
        bad.code, parts));
  }
}

TEST(CheckpointMalformed, StaleLayerInfoCannotReadOutOfBounds) {
  // A MoeLayerInfo whose dimensions disagree with the tensors (e.g. from another checkpoint) is
  // rejected before any copy.
  TempDir dir;
  const MoeWeights w = random_weights(kE, 0, kH, kI, false, 2);
  const Checkpoint ckpt = Checkpoint::open(write_checkpoint(dir, "k.safetensors", kKimiPrefix, w, ExpertConvention::kPerExpert));
  MoeLayerInfo info = find_moe_layers(ckpt)[0];
  info.hidden *= 2;
  EXPECT_TRUE(throws_error([&] { load_moe_layer(ckpt, info, 0, 1); }, ErrorCode::kFormat,
                           {"w1.weight_packed'", "expected 8192 for the layer's dimensions"}));
  info = find_moe_layers(ckpt)[0];
  info.num_experts = 16;
  EXPECT_TRUE(throws_error([&] { load_moe_layer(ckpt, info, 1, 2); }, ErrorCode::kFormat, {"experts.8.w1.weight_packed' not found"}));
}

}  // namespace
}  // namespace megamoe
