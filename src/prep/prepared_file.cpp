// Prepared checkpoints: one EP rank's MoE layers in a backend's layout, written layer by layer
// (load -> prepare -> write -> release) so memory stays at one layer whatever the model size.
#include <chrono>
#include <cstring>

#include <nlohmann/json.hpp>

#include "checkpoint/safetensors_detail.hpp"
#include "megamoe/error.hpp"
#include "megamoe/formats.hpp"
#include "megamoe/prepare.hpp"
#include "megamoe/weights.hpp"

namespace megamoe {

namespace {

using json = nlohmann::json;

constexpr const char* kKeyFormat = "megamoe.format";
constexpr const char* kKeyLayout = "megamoe.layout";
constexpr const char* kKeyBackend = "megamoe.backend";
constexpr const char* kKeyRank = "megamoe.ep_rank";
constexpr const char* kKeySize = "megamoe.ep_size";
constexpr const char* kKeySource = "megamoe.source";
constexpr const char* kKeyLayers = "megamoe.layers";
// Root list (0) -> layer objects (1) -> their values (2).
constexpr int kMaxLayersJsonDepth = 2;
constexpr int64_t kBf16Bytes = 2;
constexpr int64_t kMaxPreparedDim = int64_t{1} << 20;  // bound for E_l, H, I read from metadata

// Buffers in file order: uint8 ones first, BF16 biases last (keeps every tensor aligned).
constexpr WeightBufferKind kFileOrder[kNumWeightBuffers] = {
    WeightBufferKind::kW13, WeightBufferKind::kW13Sf, WeightBufferKind::kW2,
    WeightBufferKind::kW2Sf, WeightBufferKind::kW13Bias, WeightBufferKind::kW2Bias};

bool is_bias(WeightBufferKind k) {
  return k == WeightBufferKind::kW13Bias || k == WeightBufferKind::kW2Bias;
}

std::string buffer_tensor_name(std::string_view prefix, WeightBufferKind kind) {
  return fused_tensor_name(prefix, weight_buffer_name(kind));
}

// dtype and shape a buffer is stored with (see prepare.hpp).
void tensor_form(const WeightLayout& layout, WeightBufferKind kind, int64_t el,
                 const ExpertDims& d, StDType* dtype, std::vector<int64_t>* shape) {
  const int64_t H = d.hidden, I = d.intermediate;
  if (is_bias(kind)) {
    *dtype = StDType::kBF16;
    *shape = {el, layout.expert_bytes(kind, d) / kBf16Bytes};
    return;
  }
  *dtype = StDType::kU8;
  if (layout.name != kCanonicalLayout) {
    *shape = {el, layout.expert_bytes(kind, d)};
    return;
  }
  switch (kind) {
    case WeightBufferKind::kW13: *shape = {el, 2 * I, H / 2}; break;
    case WeightBufferKind::kW13Sf: *shape = {el, 2 * I, H / kScaleBlock}; break;
    case WeightBufferKind::kW2: *shape = {el, H, I / 2}; break;
    default: *shape = {el, H, I / kScaleBlock}; break;
  }
}

struct LayerMeta {
  std::string prefix;
  int64_t layer_index = -1;
  std::string convention;
  int64_t num_experts = 0, first_expert = 0, num_local_experts = 0, hidden = 0, intermediate = 0;
  bool bias = false;
};

json to_json(const LayerMeta& m) {
  return json{{"prefix", m.prefix},           {"layer_index", m.layer_index},
              {"convention", m.convention},   {"num_experts", m.num_experts},
              {"first_expert", m.first_expert}, {"num_local_experts", m.num_local_experts},
              {"hidden", m.hidden},           {"intermediate", m.intermediate},
              {"bias", m.bias}};
}

std::vector<LayerMeta> read_layers_meta(const SafetensorsFile& file) {
  const auto& meta = file.metadata();
  const auto fmt = meta.find(kKeyFormat);
  MEGAMOE_CHECK(fmt != meta.end() && fmt->second == kPreparedFormat, ErrorCode::kFormat,
                file.path(), ": not a megamoe prepared checkpoint (metadata ", kKeyFormat,
                " should be '", kPreparedFormat, "', got ",
                fmt == meta.end() ? std::string("nothing") : "'" + fmt->second + "'", ")");
  const auto layers = meta.find(kKeyLayers);
  MEGAMOE_CHECK(layers != meta.end(), ErrorCode::kFormat, file.path(), ": metadata lacks ",
                kKeyLayers);
  const json list = detail::parse_json_strict(file.path(), kKeyLayers, layers->second.data(),
                                              layers->second.data() + layers->second.size(),
                                              kMaxLayersJsonDepth);
  MEGAMOE_CHECK(list.is_array(), ErrorCode::kFormat, file.path(), ": ", kKeyLayers,
                " must be a JSON list");
  std::vector<LayerMeta> out;
  for (const json& j : list) {
    LayerMeta m;
    // Integers must be JSON integers (a float such as 1e300 would not convert safely).
    auto integer = [&](const char* key) {
      const json& v = j.at(key);
      MEGAMOE_CHECK(v.is_number_integer(), ErrorCode::kFormat, file.path(), ": ", kKeyLayers,
                    " field '", key, "' must be an integer, got ", v.type_name());
      return v.get<int64_t>();
    };
    try {
      m.prefix = j.at("prefix").get<std::string>();
      m.layer_index = integer("layer_index");
      m.convention = j.at("convention").get<std::string>();
      m.num_experts = integer("num_experts");
      m.first_expert = integer("first_expert");
      m.num_local_experts = integer("num_local_experts");
      m.hidden = integer("hidden");
      m.intermediate = integer("intermediate");
      m.bias = j.at("bias").get<bool>();
    } catch (const json::exception& e) {
      fail(ErrorCode::kFormat, file.path(), ": ", kKeyLayers, " entry is malformed (", e.what(), ")");
    }
    out.push_back(std::move(m));
  }
  return out;
}

}  // namespace

PreparedCheckpointReport write_prepared_checkpoint(const Checkpoint& ckpt, const std::string& out_path,
                                                   const PreparedCheckpointOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string layout_name = layout_for_backend(options.backend);
  const WeightLayout& layout = find_layout(layout_name);
  MEGAMOE_CHECK_ARG(options.ep_size >= 1 && options.ep_rank >= 0 && options.ep_rank < options.ep_size,
                    "prepare: --ep-rank must be in [0, --ep-size), got rank ", options.ep_rank,
                    " of ", options.ep_size);

  // Layers to write, all checked before the output is created.
  std::vector<MoeLayerInfo> layers;
  const std::vector<MoeLayerInfo> all = find_moe_layers(ckpt);
  MEGAMOE_CHECK(!all.empty(), ErrorCode::kFormat, ckpt.path(), ": no MoE expert tensors found");
  if (options.prefixes.empty()) {
    layers = all;
  } else {
    for (const std::string& p : options.prefixes) {
      bool found = false;
      for (const auto& l : all) {
        if (l.prefix == p) {
          layers.push_back(l);
          found = true;
        }
      }
      MEGAMOE_CHECK_ARG(found, ckpt.path(), ": no MoE layer with prefix ", detail::quote_name(p),
                        " (first layer: ", detail::quote_name(all.front().prefix), ")");
    }
  }
  SafetensorsWriter writer;
  writer.set_preserve_order(true);
  json layers_meta = json::array();
  std::map<std::string, std::pair<size_t, WeightBufferKind>> tensor_of;  // name -> (layer, buffer)
  PreparedCheckpointReport report;
  report.layout = layout_name;
  for (size_t i = 0; i < layers.size(); ++i) {
    const MoeLayerInfo& l = layers[i];
    MEGAMOE_CHECK_ARG(l.num_experts % options.ep_size == 0, ckpt.path(), ": layer ",
                      detail::quote_name(l.prefix), ": E = ", l.num_experts,
                      " experts is not divisible by EP size ", options.ep_size);
    const ExpertDims dims{l.hidden, l.intermediate};
    if (layout.check_dims != nullptr) layout.check_dims(dims);
    const int64_t el = l.num_experts / options.ep_size;
    int64_t layer_bytes = 0;
    for (WeightBufferKind kind : kFileOrder) {
      if (is_bias(kind) && !l.has_bias) continue;
      StDType dtype;
      std::vector<int64_t> shape;
      tensor_form(layout, kind, el, dims, &dtype, &shape);
      const std::string name = buffer_tensor_name(l.prefix, kind);
      writer.add_deferred(name, dtype, shape);
      tensor_of[name] = {i, kind};
      layer_bytes += el * layout.expert_bytes(kind, dims);
    }
    report.weight_bytes += layer_bytes;
    report.max_layer_bytes = std::max(report.max_layer_bytes, layer_bytes);
    LayerMeta m{l.prefix, l.layer_index, expert_convention_name(l.convention), l.num_experts,
                el * options.ep_rank, el, l.hidden, l.intermediate, l.has_bias};
    layers_meta.push_back(to_json(m));
  }
  writer.set_metadata(kKeyFormat, kPreparedFormat);
  writer.set_metadata(kKeyLayout, layout_name);
  writer.set_metadata(kKeyBackend, options.backend);
  writer.set_metadata(kKeyRank, std::to_string(options.ep_rank));
  writer.set_metadata(kKeySize, std::to_string(options.ep_size));
  writer.set_metadata(kKeySource, ckpt.path());
  writer.set_metadata(kKeyLayers, layers_meta.dump());

  // Stream: the first tensor of a layer loads and prepares it (releasing the previous one).
  reset_memory_peak();
  const int64_t baseline = memory_stats().host_bytes;
  size_t current_layer = layers.size();
  MoeWeights current;
  auto source = [&](const std::string& name) -> const void* {
    const auto& [layer, kind] = tensor_of.at(name);
    if (layer != current_layer) {
      current = MoeWeights();  // release before loading the next layer
      current = load_moe_layer(ckpt, layers[layer], options.ep_rank, options.ep_size, options.load);
      PrepareOptions popt = options.prepare;
      popt.progress = nullptr;
      const PrepareReport r = prepare(current, options.backend, popt);
      report.peak_prepare_extra = std::max(report.peak_prepare_extra, r.peak_extra_bytes);
      current_layer = layer;
      ++report.layers;
    }
    return weight_buffer(current, kind).data();
  };
  writer.write(out_path, options.progress, source);
  current = MoeWeights();
  report.peak_host_bytes = memory_stats().host_peak_bytes - baseline;
  report.file_bytes = writer.file_bytes();
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return report;
}

std::vector<std::string> prepared_layer_prefixes(const SafetensorsFile& file) {
  std::vector<std::string> out;
  for (const LayerMeta& m : read_layers_meta(file)) out.push_back(m.prefix);
  return out;
}

MoeWeights load_prepared_layer(const SafetensorsFile& file, std::string_view prefix,
                               bool allow_nan_scales) {
  const std::vector<LayerMeta> metas = read_layers_meta(file);
  const LayerMeta* m = nullptr;
  for (const auto& x : metas)
    if (x.prefix == prefix) m = &x;
  MEGAMOE_CHECK_ARG(m != nullptr, file.path(), ": no prepared layer ", detail::quote_name(prefix));
  const auto layout_it = file.metadata().find(kKeyLayout);
  MEGAMOE_CHECK(layout_it != file.metadata().end(), ErrorCode::kFormat, file.path(),
                ": metadata lacks ", kKeyLayout);
  const std::string& layout_name = layout_it->second;
  const WeightLayout& layout = find_layout(layout_name);
  MoeWeights w;
  w.num_local_experts = m->num_local_experts;
  w.first_expert = m->first_expert;
  w.hidden = m->hidden;
  w.intermediate = m->intermediate;
  w.layout = layout_name;
  // The metadata is untrusted: bound the dimensions before any size is computed from them.
  int64_t expert_elements = 0, layer_elements = 0;
  const bool sane = w.num_local_experts > 0 && w.hidden > 0 && w.hidden % kScaleBlock == 0 &&
                    w.intermediate > 0 && w.intermediate % kScaleBlock == 0 &&
                    w.hidden <= kMaxPreparedDim && w.intermediate <= kMaxPreparedDim &&
                    w.num_local_experts <= kMaxPreparedDim &&
                    !__builtin_mul_overflow(w.hidden, w.intermediate, &expert_elements) &&
                    !__builtin_mul_overflow(expert_elements, w.num_local_experts, &layer_elements);
  MEGAMOE_CHECK(sane, ErrorCode::kFormat, file.path(), ": layer ", detail::quote_name(prefix),
                ": bad dimensions E_l = ", w.num_local_experts, ", H = ", w.hidden, ", I = ",
                w.intermediate);
  const ExpertDims dims{w.hidden, w.intermediate};
  for (WeightBufferKind kind : kFileOrder) {
    if (is_bias(kind) && !m->bias) continue;
    const std::string name = buffer_tensor_name(prefix, kind);
    const TensorInfo& t = file.get(name);
    StDType dtype;
    std::vector<int64_t> shape;
    tensor_form(layout, kind, w.num_local_experts, dims, &dtype, &shape);
    MEGAMOE_CHECK(t.dtype == dtype && t.shape == shape, ErrorCode::kFormat, file.path(),
                  ": tensor ", detail::quote_name(name), ": expected ", st_dtype_name(dtype),
                  detail::shape_string(shape), " for layout '", layout_name, "', got ",
                  t.describe());
    Buffer& buf = weight_buffer(w, kind);
    buf = Buffer(t.nbytes());
    std::memcpy(buf.data(), file.data(t), static_cast<size_t>(t.nbytes()));
  }
  check_weights_layout(w);
  // As at checkpoint loading: a NaN scale byte would make every token of its expert NaN. Every
  // layout keeps an expert's scale bytes in its own part of the buffer (a permutation of them).
  for (WeightBufferKind kind : {WeightBufferKind::kW13Sf, WeightBufferKind::kW2Sf}) {
    if (allow_nan_scales) break;
    const ScaleByteHit hit = find_scale_byte(weight_buffer(w, kind), w.num_local_experts, kUe8m0NaN);
    MEGAMOE_CHECK(!hit.found(), ErrorCode::kFormat, file.path(), ": tensor ",
                  detail::quote_name(buffer_tensor_name(prefix, kind)),
                  ": UE8M0 scale byte 0xFF (NaN) in expert ", w.first_expert + hit.expert,
                  " (byte ", hit.offset, " of its scales in layout '", layout_name,
                  "'): every token routed to this expert would be NaN (allow_nan_scales accepts it)");
  }
  return w;
}

}  // namespace megamoe
