#pragma once
// Loading and saving models in Diffusers' folder layout: `config.json` beside
// `diffusion_pytorch_model.safetensors` (what `save_pretrained` writes and `from_pretrained`
// reads), with strict, named checks of every key and shape.

#include "difftrain/io/safetensors.h"
#include "difftrain/models/unets/unet.h"

#include <torch/nn/module.h>

#include <string>

namespace difftrain::models {

/// Every parameter and buffer of `module` by its dotted name (Diffusers' `state_dict()` keys),
/// sharing memory with the module.
io::TensorMap named_tensors(const torch::nn::Module& module);

/// Copies `weights` into `module`'s parameters and buffers by name, converting dtype. Strict, as
/// Diffusers' from_pretrained: missing keys, unexpected keys and shape mismatches are all listed
/// (the first few of each, by name) in one difftrain::Error that names `source`; nothing is
/// changed when any check fails.
void load_weights(torch::nn::Module& module, const io::TensorMap& weights,
                  const std::string& source);

/// The weights file of a Diffusers model folder: `diffusion_pytorch_model.safetensors`, or with
/// `variant` ("fp16"...) `diffusion_pytorch_model.<variant>.safetensors`. A folder holding only
/// pickle weights (.bin) or nothing gets an error that says what to do.
std::string weights_path(const std::string& dir, const std::string& variant = "");

/// The config.json of the Diffusers model folder `dir`; throws difftrain::Error naming what is
/// missing (`what` says what the folder should be, e.g. "a Diffusers
/// QwenImageTransformer2DModel folder (config.json + diffusion_pytorch_model*.safetensors)").
std::string model_folder_config(const std::string& dir, const std::string& what);

/// Loads the `prefix`*.safetensors of `dir` (one file or an index of shards, `variant`'s) into
/// `model`, read in `dtype`.
void load_model_folder_weights(torch::nn::Module& model, const std::string& dir, torch::Dtype dtype,
                               const std::string& variant,
                               const std::string& prefix = "diffusion_pytorch_model");

/// Builds the UNet from `dir`/config.json and loads `dir`'s weights (see weights_path and
/// load_weights), on the CPU in float32. Diffusers: `UNet2DModel.from_pretrained(dir)` /
/// `UNet2DConditionModel.from_pretrained(dir)`.
UNet load_unet(const std::string& dir, const std::string& variant = "");

/// Writes `dir`/config.json and `dir`/diffusion_pytorch_model.safetensors (float32 or the
/// model's dtype), each atomically, so Diffusers' from_pretrained(dir) loads it. With `variant`
/// ("fp16"...) the weights go to diffusion_pytorch_model.<variant>.safetensors, as
/// `save_pretrained(dir, variant=...)` names them (see weights_path).
void save_unet(UNetImpl& unet, const std::string& dir, const std::string& variant = "");

}  // namespace difftrain::models
