// Z-Image training end to end through `difftrain train` on the tiny fixture folder
// (tests/golden/z_image/tiny_z_image): a 2-rank LoRA run in buckets with gradient checkpointing
// whose loss falls and whose LoRA changes `difftrain sample`'s images the same in every file
// layout; 2 ranks equal 1 rank at the same global batch; exact resume; a ZeRO-3 full fine-tune
// against the unsharded run whose export samples; DreamBooth with prior preservation in bf16 on
// an 8-bit base, with validation from the cached embeddings and a model card.
#include "train_util.h"

#include "difftrain/io/lora_format.h"
#include "source_dir.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iostream>

namespace difftrain::testing {
namespace {

namespace fs = std::filesystem;

const std::string kTinyZ =
    std::string(difftrain_test::source_dir()) + "/tests/golden/z_image/tiny_z_image";

double z_train_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

std::vector<std::string> z_train_cmd(const std::string& data, const std::string& out,
                                     std::vector<std::string> extra) {
  std::vector<std::string> cmd = {"train",
                                  "--pretrained_model_name_or_path",
                                  kTinyZ,
                                  "--dataset",
                                  "imagefolder",
                                  "--train_data_dir",
                                  data,
                                  "--resolution",
                                  "32",
                                  "--resolution_buckets",
                                  "--bucket_step",
                                  "16",
                                  "--center_crop",
                                  "--lora",
                                  "--rank",
                                  "4",
                                  "--max_sequence_length",
                                  "32",
                                  "--learning_rate",
                                  "1e-2",
                                  "--lr_scheduler",
                                  "constant",
                                  "--lr_warmup_steps",
                                  "0",
                                  "--train_batch_size",
                                  "1",
                                  "--num_validation_images",
                                  "0",
                                  "--logging_steps",
                                  "1",
                                  "--output_dir",
                                  out};
  cmd.insert(cmd.end(), extra.begin(), extra.end());
  return cmd;
}

std::vector<std::string> without(std::vector<std::string> c, const std::string& flag,
                                 size_t values) {
  const auto it = std::find(c.begin(), c.end(), flag);
  if (it != c.end()) c.erase(it, it + 1 + static_cast<std::ptrdiff_t>(values));
  return c;
}

// `difftrain sample` of a Z-Image folder (optionally with a LoRA), its images.
torch::Tensor z_images(const std::string& dir, const std::string& name,
                       const std::string& lora = "", const std::string& model = kTinyZ) {
  std::vector<std::string> argv = {kDifftrain,
                                   "sample",
                                   "--model",
                                   model,
                                   "--prompt",
                                   "a red wide picture",
                                   "--height",
                                   "16",
                                   "--width",
                                   "48",
                                   "--num_inference_steps",
                                   "3",
                                   "--guidance_scale",
                                   "0",
                                   "--seed",
                                   "0",
                                   "--output",
                                   dir + "/" + name + ".png",
                                   "--save_tensors",
                                   dir + "/" + name + ".safetensors"};
  if (!lora.empty()) argv.insert(argv.end(), {"--lora", lora});
  auto r = run(argv, {}, 120);
  EXPECT_EQ(r.exit_code, 0) << r.log();
  if (r.exit_code != 0) return torch::zeros({1});
  return io::load_safetensors(dir + "/" + name + ".safetensors").tensors.at("images");
}

TEST(ZImageTrain, LoraOnTwoRanksInBucketsLowersLossAndExportsEveryLayout) {
  const std::string dir = make_temp_dir("z_lora");
  const std::string data = make_mixed_aspect_folder(dir + "/data");
  const std::string out = dir + "/run";
  // The script's attention targets and the feed-forward and final projections (a tiny random
  // model learns too little through its attention alone for the loss to show it).
  auto r = train(z_train_cmd(data, out,
                             {"--max_train_steps", "80", "--gradient_checkpointing",
                              "--checkpointing_steps", "40", "--weighting_scheme", "logit_normal",
                              "--lora_layers", "to_q,to_k,to_v,to_out.0,w1,w2,w3,linear"}),
                 2, 600);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_NE(r.err.find("train_dreambooth_lora_z_image.py"), std::string::npos) << r.log();
  EXPECT_NE(r.err.find("aspect-ratio buckets"), std::string::npos) << r.log();
  EXPECT_NE(r.err.find("text encoder released"), std::string::npos) << r.log();
  EXPECT_NE(r.err.find("LoRA rank 4 alpha 4 on 29 transformer module(s)"), std::string::npos)
      << r.log();
  EXPECT_TRUE(fs::exists(out + "/checkpoint-40")) << r.log();
  auto l = losses(out);
  ASSERT_EQ(l.size(), 80u);
  double first = 0, last = 0;
  for (int i = 0; i < 20; ++i)
    first += l[static_cast<size_t>(i)] / 20, last += l[l.size() - 1 - i] / 20;
  std::cout << "Z-Image LoRA loss: first 20 " << first << ", last 20 " << last << "\n";
  EXPECT_LT(last, 0.95 * first);

  // Diffusers' layout: transformer.<module>.lora_A / lora_B.
  const std::string file = out + "/pytorch_lora_weights.safetensors";
  const auto tensors = io::load_safetensors(file).tensors;
  EXPECT_TRUE(tensors.count("transformer.layers.0.attention.to_q.lora_A.weight"));
  EXPECT_TRUE(tensors.count("transformer.noise_refiner.0.attention.to_out.0.lora_B.weight"));
  EXPECT_TRUE(tensors.count("transformer.context_refiner.0.attention.to_k.lora_A.weight"));
  const auto weights = io::read_lora(file);
  EXPECT_EQ(weights.count("transformer"), 29u);

  const torch::Tensor base = z_images(dir, "base");
  const torch::Tensor tuned = z_images(dir, "tuned", file);
  const double changed = z_train_diff(tuned, base);
  std::cout << "Z-Image LoRA changes the images by " << changed << "\n";
  EXPECT_GT(changed, 1e-3);
  // kohya (lora_unet_) through lora convert, and a merged folder, give the same images.
  auto conv = run({kDifftrain, "lora", "convert", "--input", file, "--output",
                   dir + "/kohya.safetensors", "--to", "kohya", "--model", kTinyZ},
                  {}, 60);
  ASSERT_EQ(conv.exit_code, 0) << conv.log();
  EXPECT_TRUE(io::load_safetensors(dir + "/kohya.safetensors")
                  .tensors.count("lora_unet_layers_0_attention_to_q.lora_down.weight"));
  EXPECT_LE(z_train_diff(z_images(dir, "kohya", dir + "/kohya.safetensors"), tuned), 1e-5);
  auto merge = run(
      {kDifftrain, "lora", "merge", "--model", kTinyZ, "--lora", file, "--output", dir + "/merged"},
      {}, 60);
  ASSERT_EQ(merge.exit_code, 0) << merge.log();
  EXPECT_LE(z_train_diff(z_images(dir, "merged", "", dir + "/merged"), tuned), 1e-4);
}

TEST(ZImageTrain, TwoRanksEqualOneRankAndResumeIsExact) {
  const std::string dir = make_temp_dir("z_ranks");
  const std::string data = make_mixed_aspect_folder(dir + "/data");
  auto cmd = [&](const std::string& out, const std::string& steps, const std::string& batch) {
    auto c =
        z_train_cmd(data, out,
                    {"--max_train_steps", steps, "--checkpointing_steps", "2", "--train_batch_size",
                     batch, "--cache_dir", dir + "/cache", "--weighting_scheme", "mode"});
    return without(without(without(c, "--resolution_buckets", 0), "--bucket_step", 1),
                   "--center_crop", 0);
  };
  // One rank with batch 2 against two ranks with batch 1 each: the same global batch.
  auto one = train(cmd(dir + "/one", "4", "2"), 1, 600);
  ASSERT_EQ(one.exit_code, 0) << one.log();
  auto two = train(cmd(dir + "/two", "4", "1"), 2, 600);
  ASSERT_EQ(two.exit_code, 0) << two.log();
  const std::string file = "/pytorch_lora_weights.safetensors";
  const auto a = io::load_safetensors(dir + "/one" + file).tensors;
  const auto b = io::load_safetensors(dir + "/two" + file).tensors;
  const double ranks = max_abs_diff(a, b);
  double moved = 0;
  for (const auto& [key, t] : a) moved = std::max(moved, t.abs().max().item<double>());
  std::cout << "Z-Image 2 ranks vs 1 rank: " << ranks << " (weights up to " << moved << ")\n";
  EXPECT_LE(ranks, 1e-4 * std::max(1.0, moved));
  const auto la = losses(dir + "/one"), lb = losses(dir + "/two");
  ASSERT_EQ(la.size(), lb.size());
  for (size_t i = 0; i < la.size(); ++i) EXPECT_NEAR(la[i], lb[i], 1e-4 * std::abs(la[i]));

  // Resume: 2 steps, then on to 4 from checkpoint-2, equals the straight run bit for bit.
  auto first = train(cmd(dir + "/resumed", "2", "1"), 2, 600);
  ASSERT_EQ(first.exit_code, 0) << first.log();
  auto c = cmd(dir + "/resumed", "4", "1");
  c.insert(c.end(), {"--resume_from_checkpoint", "latest"});
  auto second = train(c, 2, 600);
  ASSERT_EQ(second.exit_code, 0) << second.log();
  EXPECT_NE(second.err.find("resumed from"), std::string::npos) << second.log();
  const auto resumed = io::load_safetensors(dir + "/resumed" + file).tensors;
  EXPECT_EQ(max_abs_diff(b, resumed), 0.0);
  EXPECT_EQ(losses(dir + "/two"), losses(dir + "/resumed"));
}

TEST(ZImageTrain, FullFineTuneUnderZero3EqualsUnshardedAndSamples) {
  const std::string dir = make_temp_dir("z_full");
  const std::string data = make_mixed_aspect_folder(dir + "/data");
  auto cmd = [&](const std::string& out, const std::string& strategy) {
    auto c = z_train_cmd(data, out,
                         {"--max_train_steps", "3", "--sharding_strategy", strategy,
                          "--learning_rate", "1e-4", "--train_batch_size", "2"});
    return without(without(c, "--lora", 0), "--rank", 1);
  };
  auto plain = train(cmd(dir + "/plain", "NO_SHARD"), 2, 600);
  ASSERT_EQ(plain.exit_code, 0) << plain.log();
  auto sharded = train(cmd(dir + "/sharded", "FULL_SHARD"), 2, 600);
  ASSERT_EQ(sharded.exit_code, 0) << sharded.log();
  const std::string weights = "/transformer/diffusion_pytorch_model.safetensors";
  const auto a = io::load_safetensors(dir + "/sharded" + weights).tensors;
  const auto b = io::load_safetensors(dir + "/plain" + weights).tensors;
  const auto start = io::load_safetensors(kTinyZ + weights).tensors;
  EXPECT_EQ(a.size(), start.size());
  double apart = 0, moved = 0;
  for (const auto& [key, t] : b) {
    apart += (a.at(key).to(torch::kFloat64) - t.to(torch::kFloat64)).pow(2).sum().item<double>();
    moved +=
        (t.to(torch::kFloat64) - start.at(key).to(torch::kFloat64)).pow(2).sum().item<double>();
  }
  const double rel = std::sqrt(apart / moved);
  std::cout << "Z-Image FULL_SHARD vs NO_SHARD: relative " << rel << "\n";
  EXPECT_GT(moved, 0);
  EXPECT_LE(rel, 5e-3);
  for (const char* part : {"vae", "text_encoder", "tokenizer", "scheduler", "model_index.json",
                           "transformer/config.json"})
    EXPECT_TRUE(fs::exists(dir + "/sharded/" + part)) << part;
  const auto tuned = z_images(dir, "full", "", dir + "/sharded");
  EXPECT_GT(z_train_diff(tuned, z_images(dir, "base")), 0);
}

TEST(ZImageTrain, DreamBoothWithPriorPreservationInBf16OnAnInt8Base) {
  const std::string dir = make_temp_dir("z_dreambooth");
  const std::string data = make_mixed_aspect_folder(dir + "/data");
  auto c = z_train_cmd(data, dir + "/db",
                       {"--max_train_steps",
                        "3",
                        "--instance_prompt",
                        "a photo of sks picture",
                        "--with_prior_preservation",
                        "--class_data_dir",
                        dir + "/class",
                        "--class_prompt",
                        "a photo of a picture",
                        "--num_class_images",
                        "2",
                        "--validation_inference_steps",
                        "2",
                        "--mixed_precision",
                        "bf16",
                        "--validation_prompt",
                        "a photo of sks picture",
                        "--num_validation_images",
                        "1",
                        "--base_weights_dtype",
                        "int8",
                        "--cache_latents",
                        "--gradient_checkpointing",
                        "--lora_format",
                        "comfyui"});
  c = without(without(c, "--resolution_buckets", 0), "--bucket_step", 1);
  auto db = train(c, 2, 600);
  ASSERT_EQ(db.exit_code, 0) << db.log();
  EXPECT_NE(db.err.find("generating 2 class image(s)"), std::string::npos) << db.log();
  EXPECT_EQ(std::distance(fs::directory_iterator(dir + "/class"), fs::directory_iterator()), 2);
  EXPECT_TRUE(fs::exists(dir + "/db/samples/step-000003.png")) << db.log();
  // The script's targets: to_q/k/v/out.0 of the 4 blocks, on a base stored in int8.
  EXPECT_NE(db.err.find("LoRA rank 4 alpha 4 on 16 transformer module(s)"), std::string::npos)
      << db.log();
  EXPECT_NE(db.err.find("frozen base in int8"), std::string::npos) << db.log();
  ExpectedCard card = {kTinyZ, "apache-2.0", {"text-to-image", "z-image"}, false, "", 0, ""};
  card.lora = true;
  card.instance_prompt = "a photo of sks picture";
  card.widgets = 1;
  card.widget_text = "a photo of sks picture";
  const auto text = expect_model_card(dir + "/db", card);
  EXPECT_NE(text.find("ZImagePipeline.from_pretrained("), std::string::npos) << text;
  // --lora_format comfyui: ComfyUI's and musubi-tuner's keys, which sample reads back.
  const auto comfy = io::load_safetensors(dir + "/db/pytorch_lora_weights.safetensors").tensors;
  EXPECT_TRUE(comfy.count("diffusion_model.layers.0.attention.to_out.0.lora_down.weight"));
  EXPECT_TRUE(comfy.count("diffusion_model.context_refiner.0.attention.to_q.alpha"));
  EXPECT_EQ(comfy.size(), 16u * 3u);
  z_images(dir, "comfy", dir + "/db/pytorch_lora_weights.safetensors");
  const auto l = losses(dir + "/db");
  ASSERT_EQ(l.size(), 3u);
  for (double v : l) EXPECT_TRUE(std::isfinite(v));

  // DDPM flags and a text-encoder LoRA are refused for Z-Image, with the way out.
  auto bad = train(z_train_cmd(data, dir + "/bad", {"--max_train_steps", "1", "--snr_gamma", "5"}));
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("Z-Image trains with flow matching"), std::string::npos) << bad.log();
  // Another family's run refuses --lora_format comfyui, naming the family that writes it.
  const std::string flux =
      std::string(difftrain_test::source_dir()) + "/tests/golden/flux/tiny_flux";
  auto comfy_flux = run(
      {kDifftrain, "train", "--pretrained_model_name_or_path", flux, "--dataset", "imagefolder",
       "--train_data_dir", data, "--lora", "--lora_format", "comfyui", "--output_dir", dir + "/cf"},
      {}, 120);
  EXPECT_NE(comfy_flux.exit_code, 0);
  EXPECT_NE(comfy_flux.err.find(
                "--lora_format comfyui: the flux family's runs export diffusers, "
                "peft, kohya; comfyui is written for the qwen-image, wan, z-image family's runs"),
            std::string::npos)
      << comfy_flux.log();
  auto te =
      train(z_train_cmd(data, dir + "/te", {"--max_train_steps", "1", "--train_text_encoder"}));
  EXPECT_NE(te.exit_code, 0);
  EXPECT_NE(te.err.find("trains the transformer only"), std::string::npos) << te.log();
}

}  // namespace
}  // namespace difftrain::testing
