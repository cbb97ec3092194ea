// Checkpoints (single file or sharded through model.safetensors.index.json).
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "checkpoint/safetensors_detail.hpp"
#include "megamoe/error.hpp"

namespace megamoe {

namespace fs = std::filesystem;

namespace {

// Root object (0) -> "weight_map"/"metadata" objects (1) -> their values (2).
constexpr int kMaxIndexDepth = 2;
constexpr int64_t kMaxIndexBytes = 256LL << 20;
constexpr const char* kSafetensorsSuffix = ".safetensors";
constexpr const char* kJsonSuffix = ".json";

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

std::string read_small_file(const std::string& path, int64_t limit) {
  std::ifstream in(path, std::ios::binary);
  MEGAMOE_CHECK(in.good(), ErrorCode::kIo, path, ": cannot open: ", detail::errno_string());
  in.seekg(0, std::ios::end);
  const auto size = static_cast<int64_t>(in.tellg());
  MEGAMOE_CHECK(size >= 0 && size <= limit, ErrorCode::kFormat, path, ": ", size,
                " bytes, larger than the ", limit, "-byte limit for an index file");
  in.seekg(0, std::ios::beg);
  std::string text(static_cast<size_t>(size), '\0');
  in.read(text.data(), size);
  MEGAMOE_CHECK(in.gcount() == size, ErrorCode::kIo, path, ": short read");
  return text;
}

// A shard name from an index: relative, inside the index's directory.
void check_shard_name(const std::string& index_path, const std::string& shard) {
  MEGAMOE_CHECK(!shard.empty(), ErrorCode::kFormat, index_path, ": weight_map has an empty file name");
  const fs::path p(shard);
  MEGAMOE_CHECK(!p.is_absolute(), ErrorCode::kFormat, index_path, ": weight_map file ",
                detail::quote_name(shard), " is an absolute path (shards must sit beside the index)");
  for (const auto& part : p) {
    MEGAMOE_CHECK(part != "..", ErrorCode::kFormat, index_path, ": weight_map file ",
                  detail::quote_name(shard), " leaves the index's directory");
  }
}

}  // namespace

Checkpoint Checkpoint::open(const std::string& path) {
  Checkpoint ckpt;
  ckpt.path_ = path;
  std::error_code ec;
  const auto status = fs::status(path, ec);
  MEGAMOE_CHECK(!ec && fs::exists(status), ErrorCode::kIo, path, ": cannot open: ",
                ec ? ec.message() : std::string("no such file or directory"));

  std::string index_path;
  std::vector<std::string> shard_paths;
  if (fs::is_directory(status)) {
    const fs::path index = fs::path(path) / kSafetensorsIndexName;
    if (fs::exists(index)) {
      index_path = index.string();
    } else {
      for (const auto& entry : fs::directory_iterator(path)) {
        if (entry.is_regular_file() && ends_with(entry.path().string(), kSafetensorsSuffix)) {
          shard_paths.push_back(entry.path().string());
        }
      }
      std::sort(shard_paths.begin(), shard_paths.end());
      MEGAMOE_CHECK(!shard_paths.empty(), ErrorCode::kIo, path, ": directory has neither ",
                    kSafetensorsIndexName, " nor any *", kSafetensorsSuffix, " file");
    }
  } else if (ends_with(path, kJsonSuffix)) {
    index_path = path;
  } else {
    shard_paths.push_back(path);
  }

  // weight_map: tensor -> shard file name, checked against the shards below.
  std::map<std::string, std::string> weight_map;
  if (!index_path.empty()) {
    ckpt.path_ = index_path;
    const std::string text = read_small_file(index_path, kMaxIndexBytes);
    MEGAMOE_CHECK(detail::is_valid_utf8(text), ErrorCode::kFormat, index_path,
                  ": index is not valid UTF-8");
    const nlohmann::json root = detail::parse_json_strict(
        index_path, "index", text.data(), text.data() + text.size(), kMaxIndexDepth);
    MEGAMOE_CHECK(root.is_object() && root.contains("weight_map") && root["weight_map"].is_object(),
                  ErrorCode::kFormat, index_path,
                  ": index must be an object with a \"weight_map\" object");
    std::vector<std::string> shards;
    for (const auto& [tensor, file] : root["weight_map"].items()) {
      MEGAMOE_CHECK(file.is_string(), ErrorCode::kFormat, index_path, ": weight_map entry ",
                    detail::quote_name(tensor), " must name a file, got ", file.type_name());
      const std::string shard = file.get<std::string>();
      check_shard_name(index_path, shard);
      weight_map.emplace(tensor, shard);
      shards.push_back(shard);
    }
    std::sort(shards.begin(), shards.end());
    shards.erase(std::unique(shards.begin(), shards.end()), shards.end());
    const fs::path dir = fs::path(index_path).parent_path();
    for (const auto& s : shards) shard_paths.push_back((dir / s).string());
  }

  ckpt.files_.reserve(shard_paths.size());
  for (const auto& shard_path : shard_paths) ckpt.files_.push_back(SafetensorsFile::open(shard_path));
  // Every tensor of every shard, each in exactly one shard.
  for (const SafetensorsFile& file : ckpt.files_) {
    for (const TensorInfo& t : file.tensors()) {
      const auto [it, inserted] = ckpt.tensors_.emplace(t.name, TensorRef{&file, &t});
      MEGAMOE_CHECK(inserted, ErrorCode::kFormat, ckpt.path_, ": tensor ",
                    detail::quote_name(t.name), " appears in both ", it->second.file->path(),
                    " and ", file.path());
    }
  }
  for (const auto& [tensor, shard] : weight_map) {
    const auto it = ckpt.tensors_.find(tensor);
    const bool ok = it != ckpt.tensors_.end() &&
                    fs::path(it->second.file->path()) ==
                        fs::path(index_path).parent_path() / shard;
    MEGAMOE_CHECK(ok, ErrorCode::kFormat, index_path, ": weight_map places tensor ",
                  detail::quote_name(tensor), " in ", shard, ", which does not contain it");
  }
  return ckpt;
}

Checkpoint Checkpoint::from_file(SafetensorsFile file) {
  Checkpoint ckpt;
  ckpt.path_ = file.path();
  ckpt.files_.push_back(std::move(file));
  const SafetensorsFile& f = ckpt.files_.front();
  for (const TensorInfo& t : f.tensors()) ckpt.tensors_.emplace(t.name, TensorRef{&f, &t});
  return ckpt;
}

int64_t Checkpoint::total_bytes() const {
  int64_t total = 0;
  for (const auto& f : files_) total += f.file_bytes();
  return total;
}

std::vector<std::string> Checkpoint::tensor_names() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& [name, ref] : tensors_) names.push_back(name);
  return names;
}

Checkpoint::TensorRef Checkpoint::find(std::string_view name) const {
  const auto it = tensors_.find(name);
  return it == tensors_.end() ? TensorRef{} : it->second;
}

Checkpoint::TensorRef Checkpoint::get(std::string_view name) const {
  const TensorRef ref = find(name);
  MEGAMOE_CHECK(ref.info != nullptr, ErrorCode::kFormat, path_, ": tensor ",
                detail::quote_name(name), " not found");
  return ref;
}

void Checkpoint::for_each(
    const std::function<void(const std::string&, const TensorRef&)>& fn) const {
  for (const auto& [name, ref] : tensors_) fn(name, ref);
}

}  // namespace megamoe
