// `difftrain estimate-memory`: per-rank bytes of parameters, gradients, optimizer state, frozen
// weights and activations of a training run under a sharding strategy, and the same for every
// strategy at that number of processes (Accelerate's `accelerate estimate-memory`). The work is
// each family's
// ModelFamily::estimate_memory and train::memory_report; this file only parses flags.

#include "commands.h"
#include "difftrain/distributed/process_group.h"
#include "difftrain/families/family.h"
#include "difftrain/train/memory_estimate.h"

#include <iostream>

namespace difftrain::cli {

namespace {

// The flags (train::MemoryEstimateFlags, parsed by the library), the folder and the output form.
struct EstimateMemoryArgs : train::MemoryEstimateFlags {
  std::string model;
  bool json = false;
} g_args;

}  // namespace

CLI::App* add_estimate_memory_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "estimate-memory",
      "Per-rank memory of training a model of any registered family (parameters, gradients, "
      "optimizer state, frozen weights, activations) under a sharding strategy, and under every "
      "strategy for comparison (Accelerate: accelerate estimate-memory). See docs/SHARDING.md");
  cmd->add_option("--model", g_args.model,
                  "Pipeline folder (model_index.json; configs/ has weightless ones), bare denoiser "
                  "folder (config.json) or a config.json; weights are not needed")
      ->required();
  cmd->add_option("--num_processes", g_args.options.num_processes,
                  "Processes (ranks) N (default 1)");
  cmd->add_option("--sharding_strategy", g_args.sharding_strategy,
                  "NO_SHARD, SHARD_OPTIMIZER, SHARD_GRAD_OP or FULL_SHARD (or zero0..zero3)");
  cmd->add_option("--mixed_precision", g_args.mixed_precision,
                  "no | fp16 | bf16: autocast of the activation measurement");
  cmd->add_flag("--use_8bit_adam", g_args.options.use_8bit_adam,
                "8-bit AdamW state instead of AdamW");
  cmd->add_option("--optimizer", g_args.options.optimizer,
                  "adamw (default) or prodigy (16 bytes of state per trainable parameter)");
  cmd->add_flag("--lora", g_args.options.lora, "Train LoRA adapters on the frozen denoiser");
  cmd->add_option("--rank", g_args.options.lora_rank, "LoRA rank (default 4)");
  cmd->add_option("--lora_target_modules", g_args.options.lora_target_modules,
                  "Layers that get adapters (default: those of the family's Diffusers LoRA "
                  "script, e.g. to_q,to_k,to_v,to_out.0)")
      ->delimiter(',');
  cmd->add_option("--base_weights_dtype", g_args.options.base_weights_dtype,
                  "LoRA: the frozen base's Linear/Conv weights in 8 bits: none (default), int8, "
                  "fp8_e4m3");
  cmd->add_flag("--train_text_encoder", g_args.options.train_text_encoder,
                "Count the text encoders, which stay loaded for text-encoder LoRA (families that "
                "cache text embeddings otherwise release them)");
  cmd->add_option("--batch_size", g_args.options.batch_size, "Batch per process (default 1)");
  cmd->add_option("--resolution", g_args.options.resolution,
                  "Denoiser input height = width (the latent side for latent models; default: "
                  "the family's, e.g. the config's sample_size, or 128 for 1024 px)");
  cmd->add_option("--num_frames", g_args.options.num_frames,
                  "Video families: frames of each clip (default: the family's)");
  cmd->add_option("--height", g_args.options.height,
                  "Video families: clip height in pixels (default: the family's)");
  cmd->add_option("--width", g_args.options.width,
                  "Video families: clip width in pixels (default: the family's)");
  cmd->add_flag("--gradient_checkpointing", g_args.options.gradient_checkpointing,
                "Measure activations with gradient checkpointing");
  cmd->add_option("--blocks_to_swap", g_args.options.blocks_to_swap,
                  "Transformer blocks whose frozen weights stay in host memory (`difftrain "
                  "train --blocks_to_swap`; LoRA only): the device bytes it saves");
  cmd->add_option("--encoder_sequence_length", g_args.options.encoder_sequence_length,
                  "Tokens of encoder_hidden_states (default: what `difftrain train` feeds the "
                  "family's denoiser, e.g. 77 CLIP tokens or 512 T5 tokens)");
  cmd->add_option("--fsdp_auto_wrap_policy", g_args.options.auto_wrap.policy,
                  "TRANSFORMER_BASED_WRAP (default), SIZE_BASED_WRAP or NO_WRAP");
  cmd->add_option("--fsdp_transformer_layer_cls_to_wrap", g_args.options.auto_wrap.classes,
                  "Classes wrapped as units, comma-separated (default ResnetBlock2D, "
                  "Transformer2DModel, Attention)")
      ->delimiter(',');
  cmd->add_option("--fsdp_min_num_params", g_args.options.auto_wrap.min_num_params,
                  "SIZE_BASED_WRAP threshold (default 1e8)");
  cmd->add_option("--offload_optimizer_device", g_args.offload_optimizer_device,
                  "none | cpu: ZeRO-Offload: master shards, gradients and optimizer state in host "
                  "memory (counted as host bytes)");
  cmd->add_option("--offload_param_device", g_args.offload_param_device,
                  "none | cpu: FULL_SHARD's parameter shards in host memory too");
  cmd->add_flag("--json", g_args.json, "Print one JSON object instead of tables");
  return cmd;
}

int run_estimate_memory() {
  distributed::configure_threads();
  const train::MemoryEstimateOptions o = train::memory_estimate_options(g_args);

  const auto strategies = train::strategies_to_compare(o);
  const auto& family = families::family_of(g_args.model);
  const auto estimates = family.estimate_memory(g_args.model, o, strategies);
  train::check_block_swap_estimated(o, estimates, family.name());
  std::cout << (g_args.json ? train::memory_report_json(g_args.model, o, estimates).dump(2) + "\n"
                            : train::memory_report(g_args.model, o, estimates));
  return 0;
}

}  // namespace difftrain::cli
