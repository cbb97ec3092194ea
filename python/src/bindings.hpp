// python/src/bindings.hpp: what the binding files of megamoe._megamoe share.
//
// The bindings are thin: each function turns its array arguments into megamoe::TensorView (zero
// copy, through DLPack), checks them with errors that name the argument, releases the GIL and
// calls the C++ API. Outputs are allocated by the Python layer (python/megamoe/) in the caller's
// framework (numpy or torch) and passed in, so this file never has to know about torch.
//
// Exceptions: megamoe::Error crosses as a subclass of megamoe.Error chosen by its code
// (errors.cpp has the table); binding checks on an argument's dtype throw DTypeMismatch, which
// crosses as megamoe.DTypeError (a TypeError).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <exception>
#include <initializer_list>
#include <string>

#include <optional>

#include "megamoe/error.hpp"
#include "megamoe/tensor.hpp"
#include "megamoe/weights.hpp"

namespace megamoe::python {

namespace nb = nanobind;

// An input array: any framework that speaks DLPack or the buffer protocol, any dtype, device and
// shape; read-only arrays are accepted. Every check is ours, so errors name the argument.
using InArray = nb::ndarray<nb::ro>;
// An output array: must be writable.
using OutArray = nb::ndarray<>;

// A dtype error found by a binding check (becomes megamoe.DTypeError, a TypeError).
class DTypeMismatch : public Error {
 public:
  explicit DTypeMismatch(const std::string& message)
      : Error(ErrorCode::kInvalidArgument, message) {}
};

// The TensorView of `array`. DLPack dtypes map as uint8, int32, float32, float64, bfloat16 and
// uint16 (raw BF16 bits: numpy has no bfloat16) -> DType; anything else is a DTypeMismatch
// naming `arg`. More than TensorView::kMaxDims dims is kInvalidArgument.
TensorView view_of(const char* arg, const InArray& array);
TensorView view_of(const char* arg, const OutArray& array);

// Throws DTypeMismatch naming `arg` unless view.dtype is one of `allowed`.
void expect_dtype(const char* arg, const TensorView& view, std::initializer_list<DType> allowed);

// Throws kInvalidArgument naming `arg` unless the view is contiguous and lives on the host.
void expect_host_contiguous(const char* arg, const TensorView& view);

// Throws kInvalidArgument naming `arg` unless both views have the same shape.
void expect_same_shape(const char* arg, const TensorView& view, const char* other_arg,
                       const TensorView& other);

// Shape as "[2, 3]" for messages.
std::string shape_string(const TensorView& view);

// The Python-side owner of one MoeWeights. A MoELayer takes the weights by move (it prepares them
// in place: no second copy of a layer may exist, weights.md section 3), after which this holder
// is empty and every use names that.
class WeightsHolder {
 public:
  explicit WeightsHolder(MoeWeights weights) : weights_(std::move(weights)) {}
  bool consumed() const { return !weights_.has_value(); }
  MoeWeights& get(const char* arg) {
    MEGAMOE_CHECK_ARG(weights_.has_value(), arg,
                      ": these weights were moved into a MoELayer (which prepared them in "
                      "place); load or build new ones");
    return *weights_;
  }
  MoeWeights take(const char* arg) {
    MoeWeights out = std::move(get(arg));
    weights_.reset();
    return out;
  }

 private:
  std::optional<MoeWeights> weights_;
};

// Registration of each binding file (module.cpp calls them in this order).
#if defined(MEGAMOE_PY_CRASH_TRACE)
// Debug builds (-DMEGAMOE_PY_CRASH_TRACE=ON) only; MEGAMOE_CRASH_TRACE=1 at import: native
// backtrace on SIGSEGV/SIGBUS/SIGILL/SIGABRT (crash_trace.cpp).
void install_crash_trace();
#endif
void register_errors(nb::module_& m);
void register_formats(nb::module_& m);
void register_config(nb::module_& m);
void register_weights(nb::module_& m);
void register_ep(nb::module_& m);
void register_layer(nb::module_& m);
void register_reference(nb::module_& m);
void register_routing(nb::module_& m);
void register_checkpoint(nb::module_& m);
void register_runtime(nb::module_& m);

// Runs `work` with the GIL released. An exception thrown there is carried out of the released
// region and rethrown once the GIL is held again, so megamoe::Error is always translated into a
// Python exception by a thread that holds the GIL, whatever nanobind and CPython versions do
// with exceptions unwinding through a released region.
// NOTES: added after a segfault on the H200 image (Python 3.12, its nanobind) on the first C++
// error raised inside MoELayer.forward with the GIL released; not reproduced here (Python 3.12.1,
// nanobind 3.1.0), so whether this was the cause is unverified.
template <typename Work>
void without_gil(Work&& work) {
  std::exception_ptr error;
  {
    nb::gil_scoped_release release;
    try {
      work();
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace megamoe::python
