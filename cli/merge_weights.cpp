// `difftrain merge-weights CHECKPOINT_DIR OUTPUT_DIR`: a model of a training checkpoint (sharded
// over ranks, or whole) written as one safetensors file of whole tensors (Accelerate's
// `accelerate merge-weights`). The work is io::merge_weights; this file only parses.

#include "commands.h"
#include "difftrain/distributed/process_group.h"
#include "difftrain/io/sharded_tensors.h"

#include <cstdio>
#include <iostream>

namespace difftrain::cli {

namespace {

struct MergeWeightsArgs {
  std::string checkpoint;
  std::string output;
  io::MergeWeightsOptions options;
} g_args;

}  // namespace

CLI::App* add_merge_weights_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "merge-weights",
      "Consolidate a model of a checkpoint (sharded over ranks or not) into one safetensors file "
      "of whole tensors, plus its config.json (Accelerate: accelerate merge-weights)");
  cmd->add_option("checkpoint_dir", g_args.checkpoint,
                  "Checkpoint folder written by the trainer (model.index.json + "
                  "model-0000r-of-0000N.safetensors, or model.safetensors)")
      ->required();
  cmd->add_option("output_dir", g_args.output,
                  "Folder to write (created if missing; never the checkpoint folder)")
      ->required();
  cmd->add_option("--model_index", g_args.options.model_index,
                  "Which prepared model: 0 reads model.*, i > 0 reads model_<i>.* (default 0)");
  cmd->add_option("--output_name", g_args.options.output_name,
                  "Weights file to write (default diffusion_pytorch_model.safetensors)");
  return cmd;
}

int run_merge_weights() {
  distributed::configure_threads();
  const auto r = io::merge_weights(g_args.checkpoint, g_args.output, g_args.options);
  char size[32];
  std::snprintf(size, sizeof(size), "%.1f MB", static_cast<double>(r.num_bytes) / 1e6);
  std::cout << "merged " << r.num_tensors << " tensors (" << size << ") from " << g_args.checkpoint
            << " into " << r.output_file
            << (r.lora ? " (LoRA adapter state, not a full model)" : "") << std::endl;
  return 0;
}

}  // namespace difftrain::cli
