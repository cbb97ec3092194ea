// python/src/bind_routing.cpp: synthetic workloads (routing generators, activations) and the
// Kimi-K3 style sigmoid top-k router (numerics.md section 7), on the host.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings.hpp"
#include "megamoe/routing.hpp"

namespace megamoe::python {

namespace {

template <typename T>
nb::ndarray<nb::numpy, T> owned_array(std::vector<T>&& values, std::initializer_list<size_t> shape) {
  auto* heap = new std::vector<T>(std::move(values));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(heap->data(), shape, owner);
}

nb::tuple make_routing(const std::string& kind, int64_t num_tokens, int64_t num_experts,
                       int64_t top_k, uint64_t seed) {
  const RoutingKind k = parse_routing_kind(kind);
  Routing r;
  without_gil([&] {
    r = megamoe::make_routing(k, num_tokens, num_experts, top_k, seed);
  });
  const size_t t = static_cast<size_t>(r.num_tokens), kk = static_cast<size_t>(r.top_k);
  return nb::make_tuple(owned_array(std::move(r.topk_idx), {t, kk}),
                        owned_array(std::move(r.topk_weights), {t, kk}));
}

nb::ndarray<nb::numpy, uint16_t> synthetic_activations(int64_t num_tokens, int64_t hidden,
                                                       uint64_t seed) {
  MEGAMOE_CHECK_ARG(num_tokens >= 0, "num_tokens: expected >= 0, got ", num_tokens);
  MEGAMOE_CHECK_ARG(hidden > 0, "hidden: expected > 0, got ", hidden);
  std::vector<uint16_t> x;
  without_gil([&] {
    x = megamoe::synthetic_activations(num_tokens, hidden, seed);
  });
  return owned_array(std::move(x), {static_cast<size_t>(num_tokens), static_cast<size_t>(hidden)});
}

void route_sigmoid_topk(const InArray& logits, std::optional<InArray> correction_bias,
                        float routed_scaling_factor, const OutArray& topk_idx,
                        const OutArray& topk_weights) {
  const TensorView lv = view_of("logits", logits);
  expect_dtype("logits", lv, {DType::kF32});
  check_tensor("logits", lv, DType::kF32, {-1, -1}, Device::cpu());
  const int64_t num_tokens = lv.shape[0], num_experts = lv.shape[1];
  const float* bias = nullptr;
  if (correction_bias) {
    const TensorView bv = view_of("correction_bias", *correction_bias);
    expect_dtype("correction_bias", bv, {DType::kF32});
    check_tensor("correction_bias", bv, DType::kF32, {num_experts}, Device::cpu());
    bias = bv.ptr<const float>();
  }
  const TensorView iv = view_of("topk_idx", topk_idx);
  const TensorView wv = view_of("topk_weights", topk_weights);
  expect_dtype("topk_idx", iv, {DType::kI32});
  expect_dtype("topk_weights", wv, {DType::kF32});
  check_tensor("topk_idx", iv, DType::kI32, {num_tokens, -1}, Device::cpu());
  const int64_t top_k = iv.shape[1];
  check_tensor("topk_weights", wv, DType::kF32, {num_tokens, top_k}, Device::cpu());
  without_gil([&] {
    megamoe::route_sigmoid_topk(lv.ptr<const float>(), bias, num_tokens, num_experts, top_k,
                                routed_scaling_factor, iv.ptr<int32_t>(), wv.ptr<float>());
  });
}

}  // namespace

void register_routing(nb::module_& m) {
  m.def("make_routing", &make_routing, nb::arg("kind"), nb::arg("num_tokens"),
        nb::arg("num_experts"), nb::arg("top_k"), nb::arg("seed"));
  m.def("synthetic_activations", &synthetic_activations, nb::arg("num_tokens"), nb::arg("hidden"),
        nb::arg("seed"));
  m.def("route_sigmoid_topk", &route_sigmoid_topk, nb::arg("logits"),
        nb::arg("correction_bias").none(), nb::arg("routed_scaling_factor"), nb::arg("topk_idx"),
        nb::arg("topk_weights"));
}

}  // namespace megamoe::python
