// Prepared checkpoints (write_prepared_checkpoint / load_prepared_layer), inspection statistics,
// and the `megamoe inspect` / `megamoe prepare` commands as a user runs them.
#include <gtest/gtest.h>

#include <filesystem>

#include <nlohmann/json.hpp>

#include "megamoe/checkpoint.hpp"
#include "megamoe/prepare.hpp"
#include "test_checkpoint_fixtures.hpp"

namespace megamoe {
namespace {

using testing_ckpt::random_weights;
using testing_ckpt::TempDir;
using testing_ckpt::throws_error;
using testing_ckpt::weights_equal;
using test::CliResult;
using test::cli_path;
using test::run_cli;

constexpr int64_t kH = 256, kI = 128, kE = 8;

std::string prefix_of(int layer) {
  return "language_model.model.layers." + std::to_string(layer) + ".block_sparse_moe";
}

// A Kimi-style checkpoint of `layers` layers (layer L drawn with seed 40 + L).
std::string write_kimi(const TempDir& dir, int layers, bool gpt_oss = false) {
  SafetensorsWriter w;
  for (int L = 0; L < layers; ++L) {
    const MoeWeights weights = random_weights(kE, 0, kH, kI, gpt_oss, 40 + L);
    add_moe_layer(w, gpt_oss ? "model.layers." + std::to_string(L) + ".mlp" : prefix_of(L), weights,
                  gpt_oss ? ExpertConvention::kFused : ExpertConvention::kPerExpert);
  }
  const std::string path = dir.file(gpt_oss ? "gpt.safetensors" : "kimi.safetensors");
  w.write(path);
  return path;
}

TEST(PreparedCheckpoint, EveryLayoutRoundTripsThroughAFile) {
  TempDir dir;
  const Checkpoint ckpt = Checkpoint::open(write_kimi(dir, 2));
  const auto layers = find_moe_layers(ckpt);
  for (const std::string& layout : layout_names()) {
    if (layout.rfind("test-", 0) == 0) continue;  // layouts registered by other tests
    SCOPED_TRACE(layout);
    const std::string out = dir.file(layout + ".safetensors");
    PreparedCheckpointOptions opts;
    opts.backend = layout;
    opts.ep_rank = 1;
    opts.ep_size = 2;
    const PreparedCheckpointReport r = write_prepared_checkpoint(ckpt, out, opts);
    EXPECT_EQ(r.layers, 2);
    EXPECT_EQ(r.layout, layout);
    const SafetensorsFile f = SafetensorsFile::open(out);
    EXPECT_EQ(f.file_bytes(), r.file_bytes);
    EXPECT_EQ(f.metadata().at("megamoe.layout"), layout);
    ASSERT_EQ(prepared_layer_prefixes(f), (std::vector<std::string>{prefix_of(0), prefix_of(1)}));
    for (const auto& layer : layers) {
      MoeWeights w = load_prepared_layer(f, layer.prefix);
      EXPECT_EQ(w.layout, layout);
      EXPECT_EQ(w.first_expert, kE / 2);
      MoeWeights expected = load_moe_layer(ckpt, layer, 1, 2);
      prepare(expected, layout);
      EXPECT_TRUE(weights_equal(w, expected)) << "file bytes equal in-memory preparation";
      unprepare(w);
      EXPECT_TRUE(weights_equal(w, load_moe_layer(ckpt, layer, 1, 2)));
    }
  }
}

TEST(PreparedCheckpoint, BiasesAndCanonicalShapes) {
  TempDir dir;
  const Checkpoint ckpt = Checkpoint::open(write_kimi(dir, 1, /*gpt_oss=*/true));
  const std::string out = dir.file("ref.safetensors");
  write_prepared_checkpoint(ckpt, out, {});
  const SafetensorsFile f = SafetensorsFile::open(out);
  EXPECT_EQ(f.get("model.layers.0.mlp.experts.w13").shape, (std::vector<int64_t>{kE, 2 * kI, kH / 2}));
  EXPECT_EQ(f.get("model.layers.0.mlp.experts.w13_bias").dtype, StDType::kBF16);
  EXPECT_EQ(f.data_offset() % 8, 0);
  EXPECT_EQ((f.data_offset() + f.get("model.layers.0.mlp.experts.w13_bias").data_begin) % 2, 0);
  const MoeWeights w = load_prepared_layer(f, "model.layers.0.mlp");
  EXPECT_TRUE(weights_equal(w, load_moe_layer(ckpt, find_moe_layers(ckpt)[0], 0, 1)));
}

TEST(PreparedCheckpoint, LayersAreStreamedOneAtATime) {
  TempDir dir;
  const Checkpoint ckpt = Checkpoint::open(write_kimi(dir, 4));
  PreparedCheckpointOptions opts;
  opts.backend = "blackwell-interop";
  opts.prepare.scratch_bytes = 0;
  int64_t last_done = 0, total = 0;
  opts.progress = [&](int64_t d, int64_t t) {
    last_done = d;
    total = t;
  };
  const PreparedCheckpointReport r = write_prepared_checkpoint(ckpt, dir.file("o.safetensors"), opts);
  EXPECT_EQ(r.layers, 4);
  EXPECT_EQ(r.weight_bytes, 4 * r.max_layer_bytes);
  EXPECT_EQ(last_done, total);
  EXPECT_EQ(total, r.file_bytes);
  // One layer plus one expert of scratch, never the whole model.
  const int64_t one_expert = 2 * kI * kH / 2;
  EXPECT_LE(r.peak_host_bytes, r.max_layer_bytes + one_expert);
  EXPECT_LT(r.peak_host_bytes, 2 * r.max_layer_bytes);
  EXPECT_EQ(r.peak_prepare_extra, one_expert);
}

TEST(PreparedCheckpoint, BadRequestsFailBeforeWriting) {
  TempDir dir;
  const Checkpoint ckpt = Checkpoint::open(write_kimi(dir, 1));
  const std::string out = dir.file("never.safetensors");
  PreparedCheckpointOptions opts;
  opts.ep_size = 3;
  EXPECT_TRUE(throws_error([&] { write_prepared_checkpoint(ckpt, out, opts); }, ErrorCode::kInvalidArgument,
                           {"E = 8 experts is not divisible by EP size 3"}));
  opts.ep_size = 2;
  opts.ep_rank = 2;
  EXPECT_TRUE(throws_error([&] { write_prepared_checkpoint(ckpt, out, opts); }, ErrorCode::kInvalidArgument,
                           {"--ep-rank must be in [0, --ep-size), got rank 2 of 2"}));
  opts.ep_rank = 0;
  opts.prefixes = {"model.layers.9.mlp"};
  EXPECT_TRUE(throws_error([&] { write_prepared_checkpoint(ckpt, out, opts); }, ErrorCode::kInvalidArgument,
                           {"no MoE layer with prefix 'model.layers.9.mlp'"}));
  opts.prefixes.clear();
  opts.backend = "tpu";
  EXPECT_TRUE(throws_error([&] { write_prepared_checkpoint(ckpt, out, opts); }, ErrorCode::kInvalidArgument,
                           {"unknown backend 'tpu'"}));
  EXPECT_FALSE(std::filesystem::exists(out));
  // Dims the layout refuses (sm90: H a multiple of 64): refused before writing.
  SafetensorsWriter w;
  add_moe_layer(w, "m", random_weights(2, 0, 96, 64, false, 1), ExpertConvention::kPerExpert);
  w.write(dir.file("odd.safetensors"));
  opts.backend = "sm90";
  opts.ep_size = 1;
  EXPECT_TRUE(throws_error([&] { write_prepared_checkpoint(Checkpoint::open(dir.file("odd.safetensors")), out, opts); },
                           ErrorCode::kUnsupported, {"sm90 layout: hidden", "got 96"}));
  EXPECT_FALSE(std::filesystem::exists(out));
  // A plain checkpoint is not a prepared one.
  EXPECT_TRUE(throws_error([&] { load_prepared_layer(ckpt.files().front(), prefix_of(0)); }, ErrorCode::kFormat,
                           {"not a megamoe prepared checkpoint"}));
}

TEST(PreparedCheckpoint, MalformedPreparedFilesAreRejected) {
  // Regression (fuzz_safetensors, crash-c2976f91): a prepared-format file without megamoe.layout
  // threw std::out_of_range instead of a megamoe::Error.
  TempDir dir;
  const Checkpoint ckpt = Checkpoint::open(write_kimi(dir, 1));
  const std::string good = dir.file("good.safetensors");
  write_prepared_checkpoint(ckpt, good, {});
  const SafetensorsFile g = SafetensorsFile::open(good);
  const std::string layers = g.metadata().at("megamoe.layers");
  struct Case {
    const char* kind;
    std::function<void(std::map<std::string, std::string>&, bool& drop_w2)> edit;
    std::vector<std::string> parts;
  };
  auto replace = [](std::string s, const std::string& from, const std::string& to) {
    return s.replace(s.find(from), from.size(), to);
  };
  const std::vector<Case> cases = {
      {"missing_layout", [](auto& m, bool&) { m.erase("megamoe.layout"); }, {"metadata lacks megamoe.layout"}},
      {"unknown_layout", [](auto& m, bool&) { m["megamoe.layout"] = "marlin"; }, {"layout 'marlin' is not registered"}},
      {"wrong_format", [](auto& m, bool&) { m["megamoe.format"] = "other/2"; }, {"not a megamoe prepared checkpoint", "'other/2'"}},
      {"layers_not_list", [](auto& m, bool&) { m["megamoe.layers"] = "{}"; }, {"megamoe.layers must be a JSON list"}},
      {"layers_bad_json", [](auto& m, bool&) { m["megamoe.layers"] = "[{"; }, {"megamoe.layers is not valid JSON"}},
      {"float_dim", [&](auto& m, bool&) { m["megamoe.layers"] = replace(layers, "\"hidden\":256", "\"hidden\":1e300"); },
       {"field 'hidden' must be an integer"}},
      {"huge_dims", [&](auto& m, bool&) { m["megamoe.layers"] = replace(layers, "\"hidden\":256", "\"hidden\":4611686018427387904"); },
       {"bad dimensions"}},
      {"missing_field", [&](auto& m, bool&) { m["megamoe.layers"] = replace(layers, "\"bias\":false", "\"bias_\":false"); },
       {"megamoe.layers entry is malformed"}},
      {"dims_disagree_with_tensors", [&](auto& m, bool&) { m["megamoe.layers"] = replace(layers, "\"intermediate\":128", "\"intermediate\":64"); },
       {".experts.w13'", "expected U8[8, 128, 128] for layout 'canonical', got U8[8, 256, 128]"}},
      {"missing_tensor", [](auto&, bool& drop) { drop = true; }, {".experts.w2'", "not found"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.kind);
    SafetensorsWriter w;
    std::map<std::string, std::string> meta = g.metadata();
    bool drop_w2 = false;
    c.edit(meta, drop_w2);
    for (const auto& [k, v] : meta) w.set_metadata(k, v);
    for (const TensorInfo& t : g.tensors()) {
      if (drop_w2 && t.name == prefix_of(0) + ".experts.w2") continue;
      w.add(t.name, t.dtype, t.shape, g.data(t));
    }
    const std::string path = dir.file(std::string(c.kind) + ".safetensors");
    w.write(path);
    const SafetensorsFile f = SafetensorsFile::open(path);
    std::vector<std::string> parts = c.parts;
    const ErrorCode code = std::string(c.kind) == "unknown_layout" ? ErrorCode::kInvalidArgument : ErrorCode::kFormat;
    EXPECT_TRUE(throws_error([&] { load_prepared_layer(f, prefix_of(0)); }, code, parts));
  }
}

// A NaN scale byte (0xFF) in a prepared file is refused like at checkpoint loading, naming the
// tensor and the global expert, in every layout; allow_nan_scales loads it.
TEST(PreparedCheckpoint, NanScalesAreRejectedNamingTensorAndExpert) {
  TempDir dir;
  const Checkpoint ckpt = Checkpoint::open(write_kimi(dir, 1));
  for (const std::string& layout : layout_names()) {
    if (layout.rfind("test-", 0) == 0) continue;  // layouts registered by other tests
    SCOPED_TRACE(layout);
    const std::string good = dir.file(layout + "_good.safetensors");
    PreparedCheckpointOptions opts;
    opts.backend = layout;
    opts.ep_rank = 1;
    opts.ep_size = 2;  // experts 4..7: the error names the global id
    write_prepared_checkpoint(ckpt, good, opts);
    const SafetensorsFile g = SafetensorsFile::open(good);
    const std::string sf_name = prefix_of(0) + ".experts.w2_sf";
    SafetensorsWriter w;
    for (const auto& [k, v] : g.metadata()) w.set_metadata(k, v);
    std::vector<uint8_t> sf;
    for (const TensorInfo& t : g.tensors()) {
      if (t.name != sf_name) {
        w.add(t.name, t.dtype, t.shape, g.data(t));
        continue;
      }
      sf.assign(g.data(t), g.data(t) + t.nbytes());
      sf[sf.size() / 2 + 3] = kUe8m0NaN;  // in the third of the rank's four experts: global id 6
      w.add(t.name, t.dtype, t.shape, sf.data());
    }
    ASSERT_FALSE(sf.empty()) << sf_name << " not found";
    const std::string bad = dir.file(layout + "_nan.safetensors");
    w.write(bad);
    const SafetensorsFile f = SafetensorsFile::open(bad);
    EXPECT_TRUE(throws_error([&] { load_prepared_layer(f, prefix_of(0)); }, ErrorCode::kFormat,
                             {"w2_sf", "0xFF (NaN) in expert 6"}));
    EXPECT_EQ(load_prepared_layer(f, prefix_of(0), /*allow_nan_scales=*/true).first_expert, 4);
  }
}

// ---------------------------------------------------------------------------------------------
// Inspection statistics
// ---------------------------------------------------------------------------------------------
TEST(Inspect, ScaleStatsCountRowSpreads) {
  // Rows with known spreads: 0, 3, 15 (beyond the exact fold range), and one with NaN bytes.
  const uint8_t rows[4][4] = {{120, 120, 120, 120}, {118, 121, 119, 120}, {110, 125, 111, 112},
                              {0xFF, 100, 0xFF, 101}};
  ScaleStats s;
  s.add_rows(&rows[0][0], 4, 4);
  EXPECT_EQ(s.rows, 4);
  EXPECT_EQ(s.values, 16);
  EXPECT_EQ(s.nan_values, 2);
  EXPECT_EQ(s.min, 100);
  EXPECT_EQ(s.max, 125);
  EXPECT_EQ(s.spread_rows[0], 1);
  EXPECT_EQ(s.spread_rows[1], 1);
  EXPECT_EQ(s.spread_rows[3], 1);
  EXPECT_EQ(s.spread_rows[15], 1);
  EXPECT_EQ(s.max_spread(), 15);
  EXPECT_EQ(s.spread_percentile(0.5), 1);
  EXPECT_EQ(s.spread_percentile(1.0), 15);
  EXPECT_DOUBLE_EQ(s.fraction_rows_within(kMaxExactFoldSpread), 0.75);
  EXPECT_FALSE(s.fold_exact());
  ScaleStats t;
  t.add_rows(&rows[0][0], 2, 4);
  EXPECT_TRUE(t.fold_exact());
  t.merge(s);
  EXPECT_EQ(t.rows, 6);
  EXPECT_EQ(t.max_spread(), 15);
}

TEST(Inspect, ReportNamesLayersShapesAndFoldVerdict) {
  TempDir dir;
  MoeWeights w = random_weights(4, 0, 128, 64, false, 5, 120, 124);  // spreads <= 4
  // One down-projection row of expert 2 with a spread of 20: the fold is no longer exact.
  uint8_t* row = w.w2_sf.as<uint8_t>() + (2 * 128 + 7) * 2;
  row[0] = 100;
  row[1] = 120;
  SafetensorsWriter writer;
  add_moe_layer(writer, prefix_of(5), w, ExpertConvention::kPerExpert);
  writer.write(dir.file("k.safetensors"));
  const Checkpoint ckpt = Checkpoint::open(dir.file("k.safetensors"));
  const auto layers = inspect_checkpoint(ckpt);
  ASSERT_EQ(layers.size(), 1u);
  ASSERT_EQ(layers[0].matrices.size(), 3u);
  EXPECT_EQ(layers[0].matrices[0].role, "gate (w1)");
  EXPECT_EQ(layers[0].matrices[0].stats.rows, 4 * 64);
  EXPECT_LE(layers[0].matrices[0].stats.max_spread(), 4);
  EXPECT_EQ(layers[0].matrices[2].stats.max_spread(), 20);
  EXPECT_EQ(layers[0].matrices[2].stats.min, 100);
  const std::string text = format_inspect_report(ckpt, layers);
  for (const char* part : {"layer 5", "E = 4, H = 128, I = 64", "U8[64, 64] x 4 experts", "down (w2)",
                           "max 20", "NOT exact", "exact when <= 14"})
    EXPECT_NE(text.find(part), std::string::npos) << part << " missing in:\n" << text;
  ASSERT_EQ(layers[0].matrices[2].per_expert.size(), 4u);
  EXPECT_EQ(layers[0].matrices[2].per_expert[2].max_row_spread, 20);
  EXPECT_EQ(layers[0].matrices[2].per_expert[2].min, 100);
  EXPECT_LE(layers[0].matrices[2].per_expert[1].max_row_spread, 4);
  const std::string detailed = format_inspect_report(ckpt, layers, /*per_expert=*/true);
  EXPECT_NE(detailed.find("expert 2: exponent min -27, max -3, largest row spread 20  (fold not exact)"),
            std::string::npos) << detailed;
  // Shapes only: no statistics read.
  InspectOptions no_stats;
  no_stats.scale_stats = false;
  EXPECT_EQ(inspect_checkpoint(ckpt, no_stats)[0].matrices[0].stats.rows, 0);
}

// Per tensor: whether the sm90 GEMM of its matrix can take the fast (overlapped) tiles, i.e.
// every scale byte < 128, or which expert sends it to the serial ones; NaN bytes are named.
TEST(Inspect, ReportsTheSm90GemmPathPerTensor) {
  TempDir dir;
  MoeWeights w = random_weights(4, 0, 128, 64, false, 5, 120, 124);
  EXPECT_EQ(sm90_gemm_path(w.w13_sf, 4, 0), "fast path");
  // Expert 3's up (w3) rows get a byte 130; expert 1's down rows a NaN byte (and a 140 after it).
  w.w13_sf.as<uint8_t>()[(3 * 128 + 64 + 9) * 4 + 2] = 130;
  w.w2_sf.as<uint8_t>()[(1 * 128 + 4) * 2 + 1] = kUe8m0NaN;
  w.w2_sf.as<uint8_t>()[(2 * 128 + 4) * 2 + 1] = 140;
  const ScaleByteHit hit = find_scale_byte(w.w13_sf, 4, kSm90SerialScaleByte);
  EXPECT_EQ(hit.expert, 3);
  EXPECT_EQ(hit.offset, (64 + 9) * 4 + 2);
  EXPECT_EQ(hit.byte, 130);
  EXPECT_EQ(sm90_gemm_path(w.w13_sf, 4, 8), "serial path: scale byte 130 >= 128 in expert 11");
  EXPECT_EQ(sm90_gemm_path(w.w2_sf, 4, 0), "serial path: scale byte 255 >= 128 in expert 1");
  EXPECT_FALSE(find_scale_byte(w.w13_sf, 4, kUe8m0NaN).found());

  SafetensorsWriter writer;
  add_moe_layer(writer, prefix_of(2), w, ExpertConvention::kPerExpert);
  writer.write(dir.file("k.safetensors"));
  const Checkpoint ckpt = Checkpoint::open(dir.file("k.safetensors"));
  const auto layers = inspect_checkpoint(ckpt);
  ASSERT_EQ(layers.at(0).matrices.size(), 3u);
  const auto& m = layers[0].matrices;
  EXPECT_FALSE(m[0].first_serial.found());
  EXPECT_EQ(m[1].first_serial.expert, 3);
  EXPECT_EQ(m[1].first_serial.byte, 130);
  EXPECT_EQ(m[2].first_serial.expert, 1);
  EXPECT_EQ(m[2].first_nan.expert, 1);
  EXPECT_EQ(sm90_path_text(m[0]), "fast path (every scale byte < 128)");
  EXPECT_EQ(sm90_path_text(m[1]), "serial path: scale byte 130 >= 128 in expert 3");
  const std::string text = format_inspect_report(ckpt, layers);
  for (const char* part : {"sm90 GEMM: fast path (every scale byte < 128)",
                           "sm90 GEMM: serial path: scale byte 130 >= 128 in expert 3",
                           "sm90 GEMM: serial path: scale byte 255 >= 128 in expert 1",
                           "NaN bytes 1 (first in expert 1: loading rejects them)"})
    EXPECT_NE(text.find(part), std::string::npos) << part << " missing in:\n" << text;
}

// ---------------------------------------------------------------------------------------------
// The commands
// ---------------------------------------------------------------------------------------------
class CheckpointCli : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(std::filesystem::exists(cli_path()))
        << "build the megamoe_cli target first";
  }
};

TEST_F(CheckpointCli, InspectAndPrepare) {
  TempDir dir;
  const std::string kimi = write_kimi(dir, 2);
  CliResult r = run_cli("inspect " + kimi);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* part : {"MoE layers: 2", "convention kimi-k3, E = 8, H = 256, I = 128", "row spread",
                           "folded FP8"})
    EXPECT_NE(r.output.find(part), std::string::npos) << part << " in:\n" << r.output;
  r = run_cli("inspect --json " + kimi);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["layers"].size(), 2u);
  EXPECT_EQ(j["layers"][0]["matrices"][2]["scale_stats"]["rows"], kE * kH);
  EXPECT_EQ(j["layers"][0]["matrices"][2]["sm90_gemm_path"], "fast");

  const std::string out = dir.file("rank1.safetensors");
  r = run_cli("prepare " + kimi + " --backend blackwell-interop --ep-rank 1 --ep-size 4 -o " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* part : {"2 layer(s), layout 'blackwell-interop', EP rank 1 of 4", "bytes:", "peak"})
    EXPECT_NE(r.output.find(part), std::string::npos) << part << " in:\n" << r.output;
  const SafetensorsFile f = SafetensorsFile::open(out);
  EXPECT_EQ(load_prepared_layer(f, prefix_of(1)).first_expert, 2);
  r = run_cli("inspect " + out);
  EXPECT_NE(r.output.find("layout 'blackwell-interop'"), std::string::npos) << r.output;

  r = run_cli("prepare " + kimi + " --fused 100 -o " + dir.file("fused.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("layout 'blackwell-interop'"), std::string::npos) << r.output;

  r = run_cli("prepare " + kimi + " --ep-size 3 -o " + dir.file("x.safetensors"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("not divisible by EP size 3"), std::string::npos) << r.output;
  // A NaN scale byte: prepare refuses it unless --allow-nan-scales; inspect names the expert.
  {
    MoeWeights w = random_weights(kE, 0, kH, kI, false, 9);
    w.w2_sf.as<uint8_t>()[6 * kH * (kI / kScaleBlock) + 3] = kUe8m0NaN;
    SafetensorsWriter writer;
    add_moe_layer(writer, prefix_of(0), w, ExpertConvention::kPerExpert);
    const std::string nan_ckpt = dir.file("nan.safetensors");
    writer.write(nan_ckpt);
    const std::string nan_out = dir.file("nan_prepared.safetensors");
    r = run_cli("prepare " + nan_ckpt + " -o " + nan_out);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("experts.6.w2.weight_scale': UE8M0 scale byte 0xFF (NaN) in expert 6"),
              std::string::npos) << r.output;
    EXPECT_FALSE(std::filesystem::exists(nan_out));
    r = run_cli("prepare " + nan_ckpt + " --allow-nan-scales -o " + nan_out);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    r = run_cli("inspect " + nan_ckpt);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("NaN bytes 1 (first in expert 6: loading rejects them)"),
              std::string::npos) << r.output;
    EXPECT_NE(r.output.find("serial path: scale byte 255 >= 128 in expert 6"), std::string::npos)
        << r.output;
  }
  const std::string bad = dir.file("bad.safetensors");
  testing_ckpt::write_bytes(bad, {1, 2, 3});
  r = run_cli("inspect " + bad);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("truncated file"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace megamoe
