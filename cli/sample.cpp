// `difftrain sample`: images from a Diffusers pipeline folder (DDPMPipeline / DDIMPipeline
// semantics, same seed -> same images), written as a labelled PNG grid and optionally as tensors.

#include "commands.h"
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/diffusion/generate.h"
#include "difftrain/diffusion/pipeline.h"
#include "difftrain/diffusion/sampler.h"
#include "difftrain/diffusion/sd_pipeline.h"
#include "difftrain/distributed/process_group.h"
#include "difftrain/io/image.h"
#include "difftrain/io/prompt_file.h"
#include "difftrain/io/safetensors.h"

#include <torch/cuda.h>

#include <chrono>
#include <optional>
#include <sstream>

namespace difftrain::cli {

namespace {

std::string join_names(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

struct SampleArgs {
  std::string model;
  std::string lora;
  double lora_scale = 1.0;
  std::string scheduler;
  int64_t num_inference_steps = 0;
  double eta = 0.0;
  int64_t num_images = 0;
  std::string class_labels;
  double guidance_scale = 1.0;
  uint64_t seed = 0;
  std::string output = "samples.png";
  std::string save_tensors;
  int64_t columns = 0;
  // text-to-image (Stable Diffusion folders)
  std::vector<std::string> prompts;
  std::string prompt_file;
  std::string negative_prompt;
  int64_t num_images_per_prompt = 1;
  int64_t height = 0, width = 0;
  int64_t clip_skip = 1;
  std::string variant;
  std::string device = "auto";
  double guidance_rescale = 0.0;
  std::string vae;
  std::vector<int64_t> original_size, crops_coords_top_left, target_size;
  std::vector<int64_t> negative_original_size, negative_crops_coords_top_left, negative_target_size;
  bool guidance_given = false;
} g_args;

// --device: "auto" (the first CUDA device when one is visible, else the CPU), "cpu", "cuda" or
// "cuda:N", as in Diffusers' pipe.to(device).
torch::Device parse_sample_device(const std::string& text) {
  if (text == "auto") {
    return torch::cuda::is_available() ? torch::Device(torch::kCUDA, 0)
                                       : torch::Device(torch::kCPU);
  }
  std::optional<torch::Device> device;
  try {
    device = torch::Device(text);
  } catch (const std::exception&) {
  }
  if (!device || (!device->is_cpu() && !device->is_cuda())) {
    throw Error("--device '" + text + "' is not a device: use auto, cpu, cuda or cuda:N");
  }
  if (device->is_cuda()) {
    const auto count = torch::cuda::is_available() ? torch::cuda::device_count() : 0;
    if (count == 0) {
      throw Error("--device " + text +
                  ": no CUDA device is visible to this LibTorch (check `difftrain env`); use "
                  "--device cpu");
    }
    if (device->has_index() && device->index() >= static_cast<int64_t>(count)) {
      throw Error(fmt::format("--device {}: only {} CUDA device(s) are visible", text, count));
    }
  }
  return *device;
}

// A denoising-step callback that logs step, it/s and ETA every two seconds (and at the end).
std::function<void(int64_t, int64_t)> progress_logger(std::chrono::steady_clock::time_point start) {
  auto last = std::make_shared<std::chrono::steady_clock::time_point>(start);
  return [start, last](int64_t i, int64_t n) {
    auto now = std::chrono::steady_clock::now();
    if (i != n && now - *last < std::chrono::seconds(2)) return;
    *last = now;
    const double elapsed = std::chrono::duration<double>(now - start).count();
    const double rate = i / std::max(elapsed, 1e-9);
    log::info("step {}/{}  {:.2f} it/s  ETA {:.0f}s", i, n, rate, (n - i) / rate);
  };
}

// Prompts from --prompt (repeatable) or --prompt_file (io::read_prompt_file's rules); sampling
// needs at least one.
std::vector<std::string> read_prompts(const SampleArgs& a) {
  if (!a.prompts.empty() && !a.prompt_file.empty()) {
    throw Error("give --prompt or --prompt_file, not both");
  }
  if (!a.prompt_file.empty()) {
    auto prompts = io::read_prompt_file(a.prompt_file);
    if (prompts.empty()) throw Error("--prompt_file " + a.prompt_file + " has no prompts");
    return prompts;
  }
  if (a.prompts.empty()) {
    throw Error("a Stable Diffusion folder needs --prompt \"...\" (or --prompt_file F)");
  }
  return a.prompts;
}

// Writes the grid (and --save_tensors) and logs the rate.
void write_outputs(const SampleArgs& a, const diffusion::GenerateResult& result, double seconds) {
  io::save_image_grid(a.output, result.images, result.labels, a.columns);
  if (!a.save_tensors.empty()) {
    io::save_safetensors(a.save_tensors, result.tensors(), {{"format", "np"}});
  }
  const int64_t total = result.images.size(0);
  log::info("wrote {} ({} images, {:.2f} images/s){}", a.output, total,
            total / std::max(seconds, 1e-9),
            a.save_tensors.empty() ? std::string() : " and " + a.save_tensors);
}

// `difftrain sample --model SD_DIR --prompt ...`: StableDiffusionPipeline semantics.
int run_text_to_image(const SampleArgs& a) {
  diffusion::StableDiffusionLoadOptions lo;
  lo.variant = a.variant;
  lo.scheduler = a.scheduler;
  lo.eta = a.eta;
  lo.lora = a.lora;
  lo.lora_scale = a.lora_scale;
  lo.vae = a.vae;
  diffusion::GenerateRequest request;
  request.prompts = read_prompts(a);
  if (!a.class_labels.empty()) throw Error("--class_labels is for class-conditional UNets");
  if (!a.negative_prompt.empty()) request.negative_prompts = {a.negative_prompt};
  if (a.guidance_given) request.guidance_scale = a.guidance_scale;
  request.num_inference_steps = a.num_inference_steps;
  request.height = a.height;
  request.width = a.width;
  request.num_images = a.num_images > 0 ? a.num_images : a.num_images_per_prompt;
  request.seed = a.seed;
  request.clip_skip = a.clip_skip - 1;
  request.guidance_rescale = a.guidance_rescale;
  request.original_size = a.original_size;
  request.crops_coords_top_left = a.crops_coords_top_left;
  request.target_size = a.target_size;
  request.negative_original_size = a.negative_original_size;
  request.negative_crops_coords_top_left = a.negative_crops_coords_top_left;
  request.negative_target_size = a.negative_target_size;
  const torch::Device device = parse_sample_device(a.device);
  diffusion::Pipeline pipeline = diffusion::load_stable_diffusion(a.model, lo);
  diffusion::pipeline_to(pipeline, device);
  const auto& sd = std::get<diffusion::StableDiffusion>(pipeline);
  const bool micro = !a.original_size.empty() || !a.crops_coords_top_left.empty() ||
                     !a.target_size.empty() || !a.negative_original_size.empty() ||
                     !a.negative_crops_coords_top_left.empty() || !a.negative_target_size.empty();
  if (micro && !sd.is_xl()) {
    throw Error(
        "--original_size, --crops_coords_top_left and --target_size are SDXL's "
        "micro-conditioning; " +
        a.model + " is a Stable Diffusion 1.x/2.x folder");
  }
  if (request.clip_skip >= sd.text_encoder->config().num_hidden_layers) {
    throw Error("--clip_skip " + std::to_string(a.clip_skip) + " is more than the text encoder's " +
                std::to_string(sd.text_encoder->config().num_hidden_layers) + " layers");
  }
  const auto o = diffusion::resolve_request(pipeline, request);
  log::info(
      "difftrain sample: {} ({}) on {}, scheduler {}, {} steps, guidance {}, {} prompt(s) x {} "
      "image(s), seed {}{}",
      a.model, sd.folder.pipeline_class, device.str(), sd.scheduler->class_name(),
      o.num_inference_steps, *o.guidance_scale, o.prompts.size(), o.num_images, a.seed,
      a.lora.empty() ? std::string() : fmt::format(", LoRA {} x{}", a.lora, a.lora_scale));
  for (size_t i = 0; i < o.prompts.size(); ++i) {
    const auto enc = sd.tokenizer.encode(o.prompts[i]);
    if (enc.truncated) {
      log::warn("prompt {} has {} tokens; only the first {} are used", i, enc.num_tokens,
                sd.tokenizer.model_max_length() - 2);
    }
  }
  const auto start = std::chrono::steady_clock::now();
  request.on_step = progress_logger(start);
  const auto result = diffusion::generate(pipeline, request);
  write_outputs(a, result,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return 0;
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

}  // namespace

namespace {
CLI::Option* g_guidance = nullptr;
bool app_guidance_given() { return g_guidance != nullptr && g_guidance->count() > 0; }
}  // namespace

CLI::App* add_sample_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "sample",
      "Generate images: text-to-image from a Stable Diffusion folder (--prompt), or a DDPM/DDIM "
      "UNet pipeline (Diffusers semantics: the same seed gives the same images); writes a "
      "labelled PNG grid");
  cmd->add_option("--model", g_args.model,
                  "Pipeline folder (model_index.json + unet/ + scheduler/, with vae/ text_encoder/ "
                  "tokenizer/ for Stable Diffusion) or a UNet folder with scheduler_config.json "
                  "beside config.json")
      ->required();
  cmd->add_option("--lora", g_args.lora,
                  "LoRA weights to merge first (.safetensors: Diffusers, PEFT or kohya keys)");
  cmd->add_option("--lora_scale", g_args.lora_scale, "Multiplier of the LoRA update (default 1)");
  cmd->add_option("--scheduler", g_args.scheduler,
                  "the sampler: " + join_names(diffusion::sampler_names()) +
                      ", or a Diffusers scheduler class (default: the folder's scheduler)");
  cmd->add_option("--num_inference_steps", g_args.num_inference_steps,
                  "Denoising steps (default: DDPM 1000, other samplers 50)")
      ->check(CLI::Range(int64_t{1}, int64_t{100000}));
  cmd->add_option("--eta", g_args.eta, "DDIM eta: 0 deterministic, 1 DDPM-like noise")
      ->check(CLI::Range(0.0, 10.0));
  cmd->add_option("--num_images", g_args.num_images,
                  "Images to generate (default: one per class label, else 1)")
      ->check(CLI::Range(int64_t{1}, int64_t{4096}));
  cmd->add_option("--class_labels", g_args.class_labels,
                  "Comma-separated class ids for class-conditional models, one per image");
  g_guidance = cmd->add_option("--guidance_scale", g_args.guidance_scale,
                               "Classifier-free guidance scale (> 1 guides against the null class)")
                   ->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--seed", g_args.seed, "Seed of the CPU generator (default 0)");
  cmd->add_option("--output", g_args.output, "PNG grid to write (default samples.png)");
  cmd->add_option("--save_tensors", g_args.save_tensors,
                  "Also write `images` [K,H,W,C] float32 in [0,1] to this .safetensors file");
  cmd->add_option("--columns", g_args.columns, "Grid columns (default: about square)")
      ->check(CLI::Range(int64_t{0}, int64_t{4096}));
  cmd->add_option("--prompt", g_args.prompts,
                  "Stable Diffusion folders: the prompt (repeat for several)");
  cmd->add_option("--prompt_file", g_args.prompt_file, "Prompts, one per line");
  cmd->add_option("--negative_prompt", g_args.negative_prompt,
                  "Guide away from this text (default \"\")");
  cmd->add_option("--num_images_per_prompt", g_args.num_images_per_prompt,
                  "Images per prompt (default 1)")
      ->check(CLI::Range(int64_t{1}, int64_t{4096}));
  cmd->add_option("--height", g_args.height, "Image height in pixels (default: the model's)")
      ->check(CLI::Range(int64_t{8}, int64_t{8192}));
  cmd->add_option("--width", g_args.width, "Image width in pixels (default: the model's)")
      ->check(CLI::Range(int64_t{8}, int64_t{8192}));
  cmd->add_option("--clip_skip", g_args.clip_skip,
                  "Text embeddings from this CLIP layer counted from the end, as kohya: 1 = last "
                  "(default), 2 = penultimate")
      ->check(CLI::Range(int64_t{1}, int64_t{64}));
  cmd->add_option("--guidance_rescale", g_args.guidance_rescale,
                  "Rescale the guided noise to the text prediction's std by this fraction "
                  "(Diffusers' guidance_rescale, 0 = off; 0.7 for zero-terminal-SNR models)")
      ->check(CLI::Range(0.0, 1.0));
  auto pair = [&](const char* name, std::vector<int64_t>& into, const char* help) {
    cmd->add_option(name, into, help)->expected(2)->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  };
  pair("--original_size", g_args.original_size,
       "SDXL: the size the image claims to come from, H W (default: --height --width)");
  pair("--crops_coords_top_left", g_args.crops_coords_top_left,
       "SDXL: the crop's top-left corner, TOP LEFT (default 0 0)");
  pair("--target_size", g_args.target_size, "SDXL: the target size, H W (default: the output's)");
  pair("--negative_original_size", g_args.negative_original_size,
       "SDXL: original size of the negative conditioning (default: --original_size)");
  pair("--negative_crops_coords_top_left", g_args.negative_crops_coords_top_left,
       "SDXL: crop corner of the negative conditioning (default: --crops_coords_top_left)");
  pair("--negative_target_size", g_args.negative_target_size,
       "SDXL: target size of the negative conditioning (default: --target_size)");
  cmd->add_option("--pretrained_vae_model_name_or_path,--vae", g_args.vae,
                  "An AutoencoderKL folder used instead of the pipeline's vae/ (e.g. SDXL's "
                  "fp16-safe VAE)");
  cmd->add_option("--variant", g_args.variant, "Weights variant, e.g. fp16");
  cmd->add_option("--device", g_args.device,
                  "Where to run: auto (the first CUDA device if one is visible, else the CPU), "
                  "cpu, cuda or cuda:N (default auto). The noise comes from the CPU generator, "
                  "so a seed gives the same images on any device");
  return cmd;
}

int run_sample() {
  distributed::configure_threads();
  SampleArgs& a = g_args;
  a.guidance_given = app_guidance_given();
  if (diffusion::is_stable_diffusion_folder(a.model)) return run_text_to_image(a);
  if (!a.prompts.empty() || !a.prompt_file.empty()) {
    throw Error(a.model +
                " is not a text-to-image pipeline (no text_encoder in model_index.json); "
                "--prompt needs a Stable Diffusion folder");
  }
  diffusion::UNetPipeline unet_pipeline;
  unet_pipeline.folder = diffusion::resolve_pipeline_folder(a.model);
  unet_pipeline.sampler =
      diffusion::load_pipeline_sampler(unet_pipeline.folder, a.scheduler, a.eta);
  const std::string scheduler_class = unet_pipeline.sampler->class_name();

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
  unet_pipeline.unet =
      diffusion::load_unet_with_lora(unet_pipeline.folder.unet_dir, a.lora, a.lora_scale);
  const std::string unet_class = unet_pipeline.unet->config().class_name();
  diffusion::Pipeline pipeline = std::move(unet_pipeline);
  diffusion::pipeline_to(pipeline, device);
  const auto o = diffusion::resolve_request(pipeline, request);
  log::info(
      "difftrain sample: model {} ({}) on {}, scheduler {}, {} steps{}, {} images, seed {}{}{}",
      a.model, unet_class, device.str(), scheduler_class, o.num_inference_steps,
      ddim ? fmt::format(" (eta {})", a.eta) : std::string(), o.num_images, a.seed,
      a.guidance_scale > 1 ? fmt::format(", guidance {}", a.guidance_scale) : std::string(),
      a.lora.empty() ? std::string() : fmt::format(", LoRA {} x{}", a.lora, a.lora_scale));

  const auto start = std::chrono::steady_clock::now();
  request.on_step = progress_logger(start);
  const auto result = diffusion::generate(pipeline, request);
  write_outputs(a, result,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return 0;
}

}  // namespace difftrain::cli
