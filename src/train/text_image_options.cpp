// The text-to-image option groups (train/text_image_options.h).
#include "difftrain/train/text_image_options.h"

#include "difftrain/core/error.h"
#include "difftrain/train/train_config.h"

#include <string>

namespace difftrain::train {

std::vector<OptionSpec> text_image_option_specs() {
  const auto at_least = [](double lo, std::string message) {
    return [lo, message](const nlohmann::json& v, const std::string&) {
      if (!(v.get<double>() >= lo)) throw Error(message);
    };
  };
  std::vector<OptionSpec> specs = {
      {"caption_column",
       "string",
       "text",
       "the metadata.jsonl field holding each image's caption",
       {}},
      {"caption_extension", "string", ".txt",
       "kohya's sidecar captions: a.png's caption in a.txt beside it, for images metadata.jsonl "
       "gives none (\"\" reads none)",
       [](const nlohmann::json& v, const std::string&) {
         const auto ext = v.get<std::string>();
         if (!ext.empty() && ext[0] != '.') {
           throw Error(
               "--caption_extension must start with a dot (.txt, .caption) or be empty, got '" +
               ext + "'");
         }
       }},
      {"instance_prompt", "string", "", "one caption for every image (DreamBooth)", {}},
      {"with_prior_preservation",
       "bool",
       false,
       "DreamBooth prior preservation: class images trained alongside",
       {}},
      {"class_data_dir", "string", "", "the class images (prior preservation)", {}},
      {"class_prompt", "string", "", "the class images' caption (prior preservation)", {}},
      {"prior_loss_weight", "float", 1.0, "weight of the class images' loss",
       at_least(0, "--prior_loss_weight must be >= 0")},
      {"num_class_images", "int", 100,
       "class images wanted; missing ones are generated from class_prompt first",
       at_least(1, "--num_class_images must be at least 1")},
      {"cache_latents",
       "bool",
       false,
       "encode each image (and each fixed caption) once and keep the results on disk",
       {}},
      {"train_text_encoder", "bool", false, "LoRA on the text encoder(s) too (needs --lora)", {}},
      {"text_encoder_lora_target_modules",
       "list",
       nlohmann::json::array({"q_proj", "k_proj", "v_proj", "out_proj"}),
       "text encoder layers that get adapters (--train_text_encoder)",
       {}},
      {"validation_prompt", "string", "", "validation renders of this prompt (\"\" = none)", {}},
      {"validation_negative_prompt", "string", "", "their negative prompt", {}},
  };
  for (auto& s : specs) {
    s.input_path = s.name == "class_data_dir";
    s.structural = s.name == "caption_column" || s.name == "instance_prompt" ||
                   s.name == "with_prior_preservation" || s.name == "class_prompt" ||
                   s.name == "train_text_encoder" || s.name == "text_encoder_lora_target_modules";
  }
  return specs;
}

OptionSpec clip_skip_option_spec() {
  OptionSpec spec{"clip_skip", "int", 1,
                  "prompt embeddings from this CLIP layer counted from the end, as kohya: 1 = "
                  "last, 2 = penultimate",
                  [](const nlohmann::json& v, const std::string&) {
                    const int64_t n = v.get<int64_t>();
                    if (n < 1) {
                      throw Error(
                          "--clip_skip counts as kohya does: 1 = the last layer, 2 = the one "
                          "before; got " +
                          std::to_string(n));
                    }
                  }};
  spec.structural = true;
  return spec;
}

std::map<std::string, std::string> text_image_other_tools_options() {
  return {{"reg_data_dir", "--class_data_dir with --with_prior_preservation and --class_prompt"},
          {"sample_prompts", "--validation_prompt"}};
}

bool has_text_image_options(const FamilyOptions& options) {
  return options.find("instance_prompt") != nullptr;
}

void check_text_image_options(const TrainConfig& c) {
  const FamilyOptions& f = c.family;
  if (!has_text_image_options(f)) return;
  if (f.flag("with_prior_preservation")) {
    if (f.text("class_data_dir").empty() || f.text("class_prompt").empty()) {
      throw Error("--with_prior_preservation needs --class_data_dir and --class_prompt");
    }
    if (f.text("instance_prompt").empty()) {
      throw Error("--with_prior_preservation is DreamBooth training: give --instance_prompt too");
    }
  }
  if (f.flag("train_text_encoder") && !c.lora) {
    throw Error("--train_text_encoder trains LoRA adapters on the text encoder: add --lora");
  }
}

TaskOptions with_text_image_options(TaskOptions o) {
  const FamilyOptions& f = o.family;
  if (!has_text_image_options(f)) return o;
  o.data.caption_column = f.text("caption_column");
  o.data.caption_extension = f.text("caption_extension");
  o.text.instance_prompt = f.text("instance_prompt");
  o.text.with_prior_preservation = f.flag("with_prior_preservation");
  o.text.class_data_dir = f.text("class_data_dir");
  o.text.class_prompt = f.text("class_prompt");
  o.text.prior_loss_weight = f.number("prior_loss_weight");
  o.text.num_class_images = f.integer("num_class_images");
  o.text.cache_latents = f.flag("cache_latents");
  if (f.find("clip_skip") != nullptr) o.text.clip_skip = f.integer("clip_skip");
  o.lora.train_text_encoder = f.flag("train_text_encoder");
  o.lora.text_encoder_target_modules =
      f.at("text_encoder_lora_target_modules").get<std::vector<std::string>>();
  o.validation.prompt = f.text("validation_prompt");
  o.validation.negative_prompt = f.text("validation_negative_prompt");
  return o;
}

}  // namespace difftrain::train
