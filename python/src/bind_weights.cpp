// python/src/bind_weights.cpp: MoeWeights (the expert weights of one layer on one rank).
//
// Canonical form (weights.md section 2):
//   w13    uint8 [E_l, 2I, H/2]    rows [0, I) gate, [I, 2I) up; E2M1 pairs, low nibble = even k
//   w13_sf uint8 [E_l, 2I, H/32]   UE8M0
//   w2     uint8 [E_l, H, I/2]
//   w2_sf  uint8 [E_l, H, I/32]
//   w13_bias bf16 [E_l, 2I], w2_bias bf16 [E_l, H]   optional
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "bindings.hpp"
#include "megamoe/buffer.hpp"
#include "megamoe/config.hpp"
#include "megamoe/weights.hpp"

namespace megamoe::python {

namespace {

constexpr int64_t kE2M1PerByte = 2;

struct BufferSpec {
  const char* name;
  DType dtype;
  std::vector<int64_t> shape;  // canonical shape
};

// The canonical dtype and shape of buffer `name` for these dimensions.
BufferSpec canonical_spec(const MoeWeights& w, const std::string& name) {
  const int64_t e = w.num_local_experts, h = w.hidden, i = w.intermediate;
  if (name == "w13") return {"w13", DType::kU8, {e, 2 * i, h / kE2M1PerByte}};
  if (name == "w13_sf") return {"w13_sf", DType::kU8, {e, 2 * i, h / kScaleBlock}};
  if (name == "w2") return {"w2", DType::kU8, {e, h, i / kE2M1PerByte}};
  if (name == "w2_sf") return {"w2_sf", DType::kU8, {e, h, i / kScaleBlock}};
  if (name == "w13_bias") return {"w13_bias", DType::kBF16, {e, 2 * i}};
  if (name == "w2_bias") return {"w2_bias", DType::kBF16, {e, h}};
  fail(ErrorCode::kInvalidArgument, "name: expected one of w13, w13_sf, w2, w2_sf, w13_bias, "
       "w2_bias, got '", name, "'");
}

Buffer& buffer_of(MoeWeights& w, const std::string& name) {
  if (name == "w13") return w.w13;
  if (name == "w13_sf") return w.w13_sf;
  if (name == "w2") return w.w2;
  if (name == "w2_sf") return w.w2_sf;
  if (name == "w13_bias") return w.w13_bias;
  if (name == "w2_bias") return w.w2_bias;
  fail(ErrorCode::kInvalidArgument, "name: expected one of w13, w13_sf, w2, w2_sf, w13_bias, "
       "w2_bias, got '", name, "'");
}

// (shape, dtype name) of `name` as copy_to() writes it: the canonical shape while the weights are
// canonical, else the raw bytes of the prepared buffer (uint8 [nbytes]).
nb::tuple array_spec(WeightsHolder& holder, const std::string& name) {
  MoeWeights& w = holder.get("weights");
  const BufferSpec spec = canonical_spec(w, name);
  const Buffer& buffer = buffer_of(w, name);
  if (w.layout != kCanonicalLayout) {
    return nb::make_tuple(std::vector<int64_t>{buffer.size()}, "uint8");
  }
  if (buffer.empty()) return nb::make_tuple(std::vector<int64_t>{0}, dtype_name(spec.dtype));
  return nb::make_tuple(spec.shape, dtype_name(spec.dtype));
}

void copy_to(WeightsHolder& holder, const std::string& name, const OutArray& out) {
  MoeWeights& w = holder.get("weights");
  const Buffer& buffer = buffer_of(w, name);
  const TensorView v = view_of("out", out);
  MEGAMOE_CHECK_ARG(v.is_contiguous(), "out: expected a contiguous array");
  MEGAMOE_CHECK_ARG(v.nbytes() == buffer.size(), "out: expected ", buffer.size(), " bytes for ",
                    name, ", got ", v.describe(), " (", v.nbytes(), " bytes)");
  without_gil([&] {
    copy_bytes(v.data, v.device, buffer.data(), buffer.device(), buffer.size());
  });
}

// Copies `array` (checked against the canonical spec) into `buffer`.
void fill_buffer(const BufferSpec& spec, const InArray& array, Buffer& buffer, Device device) {
  const TensorView v = view_of(spec.name, array);
  expect_dtype(spec.name, v, {spec.dtype});
  MEGAMOE_CHECK_ARG(v.ndim == static_cast<int>(spec.shape.size()), spec.name, ": expected ",
                    spec.shape.size(), " dims, got ", v.describe());
  for (int d = 0; d < v.ndim; ++d) {
    MEGAMOE_CHECK_ARG(v.shape[d] == spec.shape[d], spec.name, ": expected extent ",
                      spec.shape[d], " in dim ", d, " (from w13 and w2), got ", v.describe());
  }
  MEGAMOE_CHECK_ARG(v.is_contiguous(), spec.name, ": expected a contiguous (row-major) array");
  MEGAMOE_CHECK_ARG(v.device == device, spec.name, ": expected an array on ", device_name(device),
                    " (the device of w13), got ", device_name(v.device));
  copy_bytes(buffer.data(), device, v.data, v.device, v.nbytes());
}

WeightsHolder* from_arrays(const InArray& w13, const InArray& w13_sf, const InArray& w2,
                           const InArray& w2_sf, int64_t first_expert,
                           std::optional<InArray> w13_bias, std::optional<InArray> w2_bias) {
  const TensorView v13 = view_of("w13", w13);
  const TensorView v2 = view_of("w2", w2);
  expect_dtype("w13", v13, {DType::kU8});
  expect_dtype("w2", v2, {DType::kU8});
  MEGAMOE_CHECK_ARG(v13.ndim == 3, "w13: expected uint8 [E_l, 2I, H/2], got ", v13.describe());
  MEGAMOE_CHECK_ARG(v2.ndim == 3, "w2: expected uint8 [E_l, H, I/2], got ", v2.describe());
  MEGAMOE_CHECK_ARG(v13.shape[1] % 2 == 0, "w13: dim 1 is 2I (gate rows then up rows), got odd ",
                    v13.shape[1]);
  MEGAMOE_CHECK_ARG(w13_bias.has_value() == w2_bias.has_value(),
                    "w13_bias/w2_bias: give both biases or neither");
  const int64_t num_local = v13.shape[0];
  const int64_t intermediate = v13.shape[1] / 2;
  const int64_t hidden = v13.shape[2] * kE2M1PerByte;
  MEGAMOE_CHECK_ARG(first_expert >= 0, "first_expert: expected >= 0, got ", first_expert);

  MoeWeights w = MoeWeights::allocate(num_local, first_expert, hidden, intermediate,
                                      w13_bias.has_value(), v13.device);
  fill_buffer(canonical_spec(w, "w13"), w13, w.w13, v13.device);
  fill_buffer(canonical_spec(w, "w13_sf"), w13_sf, w.w13_sf, v13.device);
  fill_buffer(canonical_spec(w, "w2"), w2, w.w2, v13.device);
  fill_buffer(canonical_spec(w, "w2_sf"), w2_sf, w.w2_sf, v13.device);
  if (w13_bias) {
    fill_buffer(canonical_spec(w, "w13_bias"), *w13_bias, w.w13_bias, v13.device);
    fill_buffer(canonical_spec(w, "w2_bias"), *w2_bias, w.w2_bias, v13.device);
  }
  w.validate_canonical();
  return new WeightsHolder(std::move(w));
}

std::string weights_repr(WeightsHolder& holder) {
  if (holder.consumed()) return "MoeWeights(<moved into a MoELayer>)";
  const MoeWeights& w = holder.get("weights");
  return detail::concat("MoeWeights(num_local_experts=", w.num_local_experts,
                        ", first_expert=", w.first_expert, ", hidden=", w.hidden,
                        ", intermediate=", w.intermediate, ", layout='", w.layout,
                        "', bias=", w.has_bias() ? "True" : "False", ", device='",
                        device_name(w.device()), "', bytes=", w.total_bytes(), ")");
}

}  // namespace

void register_weights(nb::module_& m) {
  nb::class_<WeightsHolder>(
      m, "MoeWeights",
      "Expert weights of one layer on one rank (canonical form: weights.md section 2). Passing "
      "them to MoELayer moves them into the layer, which prepares them in place; the object is "
      "then empty (`consumed` is True).")
      .def_static("_from_arrays", &from_arrays, nb::arg("w13"), nb::arg("w13_sf"), nb::arg("w2"),
                  nb::arg("w2_sf"), nb::arg("first_expert") = 0,
                  nb::arg("w13_bias") = nb::none(), nb::arg("w2_bias") = nb::none(),
                  nb::rv_policy::take_ownership)
      .def_prop_ro("consumed", &WeightsHolder::consumed)
      .def_prop_ro("num_local_experts",
                   [](WeightsHolder& h) { return h.get("weights").num_local_experts; })
      .def_prop_ro("first_expert", [](WeightsHolder& h) { return h.get("weights").first_expert; })
      .def_prop_ro("hidden", [](WeightsHolder& h) { return h.get("weights").hidden; })
      .def_prop_ro("intermediate", [](WeightsHolder& h) { return h.get("weights").intermediate; })
      .def_prop_ro("layout", [](WeightsHolder& h) { return h.get("weights").layout; })
      .def_prop_ro("has_bias", [](WeightsHolder& h) { return h.get("weights").has_bias(); })
      .def_prop_ro("device",
                   [](WeightsHolder& h) { return device_name(h.get("weights").device()); })
      .def_prop_ro("total_bytes", [](WeightsHolder& h) { return h.get("weights").total_bytes(); })
      .def("validate_canonical", [](WeightsHolder& h) { h.get("weights").validate_canonical(); })
      .def("check_matches",
           [](WeightsHolder& h, const LayerConfig& c) { h.get("weights").check_matches(c); },
           nb::arg("config"))
      .def("array_spec", &array_spec, nb::arg("name"))
      .def("copy_to", &copy_to, nb::arg("name"), nb::arg("out"))
      .def("__repr__", &weights_repr);

  m.def(
      "synthetic_weights",
      [](const LayerConfig& config, uint64_t seed, bool with_bias) {
        return new WeightsHolder(synthetic_weights(config, seed, with_bias));
      },
      nb::arg("config"), nb::arg("seed"), nb::arg("with_bias") = false,
      nb::rv_policy::take_ownership,
      "Deterministic synthetic MXFP4 weights for this rank of `config` (host memory).");
}

}  // namespace megamoe::python
