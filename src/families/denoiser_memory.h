#pragma once
// The state side of `difftrain estimate-memory` for a denoiser too large to build (FLUX.1's 12 B,
// Z-Image's 6 B transformers): its parameters listed block by block (from the config, or from
// depth-reduced copies at the real width), cut into the units FSDP's transformer-based wrap makes,
// LoRA adapters counted on the targets by suffix, the frozen base's bytes by the trainer's 8-bit
// size rule. Private to src/families; each family lists its blocks and measures its activations.
#include "difftrain/accel/sharding.h"
#include "difftrain/train/memory_estimate.h"

#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace difftrain::families {

/// One parameter of a denoiser: its full name, elements, and for a Linear weight its sizes.
struct DenoiserParam {
  std::string name;
  int64_t numel = 0;
  int64_t in = 0, out = 0;  ///< a Linear weight's fan-in and fan-out (0: not a Linear weight)
  /// Float32 whatever the run's precision (a model's `_keep_in_fp32_modules`: Wan's norms and
  /// scale/shift tables).
  bool fp32 = false;
};

/// The parameters by unit: each block by its module path, the rest under "" (the root unit).
using DenoiserBlocks = std::vector<std::pair<std::string, std::vector<DenoiserParam>>>;

/// The denoiser's config.json behind `model_path`: a pipeline folder's transformer/config.json,
/// a model folder's config.json, or the file itself; `kinds` names what to pass in the message
/// ("a FluxPipeline folder, a FluxTransformer2DModel folder or its config.json"). *pipeline says
/// whether `model_path` is a pipeline folder.
std::string denoiser_config_path(const std::string& model_path, const std::string& kinds,
                                 bool* pipeline);

/// `m`'s parameters whose names start with `prefix` ("" = those `in_block` says belong to no
/// block), named as `rename` makes them; 2-D `.weight`s are Linear weights unless their name
/// contains one of `not_linear` (embeddings, pad tokens).
std::vector<DenoiserParam> denoiser_params(
    const torch::nn::Module& m, const std::string& prefix,
    const std::function<bool(const std::string&)>& in_block,
    const std::function<std::string(const std::string&)>& rename,
    const std::vector<std::string>& not_linear = {});

/// What training the listed denoiser holds, before the per-strategy accounting.
struct DenoiserState {
  std::vector<accel::UnitPlan> units;  ///< what trains, by unit (one under NO_WRAP)
  std::vector<int64_t> numels;         ///< every trainable tensor's elements
  int64_t params = 0;                  ///< the denoiser's parameters
  int64_t frozen = 0;                  ///< frozen parameters (the base under LoRA)
  int64_t frozen_bytes = 0;            ///< their bytes (bf16 under bf16; 8-bit Linear weights)
};

/// The state of training `blocks`: the whole denoiser, or with options.lora adapters A [r, in] and
/// B [out, r] on each Linear weight whose module ends with one of options.lora_target_modules
/// (empty: `default_targets`); `block_class(name)` names a block unit's wrap class.
DenoiserState denoiser_state(const DenoiserBlocks& blocks,
                             const train::MemoryEstimateOptions& options,
                             const std::vector<std::string>& default_targets,
                             const std::function<std::string(const std::string&)>& block_class);

/// Block swap (--blocks_to_swap, models/block_swap.h) in `estimates`: the frozen bytes of the
/// blocks `swapped` names (module paths in `blocks`, in forward order), counted as
/// denoiser_state() counts the base, go to host memory, and the device saves them minus the
/// staging of the largest two consecutive ones (models::block_swap_staging_bytes).
void add_block_swap(const DenoiserBlocks& blocks, const std::vector<std::string>& swapped,
                    const train::MemoryEstimateOptions& options,
                    std::vector<train::MemoryEstimate>& estimates);

/// add_block_swap() of a one-stack transformer: the last options.blocks_to_swap of its `count`
/// blocks `<prefix><i>` (models::last_blocks_swapped, which refuses too many); nothing when 0.
void add_last_blocks_swap(const DenoiserBlocks& blocks, const std::string& prefix, int64_t count,
                          const train::MemoryEstimateOptions& options,
                          std::vector<train::MemoryEstimate>& estimates);

}  // namespace difftrain::families
