// `difftrain lora merge` end to end: the merged folder loads to the in-memory merge_lora, runs
// like Diffusers' fused UNet, samples like `difftrain sample --lora` on the original, keeps every
// other file; a PEFT adapter folder merges with its adapter_config.json alpha and a
// mixed-convention file like a single-convention one; a trained PEFT export keeps r and alpha; bad
// input exits 1 with a one-line message naming the path.

#include "subprocess.h"

#include "difftrain/io/lora_format.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/lora/lora.h"
#include "difftrain/models/pretrained.h"
#include "program_paths.h"
#include "source_dir.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace difftrain::testing {
namespace {

namespace fs = std::filesystem;
const std::string kDifftrain = difftrain_test::difftrain_bin();
const std::string kGolden = std::string(difftrain_test::source_dir()) + "/tests/golden/diffusers/";

double max_abs(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

double max_weight_diff(const torch::nn::Module& a, const torch::nn::Module& b) {
  double worst = 0;
  const auto pb = b.named_parameters();
  for (const auto& p : a.named_parameters()) {
    worst = std::max(worst, max_abs(p.value(), pb[p.key()]));
  }
  return worst;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

TEST(LoraMergeCommand, UNetFolderEqualsInMemoryMergeAndDiffusers) {
  const auto dir = make_temp_dir("lora_merge");
  // PEFT file at 0.8: the saved weights are the in-memory merge.
  auto r = run({kDifftrain, "lora", "merge", "--model", kGolden + "unet_cond", "--lora",
                kGolden + "lora/peft_format.safetensors", "--output", dir + "/scaled",
                "--lora_scale", "0.8"},
               {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_NE((r.out + r.err).find("merged into 32 UNet modules with lora_scale 0.8"),
            std::string::npos)
      << r.log();
  auto expected = models::load_unet(kGolden + "unet_cond");
  models::merge_lora(*expected, io::read_lora(kGolden + "lora/peft_format.safetensors"), 0.8);
  auto merged = models::load_unet(dir + "/scaled");
  const double diff = max_weight_diff(*merged, *expected);
  std::printf("lora merge (peft, 0.8): max |W - in-memory merge| %.3g (tol 1e-6)\n", diff);
  EXPECT_LE(diff, 1e-6);
  EXPECT_EQ(slurp(dir + "/scaled/config.json").empty(), false);

  // kohya file at 1: the merged UNet's output is Diffusers' UNet + LoRA.
  r = run({kDifftrain, "lora", "merge", "--model", kGolden + "unet_cond", "--lora",
           kGolden + "lora/kohya_format.safetensors", "--output", dir + "/kohya"},
          {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  r = run({kDifftrain, "forward", "--model", dir + "/kohya", "--inputs",
           kGolden + "lora/io.safetensors", "--output", dir + "/out.safetensors"},
          {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  auto out = io::load_safetensors(dir + "/out.safetensors").tensors.at("out");
  auto ref = io::load_safetensors(kGolden + "lora/io.safetensors").tensors.at("out");
  const double fwd = max_abs(out, ref);
  std::printf("forward of the merged folder (kohya): max |out - diffusers| %.3g (tol 1e-4)\n", fwd);
  EXPECT_LT(fwd, 1e-4);
  fs::remove_all(dir);
}

// A PEFT adapter folder (adapter_model.safetensors + adapter_config.json with lora_alpha 8 at
// r 4) merges at scale 2; a file mixing Diffusers and kohya keys merges like the Diffusers file.
TEST(LoraMergeCommand, PeftAdapterFolderAndMixedConventionFile) {
  const auto dir = make_temp_dir("lora_merge_peft");
  fs::create_directories(dir + "/adapter");
  fs::copy_file(kGolden + "lora/peft_format.safetensors",
                dir + "/adapter/adapter_model.safetensors");
  {
    std::ofstream(dir + "/adapter/adapter_config.json")
        << R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]})";
  }
  auto r = run({kDifftrain, "lora", "merge", "--model", kGolden + "unet_cond", "--lora",
                dir + "/adapter", "--output", dir + "/peft"},
               {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  const auto reference = io::read_lora(kGolden + "lora/pytorch_lora_weights.safetensors");
  auto expected = models::load_unet(kGolden + "unet_cond");
  models::merge_lora(*expected, reference, 2.0);
  double diff = max_weight_diff(*models::load_unet(dir + "/peft"), *expected);
  std::printf(
      "lora merge (PEFT folder, alpha 8, r 4): max |W - merge at scale 2| %.3g (tol 1e-6)\n", diff);
  EXPECT_LE(diff, 1e-6);

  // attn1 modules in Diffusers keys, attn2 in kohya keys (with .alpha), one file.
  io::TensorMap mixed;
  for (const auto format : {io::LoraFormat::kDiffusers, io::LoraFormat::kKohya}) {
    io::LoraWeights part;
    for (const auto& t : reference.targets("unet")) {
      const bool attn1 = t.module.find("attn1") != std::string::npos;
      if (attn1 == (format == io::LoraFormat::kDiffusers)) part.components["unet"].push_back(t);
    }
    for (const auto& [k, v] : io::lora_to_tensors(part, format)) mixed.emplace(k, v);
  }
  io::save_safetensors(dir + "/mixed.safetensors", mixed);
  r = run({kDifftrain, "lora", "merge", "--model", kGolden + "unet_cond", "--lora",
           dir + "/mixed.safetensors", "--output", dir + "/mixed"},
          {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  expected = models::load_unet(kGolden + "unet_cond");
  models::merge_lora(*expected, reference);
  diff = max_weight_diff(*models::load_unet(dir + "/mixed"), *expected);
  std::printf(
      "lora merge (mixed Diffusers + kohya keys): max |W - in-memory merge| %.3g (tol "
      "1e-6)\n",
      diff);
  EXPECT_LE(diff, 1e-6);
  fs::remove_all(dir);
}

// `difftrain train --lora --lora_format peft` with rank 2, alpha 6: the export keeps up as trained
// and records r and alpha in adapter_config.json beside it and in lora_adapter_metadata;
// read back, every module has r 2 and alpha 6; `difftrain sample --lora` loads it.
TEST(LoraMergeCommand, TrainedPeftExportKeepsRankAndAlpha) {
  const auto dir = make_temp_dir("lora_train_peft");
  const std::string config = dir + "/tiny_unet.json";
  std::ofstream(config) << R"({"_class_name": "UNet2DModel", "sample_size": 8, "in_channels": 1,
    "out_channels": 1, "layers_per_block": 1, "block_out_channels": [8, 16],
    "down_block_types": ["DownBlock2D", "AttnDownBlock2D"],
    "up_block_types": ["AttnUpBlock2D", "UpBlock2D"], "norm_num_groups": 4,
    "attention_head_dim": 8})";
  const std::vector<std::string> common = {
      "--resolution", "8",     "--max_train_samples",     "64", "--lr_warmup_steps",     "0",
      "--use_ema",    "false", "--num_validation_images", "0",  "--checkpointing_steps", "0"};
  std::vector<std::string> base = {
      kDifftrain,          "train",      "--model_config_name_or_path", config,
      "--max_train_steps", "2",          "--train_batch_size",          "4",
      "--output_dir",      dir + "/base"};
  base.insert(base.end(), common.begin(), common.end());
  auto r = run(base, {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  std::vector<std::string> lora = {kDifftrain,
                                   "train",
                                   "--pretrained_model_name_or_path",
                                   dir + "/base",
                                   "--lora",
                                   "--rank",
                                   "2",
                                   "--lora_alpha",
                                   "6",
                                   "--lora_format",
                                   "peft",
                                   "--max_train_steps",
                                   "2",
                                   "--train_batch_size",
                                   "4",
                                   "--learning_rate",
                                   "1e-2",
                                   "--output_dir",
                                   dir + "/lora"};
  lora.insert(lora.end(), common.begin(), common.end());
  r = run(lora, {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  const std::string file = dir + "/lora/pytorch_lora_weights.safetensors";
  const auto adapter = nlohmann::json::parse(slurp(dir + "/lora/adapter_config.json"));
  EXPECT_EQ(adapter.at("peft_type"), "LORA");
  EXPECT_EQ(adapter.at("r"), 2);
  EXPECT_EQ(adapter.at("lora_alpha"), 6.0);
  const auto meta =
      nlohmann::json::parse(io::load_safetensors(file).metadata.at("lora_adapter_metadata"));
  EXPECT_EQ(meta.at("unet.r"), 2);
  EXPECT_EQ(meta.at("unet.lora_alpha"), 6.0);
  const auto back = io::read_lora(file);
  EXPECT_EQ(back.format, io::LoraFormat::kPeft);
  EXPECT_GT(back.count("unet"), 0u);
  for (const auto& t : back.targets("unet")) {
    EXPECT_EQ(t.rank(), 2) << t.module;
    EXPECT_EQ(t.alpha.value_or(0), 6.0) << t.module;
  }
  r = run({kDifftrain, "sample", "--model", dir + "/base", "--lora", file, "--num_inference_steps",
           "2", "--num_images", "1", "--class_labels", "3", "--output", dir + "/s.png"},
          {}, 120);
  EXPECT_EQ(r.exit_code, 0) << r.log();
  fs::remove_all(dir);
}

TEST(LoraMergeCommand, MergedPipelineSamplesLikeSampleWithLora) {
  // A DDIMPipeline folder with a text encoder folder and a README beside the UNet.
  const auto dir = make_temp_dir("lora_pipe");
  const std::string pipe = dir + "/pipe";
  for (const char* sub : {"/unet", "/scheduler", "/text_encoder"})
    fs::create_directories(pipe + sub);
  for (const char* f : {"config.json", "diffusion_pytorch_model.safetensors"}) {
    fs::copy_file(kGolden + "unet2d_uncond/" + f, pipe + "/unet/" + f);
  }
  fs::copy_file(kGolden + "unet2d_uncond/scheduler_config.json",
                pipe + "/scheduler/scheduler_config.json");
  std::ofstream(pipe + "/model_index.json") << R"({"_class_name": "DDIMPipeline"})";
  std::ofstream(pipe + "/text_encoder/config.json") << R"({"hidden_size": 16})";
  std::ofstream(pipe + "/README.md") << "# a tiny pipeline\n";

  // A kohya LoRA on Linear, 1x1 and 3x3 conv layers of this UNet, with a text encoder part.
  auto unet = models::load_unet(pipe + "/unet");
  const auto params = unet->named_parameters();
  auto gen = at::detail::createCPUGenerator(17);
  io::LoraWeights lora;
  const std::vector<std::pair<std::string, int64_t>> targets = {
      {"conv_in", 2},
      {"down_blocks.1.attentions.0.to_q", 4},
      {"down_blocks.1.attentions.0.to_v", 4},
      {"mid_block.attentions.0.to_out.0", 2},
      {"up_blocks.0.resnets.0.conv_shortcut", 3},
      {"up_blocks.1.resnets.0.conv1", 2}};
  for (const auto& [module, r] : targets) {
    const auto w = params[module + ".weight"];
    io::LoraTarget t;
    t.module = module;
    std::vector<int64_t> down{r, w.size(1)}, up{w.size(0), r};
    if (w.dim() == 4) {
      down.insert(down.end(), {w.size(2), w.size(3)});
      up.insert(up.end(), {1, 1});
    }
    t.down = at::randn(down, gen) * 0.05;
    t.up = at::randn(up, gen) * 0.05;
    t.alpha = static_cast<double>(r) * 1.5;
    lora.components["unet"].push_back(t);
  }
  io::LoraTarget te;
  te.module = "text_model.encoder.layers.0.self_attn.q_proj";
  te.down = at::randn({2, 16}, gen);
  te.up = at::randn({16, 2}, gen);
  lora.components["text_encoder"].push_back(te);
  const std::string lora_path = dir + "/lora.safetensors";
  io::write_lora(lora_path, lora, io::LoraFormat::kKohya);

  auto r = run({kDifftrain, "lora", "merge", "--model", pipe, "--lora", lora_path, "--output",
                dir + "/merged", "--lora_scale", "0.9"},
               {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_NE((r.out + r.err).find("1 targets for the text_encoder were not merged"),
            std::string::npos)
      << r.log();
  for (const char* f : {"/model_index.json", "/scheduler/scheduler_config.json",
                        "/text_encoder/config.json", "/README.md"}) {
    EXPECT_EQ(slurp(dir + "/merged" + f), slurp(pipe + f)) << f;
  }
  EXPECT_TRUE(fs::exists(dir + "/merged/unet/diffusion_pytorch_model.safetensors"));

  auto sample = [&](const std::string& model, const std::vector<std::string>& extra,
                    const std::string& name) {
    std::vector<std::string> argv = {kDifftrain,
                                     "sample",
                                     "--model",
                                     model,
                                     "--num_inference_steps",
                                     "10",
                                     "--num_images",
                                     "2",
                                     "--seed",
                                     "3",
                                     "--output",
                                     dir + "/" + name + ".png",
                                     "--save_tensors",
                                     dir + "/" + name + ".safetensors"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    const auto s = run(argv, {}, 120);
    EXPECT_EQ(s.exit_code, 0) << s.log();
    return io::load_safetensors(dir + "/" + name + ".safetensors").tensors.at("images");
  };
  const auto merged = sample(dir + "/merged", {}, "merged");
  const auto with_lora = sample(pipe, {"--lora", lora_path, "--lora_scale", "0.9"}, "lora");
  const auto plain = sample(pipe, {}, "plain");
  const double diff = max_abs(merged, with_lora);
  const double effect = max_abs(plain, with_lora);
  std::printf(
      "sample of merged folder vs sample --lora: max |diff| %.3g (tol 1e-5); the LoRA itself "
      "moves images by %.3g\n",
      diff, effect);
  EXPECT_LE(diff, 1e-5);
  EXPECT_GT(effect, 1e-3);  // the comparison would be empty if the LoRA did nothing
  fs::remove_all(dir);
}

TEST(LoraMergeCommand, BadInputExitsWithOneLineErrors) {
  const auto dir = make_temp_dir("lora_bad");
  fs::create_directories(dir + "/full");
  std::ofstream(dir + "/full/file.txt") << "x";
  const std::string model = kGolden + "unet_cond";
  const std::string lora = kGolden + "lora/pytorch_lora_weights.safetensors";
  struct Case {
    std::vector<std::string> args;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {{"--model", model, "--lora", dir + "/none.safetensors", "--output", dir + "/o"},
       dir + "/none.safetensors: no such LoRA file"},
      {{"--model", dir + "/nomodel", "--lora", lora, "--output", dir + "/o"},
       dir + "/nomodel: no such folder"},
      {{"--model", model, "--lora", lora, "--output", dir + "/full"},
       dir + "/full: exists and is not empty"},
      {{"--model", model, "--lora", lora, "--output", model}, "is the input folder"},
      {{"--model", model, "--lora", lora, "--output", dir + "/o", "--variant", "fp16"},
       "diffusion_pytorch_model.fp16.safetensors: no such file"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv{kDifftrain, "lora", "merge"};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    const auto r = run(argv, {}, 60);
    EXPECT_EQ(r.exit_code, 1) << r.log();
    const auto at = r.err.find("difftrain: error: ");
    ASSERT_NE(at, std::string::npos) << r.log();
    const std::string line = r.err.substr(at);
    EXPECT_NE(line.find(c.expect), std::string::npos) << c.expect << "\n" << r.log();
    EXPECT_EQ(line.find('\n'), line.size() - 1) << "not one line:\n" << r.log();
    EXPECT_FALSE(fs::exists(dir + "/o")) << r.log();
  }
  // `difftrain lora` alone is a usage error of CLI11 (a subcommand is required).
  const auto usage = run({kDifftrain, "lora"}, {}, 30);
  EXPECT_NE(usage.exit_code, 0) << usage.log();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace difftrain::testing
