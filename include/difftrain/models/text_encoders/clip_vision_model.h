#pragma once
// Transformers' CLIPVisionModel (modeling_clip.py) and CLIPImageProcessor: the image encoder of
// Wan 2.1's image-to-video folders (open-clip ViT-H/14 saved as a CLIPVisionModel), whose
// pipeline takes the penultimate layer's hidden states as the image context. Keys as Transformers
// saves them (vision_model.embeddings.*, vision_model.pre_layrnorm, vision_model.encoder.layers.N,
// vision_model.post_layernorm).
#include "difftrain/models/text_encoders/clip_text_model.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace difftrain::models {

/// The fields of Transformers' CLIPVisionConfig a forward needs.
struct ClipVisionConfig {
  int64_t hidden_size = 768;
  int64_t intermediate_size = 3072;
  int64_t num_hidden_layers = 12;
  int64_t num_attention_heads = 12;
  int64_t num_channels = 3;
  int64_t image_size = 224;
  int64_t patch_size = 32;
  std::string hidden_act = "quick_gelu";  ///< quick_gelu | gelu | gelu_new
  double layer_norm_eps = 1e-5;
  std::string source;
  int64_t num_patches() const { return (image_size / patch_size) * (image_size / patch_size); }
  /// A config.json of a CLIPVisionModel (model_type clip_vision_model) or a CLIPModel's
  /// vision_config. Throws a one-line difftrain::Error naming the file and field.
  static ClipVisionConfig load(const std::string& path);
};

/// What the vision tower returns.
struct ClipVisionOutput {
  torch::Tensor last_hidden_state;  ///< [B, 1 + patches, W], the last layer's output
  torch::Tensor pooler_output;      ///< [B, W], post_layernorm of the class token
  /// num_hidden_layers + 1 entries: the embeddings after pre_layrnorm, then each layer's output
  /// (Wan 2.1's pipeline takes hidden_states[-2]).
  std::vector<torch::Tensor> hidden_states;
};

class ClipVisionModelImpl : public torch::nn::Module {
 public:
  explicit ClipVisionModelImpl(const ClipVisionConfig& config);
  /// pixel_values [B, 3, image_size, image_size] (CLIPImageProcessor's output).
  ClipVisionOutput forward(const torch::Tensor& pixel_values);
  const ClipVisionConfig& config() const { return config_; }

 private:
  ClipVisionConfig config_;
  torch::Tensor class_embedding_;
  torch::nn::Conv2d patch_embedding_{nullptr};
  torch::nn::Embedding position_embedding_{nullptr};
  torch::nn::LayerNorm pre_layrnorm_{nullptr}, post_layernorm_{nullptr};
  std::vector<ClipEncoderLayer> layers_;
};
TORCH_MODULE(ClipVisionModel);

/// Builds the model from `dir`/config.json and loads `dir`/model.safetensors (or
/// model.<variant>.safetensors) by name, float32 on the CPU (a position_ids buffer is ignored).
ClipVisionModel load_clip_vision_model(const std::string& dir, const std::string& variant = "");

/// CLIPImageProcessor's options (preprocessor_config.json).
struct ClipImageProcessorOptions {
  int64_t shortest_edge = 224;  ///< size.shortest_edge (resize)
  int64_t crop_height = 224, crop_width = 224;
  bool do_resize = true, do_center_crop = true, do_rescale = true, do_normalize = true;
  double rescale_factor = 1.0 / 255.0;
  std::array<double, 3> image_mean = {0.48145466, 0.4578275, 0.40821073};
  std::array<double, 3> image_std = {0.26862954, 0.26130258, 0.27577711};
  static ClipImageProcessorOptions load(const std::string& path);
};

/// CLIPImageProcessor (the PIL path) on uint8 RGB images [H, W, 3]: the shorter side resized to
/// shortest_edge (the longer int(edge * long / short)) with PIL bicubic, a centre crop (offsets
/// (size - crop) // 2), x * rescale_factor, (x - mean) / std in float32: [N, 3, crop_h, crop_w].
torch::Tensor clip_image_pixel_values(const std::vector<torch::Tensor>& images,
                                      const ClipImageProcessorOptions& options = {});

}  // namespace difftrain::models
