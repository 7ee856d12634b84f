// `difftrain eval --model DIR`: classifier accuracy and Fréchet distance of a Fashion-MNIST model's
// samples (train/eval.h). Prints one JSON object; --output also writes it to a file.
#include "difftrain/families/unet/eval.h"
#include "commands.h"
#include "difftrain/diffusion/sampler.h"
#include "difftrain/io/atomic_file.h"

#include <fmt/ranges.h>

#include <iostream>

namespace difftrain::cli {
namespace {

train::EvalOptions g_options;
std::string g_output;

}  // namespace

CLI::App* add_eval_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "eval",
      "Score a class-conditional Fashion-MNIST model: a cached classifier's accuracy on its "
      "samples, and the Fréchet distance of their features to the test set's");
  cmd->add_option("--model", g_options.model, "Pipeline or UNet folder")->required();
  cmd->add_option("--lora", g_options.lora, "LoRA file to apply first");
  cmd->add_option("--num_per_class", g_options.num_per_class, "Samples per class (default 20)");
  cmd->add_option("--num_inference_steps", g_options.num_inference_steps,
                  "Sampler steps (default 50)")
      ->check(CLI::Range(int64_t{1}, int64_t{100000}));
  cmd->add_option(
      "--scheduler", g_options.scheduler,
      fmt::format("The sampler: {}", fmt::join(diffusion::sampler_names(), ", ")) +
          ", or a Diffusers scheduler class (default: the folder's scheduler, as validation and "
          "`difftrain sample` use)");
  cmd->add_option("--eta", g_options.eta, "DDIM eta: 0 deterministic, 1 DDPM-like noise")
      ->check(CLI::Range(0.0, 10.0));
  cmd->add_option("--seed", g_options.seed, "Sampling seed (default 0)");
  cmd->add_option("--guidance_scale", g_options.guidance_scale,
                  "Classifier-free guidance against the null class (default 1: none; needs a "
                  "model trained with --class_dropout_prob)");
  cmd->add_option("--data_dir", g_options.data_dir,
                  "Fashion-MNIST IDX folder (default /usr/share/datasets/fashion-mnist)");
  cmd->add_option("--cache_dir", g_options.cache_dir,
                  "Where the classifier is cached (default ~/.cache/difftrain)");
  cmd->add_option("--classifier_epochs", g_options.classifier_epochs,
                  "Epochs of classifier training when not cached (default 2)");
  cmd->add_option("--classifier_train_samples", g_options.classifier_train_samples,
                  "Train the classifier on the first N images (default 0: all)");
  cmd->add_option("--test_samples", g_options.test_samples,
                  "Reference test images (default 0: all 10000)");
  cmd->add_option("--output", g_output, "Also write the JSON result to this file");
  return cmd;
}

int run_eval() {
  const auto result = train::evaluate_model(g_options);
  if (!result.is_null()) {
    std::cout << result.dump(2) << std::endl;
    if (!g_output.empty()) io::write_file_atomic(g_output, result.dump(2) + "\n");
  }
  return 0;
}

}  // namespace difftrain::cli
