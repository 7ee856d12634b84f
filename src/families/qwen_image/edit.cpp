// Qwen-Image-Edit's inputs (edit.h), as pipeline_qwenimage_edit.py and
// pipeline_qwenimage_edit_plus.py prepare them.

#include "edit.h"

#include "difftrain/core/error.h"
#include "difftrain/io/image.h"
#include "difftrain/models/module_info.h"
#include "qwen_image_pipeline.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <cmath>

namespace difftrain::families::qwen_image {

const char* const kQwenImageEditTemplate =
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, "
    "texture, objects, background), then explain how the user's text instruction should alter or "
    "modify the image. Generate a new image that meets the user's requirements while maintaining "
    "consistency with the original input where appropriate.<|im_end|>\n<|im_start|>user\n"
    "<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n";
const char* const kQwenImageEditPlusTemplate =
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, "
    "texture, objects, background), then explain how the user's text instruction should alter or "
    "modify the image. Generate a new image that meets the user's requirements while maintaining "
    "consistency with the original input where appropriate.<|im_end|>\n<|im_start|>user\n"
    "{}<|im_end|>\n<|im_start|>assistant\n";

namespace {

constexpr double kVaeImageArea = 1024.0 * 1024.0;
constexpr double kConditionImageArea = 384.0 * 384.0;

std::string edit_template_fill(const std::string& format, const std::string& value) {
  const size_t at = format.find("{}");
  return format.substr(0, at) + value + format.substr(at + 2);
}

// VaeImageProcessor.preprocess of a PIL image already at its size: x / 255 in float32, 2x - 1.
torch::Tensor to_vae_pixels(const torch::Tensor& image) {
  const auto x = image.permute({2, 0, 1}).to(torch::kFloat32) / 255.0F;
  return (2.0F * x - 1.0F).unsqueeze(0).unsqueeze(2).contiguous();
}

}  // namespace

EditKind edit_kind_of(const std::string& pipeline_class, const std::string& where) {
  if (pipeline_class == "QwenImagePipeline" || pipeline_class.empty()) return EditKind::kNone;
  if (pipeline_class == "QwenImageEditPipeline") return EditKind::kEdit;
  if (pipeline_class == "QwenImageEditPlusPipeline") return EditKind::kEditPlus;
  throw Error(where + " is \"" + pipeline_class +
              "\"; the Qwen-Image family runs QwenImagePipeline, QwenImageEditPipeline and "
              "QwenImageEditPlusPipeline");
}

std::string pipeline_class_of(EditKind kind) {
  switch (kind) {
    case EditKind::kEdit: return "QwenImageEditPipeline";
    case EditKind::kEditPlus: return "QwenImageEditPlusPipeline";
    case EditKind::kNone: break;
  }
  return "QwenImagePipeline";
}

std::array<int64_t, 2> qwen_calculate_dimensions(double target_area, double ratio) {
  const double width = std::sqrt(target_area * ratio);
  const double height = width / ratio;
  return {static_cast<int64_t>(std::nearbyint(width / 32)) * 32,
          static_cast<int64_t>(std::nearbyint(height / 32)) * 32};
}

EditImages prepare_edit_images(const std::vector<torch::Tensor>& images, EditKind kind) {
  if (images.empty()) {
    throw Error(pipeline_class_of(kind) + " needs a reference image (--image FILE)");
  }
  if (kind == EditKind::kEdit && images.size() > 1) {
    throw Error(
        fmt::format("QwenImageEditPipeline takes one reference image, got {}; several images are "
                    "QwenImageEditPlusPipeline's (Qwen-Image-Edit-2509 and later: --pipeline "
                    "QwenImageEditPlusPipeline)",
                    images.size()));
  }
  EditImages out;
  for (const auto& image : images) {
    if (image.dim() != 3 || image.size(2) != 3 || image.scalar_type() != torch::kUInt8) {
      throw Error("Qwen-Image-Edit: a reference image must be uint8 RGB [H, W, 3]");
    }
    const double ratio =
        static_cast<double>(image.size(1)) / static_cast<double>(image.size(0));  // w / h
    const auto [vw, vh] = qwen_calculate_dimensions(kVaeImageArea, ratio);
    if (vw < 32 || vh < 32) {
      throw Error(fmt::format(
          "Qwen-Image-Edit: a reference image of {}x{} is too elongated for the pipelines' "
          "1024x1024-pixel rule (it would be {}x{}); crop it",
          image.size(1), image.size(0), vw, vh));
    }
    const torch::Tensor vae_image = io::resize_image(image, vh, vw, io::Resample::kLanczos);
    if (kind == EditKind::kEditPlus) {
      const auto [cw, ch] = qwen_calculate_dimensions(kConditionImageArea, ratio);
      if (cw < 32 || ch < 32) {
        throw Error(fmt::format(
            "Qwen-Image-Edit: a reference image of {}x{} is too elongated (its 384x384-pixel "
            "condition size would be {}x{}); crop it",
            image.size(1), image.size(0), cw, ch));
      }
      out.condition.push_back(io::resize_image(image, ch, cw, io::Resample::kLanczos));
    } else {
      out.condition.push_back(vae_image);
    }
    out.vae_pixels.push_back(to_vae_pixels(vae_image));
    out.height = vh;
    out.width = vw;
  }
  return out;
}

std::pair<torch::Tensor, torch::Tensor> encode_edit_prompts(
    const diffusion::Qwen3TextEncoder& encoder, models::Qwen2_5VisionTransformer& visual,
    const models::Qwen2VLImageProcessorOptions& processor, const std::vector<std::string>& prompts,
    const std::vector<torch::Tensor>& condition, EditKind kind) {
  models::Qwen3Model model = encoder.model();
  if (model.is_empty() || visual.is_empty()) {
    throw Error("Qwen-Image-Edit: the text encoder or its vision tower is not loaded");
  }
  const models::Qwen2VLImagePatches patches = models::qwen2_vl_image_patches(condition, processor);
  const auto grid = patches.image_grid_thw;
  const int64_t merge = processor.merge_size * processor.merge_size;
  std::string images_text;
  for (size_t i = 0; i < condition.size(); ++i) {
    images_text += fmt::format("Picture {}: <|vision_start|><|image_pad|><|vision_end|>", i + 1);
  }
  // The processor's expansion: the i-th <|image_pad|> becomes image i's merged patch count.
  auto expand = [&](std::string text) {
    std::string out;
    size_t from = 0;
    int64_t image = 0;
    const std::string pad = "<|image_pad|>";
    for (size_t at = text.find(pad); at != std::string::npos; at = text.find(pad, from)) {
      out += text.substr(from, at - from);
      if (image >= grid.size(0)) {
        throw Error("Qwen-Image-Edit: the prompt names more images than were given");
      }
      const int64_t n = grid[image].prod().item<int64_t>() / merge;
      for (int64_t j = 0; j < n; ++j) out += pad;
      ++image;
      from = at + pad.size();
    }
    return out + text.substr(from);
  };
  const torch::Device device = models::module_device(*model);
  std::vector<torch::Tensor> rows;
  int64_t longest = 0;
  for (const auto& prompt : prompts) {
    const std::string text =
        kind == EditKind::kEditPlus
            ? edit_template_fill(kQwenImageEditPlusTemplate, images_text + prompt)
            : edit_template_fill(kQwenImageEditTemplate, prompt);
    const std::vector<int64_t> ids = encoder.tokenizer().encode(expand(text));
    const auto input_ids =
        torch::tensor(ids, torch::kInt64).view({1, static_cast<int64_t>(ids.size())});
    const auto mask = torch::ones_like(input_ids);
    const models::Qwen3Output o = models::qwen2_5_vl_forward(
        model, visual, input_ids.to(device), mask.to(device), patches.pixel_values, grid);
    const torch::Tensor hidden = o.hidden_states.back()[0];
    if (hidden.size(0) <= kQwenImageEditTemplateDrop) {
      throw Error("Qwen-Image-Edit: the prompt is shorter than the template's dropped tokens");
    }
    rows.push_back(
        hidden.narrow(0, kQwenImageEditTemplateDrop, hidden.size(0) - kQwenImageEditTemplateDrop)
            .to(torch::kCPU, torch::kFloat32));
    longest = std::max(longest, rows.back().size(0));
  }
  std::vector<torch::Tensor> masks;
  for (auto& r : rows) {
    const int64_t n = r.size(0);
    masks.push_back(
        torch::cat({torch::ones({n}, torch::kInt64), torch::zeros({longest - n}, torch::kInt64)}));
    r = torch::constant_pad_nd(r, {0, 0, 0, longest - n}, 0);
  }
  return {torch::stack(rows), torch::stack(masks)};
}

torch::Tensor encode_reference_latents(models::AutoencoderKLQwenImage& vae,
                                       const std::vector<torch::Tensor>& vae_pixels,
                                       models::QwenImageGrids* grids) {
  const torch::Device device = models::module_device(*vae);
  const auto dtype = models::module_dtype(*vae);
  std::vector<torch::Tensor> packed;
  for (const auto& pixels : vae_pixels) {
    torch::Tensor z = vae->encode(pixels.to(device, dtype)).mode();
    // _encode_vae_image: (z - latents_mean) / latents_std, both in z's dtype.
    const auto& c = vae->config();
    const auto stat = [&](const std::vector<double>& v) {
      return torch::tensor(v, torch::kFloat64)
          .view({1, -1, 1, 1, 1})
          .to(z.device(), z.scalar_type());
    };
    z = ((z - stat(c.latents_mean)) / stat(c.latents_std)).select(2, 0);  // [1, C, h, w]
    if (grids != nullptr) grids->push_back({1, z.size(2) / 2, z.size(3) / 2});
    packed.push_back(pack_qwen_latents(z));
  }
  return torch::cat(packed, 1);
}

}  // namespace difftrain::families::qwen_image
