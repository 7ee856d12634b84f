#include "difftrain/families/unet/pipeline.h"

#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/families/family.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/models/lora/lora.h"
#include "difftrain/models/module_info.h"
#include "difftrain/models/pretrained.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>

namespace difftrain::families::unet {
using namespace difftrain::diffusion;

namespace fs = std::filesystem;

PipelineFolder resolve_pipeline_folder(const std::string& dir) {
  if (!fs::is_directory(dir)) {
    throw Error(dir +
                ": no such folder; expected a Diffusers pipeline folder (model_index.json, "
                "unet/, scheduler/) or a UNet folder with scheduler_config.json");
  }
  PipelineFolder out;
  const fs::path root(dir);
  if (fs::exists(root / "model_index.json")) {
    nlohmann::json index;
    try {
      index = nlohmann::json::parse(io::read_file((root / "model_index.json").string()));
    } catch (const nlohmann::json::exception& e) {
      throw Error((root / "model_index.json").string() + ": not valid JSON (" + e.what() + ")");
    }
    if (index.is_object() && index.contains("_class_name") && index["_class_name"].is_string()) {
      out.pipeline_class = index["_class_name"].get<std::string>();
    }
    out.unet_dir = (root / "unet").string();
    out.scheduler_config = (root / "scheduler" / "scheduler_config.json").string();
    if (!fs::is_directory(out.unet_dir)) {
      throw Error(dir +
                  ": pipeline folder without unet/; expected unet/config.json and "
                  "unet/diffusion_pytorch_model.safetensors");
    }
    if (!fs::exists(out.scheduler_config)) {
      throw Error(out.scheduler_config +
                  ": no such file; a pipeline folder needs "
                  "scheduler/scheduler_config.json");
    }
    return out;
  }
  if (fs::exists(root / "config.json")) {
    out.unet_dir = dir;
    out.scheduler_config = (root / "scheduler_config.json").string();
    if (!fs::exists(out.scheduler_config)) {
      throw Error(out.scheduler_config +
                  ": no such file; put the noise scheduler's scheduler_config.json beside the "
                  "UNet's config.json, or pass a pipeline folder with model_index.json");
    }
    return out;
  }
  throw Error(dir +
              ": neither model_index.json (pipeline folder) nor config.json (UNet folder) "
              "found");
}

models::UNet load_unet_with_lora(const std::string& unet_dir, const std::string& lora_path,
                                 double lora_scale) {
  models::UNet unet = models::load_unet(unet_dir);
  if (!lora_path.empty()) {
    io::LoraWeights lora = io::read_lora(lora_path);
    families::check_lora_fits_family(lora, lora_path, unet_dir);
    auto summary = models::merge_lora(*unet, lora, lora_scale, "unet");
    log::info("LoRA {} ({} format): merged into {} UNet modules with lora_scale {}", lora_path,
              io::format_label(lora), summary.modules_merged, lora_scale);
    if (summary.other_component_targets > 0) {
      log::warn("LoRA {}: {} targets for other components (text encoders) were not applied",
                lora_path, summary.other_component_targets);
    }
  }
  return unet;
}

std::string resolve_unet_dir(const std::string& dir) {
  if (fs::exists(fs::path(dir) / "model_index.json")) return (fs::path(dir) / "unet").string();
  return dir;
}

torch::Tensor forward_from_tensors(models::UNetImpl& unet,
                                   const std::map<std::string, torch::Tensor>& inputs,
                                   const std::string& source) {
  for (const auto& [name, t] : inputs) {
    if (name != "sample" && name != "timestep" && name != "class_labels" &&
        name != "encoder_hidden_states" && name != "timestep_cond" && name != "text_embeds" &&
        name != "time_ids" && name != "out") {
      log::warn("{}: tensor \"{}\" is not an input of the UNet; ignored", source, name);
    }
  }
  for (const char* required : {"sample", "timestep"}) {
    if (!inputs.count(required)) {
      throw Error(source + ": no tensor named \"" + required +
                  "\"; expected sample [B,C,H,W], timestep [] or [B], and optionally "
                  "class_labels [B], encoder_hidden_states [B,S,D]");
    }
  }
  models::UNetConditioning cond;
  auto take = [&](const char* name) {
    auto it = inputs.find(name);
    return it == inputs.end() ? torch::Tensor() : it->second;
  };
  cond.class_labels = take("class_labels");
  cond.encoder_hidden_states = take("encoder_hidden_states");
  cond.timestep_cond = take("timestep_cond");
  cond.text_embeds = take("text_embeds");
  cond.time_ids = take("time_ids");
  torch::Tensor sample = inputs.at("sample");
  if (!sample.is_floating_point()) {
    throw Error(source + ": \"sample\" must be floating point, got " +
                std::string(c10::toString(sample.scalar_type())));
  }
  unet.eval();
  torch::NoGradGuard no_grad;
  return unet.forward(sample.to(torch::kFloat32), inputs.at("timestep"), cond);
}

torch::Tensor sample_images(models::UNetImpl& unet, Sampler& scheduler, const SampleOptions& o) {
  const auto& cfg = unet.config();
  if (unet.needs_encoder_hidden_states()) {
    throw Error(cfg.class_name() +
                " with cross-attention needs text embeddings; sampling it "
                "needs the text encoder, which `difftrain sample` does not "
                "load for this folder (use `difftrain forward` with "
                "encoder_hidden_states)");
  }
  if (o.num_images < 1)
    throw Error("--num_images must be >= 1, got " + std::to_string(o.num_images));
  const bool class_conditional = cfg.num_class_embeds.has_value() && !cfg.class_embed_type;
  std::vector<int64_t> labels = o.class_labels;
  if (class_conditional) {
    if (labels.empty()) {
      throw Error(cfg.class_name() + " is class-conditional (num_class_embeds " +
                  std::to_string(*cfg.num_class_embeds) + "); pass --class_labels");
    }
    if (static_cast<int64_t>(labels.size()) != o.num_images) {
      throw Error("--class_labels has " + std::to_string(labels.size()) + " entries for " +
                  std::to_string(o.num_images) + " images; give one label per image");
    }
    for (int64_t l : labels) {
      if (l < 0 || l >= *cfg.num_class_embeds) {
        throw Error("class label " + std::to_string(l) + " is outside [0, " +
                    std::to_string(*cfg.num_class_embeds) + ") (the model's num_class_embeds)");
      }
    }
  } else if (!labels.empty()) {
    throw Error(
        "--class_labels given, but the model is not class-conditional (num_class_embeds "
        "is null)");
  } else if (cfg.class_embed_type) {
    throw Error(cfg.class_name() + " with class_embed_type \"" + *cfg.class_embed_type +
                "\" cannot be sampled without its conditioning input");
  }
  const bool guided = o.guidance_scale > 1.0;
  if (guided && !class_conditional) {
    throw Error("--guidance_scale > 1 needs a class-conditional model (num_class_embeds)");
  }
  const int64_t h = o.height > 0 ? o.height : (cfg.sample_size.empty() ? 0 : cfg.sample_size[0]);
  const int64_t w = o.width > 0 ? o.width : (cfg.sample_size.empty() ? 0 : cfg.sample_size[1]);
  if (h <= 0 || w <= 0) {
    throw Error("the UNet's config has no sample_size; give the image size explicitly");
  }

  // DDPMPipeline's default is 1000 steps, DDIMPipeline's (and every other sampler's) 50.
  const bool ddpm = scheduler.class_name() == "DDPMScheduler";
  const int64_t steps = o.num_inference_steps > 0 ? o.num_inference_steps : (ddpm ? 1000 : 50);
  scheduler.set_timesteps(steps);

  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  // DDPMPipeline / DDIMPipeline: randn_tensor((batch, in_channels, H, W), generator) in float32.
  // The draws come from the CPU generator (as randn_tensor does for a CPU generator) and then move
  // to the UNet's device and dtype, so a seed gives the same images on any device. Samplers
  // whose initial noise is not unit (Euler) scale it, as the Stable Diffusion pipelines do
  // (DDPM and DDIM: 1, so their images are DDPMPipeline's exactly).
  const torch::Device device = models::module_device(unet);
  const auto dtype = models::module_dtype(unet);
  torch::Tensor x =
      at::randn({o.num_images, cfg.in_channels, h, w}, gen, torch::kFloat32).to(device, dtype);
  if (scheduler.init_noise_sigma() != 1.0) x = x * scheduler.init_noise_sigma();
  models::UNetConditioning cond;
  torch::Tensor null_labels;
  if (class_conditional) {
    cond.class_labels = torch::tensor(labels, torch::kLong).to(device);
    if (guided) {
      null_labels = torch::full({o.num_images}, *cfg.num_class_embeds - 1, torch::kLong).to(device);
      cond.class_labels = torch::cat({cond.class_labels, null_labels});
    }
  }
  unet.eval();
  torch::NoGradGuard no_grad;
  const torch::Tensor timesteps = scheduler.timesteps();
  const int64_t n = timesteps.size(0);
  for (int64_t i = 0; i < n; ++i) {
    const double t = scheduler.timestep(i);
    const torch::Tensor x_in = scheduler.scale_model_input(x, t);
    torch::Tensor eps;
    if (guided) {
      torch::Tensor both = unet.forward(torch::cat({x_in, x_in}), timesteps[i], cond);
      auto parts = both.chunk(2, 0);
      eps = parts[1] + o.guidance_scale * (parts[0] - parts[1]);
    } else {
      eps = unet.forward(x_in, timesteps[i], cond);
    }
    x = scheduler.step(eps, t, x, gen);
    if (o.on_step) o.on_step(i + 1, n);
  }
  return (x.to(torch::kCPU, torch::kFloat32) / 2 + 0.5)
      .clamp(0, 1)
      .permute({0, 2, 3, 1})
      .contiguous();
}

namespace {

GenerateResult generate_unet(UNetPipeline& p, const GenerateRequest& r) {
  if (!p.unet || !p.sampler) throw Error("generate: the UNet pipeline has no UNet or no sampler");
  if (!r.prompts.empty() || !r.negative_prompts.empty()) {
    throw Error(
        "generate: prompts given, but this is a UNet pipeline without a text encoder; "
        "text-to-image needs a Stable Diffusion folder");
  }
  const int64_t k = r.num_images;
  SampleOptions o;
  o.num_images = k;
  o.num_inference_steps = r.num_inference_steps;
  o.class_labels = r.class_labels;
  o.guidance_scale = *r.guidance_scale;
  o.seed = r.seed;
  o.height = r.height;
  o.width = r.width;
  o.on_step = r.on_step;
  GenerateResult out;
  if (r.seeding == Seeding::kBatch) {
    out.images = sample_images(*p.unet, *p.sampler, o);
  } else {
    if (k < 1) throw Error("--num_images must be >= 1, got " + std::to_string(k));
    if (!r.class_labels.empty() && static_cast<int64_t>(r.class_labels.size()) != k) {
      throw Error("--class_labels has " + std::to_string(r.class_labels.size()) + " entries for " +
                  std::to_string(k) + " images; give one label per image");
    }
    std::vector<torch::Tensor> images;
    for (int64_t i = 0; i < k; ++i) {
      o.num_images = 1;
      o.seed = r.seed + static_cast<uint64_t>(i);
      if (!r.class_labels.empty()) o.class_labels = {r.class_labels[static_cast<size_t>(i)]};
      images.push_back(sample_images(*p.unet, *p.sampler, o));
    }
    out.images = torch::cat(images);
  }
  for (int64_t i = 0; i < k; ++i) {
    if (!r.class_labels.empty()) {
      out.labels.push_back(fmt::format("class {}", r.class_labels[static_cast<size_t>(i)]));
    } else if (r.seeding == Seeding::kBatch) {
      out.labels.push_back(fmt::format("seed {} #{}", r.seed, i));
    } else {
      out.labels.push_back(fmt::format("seed {}", r.seed + static_cast<uint64_t>(i)));
    }
  }
  return out;
}

}  // namespace

std::unique_ptr<Sampler> load_pipeline_sampler(const PipelineFolder& folder,
                                               const std::string& scheduler, double eta) {
  std::string kind = scheduler;
  // DDIMPipeline turns whatever scheduler it is given into a DDIMScheduler.
  if (kind.empty() && folder.pipeline_class == "DDIMPipeline") kind = "ddim";
  SamplerOptions options;
  options.eta = eta;
  return load_sampler(folder.scheduler_config, kind, options);
}

UNetPipeline::UNetPipeline(models::UNet unet_, std::unique_ptr<Sampler> sampler_,
                           PipelineFolder folder_)
    : folder(std::move(folder_)), unet(std::move(unet_)), sampler(std::move(sampler_)) {}

std::string UNetPipeline::class_name() const {
  if (!folder.pipeline_class.empty()) return folder.pipeline_class;
  return sampler && sampler->class_name() == "DDIMScheduler" ? "DDIMPipeline" : "DDPMPipeline";
}

void UNetPipeline::to(const torch::Device& device, std::optional<torch::Dtype> dtype) {
  if (!unet) throw Error("UNetPipeline::to: the pipeline has no UNet");
  if (dtype) {
    unet->to(device, *dtype);
  } else {
    unet->to(device);
  }
}

GenerateRequest UNetPipeline::resolve(GenerateRequest r) const {
  if (r.num_images == 0) {
    r.num_images = std::max<int64_t>(1, static_cast<int64_t>(r.class_labels.size()));
  }
  // DDPMPipeline's default is 1000 steps, DDIMPipeline's (and every other sampler's) 50.
  if (r.num_inference_steps == 0) {
    const bool ddpm = sampler && sampler->class_name() == "DDPMScheduler";
    r.num_inference_steps = ddpm ? 1000 : 50;
  }
  if (!r.guidance_scale) r.guidance_scale = 1.0;
  return r;
}

GenerateResult UNetPipeline::generate(const GenerateRequest& request) {
  return generate_unet(*this, resolve(request));
}

UNetPipeline load_unet_pipeline(const std::string& dir, const PipelineLoadOptions& options) {
  if (!options.variant.empty() || !options.vae.empty()) {
    log::warn("{} is a UNet pipeline: --variant and --vae apply to text-to-image folders; ignored",
              dir);
  }
  PipelineFolder folder = resolve_pipeline_folder(dir);
  auto sampler = load_pipeline_sampler(folder, options.scheduler, options.eta);
  auto unet = load_unet_with_lora(folder.unet_dir, options.lora, options.lora_scale);
  return UNetPipeline(std::move(unet), std::move(sampler), std::move(folder));
}

}  // namespace difftrain::families::unet
