// `difftrain lora merge`: a model folder with a LoRA file folded into the components it adapts,
// written as a new folder of the same layout (the folder's family does the work:
// ModelFamily::merge_lora; models::merge_lora_into_folder for the UNet families). `difftrain lora
// convert`: a LoRA file rewritten in another key layout (Diffusers, PEFT, kohya; kohya SDXL with
// SGM names), kohya names resolved by the model folder's family (families::convert_lora).

#include "commands.h"
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/distributed/process_group.h"
#include "difftrain/families/family.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/models/lora/lora_folder.h"

namespace difftrain::cli {

namespace {

struct LoraMergeArgs {
  std::string model;
  std::string lora;
  std::string output;
  double lora_scale = 1.0;
  std::string variant;
} g_args;

CLI::App* g_merge = nullptr;
CLI::App* g_convert = nullptr;

struct LoraConvertArgs {
  std::string input, output, to, model;
} g_convert_args;

int run_lora_convert() {
  const auto& a = g_convert_args;
  io::LoraFormat format = io::LoraFormat::kDiffusers;
  if (a.to == "peft") format = io::LoraFormat::kPeft;
  if (a.to == "kohya") format = io::LoraFormat::kKohya;
  if (a.to == "comfyui") format = io::LoraFormat::kComfyUI;
  const auto done = families::convert_lora(a.input, a.output, format, a.model);
  std::string counts;
  for (const auto& [component, targets] : done.targets) {
    counts += (counts.empty() ? "" : ", ") + std::to_string(targets) + " " + component;
  }
  log::info("difftrain lora convert: {} ({}) -> {} ({}): {} targets", a.input, done.read_label,
            a.output, a.to, counts);
  return 0;
}

}  // namespace

CLI::App* add_lora_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("lora", "Work with LoRA files (see docs/LORA.md)");
  cmd->require_subcommand(1);
  g_merge = cmd->add_subcommand(
      "merge",
      "Fold a LoRA file (Diffusers, PEFT or kohya) into a model folder's denoiser and text "
      "encoders and write the result as a new folder of the same layout (Diffusers: "
      "load_lora_weights + fuse_lora + save_pretrained)");
  g_merge
      ->add_option("--model", g_args.model,
                   "Pipeline folder (model_index.json and its components) or a bare denoiser "
                   "folder (config.json + diffusion_pytorch_model.safetensors)")
      ->required();
  g_merge->add_option("--lora", g_args.lora, "LoRA weights (.safetensors)")->required();
  g_merge
      ->add_option("--output", g_args.output,
                   "New folder to write (must not exist, or be empty; never the input)")
      ->required();
  g_merge->add_option("--lora_scale", g_args.lora_scale,
                      "Multiplier of the LoRA update (default 1, as trained)");
  g_merge->add_option("--variant", g_args.variant,
                      "Weights variant to read and write, e.g. fp16 "
                      "(diffusion_pytorch_model.fp16.safetensors)");
  g_convert = cmd->add_subcommand(
      "convert",
      "Rewrite a LoRA file in another key layout: diffusers (save_lora_weights), peft or kohya "
      "(with --model, the folder's family names the modules as its kohya files do)");
  g_convert->add_option("--input", g_convert_args.input, "LoRA file to read")->required();
  g_convert->add_option("--output", g_convert_args.output, "LoRA file to write")->required();
  g_convert
      ->add_option(
          "--to", g_convert_args.to,
          "diffusers, peft, kohya or comfyui (diffusion_model. keys, for the families whose "
          "ComfyUI names are Diffusers')")
      ->required()
      ->check(CLI::IsMember({"diffusers", "peft", "kohya", "comfyui"}));
  g_convert->add_option("--model", g_convert_args.model,
                        "The model folder the LoRA is for (pipeline or bare denoiser folder): its "
                        "family resolves kohya names and applies its own key layout");
  return cmd;
}

int run_lora() {
  distributed::configure_threads();
  if (g_convert->parsed()) return run_lora_convert();
  if (!g_merge->parsed()) return 0;
  models::LoraFolderMergeOptions options;
  options.lora_scale = g_args.lora_scale;
  options.variant = g_args.variant;
  log::info("difftrain lora merge: model {}, LoRA {} x{}{}, output {}", g_args.model, g_args.lora,
            g_args.lora_scale, g_args.variant.empty() ? "" : ", variant " + g_args.variant,
            g_args.output);
  const auto summary = families::family_of(g_args.model)
                           .merge_lora(g_args.model, g_args.lora, g_args.output, options);
  std::string files;
  for (const auto& f : summary.weights_written) files += (files.empty() ? "" : ", ") + f;
  log::info("wrote {} merged weight file(s): {} ({} files copied unchanged)",
            summary.weights_written.size(), files.empty() ? "none" : files, summary.files_copied);
  return 0;
}

}  // namespace difftrain::cli
