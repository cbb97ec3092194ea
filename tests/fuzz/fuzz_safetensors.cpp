// libFuzzer target: arbitrary bytes through the safetensors reader and everything built on it.
// Any megamoe::Error is an accepted outcome; a crash, a sanitizer report, an exception of
// another type, or a tensor view outside the input is a bug.
#include <cstdint>
#include <cstdlib>

#include "megamoe/checkpoint.hpp"
#include "megamoe/error.hpp"
#include "megamoe/prepare.hpp"

namespace {

// Reads every byte of every tensor (ASan flags any view outside the input).
uint64_t touch_all(const megamoe::SafetensorsFile& f, const uint8_t* begin, size_t size) {
  uint64_t sum = 0;
  for (const auto& t : f.tensors()) {
    const uint8_t* p = f.data(t);
    if (p < begin || p + t.nbytes() > begin + size) std::abort();
    for (int64_t i = 0; i < t.nbytes(); ++i) sum += p[i];
  }
  return sum;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace megamoe;
  try {
    SafetensorsFile file = SafetensorsFile::parse("fuzz", data, static_cast<int64_t>(size));
    volatile uint64_t sink = touch_all(file, data, size);
    (void)sink;
    // A prepared checkpoint: every layer it names.
    try {
      for (const std::string& prefix : prepared_layer_prefixes(file)) {
        MoeWeights w = load_prepared_layer(file, prefix);
        unprepare(w);
      }
    } catch (const Error&) {
    }
    // An ordinary checkpoint: MoE layers, their statistics, and each layer for EP 1 and 2.
    const Checkpoint ckpt = Checkpoint::from_file(std::move(file));
    for (const MoeLayerInfo& layer : find_moe_layers(ckpt)) {
      for (int ep_size : {1, 2}) {
        try {
          MoeWeights w = load_moe_layer(ckpt, layer, ep_size - 1, ep_size);
          (void)w;
        } catch (const Error&) {
        }
      }
    }
    const auto report = inspect_checkpoint(ckpt);
    (void)format_inspect_report(ckpt, report);
  } catch (const Error&) {
  }
  return 0;
}
