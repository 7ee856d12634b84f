// The model-family registry (families/family.h): which family a folder belongs to, by
// model_index.json's _class_name, a bare model's config.json or the components, and the one-line
// refusal of a class no family claims; each family's pipeline loader.
#include "difftrain/families/family.h"
#include "difftrain/train/ddpm_options.h"
#include "difftrain/train/text_image_options.h"

#include "difftrain/families/stable_diffusion/text_to_image.h"
#include "difftrain/families/unet/memory.h"
#include "difftrain/families/unet/pipeline.h"
#include "difftrain/families/unet/unet_based_family.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/pretrained.h"
#include "difftrain/train/memory_estimate.h"
#include "difftrain/train/trainer.h"

#include "test_util.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <utility>

namespace difftrain::test {
namespace {
namespace fs = std::filesystem;

std::string family_name(const std::string& dir) { return families::family_of(dir).name(); }

std::string folder_with_index(const std::string& dir, const std::string& index) {
  fs::create_directories(dir);
  write_text(dir + "/model_index.json", index);
  return dir;
}

TEST(Families, EachBuiltInFamilyIsRegisteredOnceWithItsOwnClasses) {
  std::set<std::string> names, classes;
  for (const auto* f : families::families()) {
    EXPECT_TRUE(names.insert(f->name()).second) << f->name();
    if (f->name() == "registrar-test") {  // AFamilyRegistersThroughThePublicRegistrar's
      names.erase(f->name());
      continue;
    }
    for (const auto& c : f->pipeline_classes()) EXPECT_TRUE(classes.insert(c).second) << c;
    EXPECT_FALSE(f->lora_components().empty()) << f->name();
  }
  EXPECT_EQ(names, (std::set<std::string>{"unet", "stable-diffusion", "sdxl", "flux", "z-image",
                                          "qwen-image", "wan"}));
  EXPECT_EQ(families::default_family().name(), "unet");
  // Diffusers' oldest LoRA layout's bare module paths are the UNet's, as its families declare.
  EXPECT_EQ(io::lora_bare_component(), "unet");
  EXPECT_EQ(families::find_family("flux")->lora_bare_component(), "");
}

// A family registered through the public API (as a program outside the tree does): found by
// name and by its folders' class, and refused when it collides with a registered one.
class RegistrarTestFamily : public families::unet::UNetBasedFamily {
 public:
  RegistrarTestFamily(std::string name, std::string pipeline_class, bool is_default = false)
      : name_(std::move(name)), class_(std::move(pipeline_class)), default_(is_default) {}
  std::string name() const override { return name_; }
  std::vector<std::string> pipeline_classes() const override { return {class_}; }
  bool matches_components(const nlohmann::json&) const override { return false; }
  bool is_default() const override { return default_; }
  std::vector<std::string> lora_components() const override { return {"registrar_part"}; }
  // Its own key layout: "mytool/<module>/down|up" for the registrar_part component.
  std::vector<io::LoraKeyLayout> lora_key_layouts() const override {
    io::LoraKeyLayout layout;
    layout.name = "registrar test";
    layout.matches = [](const std::map<std::string, torch::Tensor>& t) {
      return !t.empty() && t.begin()->first.rfind("mytool/", 0) == 0;
    };
    layout.normalize = [](const std::map<std::string, torch::Tensor>& t) {
      std::map<std::string, torch::Tensor> out;
      for (const auto& [key, value] : t) {
        const auto slash = key.rfind('/');
        out["registrar_part." + key.substr(7, slash - 7) + ".lora." + key.substr(slash + 1) +
            ".weight"] = value;
      }
      return out;
    };
    return {layout};
  }
  std::unique_ptr<diffusion::Pipeline> load_pipeline(
      const std::string&, const diffusion::PipelineLoadOptions&) const override {
    return nullptr;
  }
  std::unique_ptr<train::TrainingTask> make_training_task(
      const train::TaskOptions&) const override {
    return nullptr;
  }
  diffusion::GenerateResult sample(const families::SampleOptions&) const override { return {}; }

 private:
  std::string name_, class_;
  bool default_;
};

TEST(Families, AFamilyRegistersThroughThePublicRegistrar) {
  const size_t before = families::families().size();
  families::register_family(
      std::make_unique<RegistrarTestFamily>("registrar-test", "RegistrarTestPipeline"));
  ASSERT_EQ(families::families().size(), before + 1);
  EXPECT_EQ(families::families().back()->name(), "registrar-test");
  ASSERT_NE(families::find_family("registrar-test"), nullptr);
  EXPECT_EQ(families::find_family("no-such-family"), nullptr);
  const auto dir = temp_dir("families_registrar");
  EXPECT_EQ(
      family_name(folder_with_index(dir + "/own", R"({"_class_name": "RegistrarTestPipeline"})")),
      "registrar-test");
  // An unknown class now lists the new family's class too.
  const auto unknown = folder_with_index(dir + "/unknown", R"({"_class_name": "NoSuchPipeline"})");
  EXPECT_NE(error_of([&] {
              (void)families::family_of(unknown);
            }).find("RegistrarTestPipeline (registrar-test)"),
            std::string::npos);
  // Collisions: a name, a class, a second default.
  EXPECT_NE(error_of([&] {
              (void)families::register_family(
                  std::make_unique<RegistrarTestFamily>("sdxl", "OtherPipeline"));
            }).find("a family named \"sdxl\" is already registered"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              (void)families::register_family(std::make_unique<RegistrarTestFamily>(
                  "registrar-test-2", "StableDiffusionXLPipeline"));
            }).find("claims class StableDiffusionXLPipeline, which family \"sdxl\" already reads"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              (void)families::register_family(std::make_unique<RegistrarTestFamily>(
                  "registrar-test-3", "ThirdPipeline", /*is_default=*/true));
            }).find("says it is the default, and so does \"unet\""),
            std::string::npos);
  EXPECT_EQ(families::families().size(), before + 1);
  EXPECT_EQ(families::default_family().name(), "unet");
  // What it adds to io: its component, in every format, and its own key layout.
  EXPECT_TRUE(io::is_lora_component("registrar_part"));
  io::save_safetensors(dir + "/own_layout.safetensors",
                       {{"mytool/blocks.0.proj/down", torch::ones({2, 8})},
                        {"mytool/blocks.0.proj/up", torch::full({8, 2}, 0.5)}});
  const auto lora = io::read_lora(dir + "/own_layout.safetensors");
  ASSERT_EQ(lora.count("registrar_part"), 1u);
  EXPECT_EQ(lora.components.at("registrar_part").front().module, "blocks.0.proj");
  for (const auto format :
       {io::LoraFormat::kDiffusers, io::LoraFormat::kPeft, io::LoraFormat::kKohya}) {
    const auto path = dir + "/written_" + io::to_string(format) + ".safetensors";
    io::write_lora(path, lora, format);
    const auto back = io::read_lora(path);
    ASSERT_EQ(back.count("registrar_part"), 1u) << io::to_string(format);
    EXPECT_EQ(back.components.at("registrar_part").front().up.sum().item<double>(), 8.0);
  }
}

TEST(Families, AFamilyDeclaresItsOwnOptionsAndAnotherFamilysAreRefused) {
  const auto flux = kGoldenDir + "flux/tiny_flux";
  const auto parse = [](std::vector<std::string> args) {
    return families::parse_train_config(args);
  };
  // The flow-matching group, max_sequence_length and blocks_to_swap are FLUX.1's, not the
  // trainer's.
  const auto names = [](const std::vector<std::vector<std::string>>& rows) {
    std::set<std::string> out;
    for (const auto& r : rows) out.insert(r[0]);
    return out;
  };
  EXPECT_EQ(names(train::train_option_table()).count("weighting_scheme"), 0u);
  const auto* flux_family = families::find_family("flux");
  ASSERT_NE(flux_family, nullptr);
  const auto flux_rows = names(train::family_option_table(flux_family->options()));
  for (const char* n :
       {"weighting_scheme", "logit_mean", "logit_std", "mode_scale", "timestep_sampling",
        "sigmoid_scale", "discrete_flow_shift", "max_sequence_length", "blocks_to_swap"}) {
    EXPECT_EQ(flux_rows.count(n), 1u) << n;
  }
  // Defaults, flags and YAML alike; the values reach the configuration and the task.
  auto c = parse({"--pretrained_model_name_or_path", flux, "--lora"});
  EXPECT_EQ(c.family.family, "flux");
  EXPECT_EQ(c.family.text("weighting_scheme"), "none");
  EXPECT_EQ(c.family.integer("max_sequence_length"), 512);
  EXPECT_EQ(c.to_json().at("discrete_flow_shift"), 3.0);
  const auto dir = temp_dir("families_options");
  write_text(dir + "/run.yaml", "weighting_scheme: logit_normal\nlogit_std: 2\n");
  c = parse({"--pretrained_model_name_or_path", flux, "--config", dir + "/run.yaml",
             "--max_sequence_length=16"});
  EXPECT_EQ(c.family.text("weighting_scheme"), "logit_normal");
  EXPECT_DOUBLE_EQ(c.family.number("logit_std"), 2.0);
  EXPECT_EQ(c.family.integer("max_sequence_length"), 16);
  EXPECT_EQ(c.given.count("logit_std"), 1u);
  EXPECT_EQ(train::task_options(c).family.integer("max_sequence_length"), 16);
  // The model can come from the YAML file too.
  write_text(dir + "/model.yaml", "pretrained_model_name_or_path: " + flux + "\n");
  EXPECT_EQ(
      parse({"--config", dir + "/model.yaml", "--logit_mean", "0.5"}).family.number("logit_mean"),
      0.5);
  const auto trainer = train::trainer_options(c);
  const auto has = [](const std::vector<std::string>& v, const char* n) {
    return std::find(v.begin(), v.end(), n) != v.end();
  };
  EXPECT_TRUE(has(trainer.structural_keys, "max_sequence_length"));
  EXPECT_TRUE(has(trainer.exactness_keys, "weighting_scheme"));
  // The same refusals as before, from the family's checks.
  const auto error = [&](std::vector<std::string> flags) {
    flags.insert(flags.begin(), {"--pretrained_model_name_or_path", flux});
    return error_of([&] { (void)families::parse_train_config(flags); });
  };
  EXPECT_HAS(error({"--weighting_scheme", "lognorm"}),
             "--weighting_scheme is \"lognorm\": expected one of none, logit_normal, mode, "
             "cosmap, sigma_sqrt");
  EXPECT_HAS(error({"--timestep_sampling", "linear"}), "--timestep_sampling is \"linear\"");
  EXPECT_HAS(error({"--logit_std", "0"}), "--logit_std must be positive");
  EXPECT_HAS(error({"--max_sequence_length", "600"}), "--max_sequence_length must be in 1..512");
  EXPECT_HAS(error({"--logit_mean", "x"}), "--logit_mean is \"x\": expected a number");
  // Another family's run refuses them in one line naming the family they belong to.
  const auto sd_error = error_of([&] {
    (void)parse({"--pretrained_model_name_or_path", kTinySdGolden, "--weighting_scheme", "mode"});
  });
  EXPECT_HAS(sd_error,
             "\"weighting_scheme\" is an option of the flux, qwen-image, wan, z-image families");
  EXPECT_HAS(sd_error, "this run trains the stable-diffusion family");
  EXPECT_EQ(sd_error.find('\n'), std::string::npos);
  EXPECT_HAS(error_of([&] {
               (void)parse({"--max_sequence_length", "77"});
             }),
             "is an option of the flux, qwen-image, wan, z-image families; this run trains the "
             "unet family (no "
             "--pretrained_model_name_or_path)");
  // An option several families declare (the DDPM objective's group) names them all, and the run's
  // family says what it does instead; the class labels are the unet family's alone.
  const auto ddpm = error({"--snr_gamma", "5"});
  // (a family another test registers, built on the UNet, takes them too)
  EXPECT_HAS(ddpm, "--snr_gamma: \"snr_gamma\" is an option of the sdxl, stable-diffusion, unet");
  EXPECT_HAS(ddpm, " families; this run trains the flux family");
  EXPECT_HAS(ddpm, "FLUX.1 trains with flow matching: weigh it with --weighting_scheme");
  EXPECT_EQ(ddpm.find('\n'), std::string::npos);
  EXPECT_HAS(error_of([&] {
               (void)parse({"--pretrained_model_name_or_path", kTinySdGolden, "--only_class", "1"});
             }),
             "\"only_class\" is an option of the unet family; this run trains the "
             "stable-diffusion family");
  // The UNet families take the DDPM group: given, it reaches the task's noise options.
  const auto sd_run = parse({"--pretrained_model_name_or_path", kTinySdGolden, "--snr_gamma", "3",
                             "--noise_offset", "0.1", "--prediction_type", "v_prediction"});
  EXPECT_EQ(sd_run.family.family, "stable-diffusion");
  EXPECT_EQ(sd_run.family.find("class_dropout_prob"), nullptr);
  const auto sd_trainer = train::trainer_options(sd_run);
  EXPECT_TRUE(has(sd_trainer.structural_keys, "prediction_type"));
  EXPECT_TRUE(has(sd_trainer.exactness_keys, "snr_gamma"));
  EXPECT_TRUE(has(sd_trainer.exactness_keys, "noise_offset"));
  const auto noise = train::ddpm_noise_options(train::task_options(sd_run).family, 7);
  EXPECT_EQ(noise.prediction_type, "v_prediction");
  EXPECT_DOUBLE_EQ(noise.snr_gamma.value_or(0), 3.0);
  EXPECT_DOUBLE_EQ(noise.noise_offset, 0.1);
  EXPECT_EQ(noise.ddpm_num_steps, 1000);
  EXPECT_EQ(noise.seed, 7u);
  write_text(dir + "/flow.yaml", "discrete_flow_shift: 2\n");
  EXPECT_HAS(error_of([&] {
               (void)parse({"--config", dir + "/flow.yaml"});
             }),
             "\"discrete_flow_shift\" is an option of the flux, qwen-image, wan, z-image families");
  // Other tools' flags for what a family has are the family's to point at (kohya's).
  const auto t5 = error({"--t5xxl_max_token_length", "256"});
  EXPECT_HAS(t5, "\"t5xxl_max_token_length\" is another tool's option");
  EXPECT_HAS(t5, "difftrain's is --max_sequence_length");
  EXPECT_HAS(error_of([&] {
               (void)parse({"--pretrained_model_name_or_path", kTinySdGolden, "--unet_lr", "1e-4"});
             }),
             "\"unet_lr\" is another tool's option (kohya sd-scripts, SimpleTuner); difftrain's "
             "is --learning_rate");
  EXPECT_TRUE(flux_family->other_tools_options().count("unet_lr"));
  // An SD run's family options are the DDPM objective's, the text-to-image group and clip_skip,
  // and its shown configuration has none of FLUX.1's.
  const auto sd = parse({"--pretrained_model_name_or_path", kTinySdGolden});
  EXPECT_EQ(sd.family.values.size(),
            train::ddpm_option_specs().size() + train::text_image_option_specs().size() + 1);
  EXPECT_EQ(sd.family.values.size(),
            families::stable_diffusion::text_to_image_option_specs().size());
  EXPECT_FALSE(sd.to_json().contains("weighting_scheme"));
}

// Captions, DreamBooth, --cache_latents, the text encoder's LoRA and the validation prompt are
// the text-to-image families' group (train/text_image_options.h), clip_skip the CLIP-layer
// families' (SD, SDXL): not the trainer's, refused by the others, the same checks as before.
TEST(Families, TheTextToImageOptionsAreAGroupTheTextFamiliesDeclare) {
  const auto flux = kGoldenDir + "flux/tiny_flux";
  const auto parse = [](std::vector<std::string> args) {
    return families::parse_train_config(args);
  };
  std::set<std::string> trainer;
  for (const auto& row : train::train_option_table()) trainer.insert(row[0]);
  std::vector<std::string> group;
  for (const auto& spec : train::text_image_option_specs()) group.push_back(spec.name);
  EXPECT_EQ(group.size(), 25u);  // 13, and the 12 caption and mask options of issue 61
  for (const auto& name : group) EXPECT_EQ(trainer.count(name), 0u) << name;
  EXPECT_EQ(trainer.count("clip_skip"), 0u);
  EXPECT_EQ(trainer.count("cache_dir"), 1u);  // the run's cache folder stays the trainer's
  for (const char* family : {"stable-diffusion", "sdxl", "flux"}) {
    const auto* f = families::find_family(family);
    ASSERT_NE(f, nullptr);
    std::set<std::string> names;
    for (const auto& spec : f->options()) names.insert(spec.name);
    for (const auto& name : group) EXPECT_EQ(names.count(name), 1u) << family << " " << name;
    EXPECT_EQ(names.count("clip_skip"), std::string(family) == "flux" ? 0u : 1u) << family;
  }
  EXPECT_TRUE(families::find_family("unet")->options().size() > 0);
  for (const auto& spec : families::find_family("unet")->options()) {
    EXPECT_NE(spec.name, "instance_prompt");
  }

  // Given, they reach the task's data, text, LoRA and validation options, the structural ones
  // the resume check, the class folder the output-folder check.
  const auto dir = temp_dir("families_text_options");
  const auto run = parse({"--pretrained_model_name_or_path",
                          kTinySdGolden,
                          "--lora",
                          "--instance_prompt",
                          "a sks dog",
                          "--with_prior_preservation",
                          "--class_data_dir",
                          dir + "/class",
                          "--class_prompt",
                          "a dog",
                          "--prior_loss_weight",
                          "0.5",
                          "--num_class_images",
                          "7",
                          "--clip_skip",
                          "2",
                          "--caption_column",
                          "caption",
                          "--caption_extension",
                          ".caption",
                          "--cache_latents",
                          "--train_text_encoder",
                          "--text_encoder_lora_target_modules",
                          "q_proj,v_proj",
                          "--validation_prompt",
                          "a sks dog in a bucket",
                          "--validation_negative_prompt",
                          "blurry",
                          "--cache_dir",
                          dir + "/c"});
  EXPECT_EQ(run.defaults_from, "train_dreambooth_lora.py");  // --instance_prompt: DreamBooth
  const auto o = train::with_text_image_options(train::task_options(run));
  EXPECT_EQ(o.data.caption_column, "caption");
  EXPECT_EQ(o.data.caption_extension, ".caption");
  EXPECT_EQ(o.text.instance_prompt, "a sks dog");
  EXPECT_TRUE(o.text.with_prior_preservation);
  EXPECT_EQ(o.text.class_data_dir, dir + "/class");
  EXPECT_EQ(o.text.class_prompt, "a dog");
  EXPECT_DOUBLE_EQ(o.text.prior_loss_weight, 0.5);
  EXPECT_EQ(o.text.num_class_images, 7);
  EXPECT_TRUE(o.text.cache_latents);
  EXPECT_EQ(o.text.cache_dir, dir + "/c");
  EXPECT_EQ(o.text.clip_skip, 2);
  EXPECT_TRUE(o.lora.train_text_encoder);
  EXPECT_EQ(o.lora.text_encoder_target_modules, (std::vector<std::string>{"q_proj", "v_proj"}));
  EXPECT_EQ(o.validation.prompt, "a sks dog in a bucket");
  EXPECT_EQ(o.validation.negative_prompt, "blurry");
  const auto trainer_options = train::trainer_options(run);
  const auto has = [](const std::vector<std::string>& v, const char* n) {
    return std::find(v.begin(), v.end(), n) != v.end();
  };
  for (const char* n :
       {"caption_column", "instance_prompt", "with_prior_preservation", "class_prompt",
        "train_text_encoder", "text_encoder_lora_target_modules", "clip_skip"}) {
    EXPECT_TRUE(has(trainer_options.structural_keys, n)) << n;
  }
  EXPECT_FALSE(has(trainer_options.structural_keys, "validation_prompt"));
  bool class_input = false;
  for (const auto& in : trainer_options.inputs) {
    class_input |= in.option == "class_data_dir" && in.path == dir + "/class";
  }
  EXPECT_TRUE(class_input);
  // Not given: the defaults of before; a task made by hand keeps its own fields.
  const auto plain = train::with_text_image_options(
      train::task_options(parse({"--pretrained_model_name_or_path", kTinySdGolden})));
  EXPECT_EQ(plain.data.caption_column, "text");
  EXPECT_EQ(plain.data.caption_extension, ".txt");
  EXPECT_EQ(plain.text.clip_skip, 1);
  EXPECT_EQ(plain.lora.text_encoder_target_modules,
            (std::vector<std::string>{"q_proj", "k_proj", "v_proj", "out_proj"}));
  train::TaskOptions by_hand;
  by_hand.text.instance_prompt = "kept";
  EXPECT_EQ(train::with_text_image_options(by_hand).text.instance_prompt, "kept");

  // The checks and their messages of before.
  const auto sd_error = [&](std::vector<std::string> flags) {
    flags.insert(flags.begin(), {"--pretrained_model_name_or_path", kTinySdGolden});
    return error_of([&] { (void)parse(flags); });
  };
  EXPECT_HAS(sd_error({"--clip_skip", "0"}),
             "--clip_skip counts as kohya does: 1 = the last layer, 2 = the one before; got 0");
  EXPECT_HAS(sd_error({"--caption_extension", "txt"}),
             "--caption_extension must start with a dot (.txt, .caption) or be empty, got 'txt'");
  EXPECT_HAS(sd_error({"--prior_loss_weight", "-1"}), "--prior_loss_weight must be >= 0");
  EXPECT_HAS(sd_error({"--num_class_images", "0"}), "--num_class_images must be at least 1");
  EXPECT_HAS(sd_error({"--instance_prompt", "x", "--with_prior_preservation"}),
             "--with_prior_preservation needs --class_data_dir and --class_prompt");
  EXPECT_HAS(
      sd_error({"--with_prior_preservation", "--class_data_dir", dir, "--class_prompt", "d"}),
      "--with_prior_preservation is DreamBooth training: give --instance_prompt too");
  EXPECT_HAS(sd_error({"--train_text_encoder"}),
             "--train_text_encoder trains LoRA adapters on the text encoder: add --lora");
  // The built-in UNet job refuses them, naming the families that take them; FLUX.1 refuses
  // clip_skip and says why.
  const auto unet = error_of([&] { (void)parse({"--instance_prompt", "sks"}); });
  EXPECT_HAS(unet,
             "\"instance_prompt\" is an option of the flux, qwen-image, sdxl, stable-diffusion, "
             "wan, z-image "
             "families; "
             "this "
             "run trains the unet family");
  EXPECT_EQ(unet.find('\n'), std::string::npos);
  const auto flux_skip = error_of([&] {
    (void)parse({"--pretrained_model_name_or_path", flux, "--clip_skip", "2"});
  });
  EXPECT_HAS(flux_skip, "\"clip_skip\" is an option of the sdxl, stable-diffusion families");
  EXPECT_HAS(flux_skip, "this run trains the flux family");
  EXPECT_HAS(flux_skip, "there is no layer to skip");
  // Other tools' names for the groups' options are the groups' (the run's family first): kohya's
  // --min_snr_gamma is --snr_gamma for a UNet and --weighting_scheme for FLUX.1.
  EXPECT_HAS(error_of([&] {
               (void)parse({"--min_snr_gamma", "5"});
             }),
             "\"min_snr_gamma\" is another tool's option (kohya sd-scripts, SimpleTuner); "
             "difftrain's is --snr_gamma");
  const auto flux_snr = error_of([&] {
    (void)parse({"--pretrained_model_name_or_path", flux, "--min_snr_gamma", "5"});
  });
  EXPECT_HAS(flux_snr, "FLUX.1 trains with flow matching: weigh it with --weighting_scheme");
  EXPECT_EQ(flux_snr.find("--snr_gamma"), std::string::npos);
  EXPECT_HAS(error_of([&] {
               (void)parse({"--pretrained_model_name_or_path", flux, "--sample_prompts", "p.txt"});
             }),
             "difftrain's is --validation_prompt");
  EXPECT_HAS(
      error_of([&] {
        (void)parse({"--pretrained_model_name_or_path", kTinySdGolden, "--reg_data_dir", dir});
      }),
      "difftrain's is --class_data_dir with --with_prior_preservation");
  // FLUX.1 reads the group too.
  const auto flux_run = parse({"--pretrained_model_name_or_path", flux, "--validation_prompt",
                               "a cat", "--caption_column", "prompt"});
  const auto fo = train::with_text_image_options(train::task_options(flux_run));
  EXPECT_EQ(fo.validation.prompt, "a cat");
  EXPECT_EQ(fo.data.caption_column, "prompt");
}

// `difftrain sample`'s family options: declared by the family, offered once per name by the CLI,
// parsed for the model's family, refused for another's naming the family they belong to.
TEST(Families, AFamilyDeclaresItsOwnSampleOptionsAndAnotherFamilysAreRefused) {
  const auto flux = kGoldenDir + "flux/tiny_flux";
  const auto sdxl = kGoldenDir + "sdxl/tiny_sdxl";
  std::map<std::string, std::vector<std::string>> owners;
  for (const auto& [spec, names] : families::all_sample_options()) owners[spec.name] = names;
  EXPECT_EQ(owners["prompt_2"], std::vector<std::string>{"flux"});
  EXPECT_EQ(owners["max_sequence_length"],
            (std::vector<std::string>{"flux", "qwen-image", "wan", "z-image"}));
  EXPECT_EQ(owners["true_cfg_scale"], std::vector<std::string>{"qwen-image"});
  EXPECT_EQ(owners["cfg_truncation"], std::vector<std::string>{"z-image"});
  EXPECT_EQ(owners["original_size"], std::vector<std::string>{"sdxl"});
  EXPECT_EQ(owners.count("negative_target_size"), 1u);

  const auto& flux_family = families::family_of(flux);
  auto o = families::sample_family_options(flux_family, {}, flux);
  EXPECT_TRUE(o.at("max_sequence_length").is_null());  // the pipeline's default
  EXPECT_TRUE(o.at("prompt_2").empty());
  o = families::sample_family_options(
      flux_family, {{"prompt_2", {"a, with commas", "b"}}, {"max_sequence_length", {"16"}}}, flux);
  EXPECT_EQ(o.at("prompt_2").get<std::vector<std::string>>(),
            (std::vector<std::string>{"a, with commas", "b"}));
  EXPECT_EQ(o.integer("max_sequence_length"), 16);
  EXPECT_HAS(
      error_of([&] {
        families::sample_family_options(flux_family, {{"max_sequence_length", {"513"}}}, flux);
      }),
      "--max_sequence_length is 513: expected a value in [1, 512]");
  const auto crossed = error_of([&] {
    families::sample_family_options(flux_family, {{"original_size", {"64", "64"}}}, flux);
  });
  EXPECT_HAS(crossed, "--original_size is an option of the sdxl family; " + flux +
                          " is a flux folder, which does not take it");
  EXPECT_EQ(crossed.find('\n'), std::string::npos);

  const auto& xl = families::family_of(sdxl);
  o = families::sample_family_options(xl, {{"original_size", {"1024", "768"}}}, sdxl);
  EXPECT_EQ(o.at("original_size").get<std::vector<int64_t>>(), (std::vector<int64_t>{1024, 768}));
  EXPECT_TRUE(o.at("target_size").is_null());
  EXPECT_HAS(error_of([&] {
               families::sample_family_options(xl, {{"target_size", {"64"}}}, sdxl);
             }),
             "--target_size takes 2 values, got 1");
  EXPECT_HAS(error_of([&] {
               families::sample_family_options(xl, {{"prompt_2", {"x"}}}, sdxl);
             }),
             "--prompt_2 is an option of the flux family");
  EXPECT_HAS(error_of([&] {
               families::sample_family_options(xl, {{"nonsense", {"x"}}}, sdxl);
             }),
             "--nonsense is no family's sample option");
  // SD 1.x/2.x takes none of them.
  EXPECT_TRUE(families::sample_family_options(families::family_of(kTinySdGolden), {}, kTinySdGolden)
                  .values.empty());
}

TEST(Families, AFolderIsRecognisedByItsClassName) {
  EXPECT_EQ(family_name(kTinySdGolden), "stable-diffusion");
  EXPECT_EQ(family_name(kGoldenDir + "sdxl/tiny_sdxl"), "sdxl");
  EXPECT_EQ(family_name(kDiffusersGolden + "unet2d_uncond"), "unet");  // a bare UNet2DModel
  const auto dir = temp_dir("families_classes");
  EXPECT_EQ(family_name(folder_with_index(dir + "/ddim", R"({"_class_name": "DDIMPipeline"})")),
            "unet");
  EXPECT_EQ(family_name(folder_with_index(dir + "/img2img",
                                          R"({"_class_name": "StableDiffusionImg2ImgPipeline"})")),
            "stable-diffusion");
  // Without _class_name, by the components: text_encoder_2 means SDXL, text_encoder SD.
  EXPECT_EQ(
      family_name(folder_with_index(dir + "/xl", R"({"unet": ["diffusers", "UNet2DConditionModel"],
                                 "text_encoder": ["transformers", "CLIPTextModel"],
                                 "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"]})")),
      "sdxl");
  EXPECT_EQ(family_name(folder_with_index(dir + "/sd",
                                          R"({"unet": ["diffusers", "UNet2DConditionModel"],
                                              "text_encoder": ["transformers", "CLIPTextModel"]})")),
            "stable-diffusion");
  // What the UNet family reports itself: a missing folder, an unreadable index.
  EXPECT_EQ(family_name(dir + "/missing"), "unet");
  EXPECT_EQ(family_name(folder_with_index(dir + "/broken", "{not json")), "unet");
}

// Each family loads its folders as a diffusion::Pipeline that names the Diffusers class it runs.
TEST(Families, EachFamilyLoadsItsPipelineBehindTheInterface) {
  const auto class_of = [](const std::string& dir) {
    return families::family_of(dir).load_pipeline(dir, {})->class_name();
  };
  EXPECT_EQ(class_of(kTinySdGolden), "StableDiffusionPipeline");
  EXPECT_EQ(class_of(kGoldenDir + "sdxl/tiny_sdxl"), "StableDiffusionXLPipeline");
  // A bare UNet folder runs as the pipeline of its sampler: DDIMPipeline with DDIM (this folder's
  // scheduler), DDPMPipeline with any other.
  const std::string bare = kDiffusersGolden + "unet2d_uncond";
  EXPECT_EQ(class_of(bare), "DDIMPipeline");
  diffusion::PipelineLoadOptions options;
  options.scheduler = "ddpm";
  EXPECT_EQ(families::family_of(bare).load_pipeline(bare, options)->class_name(), "DDPMPipeline");
}

// `difftrain lora convert --model`: the folder's family names the modules (SDXL: kohya's SGM
// names), and converting back through it gives the same Diffusers targets.
TEST(Families, ConvertLoraAsksTheFolderFamilyForTheNames) {
  const auto dir = temp_dir("families_convert_lora");
  const auto xl = kGoldenDir + "sdxl/tiny_sdxl";
  const auto source = kGoldenDir + "sdxl/tiny_sdxl_lora/pytorch_lora_weights.safetensors";
  const auto to_kohya =
      families::convert_lora(source, dir + "/kohya.safetensors", io::LoraFormat::kKohya, xl);
  EXPECT_EQ(to_kohya.read_format, io::LoraFormat::kPeft);  // the fixture's keys
  ASSERT_GT(to_kohya.targets.count("unet"), 0u);
  const auto kohya = io::load_safetensors(dir + "/kohya.safetensors").tensors;
  EXPECT_TRUE(
      kohya.count("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight"));
  const auto back = families::convert_lora(dir + "/kohya.safetensors", dir + "/back.safetensors",
                                           io::LoraFormat::kDiffusers, xl);
  EXPECT_EQ(back.read_format, io::LoraFormat::kKohya);
  EXPECT_EQ(back.targets, to_kohya.targets);
  const auto modules = [](const std::string& path) {
    const io::LoraWeights lora = io::read_lora(path);
    std::set<std::pair<std::string, std::string>> out;
    for (const auto& [component, targets] : lora.components) {
      for (const auto& t : targets) out.insert({component, t.module});
    }
    return out;
  };
  EXPECT_EQ(modules(dir + "/back.safetensors"), modules(source));
  // Without a model folder, kohya's SGM names cannot become Diffusers'.
  EXPECT_NE(error_of([&] {
              families::convert_lora(dir + "/kohya.safetensors", dir + "/x.safetensors",
                                     io::LoraFormat::kDiffusers);
            }),
            "");
}

// `difftrain forward`, `estimate-memory` and `lora merge` ask the folder's family; for the UNet
// families that is the UNet's own forward and families::unet::estimate_memory, number for number.
TEST(Families, ForwardAndTheMemoryModelComeFromTheFolderFamily) {
  const std::string sd = kTinySdGolden;
  const auto& family = families::family_of(sd);
  ASSERT_EQ(family.name(), "stable-diffusion");
  auto unet = models::load_unet(sd + "/unet");
  const auto& c = unet->config();
  const int64_t side = c.sample_size.empty() ? 8 : c.sample_size[0];
  torch::manual_seed(3);
  const std::map<std::string, torch::Tensor> inputs = {
      {"sample", torch::randn({1, c.in_channels, side, side})},
      {"timestep", torch::tensor(10)},
      {"encoder_hidden_states", torch::randn({1, 77, c.cross_attention_dim.front()})}};
  const auto got = family.forward(sd, inputs, "inputs.safetensors", "", 1.0);
  torch::NoGradGuard no_grad;
  unet->eval();
  const auto want = families::unet::forward_from_tensors(*unet, inputs, "inputs.safetensors");
  EXPECT_TRUE(torch::equal(got, want)) << max_abs(got, want);

  train::MemoryEstimateOptions o;
  o.resolution = 32;
  const auto estimates = family.estimate_memory(sd, o, {accel::ShardingStrategy::kNoShard});
  ASSERT_EQ(estimates.size(), 1u);
  const auto direct = families::unet::estimate_memory(sd, o);
  EXPECT_EQ(estimates[0].param_bytes, direct.param_bytes);
  EXPECT_EQ(estimates[0].frozen_param_bytes, direct.frozen_param_bytes);
  EXPECT_GT(estimates[0].frozen_params, 0);  // the text encoder and VAE of the pipeline
}

TEST(Families, AClassNoFamilyClaimsIsRefusedInOneLineListingTheKnownOnes) {
  const auto dir = folder_with_index(temp_dir("families_unknown") + "/sd3",
                                     R"({"_class_name": "StableDiffusion3Pipeline",
                                         "transformer": ["diffusers", "SD3Transformer2DModel"]})");
  const std::string message = error_of([&] { families::family_of(dir); });
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  for (const char* part : {"StableDiffusion3Pipeline", "model_index.json", "DDPMPipeline (unet)",
                           "StableDiffusionPipeline (stable-diffusion)",
                           "StableDiffusionXLPipeline (sdxl)", "FluxPipeline (flux)"}) {
    EXPECT_NE(message.find(part), std::string::npos) << part << " in: " << message;
  }
  // The training entry point asks the same registry.
  train::TaskOptions options;
  options.model.pretrained_model_name_or_path = dir;
  EXPECT_NE(
      error_of([&] { families::make_training_task(options); }).find("StableDiffusion3Pipeline"),
      std::string::npos);
}

// A family's run starts from the defaults of the Diffusers script it follows (issue 56: a FLUX.1
// LoRA ran with train_unconditional.py's lr 1e-3, cosine schedule and EMA); given options win.
TEST(Families, ARunStartsFromItsFamilysDiffusersScriptDefaults) {
  const auto flux = kGoldenDir + "flux/tiny_flux";
  const auto sd = kGoldenDir + "sd/tiny_sd";
  const auto xl = kGoldenDir + "sdxl/tiny_sdxl";
  const auto parse = [](std::vector<std::string> args) {
    return families::parse_train_config(args);
  };
  auto f = parse({"--pretrained_model_name_or_path", flux, "--lora"});
  EXPECT_EQ(f.defaults_from, "train_dreambooth_lora_flux.py");
  EXPECT_DOUBLE_EQ(f.learning_rate, 1e-4);
  EXPECT_EQ(f.lr_scheduler, "constant");
  EXPECT_EQ(f.lr_warmup_steps, 500);
  EXPECT_DOUBLE_EQ(f.adam_beta1, 0.9);
  EXPECT_DOUBLE_EQ(f.adam_weight_decay, 1e-4);
  EXPECT_EQ(f.train_batch_size, 4);
  EXPECT_EQ(f.resolution, 512);
  EXPECT_FALSE(f.use_ema);
  EXPECT_EQ(f.max_train_steps, 0);
  EXPECT_EQ(f.num_train_epochs, 1);
  EXPECT_EQ(f.checkpointing_steps, 500);
  EXPECT_EQ(f.lora_target_modules.size(), 12u);
  const auto shown = f.shown_json();
  for (const char* gone : {"prediction_type", "ddpm_beta_schedule", "validation_scheduler",
                           "snr_gamma", "ema_max_decay", "class_conditional"}) {
    EXPECT_FALSE(shown.contains(gone)) << gone;
  }
  EXPECT_TRUE(shown.contains("weighting_scheme"));
  // Given options win, from flags and from a YAML file.
  const auto dir = temp_dir("families_defaults");
  write_text(dir + "/run.yaml", "lr_scheduler: cosine\nuse_ema: true\n");
  auto given = parse({"--pretrained_model_name_or_path", flux, "--lora", "--learning_rate", "2e-3",
                      "--config", dir + "/run.yaml", "--max_train_steps", "9", "--lora_layers",
                      "attn.to_q"});
  EXPECT_DOUBLE_EQ(given.learning_rate, 2e-3);
  EXPECT_EQ(given.lr_scheduler, "cosine");
  EXPECT_TRUE(given.use_ema);
  EXPECT_EQ(given.max_train_steps, 9);
  EXPECT_EQ(given.lora_target_modules, train::TrainConfig{}.lora_target_modules);  // --lora_layers
  EXPECT_EQ(parse({"--pretrained_model_name_or_path", flux}).defaults_from,
            "train_dreambooth_flux.py");

  // Stable Diffusion and SDXL: text-to-image or DreamBooth, LoRA or full.
  struct Case {
    std::string model;
    std::vector<std::string> flags;
    std::string script;
    double lr, weight_decay;
    int64_t batch, resolution, epochs;
  };
  const std::vector<Case> cases = {
      {sd, {"--lora"}, "train_text_to_image_lora.py", 1e-4, 1e-2, 16, 512, 100},
      {sd, {}, "train_text_to_image.py", 1e-4, 1e-2, 16, 512, 100},
      {sd,
       {"--lora", "--instance_prompt", "sks"},
       "train_dreambooth_lora.py",
       5e-4,
       1e-2,
       4,
       512,
       1},
      {sd, {"--instance_prompt", "sks"}, "train_dreambooth.py", 5e-6, 1e-2, 4, 512, 1},
      {xl, {"--lora"}, "train_text_to_image_lora_sdxl.py", 1e-4, 1e-2, 16, 1024, 100},
      {xl, {}, "train_text_to_image_sdxl.py", 1e-4, 1e-2, 16, 1024, 100},
      {xl,
       {"--lora", "--instance_prompt", "sks"},
       "train_dreambooth_lora_sdxl.py",
       1e-4,
       1e-4,
       4,
       1024,
       1},
  };
  for (const auto& c : cases) {
    std::vector<std::string> args = {"--pretrained_model_name_or_path", c.model};
    args.insert(args.end(), c.flags.begin(), c.flags.end());
    const auto r = parse(args);
    EXPECT_EQ(r.defaults_from, c.script);
    EXPECT_DOUBLE_EQ(r.learning_rate, c.lr) << c.script;
    EXPECT_DOUBLE_EQ(r.adam_weight_decay, c.weight_decay) << c.script;
    EXPECT_EQ(r.train_batch_size, c.batch) << c.script;
    EXPECT_EQ(r.resolution, c.resolution) << c.script;
    EXPECT_EQ(r.num_train_epochs, c.epochs) << c.script;
    EXPECT_EQ(r.lr_scheduler, "constant") << c.script;
    EXPECT_FALSE(r.use_ema) << c.script;
    EXPECT_FALSE(r.shown_json().contains("discrete_flow_shift")) << c.script;
    EXPECT_TRUE(r.shown_json().contains("prediction_type")) << c.script;
  }
  // No pretrained folder: the built-in job's own recipe, no script.
  EXPECT_EQ(parse({}).defaults_from, "");
  EXPECT_DOUBLE_EQ(parse({}).learning_rate, train::TrainConfig{}.learning_rate);
}

// A LoRA made for another family is refused in one line naming it (issue 56: an SDXL LoRA given
// to FLUX.1 merged 0 transformer modules and exited 0); a text-encoder-only one passes.
TEST(Families, ALoraForAnotherFamilyIsRefusedNamingIt) {
  const auto flux = kGoldenDir + "flux/tiny_flux";
  const auto xl_lora = kGoldenDir + "sdxl/tiny_sdxl_lora/pytorch_lora_weights.safetensors";
  const auto flux_lora = kGoldenDir + "flux/tiny_flux_lora/pytorch_lora_weights.safetensors";
  const auto e =
      error_of([&] { families::check_lora_fits_family(io::read_lora(xl_lora), xl_lora, flux); });
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  for (const char* part : {"has no transformer targets", "a sdxl LoRA", "flux family"}) {
    EXPECT_NE(e.find(part), std::string::npos) << part << " in: " << e;
  }
  const auto sd = kGoldenDir + "sd/tiny_sd";
  const auto to_sd =
      error_of([&] { families::check_lora_fits_family(io::read_lora(flux_lora), flux_lora, sd); });
  EXPECT_NE(to_sd.find("has no unet targets"), std::string::npos) << to_sd;
  EXPECT_NE(to_sd.find("a flux LoRA"), std::string::npos) << to_sd;
  // Its own family's LoRA, and one with only the text encoder's targets, pass.
  EXPECT_NO_THROW(families::check_lora_fits_family(io::read_lora(flux_lora), flux_lora, flux));
  io::LoraWeights te_only = io::read_lora(flux_lora);
  te_only.components.erase("transformer");
  EXPECT_NO_THROW(families::check_lora_fits_family(te_only, flux_lora, flux));
}

}  // namespace
}  // namespace difftrain::test
