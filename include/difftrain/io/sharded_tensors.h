#pragma once
// Sharded tensor checkpoints (ZeRO/FSDP): every rank owns a contiguous range of elements of each
// flattened (row-major) tensor and writes its pieces to its own safetensors file, in parallel;
// one index names the whole tensors and where their pieces are. A reader assembles whole tensors
// (consolidation, Accelerate's `merge_fsdp_weights`) or any element range of them (resuming with
// a different number of ranks).
//
// On disk, in one folder:
//   <stem>-00001-of-0000N.safetensors ... <stem>-0000N-of-0000N.safetensors   (one per rank)
//   <stem>.index.json
// A shard file holds each of its pieces 1-D under the tensor's own name; its __metadata__ is
// {"format": "difftrain-sharded", "<name>": "begin:end", ...}. The index is
//   {"format": "difftrain-sharded", "version": 1, "num_shards": N, "metadata": {...},
//    "tensors": {"<name>": {"shape": [..], "dtype": "F32",
//                           "pieces": [{"file": "...", "begin": b, "end": e}, ...]}},
//    "weight_map": {"<name>": "<file of its first piece>"}}
// where "weight_map" is the key Transformers' and Diffusers' sharded index files use.

#include "difftrain/io/safetensors.h"

#include <torch/types.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace difftrain::io {

/// A rank's piece of a flattened tensor: elements [begin, end) of `name` (row-major flattening).
/// `data` holds end - begin elements (stored 1-D; any shape with that many elements is accepted).
struct TensorPiece {
  std::string name;
  int64_t begin = 0;
  int64_t end = 0;
  torch::Tensor data;
};

/// Shape and dtype of a whole tensor, plus the pieces that make it, for the index. The pieces
/// must cover [0, numel) exactly, each element once; their order does not matter.
struct ShardedTensorInfo {
  std::vector<int64_t> shape;
  torch::Dtype dtype = torch::kFloat32;
  struct Piece {
    std::string file;  ///< shard file name inside the checkpoint folder (no folder part)
    int64_t begin = 0;
    int64_t end = 0;
  };
  std::vector<Piece> pieces;
};

/// File name of rank r's shard: "<stem>-<r+1 as 5 digits>-of-<world as 5 digits>.safetensors",
/// e.g. shard_file_name("model", 0, 2) == "model-00001-of-00002.safetensors" (Diffusers' and
/// Transformers' sharded naming). Requires 0 <= rank < world <= 99999.
std::string shard_file_name(const std::string& stem, int rank, int world);

/// Writes rank's pieces to <dir>/shard_file_name(stem, rank, world) atomically (temporary file +
/// rename; the folder is created). At most one piece per tensor; a rank may have no piece of a
/// tensor, or no pieces at all (an empty shard file). The tensor name "format" is reserved.
void write_tensor_shard(const std::string& dir, const std::string& stem, int rank, int world,
                        const std::vector<TensorPiece>& pieces);

/// Writes <dir>/<stem>.index.json atomically (layout above). `extra_metadata` (a JSON object, or
/// null for none) is stored under "metadata", e.g. {"lora": true}. Each tensor's pieces are
/// checked to cover it exactly before anything is written.
void write_shard_index(const std::string& dir, const std::string& stem, int world,
                       const std::map<std::string, ShardedTensorInfo>& tensors,
                       const nlohmann::json& extra_metadata = {});

/// Reads a sharded checkpoint through its index. The constructor validates the whole index: its
/// format and version, every shape and dtype, that each tensor's pieces cover [0, numel) with no
/// gap and no overlap, and that every shard file exists. Shard files are loaded lazily (memory
/// mapped) on first use and cached; each piece is checked against the file (key present, dtype
/// and element count as indexed) before any memory is allocated for it. Problems throw a one-line
/// difftrain::Error naming the file and the tensor. Safe to use from several threads.
class ShardedTensorReader {
 public:
  /// Reads and validates <dir>/<stem>.index.json.
  ShardedTensorReader(std::string dir, std::string stem);

  /// Names of all tensors, sorted.
  std::vector<std::string> names() const;
  /// Shape, dtype and pieces of `name`; throws naming the tensor when there is none.
  const ShardedTensorInfo& info(const std::string& name) const;
  bool has(const std::string& name) const;
  /// The world size the checkpoint was written with.
  int num_shards() const;
  /// The index's "metadata" object ({} when it has none).
  const nlohmann::json& metadata() const;
  /// Path of the index file.
  const std::string& index_path() const { return index_path_; }

  /// The whole tensor, shaped as indexed: [shape...], dtype as indexed.
  torch::Tensor read(const std::string& name) const;
  /// Elements [begin, end) of the flattened tensor, 1-D [end - begin], assembled from whichever
  /// pieces overlap the range. Requires 0 <= begin <= end <= numel.
  torch::Tensor read_range(const std::string& name, int64_t begin, int64_t end) const;
  /// Every tensor, whole (for merge-weights).
  TensorMap read_all() const;

 private:
  // The checked piece `p` of `name`, 1-D, a view of the (cached) shard file.
  torch::Tensor piece_data(const std::string& name, const ShardedTensorInfo& info,
                           const ShardedTensorInfo::Piece& p) const;
  std::shared_ptr<const Safetensors> shard(const std::string& file,
                                           const std::string& tensor) const;

  std::string dir_, stem_, index_path_;
  int num_shards_ = 0;
  nlohmann::json metadata_;
  std::map<std::string, ShardedTensorInfo> tensors_;
  mutable std::mutex mutex_;
  mutable std::map<std::string, std::shared_ptr<const Safetensors>> files_;
};

/// True when <dir>/<stem>.index.json exists.
bool has_sharded_tensors(const std::string& dir, const std::string& stem);

/// Options of merge_weights().
struct MergeWeightsOptions {
  /// Which prepared model of the checkpoint: stem "model" for 0, "model_<i>" otherwise.
  int model_index = 0;
  /// File written into the output folder (LoRA state goes to adapter_tensors.safetensors).
  std::string output_name = "diffusion_pytorch_model.safetensors";
};

/// What merge_weights() wrote.
struct MergeWeightsResult {
  std::string output_file;
  int64_t num_tensors = 0;
  int64_t num_bytes = 0;  ///< tensor data bytes written
  bool lora = false;      ///< the index metadata said "lora": true
  bool sharded = false;   ///< the input was <stem>.index.json + shards (else <stem>.safetensors)
  std::vector<std::string> copied;  ///< config files copied beside the weights
};

/// Consolidates a model of a checkpoint folder into one safetensors file (Accelerate's
/// `merge_fsdp_weights` / `accelerate merge-weights`). The input is <stem>.index.json with its
/// shards or an unsharded <stem>.safetensors; every tensor is written whole, names and dtypes
/// unchanged, atomically, into `output_dir` (created if missing; never `checkpoint_dir` itself),
/// and config.json and scheduler_config.json are copied when the checkpoint has them, so the
/// output is a Diffusers UNet folder. With index metadata "lora": true the tensors are LoRA
/// adapter state and go to adapter_tensors.safetensors instead.
MergeWeightsResult merge_weights(const std::string& checkpoint_dir, const std::string& output_dir,
                                 const MergeWeightsOptions& options = {});

}  // namespace difftrain::io
