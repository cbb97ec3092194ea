// python/src/module.cpp: the extension module megamoe._megamoe.
//
// Layering (FlashInfer-style): megamoe C++ API <- these thin bindings (arrays in, checks, GIL
// released around the work) <- python/megamoe/*.py (output allocation in the caller's framework,
// CUDA stream lookup, docstrings with shapes and dtypes). Nothing here imports torch.
#include <nanobind/stl/string.h>

#include "bindings.hpp"
#include "megamoe/buffer.hpp"

namespace megamoe::python {

namespace {

nb::dict memory_stats_dict() {
  const MemoryStats s = memory_stats();
  nb::dict d;
  d["host_bytes"] = s.host_bytes;
  d["host_peak_bytes"] = s.host_peak_bytes;
  d["device_bytes"] = s.device_bytes;
  d["device_peak_bytes"] = s.device_peak_bytes;
  d["allocations"] = s.allocations;
  return d;
}

}  // namespace

void register_runtime(nb::module_& m) {
  m.def("memory_stats", &memory_stats_dict,
        "Bytes megamoe holds now and at peak (host and device) through its Buffer allocator, "
        "and the number of allocations since start.");
  m.def("reset_memory_peak", &reset_memory_peak, "Reset the peaks to the bytes held now.");
#if defined(MEGAMOE_WITH_CUDA)
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
}

}  // namespace megamoe::python

NB_MODULE(_megamoe, m) {
  namespace py = megamoe::python;
  m.doc() = "megamoe native extension (thin bindings; the API is the megamoe package)";
#if defined(MEGAMOE_PY_CRASH_TRACE)
  py::install_crash_trace();  // acts only with MEGAMOE_CRASH_TRACE=1
#endif
  py::register_errors(m);
  py::register_runtime(m);
  py::register_formats(m);
  py::register_config(m);
  py::register_weights(m);
  py::register_ep(m);
  py::register_layer(m);
  py::register_reference(m);
  py::register_routing(m);
  py::register_checkpoint(m);
}
