#include "difftrain/io/sharded_tensors.h"

#include "difftrain/core/error.h"
#include "difftrain/io/atomic_file.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <set>
#include <system_error>

namespace difftrain::io {
namespace {

namespace fs = std::filesystem;
using Piece = ShardedTensorInfo::Piece;

constexpr const char* kFormat = "difftrain-sharded";
constexpr int kVersion = 1;
constexpr int kMaxShards = 99999;  // five digits in the file names
// Larger counts are surely a corrupt index; it also keeps numel * element size within int64.
constexpr int64_t kMaxNumel = int64_t{1} << 56;
constexpr const char* kResume =
    "the checkpoint is incomplete or corrupt; resume from an earlier "
    "checkpoint";

std::string range_str(int64_t begin, int64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}

std::string meta_range(int64_t begin, int64_t end) {
  return std::to_string(begin) + ":" + std::to_string(end);
}

std::string join(const std::string& dir, const std::string& file) {
  return (fs::path(dir) / file).string();
}

// The dtypes safetensors files hold, by their safetensors names.
bool parse_dtype(const std::string& name, torch::Dtype& out) {
  for (auto d : {torch::kFloat64, torch::kFloat32, torch::kFloat16, torch::kBFloat16, torch::kInt64,
                 torch::kInt32, torch::kInt16, torch::kInt8, torch::kUInt8, torch::kBool}) {
    if (name == safetensors_dtype_name(d)) {
      out = d;
      return true;
    }
  }
  return false;
}

// Element count of `shape`; `fail` gets the reason when a dimension is negative or the count
// is implausibly large (so nothing is ever allocated from it).
template <typename Fail>
int64_t checked_numel(const std::vector<int64_t>& shape, Fail&& fail) {
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0) fail("shape has a negative dimension " + std::to_string(d));
    if (d != 0 && numel > kMaxNumel / d) {
      fail("shape's element count exceeds 2^56 (a corrupt index?)");
    }
    numel *= d;
  }
  return numel;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

bool plain_file_name(const std::string& f) {
  return !f.empty() && f != "." && f != ".." && f.find('/') == std::string::npos &&
         f.find('\0') == std::string::npos;
}

// Sorts `pieces` by begin and checks they cover [0, numel) exactly. `where` starts each message
// (names the index or the caller) and `fix` ends it.
void check_coverage(const std::string& where, const std::string& name, int64_t numel,
                    std::vector<Piece>& pieces, const std::string& fix) {
  auto fail = [&](const std::string& what) {
    throw Error(where + ": tensor '" + name + "' " + what + "; " + fix);
  };
  std::set<std::string> files;
  for (const auto& p : pieces) {
    if (!plain_file_name(p.file)) {
      fail("has a piece in file '" + p.file + "', which is not a file name inside the folder");
    }
    if (!files.insert(p.file).second) fail("has two pieces in file '" + p.file + "'");
    if (p.begin < 0 || p.end < p.begin || p.end > numel) {
      fail("has piece " + range_str(p.begin, p.end) + " in '" + p.file + "' outside its " +
           std::to_string(numel) + " elements " + range_str(0, numel));
    }
  }
  std::stable_sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  int64_t covered = 0;
  const Piece* last = nullptr;
  for (const auto& p : pieces) {
    if (p.begin == p.end) continue;  // an empty piece covers nothing and overlaps nothing
    if (p.begin < covered) {
      fail("has overlapping pieces " + range_str(last->begin, last->end) + " in '" + last->file +
           "' and " + range_str(p.begin, p.end) + " in '" + p.file + "'");
    }
    if (p.begin > covered) {
      fail("has a gap: elements " + range_str(covered, p.begin) + " are in no piece");
    }
    covered = p.end;
    last = &p;
  }
  if (covered != numel) {
    fail("has a gap: elements " + range_str(covered, numel) + " are in no piece");
  }
}

void check_tensor_name(const std::string& name, const std::string& where) {
  if (name.empty() || name == "__metadata__" || name == "format") {
    throw Error(where + ": a tensor may not be named '" + name +
                "' (empty, __metadata__ and format are reserved); rename it");
  }
}

}  // namespace

std::string shard_file_name(const std::string& stem, int rank, int world) {
  if (world < 1 || world > kMaxShards || rank < 0 || rank >= world) {
    throw Error("shard_file_name: rank " + std::to_string(rank) + " of world " +
                std::to_string(world) + " is invalid; expected 0 <= rank < world <= 99999");
  }
  if (stem.empty() || !plain_file_name(stem)) {
    throw Error("shard_file_name: stem '" + stem + "' must be a non-empty file name, e.g. model");
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "-%05d-of-%05d.safetensors", rank + 1, world);
  return stem + buf;
}

void write_tensor_shard(const std::string& dir, const std::string& stem, int rank, int world,
                        const std::vector<TensorPiece>& pieces) {
  const std::string path = join(dir, shard_file_name(stem, rank, world));
  const std::string where = "write_tensor_shard (" + path + ")";
  TensorMap tensors;
  Metadata metadata{{"format", kFormat}};
  for (const auto& p : pieces) {
    check_tensor_name(p.name, where);
    if (tensors.count(p.name)) {
      throw Error(where + ": two pieces of tensor '" + p.name +
                  "'; a rank owns at most one contiguous range of each tensor");
    }
    if (p.begin < 0 || p.end < p.begin) {
      throw Error(where + ": piece of '" + p.name + "' has range " + range_str(p.begin, p.end) +
                  "; expected 0 <= begin <= end");
    }
    if (!p.data.defined() || p.data.numel() != p.end - p.begin) {
      throw Error(where + ": piece " + range_str(p.begin, p.end) + " of '" + p.name + "' holds " +
                  (p.data.defined() ? std::to_string(p.data.numel()) : std::string("no")) +
                  " elements; it must hold end - begin = " + std::to_string(p.end - p.begin));
    }
    tensors.emplace(p.name, p.data.detach().reshape({-1}));
    metadata[p.name] = meta_range(p.begin, p.end);
  }
  save_safetensors(path, tensors, metadata);
}

void write_shard_index(const std::string& dir, const std::string& stem, int world,
                       const std::map<std::string, ShardedTensorInfo>& tensors,
                       const nlohmann::json& extra_metadata) {
  if (world < 1 || world > kMaxShards) {
    throw Error("write_shard_index: world " + std::to_string(world) +
                " is invalid; expected 1 <= world <= 99999");
  }
  const std::string path = join(dir, stem + ".index.json");
  const std::string where = "write_shard_index (" + path + ")";
  if (!extra_metadata.is_null() && !extra_metadata.is_object()) {
    throw Error(where + ": extra metadata must be a JSON object, got " + extra_metadata.dump());
  }
  nlohmann::json entries = nlohmann::json::object();
  nlohmann::json weight_map = nlohmann::json::object();
  for (const auto& [name, info] : tensors) {
    check_tensor_name(name, where);
    // A named copy: lambdas cannot capture structured bindings before C++20 (clang rejects it).
    const std::string& tensor = name;
    const int64_t numel = checked_numel(info.shape, [&](const std::string& why) {
      throw Error(where + ": tensor '" + tensor + "' " + why + "; fix the shape");
    });
    auto pieces = info.pieces;
    check_coverage(where, name, numel, pieces, "fix the piece ranges");
    nlohmann::json list = nlohmann::json::array();
    for (const auto& p : pieces) {
      list.push_back({{"file", p.file}, {"begin", p.begin}, {"end", p.end}});
      if (p.end > p.begin && !weight_map.contains(name)) weight_map[name] = p.file;
    }
    entries[name] = {
        {"shape", info.shape}, {"dtype", safetensors_dtype_name(info.dtype)}, {"pieces", list}};
  }
  nlohmann::json index = {
      {"format", kFormat},
      {"version", kVersion},
      {"num_shards", world},
      {"metadata", extra_metadata.is_null() ? nlohmann::json::object() : extra_metadata},
      {"tensors", entries},
      {"weight_map", weight_map}};
  write_file_atomic(path, index.dump(2) + "\n");
}

bool has_sharded_tensors(const std::string& dir, const std::string& stem) {
  std::error_code ec;
  return fs::is_regular_file(fs::path(dir) / (stem + ".index.json"), ec);
}

ShardedTensorReader::ShardedTensorReader(std::string dir, std::string stem)
    : dir_(std::move(dir)), stem_(std::move(stem)), index_path_(join(dir_, stem_ + ".index.json")) {
  std::error_code ec;
  if (!fs::is_directory(dir_, ec)) {
    throw Error(dir_ + ": no such folder; give a checkpoint folder holding " + stem_ +
                ".index.json");
  }
  if (!fs::is_regular_file(index_path_, ec)) {
    throw Error(index_path_ + ": no such file; this folder has no sharded '" + stem_ +
                "' (the index is written last, so the checkpoint may be incomplete)");
  }
  auto bad = [&](const std::string& what) {
    throw Error(index_path_ + ": " + what + "; " + kResume);
  };
  nlohmann::json index;
  try {
    index = nlohmann::json::parse(read_file(index_path_));
  } catch (const nlohmann::json::exception& e) {
    bad(std::string("not valid JSON (") + e.what() + ")");
  }
  if (!index.is_object() || index.value("format", nlohmann::json()) != kFormat) {
    bad(std::string("not a sharded tensor index (\"format\" is not \"") + kFormat + "\")");
  }
  const auto version = index.value("version", nlohmann::json());
  if (!version.is_number_integer()) bad("has no integer \"version\"");
  if (version.get<int64_t>() != kVersion) {
    throw Error(index_path_ + ": index version " + version.dump() + " is not supported (this " +
                "difftrain reads version 1); use the difftrain that wrote it");
  }
  const auto shards = index.value("num_shards", nlohmann::json());
  if (!shards.is_number_integer() || shards.get<int64_t>() < 1 ||
      shards.get<int64_t>() > kMaxShards) {
    bad("\"num_shards\" is " + shards.dump() + "; expected an integer in [1, 99999]");
  }
  num_shards_ = shards.get<int>();
  metadata_ = index.value("metadata", nlohmann::json::object());
  if (!metadata_.is_object()) bad("\"metadata\" is not an object");
  const auto entries = index.value("tensors", nlohmann::json());
  if (!entries.is_object()) bad("has no \"tensors\" object");

  std::set<std::string> files_seen;
  for (auto it = entries.begin(); it != entries.end(); ++it) {
    const std::string& name = it.key();
    const auto& e = it.value();
    auto bad_tensor = [&](const std::string& what) { bad("tensor '" + name + "' " + what); };
    if (!e.is_object()) bad_tensor("is not an object");
    ShardedTensorInfo info;
    const auto shape = e.value("shape", nlohmann::json());
    if (!shape.is_array()) bad_tensor("has no \"shape\" array");
    for (const auto& d : shape) {
      if (!d.is_number_integer()) bad_tensor("has a shape entry that is not an integer");
      // Out-of-range values become negative here and are rejected by checked_numel.
      info.shape.push_back(d.get<int64_t>());
    }
    const int64_t numel = checked_numel(info.shape, bad_tensor);
    const auto dtype = e.value("dtype", nlohmann::json());
    if (!dtype.is_string() || !parse_dtype(dtype.get<std::string>(), info.dtype)) {
      bad_tensor("has dtype " + dtype.dump() +
                 "; expected one of F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL");
    }
    const auto pieces = e.value("pieces", nlohmann::json());
    if (!pieces.is_array()) bad_tensor("has no \"pieces\" array");
    for (const auto& p : pieces) {
      if (!p.is_object() || !p.value("file", nlohmann::json()).is_string() ||
          !p.value("begin", nlohmann::json()).is_number_integer() ||
          !p.value("end", nlohmann::json()).is_number_integer()) {
        bad_tensor("has a piece that is not {\"file\": string, \"begin\": int, \"end\": int}");
      }
      info.pieces.push_back(
          {p["file"].get<std::string>(), p["begin"].get<int64_t>(), p["end"].get<int64_t>()});
    }
    check_coverage(index_path_, name, numel, info.pieces, kResume);
    for (const auto& p : info.pieces) {
      if (p.begin == p.end || !files_seen.insert(p.file).second) continue;
      if (!fs::is_regular_file(fs::path(dir_) / p.file, ec)) {
        throw Error(join(dir_, p.file) + ": shard file is missing (the index lists tensor '" +
                    name + "' in it); " + kResume);
      }
    }
    tensors_.emplace(name, std::move(info));
  }
}

std::vector<std::string> ShardedTensorReader::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& [name, info] : tensors_) out.push_back(name);
  return out;
}

const ShardedTensorInfo& ShardedTensorReader::info(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    throw Error(index_path_ + ": no tensor '" + name + "' in this checkpoint (it has " +
                std::to_string(tensors_.size()) +
                " tensors); it was saved from another model or with another configuration");
  }
  return it->second;
}

bool ShardedTensorReader::has(const std::string& name) const { return tensors_.count(name) > 0; }

int ShardedTensorReader::num_shards() const { return num_shards_; }

const nlohmann::json& ShardedTensorReader::metadata() const { return metadata_; }

std::shared_ptr<const Safetensors> ShardedTensorReader::shard(const std::string& file,
                                                              const std::string& tensor) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = files_.find(file);
  if (it != files_.end()) return it->second;
  const std::string path = join(dir_, file);
  std::shared_ptr<const Safetensors> loaded;
  try {
    loaded = std::make_shared<const Safetensors>(load_safetensors(path));
  } catch (const Error& e) {
    // Keep load_safetensors' reason but not its path (named here) nor its advice (ours differs).
    std::string why = e.what();
    const std::string prefix = "invalid safetensors file '" + path + "': ";
    if (why.rfind(prefix, 0) == 0) why = why.substr(prefix.size());
    const auto advice = why.find("; the file is corrupt or not safetensors");
    if (advice != std::string::npos) why = why.substr(0, advice);
    throw Error("shard file '" + path + "' (holding tensor '" + tensor +
                "') cannot be read: " + why + "; " + kResume);
  }
  files_.emplace(file, loaded);
  return loaded;
}

torch::Tensor ShardedTensorReader::piece_data(const std::string& name,
                                              const ShardedTensorInfo& info, const Piece& p) const {
  auto file = shard(p.file, name);
  const std::string path = join(dir_, p.file);
  auto bad = [&](const std::string& what) {
    throw Error(path + ": tensor '" + name + "' " + what + " (per " + index_path_ + "); " +
                kResume);
  };
  auto it = file->tensors.find(name);
  if (it == file->tensors.end()) {
    bad("is missing from this shard file, which should hold its elements " +
        range_str(p.begin, p.end));
  }
  const auto& t = it->second;
  if (t.scalar_type() != info.dtype) {
    bad(std::string("is ") + safetensors_dtype_name(t.scalar_type()) + " here but " +
        safetensors_dtype_name(info.dtype) + " in the index");
  }
  if (t.numel() != p.end - p.begin) {
    bad("has " + std::to_string(t.numel()) + " elements here but its piece " +
        range_str(p.begin, p.end) + " has " + std::to_string(p.end - p.begin));
  }
  auto m = file->metadata.find(name);
  if (m != file->metadata.end() && m->second != meta_range(p.begin, p.end)) {
    bad("holds elements [" + m->second + ") here but the index says " + range_str(p.begin, p.end) +
        " (files of different checkpoints mixed?)");
  }
  return t.reshape({-1});
}

torch::Tensor ShardedTensorReader::read_range(const std::string& name, int64_t begin,
                                              int64_t end) const {
  const auto& meta = info(name);
  const int64_t numel = checked_numel(meta.shape, [](const std::string&) {});  // checked already
  if (begin < 0 || end < begin || end > numel) {
    throw Error("read_range: range " + range_str(begin, end) + " of tensor '" + name +
                "' is outside its " + std::to_string(numel) + " elements (shape " +
                shape_str(meta.shape) + "); expected 0 <= begin <= end <= numel");
  }
  // Check every needed piece against its file before allocating the result.
  std::vector<std::pair<const Piece*, torch::Tensor>> parts;
  for (const auto& p : meta.pieces) {
    if (p.begin == p.end || p.end <= begin || p.begin >= end) continue;
    parts.emplace_back(&p, piece_data(name, meta, p));
  }
  auto out = torch::empty({end - begin}, torch::TensorOptions().dtype(meta.dtype));
  for (const auto& [p, data] : parts) {
    const int64_t lo = std::max(begin, p->begin), hi = std::min(end, p->end);
    out.narrow(0, lo - begin, hi - lo).copy_(data.narrow(0, lo - p->begin, hi - lo));
  }
  return out;
}

torch::Tensor ShardedTensorReader::read(const std::string& name) const {
  const auto& meta = info(name);
  const int64_t numel = checked_numel(meta.shape, [](const std::string&) {});
  return read_range(name, 0, numel).view(meta.shape);
}

TensorMap ShardedTensorReader::read_all() const {
  TensorMap out;
  for (const auto& [name, meta] : tensors_) out.emplace(name, read(name));
  return out;
}

MergeWeightsResult merge_weights(const std::string& checkpoint_dir, const std::string& output_dir,
                                 const MergeWeightsOptions& options) {
  std::error_code ec;
  const fs::path in(checkpoint_dir), out(output_dir);
  if (!fs::exists(in, ec)) {
    throw Error(checkpoint_dir + ": no such folder; give a checkpoint folder written by the " +
                "trainer (e.g. runs/<run>/checkpoint-<step>)");
  }
  if (!fs::is_directory(in, ec)) {
    throw Error(checkpoint_dir + ": not a folder; give a checkpoint folder written by the trainer");
  }
  if (options.model_index < 0) {
    throw Error("model index " + std::to_string(options.model_index) +
                " is negative; use 0 for the first prepared model, 1 for the second, ...");
  }
  if (!plain_file_name(options.output_name)) {
    throw Error("output name '" + options.output_name +
                "' must be a file name without a folder, e.g. "
                "diffusion_pytorch_model.safetensors");
  }
  if (output_dir.empty()) throw Error("the output folder is empty; give a new folder to write");
  if (fs::weakly_canonical(in, ec) == fs::weakly_canonical(out, ec) ||
      (fs::exists(out, ec) && fs::equivalent(in, out, ec))) {
    throw Error(output_dir + ": the output is the checkpoint folder " + checkpoint_dir +
                "; give another folder (the checkpoint is never modified)");
  }
  const std::string stem =
      options.model_index == 0 ? "model" : "model_" + std::to_string(options.model_index);

  MergeWeightsResult result;
  TensorMap tensors;
  std::string source;
  if (has_sharded_tensors(checkpoint_dir, stem)) {
    ShardedTensorReader reader(checkpoint_dir, stem);
    tensors = reader.read_all();
    const auto lora = reader.metadata().value("lora", nlohmann::json());
    result.lora = lora.is_boolean() && lora.get<bool>();
    result.sharded = true;
    source = reader.index_path();
  } else if (fs::is_regular_file(in / (stem + ".safetensors"), ec)) {
    source = (in / (stem + ".safetensors")).string();
    auto file = load_safetensors(source);
    tensors = std::move(file.tensors);
    auto lora = file.metadata.find("lora");
    result.lora = lora != file.metadata.end() && lora->second == "true";
  } else {
    // Name the models the folder does have (shard files aside), so the fix is obvious.
    std::vector<std::string> models;
    for (const auto& entry : fs::directory_iterator(in, ec)) {
      const std::string f = entry.path().filename().string();
      auto ends_with = [&](const std::string& end) {
        return f.size() > end.size() && f.compare(f.size() - end.size(), end.size(), end) == 0;
      };
      if (f.rfind("model", 0) == 0 &&
          (ends_with(".index.json") || (ends_with(".safetensors") && f.find("-of-") == f.npos))) {
        models.push_back(f);
      }
    }
    std::sort(models.begin(), models.end());
    std::string found;
    for (const auto& m : models) found += (found.empty() ? "" : ", ") + m;
    throw Error(checkpoint_dir + ": no model " + std::to_string(options.model_index) +
                " in this folder (neither " + stem + ".index.json nor " + stem + ".safetensors); " +
                (found.empty() ? "give a checkpoint folder written by the trainer"
                               : "it has " + found + "; pick one with --model_index"));
  }
  if (tensors.empty()) throw Error(source + ": holds no tensors; there is nothing to merge");

  for (const auto& [name, t] : tensors) {
    result.num_bytes += t.numel() * static_cast<int64_t>(t.element_size());
  }
  result.num_tensors = static_cast<int64_t>(tensors.size());
  fs::create_directories(out, ec);
  if (!fs::is_directory(out)) {
    throw Error(output_dir + ": cannot create the output folder (" +
                (ec ? ec.message() : std::string("a file is in the way")) +
                "); check the path and permissions");
  }
  const fs::path file =
      out / (result.lora ? std::string("adapter_tensors.safetensors") : options.output_name);
  result.output_file = file.string();
  save_safetensors(result.output_file, tensors, {{"format", "pt"}});
  for (const char* config : {"config.json", "scheduler_config.json"}) {
    if (!fs::is_regular_file(in / config, ec)) continue;
    write_file_atomic((out / config).string(), read_file((in / config).string()));
    result.copied.push_back((out / config).string());
  }
  return result;
}

}  // namespace difftrain::io
