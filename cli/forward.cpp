// `difftrain forward`: one UNet forward on tensors from a file, to check a converted checkpoint
// against Python.

#include "commands.h"
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/diffusion/pipeline.h"
#include "difftrain/distributed/process_group.h"
#include "difftrain/io/safetensors.h"

#include <filesystem>

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
      "Run the UNet once on tensors from a .safetensors file (sample, timestep, optional "
      "class_labels / encoder_hidden_states) and write `out`, to compare with Diffusers");
  cmd->add_option("--model", g_args.model,
                  "UNet folder (config.json + diffusion_pytorch_model.safetensors) or pipeline "
                  "folder with unet/")
      ->required();
  cmd->add_option("--lora", g_args.lora, "LoRA weights to merge first (.safetensors)");
  cmd->add_option("--lora_scale", g_args.lora_scale, "Multiplier of the LoRA update (default 1)");
  cmd->add_option("--inputs", g_args.inputs, "Input tensors (.safetensors)")->required();
  cmd->add_option("--output", g_args.output, "Where to write `out` (.safetensors)")->required();
  return cmd;
}

int run_forward() {
  distributed::configure_threads();
  namespace fs = std::filesystem;
  std::string unet_dir = g_args.model;
  if (fs::exists(fs::path(unet_dir) / "model_index.json")) {
    unet_dir = (fs::path(unet_dir) / "unet").string();
  }
  models::UNet unet = diffusion::load_unet_with_lora(unet_dir, g_args.lora, g_args.lora_scale);
  auto inputs = io::load_safetensors(g_args.inputs).tensors;
  for (const auto& [name, t] : inputs) {
    if (name != "sample" && name != "timestep" && name != "class_labels" &&
        name != "encoder_hidden_states" && name != "timestep_cond" && name != "out") {
      log::warn("{}: tensor \"{}\" is not an input of the UNet; ignored", g_args.inputs, name);
    }
  }
  for (const char* required : {"sample", "timestep"}) {
    if (!inputs.count(required)) {
      throw Error(g_args.inputs + ": no tensor named \"" + required +
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
  torch::Tensor sample = inputs.at("sample");
  if (!sample.is_floating_point()) {
    throw Error(g_args.inputs + ": \"sample\" must be floating point, got " +
                std::string(c10::toString(sample.scalar_type())));
  }
  unet->eval();
  torch::NoGradGuard no_grad;
  torch::Tensor out = unet->forward(sample.to(torch::kFloat32), inputs.at("timestep"), cond);
  io::save_safetensors(g_args.output, {{"out", out}}, {{"format", "pt"}});
  log::info("wrote {}: out {}", g_args.output, fmt::format("{}", fmt::join(out.sizes(), "x")));
  return 0;
}

}  // namespace difftrain::cli
