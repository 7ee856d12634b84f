// The FLUX.1 family: FluxPipeline folders (FLUX.1-dev with embedded guidance, FLUX.1-schnell
// without) and bare FluxTransformer2DModel folders. Sampling in flux_pipeline.cpp, LoRA names in
// lora.cpp and merge.cpp, the memory model in memory.cpp.
#include "difftrain/families/family.h"
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/families/flux/lora_layouts.h"
#include "difftrain/train/block_swap_option.h"
#include "difftrain/train/ddpm_options.h"
#include "difftrain/train/flow_matching_options.h"
#include "difftrain/train/text_image_options.h"
#include "flux_family.h"
#include "flux_pipeline.h"

#include <fmt/format.h>

#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <mutex>

namespace difftrain::families {
namespace {
namespace fs = std::filesystem;

// kohya's --timestep_sampling flux_shift (and musubi-tuner's for clips): the sigmoid draw
// shifted by mu on the line through (256, 0.5) and (4096, 1.15) at the packed sequence length of
// one frame, (H / 2) * (W / 2) of the last two axes.
torch::Tensor flux_shift(const torch::Tensor& u, torch::IntArrayRef x0_shape) {
  if (x0_shape.size() != 4 && x0_shape.size() != 5) {
    throw Error(
        "--timestep_sampling flux_shift needs image latents [B, C, H, W] or video latents "
        "[B, C, F, H, W]");
  }
  const int64_t h = x0_shape[x0_shape.size() - 2], w = x0_shape[x0_shape.size() - 1];
  const double m = (1.15 - 0.5) / (4096.0 - 256.0);
  const double mu = m * static_cast<double>((h / 2) * (w / 2)) + (0.5 - m * 256.0);
  return std::exp(mu) / (std::exp(mu) + (1 / u - 1));
}

bool flux_has_component(const nlohmann::json& index, const char* name) {
  return index.contains(name) && index[name].is_array() && index[name].size() == 2 &&
         !index[name][0].is_null();
}

class FluxFamily : public ModelFamily {
 public:
  FluxFamily() {
    static std::once_flag once;
    std::call_once(once, [] {
      diffusion::register_flow_timestep_sampling({"flux_shift", flux_shift});
    });
  }
  std::string name() const override { return "flux"; }
  std::vector<std::string> pipeline_classes() const override { return {"FluxPipeline"}; }
  std::vector<std::string> model_classes() const override { return {"FluxTransformer2DModel"}; }
  bool matches_components(const nlohmann::json& index) const override {
    return flux_has_component(index, "transformer") && flux_has_component(index, "text_encoder_2");
  }
  int component_match_rank() const override { return 3; }  // a transformer, above the UNets
  std::vector<std::string> lora_components() const override {
    return {"transformer", "text_encoder"};
  }
  std::map<std::string, std::string> other_tools_options() const override {
    // kohya's flux_train_network.py: its denoiser's rate and T5's sequence length; the
    // text-to-image group's names; and kohya's min-SNR weighting, which is the DDPM objective's.
    auto table = train::text_image_other_tools_options();
    table.emplace("unet_lr", "--learning_rate");
    table.emplace("t5xxl_max_token_length", "--max_sequence_length");
    table.emplace("min_snr_gamma",
                  "!FLUX.1 trains with flow matching: weigh it with --weighting_scheme (none, "
                  "logit_normal, mode, cosmap, sigma_sqrt) or --timestep_sampling");
    return table;
  }
  void adapt_lora(io::LoraWeights& lora, const std::string& dir,
                  io::LoraFormat format) const override {
    flux::adapt_flux_lora(lora, dir, format);
  }
  models::LoraFolderMergeSummary merge_lora(
      const std::string& dir, const std::string& lora, const std::string& output_dir,
      const models::LoraFolderMergeOptions& options) const override {
    return flux::merge_flux_lora(dir, lora, output_dir, options);
  }
  torch::Tensor forward(const std::string& dir, const std::map<std::string, torch::Tensor>& inputs,
                        const std::string& source, const std::string& lora,
                        double lora_scale) const override {
    return flux::forward_flux(dir, inputs, source, lora, lora_scale);
  }
  std::vector<train::MemoryEstimate> estimate_memory(
      const std::string& model_path, const train::MemoryEstimateOptions& options,
      const std::vector<accel::ShardingStrategy>& strategies) const override {
    return flux::estimate_flux_memory(model_path, options, strategies);
  }
  std::unique_ptr<diffusion::Pipeline> load_pipeline(
      const std::string& dir, const diffusion::PipelineLoadOptions& options) const override {
    return std::make_unique<flux::FluxPipeline>(flux::load_flux_pipeline(dir, options));
  }
  std::optional<train::ScriptDefaults> training_defaults(
      const train::TrainConfig& config) const override {
    // train_dreambooth_lora_flux.py and train_dreambooth_flux.py (which also take captioned
    // folders): the same defaults, LoRA on Diffusers' FLUX targets.
    train::ScriptDefaults d;
    d.script = config.lora ? "train_dreambooth_lora_flux.py" : "train_dreambooth_flux.py";
    d.resolution = 512;
    d.train_batch_size = 4;
    d.num_train_epochs = 1;
    d.learning_rate = 1e-4;
    d.adam_weight_decay = 1e-4;
    d.lora_target_modules = families::flux::diffusers_flux_lora_targets();
    // The UNet validation sampler does not apply (FLUX.1 samples with its folder's
    // FlowMatchEulerDiscreteScheduler); the DDPM objective's options and --clip_skip are not
    // FLUX.1's at all (instead_of_option).
    d.not_applicable = {"validation_scheduler"};
    return d;
  }
  std::vector<io::LoraKeyLayout> lora_key_layouts() const override {
    return {flux::flux_lora_key_layout()};
  }
  // The DDPM objective's options (the UNet families'): FLUX.1 weighs flow matching instead; and
  // CLIP's layer choice, which FLUX.1 has not.
  std::string instead_of_option(const std::string& name) const override {
    if (name == "clip_skip") {
      return "FLUX.1 takes its CLIP's pooled output and T5's last layer, so there is no layer to "
             "skip";
    }
    for (const auto& spec : train::ddpm_option_specs()) {
      if (spec.name == name) {
        return "FLUX.1 trains with flow matching: weigh it with --weighting_scheme (none, "
               "logit_normal, mode, cosmap, sigma_sqrt) or --timestep_sampling";
      }
    }
    return "";
  }
  std::vector<train::OptionSpec> options() const override {
    auto specs = train::flow_matching_option_specs();
    for (auto& spec : train::text_image_option_specs()) specs.push_back(std::move(spec));
    train::OptionSpec length{"max_sequence_length", "int", 512,
                             "T5 tokens of each caption (Diffusers' FLUX scripts' flag)",
                             [](const nlohmann::json& v, const std::string& where) {
                               const int64_t n = v.get<int64_t>();
                               if (n < 1 || n > 512) {
                                 throw Error(where +
                                             " must be in 1..512 (FLUX.1's T5 takes up "
                                             "to 512 tokens)");
                               }
                             }};
    length.structural = true;  // the cached text embeddings and the run's captions
    specs.push_back(std::move(length));
    specs.push_back(train::block_swap_option_spec());
    return specs;
  }
  std::vector<train::OptionSpec> sample_options() const override {
    train::OptionSpec prompt_2{"prompt_2",
                               "string",
                               nlohmann::json::array(),
                               "the prompt for the T5 encoder (repeat for several; default: "
                               "--prompt)",
                               {}};
    prompt_2.values = -1;
    train::OptionSpec length{"max_sequence_length", "int?", nullptr,
                             "T5 tokens per prompt, padded or cut (default 512)",
                             train::range_check(1, 512)};
    return {std::move(prompt_2), std::move(length)};
  }
  std::unique_ptr<train::TrainingTask> make_training_task(
      const train::TaskOptions& options) const override {
    return flux::make_flux_training_task(options);
  }
  diffusion::GenerateResult sample(const SampleOptions& a) const override {
    // families::sample() parses the family's options; a library caller may leave them out.
    const train::FamilyOptions own =
        a.family.specs.empty() ? parse_family_flags(name(), sample_options(), {}) : a.family;
    diffusion::GenerateRequest request;
    request.prompts = sample_prompts(a, "FLUX.1");
    request.prompts_2 = own.at("prompt_2").get<std::vector<std::string>>();
    if (!a.class_labels.empty()) throw Error("--class_labels is for class-conditional UNets");
    if (!a.negative_prompt.empty()) {
      throw Error(
          "FluxPipeline takes no negative prompt (FLUX.1 samples without classifier-free "
          "guidance); leave --negative_prompt out");
    }
    if (a.clip_skip != 1) throw Error("--clip_skip does not apply to FLUX.1 (its CLIP is pooled)");
    if (a.guidance_rescale != 0) throw Error("--guidance_rescale does not apply to FLUX.1");
    if (a.guidance_given) request.guidance_scale = a.guidance_scale;
    request.num_inference_steps = a.num_inference_steps;
    request.height = a.height;
    request.width = a.width;
    const auto& length = own.at("max_sequence_length");
    request.max_sequence_length = length.is_null() ? 0 : length.get<int64_t>();
    request.num_images = a.num_images > 0 ? a.num_images : a.num_images_per_prompt;
    request.seed = a.seed;
    const torch::Device device = parse_sample_device(a.device);
    flux::FluxPipeline pipe = flux::load_flux_pipeline(a.model, a);
    pipe.to(device);
    const auto o = pipe.resolve(request);
    const bool guided = pipe.transformer->options().guidance_embeds();
    if (!guided && a.guidance_given) {
      log::warn("--guidance_scale {} is ignored: {} has no guidance embedding (FLUX.1-schnell)",
                a.guidance_scale, a.model);
    }
    log::info(
        "difftrain sample: {} (FluxPipeline) on {}, {} steps, {}, max_sequence_length {}, {} "
        "prompt(s) x {} image(s), {}x{}, seed {}{}",
        a.model, device.str(), o.num_inference_steps,
        guided ? fmt::format("guidance {}", *o.guidance_scale) : std::string("no guidance"),
        o.max_sequence_length, o.prompts.size(), o.num_images, o.height, o.width, a.seed,
        a.lora.empty() ? std::string() : fmt::format(", LoRA {} x{}", a.lora, a.lora_scale));
    request.on_step = a.on_step;
    if (a.on_start) a.on_start();
    return pipe.generate(request);
  }
};

}  // namespace

DIFFTRAIN_BUILTIN_FAMILY(flux, FluxFamily)

}  // namespace difftrain::families
