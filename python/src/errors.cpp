// python/src/errors.cpp: megamoe::Error -> Python exceptions.
//
// Every exception megamoe raises is a megamoe.Error, and also the builtin exception a Python
// caller would expect for that kind of problem, so `except ValueError` works as well as
// `except megamoe.Error`:
//
//   ErrorCode         Python class                 also a
//   kInvalidArgument  megamoe.InvalidArgumentError ValueError
//   (dtype checks)    megamoe.DTypeError           TypeError
//   kOutOfRange       megamoe.OutOfRangeError      ValueError  (a bad expert id or token count is
//                                                               a bad value, not a subscript)
//   kFormat           megamoe.FormatError          ValueError
//   kIo               megamoe.IoError              OSError
//   kUnsupported      megamoe.UnsupportedError     RuntimeError (valid request, this build/machine
//                                                               cannot serve it: no CUDA, no GPU)
//   kCuda             megamoe.CudaError            RuntimeError
//   kTimeout          megamoe.TimeoutError         TimeoutError (a rank of an EP group did not
//                                                               arrive in time)
//   kInternal         megamoe.InternalError        RuntimeError
//
// Each class has a `code` attribute ("invalid_argument", ...).
#include <cstring>
#include <stdexcept>
#include <string>

#include "bindings.hpp"

namespace megamoe::python {

namespace {

constexpr int kNumErrorCodes = static_cast<int>(ErrorCode::kInternal) + 1;

struct ErrorTypes {
  PyObject* by_code[kNumErrorCodes] = {};
  PyObject* dtype = nullptr;
};

ErrorTypes& error_types() {
  static ErrorTypes types;
  return types;
}

// A new exception class megamoe.<name>(bases...) with a class attribute `code`, stored in `m`.
PyObject* new_exception(nb::module_& m, const char* name, const char* code, const char* doc,
                        nb::tuple bases) {
  const std::string qualified = std::string("megamoe.") + name;
  nb::dict attrs;
  attrs["code"] = code;
  PyObject* type =
      PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases.ptr(), attrs.ptr());
  if (type == nullptr) throw nb::python_error();
  m.attr(name) = nb::handle(type);  // the module holds one reference, this static table another
  return type;
}

// NOTES: library code reports dtype problems through check_tensor() as kInvalidArgument with the
// message "<arg>: expected dtype X, got Y"; those become DTypeError too, so every dtype problem
// is a TypeError whichever layer found it.
bool is_dtype_message(const char* what) { return std::strstr(what, ": expected dtype ") != nullptr; }

void translate(const std::exception_ptr& p, void*) {
  ErrorTypes& types = error_types();
  try {
    std::rethrow_exception(p);
  } catch (const DTypeMismatch& e) {
    PyErr_SetString(types.dtype, e.what());
  } catch (const Error& e) {
    PyObject* type = types.by_code[static_cast<int>(e.code())];
    if (e.code() == ErrorCode::kInvalidArgument && is_dtype_message(e.what())) type = types.dtype;
    PyErr_SetString(type, e.what());
  }
}

}  // namespace

void register_errors(nb::module_& m) {
  ErrorTypes& types = error_types();
  PyObject* base = new_exception(m, "Error", "error",
                                 "Base class of every error megamoe raises; `code` names its kind.",
                                 nb::make_tuple(nb::handle(PyExc_Exception)));
  const nb::handle b(base);
  auto code_slot = [&](ErrorCode code) -> PyObject*& {
    return types.by_code[static_cast<int>(code)];
  };
  code_slot(ErrorCode::kInvalidArgument) = new_exception(
      m, "InvalidArgumentError", "invalid_argument",
      "A bad shape, device, value, option or combination (also a ValueError).",
      nb::make_tuple(b, nb::handle(PyExc_ValueError)));
  types.dtype = new_exception(m, "DTypeError", "invalid_argument",
                              "An array of the wrong dtype (also a TypeError).",
                              nb::make_tuple(b, nb::handle(PyExc_TypeError)));
  code_slot(ErrorCode::kOutOfRange) = new_exception(
      m, "OutOfRangeError", "out_of_range",
      "An index or count outside its range: expert id >= E, tokens above capacity (also a "
      "ValueError).",
      nb::make_tuple(b, nb::handle(PyExc_ValueError)));
  code_slot(ErrorCode::kFormat) = new_exception(
      m, "FormatError", "format", "Malformed file or data (also a ValueError).",
      nb::make_tuple(b, nb::handle(PyExc_ValueError)));
  code_slot(ErrorCode::kIo) = new_exception(m, "IoError", "io",
                                            "Open/read/write/mmap failure (also an OSError).",
                                            nb::make_tuple(b, nb::handle(PyExc_OSError)));
  code_slot(ErrorCode::kUnsupported) = new_exception(
      m, "UnsupportedError", "unsupported",
      "A valid request this build or machine cannot serve, e.g. a GPU backend without CUDA or "
      "without a GPU (also a RuntimeError).",
      nb::make_tuple(b, nb::handle(PyExc_RuntimeError)));
  code_slot(ErrorCode::kCuda) = new_exception(m, "CudaError", "cuda",
                                              "A CUDA runtime call failed (also a RuntimeError).",
                                              nb::make_tuple(b, nb::handle(PyExc_RuntimeError)));
  code_slot(ErrorCode::kTimeout) = new_exception(
      m, "TimeoutError", "timeout",
      "Another rank of an expert-parallel group did not arrive within the group's timeout_s; "
      "the group is unusable afterwards (also the builtin TimeoutError).",
      nb::make_tuple(b, nb::handle(PyExc_TimeoutError)));
  code_slot(ErrorCode::kInternal) = new_exception(
      m, "InternalError", "internal", "A broken invariant inside megamoe (also a RuntimeError).",
      nb::make_tuple(b, nb::handle(PyExc_RuntimeError)));
  // A code added to ErrorCode without a class here would reach PyErr_SetString with a null type;
  // fail at import instead.
  for (int code = 0; code < kNumErrorCodes; ++code) {
    if (types.by_code[code] == nullptr) {
      throw std::runtime_error("megamoe: no Python exception class for ErrorCode " +
                               std::to_string(code));
    }
  }
  nb::register_exception_translator(translate);
}

}  // namespace megamoe::python
