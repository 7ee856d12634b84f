// `difftrain lora merge`: a model folder with a LoRA file folded into its UNet, written as a new
// folder of the same layout. The work is models::merge_lora_into_folder; this file only parses.

#include "commands.h"
#include "difftrain/core/log.h"
#include "difftrain/distributed/process_group.h"
#include "difftrain/models/lora_folder.h"

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

}  // namespace

CLI::App* add_lora_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("lora", "Work with LoRA files (see docs/LORA.md)");
  cmd->require_subcommand(1);
  g_merge = cmd->add_subcommand(
      "merge",
      "Fold a LoRA file (Diffusers, PEFT or kohya) into a model folder's UNet and write the "
      "result as a new folder of the same layout (Diffusers: load_lora_weights + fuse_lora + "
      "save_pretrained)");
  g_merge
      ->add_option("--model", g_args.model,
                   "Pipeline folder (model_index.json + unet/ + ...) or UNet folder (config.json + "
                   "diffusion_pytorch_model.safetensors)")
      ->required();
  g_merge->add_option("--lora", g_args.lora, "LoRA weights (.safetensors)")->required();
  g_merge
      ->add_option("--output", g_args.output,
                   "New folder to write (must not exist, or be empty; never the input)")
      ->required();
  g_merge->add_option("--lora_scale", g_args.lora_scale,
                      "Multiplier of the LoRA update (default 1, as trained)");
  g_merge->add_option("--variant", g_args.variant,
                      "UNet weights variant to read and write, e.g. fp16 "
                      "(diffusion_pytorch_model.fp16.safetensors)");
  return cmd;
}

int run_lora() {
  distributed::configure_threads();
  if (!g_merge->parsed()) return 0;  // CLI11 requires a subcommand; merge is the only one
  models::LoraFolderMergeOptions options;
  options.lora_scale = g_args.lora_scale;
  options.variant = g_args.variant;
  log::info("difftrain lora merge: model {}, LoRA {} x{}{}, output {}", g_args.model, g_args.lora,
            g_args.lora_scale, g_args.variant.empty() ? "" : ", variant " + g_args.variant,
            g_args.output);
  const auto summary =
      models::merge_lora_into_folder(g_args.model, g_args.lora, g_args.output, options);
  log::info("wrote {} ({} files copied unchanged)", summary.weights_written, summary.files_copied);
  return 0;
}

}  // namespace difftrain::cli
