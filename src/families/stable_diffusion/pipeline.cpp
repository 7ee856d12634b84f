#include "difftrain/families/stable_diffusion/pipeline.h"

#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/families/family.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/models/lora/lora.h"
#include "difftrain/models/module_info.h"
#include "difftrain/models/pretrained.h"

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <mutex>
#include <optional>
#include <set>

namespace difftrain::families::stable_diffusion {
using namespace difftrain::diffusion;
using namespace difftrain::train;
using namespace difftrain::families::unet;

namespace fs = std::filesystem;

namespace {

// A model_index.json entry ["library", "Class"] -> "Class"; [null, null] -> "".
std::string component_class(const std::string& index_path, const std::string& name,
                            const nlohmann::json& value) {
  if (value.is_array() && value.size() == 2) {
    if (value[0].is_null() && value[1].is_null()) return "";
    if (value[1].is_string()) return value[1].get<std::string>();
  }
  throw Error(index_path + ": component \"" + name +
              "\" should be [\"library\", \"ClassName\"] or [null, null], got " + value.dump());
}

std::string require_dir(const fs::path& root, const std::string& name, const std::string& cls) {
  const fs::path dir = root / name;
  if (!fs::is_directory(dir)) {
    throw Error(dir.string() + ": no such folder, but model_index.json lists " + name + " (" + cls +
                "); copy the whole pipeline folder");
  }
  return dir.string();
}

struct ExtensionRegistry {
  std::mutex mutex;
  std::vector<std::shared_ptr<const PipelineExtension>> all;
};

ExtensionRegistry& extension_registry() {
  static ExtensionRegistry e;
  return e;
}

// "text_encoder_2, tokenizer_2"
std::string component_list(const PipelineExtension& e) {
  std::string out;
  for (const auto& [name, classes] : e.components()) out += (out.empty() ? "" : ", ") + name;
  return out;
}

}  // namespace

void register_pipeline_extension(std::shared_ptr<const PipelineExtension> extension) {
  TORCH_CHECK(extension != nullptr, "register_pipeline_extension: a null extension");
  ExtensionRegistry& e = extension_registry();
  std::lock_guard<std::mutex> lock(e.mutex);
  for (const auto& other : e.all) {
    if (other == extension) return;
    for (const auto& [name, classes] : extension->components()) {
      for (const auto& [theirs, their_classes] : other->components()) {
        if (name == theirs) {
          throw Error("register_pipeline_extension: " + extension->display_name() +
                      " claims the component " + name + ", which " + other->display_name() +
                      " already reads; a component belongs to one extension");
        }
      }
    }
  }
  e.all.push_back(std::move(extension));
}

std::vector<std::shared_ptr<const PipelineExtension>> pipeline_extensions() {
  families::families();  // the built-in families register their extensions first
  ExtensionRegistry& e = extension_registry();
  std::lock_guard<std::mutex> lock(e.mutex);
  return e.all;
}

bool is_stable_diffusion_folder(const std::string& dir) {
  const fs::path index = fs::path(dir) / "model_index.json";
  if (!fs::is_regular_file(index)) return false;
  try {
    auto j = nlohmann::json::parse(io::read_file(index.string()));
    return j.is_object() && j.contains("text_encoder") && !j["text_encoder"].is_null() &&
           !(j["text_encoder"].is_array() && !j["text_encoder"].empty() &&
             j["text_encoder"][0].is_null());
  } catch (const std::exception&) {
    return false;
  }
}

StableDiffusionFolder resolve_stable_diffusion_folder(const std::string& dir) {
  const fs::path root(dir);
  if (!fs::is_directory(root)) {
    throw Error(dir +
                ": no such folder; expected a Stable Diffusion folder (model_index.json, unet/, "
                "vae/, text_encoder/, tokenizer/, scheduler/)");
  }
  const fs::path index_path = root / "model_index.json";
  if (!fs::is_regular_file(index_path)) {
    throw Error(dir +
                ": no model_index.json; a Stable Diffusion folder is what Diffusers' "
                "StableDiffusionPipeline.save_pretrained writes");
  }
  StableDiffusionFolder out =
      parse_model_index(io::read_file(index_path.string()), index_path.string());
  out.root = dir;
  out.unet_dir = require_dir(root, "unet", "UNet2DConditionModel");
  out.vae_dir = require_dir(root, "vae", "AutoencoderKL");
  out.text_encoder_dir = require_dir(root, "text_encoder", "CLIPTextModel");
  out.tokenizer_dir = require_dir(root, "tokenizer", "CLIPTokenizer");
  if (out.extension) {
    for (const auto& [name, classes] : out.extension->components()) {
      out.extension_dirs[name] = require_dir(root, name, classes.empty() ? name : classes.front());
    }
  }
  out.scheduler_config = (root / "scheduler" / "scheduler_config.json").string();
  if (!fs::is_regular_file(out.scheduler_config)) {
    throw Error(out.scheduler_config + ": no such file; the pipeline's scheduler/ needs it");
  }
  return out;
}

StableDiffusionFolder parse_model_index(const std::string& json_text,
                                        const std::string& index_path) {
  nlohmann::json index;
  try {
    index = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(index_path + ": not valid JSON (" + e.what() + ")");
  }
  if (!index.is_object()) throw Error(index_path + ": expected a JSON object");
  StableDiffusionFolder out;
  if (index.contains("_class_name") && index["_class_name"].is_string()) {
    out.pipeline_class = index["_class_name"].get<std::string>();
  }
  // Another pipeline with SD-like components (an inpainting or depth UNet, an upscaler) would
  // otherwise load and train as plain text-to-image: refused by name.
  const auto extensions = pipeline_extensions();
  std::set<std::string> known_pipelines = {"StableDiffusionPipeline",
                                           "StableDiffusionImg2ImgPipeline"};
  std::string others;       // " and StableDiffusionXLPipeline folders"
  std::string other_parts;  // " and SDXL folders (the same plus text_encoder_2, tokenizer_2)"
  for (const auto& e : extensions) {
    const auto classes = e->pipeline_classes();
    known_pipelines.insert(classes.begin(), classes.end());
    if (!classes.empty()) others += " and " + classes.front();
    other_parts +=
        " and " + e->display_name() + " folders (the same plus " + component_list(*e) + ")";
  }
  if (!out.pipeline_class.empty() && !known_pipelines.count(out.pipeline_class)) {
    throw Error(index_path + ": pipeline class \"" + out.pipeline_class +
                "\" is not supported; difftrain runs StableDiffusionPipeline (SD 1.x/2.x)" +
                others + " folders (or their Img2Img variants, the same weights)");
  }
  const std::set<std::string> ignored = {"safety_checker", "feature_extractor", "image_encoder"};
  std::map<std::string, std::set<std::string>> supported = {
      {"unet", {"UNet2DConditionModel"}},
      {"vae", {"AutoencoderKL"}},
      {"text_encoder", {"CLIPTextModel"}},
      {"tokenizer", {"CLIPTokenizer", "CLIPTokenizerFast"}},
  };
  for (const auto& e : extensions) {
    for (const auto& [name, classes] : e->components()) {
      supported[name] = std::set<std::string>(classes.begin(), classes.end());
    }
  }
  if (index.contains("force_zeros_for_empty_prompt")) {
    if (!index["force_zeros_for_empty_prompt"].is_boolean()) {
      throw Error(index_path + ": force_zeros_for_empty_prompt must be true or false, got " +
                  index["force_zeros_for_empty_prompt"].dump());
    }
    out.force_zeros_for_empty_prompt = index["force_zeros_for_empty_prompt"].get<bool>();
  }
  std::set<std::string> seen;
  for (const auto& [name, value] : index.items()) {
    if (name.empty() || name[0] == '_' || value.is_boolean()) continue;  // requires_safety_checker
    const std::string cls = component_class(index_path, name, value);
    if (ignored.count(name)) {
      if (!cls.empty()) {
        out.notes.push_back(name + " (" + cls +
                            ") is not used by difftrain: images are not filtered");
      }
      continue;
    }
    if (name == "scheduler") {
      out.scheduler_class = cls;
      seen.insert(name);
      continue;
    }
    auto it = supported.find(name);
    if (it == supported.end()) {
      throw Error(index_path + ": component \"" + name + "\" (" + cls +
                  ") is not supported; difftrain runs Stable Diffusion 1.x/2.x folders "
                  "(unet, vae, text_encoder, tokenizer, scheduler)" +
                  other_parts);
    }
    if (cls.empty()) {
      throw Error(index_path + ": component \"" + name +
                  "\" is null; a text-to-image pipeline needs it");
    }
    if (!it->second.count(cls)) {
      std::string list;
      for (const auto& s : it->second) list += (list.empty() ? "" : ", ") + s;
      throw Error(index_path + ": " + name + " class \"" + cls +
                  "\" is not supported; supported: " + list);
    }
    seen.insert(name);
  }
  // An extension's components come together, and make the folder the extension's.
  for (const auto& e : extensions) {
    std::vector<std::string> listed, missing;
    for (const auto& [name, classes] : e->components()) {
      (seen.count(name) ? listed : missing).push_back(name);
    }
    if (listed.empty()) continue;
    if (!missing.empty()) {
      throw Error(
          index_path + ": lists " + listed.front() + " but no " + missing.front() + "; an " +
          e->display_name() + " folder has " + component_list(*e) + " (" +
          (e->pipeline_classes().empty() ? e->display_name() : e->pipeline_classes().front()) +
          ")");
    }
    if (out.extension) {
      throw Error(index_path + ": lists the components of both " + out.extension->display_name() +
                  " and " + e->display_name() + "; a folder is one pipeline's");
    }
    out.extension = e;
  }
  for (const char* need : {"unet", "vae", "text_encoder", "tokenizer", "scheduler"}) {
    if (!seen.count(need)) {
      throw Error(index_path + ": no \"" + std::string(need) +
                  "\" component; a Stable Diffusion folder lists unet, vae, text_encoder, "
                  "tokenizer and scheduler");
    }
  }
  return out;
}

StableDiffusion load_stable_diffusion(const std::string& dir,
                                      const StableDiffusionLoadOptions& options) {
  StableDiffusion sd;
  sd.folder = resolve_stable_diffusion_folder(dir);
  for (const auto& note : sd.folder.notes) log::info("{}: {}", dir, note);

  // The folder's scheduler class (PNDM for SD-1.x, Euler for SDXL's, ...) or, with --scheduler,
  // another sampler built from its config (Diffusers: `Class.from_config(pipe.scheduler.config)`).
  SamplerOptions so;
  so.eta = options.eta;
  sd.scheduler = load_sampler(sd.folder.scheduler_config, options.scheduler, so);

  sd.text_encoders = load_text_encoders(sd.folder, options.variant);
  if (!options.vae.empty()) log::info("VAE from {} instead of {}", options.vae, sd.folder.vae_dir);
  sd.vae = models::load_autoencoder_kl(options.vae.empty() ? sd.folder.vae_dir : options.vae,
                                       options.vae.empty() ? options.variant : "");
  sd.unet = models::load_unet(sd.folder.unet_dir, options.variant);
  check_unet_fits(sd.folder, sd.unet, sd.text_encoders);
  const auto& ucfg = sd.unet->config();
  if (ucfg.in_channels != sd.vae->config().latent_channels) {
    throw Error(sd.folder.unet_dir + ": in_channels " + std::to_string(ucfg.in_channels) +
                " differs from the VAE's latent_channels " +
                std::to_string(sd.vae->config().latent_channels) + "; the folder mixes models");
  }

  if (!options.lora.empty()) {
    io::LoraWeights lora = io::read_lora(options.lora);
    families::check_lora_fits_family(lora, options.lora, dir);
    auto u = models::merge_lora(*sd.unet, lora, options.lora_scale, "unet");
    int64_t te_merged = 0;
    for (const auto& e : sd.text_encoders.encoders()) {
      if (lora.count(e->component()) == 0) continue;
      te_merged +=
          models::merge_lora(*e->module(), lora, options.lora_scale, e->component()).modules_merged;
    }
    log::info("LoRA {} ({} format): merged into {} UNet and {} text encoder modules, scale {}",
              options.lora, io::format_label(lora), u.modules_merged, te_merged,
              options.lora_scale);
    const int64_t others = u.other_component_targets - te_merged;
    if (others > 0) {
      log::warn("LoRA {}: {} targets for other components were not applied", options.lora, others);
    }
  }
  return sd;
}

TextEncoderStack load_text_encoders(const StableDiffusionFolder& folder,
                                    const std::string& variant) {
  if (folder.extension) return folder.extension->load_text_encoders(folder, variant);
  // StableDiffusionPipeline: one CLIPTextModel's last_hidden_state.
  TextEncoders encoders;
  encoders.push_back(ClipTextEncoder::load(
      {"text_encoder", "tokenizer", folder.text_encoder_dir, folder.tokenizer_dir},
      /*with_projection=*/false, variant));
  return TextEncoderStack(last_hidden_state(), std::move(encoders));
}

void check_unet_fits(const StableDiffusionFolder& folder, const models::UNet& unet,
                     const TextEncoderStack& text) {
  if (!unet->needs_encoder_hidden_states()) {
    throw Error(folder.unet_dir +
                ": the UNet has no cross-attention, so it cannot take text "
                "embeddings; expected a UNet2DConditionModel");
  }
  const auto& ucfg = unet->config();
  const int64_t text_width = text.embed_dim();
  if (ucfg.cross_attention_dim.empty() || ucfg.cross_attention_dim[0] != text_width) {
    throw Error(folder.unet_dir + ": cross_attention_dim " +
                (ucfg.cross_attention_dim.empty() ? std::string("null")
                                                  : std::to_string(ucfg.cross_attention_dim[0])) +
                " differs from the text encoder" +
                (text.size() > 1 ? "s' hidden_size sum " : "'s hidden_size ") +
                std::to_string(text_width) + "; the folder mixes models");
  }
  if (folder.extension) {
    folder.extension->check_unet(folder, unet, text);
  } else if (unet->needs_added_conditioning()) {
    // Which pipeline would give it: the extensions' components.
    std::string wanted;
    for (const auto& e : pipeline_extensions()) {
      wanted += std::string(wanted.empty() ? "" : " or ") + e->display_name() + "'s " +
                component_list(*e);
    }
    throw Error(folder.unet_dir + ": the UNet has addition_embed_type \"" +
                ucfg.addition_embed_type.value_or("") +
                "\", but model_index.json lists no component that gives it" +
                (wanted.empty() ? std::string() : " (" + wanted + ")") +
                "; the folder mixes models");
  }
}

torch::Tensor rescale_noise_cfg(const torch::Tensor& noise_cfg,
                                const torch::Tensor& noise_pred_text, double guidance_rescale) {
  std::vector<int64_t> dims;
  for (int64_t d = 1; d < noise_pred_text.dim(); ++d) dims.push_back(d);
  const torch::Tensor std_text = noise_pred_text.std(dims, /*unbiased=*/true, /*keepdim=*/true);
  const torch::Tensor std_cfg = noise_cfg.std(dims, /*unbiased=*/true, /*keepdim=*/true);
  const torch::Tensor rescaled = noise_cfg * (std_text / std_cfg);
  return guidance_rescale * rescaled + (1 - guidance_rescale) * noise_cfg;
}

TextToImageResult text_to_image(StableDiffusion& sd, const TextToImageOptions& o) {
  if (o.prompts.empty()) throw Error("text-to-image needs at least one prompt (--prompt)");
  if (o.num_images_per_prompt < 1) {
    throw Error("--num_images_per_prompt must be >= 1, got " +
                std::to_string(o.num_images_per_prompt));
  }
  if (o.num_inference_steps < 1) {
    throw Error("--num_inference_steps must be >= 1, got " + std::to_string(o.num_inference_steps));
  }
  const int64_t n = static_cast<int64_t>(o.prompts.size());
  std::vector<std::string> negatives = o.negative_prompts;
  if (negatives.empty()) negatives.assign(o.prompts.size(), "");
  if (negatives.size() == 1 && n > 1) negatives.assign(o.prompts.size(), negatives[0]);
  if (static_cast<int64_t>(negatives.size()) != n) {
    throw Error("got " + std::to_string(negatives.size()) + " negative prompts for " +
                std::to_string(n) + " prompts; give one, or one per prompt");
  }
  const auto& ucfg = sd.unet->config();
  const int64_t factor = sd.vae->config().downsample_factor();
  const int64_t default_side = (ucfg.sample_size.empty() ? 64 : ucfg.sample_size[0]) * factor;
  const int64_t height = o.height > 0 ? o.height : default_side;
  const int64_t width =
      o.width > 0 ? o.width
                  : (ucfg.sample_size.size() > 1 ? ucfg.sample_size[1] * factor : default_side);
  if (height % factor != 0 || width % factor != 0) {
    throw Error("--height " + std::to_string(height) + " and --width " + std::to_string(width) +
                " must be multiples of " + std::to_string(factor) +
                " (the VAE's downsampling factor)");
  }
  const int64_t k = o.num_images_per_prompt;
  const bool guided = o.guidance_scale > 1.0;

  const torch::Device device = models::module_device(*sd.unet);
  const auto dtype = models::module_dtype(*sd.unet);

  sd.unet->eval();
  for (auto* m : sd.text_encoders.modules()) m->eval();
  sd.vae->eval();
  torch::NoGradGuard no_grad;

  if (o.guidance_rescale < 0 || o.guidance_rescale > 1) {
    throw Error("--guidance_rescale must be in [0, 1], got " + std::to_string(o.guidance_rescale));
  }
  torch::Tensor embeds, pooled, time_ids;
  if (sd.folder.extension) {
    const std::vector<std::string> known = sd.folder.extension->option_names();
    for (const auto& [name, value] : o.options.items()) {
      if (std::find(known.begin(), known.end(), name) == known.end()) {
        throw Error("--" + name + " is not an option of " + sd.class_name());
      }
    }
    PromptConditioning c =
        sd.folder.extension->encode_prompts(sd, o, negatives, height, width, guided);
    embeds = c.embeds;
    if (c.text_embeds.defined()) pooled = c.text_embeds.to(device, dtype);
    if (c.time_ids.defined()) time_ids = c.time_ids.to(device, dtype);
  } else {
    if (!o.options.empty()) {
      std::string names;
      for (const auto& [name, value] : o.options.items()) {
        names += (names.empty() ? "--" : ", --") + name;
      }
      throw Error(names + ": not options of " + sd.class_name() + " (" + sd.folder.root + ")");
    }
    // encode_prompt: embeddings repeated K times per prompt (prompt-major), negatives first.
    torch::Tensor cond =
        sd.text_encoders.encode(o.prompts, o.clip_skip).embeds.repeat_interleave(k, 0);
    embeds = cond;
    if (guided) {
      torch::Tensor uncond =
          sd.text_encoders.encode(negatives, o.clip_skip).embeds.repeat_interleave(k, 0);
      embeds = torch::cat({uncond, cond});
    }
  }
  embeds = embeds.to(device, dtype);

  sd.scheduler->set_timesteps(o.num_inference_steps);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  const std::vector<int64_t> shape = {n * k, ucfg.in_channels, height / factor, width / factor};
  torch::Tensor x;
  if (o.latents.defined()) {
    if (o.latents.sizes() != c10::IntArrayRef(shape)) {
      throw Error("initial latents have shape " + c10::str(o.latents.sizes()) + ", expected " +
                  c10::str(c10::IntArrayRef(shape)));
    }
    x = o.latents.to(device, dtype);
  } else {
    // randn_tensor with a CPU generator: drawn on the CPU in float32, then moved.
    x = at::randn(shape, gen, torch::kFloat32).to(device, dtype);
  }
  // prepare_latents scales given and drawn latents alike (1 for DDPM, DDIM, PNDM, DPM-Solver).
  if (sd.scheduler->init_noise_sigma() != 1.0) x = x * sd.scheduler->init_noise_sigma();
  const torch::Tensor timesteps = sd.scheduler->timesteps();
  const int64_t steps = timesteps.size(0);
  models::UNetConditioning uc;
  uc.encoder_hidden_states = embeds;
  uc.text_embeds = pooled;
  uc.time_ids = time_ids;
  for (int64_t i = 0; i < steps; ++i) {
    const double t = sd.scheduler->timestep(i);
    torch::Tensor eps;
    if (guided) {
      const torch::Tensor x_in = sd.scheduler->scale_model_input(torch::cat({x, x}), t);
      auto parts = sd.unet->forward(x_in, timesteps[i], uc).chunk(2, 0);
      eps = parts[0] + o.guidance_scale * (parts[1] - parts[0]);
      if (o.guidance_rescale > 0) eps = rescale_noise_cfg(eps, parts[1], o.guidance_rescale);
    } else {
      eps = sd.unet->forward(sd.scheduler->scale_model_input(x, t), timesteps[i], uc);
    }
    x = sd.scheduler->step(eps, t, x, gen);
    if (o.on_step) o.on_step(i + 1, steps);
  }
  TextToImageResult out;
  out.latents = x.to(torch::kCPU, torch::kFloat32);
  out.prompt_embeds = embeds.to(torch::kCPU, torch::kFloat32);
  if (pooled.defined()) out.pooled_prompt_embeds = pooled.to(torch::kCPU, torch::kFloat32);
  if (time_ids.defined()) out.add_time_ids = time_ids.to(torch::kCPU, torch::kFloat32);
  auto vae_dtype = models::module_dtype(*sd.vae);
  // A VAE that overflows in float16 (SDXL's: black images) says force_upcast in its config, and
  // an extension's pipeline may decode in float32 then (upcast_vae), and back afterwards.
  const bool upcast = sd.folder.extension && sd.folder.extension->upcasts_vae() &&
                      vae_dtype == torch::kFloat16 && sd.vae->config().force_upcast;
  if (upcast) {
    sd.vae->to(torch::kFloat32);
    vae_dtype = torch::kFloat32;
  }
  torch::Tensor decoded = sd.vae->decode(sd.vae->unscale_latents(x.to(vae_dtype)));
  if (upcast) sd.vae->to(torch::kFloat16);
  out.images = (decoded.to(torch::kCPU, torch::kFloat32) / 2 + 0.5)
                   .clamp(0, 1)
                   .permute({0, 2, 3, 1})
                   .contiguous();
  return out;
}

namespace {

GenerateResult generate_text_to_image(StableDiffusion& sd, const GenerateRequest& r) {
  if (!r.class_labels.empty()) throw Error("--class_labels is for class-conditional UNets");
  const int64_t k = r.num_images;
  TextToImageOptions o;
  o.prompts = r.prompts;
  o.negative_prompts = r.negative_prompts;
  o.guidance_scale = *r.guidance_scale;
  o.num_inference_steps = r.num_inference_steps;
  o.height = r.height;
  o.width = r.width;
  o.num_images_per_prompt = k;
  o.seed = r.seed;
  o.clip_skip = r.clip_skip;
  o.guidance_rescale = r.guidance_rescale;
  // The family's own sample options (an extension's: SDXL's micro-conditioning) by name.
  o.options = r.options;
  o.on_step = r.on_step;
  GenerateResult out;
  if (r.seeding == Seeding::kBatch) {
    auto t = text_to_image(sd, o);
    out.images = t.images;
    out.latents = t.latents;
    out.prompt_embeds = t.prompt_embeds;
  } else {
    // text_to_image's own checks, up front, before the first image's run.
    const size_t n = r.prompts.size();
    if (n == 0) throw Error("text-to-image needs at least one prompt (--prompt)");
    if (k < 1) throw Error("--num_images_per_prompt must be >= 1, got " + std::to_string(k));
    const size_t negatives = r.negative_prompts.size();
    if (negatives > 1 && negatives != n) {
      throw Error("got " + std::to_string(negatives) + " negative prompts for " +
                  std::to_string(n) + " prompts; give one, or one per prompt");
    }
    std::vector<torch::Tensor> images, latents, embeds;
    o.num_images_per_prompt = 1;
    for (size_t p = 0; p < n; ++p) {
      o.prompts = {r.prompts[p]};
      if (negatives > 0) o.negative_prompts = {r.negative_prompts[negatives == 1 ? 0 : p]};
      for (int64_t j = 0; j < k; ++j) {
        o.seed = r.seed + static_cast<uint64_t>(static_cast<int64_t>(p) * k + j);
        auto t = text_to_image(sd, o);
        images.push_back(t.images);
        latents.push_back(t.latents);
        embeds.push_back(t.prompt_embeds);
      }
    }
    out.images = torch::cat(images);
    out.latents = torch::cat(latents);
    out.prompt_embeds = torch::cat(embeds);
  }
  out.labels = prompt_labels(r.prompts, k);
  return out;
}

}  // namespace

std::string StableDiffusion::class_name() const {
  if (!folder.pipeline_class.empty()) return folder.pipeline_class;
  if (folder.extension && !folder.extension->pipeline_classes().empty()) {
    return folder.extension->pipeline_classes().front();
  }
  return "StableDiffusionPipeline";
}

void StableDiffusion::to(const torch::Device& device, std::optional<torch::Dtype> dtype) {
  const auto move = [&](torch::nn::Module& m) {
    if (dtype) {
      m.to(device, *dtype);
    } else {
      m.to(device);
    }
  };
  if (text_encoders.empty() || !vae || !unet) {
    throw Error("StableDiffusion::to: the pipeline is missing its text encoder, VAE or UNet");
  }
  text_encoders.to(device, dtype);
  move(*vae);
  move(*unet);
}

GenerateRequest StableDiffusion::resolve(GenerateRequest r) const {
  if (r.num_images == 0) r.num_images = 1;
  if (r.num_inference_steps == 0) r.num_inference_steps = 50;
  // StableDiffusionPipeline's default guidance is 7.5; an extension's pipeline has its own.
  if (!r.guidance_scale) {
    r.guidance_scale = folder.extension ? folder.extension->default_guidance() : 7.5;
  }
  return r;
}

GenerateResult StableDiffusion::generate(const GenerateRequest& request) {
  return generate_text_to_image(*this, resolve(request));
}

}  // namespace difftrain::families::stable_diffusion
