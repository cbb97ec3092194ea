// safetensors reading (memory-mapped, validated) and writing.
//
// File layout: u64 little-endian N | N bytes of UTF-8 JSON | data region.
// The JSON is an object: name -> {"dtype", "shape", "data_offsets": [begin, end)} with offsets
// relative to the data region, plus an optional "__metadata__": {string: string}.
//
// NOTES: nothing in a header is trusted before it is checked. The header length is bounded
// (kMaxSafetensorsHeaderBytes) and checked against the file size before anything is parsed; the
// header bytes are checked to be UTF-8 before JSON parsing so a bad name gets its own message;
// duplicate keys are detected during parsing (nlohmann keeps the last one silently); nesting
// deeper than a header can have is refused during parsing, so no input can build a deep tree.
#include "checkpoint/safetensors_detail.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "megamoe/error.hpp"

namespace megamoe {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// dtypes
// ---------------------------------------------------------------------------------------------
namespace {

struct DTypeEntry {
  StDType dtype;
  const char* name;
  int bits;
};

constexpr DTypeEntry kDTypes[] = {
    {StDType::kBool, "BOOL", 8},        {StDType::kU8, "U8", 8},
    {StDType::kI8, "I8", 8},            {StDType::kF8E5M2, "F8_E5M2", 8},
    {StDType::kF8E4M3, "F8_E4M3", 8},   {StDType::kF8E8M0, "F8_E8M0", 8},
    {StDType::kI16, "I16", 16},         {StDType::kU16, "U16", 16},
    {StDType::kF16, "F16", 16},         {StDType::kBF16, "BF16", 16},
    {StDType::kI32, "I32", 32},         {StDType::kU32, "U32", 32},
    {StDType::kF32, "F32", 32},         {StDType::kI64, "I64", 64},
    {StDType::kU64, "U64", 64},         {StDType::kF64, "F64", 64},
    {StDType::kC64, "C64", 64},         {StDType::kF4, "F4", 4},
    {StDType::kF6E2M3, "F6_E2M3", 6},   {StDType::kF6E3M2, "F6_E3M2", 6},
};

const DTypeEntry& dtype_entry(StDType dtype) {
  for (const auto& e : kDTypes)
    if (e.dtype == dtype) return e;
  fail(ErrorCode::kInternal, "st_dtype: unknown enum value ", static_cast<int>(dtype));
}

constexpr int kBitsPerByte = 8;

}  // namespace

const char* st_dtype_name(StDType dtype) { return dtype_entry(dtype).name; }
int st_dtype_bits(StDType dtype) { return dtype_entry(dtype).bits; }

bool st_dtype_parse(std::string_view name, StDType* out) {
  for (const auto& e : kDTypes) {
    if (name == e.name) {
      *out = e.dtype;
      return true;
    }
  }
  return false;
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorInfo::describe() const {
  return detail::concat(st_dtype_name(dtype), detail::shape_string(shape));
}

// ---------------------------------------------------------------------------------------------
// Helpers shared with the checkpoint code (safetensors_detail.hpp)
// ---------------------------------------------------------------------------------------------
namespace detail {

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::string quote_name(std::string_view name) {
  constexpr size_t kMaxShown = 200;
  std::string out = "'";
  for (size_t i = 0; i < name.size() && i < kMaxShown; ++i) {
    const auto c = static_cast<unsigned char>(name[i]);
    if (c < 0x20 || c == 0x7F || c == '\'' || c == '\\') {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02X", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (name.size() > kMaxShown) out += "...";
  return out + "'";
}

// Length of the valid UTF-8 sequence starting at s[i], or 0 when it is invalid (overlong forms,
// surrogates and code points above U+10FFFF are invalid).
static int utf8_sequence_length(const uint8_t* s, int64_t n, int64_t i) {
  const uint8_t c = s[i];
  if (c < 0x80) return 1;
  int len;
  uint32_t cp;
  if ((c & 0xE0) == 0xC0) { len = 2; cp = c & 0x1F; }
  else if ((c & 0xF0) == 0xE0) { len = 3; cp = c & 0x0F; }
  else if ((c & 0xF8) == 0xF0) { len = 4; cp = c & 0x07; }
  else return 0;
  if (i + len > n) return 0;
  for (int k = 1; k < len; ++k) {
    if ((s[i + k] & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (s[i + k] & 0x3F);
  }
  constexpr uint32_t kMinForLength[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMinForLength[len]) return 0;             // overlong
  if (cp >= 0xD800 && cp <= 0xDFFF) return 0;        // surrogate
  if (cp > 0x10FFFF) return 0;
  return len;
}

int64_t find_invalid_utf8(const uint8_t* s, int64_t n) {
  for (int64_t i = 0; i < n;) {
    const int len = utf8_sequence_length(s, n, i);
    if (len == 0) return i;
    i += len;
  }
  return -1;
}

bool is_valid_utf8(std::string_view s) {
  return find_invalid_utf8(reinterpret_cast<const uint8_t*>(s.data()),
                           static_cast<int64_t>(s.size())) < 0;
}

json parse_json_strict(const std::string& label, const char* what, const char* begin,
                       const char* end, int max_depth) {
  // One set of keys per open object: a repeated key is an error (nlohmann would keep one).
  std::vector<std::set<std::string>> keys;
  auto callback = [&](int depth, json::parse_event_t event, json& parsed) -> bool {
    if (depth > max_depth) {
      fail(ErrorCode::kFormat, label, ": ", what, " nests deeper (", depth,
           " levels) than its format allows (", max_depth, ")");
    }
    switch (event) {
      case json::parse_event_t::object_start: keys.emplace_back(); break;
      case json::parse_event_t::object_end: keys.pop_back(); break;
      case json::parse_event_t::key: {
        std::string key = parsed.get<std::string>();
        if (!keys.back().insert(key).second) {
          fail(ErrorCode::kFormat, label, ": ", what, " has the key ", quote_name(key),
               " twice (duplicate tensor names are ambiguous)");
        }
        break;
      }
      default: break;
    }
    return true;
  };
  try {
    return json::parse(begin, end, callback, /*allow_exceptions=*/true, /*ignore_comments=*/false);
  } catch (const json::exception& e) {
    fail(ErrorCode::kFormat, label, ": ", what, " is not valid JSON (", e.what(), ")");
  }
}

std::string errno_string() { return std::strerror(errno); }

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// SafetensorsFile
// ---------------------------------------------------------------------------------------------
struct SafetensorsFile::Impl {
  std::string path;
  const uint8_t* bytes = nullptr;
  int64_t size = 0;
  void* mapping = nullptr;  // non-null when we own an mmap of `size` bytes
  int64_t data_offset = 0;
  std::vector<TensorInfo> tensors;
  std::map<std::string, size_t, std::less<>> index;
  std::map<std::string, std::string> metadata;

  ~Impl() {
    if (mapping != nullptr) munmap(mapping, static_cast<size_t>(size));
  }
  void validate();
};

namespace {

// The header depth of a safetensors file: root object (1), tensor entry (2), shape array (3).
constexpr int kMaxHeaderDepth = 3;

int64_t read_u64_le(const uint8_t* p, bool* fits_int64) {
  uint64_t v = 0;
  for (int i = kSafetensorsHeaderLengthBytes - 1; i >= 0; --i) v = (v << kBitsPerByte) | p[i];
  *fits_int64 = v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  return static_cast<int64_t>(v & static_cast<uint64_t>(std::numeric_limits<int64_t>::max()));
}

// A non-negative integer that fits int64, or fails naming `what`.
int64_t json_index(const json& v, const std::string& where, const char* what) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    MEGAMOE_CHECK(u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                  ErrorCode::kFormat, where, ": ", what, " = ", u, " does not fit int64");
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) {
    const auto i = v.get<int64_t>();
    MEGAMOE_CHECK(i >= 0, ErrorCode::kFormat, where, ": ", what, " = ", i, " is negative");
    return i;
  }
  fail(ErrorCode::kFormat, where, ": ", what, " must be a non-negative integer, got ",
       v.type_name(), " ", v.dump(-1, ' ', true, json::error_handler_t::replace));
}

}  // namespace

void SafetensorsFile::Impl::validate() {
  using detail::quote_name;
  const std::string& f = path;
  // -- header length ---------------------------------------------------------------------
  MEGAMOE_CHECK(size >= kSafetensorsHeaderLengthBytes, ErrorCode::kFormat, f,
                ": truncated file: ", size, " bytes, fewer than the ",
                kSafetensorsHeaderLengthBytes, "-byte header length");
  bool fits = false;
  const int64_t header_len = read_u64_le(bytes, &fits);
  MEGAMOE_CHECK(fits && header_len <= kMaxSafetensorsHeaderBytes, ErrorCode::kFormat, f,
                ": header length ", fits ? std::to_string(header_len) : std::string(">2^63"),
                " exceeds the limit of ", kMaxSafetensorsHeaderBytes, " bytes");
  MEGAMOE_CHECK(header_len <= size - kSafetensorsHeaderLengthBytes, ErrorCode::kFormat, f,
                ": truncated file: header length ", header_len, " is larger than the ",
                size - kSafetensorsHeaderLengthBytes, " bytes after the length field");
  MEGAMOE_CHECK(header_len > 0, ErrorCode::kFormat, f, ": header length is 0 (no JSON header)");
  data_offset = kSafetensorsHeaderLengthBytes + header_len;
  const int64_t data_size = size - data_offset;
  const auto* header = reinterpret_cast<const char*>(bytes + kSafetensorsHeaderLengthBytes);

  // -- UTF-8, then JSON ---------------------------------------------------------------------
  const int64_t bad = detail::find_invalid_utf8(bytes + kSafetensorsHeaderLengthBytes, header_len);
  if (bad >= 0) {
    // Show the JSON string around the bad byte (from the previous quote to the next one).
    int64_t lo = bad, hi = bad;
    while (lo > 0 && header[lo - 1] != '"') --lo;
    while (hi < header_len && header[hi] != '"') ++hi;
    std::string shown;
    for (int64_t i = lo; i < hi; ++i) {
      const auto c = static_cast<unsigned char>(header[i]);
      if (c >= 0x20 && c < 0x7F) {
        shown += static_cast<char>(c);
      } else {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\x%02X", c);
        shown += buf;
      }
    }
    fail(ErrorCode::kFormat, f, ": header is not valid UTF-8 at header byte ", bad,
         ", in the string \"", shown, "\" (tensor names and metadata must be UTF-8)");
  }
  const json root = detail::parse_json_strict(f, "header", header, header + header_len,
                                              kMaxHeaderDepth);
  MEGAMOE_CHECK(root.is_object(), ErrorCode::kFormat, f, ": header must be a JSON object, got ",
                root.type_name());

  // -- entries ------------------------------------------------------------------------------
  tensors.reserve(root.size());
  for (const auto& [name, entry] : root.items()) {
    if (name == kSafetensorsMetadataKey) {
      MEGAMOE_CHECK(entry.is_object(), ErrorCode::kFormat, f, ": '", kSafetensorsMetadataKey,
                    "' must be an object of strings, got ", entry.type_name());
      for (const auto& [key, value] : entry.items()) {
        MEGAMOE_CHECK(value.is_string(), ErrorCode::kFormat, f, ": '", kSafetensorsMetadataKey,
                      "' value of ", quote_name(key), " must be a string, got ",
                      value.type_name());
        metadata.emplace(key, value.get<std::string>());
      }
      continue;
    }
    const std::string where = detail::concat(f, ": tensor ", quote_name(name));
    MEGAMOE_CHECK(!name.empty(), ErrorCode::kFormat, f, ": a tensor has an empty name");
    MEGAMOE_CHECK(entry.is_object(), ErrorCode::kFormat, where,
                  ": entry must be an object {dtype, shape, data_offsets}, got ",
                  entry.type_name());
    for (const auto& [field, unused] : entry.items()) {
      MEGAMOE_CHECK(field == "dtype" || field == "shape" || field == "data_offsets",
                    ErrorCode::kFormat, where, ": unexpected field ", quote_name(field),
                    " (expected dtype, shape, data_offsets)");
    }
    for (const char* field : {"dtype", "shape", "data_offsets"}) {
      MEGAMOE_CHECK(entry.contains(field), ErrorCode::kFormat, where, ": missing field '", field,
                    "'");
    }
    TensorInfo t;
    t.name = name;
    // dtype
    const json& dt = entry["dtype"];
    MEGAMOE_CHECK(dt.is_string(), ErrorCode::kFormat, where, ": dtype must be a string, got ",
                  dt.type_name());
    const std::string dt_name = dt.get<std::string>();
    MEGAMOE_CHECK(st_dtype_parse(dt_name, &t.dtype), ErrorCode::kFormat, where,
                  ": unknown dtype ", quote_name(dt_name));
    // shape
    const json& shape = entry["shape"];
    MEGAMOE_CHECK(shape.is_array(), ErrorCode::kFormat, where, ": shape must be an array, got ",
                  shape.type_name());
    MEGAMOE_CHECK(shape.size() <= static_cast<size_t>(kMaxTensorDims), ErrorCode::kFormat, where,
                  ": shape has ", shape.size(), " dims, more than the limit of ", kMaxTensorDims);
    int64_t numel = 1;
    for (size_t d = 0; d < shape.size(); ++d) {
      const std::string what = detail::concat("shape[", d, "]");
      const int64_t extent = json_index(shape[d], where, what.c_str());
      t.shape.push_back(extent);
      MEGAMOE_CHECK(!__builtin_mul_overflow(numel, extent, &numel), ErrorCode::kFormat, where,
                    ": element count of shape ", detail::shape_string(t.shape),
                    "... overflows int64");
    }
    const int bits = st_dtype_bits(t.dtype);
    MEGAMOE_CHECK(numel <= std::numeric_limits<int64_t>::max() / bits, ErrorCode::kFormat, where,
                  ": byte size of ", t.describe(), " overflows int64");
    const int64_t total_bits = numel * bits;
    MEGAMOE_CHECK(total_bits % kBitsPerByte == 0, ErrorCode::kFormat, where, ": ", t.describe(),
                  " is not a whole number of bytes (", total_bits, " bits)");
    const int64_t nbytes = total_bits / kBitsPerByte;
    // data_offsets
    const json& offsets = entry["data_offsets"];
    MEGAMOE_CHECK(offsets.is_array() && offsets.size() == 2, ErrorCode::kFormat, where,
                  ": data_offsets must be an array [begin, end], got ",
                  offsets.dump(-1, ' ', true, json::error_handler_t::replace));
    t.data_begin = json_index(offsets[0], where, "data_offsets[0]");
    t.data_end = json_index(offsets[1], where, "data_offsets[1]");
    MEGAMOE_CHECK(t.data_begin <= t.data_end, ErrorCode::kFormat, where, ": data_offsets [",
                  t.data_begin, ", ", t.data_end, "] are reversed");
    MEGAMOE_CHECK(t.data_end <= data_size, ErrorCode::kFormat, where, ": data_offsets [",
                  t.data_begin, ", ", t.data_end, "] are outside the data region (", data_size,
                  " bytes; the file may be truncated)");
    MEGAMOE_CHECK(t.nbytes() == nbytes, ErrorCode::kFormat, where, ": shape ", t.describe(),
                  " needs ", nbytes, " bytes but data_offsets [", t.data_begin, ", ", t.data_end,
                  "] span ", t.nbytes());
    tensors.push_back(std::move(t));
  }

  // -- overlaps -----------------------------------------------------------------------------
  std::sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.data_begin != b.data_begin ? a.data_begin < b.data_begin : a.data_end < b.data_end;
  });
  int64_t covered_end = 0;
  const TensorInfo* covering = nullptr;
  for (const TensorInfo& t : tensors) {
    if (covering != nullptr && t.data_begin < covered_end && t.nbytes() > 0) {
      fail(ErrorCode::kFormat, f, ": tensor ", quote_name(t.name), " data_offsets [",
           t.data_begin, ", ", t.data_end, "] overlap tensor ", quote_name(covering->name), " [",
           covering->data_begin, ", ", covering->data_end, "]");
    }
    if (t.data_end > covered_end) {
      covered_end = t.data_end;
      covering = &t;
    }
  }
  for (size_t i = 0; i < tensors.size(); ++i) index.emplace(tensors[i].name, i);
}

SafetensorsFile::SafetensorsFile(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SafetensorsFile::SafetensorsFile(SafetensorsFile&&) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&&) noexcept = default;
SafetensorsFile::~SafetensorsFile() = default;

SafetensorsFile SafetensorsFile::parse(std::string label, const uint8_t* bytes, int64_t size) {
  MEGAMOE_CHECK_ARG(size >= 0 && (bytes != nullptr || size == 0), label,
                    ": SafetensorsFile::parse: null bytes or negative size ", size);
  auto impl = std::make_unique<Impl>();
  impl->path = std::move(label);
  impl->bytes = bytes;
  impl->size = size;
  impl->validate();
  return SafetensorsFile(std::move(impl));
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MEGAMOE_CHECK(fd >= 0, ErrorCode::kIo, path, ": cannot open: ", detail::errno_string());
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const std::string err = detail::errno_string();
    ::close(fd);
    fail(ErrorCode::kIo, path, ": cannot stat: ", err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(ErrorCode::kIo, path, ": not a regular file");
  }
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  impl->size = static_cast<int64_t>(st.st_size);
  if (impl->size > 0) {
    void* m = mmap(nullptr, static_cast<size_t>(impl->size), PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      const std::string err = detail::errno_string();
      ::close(fd);
      fail(ErrorCode::kIo, path, ": cannot mmap ", impl->size, " bytes: ", err);
    }
    impl->mapping = m;
    impl->bytes = static_cast<const uint8_t*>(m);
  }
  ::close(fd);  // the mapping stays valid
  impl->validate();
  return SafetensorsFile(std::move(impl));
}

const std::string& SafetensorsFile::path() const { return impl_->path; }
int64_t SafetensorsFile::file_bytes() const { return impl_->size; }
int64_t SafetensorsFile::data_offset() const { return impl_->data_offset; }
const std::vector<TensorInfo>& SafetensorsFile::tensors() const { return impl_->tensors; }
const std::map<std::string, std::string>& SafetensorsFile::metadata() const {
  return impl_->metadata;
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  const auto it = impl_->index.find(name);
  return it == impl_->index.end() ? nullptr : &impl_->tensors[it->second];
}

const TensorInfo& SafetensorsFile::get(std::string_view name) const {
  const TensorInfo* t = find(name);
  MEGAMOE_CHECK(t != nullptr, ErrorCode::kFormat, impl_->path, ": tensor ",
                detail::quote_name(name), " not found");
  return *t;
}

const uint8_t* SafetensorsFile::data(const TensorInfo& tensor) const {
  return impl_->bytes + impl_->data_offset + tensor.data_begin;
}

// ---------------------------------------------------------------------------------------------
// SafetensorsWriter
// ---------------------------------------------------------------------------------------------
namespace {
constexpr int64_t kDataAlignment = 8;
constexpr int64_t kWriteChunkBytes = 64LL << 20;  // progress granularity
}  // namespace

void SafetensorsWriter::add_deferred(std::string name, StDType dtype, std::vector<int64_t> shape) {
  add_entry(std::move(name), dtype, std::move(shape), nullptr, true);
}

void SafetensorsWriter::add(std::string name, StDType dtype, std::vector<int64_t> shape,
                            const void* data) {
  add_entry(std::move(name), dtype, std::move(shape), data, false);
}

void SafetensorsWriter::add_entry(std::string name, StDType dtype, std::vector<int64_t> shape,
                                  const void* data, bool deferred) {
  using detail::quote_name;
  MEGAMOE_CHECK_ARG(!name.empty(), "SafetensorsWriter::add: empty tensor name");
  MEGAMOE_CHECK_ARG(name != kSafetensorsMetadataKey, "SafetensorsWriter::add: the name '",
                    kSafetensorsMetadataKey, "' is reserved");
  MEGAMOE_CHECK_ARG(detail::is_valid_utf8(name), "SafetensorsWriter::add: tensor name ",
                    quote_name(name), " is not valid UTF-8");
  MEGAMOE_CHECK_ARG(shape.size() <= static_cast<size_t>(kMaxTensorDims),
                    "SafetensorsWriter::add: tensor ", quote_name(name), " has ", shape.size(),
                    " dims, more than ", kMaxTensorDims);
  for (const Entry& e : entries_) {
    MEGAMOE_CHECK_ARG(e.name != name, "SafetensorsWriter::add: duplicate tensor name ",
                      quote_name(name));
  }
  int64_t numel = 1;
  for (int64_t d : shape) {
    MEGAMOE_CHECK_ARG(d >= 0, "SafetensorsWriter::add: tensor ", quote_name(name),
                      ": negative dim in ", detail::shape_string(shape));
    MEGAMOE_CHECK_ARG(!__builtin_mul_overflow(numel, d, &numel), "SafetensorsWriter::add: tensor ",
                      quote_name(name), ": element count overflows");
  }
  const int bits = st_dtype_bits(dtype);
  MEGAMOE_CHECK_ARG(numel <= std::numeric_limits<int64_t>::max() / bits &&
                        (numel * bits) % kBitsPerByte == 0,
                    "SafetensorsWriter::add: tensor ", quote_name(name), " ",
                    st_dtype_name(dtype), detail::shape_string(shape),
                    " is not a whole number of bytes");
  const int64_t bytes = numel * bits / kBitsPerByte;
  MEGAMOE_CHECK_ARG(deferred || data != nullptr || bytes == 0, "SafetensorsWriter::add: tensor ",
                    quote_name(name), ": null data for ", bytes, " bytes");
  entries_.push_back({std::move(name), dtype, std::move(shape), data, bytes, -1, deferred});
}

void SafetensorsWriter::add_copy(std::string name, StDType dtype, std::vector<int64_t> shape,
                                 const void* data) {
  add(std::move(name), dtype, std::move(shape), data);
  Entry& e = entries_.back();
  const auto* p = static_cast<const uint8_t*>(data);
  owned_.emplace_back(p, p + e.bytes);
  e.owned_index = static_cast<int64_t>(owned_.size()) - 1;
  e.data = owned_.back().data();
}

void SafetensorsWriter::set_metadata(std::string key, std::string value) {
  MEGAMOE_CHECK_ARG(detail::is_valid_utf8(key) && detail::is_valid_utf8(value),
                    "SafetensorsWriter::set_metadata: key ", detail::quote_name(key),
                    " or its value is not valid UTF-8");
  metadata_[std::move(key)] = std::move(value);
}

std::string SafetensorsWriter::header_json(std::vector<const Entry*>* order) const {
  order->clear();
  for (const Entry& e : entries_) order->push_back(&e);
  if (!preserve_order_) {
    std::stable_sort(order->begin(), order->end(), [](const Entry* a, const Entry* b) {
      return st_dtype_bits(a->dtype) > st_dtype_bits(b->dtype);
    });
  }
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata_.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata_) meta[k] = v;
    header[kSafetensorsMetadataKey] = std::move(meta);
  }
  int64_t offset = 0;
  for (const Entry* e : *order) {
    nlohmann::ordered_json t = nlohmann::ordered_json::object();
    t["dtype"] = st_dtype_name(e->dtype);
    t["shape"] = e->shape;
    t["data_offsets"] = {offset, offset + e->bytes};
    header[e->name] = std::move(t);
    offset += e->bytes;
  }
  std::string text = header.dump();
  // Pad with spaces (valid JSON whitespace) so the data region starts 8-byte aligned.
  const int64_t unpadded = kSafetensorsHeaderLengthBytes + static_cast<int64_t>(text.size());
  const int64_t padded = (unpadded + kDataAlignment - 1) / kDataAlignment * kDataAlignment;
  text.append(static_cast<size_t>(padded - unpadded), ' ');
  return text;
}

int64_t SafetensorsWriter::file_bytes() const {
  std::vector<const Entry*> order;
  int64_t total = kSafetensorsHeaderLengthBytes + static_cast<int64_t>(header_json(&order).size());
  for (const Entry& e : entries_) total += e.bytes;
  return total;
}

namespace {
void put_u64_le(uint8_t* p, uint64_t v) {
  for (int i = 0; i < kSafetensorsHeaderLengthBytes; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
}  // namespace

std::vector<uint8_t> SafetensorsWriter::serialize() const {
  std::vector<const Entry*> order;
  const std::string header = header_json(&order);
  std::vector<uint8_t> out(kSafetensorsHeaderLengthBytes);
  put_u64_le(out.data(), header.size());
  out.insert(out.end(), header.begin(), header.end());
  for (const Entry* e : order) {
    MEGAMOE_CHECK_ARG(!e->deferred, "SafetensorsWriter::serialize: tensor ",
                      detail::quote_name(e->name), " is deferred (use write with a source)");
    const auto* p = static_cast<const uint8_t*>(e->data);
    if (e->bytes > 0) out.insert(out.end(), p, p + e->bytes);
  }
  return out;
}

void SafetensorsWriter::write(const std::string& path,
                              const std::function<void(int64_t, int64_t)>& progress,
                              const TensorSource& source) const {
  std::vector<const Entry*> order;
  const std::string header = header_json(&order);
  int64_t total = kSafetensorsHeaderLengthBytes + static_cast<int64_t>(header.size());
  for (const Entry* e : order) {
    total += e->bytes;
    MEGAMOE_CHECK_ARG(!e->deferred || source, "SafetensorsWriter::write: tensor ",
                      detail::quote_name(e->name), " is deferred but no source was given");
  }

  const std::string tmp = detail::concat(path, ".tmp.", ::getpid());
  FILE* file = std::fopen(tmp.c_str(), "wb");
  MEGAMOE_CHECK(file != nullptr, ErrorCode::kIo, path, ": cannot create ", tmp, ": ",
                detail::errno_string());
  int64_t written = 0;
  auto put = [&](const void* p, int64_t n) {
    if (n > 0 && std::fwrite(p, 1, static_cast<size_t>(n), file) != static_cast<size_t>(n)) {
      const std::string err = detail::errno_string();
      std::fclose(file);
      std::remove(tmp.c_str());
      fail(ErrorCode::kIo, path, ": write failed after ", written, " bytes: ", err);
    }
    written += n;
    if (progress) progress(written, total);
  };
  uint8_t len[kSafetensorsHeaderLengthBytes];
  put_u64_le(len, header.size());
  put(len, sizeof len);
  put(header.data(), static_cast<int64_t>(header.size()));
  for (const Entry* e : order) {
    const void* data = e->data;
    if (e->deferred) {
      try {
        data = source(e->name);
      } catch (...) {
        std::fclose(file);
        std::remove(tmp.c_str());
        throw;
      }
      if (data == nullptr && e->bytes > 0) {
        std::fclose(file);
        std::remove(tmp.c_str());
        fail(ErrorCode::kInternal, path, ": the source gave no bytes for tensor ",
             detail::quote_name(e->name));
      }
    }
    const auto* p = static_cast<const uint8_t*>(data);
    for (int64_t off = 0; off < e->bytes; off += kWriteChunkBytes) {
      put(p + off, std::min(kWriteChunkBytes, e->bytes - off));
    }
  }
  if (std::fclose(file) != 0) {
    const std::string err = detail::errno_string();
    std::remove(tmp.c_str());
    fail(ErrorCode::kIo, path, ": closing ", tmp, " failed: ", err);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string err = detail::errno_string();
    std::remove(tmp.c_str());
    fail(ErrorCode::kIo, path, ": cannot rename ", tmp, " to it: ", err);
  }
}

}  // namespace megamoe
