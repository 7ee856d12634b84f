// `difftrain forward`: one forward of a model folder's denoiser (its family's: the UNet of the
// built-in ones) on tensors from a file, to check a converted checkpoint against Python.

#include "commands.h"
#include "difftrain/core/log.h"
#include "difftrain/distributed/process_group.h"
#include "difftrain/families/family.h"
#include "difftrain/io/safetensors.h"

namespace difftrain::cli {

namespace {

struct ForwardArgs {
  std::string model;
  std::string lora;
  double lora_scale = 1.0;
  std::string inputs;
  std::string output;
} g_args;

}  // namespace

CLI::App* add_forward_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "forward",
      "Run the denoiser once on tensors from a .safetensors file and write `out` (or `out.<i>` per "
      "sample for a denoiser of lists), to compare "
      "with Diffusers: the inputs are the denoiser's forward arguments by their Diffusers names "
      "(docs/COMMANDS.md lists each family's)");
  cmd->add_option("--model", g_args.model,
                  "Denoiser folder (config.json + diffusion_pytorch_model.safetensors) or a "
                  "pipeline folder, whose family finds its denoiser")
      ->required();
  cmd->add_option("--lora", g_args.lora, "LoRA weights to merge first (.safetensors)");
  cmd->add_option("--lora_scale", g_args.lora_scale, "Multiplier of the LoRA update (default 1)");
  cmd->add_option("--inputs", g_args.inputs, "Input tensors (.safetensors)")->required();
  cmd->add_option("--output", g_args.output, "Where to write `out` (.safetensors)")->required();
  return cmd;
}

int run_forward() {
  distributed::configure_threads();
  const auto& family = families::family_of(g_args.model);
  auto inputs = io::load_safetensors(g_args.inputs).tensors;
  const auto outputs =
      family.forward_outputs(g_args.model, inputs, g_args.inputs, g_args.lora, g_args.lora_scale);
  io::save_safetensors(g_args.output, outputs, {{"format", "pt"}});
  std::string shapes;
  for (const auto& [name, t] : outputs) {
    shapes += fmt::format("{}{} {}", shapes.empty() ? "" : ", ", name, fmt::join(t.sizes(), "x"));
  }
  log::info("wrote {}: {}", g_args.output, shapes);
  return 0;
}

}  // namespace difftrain::cli
