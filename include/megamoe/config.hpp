// megamoe/config.hpp: the shape and configuration of one MoE layer.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "megamoe/activation.hpp"

namespace megamoe {

// Routed-expert shape of one MoE layer (targets.md, "Shapes").
struct LayerShape {
  int64_t hidden = 0;        // H: expert input width (Kimi-K3: the latent width 3584)
  int64_t intermediate = 0;  // I: per-expert intermediate width
  int64_t num_experts = 0;   // E: experts in total, over all EP ranks
  int64_t top_k = 0;         // K

  void validate() const;     // H, I multiples of 32, all positive
  std::string to_string() const;
};

// Named shapes of targets.md: "kimi-k3", "deepseek-v3", "gpt-oss-120b", "small".
LayerShape shape_preset(std::string_view name);
// The activation each preset uses (kimi-k3: situ; gpt-oss-120b: swiglu_oai; others: swiglu).
Activation activation_preset(std::string_view shape_name);
std::vector<std::string> shape_preset_names();

// How the Hopper GEMM tile policy estimates the routed rows of a launch (docs/design.md).
enum class RowsHintMode : uint8_t {
  kGated,     // the rank's expected share of T*K slots, plus gated launches for up to T rows per
              // expert (skewed routing): the default
  kBound,     // T*K slots, no gated launches
  kExpected,  // the expected share, no gated launches
};
// "gated" | "bound" | "expected"; throws kInvalidArgument naming the valid values.
RowsHintMode parse_rows_hint_mode(std::string_view name);
const char* to_string(RowsHintMode mode);

// What the expert GEMMs compute (docs/numerics.md).
enum class Precision : uint8_t {
  kExact,  // the contract (numerics.md sections 3 and 6): exact products, FP32 sums; the default
  kFp8,    // "FP8 mode": token rows and weight rows rebased to E4M3 with one power of two per row
           // (numerics.md "FP8 mode"); the cpu backend computes it, sm90 not yet (its GEMMs do)
};
// "exact" | "fp8"; throws kInvalidArgument naming the valid values.
Precision parse_precision(std::string_view name);
const char* to_string(Precision precision);

// Options of the Hopper (sm90) backend, explicit per layer (the CPU backend ignores them; the
// CLI maps flags onto them). Every value computes the same function: the tile changes only the
// order of the FP32 sums, the launch mode nothing.
struct Sm90Options {
  // GEMM tile: "auto" (the policy), "serial" (the policy over the serial-mainloop tiles, exact for
  // any scale byte) or one tile of the shipped table for both GEMMs (`megamoe bench --list-tiles`).
  // An FP8-mode tile (fp8_*; precision fp8 only) is forced on the FP8 mode's calls, the exact
  // mode's calls of that layer taking the policy's tiles.
  std::string gemm_tile = "auto";
  bool programmatic_launch = true;  // programmatic dependent launch between the six kernels
  RowsHintMode rows_hint = RowsHintMode::kGated;
  // The MegaMoE kernel (issue 32; docs/design.md): both expert GEMMs of a call in one persistent
  // launch, each L2 tile starting once the L1 tiles of its rows are written, for the exact-mode
  // calls with up to 12 routed rows per local expert on average and the prefill calls whose tile
  // is the staged 256 x 128 one (the other calls chain the two GEMM launches; a forced tile the
  // kernel is built for runs fused, FP8 tiles included: the rebase of L1's rows into L2's then
  // runs inside the launch); under expert parallelism the same launch also writes L2's rows into
  // their source ranks' combine slots. The same results bit for bit as the chain on the same
  // tile.
  bool mega_kernel = false;
  // The dispatch inside the MegaMoE kernel (expert parallelism, with mega_kernel): for the calls
  // the kernel runs, its gather units convert each received token row as soon as its arrival word
  // says it is there, while the rest still arrive, instead of a gather launch after every rank's
  // rows are in (the dispatch kernel then waits only for the ranks' slot ids, to sort them). The
  // same results bit for bit. Off by default: its gain is the overlap of NVLink transfers with
  // the GEMMs, not measurable on one GPU, where it costs (docs/perf.md).
  bool mega_dispatch = false;
  // The combine inside the MegaMoE kernel (with mega_kernel): for the calls the kernel runs with
  // at most 16384 items (T * H / 8; 1024 with several EP ranks on one GPU), its last CTAs sum y
  // once every L2 row is in (under expert parallelism: once every rank has returned its rows)
  // instead of a combine launch (and, under expert parallelism, a return launch) after it. The
  // same results bit for bit. Off by default: on one GPU it is slower at decode than the launches
  // with programmatic dependent launch (docs/perf.md); its gain, the return's launch after the
  // cross-GPU wait, needs the multi-GPU machine to measure.
  bool mega_combine = false;
  // Decode front: quantize, dispatch and gather of an exact-mode call on one GPU with T*K <= 1024
  // as one launch (kernels/sm90/sm90_decode_front.cuh) instead of three; the same workspace bit
  // for bit. Off: the three launches (the stage columns of `megamoe bench` then split them).
  bool decode_front = true;
};

struct LayerConfig {
  LayerShape shape;
  int ep_size = 1;                       // R
  int ep_rank = 0;                       // r: owns global experts [r*E_l, (r+1)*E_l)
  int64_t max_tokens_per_rank = 8192;    // capacity: T above it is an error, never a drop
  Activation activation = Activation::swiglu();
  bool fast_math = true;                 // numerics.md section 4
  Precision precision = Precision::kExact;  // what the expert GEMMs compute
  // With precision fp8: a call runs the FP8 mode when its tokens give at least this many routed
  // rows per expert on average (T * K / E), the exact mode below (where the FP8 tiles are slower:
  // docs/perf.md "FP8 mode"); 0 = every call. Both backends apply the same rule (fp8_for_tokens).
  int64_t fp8_min_rows_per_expert = 128;
  Sm90Options sm90;                      // Hopper backend options
  // GPU backends report invalid expert ids found on the device at the next call or at
  // check_errors(); true makes every call wait for the device and report them at once (a
  // debugging mode: it cannot be captured in a CUDA graph). The cpu backend always reports at once.
  bool sync_error_check = false;

  int64_t num_local_experts() const { return shape.num_experts / ep_size; }
  // Whether a call of num_tokens tokens runs the FP8 mode (precision and
  // fp8_min_rows_per_expert). Under expert parallelism the sm90 layer asks it for the group's
  // tokens, estimated as this rank's T times ep_size (every local expert expects T*R*K/E rows).
  bool fp8_for_tokens(int64_t num_tokens) const {
    return precision == Precision::kFp8 &&
           num_tokens * shape.top_k >= fp8_min_rows_per_expert * shape.num_experts;
  }
  int64_t first_local_expert() const { return num_local_experts() * ep_rank; }
  void validate() const;                 // throws kInvalidArgument naming the field
};

}  // namespace megamoe
