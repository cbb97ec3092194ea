// python/src/bind_checkpoint.cpp: safetensors checkpoints -> canonical MoeWeights, and weight
// preparation (a backend's layout, in place, with an exact inverse).
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bindings.hpp"
#include "megamoe/checkpoint.hpp"
#include "megamoe/prepare.hpp"

namespace megamoe::python {

namespace {

// NOTES: Checkpoint is move-only in practice (it owns memory mappings), but its implicit copy
// constructor is declared, which makes nanobind try to instantiate it; a holder with a deleted
// copy keeps the binding honest.
struct CheckpointHandle {
  explicit CheckpointHandle(Checkpoint c) : ckpt(std::move(c)) {}
  CheckpointHandle(const CheckpointHandle&) = delete;
  CheckpointHandle& operator=(const CheckpointHandle&) = delete;
  Checkpoint ckpt;
};

ExpertConvention parse_convention(const std::string& name) {
  if (name == expert_convention_name(ExpertConvention::kPerExpert)) return ExpertConvention::kPerExpert;
  if (name == expert_convention_name(ExpertConvention::kFused)) return ExpertConvention::kFused;
  fail(ErrorCode::kInvalidArgument, "convention: expected '",
       expert_convention_name(ExpertConvention::kPerExpert), "' or '",
       expert_convention_name(ExpertConvention::kFused), "', got '", name, "'");
}

std::string layer_info_repr(const MoeLayerInfo& l) {
  return detail::concat("MoeLayerInfo(prefix='", l.prefix, "', layer_index=", l.layer_index,
                        ", convention='", expert_convention_name(l.convention),
                        "', num_experts=", l.num_experts, ", hidden=", l.hidden,
                        ", intermediate=", l.intermediate,
                        ", has_bias=", l.has_bias ? "True" : "False", ")");
}

nb::dict report_dict(const PrepareReport& r) {
  nb::dict d;
  d["from_layout"] = r.from_layout;
  d["to_layout"] = r.to_layout;
  d["no_op"] = r.no_op;
  d["converted"] = r.converted;
  d["bytes_transformed"] = r.bytes_transformed;
  d["scratch_bytes"] = r.scratch_bytes;
  d["peak_extra_bytes"] = r.peak_extra_bytes;
  d["summary"] = r.summary();
  return d;
}

PrepareOptions prepare_options(int64_t scratch_bytes, uintptr_t stream) {
  PrepareOptions o;
  o.scratch_bytes = scratch_bytes;
  o.stream = reinterpret_cast<void*>(stream);
  return o;
}

void write_moe_checkpoint(const std::string& path, const std::map<std::string, WeightsHolder*>& layers,
                          const std::string& convention) {
  const ExpertConvention conv = parse_convention(convention);
  SafetensorsWriter writer;
  for (const auto& [prefix, holder] : layers) {
    MEGAMOE_CHECK_ARG(holder != nullptr, "layers['", prefix, "']: expected MoeWeights, got None");
    const MoeWeights& w = holder->get("layers");
    MEGAMOE_CHECK_ARG(w.device().type == DeviceType::kCPU && w.layout == kCanonicalLayout,
                      "layers['", prefix, "']: expected canonical host weights, got layout '",
                      w.layout, "' on ", device_name(w.device()));
    add_moe_layer(writer, prefix, w, conv);
  }
  without_gil([&] {
    writer.write(path);
  });
}

}  // namespace

void register_checkpoint(nb::module_& m) {
  nb::class_<MoeLayerInfo>(m, "MoeLayerInfo",
                           "One MoE layer found in a checkpoint (find_moe_layers).")
      .def_ro("prefix", &MoeLayerInfo::prefix)
      .def_ro("layer_index", &MoeLayerInfo::layer_index)
      .def_prop_ro("convention",
                   [](const MoeLayerInfo& l) { return expert_convention_name(l.convention); })
      .def_ro("num_experts", &MoeLayerInfo::num_experts)
      .def_ro("hidden", &MoeLayerInfo::hidden)
      .def_ro("intermediate", &MoeLayerInfo::intermediate)
      .def_ro("has_bias", &MoeLayerInfo::has_bias)
      .def("__repr__", &layer_info_repr);

  nb::class_<CheckpointHandle>(m, "Checkpoint",
                               "A safetensors checkpoint: one file, an index.json, or a folder of "
                               "shards (memory-mapped and validated when opened).")
      .def_static(
          "_open",
          [](const std::string& path) {
            std::unique_ptr<CheckpointHandle> h;
            without_gil([&] {
              h = std::make_unique<CheckpointHandle>(Checkpoint::open(path));
            });
            return h.release();
          },
          nb::arg("path"), nb::rv_policy::take_ownership)
      .def_prop_ro("path", [](const CheckpointHandle& h) { return h.ckpt.path(); })
      .def_prop_ro("num_tensors", [](const CheckpointHandle& h) { return h.ckpt.num_tensors(); })
      .def_prop_ro("total_bytes", [](const CheckpointHandle& h) { return h.ckpt.total_bytes(); })
      .def("tensor_names", [](const CheckpointHandle& h) { return h.ckpt.tensor_names(); })
      .def(
          "moe_layers", [](const CheckpointHandle& h) { return find_moe_layers(h.ckpt); },
          "All MoE layers, ordered by layer index then prefix, each validated in full.")
      .def("__repr__", [](const CheckpointHandle& h) {
        return detail::concat("Checkpoint('", h.ckpt.path(), "', tensors=", h.ckpt.num_tensors(),
                              ", bytes=", h.ckpt.total_bytes(), ")");
      });

  m.def(
      "load_moe_layer",
      [](const CheckpointHandle& checkpoint, const MoeLayerInfo& layer, int ep_rank, int ep_size,
         bool allow_nan_scales) {
        MoeWeights w;
        LoadOptions options;
        options.allow_nan_scales = allow_nan_scales;
        without_gil([&] {
          w = load_moe_layer(checkpoint.ckpt, layer, ep_rank, ep_size, options);
        });
        return new WeightsHolder(std::move(w));
      },
      nb::arg("checkpoint"), nb::arg("layer"), nb::arg("ep_rank") = 0, nb::arg("ep_size") = 1,
      nb::arg("allow_nan_scales") = false, nb::rv_policy::take_ownership);
  m.def("write_moe_checkpoint", &write_moe_checkpoint, nb::arg("path"), nb::arg("layers"),
        nb::arg("convention"));

  m.def(
      "prepare",
      [](WeightsHolder& w, const std::string& backend, int64_t scratch_bytes, uintptr_t stream) {
        MoeWeights& weights = w.get("weights");
        PrepareReport r;
        without_gil([&] {
          r = prepare(weights, backend, prepare_options(scratch_bytes, stream));
        });
        return report_dict(r);
      },
      nb::arg("weights"), nb::arg("backend"), nb::arg("scratch_bytes"), nb::arg("stream"));
  m.def(
      "unprepare",
      [](WeightsHolder& w, int64_t scratch_bytes, uintptr_t stream) {
        MoeWeights& weights = w.get("weights");
        PrepareReport r;
        without_gil([&] {
          r = unprepare(weights, prepare_options(scratch_bytes, stream));
        });
        return report_dict(r);
      },
      nb::arg("weights"), nb::arg("scratch_bytes"), nb::arg("stream"));
  m.def(
      "prepare_for_fused",
      [](WeightsHolder& w, int sm_version, int64_t scratch_bytes, uintptr_t stream) {
        MoeWeights& weights = w.get("weights");
        PrepareReport r;
        without_gil([&] {
          r = prepare_for_fused(weights, sm_version, prepare_options(scratch_bytes, stream));
        });
        return report_dict(r);
      },
      nb::arg("weights"), nb::arg("sm_version"), nb::arg("scratch_bytes"), nb::arg("stream"));
  m.def("layout_names", &layout_names);
  m.def("layout_for_backend", &layout_for_backend, nb::arg("backend"));
  m.attr("DEFAULT_PREPARE_SCRATCH_BYTES") = kDefaultPrepareScratchBytes;
}

}  // namespace megamoe::python
