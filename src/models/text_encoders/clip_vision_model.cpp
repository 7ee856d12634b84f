// CLIPVisionModel and CLIPImageProcessor (clip_vision_model.h), as Transformers computes them.
#include "difftrain/models/text_encoders/clip_vision_model.h"

#include "../json_fields.h"
#include "difftrain/core/error.h"
#include "difftrain/io/image.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/pretrained.h"

#include <torch/torch.h>

#include <filesystem>

namespace difftrain::models {
namespace fs = std::filesystem;

ClipVisionConfig ClipVisionConfig::load(const std::string& path) {
  const nlohmann::json root =
      detail::parse_json_file(path, "a Transformers CLIPVisionModel config.json");
  if (!root.is_object()) throw Error(path + ": a CLIPVisionModel config must be a JSON object");
  const detail::JsonFields top(root, path);
  const std::string model_type = top.string("model_type", "clip_vision_model");
  if (model_type != "clip_vision_model" && model_type != "clip") {
    top.fail("model_type", "is \"" + model_type +
                               "\"; supported: clip_vision_model, clip (is this the "
                               "image_encoder folder?)");
  }
  const bool nested = root.contains("vision_config") && !root.contains("hidden_size");
  const nlohmann::json& j = nested ? root.at("vision_config") : root;
  const detail::JsonFields r(j, nested ? path + " (vision_config)" : path);
  ClipVisionConfig c;
  c.source = path;
  c.hidden_size = r.integer_at_least("hidden_size", c.hidden_size, 1);
  c.intermediate_size = r.integer_at_least("intermediate_size", c.intermediate_size, 1);
  c.num_hidden_layers = r.integer_at_least("num_hidden_layers", c.num_hidden_layers, 2);
  c.num_attention_heads = r.integer_at_least("num_attention_heads", c.num_attention_heads, 1);
  c.num_channels = r.integer_at_least("num_channels", c.num_channels, 1);
  c.image_size = r.integer_at_least("image_size", c.image_size, 1);
  c.patch_size = r.integer_at_least("patch_size", c.patch_size, 1);
  c.hidden_act = r.choice("hidden_act", c.hidden_act, {"quick_gelu", "gelu", "gelu_new"});
  c.layer_norm_eps = r.number("layer_norm_eps", c.layer_norm_eps);
  if (c.hidden_size % c.num_attention_heads != 0) {
    r.fail("hidden_size", "must be divisible by num_attention_heads");
  }
  if (c.image_size % c.patch_size != 0) r.fail("image_size", "must be a multiple of patch_size");
  return c;
}

namespace {

ClipTextConfig layer_config(const ClipVisionConfig& v) {
  ClipTextConfig t;
  t.hidden_size = v.hidden_size;
  t.intermediate_size = v.intermediate_size;
  t.num_attention_heads = v.num_attention_heads;
  t.hidden_act = v.hidden_act;
  t.layer_norm_eps = v.layer_norm_eps;
  t.source = v.source;
  return t;
}

torch::nn::LayerNorm norm(const ClipVisionConfig& c) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden_size}).eps(c.layer_norm_eps));
}

}  // namespace

ClipVisionModelImpl::ClipVisionModelImpl(const ClipVisionConfig& c) : config_(c) {
  auto vision =
      register_module("vision_model", std::make_shared<torch::nn::Module>("CLIPVisionTransformer"));
  auto embeddings = vision->register_module(
      "embeddings", std::make_shared<torch::nn::Module>("CLIPVisionEmbeddings"));
  class_embedding_ =
      embeddings->register_parameter("class_embedding", torch::zeros({c.hidden_size}));
  patch_embedding_ = embeddings->register_module(
      "patch_embedding",
      torch::nn::Conv2d(torch::nn::Conv2dOptions(c.num_channels, c.hidden_size, c.patch_size)
                            .stride(c.patch_size)
                            .bias(false)));
  position_embedding_ = embeddings->register_module(
      "position_embedding", torch::nn::Embedding(c.num_patches() + 1, c.hidden_size));
  pre_layrnorm_ = vision->register_module("pre_layrnorm", norm(c));
  auto encoder =
      vision->register_module("encoder", std::make_shared<torch::nn::Module>("CLIPEncoder"));
  auto layers = encoder->register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    layers_.push_back(ClipEncoderLayer(layer_config(c), /*causal=*/false));
    layers->push_back(layers_.back());
  }
  post_layernorm_ = vision->register_module("post_layernorm", norm(c));
}

ClipVisionOutput ClipVisionModelImpl::forward(const torch::Tensor& pixel_values) {
  const auto& c = config_;
  if (pixel_values.dim() != 4 || pixel_values.size(1) != c.num_channels ||
      pixel_values.size(2) != c.image_size || pixel_values.size(3) != c.image_size) {
    throw Error(c10::str("CLIPVisionModel: pixel_values must be [B, ", c.num_channels, ", ",
                         c.image_size, ", ", c.image_size, "], got ", pixel_values.sizes()));
  }
  const int64_t B = pixel_values.size(0);
  const auto weight = patch_embedding_->weight;
  // [B, W, g, g] -> [B, g*g, W]; the class token first, then the positions.
  torch::Tensor patches =
      patch_embedding_(pixel_values.to(weight.scalar_type())).flatten(2).transpose(1, 2);
  torch::Tensor cls = class_embedding_.view({1, 1, -1}).expand({B, 1, c.hidden_size});
  torch::Tensor h = torch::cat({cls, patches}, 1) + position_embedding_->weight.unsqueeze(0);
  h = pre_layrnorm_(h);
  ClipVisionOutput out;
  out.hidden_states.push_back(h);
  for (auto& layer : layers_) {
    h = layer(h);
    out.hidden_states.push_back(h);
  }
  out.last_hidden_state = h;
  out.pooler_output = post_layernorm_(h.select(1, 0));
  return out;
}

ClipVisionModel load_clip_vision_model(const std::string& dir, const std::string& variant) {
  const fs::path config = fs::path(dir) / "config.json";
  std::error_code ec;
  if (!fs::is_regular_file(config, ec)) {
    throw Error(dir +
                ": no config.json; expected a Transformers CLIPVisionModel folder (the "
                "pipeline's image_encoder/)");
  }
  const std::string file =
      variant.empty() ? "model.safetensors" : "model." + variant + ".safetensors";
  const fs::path path = fs::path(dir) / file;
  if (!fs::exists(path, ec)) {
    throw Error(path.string() + ": no such file; save the image encoder as safetensors " +
                "(CLIPVisionModel.save_pretrained(dir, safe_serialization=True))");
  }
  ClipVisionModel model(ClipVisionConfig::load(config.string()));
  io::TensorMap tensors = io::load_safetensors(path.string()).tensors;
  tensors.erase("vision_model.embeddings.position_ids");
  load_weights(*model, tensors, path.string());
  return model;
}

ClipImageProcessorOptions ClipImageProcessorOptions::load(const std::string& path) {
  const nlohmann::json j =
      detail::parse_json_file(path, "a CLIPImageProcessor preprocessor_config.json");
  if (!j.is_object()) throw Error(path + ": expected a JSON object (preprocessor_config.json)");
  const detail::JsonFields r(j, path);
  ClipImageProcessorOptions o;
  if (r.has("size")) {
    const auto& s = j.at("size");
    if (s.is_number_integer()) {
      o.shortest_edge = s.get<int64_t>();
    } else if (s.is_object() && s.contains("shortest_edge")) {
      o.shortest_edge = s.at("shortest_edge").get<int64_t>();
    } else {
      r.fail("size", "must hold shortest_edge (CLIPImageProcessor resizes the shorter side)");
    }
  }
  if (r.has("crop_size")) {
    const auto& s = j.at("crop_size");
    if (s.is_number_integer()) {
      o.crop_height = o.crop_width = s.get<int64_t>();
    } else if (s.is_object() && s.contains("height") && s.contains("width")) {
      o.crop_height = s.at("height").get<int64_t>();
      o.crop_width = s.at("width").get<int64_t>();
    } else {
      r.fail("crop_size", "must be {\"height\": H, \"width\": W}");
    }
  }
  o.do_resize = r.boolean("do_resize", o.do_resize);
  o.do_center_crop = r.boolean("do_center_crop", o.do_center_crop);
  o.do_rescale = r.boolean("do_rescale", o.do_rescale);
  o.do_normalize = r.boolean("do_normalize", o.do_normalize);
  o.rescale_factor = r.number("rescale_factor", o.rescale_factor);
  if (r.has("resample") && r.integer("resample", 3) != 3) {
    r.fail("resample", "must be 3 (PIL bicubic), the value CLIP's processors use");
  }
  for (const char* key : {"image_mean", "image_std"}) {
    if (!r.has(key)) continue;
    const auto& v = j.at(key);
    if (!v.is_array() || v.size() != 3) r.fail(key, "must be 3 numbers");
    auto& dst = std::string(key) == "image_mean" ? o.image_mean : o.image_std;
    for (size_t i = 0; i < 3; ++i) dst[i] = v[i].get<double>();
  }
  if (o.shortest_edge < 1 || o.crop_height < 1 || o.crop_width < 1) {
    r.fail("size", "sizes must be >= 1");
  }
  return o;
}

torch::Tensor clip_image_pixel_values(const std::vector<torch::Tensor>& images,
                                      const ClipImageProcessorOptions& o) {
  const auto mean =
      torch::tensor({o.image_mean[0], o.image_mean[1], o.image_mean[2]}, torch::kFloat32)
          .view({3, 1, 1});
  const auto std_ = torch::tensor({o.image_std[0], o.image_std[1], o.image_std[2]}, torch::kFloat32)
                        .view({3, 1, 1});
  std::vector<torch::Tensor> out;
  for (const auto& image : images) {
    if (image.dim() != 3 || image.size(2) != 3 || image.scalar_type() != torch::kUInt8) {
      throw Error("CLIP image processor: expected uint8 RGB images [H, W, 3]");
    }
    torch::Tensor x = image;
    if (o.do_resize) {
      const int64_t h = x.size(0), w = x.size(1);
      const int64_t shortest = std::min(h, w), longest = std::max(h, w);
      const auto other =
          static_cast<int64_t>(static_cast<double>(o.shortest_edge) * static_cast<double>(longest) /
                               static_cast<double>(shortest));
      const int64_t nh = h <= w ? o.shortest_edge : other, nw = h <= w ? other : o.shortest_edge;
      if (nh != h || nw != w) x = io::resize_image(x.contiguous(), nh, nw, io::Resample::kBicubic);
    }
    if (o.do_center_crop) {
      if (x.size(0) < o.crop_height || x.size(1) < o.crop_width) {
        throw Error(
            "CLIP image processor: the image is smaller than the crop after resizing; "
            "check size and crop_size in preprocessor_config.json");
      }
      const int64_t top = (x.size(0) - o.crop_height) / 2, left = (x.size(1) - o.crop_width) / 2;
      x = x.narrow(0, top, o.crop_height).narrow(1, left, o.crop_width);
    }
    // rescale: float64 x factor then float32; normalize in float32.
    torch::Tensor f = x.permute({2, 0, 1}).to(torch::kFloat64);
    if (o.do_rescale) f = f * o.rescale_factor;
    f = f.to(torch::kFloat32);
    if (o.do_normalize) f = (f - mean) / std_;
    out.push_back(f.contiguous());
  }
  return torch::stack(out);
}

}  // namespace difftrain::models
