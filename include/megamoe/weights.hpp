// megamoe/weights.hpp: the expert weights of one layer on one rank.
//
// Canonical form (weights.md section 2), the form every backend starts from:
//   w13    uint8 [E_l, 2I, H/2]    rows [0, I) gate (w1), [I, 2I) up (w3); E2M1 pairs, low nibble even k
//   w13_sf uint8 [E_l, 2I, H/32]   UE8M0
//   w2     uint8 [E_l, H, I/2]
//   w2_sf  uint8 [E_l, H, I/32]
//   w13_bias bf16 [E_l, 2I], w2_bias bf16 [E_l, H]   optional (GPT-OSS)
//
// A backend's preparation turns these buffers into its own layout in place (src/prep/); the
// `layout` field says which layout the bytes are in now, so preparing twice is detected.
#pragma once

#include <cstdint>
#include <string>

#include "megamoe/buffer.hpp"
#include "megamoe/config.hpp"

namespace megamoe {

constexpr const char* kCanonicalLayout = "canonical";

struct MoeWeights {
  int64_t num_local_experts = 0;  // E_l
  int64_t first_expert = 0;       // global id of local expert 0 (= ep_rank * E_l)
  int64_t hidden = 0;             // H
  int64_t intermediate = 0;       // I
  std::string layout = kCanonicalLayout;

  Buffer w13, w13_sf, w2, w2_sf;
  Buffer w13_bias, w2_bias;       // empty when the checkpoint has none

  bool has_bias() const { return !w13_bias.empty(); }
  Device device() const { return w13.device(); }
  int64_t total_bytes() const;

  // Canonical sizes in bytes of each buffer for this (E_l, H, I).
  int64_t w13_bytes() const { return num_local_experts * 2 * intermediate * hidden / 2; }
  int64_t w13_sf_bytes() const { return num_local_experts * 2 * intermediate * hidden / 32; }
  int64_t w2_bytes() const { return num_local_experts * hidden * intermediate / 2; }
  int64_t w2_sf_bytes() const { return num_local_experts * hidden * intermediate / 32; }

  // Allocates canonical buffers (uninitialised) for these dimensions.
  static MoeWeights allocate(int64_t num_local_experts, int64_t first_expert, int64_t hidden,
                             int64_t intermediate, bool with_bias, Device device = Device::cpu());

  // Checks dimensions and buffer sizes against the layout; throws kInvalidArgument / kFormat.
  void validate_canonical() const;

  // Checks that these weights serve `config` (H, I, E_l, first expert); throws naming the field.
  void check_matches(const LayerConfig& config) const;

  // A full copy of these weights (every buffer, the dimensions and the layout) on `device`.
  MoeWeights to(Device device) const;
};

// ---------------------------------------------------------------------------------------------
// Scale bytes that change what a layer computes or how fast
// ---------------------------------------------------------------------------------------------
// UE8M0 byte 0xFF is NaN: every token routed to that expert becomes NaN (checkpoint loading
// rejects it unless told otherwise). The sm90 GEMMs' overlapped tiles need every scale byte of
// a matrix below kSm90SerialScaleByte; one byte at or above it sends that GEMM (L1 for w13_sf,
// L2 for w2_sf) of the whole layer to the slower serial tiles (kernels/layout/sm90_weight_layout.hpp).
constexpr int kSm90SerialScaleByte = 128;

// A scale byte found in a buffer of E_l experts: the local expert, the offset inside that
// expert's part of the buffer, the byte. expert < 0 when none was found.
struct ScaleByteHit {
  int64_t expert = -1;
  int64_t offset = -1;
  int byte = 0;
  bool found() const { return expert >= 0; }
};

// The first byte >= min_byte of `scales` (host memory, split into num_local_experts equal
// expert-major parts, as in every layout megamoe prepares). kInvalidArgument for device buffers
// or sizes not divisible by num_local_experts.
ScaleByteHit find_scale_byte(const Buffer& scales, int64_t num_local_experts, int min_byte);

// Which sm90 GEMM tiles a scale buffer gets: "fast path" when every byte is < 128, else
// "serial path: scale byte 131 >= 128 in expert 5" (global expert id = first_expert + local).
// Host-side, for logs and `megamoe inspect`; the layer decides on its device copy.
std::string sm90_gemm_path(const Buffer& scales, int64_t num_local_experts, int64_t first_expert);

// Synthetic MXFP4 weights for tests, benchmarks and the default CLI run: uniform random E2M1
// codes and UE8M0 scales chosen so each expert's outputs have unit-order magnitude
// (scales around 2^-round(log2(sqrt(K)))), with a small per-row spread. Deterministic in `seed`.
MoeWeights synthetic_weights(const LayerConfig& config, uint64_t seed, bool with_bias = false);

}  // namespace megamoe
