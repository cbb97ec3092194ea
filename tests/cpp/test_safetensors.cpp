// safetensors reader and writer: round trips, alignment, sharded checkpoints, and the table of
// malformed files (docs/reliability.md), each rejected with its own message naming file and
// tensor, through both the memory-mapped path and the in-memory parser.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <numeric>

#include "megamoe/checkpoint.hpp"
#include "test_checkpoint_fixtures.hpp"

namespace megamoe {
namespace {

using testing_ckpt::raw_safetensors;
using testing_ckpt::TempDir;
using testing_ckpt::throws_error;
using testing_ckpt::write_bytes;

std::vector<uint8_t> iota_bytes(size_t n, uint8_t start = 0) {
  std::vector<uint8_t> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

TEST(Safetensors, RoundTripEveryDtypeWithMetadata) {
  TempDir dir;
  SafetensorsWriter writer;
  struct Case { const char* name; StDType dtype; std::vector<int64_t> shape; };
  const std::vector<Case> cases = {
      {"bool", StDType::kBool, {3}},       {"u8", StDType::kU8, {2, 3}},
      {"i8", StDType::kI8, {5}},           {"f8e4m3", StDType::kF8E4M3, {4, 4}},
      {"f8e5m2", StDType::kF8E5M2, {1}},   {"e8m0", StDType::kF8E8M0, {7}},
      {"bf16", StDType::kBF16, {3, 1}},    {"f16", StDType::kF16, {2}},
      {"i16", StDType::kI16, {2}},         {"u16", StDType::kU16, {2}},
      {"f32", StDType::kF32, {2, 2}},      {"i32", StDType::kI32, {3}},
      {"u32", StDType::kU32, {1}},         {"f64", StDType::kF64, {2}},
      {"i64", StDType::kI64, {2}},         {"u64", StDType::kU64, {1}},
      {"c64", StDType::kC64, {1}},         {"f4", StDType::kF4, {6}},
      {"f6", StDType::kF6E2M3, {4}},       {"empty", StDType::kF32, {0, 5}},
      {"scalar", StDType::kF64, {}},
  };
  std::vector<std::vector<uint8_t>> data;
  for (const auto& c : cases) {
    int64_t n = 1;
    for (auto d : c.shape) n *= d;
    data.push_back(iota_bytes(static_cast<size_t>(n * st_dtype_bits(c.dtype) / 8), 7));
    writer.add(c.name, c.dtype, c.shape, data.back().data());
  }
  writer.set_metadata("format", "pt");
  writer.set_metadata("megamoe.layout", "canonical");
  const std::string path = dir.file("all.safetensors");
  writer.write(path);

  const SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_EQ(f.file_bytes(), writer.file_bytes());
  EXPECT_EQ(f.data_offset() % 8, 0) << "data region must start 8-byte aligned";
  ASSERT_EQ(f.tensors().size(), cases.size());
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.metadata().at("megamoe.layout"), "canonical");
  int64_t expected_begin = 0;
  for (const TensorInfo& t : f.tensors()) {
    EXPECT_EQ(t.data_begin, expected_begin) << "no gaps between tensors: " << t.name;
    const int64_t elem_bytes = std::max(1, st_dtype_bits(t.dtype) / 8);
    EXPECT_EQ((f.data_offset() + t.data_begin) % elem_bytes, 0) << t.name << " misaligned";
    expected_begin = t.data_end;
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    const TensorInfo& t = f.get(cases[i].name);
    EXPECT_EQ(t.dtype, cases[i].dtype) << cases[i].name;
    EXPECT_EQ(t.shape, cases[i].shape) << cases[i].name;
    ASSERT_EQ(t.nbytes(), static_cast<int64_t>(data[i].size())) << cases[i].name;
    if (!data[i].empty()) EXPECT_EQ(std::memcmp(f.data(t), data[i].data(), data[i].size()), 0) << cases[i].name;
  }
  EXPECT_EQ(f.find("missing"), nullptr);
  EXPECT_TRUE(throws_error([&] { f.get("missing"); }, ErrorCode::kFormat, {path, "'missing'", "not found"}));

  // serialize() produces the same bytes as write().
  const std::vector<uint8_t> image = writer.serialize();
  const SafetensorsFile g = SafetensorsFile::parse("image", image.data(), static_cast<int64_t>(image.size()));
  EXPECT_EQ(g.tensors().size(), cases.size());
}

TEST(Safetensors, DtypeNamesRoundTrip) {
  for (int i = 0; i <= static_cast<int>(StDType::kF6E3M2); ++i) {
    const auto d = static_cast<StDType>(i);
    StDType back;
    ASSERT_TRUE(st_dtype_parse(st_dtype_name(d), &back)) << st_dtype_name(d);
    EXPECT_EQ(back, d);
  }
  StDType out;
  EXPECT_FALSE(st_dtype_parse("u8", &out));  // case matters, as in the format
  EXPECT_FALSE(st_dtype_parse("F8_E4M3FN", &out));
}

TEST(Safetensors, WriterRejectsBadTensors) {
  SafetensorsWriter w;
  const uint8_t b[4] = {};
  w.add("a", StDType::kU8, {4}, b);
  EXPECT_TRUE(throws_error([&] { w.add("a", StDType::kU8, {4}, b); }, ErrorCode::kInvalidArgument, {"duplicate", "'a'"}));
  EXPECT_TRUE(throws_error([&] { w.add("", StDType::kU8, {4}, b); }, ErrorCode::kInvalidArgument, {"empty"}));
  EXPECT_TRUE(throws_error([&] { w.add("__metadata__", StDType::kU8, {4}, b); }, ErrorCode::kInvalidArgument, {"reserved"}));
  EXPECT_TRUE(throws_error([&] { w.add("bad\xff", StDType::kU8, {1}, b); }, ErrorCode::kInvalidArgument, {"UTF-8"}));
  EXPECT_TRUE(throws_error([&] { w.add("f4", StDType::kF4, {3}, b); }, ErrorCode::kInvalidArgument, {"whole number of bytes"}));
  EXPECT_TRUE(throws_error([&] { w.add("neg", StDType::kU8, {-1}, b); }, ErrorCode::kInvalidArgument, {"negative"}));
}

TEST(Safetensors, WriteFailsWithIoErrorNamingThePath) {
  SafetensorsWriter w;
  const uint8_t b[1] = {1};
  w.add("a", StDType::kU8, {1}, b);
  EXPECT_TRUE(throws_error([&] { w.write("/nonexistent_dir_megamoe/x.safetensors"); }, ErrorCode::kIo,
                           {"/nonexistent_dir_megamoe/x.safetensors", "cannot create"}));
}

TEST(Safetensors, OpenMissingFileIsIoError) {
  EXPECT_TRUE(throws_error([] { SafetensorsFile::open("/nonexistent_megamoe.safetensors"); }, ErrorCode::kIo,
                           {"/nonexistent_megamoe.safetensors", "cannot open"}));
  TempDir dir;
  EXPECT_TRUE(throws_error([&] { SafetensorsFile::open(dir.path().string()); }, ErrorCode::kIo, {"not a regular file"}));
}

TEST(Safetensors, HeaderWithTrailingSpacesAndGapsIsAccepted) {
  // Spaces after the JSON (the reference writer pads this way) and unused bytes between tensors
  // are harmless; both are accepted.
  const std::string header =
      R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[1],"data_offsets":[4,5]}})"
      "      ";
  const auto image = raw_safetensors(header, iota_bytes(6));
  const auto f = SafetensorsFile::parse("gaps", image.data(), static_cast<int64_t>(image.size()));
  EXPECT_EQ(f.get("b").data_begin, 4);
  EXPECT_EQ(f.data(f.get("b"))[0], 4);
}

// ---------------------------------------------------------------------------------------------
// The malformed-file table (docs/reliability.md, "safetensors reader")
// ---------------------------------------------------------------------------------------------
struct BadFile {
  const char* kind;
  std::vector<uint8_t> bytes;
  std::vector<std::string> message_parts;  // besides the file name
};

std::string entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  const std::string& offsets) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape +
         ",\"data_offsets\":" + offsets + "}";
}

std::vector<BadFile> bad_files() {
  const auto ok = entry("w", "U8", "[4]", "[0,4]");
  const auto data4 = iota_bytes(4);
  std::vector<BadFile> t;
  t.push_back({"truncated_below_length_field", {1, 2, 3, 4, 5}, {"truncated file", "5 bytes"}});
  t.push_back({"empty_file", {}, {"truncated file", "0 bytes"}});
  t.push_back({"header_length_past_end", raw_safetensors("{" + ok + "}", data4, 4096, true),
               {"truncated file", "header length 4096"}});
  t.push_back({"huge_header_length", raw_safetensors("{}", {}, int64_t{1} << 40, true),
               {"header length 1099511627776 exceeds the limit"}});
  t.push_back({"header_length_above_2^63", raw_safetensors("{}", {}, -1, true),
               {"header length >2^63 exceeds the limit"}});
  t.push_back({"zero_header_length", raw_safetensors("", data4), {"header length is 0"}});
  t.push_back({"invalid_json", raw_safetensors("{\"w\": {\"dtype\": ", data4), {"header is not valid JSON"}});
  t.push_back({"trailing_garbage_json", raw_safetensors("{" + ok + "}x", data4), {"header is not valid JSON"}});
  t.push_back({"header_not_object", raw_safetensors("[1, 2]", data4), {"header must be a JSON object", "array"}});
  t.push_back({"non_utf8_name",
               raw_safetensors("{" + entry("layer\xff.w", "U8", "[4]", "[0,4]") + "}", data4),
               {"not valid UTF-8", "layer\\xFF.w"}});
  t.push_back({"overlong_utf8_name",
               raw_safetensors("{" + entry("a\xc0\xafb", "U8", "[4]", "[0,4]") + "}", data4),
               {"not valid UTF-8"}});
  t.push_back({"lone_surrogate_escape",
               raw_safetensors("{" + entry("a\\udc80", "U8", "[4]", "[0,4]") + "}", data4),
               {"header is not valid JSON"}});
  t.push_back({"duplicate_names",
               raw_safetensors("{" + ok + "," + entry("w", "U8", "[4]", "[0,4]") + "}", data4),
               {"has the key 'w' twice"}});
  t.push_back({"duplicate_field",
               raw_safetensors(R"({"w":{"dtype":"U8","dtype":"U8","shape":[4],"data_offsets":[0,4]}})", data4),
               {"has the key 'dtype' twice"}});
  t.push_back({"empty_name", raw_safetensors("{" + entry("", "U8", "[4]", "[0,4]") + "}", data4), {"empty name"}});
  t.push_back({"entry_not_object", raw_safetensors(R"({"w": 3})", data4), {"tensor 'w'", "must be an object"}});
  t.push_back({"missing_dtype", raw_safetensors(R"({"w":{"shape":[4],"data_offsets":[0,4]}})", data4),
               {"tensor 'w'", "missing field 'dtype'"}});
  t.push_back({"unexpected_field",
               raw_safetensors(R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4],"x":1}})", data4),
               {"tensor 'w'", "unexpected field 'x'"}});
  t.push_back({"unknown_dtype", raw_safetensors("{" + entry("w", "Q7", "[4]", "[0,4]") + "}", data4),
               {"tensor 'w'", "unknown dtype 'Q7'"}});
  t.push_back({"dtype_not_string", raw_safetensors(R"({"w":{"dtype":8,"shape":[4],"data_offsets":[0,4]}})", data4),
               {"tensor 'w'", "dtype must be a string"}});
  t.push_back({"negative_shape", raw_safetensors("{" + entry("w", "U8", "[-4]", "[0,4]") + "}", data4),
               {"tensor 'w'", "shape[0] = -4 is negative"}});
  t.push_back({"fractional_shape", raw_safetensors("{" + entry("w", "U8", "[2.5]", "[0,4]") + "}", data4),
               {"tensor 'w'", "shape[0] must be a non-negative integer", "2.5"}});
  t.push_back({"string_shape_entry", raw_safetensors("{" + entry("w", "U8", "[\"4\"]", "[0,4]") + "}", data4),
               {"tensor 'w'", "shape[0] must be a non-negative integer"}});
  t.push_back({"shape_not_array", raw_safetensors("{" + entry("w", "U8", "4", "[0,4]") + "}", data4),
               {"tensor 'w'", "shape must be an array"}});
  t.push_back({"shape_product_overflow",
               raw_safetensors("{" + entry("w", "U8", "[4611686018427387904, 4]", "[0,4]") + "}", data4),
               {"tensor 'w'", "overflows int64"}});
  t.push_back({"shape_extent_above_int64",
               raw_safetensors("{" + entry("w", "U8", "[18446744073709551615]", "[0,4]") + "}", data4),
               {"tensor 'w'", "does not fit int64"}});
  t.push_back({"byte_size_overflow",
               raw_safetensors("{" + entry("w", "F64", "[2305843009213693952]", "[0,4]") + "}", data4),
               {"tensor 'w'", "byte size of F64[2305843009213693952] overflows"}});
  {
    std::string dims = "[";
    for (int i = 0; i < 33; ++i) dims += (i ? ",1" : "1");
    dims += "]";
    t.push_back({"too_many_dims", raw_safetensors("{" + entry("w", "U8", dims, "[0,1]") + "}", data4),
                 {"tensor 'w'", "33 dims, more than the limit of 32"}});
  }
  t.push_back({"subbyte_not_whole_bytes", raw_safetensors("{" + entry("w", "F4", "[3]", "[0,2]") + "}", data4),
               {"tensor 'w'", "not a whole number of bytes"}});
  t.push_back({"offsets_wrong_arity", raw_safetensors("{" + entry("w", "U8", "[4]", "[0,4,8]") + "}", data4),
               {"tensor 'w'", "data_offsets must be an array [begin, end]"}});
  t.push_back({"negative_offset", raw_safetensors("{" + entry("w", "U8", "[4]", "[-4,0]") + "}", data4),
               {"tensor 'w'", "data_offsets[0] = -4 is negative"}});
  t.push_back({"reversed_offsets", raw_safetensors("{" + entry("w", "U8", "[0]", "[4,0]") + "}", data4),
               {"tensor 'w'", "are reversed"}});
  t.push_back({"offsets_out_of_range", raw_safetensors("{" + entry("w", "U8", "[8]", "[0,8]") + "}", data4),
               {"tensor 'w'", "outside the data region (4 bytes"}});
  t.push_back({"truncated_data",
               [&] {
                 auto full = raw_safetensors("{" + entry("w", "U8", "[64]", "[0,64]") + "}", iota_bytes(64));
                 full.resize(full.size() - 10);
                 return full;
               }(),
               {"tensor 'w'", "outside the data region (54 bytes; the file may be truncated)"}});
  t.push_back({"shape_byte_mismatch", raw_safetensors("{" + entry("w", "F32", "[2]", "[0,4]") + "}", data4),
               {"tensor 'w'", "F32[2] needs 8 bytes but data_offsets [0, 4] span 4"}});
  t.push_back({"overlapping_offsets",
               raw_safetensors("{" + entry("a", "U8", "[3]", "[0,3]") + "," + entry("b", "U8", "[2]", "[2,4]") + "}", data4),
               {"tensor 'b'", "overlap tensor 'a'"}});
  t.push_back({"nested_overlap",
               raw_safetensors("{" + entry("a", "U8", "[4]", "[0,4]") + "," + entry("b", "U8", "[1]", "[1,2]") + "," +
                                   entry("c", "U8", "[1]", "[3,4]") + "}", data4),
               {"overlap tensor 'a'"}});
  t.push_back({"metadata_not_strings", raw_safetensors(R"({"__metadata__":{"k":1}})", {}),
               {"'__metadata__' value of 'k' must be a string"}});
  t.push_back({"metadata_not_object", raw_safetensors(R"({"__metadata__":[]})", {}),
               {"'__metadata__' must be an object"}});
  t.push_back({"deep_nesting", raw_safetensors(R"({"w":{"dtype":"U8","shape":[[[[1]]]],"data_offsets":[0,1]}})", data4),
               {"nests deeper"}});
  return t;
}

TEST(SafetensorsMalformed, EveryKindGetsItsOwnErrorNamingTheFile) {
  TempDir dir;
  const auto table = bad_files();
  ASSERT_GE(table.size(), 12u);
  for (const BadFile& bad : table) {
    SCOPED_TRACE(bad.kind);
    // In memory.
    const std::string label = std::string("mem:") + bad.kind;
    std::vector<std::string> parts = bad.message_parts;
    parts.push_back(label);
    EXPECT_TRUE(throws_error(
        [&] { SafetensorsFile::parse(label, bad.bytes.data(), static_cast<int64_t>(bad.bytes.size())); },
        ErrorCode::kFormat, parts));
    // Through the file system and mmap.
    const std::string path = dir.file(std::string(bad.kind) + ".safetensors");
    write_bytes(path, bad.bytes);
    parts.back() = path;
    EXPECT_TRUE(throws_error([&] { SafetensorsFile::open(path); }, ErrorCode::kFormat, parts));
  }
}

TEST(SafetensorsMalformed, EveryPrefixOfAValidFileIsRejectedOrValid) {
  // Cutting a valid file anywhere must give a kFormat error (never a crash or an out-of-bounds
  // read: the ASan build checks the latter) unless the cut leaves a complete file.
  SafetensorsWriter w;
  const auto a = iota_bytes(40), b = iota_bytes(24);
  w.add("a", StDType::kU8, {5, 8}, a.data());
  w.add("b", StDType::kBF16, {12}, b.data());
  w.set_metadata("k", "v");
  const auto image = w.serialize();
  for (size_t n = 0; n < image.size(); ++n) {
    std::vector<uint8_t> cut(image.begin(), image.begin() + static_cast<long>(n));
    EXPECT_TRUE(throws_error(
        [&] { SafetensorsFile::parse("cut", cut.data(), static_cast<int64_t>(cut.size())); },
        ErrorCode::kFormat, {}))
        << "prefix of " << n << " bytes";
  }
  EXPECT_NO_THROW(SafetensorsFile::parse("full", image.data(), static_cast<int64_t>(image.size())));
}

// ---------------------------------------------------------------------------------------------
// Checkpoints of several files
// ---------------------------------------------------------------------------------------------
void write_shard(const std::string& path, const std::vector<std::string>& names) {
  SafetensorsWriter w;
  std::vector<uint8_t> bytes(4, 9);
  for (const auto& n : names) w.add_copy(n, StDType::kU8, {4}, bytes.data());
  w.write(path);
}

void write_text(const std::string& path, const std::string& text) {
  write_bytes(path, std::vector<uint8_t>(text.begin(), text.end()));
}

TEST(Checkpoint, ShardedThroughIndex) {
  TempDir dir;
  write_shard(dir.file("model-00001-of-00002.safetensors"), {"a", "b"});
  write_shard(dir.file("model-00002-of-00002.safetensors"), {"c"});
  write_text(dir.file(kSafetensorsIndexName),
             R"({"metadata":{"total_size":12},"weight_map":{"a":"model-00001-of-00002.safetensors",)"
             R"("b":"model-00001-of-00002.safetensors","c":"model-00002-of-00002.safetensors"}})");
  for (const std::string& path : {dir.path().string(), dir.file(kSafetensorsIndexName)}) {
    const Checkpoint ckpt = Checkpoint::open(path);
    EXPECT_EQ(ckpt.files().size(), 2u);
    EXPECT_EQ(ckpt.tensor_names(), (std::vector<std::string>{"a", "b", "c"}));
    EXPECT_EQ(ckpt.get("c").data()[0], 9);
    EXPECT_NE(ckpt.get("c").file->path().find("00002"), std::string::npos);
    EXPECT_TRUE(throws_error([&] { ckpt.get("zz"); }, ErrorCode::kFormat, {"'zz'", "not found"}));
  }
}

TEST(Checkpoint, DirectoryWithoutIndexOpensEveryShard) {
  TempDir dir;
  write_shard(dir.file("x.safetensors"), {"a"});
  write_shard(dir.file("y.safetensors"), {"b"});
  const Checkpoint ckpt = Checkpoint::open(dir.path().string());
  EXPECT_EQ(ckpt.num_tensors(), 2);
}

TEST(Checkpoint, MalformedIndexAndShards) {
  TempDir dir;
  write_shard(dir.file("s1.safetensors"), {"a"});
  write_shard(dir.file("s2.safetensors"), {"a"});
  const std::string idx = dir.file("bad.index.json");
  write_text(idx, R"({"weight_map":{"a":"s1.safetensors","b":"s1.safetensors"}})");
  EXPECT_TRUE(throws_error([&] { Checkpoint::open(idx); }, ErrorCode::kFormat,
                           {idx, "tensor 'b' in s1.safetensors, which does not contain it"}));
  write_text(idx, R"({"weight_map":{"a":"s1.safetensors","x":"s2.safetensors"}})");
  EXPECT_TRUE(throws_error([&] { Checkpoint::open(idx); }, ErrorCode::kFormat, {"tensor 'a' appears in both"}));
  write_text(idx, R"({"weight_map":{"a":"../s1.safetensors"}})");
  EXPECT_TRUE(throws_error([&] { Checkpoint::open(idx); }, ErrorCode::kFormat, {"leaves the index's directory"}));
  write_text(idx, R"({"weight_map":{"a":"/etc/passwd"}})");
  EXPECT_TRUE(throws_error([&] { Checkpoint::open(idx); }, ErrorCode::kFormat, {"absolute path"}));
  write_text(idx, R"({"weight_map":{"a":"s1.safetensors","a":"s2.safetensors"}})");
  EXPECT_TRUE(throws_error([&] { Checkpoint::open(idx); }, ErrorCode::kFormat, {"has the key 'a' twice"}));
  write_text(idx, R"({"weight_map":{"a":3}})");
  EXPECT_TRUE(throws_error([&] { Checkpoint::open(idx); }, ErrorCode::kFormat, {"must name a file"}));
  write_text(idx, R"({"metadata":{}})");
  EXPECT_TRUE(throws_error([&] { Checkpoint::open(idx); }, ErrorCode::kFormat, {"\"weight_map\" object"}));
  write_text(idx, R"({"weight_map":{"a":"missing.safetensors"}})");
  EXPECT_TRUE(throws_error([&] { Checkpoint::open(idx); }, ErrorCode::kIo, {"missing.safetensors", "cannot open"}));
  EXPECT_TRUE(throws_error([&] { Checkpoint::open(dir.file("nope")); }, ErrorCode::kIo, {"nope", "cannot open"}));
  TempDir empty;
  EXPECT_TRUE(throws_error([&] { Checkpoint::open(empty.path().string()); }, ErrorCode::kIo, {"neither"}));
}

}  // namespace
}  // namespace megamoe
