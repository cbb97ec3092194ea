// python/src/bind_reference.cpp: the CPU implementation of the contract (reference/), the FP64
// ideal MoE and the diff metric, on host arrays. A second path to the same function as a
// MoELayer on the "cpu" backend, so tests can compare the two, and a way to compare GPU results
// stage by stage (the trace).
#include <nanobind/stl/string.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "bindings.hpp"
#include "megamoe/reference.hpp"

namespace megamoe::python {

namespace {

struct RoutingViews {
  TensorView idx, weights;
  int64_t num_tokens = 0;
};

// Checks topk_idx int32 [T, K] and (when given) topk_weights fp32 [T, K] on the host.
RoutingViews routing_views(const LayerConfig& c, int64_t num_tokens, const InArray& topk_idx,
                           const InArray* topk_weights) {
  RoutingViews r;
  r.num_tokens = num_tokens;
  r.idx = view_of("topk_idx", topk_idx);
  expect_dtype("topk_idx", r.idx, {DType::kI32});
  check_tensor("topk_idx", r.idx, DType::kI32, {num_tokens, c.shape.top_k}, Device::cpu());
  if (topk_weights != nullptr) {
    r.weights = view_of("topk_weights", *topk_weights);
    expect_dtype("topk_weights", r.weights, {DType::kF32});
    check_tensor("topk_weights", r.weights, DType::kF32, {num_tokens, c.shape.top_k},
                 Device::cpu());
  }
  return r;
}

// T from x [T, cols] after checking its dtype, rank and width.
int64_t tokens_of(const char* arg, const TensorView& v, DType dtype, int64_t cols) {
  expect_dtype(arg, v, {dtype});
  check_tensor(arg, v, dtype, {-1, cols}, Device::cpu());
  return v.shape[0];
}

const MoeWeights& host_weights(WeightsHolder& holder) {
  const MoeWeights& w = holder.get("weights");
  MEGAMOE_CHECK_ARG(w.device().type == DeviceType::kCPU, "weights: the reference runs on the "
                    "host, got weights on ", device_name(w.device()));
  return w;
}

// A numpy array that owns `values` (moved to the heap, freed with the array).
template <typename T>
nb::ndarray<nb::numpy, T> owned_array(std::vector<T>&& values, std::initializer_list<size_t> shape) {
  auto* heap = new std::vector<T>(std::move(values));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(heap->data(), shape, owner);
}

nb::dict trace_dict(ReferenceTrace&& t, const LayerConfig& c, int64_t num_tokens) {
  const size_t tokens = static_cast<size_t>(num_tokens);
  const size_t slots = tokens * static_cast<size_t>(c.shape.top_k);
  const size_t h = static_cast<size_t>(c.shape.hidden), i = static_cast<size_t>(c.shape.intermediate);
  const size_t block = static_cast<size_t>(kScaleBlock);
  nb::dict d;
  d["x_q"] = owned_array(std::move(t.x_q), {tokens, h});
  d["x_sf"] = owned_array(std::move(t.x_sf), {tokens, h / block});
  d["l1_acc"] = owned_array(std::move(t.l1_acc), {slots, 2 * i});
  d["h_q"] = owned_array(std::move(t.h_q), {slots, i});
  d["h_sf"] = owned_array(std::move(t.h_sf), {slots, i / block});
  d["o"] = owned_array(std::move(t.o), {slots, h});
  return d;
}

nb::object reference_forward(const LayerConfig& c, WeightsHolder& weights, const InArray& x,
                             const InArray& topk_idx, const InArray& topk_weights,
                             const OutArray& y, bool trace) {
  const MoeWeights& w = host_weights(weights);
  const TensorView xv = view_of("x", x);
  const int64_t t = tokens_of("x", xv, DType::kBF16, c.shape.hidden);
  const RoutingViews r = routing_views(c, t, topk_idx, &topk_weights);
  const TensorView yv = view_of("y", y);
  expect_dtype("y", yv, {DType::kBF16});
  check_tensor("y", yv, DType::kBF16, {t, c.shape.hidden}, Device::cpu());
  ReferenceTrace tr;
  without_gil([&] {
    megamoe::reference_forward(c, w, xv.ptr<const uint16_t>(), r.idx.ptr<const int32_t>(),
                               r.weights.ptr<const float>(), t, yv.ptr<uint16_t>(),
                               trace ? &tr : nullptr);
  });
  if (!trace) return nb::none();
  return trace_dict(std::move(tr), c, t);
}

void reference_forward_quantized(const LayerConfig& c, WeightsHolder& weights, const InArray& x_q,
                                 const InArray& x_sf, const InArray& topk_idx,
                                 const InArray& topk_weights, const OutArray& y) {
  const MoeWeights& w = host_weights(weights);
  const TensorView qv = view_of("x_q", x_q);
  const int64_t t = tokens_of("x_q", qv, DType::kU8, c.shape.hidden);
  const TensorView sv = view_of("x_sf", x_sf);
  expect_dtype("x_sf", sv, {DType::kU8});
  check_tensor("x_sf", sv, DType::kU8, {t, c.shape.hidden / kScaleBlock}, Device::cpu());
  const RoutingViews r = routing_views(c, t, topk_idx, &topk_weights);
  const TensorView yv = view_of("y", y);
  expect_dtype("y", yv, {DType::kBF16});
  check_tensor("y", yv, DType::kBF16, {t, c.shape.hidden}, Device::cpu());
  without_gil([&] {
    megamoe::reference_forward_quantized(c, w, qv.ptr<const uint8_t>(), sv.ptr<const uint8_t>(),
                                         r.idx.ptr<const int32_t>(), r.weights.ptr<const float>(), t,
                                         yv.ptr<uint16_t>());
  });
}

void reference_l2_combine(const LayerConfig& c, WeightsHolder& weights, const InArray& h_q,
                          const InArray& h_sf, const InArray& topk_idx, const OutArray& y) {
  const MoeWeights& w = host_weights(weights);
  const TensorView idx = view_of("topk_idx", topk_idx);
  expect_dtype("topk_idx", idx, {DType::kI32});
  check_tensor("topk_idx", idx, DType::kI32, {-1, c.shape.top_k}, Device::cpu());
  const int64_t t = idx.shape[0];
  const TensorView qv = view_of("h_q", h_q);
  const TensorView sv = view_of("h_sf", h_sf);
  expect_dtype("h_q", qv, {DType::kU8});
  expect_dtype("h_sf", sv, {DType::kU8});
  check_tensor("h_q", qv, DType::kU8, {t * c.shape.top_k, c.shape.intermediate}, Device::cpu());
  check_tensor("h_sf", sv, DType::kU8, {t * c.shape.top_k, c.shape.intermediate / kScaleBlock},
               Device::cpu());
  const TensorView yv = view_of("y", y);
  expect_dtype("y", yv, {DType::kBF16});
  check_tensor("y", yv, DType::kBF16, {t, c.shape.hidden}, Device::cpu());
  without_gil([&] {
    megamoe::reference_l2_combine(c, w, qv.ptr<const uint8_t>(), sv.ptr<const uint8_t>(),
                                  idx.ptr<const int32_t>(), t, yv.ptr<uint16_t>());
  });
}

void ideal_forward(const LayerConfig& c, WeightsHolder& weights, const InArray& x,
                   const InArray& topk_idx, const InArray& topk_weights, const OutArray& y) {
  const MoeWeights& w = host_weights(weights);
  const TensorView xv = view_of("x", x);
  const int64_t t = tokens_of("x", xv, DType::kBF16, c.shape.hidden);
  const RoutingViews r = routing_views(c, t, topk_idx, &topk_weights);
  const TensorView yv = view_of("y", y);
  expect_dtype("y", yv, {DType::kF64});
  check_tensor("y", yv, DType::kF64, {t, c.shape.hidden}, Device::cpu());
  without_gil([&] {
    megamoe::ideal_forward(c, w, xv.ptr<const uint16_t>(), r.idx.ptr<const int32_t>(),
                           r.weights.ptr<const float>(), t, yv.ptr<double>());
  });
}

double diff_metric(const InArray& a, const InArray& b) {
  const TensorView av = view_of("a", a);
  const TensorView bv = view_of("b", b);
  expect_dtype("a", av, {DType::kF64});
  expect_dtype("b", bv, {DType::kF64});
  expect_host_contiguous("a", av);
  expect_host_contiguous("b", bv);
  expect_same_shape("b", bv, "a", av);
  return megamoe::diff_metric(av.ptr<const double>(), bv.ptr<const double>(), av.numel());
}

nb::dict compare_output(const LayerConfig& c, const InArray& y, const InArray& ref,
                        const InArray& topk_idx) {
  const TensorView yv = view_of("y", y);
  const int64_t t = tokens_of("y", yv, DType::kBF16, c.shape.hidden);
  const TensorView rv = view_of("ref", ref);
  expect_dtype("ref", rv, {DType::kF64});
  check_tensor("ref", rv, DType::kF64, {t, c.shape.hidden}, Device::cpu());
  const RoutingViews r = routing_views(c, t, topk_idx, nullptr);
  DiffReport rep;
  without_gil([&] {
    rep = megamoe::compare_output(c, yv.ptr<const uint16_t>(), rv.ptr<const double>(),
                                  r.idx.ptr<const int32_t>(), t);
  });
  nb::dict d;
  d["diff"] = rep.diff;
  d["worst_row_diff"] = rep.worst_row_diff;
  d["worst_row"] = rep.worst_row;
  d["worst_expert_diff"] = rep.worst_expert_diff;
  d["worst_expert"] = rep.worst_expert;
  d["max_abs_err"] = rep.max_abs_err;
  return d;
}

}  // namespace

void register_reference(nb::module_& m) {
  m.def("reference_forward", &reference_forward, nb::arg("config"), nb::arg("weights"),
        nb::arg("x"), nb::arg("topk_idx"), nb::arg("topk_weights"), nb::arg("y"),
        nb::arg("trace") = false);
  m.def("reference_forward_quantized", &reference_forward_quantized, nb::arg("config"),
        nb::arg("weights"), nb::arg("x_q"), nb::arg("x_sf"), nb::arg("topk_idx"),
        nb::arg("topk_weights"), nb::arg("y"));
  m.def("reference_l2_combine", &reference_l2_combine, nb::arg("config"), nb::arg("weights"),
        nb::arg("h_q"), nb::arg("h_sf"), nb::arg("topk_idx"), nb::arg("y"));
  m.def("ideal_forward", &ideal_forward, nb::arg("config"), nb::arg("weights"), nb::arg("x"),
        nb::arg("topk_idx"), nb::arg("topk_weights"), nb::arg("y"));
  m.def("diff_metric", &diff_metric, nb::arg("a"), nb::arg("b"));
  m.def("compare_output", &compare_output, nb::arg("config"), nb::arg("y"), nb::arg("ref"),
        nb::arg("topk_idx"));
}

}  // namespace megamoe::python
