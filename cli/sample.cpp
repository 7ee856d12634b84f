// `difftrain sample`: parses the flags, asks the folder's family for the images
// (families::sample: the same seed gives Diffusers' images) and writes a labelled PNG grid.

#include "commands.h"
#include "difftrain/diffusion/sampler.h"
#include "difftrain/distributed/process_group.h"
#include "difftrain/families/family.h"

#include <fmt/ranges.h>

namespace difftrain::cli {
namespace {
families::SampleOptions g_args;
families::SampleOutputs g_out;
std::string g_dtype = "fp32";
CLI::Option* g_guidance = nullptr;
}  // namespace

CLI::App* add_sample_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "sample",
      "Generate images: text-to-image from a Stable Diffusion, SDXL or FLUX.1 folder (--prompt), "
      "or a DDPM/DDIM UNet pipeline (Diffusers semantics: the same seed gives the same images); "
      "writes a labelled PNG grid");
  cmd->add_option("--model", g_args.model,
                  "Pipeline folder (model_index.json + unet/ + scheduler/, with vae/ text_encoder/ "
                  "tokenizer/ for Stable Diffusion; FLUX.1: transformer/ vae/ text_encoder(_2)/ "
                  "tokenizer(_2)/ scheduler/) or a UNet folder with scheduler_config.json "
                  "beside config.json")
      ->required();
  cmd->add_option("--lora", g_args.lora,
                  "LoRA weights to merge first (.safetensors: Diffusers, PEFT or kohya keys)");
  cmd->add_option("--lora_scale", g_args.lora_scale, "Multiplier of the LoRA update (default 1)");
  cmd->add_option("--scheduler", g_args.scheduler,
                  fmt::format("the sampler: {}", fmt::join(diffusion::sampler_names(), ", ")) +
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
  g_guidance =
      cmd->add_option("--guidance_scale", g_args.guidance_scale,
                      "Classifier-free guidance scale (> 1 guides against the null class); "
                      "FLUX.1-dev: the embedded guidance (default 3.5)")
          ->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--seed", g_args.seed, "Seed of the CPU generator (default 0)");
  cmd->add_option("--output", g_out.grid, "PNG grid to write (default samples.png)");
  cmd->add_option("--save_tensors", g_out.tensors,
                  "Also write `images` [K,H,W,C] float32 in [0,1] to this .safetensors file");
  cmd->add_option("--columns", g_out.columns, "Grid columns (default: about square)")
      ->check(CLI::Range(int64_t{0}, int64_t{4096}));
  cmd->add_option("--prompt", g_args.prompts, "Text-to-image: the prompt (repeat for several)");
  cmd->add_option("--prompt_file", g_args.prompt_file, "Prompts, one per line");
  cmd->add_option("--negative_prompt", g_args.negative_prompt, "Guide away from this text");
  cmd->add_option("--prompt_2", g_args.prompts_2,
                  "FLUX.1: the prompt for the T5 encoder (repeat for several; default: --prompt)");
  cmd->add_option("--max_sequence_length", g_args.max_sequence_length,
                  "FLUX.1: T5 tokens per prompt, padded or cut (default 512)")
      ->check(CLI::Range(int64_t{1}, int64_t{512}));
  cmd->add_option("--num_images_per_prompt", g_args.num_images_per_prompt,
                  "Images per prompt (default 1)")
      ->check(CLI::Range(int64_t{1}, int64_t{4096}));
  for (auto [name, into] : {std::pair{"height", &g_args.height}, {"width", &g_args.width}}) {
    cmd->add_option(fmt::format("--{}", name), *into,
                    fmt::format("Image {} in pixels (default: the model's)", name))
        ->check(CLI::Range(int64_t{8}, int64_t{8192}));
  }
  cmd->add_option(
         "--clip_skip", g_args.clip_skip,
         "CLIP layer of the text embeddings from the end, as kohya: 1 = last, 2 = penultimate")
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
                  "An AutoencoderKL folder to use instead of vae/ (SDXL's fp16-safe VAE)");
  cmd->add_option("--variant", g_args.variant, "Weights variant, e.g. fp16");
  cmd->add_option("--dtype", g_dtype,
                  "Weights and compute dtype: fp32 (default), bf16 or fp16 (Diffusers' "
                  "torch_dtype; FLUX.1 ships bf16 and is read straight into it)")
      ->check(CLI::IsMember({"fp32", "float32", "bf16", "bfloat16", "fp16", "float16"}));
  cmd->add_option("--device", g_args.device,
                  "auto (default: first visible CUDA device, else CPU), cpu, cuda or cuda:N; the "
                  "noise comes from the CPU generator, so a seed gives the same images anywhere");
  return cmd;
}

int run_sample() {
  distributed::configure_threads();
  g_args.guidance_given = g_guidance->count() > 0;
  g_args.dtype = families::parse_sample_dtype(g_dtype);
  families::sample_to_files(g_args, g_out);
  return 0;
}

}  // namespace difftrain::cli
