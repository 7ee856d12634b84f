#pragma once
// Qwen2.5-VL's vision side, as Transformers computes it (modeling_qwen2_5_vl.py,
// image_processing_qwen2_vl.py): the image processor that turns an RGB image into flattened
// patches, the vision transformer (`visual.*`: a Conv3d patch embedding over temporal x 14 x 14
// patches, blocks of window attention with full attention at the config's indexes, 2-D rotary
// positions, and the patch merger that folds 2 x 2 patches into one language-model token), and
// the multimodal rotary position ids of a prompt with images (get_rope_index). Qwen-Image's Edit
// pipelines encode their instruction with the reference images this way.

#include "difftrain/io/safetensors.h"
#include "difftrain/models/linear.h"
#include "difftrain/models/text_encoders/qwen3_model.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace difftrain::models {

/// A Qwen2.5-VL config.json's vision_config (and the token ids at its top level).
struct Qwen2_5VisionOptions {
  TORCH_ARG(int64_t, depth) = 32;
  TORCH_ARG(int64_t, hidden_size) = 1280;
  TORCH_ARG(int64_t, num_heads) = 16;
  TORCH_ARG(int64_t, intermediate_size) = 3420;
  /// The language model's width (the merger's output).
  TORCH_ARG(int64_t, out_hidden_size) = 3584;
  TORCH_ARG(int64_t, in_channels) = 3;
  TORCH_ARG(int64_t, patch_size) = 14;
  TORCH_ARG(int64_t, spatial_merge_size) = 2;
  TORCH_ARG(int64_t, temporal_patch_size) = 2;
  /// Window attention's side in pixels (window_size / merge / patch merged tokens per side).
  TORCH_ARG(int64_t, window_size) = 112;
  TORCH_ARG(std::vector<int64_t>, fullatt_block_indexes) = {7, 15, 23, 31};
  TORCH_ARG(int64_t, image_token_id) = 151655;
  TORCH_ARG(int64_t, vision_start_token_id) = 151652;

 public:
  /// Reads `path`'s vision_config and token ids; errors name the file and the field (no
  /// vision_config, non-positive sizes, heads not dividing the width, a hidden_act other than
  /// silu, window_size not a multiple of merge x patch).
  static Qwen2_5VisionOptions load(const std::string& path);
};

/// The image processor's settings (Qwen2VLImageProcessor; a processor folder's
/// preprocessor_config.json, Qwen-Image-Edit's processor/).
struct Qwen2VLImageProcessorOptions {
  int64_t min_pixels = 56 * 56;
  int64_t max_pixels = 12845056;  // Qwen2.5-VL-7B-Instruct's (and Qwen-Image-Edit's processor/)
  int64_t patch_size = 14;
  int64_t merge_size = 2;
  int64_t temporal_patch_size = 2;
  std::array<double, 3> image_mean = {0.48145466, 0.4578275, 0.40821073};
  std::array<double, 3> image_std = {0.26862954, 0.26130258, 0.27577711};
  /// Reads preprocessor_config.json (min_pixels / max_pixels or size.shortest_edge /
  /// longest_edge, patch_size, merge_size, temporal_patch_size, image_mean, image_std).
  static Qwen2VLImageProcessorOptions load(const std::string& path);
};

/// smart_resize: {height, width} rounded (half to even) to multiples of `factor`, then scaled
/// down (floor) or up (ceil) to fit [min_pixels, max_pixels] with the aspect ratio kept. Throws
/// difftrain::Error for an aspect ratio beyond 200 or a side below 1.
std::array<int64_t, 2> qwen2_vl_smart_resize(int64_t height, int64_t width, int64_t factor,
                                             int64_t min_pixels, int64_t max_pixels);

/// What the processor makes of images.
struct Qwen2VLImagePatches {
  torch::Tensor pixel_values;    ///< float32 [sum of t*h*w, C * temporal * patch * patch]
  torch::Tensor image_grid_thw;  ///< int64 [images, 3]: frames / temporal, rows, columns
};

/// Qwen2VLImageProcessor (the PIL path) on uint8 RGB images [H, W, 3]: smart_resize to multiples
/// of patch x merge (PIL bicubic when the size changes), x / 255, (x - mean) / std in float32, the
/// frame repeated to temporal_patch_size, patches flattened in merge-block order.
Qwen2VLImagePatches qwen2_vl_image_patches(const std::vector<torch::Tensor>& images,
                                           const Qwen2VLImageProcessorOptions& o = {});

class Qwen2_5VisionBlockImpl : public torch::nn::Module {
 public:
  explicit Qwen2_5VisionBlockImpl(const Qwen2_5VisionOptions& o);
  /// x [N, hidden]; cos, sin [N, head_dim]; bounds: segment starts and ends (cu_seqlens).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const std::vector<int64_t>& bounds);

 private:
  int64_t heads_;
  Qwen3RMSNorm norm1_{nullptr}, norm2_{nullptr};
  Linear qkv_{nullptr}, proj_{nullptr};
  Linear gate_proj_{nullptr}, up_proj_{nullptr}, down_proj_{nullptr};
};
TORCH_MODULE(Qwen2_5VisionBlock);

/// Transformers' Qwen2_5_VisionTransformerPretrainedModel (`patch_embed.proj`, `blocks.{i}`,
/// `merger.ln_q`, `merger.mlp.{0,2}`).
class Qwen2_5VisionTransformerImpl : public torch::nn::Module {
 public:
  explicit Qwen2_5VisionTransformerImpl(const Qwen2_5VisionOptions& options);
  /// pixel_values [N, C * temporal * patch²] (the processor's), image_grid_thw int64 [I, 3] ->
  /// the image tokens' embeddings [N / merge², out_hidden_size], images one after the other.
  torch::Tensor forward(const torch::Tensor& pixel_values, const torch::Tensor& image_grid_thw);
  const Qwen2_5VisionOptions& options() const { return options_; }

 private:
  Qwen2_5VisionOptions options_;
  torch::Tensor patch_weight_;
  std::vector<Qwen2_5VisionBlock> blocks_;
  Qwen3RMSNorm ln_q_{nullptr};
  Linear mlp0_{nullptr}, mlp2_{nullptr};
};
TORCH_MODULE(Qwen2_5VisionTransformer);

/// get_rope_index of Qwen2.5-VL for images: per row (its real tokens, attention_mask 1), text
/// positions count on; each run of image_token_id tokens (one image, in order across the batch)
/// gets (st, st + row, st + column) over its merged grid, and the text after it continues from
/// the block's largest + 1. Padding positions are 1. -> int64 [3, B, S].
torch::Tensor qwen2_5_vl_rope_index(const torch::Tensor& input_ids,
                                    const torch::Tensor& attention_mask,
                                    const torch::Tensor& image_grid_thw,
                                    const Qwen2_5VisionOptions& o);

/// Qwen2_5_VLModel.forward with images: the token embeddings, the image tokens' replaced by the
/// vision tower's output in order, 3-D positions from qwen2_5_vl_rope_index, then the language
/// model -> its hidden states (Qwen3Model::forward's).
Qwen3Output qwen2_5_vl_forward(Qwen3Model& language_model, Qwen2_5VisionTransformer& visual,
                               const torch::Tensor& input_ids, const torch::Tensor& attention_mask,
                               const torch::Tensor& pixel_values,
                               const torch::Tensor& image_grid_thw);

/// The vision tower of a Qwen2.5-VL folder from its config.json (`config_path`) and the
/// `visual.*` tensors of its weights with that prefix dropped (load_qwen3_model's `visual`),
/// loaded strictly by name (`source` names the files in errors), in `dtype` on the CPU.
Qwen2_5VisionTransformer make_qwen2_5_vl_vision(const std::string& config_path,
                                                const io::TensorMap& weights,
                                                const std::string& source,
                                                torch::Dtype dtype = torch::kFloat32);

}  // namespace difftrain::models
