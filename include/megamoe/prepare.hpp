// megamoe/prepare.hpp: turning canonical expert weights into a backend's layout, in place, and back.
//
//   prepare(weights, "blackwell-interop");   // canonical -> prepared; weights.layout = the layout
//   unprepare(weights);                      // prepared -> canonical, bit for bit
//   prepare_for_fused(weights, 100);         // the fused MegaMoE path of an SM100 GPU, whatever
//                                            // layout the weights are in now
//
// Backends and their layouts (layout_for_backend):
//   "reference", "cpu", "canonical"  -> "canonical"          (identity; the CPU layer reads it)
//   "blackwell-interop"              -> "blackwell-interop"  (DeepGEMM SM100 fp8_fp4_mega_moe,
//                                                             weights.md section 3, docs/layouts.md)
//   "sm90"                           -> "sm90"               (the Hopper kernels; registered by
//                                                             src/prep/sm90_layout.cpp)
//
// Re-preparing: weights already in the target layout are left alone (PrepareReport::no_op, no
// transform runs twice). Weights in a different prepared layout are first unprepared to canonical
// and then prepared (PrepareReport::converted): every layout has an exact inverse, so converting
// is lossless, and it is what selecting the fused path needs when the default backend already
// prepared the weights for itself.
//
// ---------------------------------------------------------------------------------------------
// How a layout is defined (the interface src/prep/sm90_layout.cpp implements)
// ---------------------------------------------------------------------------------------------
// A layout is a pure function of the bytes of ONE expert, per buffer: a documented index
// permutation of the canonical bytes, plus byte re-packing of scales (which may add zero
// padding, so a prepared buffer may be larger than the canonical one). It is described by a
// WeightLayout: its name and, for each of the six buffers (w13, w13_sf, w2, w2_sf, w13_bias,
// w2_bias), a BufferTransform:
//
//   prepared_expert_bytes(dims)  bytes of one expert in the prepared layout (nullptr: canonical)
//   forward(src, dst, n, dims)   n consecutive experts, canonical -> prepared
//   inverse(src, dst, n, dims)   n consecutive experts, prepared -> canonical (exact inverse)
//   forward_device / inverse_device: the same on device pointers, launched on `stream`
//                                (nullptr when the layout has no device implementation)
//
// src and dst never overlap; expert e of a call starts at src + e * (source expert bytes) and
// dst + e * (destination expert bytes). All four function pointers null = identity (the buffer
// is not touched). A transform must not fail: every dimension check belongs in check_dims, which
// runs before any byte moves, so a preparation either completes or changes nothing.
//
// The driver (src/prep/prepare.cpp) applies a layout buffer by buffer, in place:
//   - same or smaller prepared size: chunks of experts are copied into ONE scratch buffer (at
//     most PrepareOptions::scratch_bytes, at least one expert) and transformed back into the
//     buffer; the buffer is then shrunk to the prepared size. Peak extra memory = the scratch.
//   - larger prepared size (padding): a buffer of the prepared size is allocated, filled from the
//     old one, and the old one released. Peak extra memory = that one buffer. Only scale buffers
//     grow (blackwell-interop pads K/32 groups to a multiple of 4 when K % 128 != 0), so this is
//     at most 1/16 of the layer's weight bytes plus padding; it never happens for Kimi-K3 or
//     DeepSeek-V3 shapes.
// For weights on a CUDA device the same driver runs with a device scratch and calls the
// *_device functions; a layout without them cannot prepare device weights (kUnsupported).
// Device transforms are launched on PrepareOptions::stream; the driver's scratch copies use
// copy_bytes (cudaMemcpy, legacy default stream), so `stream` must be a blocking stream or
// nullptr for the copies and transforms to stay ordered. The last transform may still be running
// when prepare() returns: synchronize `stream` before reading the weights on another stream.
// No second copy of the layer is ever held; tests/cpp/test_prep_memory.cpp measures it.
//
// Registering: layouts in src/prep/ are built in (canonical, blackwell-interop, and sm90 when
// src/prep/sm90_layout.hpp exists: it declares `WeightLayout megamoe::prep::sm90_weight_layout()`
// and registry.cpp picks it up through __has_include). register_layout() adds others at run time.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "megamoe/checkpoint.hpp"
#include "megamoe/weights.hpp"

namespace megamoe {

enum class WeightBufferKind : int { kW13 = 0, kW13Sf, kW2, kW2Sf, kW13Bias, kW2Bias };
constexpr int kNumWeightBuffers = 6;

const char* weight_buffer_name(WeightBufferKind kind);  // "w13", "w13_sf", ... "w2_bias"
Buffer& weight_buffer(MoeWeights& weights, WeightBufferKind kind);
const Buffer& weight_buffer(const MoeWeights& weights, WeightBufferKind kind);

struct ExpertDims {
  int64_t hidden = 0;        // H
  int64_t intermediate = 0;  // I
};

// Bytes of one expert of `kind` in the canonical form (weights.hpp).
int64_t canonical_expert_bytes(WeightBufferKind kind, const ExpertDims& dims);

using HostExpertTransform = void (*)(const uint8_t* src, uint8_t* dst, int64_t num_experts,
                                     const ExpertDims& dims);
using DeviceExpertTransform = void (*)(const uint8_t* src, uint8_t* dst, int64_t num_experts,
                                       const ExpertDims& dims, void* stream);

struct BufferTransform {
  int64_t (*prepared_expert_bytes)(const ExpertDims& dims) = nullptr;  // nullptr: canonical size
  HostExpertTransform forward = nullptr;
  HostExpertTransform inverse = nullptr;
  DeviceExpertTransform forward_device = nullptr;
  DeviceExpertTransform inverse_device = nullptr;

  bool is_identity() const {
    return forward == nullptr && inverse == nullptr && forward_device == nullptr &&
           inverse_device == nullptr && prepared_expert_bytes == nullptr;
  }
};

struct WeightLayout {
  std::string name;         // the value MoeWeights::layout takes once prepared
  std::string description;  // one line, for `megamoe prepare --help` and error messages
  // Throws (kUnsupported / kInvalidArgument, naming the dimension) when this layout cannot hold
  // experts of these dimensions. nullptr: any H, I that are positive multiples of 32.
  void (*check_dims)(const ExpertDims& dims) = nullptr;
  std::array<BufferTransform, kNumWeightBuffers> buffers{};

  const BufferTransform& buffer(WeightBufferKind kind) const {
    return buffers[static_cast<int>(kind)];
  }
  // Bytes of one expert of `kind` in this layout.
  int64_t expert_bytes(WeightBufferKind kind, const ExpertDims& dims) const;
};

// Adds a layout. kInvalidArgument when the name is taken or empty, or when a buffer has a
// forward without an inverse (or the reverse) on the host or on the device.
void register_layout(const WeightLayout& layout);
// kInvalidArgument naming the known layouts when `name` is not registered.
const WeightLayout& find_layout(std::string_view name);
bool has_layout(std::string_view name);
std::vector<std::string> layout_names();

// "reference"/"cpu"/"canonical" -> "canonical"; a registered layout's name -> itself; otherwise
// kInvalidArgument naming the known backends.
std::string layout_for_backend(std::string_view backend);

// The layout of the fused MegaMoE kernel on a GPU of compute capability `sm_version`
// (major * 10 + minor): 90 -> "sm90"; 100, 103 -> "blackwell-interop"; others kUnsupported.
std::string fused_layout_for_arch(int sm_version);

// Checks E_l, H, I and the size of every buffer against weights.layout (kInvalidArgument naming
// the buffer, expected and actual bytes; kInvalidArgument for an unknown layout).
void check_weights_layout(const MoeWeights& weights);

constexpr int64_t kDefaultPrepareScratchBytes = 64LL << 20;  // targets.md: <= 64 MiB or 1 expert

struct PrepareOptions {
  // Upper bound of the one scratch buffer; it always holds at least one expert of the largest
  // buffer transformed in place (so 0 means "exactly one expert").
  int64_t scratch_bytes = kDefaultPrepareScratchBytes;
  void* stream = nullptr;  // cudaStream_t for device weights
  // Called with (bytes transformed so far, total bytes to transform).
  std::function<void(int64_t, int64_t)> progress;
};

struct PrepareReport {
  std::string from_layout;
  std::string to_layout;
  bool no_op = false;             // already in the target layout: nothing was done
  bool converted = false;         // went through canonical from another prepared layout
  int64_t bytes_transformed = 0;  // bytes of the buffers that were rewritten (source sizes)
  int64_t scratch_bytes = 0;      // size of the scratch buffer used (0 when none)
  int64_t peak_extra_bytes = 0;   // most memory held at once beyond the weights themselves
  std::string summary() const;    // one line, for logs and the CLI
};

// Prepares `weights` in place for `backend` (see layout_for_backend).
PrepareReport prepare(MoeWeights& weights, std::string_view backend,
                      const PrepareOptions& options = {});
// Back to canonical, bit for bit. A no-op (no_op = true) for canonical weights.
PrepareReport unprepare(MoeWeights& weights, const PrepareOptions& options = {});
// Prepares for the fused MegaMoE kernel of `sm_version`, whatever backend is the default and
// whatever layout the weights are in now (fused_layout_for_arch).
PrepareReport prepare_for_fused(MoeWeights& weights, int sm_version,
                                const PrepareOptions& options = {});

// ---------------------------------------------------------------------------------------------
// Prepared checkpoints (what `megamoe prepare` writes)
// ---------------------------------------------------------------------------------------------
// One safetensors file with the prepared MoE layers of one EP rank:
//   {prefix}.experts.w13, .w13_sf, .w2, .w2_sf [, .w13_bias, .w2_bias]   the layout's bytes
//     canonical: the shapes of weights.hpp (U8 [E_l, 2I, H/2], ..., BF16 [E_l, 2I]);
//     other layouts: U8 [E_l, bytes of one expert] (biases stay BF16 [E_l, rows])
//   metadata: megamoe.format = kPreparedFormat, megamoe.layout, megamoe.backend, megamoe.ep_rank,
//             megamoe.ep_size, megamoe.source, megamoe.layers (a JSON list of {prefix,
//             layer_index, convention, num_experts, first_expert, num_local_experts, hidden,
//             intermediate, bias})
// Layers are loaded, prepared and written one at a time: peak memory is one layer's experts for
// the rank plus the preparation scratch, whatever the number of layers.
constexpr const char* kPreparedFormat = "megamoe-prepared-moe/1";

struct PreparedCheckpointOptions {
  std::string backend = "reference";
  int ep_rank = 0;
  int ep_size = 1;
  std::vector<std::string> prefixes;               // layers to write (empty: every MoE layer)
  PrepareOptions prepare;                          // scratch bound (its progress is not used)
  LoadOptions load;                                // NaN scales are rejected unless allowed
  std::function<void(int64_t, int64_t)> progress;  // (bytes written, total bytes)
};

struct PreparedCheckpointReport {
  std::string layout;
  int64_t layers = 0;
  int64_t file_bytes = 0;
  int64_t weight_bytes = 0;         // prepared expert bytes written
  int64_t max_layer_bytes = 0;      // the largest layer held at once
  int64_t peak_prepare_extra = 0;   // largest PrepareReport::peak_extra_bytes over layers
  int64_t peak_host_bytes = 0;      // peak of Buffer memory during the run, above the start
  double seconds = 0;
};

PreparedCheckpointReport write_prepared_checkpoint(const Checkpoint& checkpoint,
                                                   const std::string& out_path,
                                                   const PreparedCheckpointOptions& options);
// Prefixes of the layers in a prepared file (kFormat when it is not one).
std::vector<std::string> prepared_layer_prefixes(const SafetensorsFile& file);
// One layer of a prepared file, in the file's layout (weights.layout says which); every size is
// checked against the layout (kFormat naming file and tensor), and a UE8M0 scale byte 0xFF (NaN)
// is kFormat naming the tensor and the expert unless allow_nan_scales.
MoeWeights load_prepared_layer(const SafetensorsFile& file, std::string_view prefix,
                               bool allow_nan_scales = false);

}  // namespace megamoe
