// The text-to-image option groups (train/text_image_options.h).
#include "difftrain/train/text_image_options.h"

#include "difftrain/core/error.h"
#include "difftrain/train/train_config.h"

#include <algorithm>
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
      {"proportion_empty_prompts", "float", 0.0,
       "Diffusers' name for caption dropout: the share of captions replaced by \"\"",
       range_check(0, 1)},
      {"caption_dropout_rate", "float", 0.0, "kohya's caption dropout: a caption becomes \"\"",
       range_check(0, 1)},
      {"caption_dropout_every_n_epochs", "int", 0,
       "kohya: every caption is \"\" in epochs N, 2N, ... (1-based; 0 = never)",
       at_least(0, "--caption_dropout_every_n_epochs must be >= 0")},
      {"caption_tag_dropout_rate", "float", 0.0,
       "kohya: each tag not kept (--keep_tokens) is dropped with this probability",
       range_check(0, 1)},
      {"shuffle_caption",
       "bool",
       false,
       "kohya: the tags (split at --caption_separator) in a new order every epoch",
       {}},
      {"keep_tokens", "int", 0, "kohya: the first N tags stay in front when shuffling",
       at_least(0, "--keep_tokens must be >= 0")},
      {"keep_tokens_separator",
       "string",
       "",
       "kohya: text before it stays in front when shuffling (after a second one: at the end)",
       {}},
      {"caption_separator", "string", ",", "kohya: what separates a caption's tags",
       [](const nlohmann::json& v, const std::string&) {
         if (v.get<std::string>().empty()) throw Error("--caption_separator must not be empty");
       }},
      {"caption_prefix", "string", "", "kohya: text put before every caption (and a space)", {}},
      {"caption_suffix", "string", "", "kohya: text put after every caption (after a space)", {}},
      {"masked_loss",
       "bool",
       false,
       "kohya: the loss weighed by a mask (white = trained): --conditioning_data_dir's image of "
       "the same name, metadata.jsonl's \"mask\", or the image's alpha",
       {}},
      {"conditioning_data_dir",
       "string",
       "",
       "--masked_loss's masks: one image per training image, same relative name",
       {}},
      {"validation_prompt", "string", "", "validation renders of this prompt (\"\" = none)", {}},
      {"validation_negative_prompt", "string", "", "their negative prompt", {}},
  };
  for (auto& s : specs) {
    s.input_path = s.name == "class_data_dir" || s.name == "conditioning_data_dir";
    s.exactness = s.name.rfind("caption_", 0) == 0 || s.name == "proportion_empty_prompts" ||
                  s.name == "shuffle_caption" || s.name.rfind("keep_tokens", 0) == 0 ||
                  s.name == "masked_loss";
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
  if (f.number("proportion_empty_prompts") > 0 && f.number("caption_dropout_rate") > 0) {
    throw Error(
        "--proportion_empty_prompts (Diffusers) and --caption_dropout_rate (kohya) are the same "
        "caption dropout: give one");
  }
  if (!f.text("conditioning_data_dir").empty() && !f.flag("masked_loss")) {
    throw Error("--conditioning_data_dir holds --masked_loss's masks: add --masked_loss");
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
  auto& p = o.text.captions;
  p.prefix = f.text("caption_prefix");
  p.suffix = f.text("caption_suffix");
  p.dropout_rate = std::max(f.number("proportion_empty_prompts"), f.number("caption_dropout_rate"));
  p.dropout_every_n_epochs = f.integer("caption_dropout_every_n_epochs");
  p.tag_dropout_rate = f.number("caption_tag_dropout_rate");
  p.shuffle = f.flag("shuffle_caption");
  p.keep_tokens = f.integer("keep_tokens");
  p.keep_tokens_separator = f.text("keep_tokens_separator");
  p.separator = f.text("caption_separator");
  o.data.masked_loss = f.flag("masked_loss");
  o.data.conditioning_data_dir = f.text("conditioning_data_dir");
  o.validation.prompt = f.text("validation_prompt");
  o.validation.negative_prompt = f.text("validation_negative_prompt");
  return o;
}

}  // namespace difftrain::train
