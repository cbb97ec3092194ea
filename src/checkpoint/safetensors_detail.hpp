// Internal helpers shared by the safetensors reader, the checkpoint loader and inspection.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "megamoe/checkpoint.hpp"

namespace megamoe::detail {

std::string shape_string(const std::vector<int64_t>& shape);  // "[4, 16]"
// A name in single quotes, control bytes and quotes escaped as \xNN, cut after 200 bytes.
std::string quote_name(std::string_view name);

// Byte offset of the first invalid UTF-8 sequence, or -1 when all of s[0, n) is valid.
int64_t find_invalid_utf8(const uint8_t* s, int64_t n);
bool is_valid_utf8(std::string_view s);

// Parses JSON text, failing with kFormat "LABEL: WHAT ..." on a syntax error, a duplicate key in
// any object, or nesting deeper than max_depth (root = depth 0).
nlohmann::json parse_json_strict(const std::string& label, const char* what, const char* begin,
                                 const char* end, int max_depth);

std::string errno_string();

}  // namespace megamoe::detail
