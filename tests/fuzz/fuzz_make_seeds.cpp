// Writes the seed corpus of fuzz_safetensors into a folder: small valid checkpoints in both
// expert conventions, a sharded-style plain file, and prepared files of every layout that serves
// their dims. Usage: fuzz_make_seeds DIR
#include <cstdio>
#include <random>
#include <string>

#include "megamoe/checkpoint.hpp"
#include "megamoe/prepare.hpp"

using namespace megamoe;

namespace {

MoeWeights tiny(int64_t experts, int64_t hidden, int64_t intermediate, bool bias, uint32_t seed) {
  MoeWeights w;
  w.num_local_experts = experts;
  w.hidden = hidden;
  w.intermediate = intermediate;
  const ExpertDims d{hidden, intermediate};
  std::mt19937 rng(seed);
  for (int b = 0; b < kNumWeightBuffers; ++b) {
    const auto kind = static_cast<WeightBufferKind>(b);
    if (!bias && (kind == WeightBufferKind::kW13Bias || kind == WeightBufferKind::kW2Bias)) continue;
    Buffer buf(experts * canonical_expert_bytes(kind, d));
    for (int64_t i = 0; i < buf.size(); ++i) buf.as<uint8_t>()[i] = static_cast<uint8_t>(110 + rng() % 20);
    weight_buffer(w, kind) = std::move(buf);
  }
  return w;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  {
    SafetensorsWriter w;
    add_moe_layer(w, "language_model.model.layers.0.block_sparse_moe", tiny(2, 32, 32, false, 1),
                  ExpertConvention::kPerExpert);
    w.set_metadata("format", "pt");
    w.write(dir + "/kimi.safetensors");
  }
  {
    SafetensorsWriter w;
    add_moe_layer(w, "model.layers.1.mlp", tiny(2, 32, 32, true, 2), ExpertConvention::kFused);
    w.write(dir + "/gpt_oss.safetensors");
  }
  {
    SafetensorsWriter w;
    const uint8_t bytes[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
    w.add("a", StDType::kBF16, {2, 2}, bytes);
    w.add("b", StDType::kF4, {4}, bytes);
    w.add("c", StDType::kF64, {1}, bytes);
    w.write(dir + "/plain.safetensors");
  }
  // Prepared files of a tiny layer with H = 128, 2I = 128 (every built-in layout serves it).
  SafetensorsWriter src;
  add_moe_layer(src, "m", tiny(1, 128, 64, false, 3), ExpertConvention::kPerExpert);
  src.write(dir + "/prepare_source.safetensors");
  const Checkpoint ckpt = Checkpoint::open(dir + "/prepare_source.safetensors");
  for (const std::string& layout : layout_names()) {
    PreparedCheckpointOptions opts;
    opts.backend = layout;
    try {
      write_prepared_checkpoint(ckpt, dir + "/prepared_" + layout + ".safetensors", opts);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "skipped layout %s: %s\n", layout.c_str(), e.what());
    }
  }
  std::remove((dir + "/prepare_source.safetensors").c_str());
  return 0;
}
