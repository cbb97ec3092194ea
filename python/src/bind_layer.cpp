// python/src/bind_layer.cpp: MoeLayer, the one entry point of a layer call.
//
//   x            bf16  [T, H]   (uint16 arrays carry raw BF16 bits)
//   topk_idx     int32 [T, K]   global expert ids in [0, E) or -1
//   topk_weights fp32  [T, K]
//   y            bf16  [T, H]   written in full
// All on the layer's device and contiguous. `stream` is a cudaStream_t as an integer (0 = the
// legacy default stream); the Python layer passes torch's current stream.
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>

#include "bindings.hpp"
#include "ep/ep_group.hpp"
#include "megamoe/ep.hpp"
#include "megamoe/layer.hpp"
#include "megamoe/prepare.hpp"
#include "runtime/cuda_device.hpp"

namespace megamoe::python {

namespace {

constexpr const char* kAutoBackend = "auto";
#if defined(MEGAMOE_WITH_CUDA)
constexpr bool kBuiltWithCuda = true;
#else
constexpr bool kBuiltWithCuda = false;
#endif

// NOTES: the layer takes the weights by move. Everything that can be checked before the move is
// checked here, so a wrong config, backend name or EP group leaves the caller's weights intact.
void init_layer(MoeLayer* self, const LayerConfig& config, WeightsHolder& weights,
                const std::string& backend, std::shared_ptr<EpGroup> group) {
  config.validate();
  const MoeWeights& w = weights.get("weights");
  w.check_matches(config);
  if (backend != kAutoBackend) {
    const std::vector<std::string> names = available_backends();
    if (std::find(names.begin(), names.end(), backend) == names.end()) {
      std::string list;
      for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
      // An unknown name is the caller's mistake; a known one missing here is this machine's.
      const bool known = backend == "cpu" || backend == "sm90";
      fail(known ? ErrorCode::kUnsupported : ErrorCode::kInvalidArgument, "backend: '", backend,
           "' is ", known ? "not available in this build or on this machine" : "unknown",
           " (available here: auto, ", list, "; built with CUDA: ", kBuiltWithCuda ? "yes" : "no",
           ")");
    }
  }
  // A backend reads canonical weights (and prepares them) or weights already in its own layout.
  const std::string chosen = backend == kAutoBackend ? available_backends().front() : backend;
  const std::string own_layout = has_layout(chosen) ? chosen : std::string(kCanonicalLayout);
  MEGAMOE_CHECK_ARG(w.layout == kCanonicalLayout || w.layout == own_layout, "weights: layout '",
                    w.layout, "' cannot serve backend '", chosen, "' (it reads '",
                    kCanonicalLayout, "' or '", own_layout, "'); unprepare() them first");
  if (group == nullptr) {
    new (self) MoeLayer(config, weights.take("weights"), chosen);
    return;
  }
  // The checks the EP constructor makes after taking the weights (src/moe/layer.cpp,
  // make_sm90_backend), made before: the backend, the rank, the group's window and device.
  MEGAMOE_CHECK(chosen != "cpu", ErrorCode::kUnsupported, "group: the cpu backend has no "
                "expert-parallel communication; an EP group needs the sm90 backend");
  MEGAMOE_CHECK_ARG(config.ep_size == group->size() && config.ep_rank == group->rank(),
                    "group: the config's ep_size/ep_rank (", config.ep_size, "/", config.ep_rank,
                    ") must be the group's size/rank (", group->size(), "/", group->rank(), ")");
  group->impl().check_layer(config);
  MEGAMOE_CHECK_ARG(group->device() == cuda::current_device(), "group: the EP group lives on "
                    "device ", group->device(), ", the current device is ",
                    cuda::current_device(), " (build the layer under torch.cuda.device(",
                    group->device(), "))");
  MEGAMOE_CHECK(!group->broken(), ErrorCode::kTimeout, "group: EP rank ", group->rank(), " of ",
                group->size(), " timed out in an earlier call and is unusable; make a new group");
  new (self) MoeLayer(config, weights.take("weights"), std::move(group), chosen);
}

void forward(MoeLayer& layer, const InArray& x, const InArray& topk_idx,
             const InArray& topk_weights, const OutArray& y, uintptr_t stream) {
  const TensorView xv = view_of("x", x);
  const TensorView iv = view_of("topk_idx", topk_idx);
  const TensorView wv = view_of("topk_weights", topk_weights);
  const TensorView yv = view_of("y", y);
  expect_dtype("x", xv, {DType::kBF16});
  expect_dtype("topk_idx", iv, {DType::kI32});
  expect_dtype("topk_weights", wv, {DType::kF32});
  expect_dtype("y", yv, {DType::kBF16});
  // Shapes, devices, strides and the capacity are checked by MoeLayer::forward (src/moe/layer.cpp).

  without_gil([&] {
    layer.forward(xv, iv, wv, yv, reinterpret_cast<void*>(stream));
  });
}

}  // namespace

void register_layer(nb::module_& m) {
  nb::class_<MoeLayer>(m, "MoeLayer",
                       "Raw binding of megamoe::MoeLayer; use megamoe.MoELayer, which allocates "
                       "outputs and finds the CUDA stream.")
      .def("__init__", &init_layer, nb::arg("config"), nb::arg("weights"),
           nb::arg("backend") = kAutoBackend, nb::arg("group").none() = nb::none())
      .def("forward", &forward, nb::arg("x"), nb::arg("topk_idx"), nb::arg("topk_weights"),
           nb::arg("y"), nb::arg("stream") = 0)
      .def(
          "check_errors",
          [](MoeLayer& layer, uintptr_t stream) {
            without_gil([&] { layer.check_errors(reinterpret_cast<void*>(stream)); });
          },
          nb::arg("stream") = 0)
      .def(
          "expert_rows",
          [](MoeLayer& layer, uintptr_t stream) {
            std::vector<int64_t> rows;
            without_gil([&] { rows = layer.expert_rows(reinterpret_cast<void*>(stream)); });
            return rows;
          },
          nb::arg("stream") = 0)
      .def_prop_ro("config", &MoeLayer::config, nb::rv_policy::copy)
      .def_prop_ro("backend", &MoeLayer::backend)
      .def_prop_ro("last_call_kernels", &MoeLayer::last_call_kernels)
      .def_prop_ro("device", [](const MoeLayer& l) { return device_name(l.device()); })
      .def_prop_ro("weights_layout", [](const MoeLayer& l) { return l.weights().layout; })
      .def_prop_ro("weights_bytes", [](const MoeLayer& l) { return l.weights().total_bytes(); });

  m.def("available_backends", &available_backends,
        "Backends usable in this process, best first ('cpu' is always last).");
}

}  // namespace megamoe::python
