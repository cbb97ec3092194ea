// megamoe/checkpoint.hpp: safetensors files, multi-file checkpoints, and the MoE experts in them.
//
// Data flow (docs/design.md): checkpoint -> canonical MoeWeights (this header) -> prepared weights
// (prepare.hpp) -> layer.
//
//   SafetensorsFile   one memory-mapped .safetensors file, validated when opened
//   SafetensorsWriter writes one (fixtures, `megamoe prepare` output)
//   Checkpoint        one file, or the shards named by model.safetensors.index.json
//   find_moe_layers   recognises expert tensors in both conventions of weights.md section 1
//   load_moe_layer    one layer, one EP rank, into the canonical form of weights.md section 2
//
// Every error is a megamoe::Error (kFormat for malformed content, kIo for open/read/mmap/write
// failures, kInvalidArgument for a bad request such as an EP size that does not divide E) whose
// message starts with the file (or checkpoint) path and names the tensor. docs/reliability.md
// lists each rejected input with the test that proves it.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "megamoe/weights.hpp"

namespace megamoe {

// ---------------------------------------------------------------------------------------------
// safetensors element types
// ---------------------------------------------------------------------------------------------
// Every dtype of the safetensors format (including the sub-byte F4/F6 kinds of newer writers).
// A tensor of a sub-byte dtype occupies numel * bits / 8 bytes, which must be a whole number.
enum class StDType : uint8_t {
  kBool, kU8, kI8, kF8E5M2, kF8E4M3, kF8E8M0, kI16, kU16, kF16, kBF16,
  kI32, kU32, kF32, kI64, kU64, kF64, kC64, kF4, kF6E2M3, kF6E3M2,
};

const char* st_dtype_name(StDType dtype);                 // the header spelling: "U8", "F8_E4M3"
bool st_dtype_parse(std::string_view name, StDType* out);  // false for an unknown spelling
int st_dtype_bits(StDType dtype);                          // bits per element (4 .. 64)

// ---------------------------------------------------------------------------------------------
// Reading
// ---------------------------------------------------------------------------------------------
// Bounds the reader enforces before trusting any number in a header.
constexpr int64_t kSafetensorsHeaderLengthBytes = 8;              // little-endian u64 prefix
constexpr int64_t kMaxSafetensorsHeaderBytes = 100LL * 1000 * 1000;  // as the reference reader
constexpr int kMaxTensorDims = 32;
constexpr const char* kSafetensorsMetadataKey = "__metadata__";

struct TensorInfo {
  std::string name;
  StDType dtype = StDType::kU8;
  std::vector<int64_t> shape;
  int64_t data_begin = 0;  // [data_begin, data_end) relative to the start of the data region
  int64_t data_end = 0;

  int64_t numel() const;   // product of the shape (validated to fit int64 when read)
  int64_t nbytes() const { return data_end - data_begin; }
  std::string describe() const;  // "U8[4, 16]"
};

// A validated, read-only, memory-mapped safetensors file. Opening checks everything the format
// can get wrong (docs/reliability.md): a file shorter than 8 bytes, a header length beyond the
// file or beyond kMaxSafetensorsHeaderBytes, a header that is not UTF-8 or not JSON or not an
// object, duplicate keys, unknown fields, unknown dtypes, shapes that are not arrays of
// non-negative integers or whose element count overflows, data_offsets outside the data region,
// reversed or overlapping offsets, and a byte size that differs from the shape. Tensor data is
// read through the mapping only, so only the pages of tensors actually used are touched.
class SafetensorsFile {
 public:
  // Maps `path` (kIo when it cannot be opened or mapped, kFormat when it is malformed).
  static SafetensorsFile open(const std::string& path);
  // Validates an image already in memory (not copied: `bytes` must outlive the object). `label`
  // stands for the path in messages. Used by the fuzzer and by tests.
  static SafetensorsFile parse(std::string label, const uint8_t* bytes, int64_t size);

  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::string& path() const;
  int64_t file_bytes() const;
  int64_t data_offset() const;                     // 8 + header length
  const std::vector<TensorInfo>& tensors() const;  // in data-offset order
  const TensorInfo* find(std::string_view name) const;  // nullptr when absent
  const TensorInfo& get(std::string_view name) const;   // kFormat naming file and tensor
  const uint8_t* data(const TensorInfo& tensor) const;  // first byte of the tensor in the mapping
  const std::map<std::string, std::string>& metadata() const;

 private:
  struct Impl;
  explicit SafetensorsFile(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// ---------------------------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------------------------
// Writes files the reference reader (and ours) accepts: the header is padded with spaces so the
// data region starts 8-byte aligned, and tensors follow back to back with no gaps (the format
// forbids gaps) ordered by element size, largest first, so each tensor is aligned to its element
// size; tensors of one element size keep the order they were added in.
class SafetensorsWriter {
 public:
  // Borrows `data` (numel * bits / 8 bytes): it must stay valid until write()/serialize().
  // Throws kInvalidArgument for an empty, duplicate, reserved or non-UTF-8 name, a negative dim,
  // or a byte size that is not a whole number.
  void add(std::string name, StDType dtype, std::vector<int64_t> shape, const void* data);
  // Same, copying the bytes into the writer.
  void add_copy(std::string name, StDType dtype, std::vector<int64_t> shape, const void* data);
  // Declares a tensor whose bytes write() asks `source` for (streaming large outputs).
  void add_deferred(std::string name, StDType dtype, std::vector<int64_t> shape);
  void set_metadata(std::string key, std::string value);
  // Keep tensors in the order they were added instead of ordering by element size; the caller
  // then answers for alignment (e.g. even-sized uint8 tensors before BF16 ones).
  void set_preserve_order(bool preserve) { preserve_order_ = preserve; }

  int64_t num_tensors() const { return static_cast<int64_t>(entries_.size()); }
  int64_t file_bytes() const;  // the size write() produces

  // Supplies the bytes of a deferred tensor; the pointer must stay valid until the next call.
  // Called once per deferred tensor, in file order.
  using TensorSource = std::function<const void*(const std::string& name)>;

  // Writes to `path` through a temporary file renamed at the end (kIo on failure). `progress`
  // (optional) is called with (bytes written, total bytes); `source` serves deferred tensors.
  void write(const std::string& path,
             const std::function<void(int64_t, int64_t)>& progress = {},
             const TensorSource& source = {}) const;
  std::vector<uint8_t> serialize() const;  // no deferred tensors allowed

 private:
  struct Entry {
    std::string name;
    StDType dtype;
    std::vector<int64_t> shape;
    const void* data;
    int64_t bytes;
    int64_t owned_index;  // into owned_, or -1 when borrowed
    bool deferred;        // bytes come from the TensorSource at write time
  };
  void add_entry(std::string name, StDType dtype, std::vector<int64_t> shape, const void* data,
                 bool deferred);
  std::string header_json(std::vector<const Entry*>* order) const;
  std::vector<Entry> entries_;
  std::vector<std::vector<uint8_t>> owned_;
  std::map<std::string, std::string> metadata_;
  bool preserve_order_ = false;
};

// ---------------------------------------------------------------------------------------------
// Checkpoints (one file or sharded)
// ---------------------------------------------------------------------------------------------
constexpr const char* kSafetensorsIndexName = "model.safetensors.index.json";

class Checkpoint {
 public:
  // `path`: a .safetensors file; a *.safetensors.index.json ({"weight_map": {tensor: shard}});
  // or a directory holding model.safetensors.index.json, else its *.safetensors files. Shards
  // must sit in the index's directory (no absolute paths, no ".."); every weight_map entry must
  // name a tensor that exists in that shard; a tensor present in two shards is an error.
  static Checkpoint open(const std::string& path);
  // A checkpoint of one already opened or parsed file (in-memory images, the fuzzer, bindings).
  static Checkpoint from_file(SafetensorsFile file);

  struct TensorRef {
    const SafetensorsFile* file = nullptr;
    const TensorInfo* info = nullptr;
    const uint8_t* data() const { return file->data(*info); }
  };

  const std::string& path() const { return path_; }
  const std::vector<SafetensorsFile>& files() const { return files_; }
  int64_t num_tensors() const { return static_cast<int64_t>(tensors_.size()); }
  int64_t total_bytes() const;  // sum of the shard sizes
  std::vector<std::string> tensor_names() const;  // sorted
  // nullptr info when absent.
  TensorRef find(std::string_view name) const;
  // kFormat "CKPT: tensor 'NAME' not found" when absent.
  TensorRef get(std::string_view name) const;
  // Calls fn for every tensor, in name order.
  void for_each(const std::function<void(const std::string&, const TensorRef&)>& fn) const;

 private:
  std::string path_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, TensorRef, std::less<>> tensors_;
};

// ---------------------------------------------------------------------------------------------
// MoE experts (weights.md section 1)
// ---------------------------------------------------------------------------------------------
//   kPerExpert (Kimi-K3, compressed-tensors mxfp4-pack-quantized): per expert e
//     {prefix}.experts.{e}.w1.weight_packed U8 [I, H/2]   gate      + .weight_scale U8 [I, H/32]
//     {prefix}.experts.{e}.w3.weight_packed U8 [I, H/2]   up        + .weight_scale U8 [I, H/32]
//     {prefix}.experts.{e}.w2.weight_packed U8 [H, I/2]   down      + .weight_scale U8 [H, I/32]
//     (scales may also be typed F8_E8M0; an optional .weight_shape I32/I64 [2] is checked)
//   kFused (GPT-OSS): all experts in one tensor, gate/up rows interleaved (even gate, odd up)
//     {prefix}.experts.gate_up_proj_blocks U8 [E, 2I, H/32, 16] (or [E, 2I, H/2])
//     {prefix}.experts.gate_up_proj_scales U8 [E, 2I, H/32]
//     {prefix}.experts.gate_up_proj_bias BF16 [E, 2I]            (bias optional, both or none)
//     {prefix}.experts.down_proj_blocks    U8 [E, H, I/32, 16] (or [E, H, I/2])
//     {prefix}.experts.down_proj_scales    U8 [E, H, I/32]
//     {prefix}.experts.down_proj_bias      BF16 [E, H]
enum class ExpertConvention : uint8_t { kPerExpert, kFused };
const char* expert_convention_name(ExpertConvention convention);  // "kimi-k3", "gpt-oss"

struct MoeLayerInfo {
  std::string prefix;            // the name part before ".experts."
  int64_t layer_index = -1;      // L of ".layers.{L}." in the prefix, -1 when there is none
  ExpertConvention convention = ExpertConvention::kPerExpert;
  int64_t num_experts = 0;       // E
  int64_t hidden = 0;            // H
  int64_t intermediate = 0;      // I
  bool has_bias = false;
};

// All MoE layers of the checkpoint, ordered by layer index then prefix. Each is validated in
// full: every expert 0..E-1 present with all six tensors (a weight without its scale is a
// "missing partner"), dtypes U8 (scales U8 or F8_E8M0, biases BF16), shapes consistent between
// the three matrices and across experts, H and I positive multiples of 32. Throws kFormat naming
// the file, the tensor, and the expected and actual value.
std::vector<MoeLayerInfo> find_moe_layers(const Checkpoint& checkpoint);

struct LoadOptions {
  // A UE8M0 scale byte 0xFF (NaN) makes every token routed to its expert NaN; loading rejects it
  // (kFormat naming the tensor, the expert and the position) unless this is set.
  bool allow_nan_scales = false;
};

// Loads one layer for EP rank `ep_rank` of `ep_size` (global experts [r*E_l, (r+1)*E_l),
// E_l = E / R) into canonical MoeWeights on the host: gate rows first, GPT-OSS rows
// de-interleaved (even rows gate, odd rows up; biases too). Only the rank's experts are read.
// kInvalidArgument when R does not divide E or r is outside [0, R); kFormat for a NaN scale
// byte (see LoadOptions).
MoeWeights load_moe_layer(const Checkpoint& checkpoint, const MoeLayerInfo& layer, int ep_rank,
                          int ep_size, const LoadOptions& options = {});

// Tensor names of the per-expert convention: "{prefix}.experts.{e}.{matrix}.{suffix}".
std::string per_expert_tensor_name(std::string_view prefix, int64_t expert,
                                   std::string_view matrix, std::string_view suffix);
// Tensor names of the fused convention: "{prefix}.experts.{suffix}".
std::string fused_tensor_name(std::string_view prefix, std::string_view suffix);

// Adds canonical weights (all E_l experts, numbered from 0) to `writer` under `prefix` in either
// convention (the fused one interleaves gate/up rows and biases). Bytes are copied into the
// writer. Used for fixtures and by examples that write synthetic checkpoints.
void add_moe_layer(SafetensorsWriter& writer, std::string_view prefix, const MoeWeights& weights,
                   ExpertConvention convention);

// ---------------------------------------------------------------------------------------------
// Inspection: scale-exponent statistics (megamoe inspect)
// ---------------------------------------------------------------------------------------------
// A per-row fold of MXFP4 weights into E4M3 relative to the row's largest scale exponent is exact
// when every block's exponent is within kMaxExactFoldSpread of it: E2M1 magnitudes 0.5 .. 6 scaled
// by 2^(6 - d) stay inside E4M3's exactly representable range [2^-9, 448] for d <= 14 (d = 15
// would need 2^-10). docs/layouts.md derives it.
constexpr int kMaxExactFoldSpread = 14;
constexpr int kNumUe8m0Codes = 256;

struct ScaleStats {
  int64_t rows = 0;
  int64_t values = 0;
  int64_t nan_values = 0;            // 0xFF bytes (excluded from min/max/spread)
  int min = kNumUe8m0Codes;          // min/max UE8M0 byte (biased exponent); min > max when empty
  int max = -1;
  std::array<int64_t, kNumUe8m0Codes> spread_rows{};  // rows by (max - min) inside the row

  void add_rows(const uint8_t* sf, int64_t rows, int64_t groups_per_row);
  void merge(const ScaleStats& other);
  int max_spread() const;
  int spread_percentile(double fraction) const;  // smallest spread covering `fraction` of rows
  double fraction_rows_within(int spread) const;
  bool fold_exact() const { return max_spread() <= kMaxExactFoldSpread; }
};

// One expert's scale tensor in brief (per-tensor statistics without the histogram).
struct ExpertScaleSummary {
  int min = kNumUe8m0Codes;  // UE8M0 bytes; min > max when the tensor has no finite scale
  int max = -1;
  int max_row_spread = 0;
};

struct InspectMatrix {
  std::string role;          // "gate (w1)", "up (w3)", "down (w2)"
  std::string weight_desc;   // dtype and shape of one expert's tensor (or the fused tensor)
  std::string scale_desc;
  ScaleStats stats;          // over all experts (rows of this matrix only)
  std::vector<ExpertScaleSummary> per_expert;  // expert e's scale tensor (when stats were read)
  // The first expert (global id) with a scale byte >= kSm90SerialScaleByte and its largest such
  // byte (255 = NaN): the sm90 GEMM of this matrix then takes its serial tiles. Not found: fast.
  ScaleByteHit first_serial;
  ScaleByteHit first_nan;    // the first expert with a NaN byte (0xFF): loading rejects it
};

struct InspectLayer {
  MoeLayerInfo info;
  std::vector<InspectMatrix> matrices;  // gate, up, down
  int64_t expert_bytes = 0;             // canonical bytes of one expert (weights + scales + bias)
};

struct InspectOptions {
  bool scale_stats = true;                          // false: shapes only, no data read
  std::function<void(int64_t, int64_t)> progress;   // (layers done, layers)
};

std::vector<InspectLayer> inspect_checkpoint(const Checkpoint& checkpoint,
                                             const InspectOptions& options = {});
// "fast path (every scale byte < 128)" or "serial path: scale byte 200 >= 128 in expert 3".
std::string sm90_path_text(const InspectMatrix& matrix);

// Human-readable report of the layers (what `megamoe inspect` prints); `per_expert` adds one
// line per expert and matrix (min, max, largest row spread of its scale tensor).
std::string format_inspect_report(const Checkpoint& checkpoint,
                                  const std::vector<InspectLayer>& layers, bool per_expert = false);

}  // namespace megamoe
