#pragma once
// The memory model of the UNet families (unconditional/class-conditional UNets, Stable
// Diffusion 1.x/2.x, SDXL) behind `difftrain estimate-memory`: train::estimate_state_memory on
// the UNet (or its LoRA adapters) built from its config, plus the pipeline's frozen parts and
// activations measured on one forward. docs/SHARDING.md.

#include "difftrain/models/kernels/quantized_weight.h"
#include "difftrain/models/unets/unet.h"
#include "difftrain/train/memory_estimate.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace difftrain::families::unet {

/// Bytes the autograd graph of one training forward keeps alive, measured: `unet` runs once with
/// grad enabled (in train mode, under bf16 autocast when options.mixed_precision is "bf16";
/// "fp16" computes in fp32 on the CPU) on [batch_size, in_channels, R, R] noise, R =
/// options.resolution or the config's sample_size, and the live heap bytes (glibc mallinfo2:
/// uordblks + hblkhd) after it, with the output and its graph alive, minus those before it are
/// returned. A warm-up pass without grad on the same shapes first keeps one-time allocations
/// (kernel caches) out. An estimate: it counts what backward needs plus the output, not the
/// transient peak inside backward.
int64_t measure_activation_bytes(models::UNetImpl& unet,
                                 const train::MemoryEstimateOptions& options,
                                 int64_t batch_size = 1);

/// The config.json a model path names, as the trainer reads it: a pipeline folder
/// (model_index.json + unet/config.json), a UNet folder (config.json) or a config.json path.
/// Throws difftrain::Error naming the path when there is none.
std::string resolve_unet_config_path(const std::string& model_path);

/// The frozen parts besides the UNet of a pipeline folder `model_path` and their parameter
/// counts, from their configs: text_encoder, SDXL's text_encoder_2 (with projection) and vae.
/// Empty for a UNet folder or config.
std::vector<std::pair<std::string, int64_t>> pipeline_frozen_params(const std::string& model_path);

/// One frozen part of a pipeline folder: its parameters and the bytes the trainer holds them in
/// (`dense_bytes` each; a text encoder's Linear weights as `text_storage`, by the size rule).
struct FrozenPart {
  std::string name;
  int64_t params = 0;
  int64_t bytes = 0;
};
std::vector<FrozenPart> pipeline_frozen_parts(const std::string& model_path,
                                              models::WeightStorage text_storage,
                                              int64_t dense_bytes);

/// Builds the UNet of `model_path` (see resolve_unet_config_path; random weights, fp32, nothing
/// copied), adds LoRA adapters when options.lora as the trainer does (base frozen, alpha = rank),
/// and returns estimate_state_memory() with activation_bytes measured at batch 1 and scaled to
/// options.batch_size. For a pipeline folder the text encoder(s) and VAE are added to the frozen
/// parameters (pipeline_frozen_params; bf16 bytes under bf16, else fp32), and an SDXL UNet is
/// measured with its added conditioning (pooled text embedding and 6 time ids).
train::MemoryEstimate estimate_memory(const std::string& model_path,
                                      const train::MemoryEstimateOptions& options);

/// estimate_memory() for each of `strategies` (same model, one activation measurement).
std::vector<train::MemoryEstimate> estimate_memory(
    const std::string& model_path, const train::MemoryEstimateOptions& options,
    const std::vector<accel::ShardingStrategy>& strategies);

}  // namespace difftrain::families::unet
