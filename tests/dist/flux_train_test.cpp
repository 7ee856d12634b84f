// FLUX.1 training end to end through `difftrain train` on the tiny fixture folder: a 2-rank LoRA
// run (CLIP LoRA, aspect-ratio buckets, gradient checkpointing) whose loss falls and whose LoRA
// changes the images in `difftrain sample` (the same in all three file layouts); exact resume with
// buckets under Prodigy and 8-bit AdamW (cached embeddings, encoders released); a 2-rank ZeRO-3
// full fine-tune against the unsharded run; DreamBooth with prior preservation in bf16.

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

const std::string kTinyFlux =
    std::string(difftrain_test::source_dir()) + "/tests/golden/flux/tiny_flux";

double flux_train_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

std::vector<std::string> flux_train_cmd(const std::string& data, const std::string& out,
                                        std::vector<std::string> extra) {
  std::vector<std::string> cmd = {"train",
                                  "--pretrained_model_name_or_path",
                                  kTinyFlux,
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
                                  "16",
                                  "--learning_rate",
                                  "1e-2",
                                  "--lr_scheduler",
                                  "constant",
                                  "--lr_warmup_steps",
                                  "0",
                                  "--train_batch_size",
                                  "1",
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

// `difftrain sample` of the tiny folder (optionally with a LoRA), its images.
torch::Tensor flux_images(const std::string& dir, const std::string& name,
                          const std::string& lora = "", const std::string& model = kTinyFlux) {
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
                                   "4",
                                   "--max_sequence_length",
                                   "16",
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

TEST(FluxTrain, LoraOnTwoRanksWithClipInBucketsLowersLossAndExports) {
  const std::string dir = make_temp_dir("flux_lora");
  const std::string data = make_mixed_aspect_folder(dir + "/data");
  const std::string out = dir + "/run";
  auto r = train(
      flux_train_cmd(data, out,
                     {"--max_train_steps", "40", "--train_text_encoder", "--gradient_checkpointing",
                      "--checkpointing_steps", "20", "--weighting_scheme", "logit_normal"}),
      2, 600);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_NE(r.err.find("aspect-ratio buckets: 12 image(s)"), std::string::npos) << r.log();
  EXPECT_NE(r.err.find("16x48: 4 image(s)"), std::string::npos) << r.log();
  EXPECT_NE(r.err.find("flow matching"), std::string::npos) << r.log();
  EXPECT_NE(r.err.find("guidance 3.5"), std::string::npos) << r.log();
  EXPECT_TRUE(fs::exists(out + "/checkpoint-20")) << r.log();
  auto l = losses(out);
  ASSERT_EQ(l.size(), 40u);
  double first = 0, last = 0;
  for (int i = 0; i < 10; ++i)
    first += l[static_cast<size_t>(i)] / 10, last += l[l.size() - 1 - i] / 10;
  std::cout << "FLUX LoRA loss: first 10 " << first << ", last 10 " << last << "\n";
  EXPECT_LT(last, 0.9 * first);

  // Diffusers' layout: transformer.<module>.lora_A/B and text_encoder.<module>.lora_A/B.
  const std::string file = out + "/pytorch_lora_weights.safetensors";
  const auto tensors = io::load_safetensors(file).tensors;
  EXPECT_TRUE(tensors.count("transformer.transformer_blocks.0.attn.to_q.lora_A.weight"));
  EXPECT_TRUE(tensors.count("transformer.single_transformer_blocks.1.attn.to_k.lora_B.weight"));
  EXPECT_TRUE(tensors.count("transformer.transformer_blocks.1.ff_context.net.2.lora_A.weight"));
  EXPECT_TRUE(
      tensors.count("text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight"));
  auto weights = io::read_lora(file);
  // Diffusers' 12 targets: 8 attention + 4 feed-forward in each of 2 double blocks, 4 attention
  // projections (to_q/k/v; no to_out) in each of 2 single blocks.
  EXPECT_EQ(weights.count("transformer"), 2u * 12u + 2u * 3u);
  EXPECT_EQ(weights.count("text_encoder"), 4u * 2u);  // q,k,v,out of CLIP's layers

  const torch::Tensor base = flux_images(dir, "base");
  const torch::Tensor tuned = flux_images(dir, "tuned", file);
  const double changed = flux_train_diff(tuned, base);
  std::cout << "FLUX LoRA changes the images by " << changed << "\n";
  EXPECT_GT(changed, 1e-3);
  // The same adapters as PEFT (trained again with --lora_format peft would give the same file's
  // weights) and as kohya / BFL (through `lora convert`) give the same images.
  io::write_lora(dir + "/peft.safetensors", weights, io::LoraFormat::kPeft);
  auto conv = run({kDifftrain, "lora", "convert", "--input", file, "--output",
                   dir + "/kohya.safetensors", "--to", "kohya", "--model", kTinyFlux},
                  {}, 60);
  ASSERT_EQ(conv.exit_code, 0) << conv.log();
  EXPECT_TRUE(io::load_safetensors(dir + "/kohya.safetensors")
                  .tensors.count("lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"));
  for (const char* tag : {"peft", "kohya"}) {
    const auto again = flux_images(dir, tag, dir + "/" + tag + ".safetensors");
    EXPECT_LE(flux_train_diff(again, tuned), 1e-5) << tag;
  }
}

TEST(FluxTrain, ResumeWithBucketsIsExactUnderProdigyAnd8bitAdam) {
  const std::string dir = make_temp_dir("flux_resume");
  const std::string data = make_mixed_aspect_folder(dir + "/data");
  for (const auto& [tag, flags] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"prodigy", {"--optimizer", "prodigy", "--learning_rate", "1"}},
           {"adam8", {"--use_8bit_adam", "--lora_format", "kohya"}}}) {
    auto cmd = [&, flags = flags](const std::string& out, const std::string& steps) {
      auto c = flux_train_cmd(
          data, out,
          {"--max_train_steps", steps, "--checkpointing_steps", "3", "--random_flip",
           "--train_batch_size", "2", "--weighting_scheme", "mode", "--cache_dir", dir + "/cache"});
      c.insert(c.end(), flags.begin(), flags.end());
      return c;
    };
    auto straight = train(cmd(dir + "/" + tag + "-straight", "6"), 2, 600);
    ASSERT_EQ(straight.exit_code, 0) << straight.log();
    EXPECT_NE(straight.err.find("text encoders released"), std::string::npos) << straight.log();
    auto first = train(cmd(dir + "/" + tag + "-resumed", "3"), 2, 600);
    ASSERT_EQ(first.exit_code, 0) << first.log();
    auto c = cmd(dir + "/" + tag + "-resumed", "6");
    c.insert(c.end(), {"--resume_from_checkpoint", "latest"});
    auto second = train(c, 2, 600);
    ASSERT_EQ(second.exit_code, 0) << second.log();
    EXPECT_NE(second.err.find("resumed from"), std::string::npos) << second.log();
    const auto a =
        io::load_safetensors(dir + "/" + tag + "-straight/pytorch_lora_weights.safetensors");
    const auto b =
        io::load_safetensors(dir + "/" + tag + "-resumed/pytorch_lora_weights.safetensors");
    const double d = max_abs_diff(a.tensors, b.tensors);
    std::cout << "FLUX " << tag << " resumed vs straight: " << d << "\n";
    EXPECT_EQ(d, 0.0) << tag;
    EXPECT_EQ(losses(dir + "/" + tag + "-straight"), losses(dir + "/" + tag + "-resumed")) << tag;
    if (tag == "adam8") {
      EXPECT_TRUE(a.tensors.count("lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"));
    }
  }
}

// ZeRO-3 (FULL_SHARD) full fine-tuning of the transformer on 2 ranks against the unsharded run;
// the export is a FluxPipeline folder `difftrain sample` loads.
TEST(FluxTrain, FullFineTuneUnderZero3EqualsUnsharded) {
  const std::string dir = make_temp_dir("flux_full");
  const std::string data = make_mixed_aspect_folder(dir + "/data");
  auto cmd = [&](const std::string& out, const std::string& strategy) {
    auto c = flux_train_cmd(data, out,
                            {"--max_train_steps", "3", "--sharding_strategy", strategy,
                             "--learning_rate", "1e-4", "--train_batch_size", "2"});
    c.erase(std::find(c.begin(), c.end(), "--lora"));
    c.erase(std::find(c.begin(), c.end(), "--rank"), std::find(c.begin(), c.end(), "--rank") + 2);
    return c;
  };
  auto plain = train(cmd(dir + "/plain", "NO_SHARD"), 2, 600);
  ASSERT_EQ(plain.exit_code, 0) << plain.log();
  auto sharded = train(cmd(dir + "/sharded", "FULL_SHARD"), 2, 600);
  ASSERT_EQ(sharded.exit_code, 0) << sharded.log();
  const std::string weights = "/transformer/diffusion_pytorch_model.safetensors";
  const auto a = io::load_safetensors(dir + "/sharded" + weights).tensors;
  const auto b = io::load_safetensors(dir + "/plain" + weights).tensors;
  const auto start = io::load_safetensors(kTinyFlux + weights).tensors;
  // As the SD test and docs/SHARDING.md: distance apart relative to the distance moved.
  double apart = 0, moved = 0;
  for (const auto& [key, t] : b) {
    apart += (a.at(key).to(torch::kFloat64) - t.to(torch::kFloat64)).pow(2).sum().item<double>();
    moved +=
        (t.to(torch::kFloat64) - start.at(key).to(torch::kFloat64)).pow(2).sum().item<double>();
  }
  const double rel = std::sqrt(apart / moved);
  std::cout << "FLUX FULL_SHARD vs NO_SHARD: relative " << rel << ", max abs " << max_abs_diff(a, b)
            << "\n";
  EXPECT_GT(moved, 0);
  EXPECT_LE(rel, 5e-3);
  for (const char* part : {"vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2",
                           "scheduler", "model_index.json", "transformer/config.json"})
    EXPECT_TRUE(fs::exists(dir + "/sharded/" + part)) << part;
  const auto tuned = flux_images(dir, "full", "", dir + "/sharded");
  EXPECT_GT(flux_train_diff(tuned, flux_images(dir, "base")), 0);
}

// DreamBooth with prior preservation: class images drawn with the FLUX sampler, bf16 with the
// frozen transformer, T5 and CLIP in bf16 and gradient checkpointing (recomputed under the
// forward's autocast), validation renders from the cached prompt embeddings.
TEST(FluxTrain, DreamBoothWithPriorPreservationInBf16) {
  const std::string dir = make_temp_dir("flux_dreambooth");
  const std::string data = make_mixed_aspect_folder(dir + "/data");
  auto c = flux_train_cmd(data, dir + "/db",
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
                           "--cache_latents",
                           "--gradient_checkpointing"});
  c.erase(std::find(c.begin(), c.end(), "--resolution_buckets"));
  c.erase(std::find(c.begin(), c.end(), "--bucket_step"),
          std::find(c.begin(), c.end(), "--bucket_step") + 2);
  auto db = train(c, 2, 600);
  ASSERT_EQ(db.exit_code, 0) << db.log();
  EXPECT_NE(db.err.find("generating 2 class image(s)"), std::string::npos) << db.log();
  EXPECT_EQ(std::distance(fs::directory_iterator(dir + "/class"), fs::directory_iterator()), 2);
  EXPECT_TRUE(fs::exists(dir + "/db/samples/step-000003.png")) << db.log();
  EXPECT_NE(db.err.find("text encoders released"), std::string::npos) << db.log();
  ExpectedCard card = {kTinyFlux, "other", {"text-to-image", "flux"}, false, "", 0, ""};
  card.lora = true;
  card.instance_prompt = "a photo of sks picture";
  card.widgets = 1;
  card.widget_text = "a photo of sks picture";
  const auto text = expect_model_card(dir + "/db", card);
  EXPECT_NE(text.find("FLUX.1-dev/blob/main/LICENSE.md"), std::string::npos) << text;
  EXPECT_NE(text.find("FluxPipeline.from_pretrained("), std::string::npos) << text;
  const auto l = losses(dir + "/db");
  ASSERT_EQ(l.size(), 3u);
  for (double v : l) EXPECT_TRUE(std::isfinite(v));
  // The frozen transformer base, both encoders and the VAE at 2 bytes per parameter, until the
  // encoders are released (run_info counts what is held while training: no encoder).
  int64_t frozen = 0;
  for (const char* f : {"/transformer/diffusion_pytorch_model.safetensors",
                        "/vae/diffusion_pytorch_model.safetensors"}) {
    for (const auto& [key, t] : io::load_safetensors(kTinyFlux + f).tensors) frozen += t.numel();
  }
  const auto info = nlohmann::json::parse(std::ifstream(dir + "/db/logs/run_info.rank0.json"));
  EXPECT_EQ(info["state_bytes"]["frozen_param_bytes"].get<int64_t>(), 2 * frozen);

  // DDPM flags are refused for a flow-matching model, with the way out.
  auto bad =
      train(flux_train_cmd(data, dir + "/bad", {"--max_train_steps", "1", "--snr_gamma", "5"}));
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("--weighting_scheme"), std::string::npos) << bad.log();
}

}  // namespace
}  // namespace difftrain::testing
