// Text-to-image end to end on the tiny Stable Diffusion fixture: `difftrain sample` against the
// Diffusers reference, and `difftrain train` LoRA fine-tuning on a captioned image folder (2 ranks,
// export, reload, exact resume, DreamBooth prior preservation, cached latents).

#include "train_util.h"

#include "difftrain/io/image.h"
#include "difftrain/io/lora_format.h"
#include "source_dir.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

namespace difftrain::testing {
namespace {

namespace fs = std::filesystem;

const std::string kSd = std::string(difftrain_test::source_dir()) + "/tests/golden/sd/tiny_sd";

double tensor_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

// Eight 32x32 images of coloured squares on grey, each captioned with its colour and place.
std::string make_captioned_folder(const std::string& dir) {
  fs::create_directories(dir);
  std::ofstream meta(dir + "/metadata.jsonl");
  for (int i = 0; i < 8; ++i) {
    auto img = torch::zeros({3, 32, 32});
    const auto& [name, rgb] = kCaptionColours[static_cast<size_t>(i % 4)];
    const int64_t off = i < 4 ? 4 : 16;
    for (int ch = 0; ch < 3; ++ch) img[ch].narrow(0, off, 12).narrow(1, off, 12).fill_(rgb[ch]);
    add_captioned_image(dir, meta, "img" + std::to_string(i) + ".png", img,
                        "a " + name + " square at the " + (i < 4 ? "top left" : "bottom right"));
  }
  return dir;
}

std::vector<std::string> sd_train_cmd(const std::string& data, const std::string& out,
                                      std::vector<std::string> extra) {
  std::vector<std::string> cmd = {"train",
                                  "--pretrained_model_name_or_path",
                                  kSd,
                                  "--dataset",
                                  "imagefolder",
                                  "--train_data_dir",
                                  data,
                                  "--resolution",
                                  "32",
                                  "--center_crop",
                                  "--lora",
                                  "--rank",
                                  "4",
                                  "--learning_rate",
                                  "1e-2",
                                  "--lr_scheduler",
                                  "constant",
                                  "--lr_warmup_steps",
                                  "0",
                                  "--train_batch_size",
                                  "2",
                                  "--use_ema",
                                  "false",
                                  "--num_validation_images",
                                  "0",
                                  "--logging_steps",
                                  "1",
                                  "--output_dir",
                                  out};
  cmd.insert(cmd.end(), extra.begin(), extra.end());
  return cmd;
}

io::TensorMap lora_file(const std::string& out) {
  return io::load_safetensors(out + "/pytorch_lora_weights.safetensors").tensors;
}

ProcessResult sample(const std::string& out_png, const std::string& tensors,
                     std::vector<std::string> extra) {
  std::vector<std::string> argv = {kDifftrain, "sample", "--model",        kSd,
                                   "--output", out_png,  "--save_tensors", tensors};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return run(argv, {}, 120);
}

TEST(SdCli, SampleMatchesDiffusersReference) {
  const std::string dir = make_temp_dir("sd_sample");
  auto r = sample(dir + "/grid.png", dir + "/out.safetensors",
                  {"--prompt", "a photo of a cat", "--prompt",
                   "an astronaut riding a horse on mars, highly detailed", "--num_inference_steps",
                   "10", "--seed", "42"});
  ASSERT_EQ(r.exit_code, 0) << r.log();
  auto ref = io::load_safetensors(kSd + "/txt2img_seed42.safetensors").tensors;
  auto got = io::load_safetensors(dir + "/out.safetensors").tensors;
  const double d = tensor_diff(got.at("images"), ref.at("images"));
  std::cout << "CLI images vs Diffusers: " << d << "\n";
  EXPECT_LE(d, 1e-4);
  EXPECT_TRUE(fs::exists(dir + "/grid.png"));
  EXPECT_NE(r.err.find("step 10/10"), std::string::npos) << r.log();

  // The same prompts from a file, and an unknown folder / missing prompt as one-line errors.
  std::ofstream(dir + "/prompts.txt")
      << "a photo of a cat\nan astronaut riding a horse on mars, highly detailed\n";
  auto f = sample(
      dir + "/grid2.png", dir + "/out2.safetensors",
      {"--prompt_file", dir + "/prompts.txt", "--num_inference_steps", "10", "--seed", "42"});
  ASSERT_EQ(f.exit_code, 0) << f.log();
  EXPECT_EQ(tensor_diff(io::load_safetensors(dir + "/out2.safetensors").tensors.at("images"),
                        got.at("images")),
            0.0);
  auto none = sample(dir + "/g.png", dir + "/o.safetensors", {});
  EXPECT_NE(none.exit_code, 0);
  EXPECT_NE(none.err.find("needs --prompt"), std::string::npos) << none.log();
}

TEST(SdCli, LoraTrainingOnTwoRanksLowersLossAndExports) {
  const std::string dir = make_temp_dir("sd_lora");
  const std::string data = make_captioned_folder(dir + "/data");
  const std::string out = dir + "/run";
  auto r =
      train(sd_train_cmd(data, out,
                         {"--max_train_steps", "40", "--train_text_encoder", "--validation_prompt",
                          "a red square at the top left", "--num_validation_images", "2",
                          "--validation_inference_steps", "4"}),
            2, 600);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  auto l = losses(out);
  ASSERT_EQ(l.size(), 40u);
  double first = 0, last = 0;
  for (int i = 0; i < 8; ++i)
    first += l[static_cast<size_t>(i)] / 8, last += l[l.size() - 1 - i] / 8;
  std::cout << "loss: first 8 " << first << ", last 8 " << last << "\n";
  EXPECT_LT(last, 0.9 * first);
  EXPECT_TRUE(fs::exists(out + "/samples/step-000040.png"));
  ExpectedCard card = {
      kSd, "creativeml-openrail-m", {"text-to-image", "stable-diffusion"}, false, "", 0, ""};
  card.lora = true;
  card.widgets = 2;
  card.widget_text = "a red square at the top left";
  const auto text = expect_model_card(out, card);
  EXPECT_NE(text.find("weight_name=\"pytorch_lora_weights.safetensors\""), std::string::npos);

  // The export holds both components in Diffusers' layout and loads in `difftrain sample`.
  auto weights = io::read_lora(out + "/pytorch_lora_weights.safetensors");
  EXPECT_EQ(weights.count("unet"), 4u * 8u);          // to_q, to_k, to_v, to_out.0 of 8 attentions
  EXPECT_EQ(weights.count("text_encoder"), 4u * 2u);  // q, k, v, out_proj of 2 layers
  const std::vector<std::string> prompt = {
      "--prompt", "a red square at the top left", "--num_inference_steps", "4", "--seed", "0"};
  auto base = sample(dir + "/base.png", dir + "/base.safetensors", prompt);
  ASSERT_EQ(base.exit_code, 0) << base.log();
  auto extra = prompt;
  extra.insert(extra.end(), {"--lora", out + "/pytorch_lora_weights.safetensors"});
  auto tuned = sample(dir + "/tuned.png", dir + "/tuned.safetensors", extra);
  ASSERT_EQ(tuned.exit_code, 0) << tuned.log();
  EXPECT_NE(tuned.err.find("merged into 32 UNet and 8 text encoder modules"), std::string::npos)
      << tuned.log();
  const double changed =
      tensor_diff(io::load_safetensors(dir + "/tuned.safetensors").tensors.at("images"),
                  io::load_safetensors(dir + "/base.safetensors").tensors.at("images"));
  std::cout << "LoRA changes the images by " << changed << "\n";
  EXPECT_GT(changed, 1e-3);
}

TEST(SdCli, ResumeIsExactWithPriorPreservation) {
  const std::string dir = make_temp_dir("sd_resume");
  const std::string data = make_captioned_folder(dir + "/data");
  const std::vector<std::string> dreambooth = {"--instance_prompt",
                                               "a photo of sks square",
                                               "--with_prior_preservation",
                                               "--class_data_dir",
                                               dir + "/class",
                                               "--class_prompt",
                                               "a photo of a square",
                                               "--num_class_images",
                                               "3",
                                               "--validation_inference_steps",
                                               "3",
                                               "--train_text_encoder",
                                               "--checkpointing_steps",
                                               "2"};
  auto cmd = [&](const std::string& out, const std::string& steps) {
    auto c = sd_train_cmd(data, out, dreambooth);
    c.insert(c.end(), {"--max_train_steps", steps});
    return c;
  };
  auto straight = train(cmd(dir + "/straight", "4"));
  ASSERT_EQ(straight.exit_code, 0) << straight.log();
  ExpectedCard card = {
      kSd, "creativeml-openrail-m", {"text-to-image", "stable-diffusion"}, false, "", 0, ""};
  card.lora = true;
  card.instance_prompt = "a photo of sks square";
  const auto text = expect_model_card(dir + "/straight", card);
  EXPECT_NE(text.find("## Trigger words"), std::string::npos) << text;
  EXPECT_EQ(std::distance(fs::directory_iterator(dir + "/class"), fs::directory_iterator()), 3);
  auto first = train(cmd(dir + "/resumed", "2"));
  ASSERT_EQ(first.exit_code, 0) << first.log();
  auto c = cmd(dir + "/resumed", "4");
  c.insert(c.end(), {"--resume_from_checkpoint", "latest"});
  auto second = train(c);
  ASSERT_EQ(second.exit_code, 0) << second.log();
  EXPECT_NE(second.err.find("resumed from"), std::string::npos) << second.log();
  const double d = max_abs_diff(lora_file(dir + "/straight"), lora_file(dir + "/resumed"));
  std::cout << "resumed vs straight: " << d << "\n";
  EXPECT_EQ(d, 0.0);
}

TEST(SdCli, CachedLatentsTrainLikeUncached) {
  const std::string dir = make_temp_dir("sd_cache");
  const std::string data = make_captioned_folder(dir + "/data");
  auto plain = train(sd_train_cmd(data, dir + "/plain", {"--max_train_steps", "3"}));
  ASSERT_EQ(plain.exit_code, 0) << plain.log();
  // The cache in a folder of its own (--cache_dir), shared by the runs below.
  const std::vector<std::string> cache = {"--max_train_steps", "3", "--cache_latents",
                                          "--cache_dir", dir + "/latents"};
  auto cached = train(sd_train_cmd(data, dir + "/cached", cache));
  ASSERT_EQ(cached.exit_code, 0) << cached.log();
  EXPECT_NE(cached.err.find("cache_latents: encoded 8 image(s)"), std::string::npos)
      << cached.log();
  // Same posterior draws from the same per-sample streams; only batched-vs-single VAE and text
  // encoder rounding differs (~1e-7), which Adam's per-coordinate step may amplify on near-zero
  // gradients: the trainer's equivalence tolerance, 1e-4.
  const double d = max_abs_diff(lora_file(dir + "/plain"), lora_file(dir + "/cached"));
  std::cout << "cached vs uncached: " << d << "\n";
  EXPECT_LE(d, 1e-4);
  // A second run reuses the cache (same cache folder, data and models) and trains the same. (A
  // run into the first one's output folder is refused since issue 38.)
  auto again = train(sd_train_cmd(data, dir + "/cached_again", cache));
  ASSERT_EQ(again.exit_code, 0) << again.log();
  EXPECT_NE(again.err.find("cache_latents: reusing"), std::string::npos) << again.log();
  EXPECT_EQ(max_abs_diff(lora_file(dir + "/cached_again"), lora_file(dir + "/cached")), 0.0);

  // On two ranks every rank encodes its half of the captions (issue 38: rank 0 alone kept the
  // other waiting in a collective); the joined file holds the same embeddings in the same order.
  auto two = train(sd_train_cmd(data, dir + "/cached_two",
                                {"--max_train_steps", "1", "--cache_latents", "--cache_dir",
                                 dir + "/latents_two"}),
                   2);
  ASSERT_EQ(two.exit_code, 0) << two.log();
  EXPECT_NE(two.err.find("caption(s) into"), std::string::npos) << two.log();
  EXPECT_NE(two.err.find("(2 rank(s))"), std::string::npos) << two.log();
  auto text_cache = [](const std::string& folder) {
    for (const auto& e : fs::directory_iterator(folder)) {
      if (e.path().filename().string().rfind("text-embeddings-", 0) == 0) {
        return io::load_safetensors(e.path().string());
      }
    }
    ADD_FAILURE() << "no text-embeddings cache in " << folder;
    return io::Safetensors{};
  };
  const auto one_rank = text_cache(dir + "/latents");
  const auto two_ranks = text_cache(dir + "/latents_two");
  EXPECT_EQ(one_rank.metadata.at("captions"), two_ranks.metadata.at("captions"));
  const double te = max_abs_diff(one_rank.tensors, two_ranks.tensors);
  std::cout << "text cache on 2 ranks vs 1: " << te << " (tolerance 1e-5)\n";
  EXPECT_LE(te, 1e-5);

  // Random crops would freeze one crop in the cache: refused with the fix.
  auto bad = train({"train", "--pretrained_model_name_or_path", kSd, "--dataset", "imagefolder",
                    "--train_data_dir", data, "--resolution", "32", "--lora", "--cache_latents",
                    "--output_dir", dir + "/bad"});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("--center_crop"), std::string::npos) << bad.log();
}

// Full fine-tuning of the SD UNet under FULL_SHARD equals NO_SHARD and exports a whole
// StableDiffusionPipeline folder that `difftrain sample` loads.
TEST(SdCli, FullFineTuningShardedExportsPipeline) {
  const std::string dir = make_temp_dir("sd_full");
  const std::string data = make_captioned_folder(dir + "/data");
  auto cmd = [&](const std::string& out, const std::string& strategy) {
    auto c = sd_train_cmd(data, out, {"--max_train_steps", "3", "--sharding_strategy", strategy});
    c.erase(std::find(c.begin(), c.end(), "--lora"));
    c.erase(std::find(c.begin(), c.end(), "--rank"), std::find(c.begin(), c.end(), "--rank") + 2);
    return c;
  };
  auto plain = train(cmd(dir + "/plain", "NO_SHARD"), 2);
  ASSERT_EQ(plain.exit_code, 0) << plain.log();
  auto sharded = train(cmd(dir + "/sharded", "FULL_SHARD"), 2);
  ASSERT_EQ(sharded.exit_code, 0) << sharded.log();
  // As docs/SHARDING.md: how far the runs ended apart relative to how far training moved the
  // weights. Summing the batch in another order changes gradients by ~1e-7 relative, and Adam
  // can turn that into lr-sized steps on near-zero-gradient coordinates, so the max difference
  // is not the measure; tolerance 5e-3 as the sharding tests (a wrong reduction gives ~1).
  const auto a = unet_weights(dir + "/sharded"), b = unet_weights(dir + "/plain");
  const auto start =
      io::load_safetensors(kSd + "/unet/diffusion_pytorch_model.safetensors").tensors;
  double apart = 0, moved = 0;
  for (const auto& [key, t] : b) {
    apart += (a.at(key).to(torch::kFloat64) - t.to(torch::kFloat64)).pow(2).sum().item<double>();
    moved +=
        (t.to(torch::kFloat64) - start.at(key).to(torch::kFloat64)).pow(2).sum().item<double>();
  }
  const double rel = std::sqrt(apart / moved);
  std::cout << "FULL_SHARD vs NO_SHARD: relative " << rel << ", max abs " << max_abs_diff(a, b)
            << "\n";
  EXPECT_LE(rel, 5e-3);
  for (const char* part : {"vae", "text_encoder", "tokenizer", "scheduler", "model_index.json"})
    EXPECT_TRUE(fs::exists(dir + "/sharded/" + part)) << part;
  expect_model_card(
      dir + "/sharded",
      {kSd, "creativeml-openrail-m", {"text-to-image", "stable-diffusion"}, false, "", 0, ""});
  auto s = run({kDifftrain, "sample", "--model", dir + "/sharded", "--prompt", "a red square",
                "--num_inference_steps", "2", "--output", dir + "/s.png"});
  EXPECT_EQ(s.exit_code, 0) << s.log();
}

// --mixed_precision bf16 holds the frozen UNet, VAE and text encoder in bf16 (half their bytes in
// run_info) while the adapters train in fp32.
TEST(SdCli, Bf16HoldsFrozenWeightsInBf16) {
  const std::string dir = make_temp_dir("sd_bf16");
  const std::string data = make_captioned_folder(dir + "/data");
  const std::string out = dir + "/run";
  auto r = train(sd_train_cmd(data, out, {"--max_train_steps", "6", "--mixed_precision", "bf16"}));
  ASSERT_EQ(r.exit_code, 0) << r.log();
  for (double l : losses(out)) EXPECT_TRUE(std::isfinite(l));
  for (const auto& [key, t] : lora_file(out)) EXPECT_EQ(t.scalar_type(), torch::kFloat32) << key;
  int64_t frozen = 0;
  for (const char* f :
       {"/unet/diffusion_pytorch_model.safetensors", "/vae/diffusion_pytorch_model.safetensors",
        "/text_encoder/model.safetensors"}) {
    for (const auto& [key, t] : io::load_safetensors(kSd + f).tensors) frozen += t.numel();
  }
  std::ifstream in(out + "/logs/run_info.rank0.json");
  const auto info = nlohmann::json::parse(in);
  EXPECT_EQ(info["state_bytes"]["frozen_param_bytes"].get<int64_t>(), 2 * frozen);
  // fp32 training holds the same weights at 4 bytes each.
  auto fp32 = train(sd_train_cmd(data, dir + "/fp32", {"--max_train_steps", "1"}));
  ASSERT_EQ(fp32.exit_code, 0) << fp32.log();
  std::ifstream in32(dir + "/fp32/logs/run_info.rank0.json");
  EXPECT_EQ(nlohmann::json::parse(in32)["state_bytes"]["frozen_param_bytes"].get<int64_t>(),
            4 * frozen);
}

}  // namespace
}  // namespace difftrain::testing
