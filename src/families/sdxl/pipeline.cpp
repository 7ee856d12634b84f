// StableDiffusionXLPipeline as an extension of Stable Diffusion's pipeline (sdxl.h): the second
// text encoder and tokenizer, the UNet's text_time conditioning (pooled embedding and
// micro-conditioning time ids), guidance 5 and the float16 VAE decoded in float32. Sampling and
// loading are Stable Diffusion's (families/stable_diffusion/pipeline.h); this is what differs.
#include "sdxl.h"

#include "difftrain/core/error.h"

#include <string>
#include <utility>
#include <vector>

namespace difftrain::families::sdxl {
using namespace difftrain::diffusion;
using stable_diffusion::PromptConditioning;
using stable_diffusion::StableDiffusion;
using stable_diffusion::StableDiffusionFolder;
using stable_diffusion::TextToImageOptions;

namespace {

// options[name] as integers; empty when absent or null.
std::vector<int64_t> micro_conditioning_value(const nlohmann::json& options,
                                              const std::string& name) {
  const auto it = options.find(name);
  if (it == options.end() || it->is_null()) return {};
  std::vector<int64_t> out;
  if (it->is_array()) {
    for (const auto& v : *it) {
      if (!v.is_number_integer()) break;
      out.push_back(v.get<int64_t>());
    }
    if (out.size() == it->size()) return out;
  }
  throw Error("--" + name + " takes integers, got " + it->dump());
}

class SdxlExtension final : public stable_diffusion::PipelineExtension {
 public:
  std::string display_name() const override { return "SDXL"; }
  std::vector<std::string> pipeline_classes() const override {
    return {"StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline"};
  }
  std::vector<std::pair<std::string, std::vector<std::string>>> components() const override {
    return {{"text_encoder_2", {"CLIPTextModelWithProjection"}},
            {"tokenizer_2", {"CLIPTokenizer", "CLIPTokenizerFast"}}};
  }
  double default_guidance() const override { return 5.0; }  // StableDiffusionXLPipeline's
  bool upcasts_vae() const override { return true; }
  std::vector<std::string> option_names() const override {
    std::vector<std::string> names;
    for (const auto& spec : micro_conditioning_options()) names.push_back(spec.name);
    return names;
  }

  // CLIPTextModel + CLIPTextModelWithProjection, penultimate layers side by side, the pooled
  // embedding from the second.
  TextEncoderStack load_text_encoders(const StableDiffusionFolder& folder,
                                      const std::string& variant) const override {
    TextEncoders encoders;
    encoders.push_back(ClipTextEncoder::load(
        {"text_encoder", "tokenizer", folder.text_encoder_dir, folder.tokenizer_dir},
        /*with_projection=*/false, variant));
    encoders.push_back(ClipTextEncoder::load(
        {"text_encoder_2", "tokenizer_2", folder.extension_dirs.at("text_encoder_2"),
         folder.extension_dirs.at("tokenizer_2")},
        /*with_projection=*/true, variant));
    return TextEncoderStack(concatenated_hidden_states("SDXL"), std::move(encoders));
  }

  void check_unet(const StableDiffusionFolder& folder, const models::UNet& unet,
                  const TextEncoderStack& text) const override {
    if (!unet->needs_added_conditioning()) {
      throw Error(folder.unet_dir +
                  ": the UNet has no addition_embed_type \"text_time\", but the folder is SDXL "
                  "(text_encoder_2); the folder mixes models");
    }
    const auto& ucfg = unet->config();
    const int64_t want = text.pooled_dim() + 6 * ucfg.addition_time_embed_dim.value_or(0);
    if (ucfg.projection_class_embeddings_input_dim.value_or(0) != want) {
      throw Error(folder.unet_dir + ": projection_class_embeddings_input_dim " +
                  std::to_string(ucfg.projection_class_embeddings_input_dim.value_or(0)) +
                  " differs from text_encoder_2's projection_dim + 6 x addition_time_embed_dim = " +
                  std::to_string(want) + "; the folder mixes models");
    }
  }

  // StableDiffusionXLPipeline.encode_prompt, then _get_add_time_ids.
  PromptConditioning encode_prompts(StableDiffusion& sd, const TextToImageOptions& o,
                                    const std::vector<std::string>& negatives, int64_t height,
                                    int64_t width, bool guided) const override {
    const int64_t n = static_cast<int64_t>(o.prompts.size());
    const int64_t k = o.num_images_per_prompt;
    const PromptEmbeds positive = sd.text_encoders.encode(o.prompts, o.clip_skip);
    PromptConditioning c;
    c.embeds = positive.embeds.repeat_interleave(k, 0);
    c.text_embeds = positive.pooled.repeat_interleave(k, 0);
    auto option_or = [&](const char* name, std::vector<int64_t> fallback) {
      auto v = micro_conditioning_value(o.options, name);
      return v.empty() ? fallback : v;
    };
    const std::vector<int64_t> hw = {height, width};
    const auto original = option_or("original_size", hw);
    const auto crops = option_or("crops_coords_top_left", {0, 0});
    const auto target = option_or("target_size", hw);
    c.time_ids = add_time_ids(original, crops, target).repeat({n * k, 1});
    if (guided) {
      torch::Tensor negative_embeds, negative_pooled;
      if (o.negative_prompts.empty() && sd.folder.force_zeros_for_empty_prompt) {
        negative_embeds = torch::zeros_like(positive.embeds);
        negative_pooled = torch::zeros_like(positive.pooled);
      } else {
        // Diffusers takes hidden_states[-2] for the negatives whatever clip_skip is.
        const PromptEmbeds negative = sd.text_encoders.encode(negatives, 0);
        negative_embeds = negative.embeds;
        negative_pooled = negative.pooled;
      }
      const torch::Tensor negative_time_ids =
          add_time_ids(option_or("negative_original_size", original),
                       option_or("negative_crops_coords_top_left", crops),
                       option_or("negative_target_size", target))
              .repeat({n * k, 1});
      c.embeds = torch::cat({negative_embeds.repeat_interleave(k, 0), c.embeds});
      c.text_embeds = torch::cat({negative_pooled.repeat_interleave(k, 0), c.text_embeds});
      c.time_ids = torch::cat({negative_time_ids, c.time_ids});
    }
    return c;
  }
};

}  // namespace

const std::shared_ptr<const stable_diffusion::PipelineExtension>& pipeline_extension() {
  static const std::shared_ptr<const stable_diffusion::PipelineExtension> extension =
      std::make_shared<SdxlExtension>();
  return extension;
}

std::vector<train::OptionSpec> micro_conditioning_options() {
  std::vector<train::OptionSpec> out;
  const auto pair = [&](const char* name, const char* help) {
    train::OptionSpec s{name, "int?", nullptr, help, train::range_check(0, 1 << 20)};
    s.values = 2;
    out.push_back(std::move(s));
  };
  pair("original_size", "the size the image claims to come from, H W (default: --height --width)");
  pair("crops_coords_top_left", "the crop's top-left corner, TOP LEFT (default 0 0)");
  pair("target_size", "the target size, H W (default: the output's)");
  pair("negative_original_size",
       "original size of the negative conditioning (default: --original_size)");
  pair("negative_crops_coords_top_left",
       "crop corner of the negative conditioning (default: --crops_coords_top_left)");
  pair("negative_target_size", "target size of the negative conditioning (default: --target_size)");
  return out;
}

torch::Tensor add_time_ids(const std::vector<int64_t>& original_size,
                           const std::vector<int64_t>& crops_coords_top_left,
                           const std::vector<int64_t>& target_size) {
  auto check = [](const std::vector<int64_t>& v, const char* name) {
    if (v.size() != 2) {
      throw Error(
          std::string("--") + name + " takes two integers (" +
          (std::string(name).find("crops") != std::string::npos ? "top left" : "height width") +
          "), got " + std::to_string(v.size()));
    }
  };
  check(original_size, "original_size");
  check(crops_coords_top_left, "crops_coords_top_left");
  check(target_size, "target_size");
  std::vector<float> row;
  for (const auto* v : {&original_size, &crops_coords_top_left, &target_size}) {
    for (int64_t x : *v) row.push_back(static_cast<float>(x));
  }
  return torch::tensor(row, torch::kFloat32).reshape({1, 6});
}

}  // namespace difftrain::families::sdxl
