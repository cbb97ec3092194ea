// python/src/bind_ep.cpp: expert parallelism (megamoe/ep.hpp): EpOptions, EpGroup and the
// functions that make groups.
//
// Groups cross as std::shared_ptr<EpGroup>: each MoeLayer built on a group holds a reference of
// its own, so a group lives as long as the last layer or Python object that uses it. Making a
// group runs with the GIL released: an NCCL group is collective and waits for every rank, which
// may be a thread of this process.
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "bindings.hpp"
#include "megamoe/ep.hpp"

namespace megamoe::python {

namespace {

EpOptions make_options(double timeout_s, int64_t max_recv_rows) {
  EpOptions o;
  o.timeout_s = timeout_s;
  o.max_recv_rows = max_recv_rows;
  return o;
}

nb::str options_repr(const EpOptions& o) {
  return nb::str("EpOptions(timeout_s={!r}, max_recv_rows={!r})")
      .format(o.timeout_s, o.max_recv_rows);
}

std::vector<std::shared_ptr<EpGroup>> virtual_group(int size, const LayerConfig& config,
                                                    double timeout_s, int64_t max_recv_rows) {
  std::vector<std::shared_ptr<EpGroup>> ranks;
  const EpOptions options = make_options(timeout_s, max_recv_rows);
  without_gil([&] { ranks = EpGroup::create_virtual(size, config, options); });
  return ranks;
}

std::shared_ptr<EpGroup> nccl_group(const nb::bytes& unique_id, int size, int rank,
                                    const LayerConfig& config, double timeout_s,
                                    int64_t max_recv_rows) {
  // Checked first, before anything that needs NCCL, so a wrong id is reported as what it is in
  // every build.
  NcclUniqueId id{};
  MEGAMOE_CHECK_ARG(unique_id.size() == id.size(), "unique_id: expected ", id.size(),
                    " bytes (what nccl_unique_id() returns), got ", unique_id.size());
  const auto* bytes = reinterpret_cast<const uint8_t*>(unique_id.data());
  std::copy(bytes, bytes + id.size(), id.begin());
  const EpOptions options = make_options(timeout_s, max_recv_rows);
  std::shared_ptr<EpGroup> group;
  without_gil([&] { group = EpGroup::create_nccl(id, size, rank, config, options); });
  return group;
}

nb::bytes unique_id_bytes() {
  NcclUniqueId id{};
  without_gil([&] { id = nccl_unique_id(); });
  return nb::bytes(reinterpret_cast<const char*>(id.data()), id.size());
}

std::string group_repr(const EpGroup& g) {
  return detail::concat("EpGroup(transport='", g.transport(), "', rank=", g.rank(), ", size=",
                        g.size(), ", device=", g.device(), ", window_bytes=", g.window_bytes(),
                        ", max_recv_rows=", g.max_recv_rows(), g.broken() ? ", broken" : "", ")");
}

}  // namespace

void register_ep(nb::module_& m) {
  nb::class_<EpOptions>(m, "EpOptions", "Options of an EP group (megamoe/ep.hpp).")
      .def(
          "__init__",
          [](EpOptions* self, double timeout_s, int64_t max_recv_rows) {
            new (self) EpOptions(make_options(timeout_s, max_recv_rows));
          },
          nb::arg("timeout_s") = EpOptions{}.timeout_s,
          nb::arg("max_recv_rows") = EpOptions{}.max_recv_rows,
          "timeout_s: every wait on another rank gives up after this long and reports "
          "TimeoutError instead of hanging. max_recv_rows: rows (token, expert slot) one rank may "
          "receive per call; 0 = the worst case, which never overflows. Checked when a group is "
          "made.")
      .def_rw("timeout_s", &EpOptions::timeout_s)
      .def_rw("max_recv_rows", &EpOptions::max_recv_rows)
      .def("__repr__", &options_repr);

  nb::class_<EpGroup>(m, "EpGroup",
                      "One rank's handle of an expert-parallel group; make one with "
                      "megamoe.ep.virtual_group() or megamoe.ep.nccl_group().")
      .def_prop_ro("rank", &EpGroup::rank)
      .def_prop_ro("size", &EpGroup::size)
      .def_prop_ro("transport", &EpGroup::transport, "'virtual' or 'nccl'.")
      .def_prop_ro("device", &EpGroup::device, "The CUDA device index of this rank.")
      .def_prop_ro("window_bytes", &EpGroup::window_bytes,
                   "Bytes of this rank's symmetric window.")
      .def_prop_ro("max_recv_rows", &EpGroup::max_recv_rows,
                   "Receive-row capacity of a layer on this group.")
      .def_prop_ro("broken", &EpGroup::broken,
                   "True once a timeout has made the group unusable (every later call raises "
                   "TimeoutError; make a new group).")
      .def_prop_ro("options", &EpGroup::options, nb::rv_policy::copy)
      .def("__repr__", &group_repr);

  m.def("ep_virtual_group", &virtual_group, nb::arg("size"), nb::arg("config"),
        nb::arg("timeout_s") = EpOptions{}.timeout_s,
        nb::arg("max_recv_rows") = EpOptions{}.max_recv_rows,
        "`size` virtual ranks on the current CUDA device: element r is rank r's EpGroup. "
        "UnsupportedError without CUDA or a GPU.");
  m.def("ep_nccl_group", &nccl_group, nb::arg("unique_id"), nb::arg("size"), nb::arg("rank"),
        nb::arg("config"), nb::arg("timeout_s") = EpOptions{}.timeout_s,
        nb::arg("max_recv_rows") = EpOptions{}.max_recv_rows,
        "This process's rank of an NCCL group on the current CUDA device; collective over the "
        "`size` ranks, which pass the same 128-byte unique_id.");
  m.def("nccl_unique_id", &unique_id_bytes,
        "A fresh NCCL unique id (128 bytes) for ep_nccl_group; made by one rank and handed to the "
        "others. UnsupportedError in a build without NCCL.");
  m.def("nccl_available", &nccl_available, "Whether this build can make NCCL groups.");
  m.def("nccl_version", &nccl_version, "The loaded libnccl's version code (0 when none loads).");
}

}  // namespace megamoe::python
