// python/src/bind_config.cpp: LayerShape, Activation, LayerConfig and the named presets.
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <variant>

#include <nanobind/stl/optional.h>

#include "bindings.hpp"
#include "megamoe/activation.hpp"
#include "megamoe/config.hpp"

namespace megamoe::python {

namespace {

using ShapeArg = std::variant<LayerShape, std::string>;
using ActivationArg = std::variant<Activation, std::string>;

LayerShape to_shape(const ShapeArg& shape) {
  if (const auto* name = std::get_if<std::string>(&shape)) return shape_preset(*name);
  return std::get<LayerShape>(shape);
}

Activation to_activation(const ActivationArg& act) {
  if (const auto* spec = std::get_if<std::string>(&act)) return Activation::parse(*spec);
  Activation a = std::get<Activation>(act);
  a.validate();
  return a;
}

std::string config_repr(const LayerConfig& c) {
  return detail::concat("LayerConfig(shape=", c.shape.to_string(), ", activation='",
                        c.activation.to_string(), "', ep_size=", c.ep_size, ", ep_rank=", c.ep_rank,
                        ", max_tokens_per_rank=", c.max_tokens_per_rank,
                        ", fast_math=", c.fast_math ? "True" : "False", ", precision='",
                        to_string(c.precision), "', gemm_tile='", c.sm90.gemm_tile, "'",
                        c.sm90.mega_kernel ? ", mega_kernel=True" : "",
                        c.sm90.mega_dispatch ? ", mega_dispatch=True" : "",
                        c.sm90.mega_combine ? ", mega_combine=True" : "",
                        c.sm90.decode_front ? "" : ", decode_front=False", ")");
}

}  // namespace

void register_config(nb::module_& m) {
  // -------------------------------------------------------------------------------------------
  // LayerShape
  // -------------------------------------------------------------------------------------------
  nb::class_<LayerShape>(m, "LayerShape",
                         "Routed-expert shape of one MoE layer: hidden H (expert input width), "
                         "intermediate I (per expert), num_experts E (all ranks), top_k K.")
      .def(
          "__init__",
          [](LayerShape* self, int64_t hidden, int64_t intermediate, int64_t num_experts,
             int64_t top_k) {
            new (self) LayerShape{hidden, intermediate, num_experts, top_k};
            self->validate();
          },
          nb::arg("hidden"), nb::arg("intermediate"), nb::arg("num_experts"), nb::arg("top_k"),
          "Validated: H and I multiples of 32, all positive (InvalidArgumentError otherwise).")
      .def_rw("hidden", &LayerShape::hidden)
      .def_rw("intermediate", &LayerShape::intermediate)
      .def_rw("num_experts", &LayerShape::num_experts)
      .def_rw("top_k", &LayerShape::top_k)
      .def("validate", &LayerShape::validate)
      .def("__repr__", [](const LayerShape& s) { return "LayerShape(" + s.to_string() + ")"; })
      .def("__eq__", [](const LayerShape& a, const LayerShape& b) {
        return a.hidden == b.hidden && a.intermediate == b.intermediate &&
               a.num_experts == b.num_experts && a.top_k == b.top_k;
      });

  m.def("shape_preset", &shape_preset, nb::arg("name"),
        "The LayerShape of a named preset (see shape_preset_names()).");
  m.def("shape_preset_names", &shape_preset_names, "Names accepted by shape_preset().");
  m.def("activation_preset", &activation_preset, nb::arg("shape_name"),
        "The activation a preset model uses (kimi-k3: situ; gpt-oss-120b: swiglu_oai; others: "
        "swiglu).");

  // -------------------------------------------------------------------------------------------
  // Activation
  // -------------------------------------------------------------------------------------------
  nb::class_<Activation>(m, "Activation",
                         "The activation epilogue, chosen by name (numerics.md section 4). Build "
                         "with Activation.parse('situ'), Activation.swiglu(), ...")
      .def_static("parse", &Activation::parse, nb::arg("spec"),
                  "Parse 'swiglu', 'swiglu:clamp=7', 'situ', 'situ:beta=4,linear_beta=25', "
                  "'swiglu_oai', 'swiglu_oai:alpha=1.702,clamp=7'. InvalidArgumentError names "
                  "the problem.")
      .def_static("swiglu", &Activation::swiglu)
      .def_static("swiglu_clamped", &Activation::swiglu_clamped, nb::arg("limit"))
      .def_static("situ", &Activation::situ, nb::arg("beta") = 4.0f,
                  nb::arg("linear_beta") = 25.0f)
      .def_static("swiglu_oai", &Activation::swiglu_oai, nb::arg("alpha") = 1.702f,
                  nb::arg("limit") = 7.0f)
      .def_prop_ro("kind", &Activation::name)
      .def_prop_ro("clamp", [](const Activation& a) -> std::optional<float> {
        if (!a.has_clamp) return std::nullopt;
        return a.clamp;
      }, "The clamp limit L, or None when there is no clamp.")
      .def_ro("beta", &Activation::beta)
      .def_ro("linear_beta", &Activation::linear_beta)
      .def_ro("alpha", &Activation::alpha)
      .def("validate", &Activation::validate)
      .def("name", &Activation::name)
      .def("__str__", &Activation::to_string)
      .def("__repr__", [](const Activation& a) {
        return "Activation.parse('" + a.to_string() + "')";
      })
      .def("__eq__", [](const Activation& a, const Activation& b) {
        return a.to_string() == b.to_string();
      });

  // -------------------------------------------------------------------------------------------
  // LayerConfig
  // -------------------------------------------------------------------------------------------
  nb::class_<LayerConfig>(m, "LayerConfig",
                          "Shape and configuration of one MoE layer on one EP rank.")
      .def(
          "__init__",
          [](LayerConfig* self, const ShapeArg& shape, std::optional<ActivationArg> activation,
             int ep_size, int ep_rank, int64_t max_tokens_per_rank, bool fast_math,
             const std::string& gemm_tile, bool programmatic_launch, const std::string& rows_hint,
             bool sync_error_check, const std::string& precision,
             int64_t fp8_min_rows_per_expert, bool mega_kernel, bool decode_front,
             bool mega_dispatch, bool mega_combine) {
            LayerConfig c;
            c.shape = to_shape(shape);
            if (activation) {
              c.activation = to_activation(*activation);
            } else if (const auto* name = std::get_if<std::string>(&shape)) {
              c.activation = activation_preset(*name);
            }
            c.ep_size = ep_size;
            c.ep_rank = ep_rank;
            c.max_tokens_per_rank = max_tokens_per_rank;
            c.fast_math = fast_math;
            c.sm90.gemm_tile = gemm_tile;
            c.sm90.programmatic_launch = programmatic_launch;
            c.sm90.rows_hint = parse_rows_hint_mode(rows_hint);
            c.sm90.mega_kernel = mega_kernel;
            c.sm90.decode_front = decode_front;
            c.sm90.mega_dispatch = mega_dispatch;
            c.sm90.mega_combine = mega_combine;
            c.sync_error_check = sync_error_check;
            c.precision = parse_precision(precision);
            c.fp8_min_rows_per_expert = fp8_min_rows_per_expert;
            c.validate();
            new (self) LayerConfig(c);
          },
          nb::arg("shape"), nb::arg("activation") = nb::none(), nb::arg("ep_size") = 1,
          nb::arg("ep_rank") = 0, nb::arg("max_tokens_per_rank") = 8192,
          nb::arg("fast_math") = true, nb::arg("gemm_tile") = "auto",
          nb::arg("programmatic_launch") = true, nb::arg("rows_hint") = "gated",
          nb::arg("sync_error_check") = false, nb::arg("precision") = "exact",
          nb::arg("fp8_min_rows_per_expert") = 128, nb::arg("mega_kernel") = false,
          nb::arg("decode_front") = true, nb::arg("mega_dispatch") = false,
          nb::arg("mega_combine") = false,
          "shape: a LayerShape or a preset name ('kimi-k3', 'deepseek-v3', 'gpt-oss-120b', "
          "'small'). activation: an Activation or a spec string; None takes the preset's "
          "activation when shape is a name, else 'swiglu'. gemm_tile, programmatic_launch, "
          "rows_hint: the Hopper backend's options ('auto', 'serial' or a tile name of "
          "`megamoe bench --list-tiles`; programmatic dependent launch; 'gated', 'bound' or "
          "'expected'). sync_error_check: GPU layers wait for every call and raise invalid expert "
          "ids at once (debugging; not under CUDA-graph capture); by default they raise them at "
          "the next call or at MoELayer.check_errors(). precision: 'exact' (the contract) or 'fp8' "
          "(the FP8 mode of docs/numerics.md, for calls with at least fp8_min_rows_per_expert routed "
          "rows per expert on average, T * K / E; 0: every call), on both backends; sm90 raises "
          "UnsupportedError for it with H, I not multiples of 128. mega_kernel: the sm90 backend runs "
          "both expert GEMMs of a call with up to 12 routed rows per expert (exact mode) in one "
          "persistent launch, the MegaMoE kernel (the same results as the chained launches). "
          "decode_front: the sm90 backend quantizes, dispatches and gathers a call with "
          "T * K <= 1024 on one GPU (exact mode) in one launch (False: three; the same results). "
          "mega_dispatch (with mega_kernel, under expert parallelism): the MegaMoE kernel gathers "
          "each received token row as it arrives instead of a gather launch after every rank's "
          "rows (the same results). mega_combine (with mega_kernel): the MegaMoE kernel also sums "
          "y of calls up to 16384 items (T * H / 8), and under expert parallelism returns its "
          "rows' signal, instead of launches after it (the same results). Validated on "
          "construction.")
      .def_rw("shape", &LayerConfig::shape)
      .def_rw("activation", &LayerConfig::activation)
      .def_rw("ep_size", &LayerConfig::ep_size)
      .def_rw("ep_rank", &LayerConfig::ep_rank)
      .def_rw("max_tokens_per_rank", &LayerConfig::max_tokens_per_rank)
      .def_rw("fast_math", &LayerConfig::fast_math)
      .def_rw("sync_error_check", &LayerConfig::sync_error_check)
      .def_prop_rw(
          "gemm_tile", [](const LayerConfig& c) { return c.sm90.gemm_tile; },
          [](LayerConfig& c, const std::string& v) { c.sm90.gemm_tile = v; })
      .def_prop_rw(
          "programmatic_launch", [](const LayerConfig& c) { return c.sm90.programmatic_launch; },
          [](LayerConfig& c, bool v) { c.sm90.programmatic_launch = v; })
      .def_prop_rw(
          "mega_kernel", [](const LayerConfig& c) { return c.sm90.mega_kernel; },
          [](LayerConfig& c, bool v) { c.sm90.mega_kernel = v; })
      .def_prop_rw(
          "mega_dispatch", [](const LayerConfig& c) { return c.sm90.mega_dispatch; },
          [](LayerConfig& c, bool v) { c.sm90.mega_dispatch = v; })
      .def_prop_rw(
          "mega_combine", [](const LayerConfig& c) { return c.sm90.mega_combine; },
          [](LayerConfig& c, bool v) { c.sm90.mega_combine = v; })
      .def_prop_rw(
          "decode_front", [](const LayerConfig& c) { return c.sm90.decode_front; },
          [](LayerConfig& c, bool v) { c.sm90.decode_front = v; })
      .def_prop_rw(
          "rows_hint", [](const LayerConfig& c) { return std::string(to_string(c.sm90.rows_hint)); },
          [](LayerConfig& c, const std::string& v) { c.sm90.rows_hint = parse_rows_hint_mode(v); })
      .def_prop_rw(
          "precision", [](const LayerConfig& c) { return std::string(to_string(c.precision)); },
          [](LayerConfig& c, const std::string& v) { c.precision = parse_precision(v); })
      .def_rw("fp8_min_rows_per_expert", &LayerConfig::fp8_min_rows_per_expert)
      .def("fp8_for_tokens", &LayerConfig::fp8_for_tokens, nb::arg("num_tokens"),
           "Whether a call of num_tokens tokens runs the FP8 mode.")
      .def_prop_ro("num_local_experts", &LayerConfig::num_local_experts)
      .def_prop_ro("first_local_expert", &LayerConfig::first_local_expert)
      .def("validate", &LayerConfig::validate)
      .def("__repr__", &config_repr);
}

}  // namespace megamoe::python
