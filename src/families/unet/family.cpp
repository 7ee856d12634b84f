// The UNet family: unconditional and class-conditional UNets (Diffusers' DDPMPipeline /
// DDIMPipeline folders, or a bare UNet2DModel / UNet2DConditionModel folder with its
// scheduler_config.json), trained as train_unconditional.py does (unet_task.cpp). The default
// family: a run without a pretrained folder builds its UNet from a config.
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/diffusion/sampler.h"
#include "difftrain/families/unet/eval.h"
#include "difftrain/families/unet/pipeline.h"
#include "difftrain/families/unet/unet_based_family.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/train/train_config.h"
#include "unet_task.h"

#include <fmt/format.h>

#include <sstream>

namespace difftrain::families {
namespace {

// `difftrain eval`: the family's scoring of a class-conditional Fashion-MNIST model (eval.h).
FamilyCommand eval_command() {
  const auto at_least = [](double lo) {
    return [lo](const nlohmann::json& v, const std::string& where) {
      if (v.get<double>() < lo) throw Error(fmt::format("{} must be at least {}", where, lo));
    };
  };
  FamilyCommand c;
  c.name = "eval";
  c.help =
      "Score a class-conditional Fashion-MNIST model: a cached classifier's accuracy on its "
      "samples, and the Fréchet distance of their features to the test set's";
  c.options = {
      {"model", "string", "", "Pipeline or bare denoiser folder (required)", {}},
      {"lora", "string", "", "LoRA file to apply first", {}},
      {"num_per_class", "int", 20, "Samples per class", at_least(1)},
      {"num_inference_steps", "int", 50, "Sampler steps", train::range_check(1, 100000)},
      {"scheduler",
       "string",
       "",
       "The sampler (difftrain sample --help lists them), or a Diffusers scheduler class "
       "(default: the folder's scheduler, as validation and `difftrain sample` use)",
       {}},
      {"eta", "float", 0.0, "DDIM eta: 0 deterministic, 1 DDPM-like noise",
       train::range_check(0, 10)},
      {"seed", "int", 0, "Sampling seed", at_least(0)},
      {"guidance_scale",
       "float",
       1.0,
       "Classifier-free guidance against the null class (1: none; needs a model trained with "
       "--class_dropout_prob)",
       {}},
      {"data_dir",
       "string",
       "",
       "Fashion-MNIST IDX folder (default /usr/share/datasets/"
       "fashion-mnist)",
       {}},
      {"cache_dir",
       "string",
       "",
       "Where the classifier is cached (default ~/.cache/difftrain)",
       {}},
      {"classifier_epochs", "int", 2, "Epochs of classifier training when not cached", at_least(1)},
      {"classifier_train_samples", "int", 0, "Train the classifier on the first N images (0: all)",
       at_least(0)},
      {"test_samples", "int", 0, "Reference test images (0: all 10000)", at_least(0)},
      {"output", "string", "", "Also write the JSON result to this file", {}},
  };
  c.run = [](const train::FamilyOptions& f) {
    families::unet::EvalOptions o;
    o.model = f.text("model");
    if (o.model.empty()) throw Error("difftrain eval needs --model DIR (a pipeline folder)");
    o.lora = f.text("lora");
    o.num_per_class = f.integer("num_per_class");
    o.num_inference_steps = f.integer("num_inference_steps");
    o.scheduler = f.text("scheduler");
    o.eta = f.number("eta");
    o.seed = static_cast<uint64_t>(f.integer("seed"));
    o.guidance_scale = f.number("guidance_scale");
    o.data_dir = f.text("data_dir");
    o.cache_dir = f.text("cache_dir");
    o.classifier_epochs = f.integer("classifier_epochs");
    o.classifier_train_samples = f.integer("classifier_train_samples");
    o.test_samples = f.integer("test_samples");
    auto result = families::unet::evaluate_model(o);
    const auto output = f.text("output");
    if (!result.is_null() && !output.empty()) io::write_file_atomic(output, result.dump(2) + "\n");
    return result;
  };
  return c;
}

std::vector<int64_t> parse_labels(const std::string& text) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    try {
      size_t used = 0;
      out.push_back(std::stoll(item, &used));
      if (used != item.size()) throw std::invalid_argument(item);
    } catch (const std::exception&) {
      throw Error("--class_labels: \"" + item + "\" is not an integer; expected e.g. 0,3,7");
    }
  }
  return out;
}

class UNetFamily : public unet::UNetBasedFamily {
 public:
  std::string name() const override { return "unet"; }
  std::vector<std::string> pipeline_classes() const override {
    return {"DDPMPipeline", "DDIMPipeline"};
  }
  std::vector<std::string> model_classes() const override {
    return {"UNet2DModel", "UNet2DConditionModel"};
  }
  bool matches_components(const nlohmann::json& index) const override {
    return index.contains("unet");
  }
  bool is_default() const override { return true; }
  std::vector<std::string> lora_components() const override { return {"unet"}; }
  std::unique_ptr<diffusion::Pipeline> load_pipeline(
      const std::string& dir, const diffusion::PipelineLoadOptions& options) const override {
    return std::make_unique<families::unet::UNetPipeline>(
        families::unet::load_unet_pipeline(dir, options));
  }
  std::vector<FamilyCommand> commands() const override { return {eval_command()}; }

  // The DDPM objective's options, and class labels (train_unconditional.py has none; difftrain's
  // class-conditional UNet takes them from labelled datasets).
  std::vector<train::OptionSpec> options() const override {
    auto specs = UNetBasedFamily::options();
    train::OptionSpec conditional{"class_conditional",
                                  "bool?",
                                  nullptr,
                                  "condition on class labels (default: yes for a fresh UNet on a "
                                  "labelled dataset)",
                                  {}};
    train::OptionSpec dropout{"class_dropout_prob", "float", 0.0,
                              "labels replaced by the null class (enables guidance when sampling)",
                              [](const nlohmann::json& v, const std::string&) {
                                const double p = v.get<double>();
                                if (!(p >= 0 && p < 1)) {
                                  throw Error("--class_dropout_prob must be in [0, 1)");
                                }
                              }};
    train::OptionSpec only{"only_class", "int?", nullptr,
                           "train on one class of fashion_mnist / mnist only",
                           [](const nlohmann::json& v, const std::string&) {
                             if (v.get<int64_t>() < 0) throw Error("--only_class must be >= 0");
                           }};
    for (auto* s : {&conditional, &dropout, &only}) {
      s->structural = true;
      specs.push_back(std::move(*s));
    }
    return specs;
  }

  // The built-in job (the built-in UNet trained from scratch) trains with the recipe that
  // measured best on it (docs/QUALITY.md): v-prediction with min-SNR-5 weighting on the cosine
  // (squaredcos_cap_v2) noise schedule and Adam beta2 0.99, where Diffusers' scripts default to
  // epsilon without weighting on the linear one and beta2 0.999; label dropout 0.1 and validation
  // drawn by DDPM's ancestral sampler (its scheduler's class, as DDPMPipeline) with
  // classifier-free guidance 1.5. Options given win; a pretrained or configured model keeps
  // Diffusers' defaults.
  void configure_training(train::TrainConfig& c) const override {
    const auto unset = [&](const char* name) { return c.given.count(name) == 0; };
    if (c.pretrained_model_name_or_path.empty() && c.model_config_name_or_path.empty()) {
      if (unset("prediction_type")) c.family.values["prediction_type"] = "v_prediction";
      if (unset("snr_gamma")) c.family.values["snr_gamma"] = 5.0;
      if (unset("ddpm_beta_schedule")) c.family.values["ddpm_beta_schedule"] = "squaredcos_cap_v2";
      if (unset("class_dropout_prob")) c.family.values["class_dropout_prob"] = 0.1;
      if (unset("adam_beta2")) c.adam_beta2 = 0.99;
      if (unset("validation_scheduler")) c.validation_scheduler = "ddpm";
      if (unset("guidance_scale") && c.family.number("class_dropout_prob") > 0) {
        c.guidance_scale = 1.5;
      }
    }
    // A fresh UNet guides against its null class, which label dropout trains.
    if (c.guidance_scale && *c.guidance_scale != 1 && c.family.number("class_dropout_prob") <= 0 &&
        c.pretrained_model_name_or_path.empty()) {
      throw Error(
          "--guidance_scale > 1 needs a null class: train with --class_dropout_prob (e.g. 0.1)");
    }
  }
  std::unique_ptr<train::TrainingTask> make_training_task(
      const train::TaskOptions& options) const override {
    return families::unet::make_unet_task(options);
  }

  diffusion::GenerateResult sample(const SampleOptions& a) const override {
    if (!a.prompts.empty() || !a.prompt_file.empty()) {
      throw Error(a.model +
                  " is not a text-to-image pipeline (no text_encoder in model_index.json); "
                  "--prompt needs a Stable Diffusion folder");
    }
    families::unet::UNetPipeline pipeline = families::unet::load_unet_pipeline(a.model, a);
    const std::string scheduler_class = pipeline.sampler->class_name();

    diffusion::GenerateRequest request;
    request.class_labels = parse_labels(a.class_labels);
    request.num_images = a.num_images;
    request.num_inference_steps = a.num_inference_steps;
    request.guidance_scale = a.guidance_scale;
    request.seed = a.seed;
    const bool ddim = scheduler_class == "DDIMScheduler";
    if (!ddim && a.eta != 0.0) {
      log::warn("--eta applies to DDIM only; ignored for {}", scheduler_class);
    }

    const torch::Device device = parse_sample_device(a.device);
    const std::string unet_class = pipeline.unet->config().class_name();
    if (a.dtype) {
      throw Error("--dtype is for text-to-image folders (Stable Diffusion, SDXL, FLUX.1); " +
                  a.model + " is a UNet pipeline: leave --dtype out");
    }
    pipeline.to(device);
    const auto o = pipeline.resolve(request);
    log::info(
        "difftrain sample: model {} ({}) on {}, scheduler {}, {} steps{}, {} images, seed {}{}{}",
        a.model, unet_class, device.str(), scheduler_class, o.num_inference_steps,
        ddim ? fmt::format(" (eta {})", a.eta) : std::string(), o.num_images, a.seed,
        a.guidance_scale > 1 ? fmt::format(", guidance {}", a.guidance_scale) : std::string(),
        a.lora.empty() ? std::string() : fmt::format(", LoRA {} x{}", a.lora, a.lora_scale));
    request.on_step = a.on_step;
    if (a.on_start) a.on_start();
    return pipeline.generate(request);
  }
};

}  // namespace

DIFFTRAIN_BUILTIN_FAMILY(unet, UNetFamily)

}  // namespace difftrain::families
