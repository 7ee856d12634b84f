#pragma once
// Model weights as Diffusers and Transformers save them: one `<stem>.safetensors`, or, above
// save_pretrained's max_shard_size (FLUX.1's 12 B transformer, T5-XXL), several shard files and
// an index `<stem>.safetensors.index.json` whose "weight_map" names each tensor's file:
//   {"metadata": {"total_size": ...}, "weight_map": {"<tensor>":
//   "<stem>-00001-of-00003.safetensors"}}
// With a variant ("fp16", "bf16") the single file is `<stem>.<variant>.safetensors` and the
// index `<stem>.safetensors.index.<variant>.json` (Diffusers' and Transformers' _add_variant).

#include "difftrain/io/safetensors.h"

#include <torch/types.h>

#include <optional>
#include <string>
#include <vector>

namespace difftrain::io {

/// Where a model folder's weights are.
struct WeightFiles {
  /// The index file, "" for a single file.
  std::string index;
  /// The safetensors files to read (absolute or relative to the caller's folder, as given), in
  /// order; one for an unsharded model.
  std::vector<std::string> files;
};

/// The weight files of `dir` for `stem` ("diffusion_pytorch_model", "model") and `variant` (""
/// = none): the single file when it exists, else the index (also accepted as
/// `<stem>.<variant>.safetensors.index.json`) and the files its weight_map names. Throws
/// difftrain::Error naming the folder when neither exists (and saying what to do when only
/// pickle weights are there), the index is not valid JSON, has no "weight_map" object, or names
/// a file that is missing.
WeightFiles find_weight_files(const std::string& dir, const std::string& stem,
                              const std::string& variant = "");

/// Every tensor of `files` in one map, each floating tensor converted to `dtype` when given, file
/// by file (a file's mapping is released before the next one is read, so a sharded model never
/// needs all its files mapped plus a converted copy at once). With an index, each tensor must be
/// in the file the weight_map names, and every weight_map entry must be found. Throws
/// difftrain::Error naming the file and tensor on a mismatch or a tensor in two files.
TensorMap load_weight_files(const WeightFiles& files,
                            std::optional<torch::Dtype> dtype = std::nullopt);

}  // namespace difftrain::io
