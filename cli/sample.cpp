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
// The registered families' own sample options (families::all_sample_options): name -> values.
std::map<std::string, std::vector<std::string>> g_family_values;
std::vector<std::pair<std::string, CLI::Option*>> g_family_flags;

std::string family_names() {
  std::vector<std::string> names;
  for (const auto* f : families::families()) names.push_back(f->name());
  return fmt::format("{}", fmt::join(names, ", "));
}
}  // namespace

CLI::App* add_sample_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "sample",
      "Generate images from a model folder of any registered family (" + family_names() +
          "): text-to-image with --prompt, or a DDPM/DDIM pipeline without (Diffusers semantics: "
          "the same seed gives the same images); writes a labelled PNG grid. A family's own "
          "options are marked [family]");
  cmd->add_option("--model", g_args.model,
                  "Pipeline folder (model_index.json and the components it lists) or a bare "
                  "denoiser folder with scheduler_config.json beside config.json; its family is "
                  "found from model_index.json's _class_name")
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
                      "Classifier-free guidance scale (> 1 guides; class-conditional pipelines "
                      "against the null class); a guidance-distilled transformer's embedded "
                      "guidance (its pipeline's default)")
          ->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--seed", g_args.seed, "Seed of the CPU generator (default 0)");
  cmd->add_option("--output", g_out.grid,
                  "PNG grid to write (default samples.png), or for a video model a video file by "
                  "its extension: .mp4 .mkv .mov .webm .webp .gif (default samples.mp4; several "
                  "clips as <stem>_<k>.<ext>)");
  cmd->add_option("--fps", g_out.fps,
                  "A video file's frame rate (default: the rate the model was trained at)")
      ->check(CLI::Range(0.1, 240.0));
  cmd->add_option("--save_frames", g_out.frames_dir,
                  "Video models: also write every frame as a PNG under this folder "
                  "(<k>/frame_<i>.png)");
  cmd->add_option("--save_tensors", g_out.tensors,
                  "Also write `images` [K,H,W,C] (clips: `frames` [K,F,H,W,C]) float32 in [0,1] "
                  "to this .safetensors file");
  cmd->add_option("--columns", g_out.columns, "Grid columns (default: about square)")
      ->check(CLI::Range(int64_t{0}, int64_t{4096}));
  cmd->add_option("--prompt", g_args.prompts, "Text-to-image: the prompt (repeat for several)");
  cmd->add_option("--prompt_file", g_args.prompt_file, "Prompts, one per line");
  cmd->add_option("--negative_prompt", g_args.negative_prompt, "Guide away from this text");
  cmd->add_option("--num_images_per_prompt,--num_videos_per_prompt", g_args.num_images_per_prompt,
                  "Images (a video pipeline's videos) per prompt (default 1)")
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
  // Each family's own options, once per name; the model's family parses them (families::sample)
  // and refuses another family's. A forked rank builds its command line again: start afresh.
  g_family_flags.clear();
  g_family_values.clear();
  for (const auto& [spec, owners] : families::all_sample_options()) {
    auto* opt = cmd->add_option("--" + spec.name, g_family_values[spec.name],
                                fmt::format("[{}] {}", fmt::join(owners, ", "), spec.help));
    opt->type_name(option_type_name(spec.type));
    if (spec.values > 0) opt->expected(static_cast<int>(spec.values));
    if (spec.values == 1) opt->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    g_family_flags.emplace_back(spec.name, opt);
  }
  cmd->add_option("--pretrained_vae_model_name_or_path,--vae", g_args.vae,
                  "An AutoencoderKL folder to use instead of vae/ (e.g. an fp16-safe VAE)");
  cmd->add_option("--variant", g_args.variant, "Weights variant, e.g. fp16");
  cmd->add_option("--dtype", g_dtype,
                  "Weights and compute dtype: fp32 (default), bf16 or fp16 (Diffusers' "
                  "torch_dtype; families that read their weights straight into it never hold a "
                  "float32 copy)")
      ->check(CLI::IsMember({"fp32", "float32", "bf16", "bfloat16", "fp16", "float16"}));
  cmd->add_option("--device", g_args.device,
                  "auto (default: first visible CUDA device, else CPU), cpu, cuda or cuda:N; the "
                  "noise comes from the CPU generator, so a seed gives the same images anywhere");
  return cmd;
}

int run_sample() {
  distributed::configure_threads();
  g_args.guidance_given = g_guidance->count() > 0;
  for (const auto& [name, opt] : g_family_flags) {
    if (opt->count() > 0) g_args.family_flags[name] = g_family_values[name];
  }
  g_args.dtype = families::parse_sample_dtype(g_dtype);
  families::sample_to_files(g_args, g_out);
  return 0;
}

}  // namespace difftrain::cli
