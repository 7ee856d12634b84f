// SDXL end to end: `difftrain sample --model SDXL_DIR` against the Diffusers reference
// (tests/golden/sdxl), with and without the fixture LoRAs.

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

const std::string kGolden = std::string(difftrain_test::source_dir()) + "/tests/golden/sdxl";
const std::string kXl = kGolden + "/tiny_sdxl";

double tensor_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

ProcessResult sample_xl(const std::string& dir, const std::string& name,
                        std::vector<std::string> extra) {
  std::vector<std::string> argv = {kDifftrain,       "sample",
                                   "--model",        kXl,
                                   "--output",       dir + "/" + name + ".png",
                                   "--save_tensors", dir + "/" + name + ".safetensors"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return run(argv, {}, 120);
}

torch::Tensor images_of(const std::string& dir, const std::string& name) {
  return io::load_safetensors(dir + "/" + name + ".safetensors").tensors.at("images");
}

// The fixture's call (txt2img_seed42.json).
const std::vector<std::string> kCall = {"--prompt",
                                        "a photo of a cat",
                                        "--prompt",
                                        "an astronaut riding a horse on mars, highly detailed",
                                        "--negative_prompt",
                                        "blurry, low quality",
                                        "--num_inference_steps",
                                        "8",
                                        "--height",
                                        "32",
                                        "--width",
                                        "32",
                                        "--seed",
                                        "42"};

TEST(SdxlCli, SampleMatchesDiffusersReference) {
  const std::string dir = make_temp_dir("sdxl_sample");
  auto r = sample_xl(dir, "base", kCall);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  auto ref = io::load_safetensors(kXl + "/txt2img_seed42.safetensors").tensors;
  const double d = tensor_diff(images_of(dir, "base"), ref.at("images"));
  std::cout << "CLI SDXL images vs Diffusers: " << d << "\n";
  EXPECT_LE(d, 1e-4);
  EXPECT_NE(r.err.find("StableDiffusionXLPipeline"), std::string::npos) << r.log();
  EXPECT_NE(r.err.find("guidance 5"), std::string::npos) << r.log();

  // The micro-conditioning flags change the images; explicit defaults do not.
  auto same = kCall;
  same.insert(same.end(), {"--original_size", "32", "32", "--crops_coords_top_left", "0", "0",
                           "--target_size", "32", "32"});
  ASSERT_EQ(sample_xl(dir, "same", same).exit_code, 0);
  EXPECT_EQ(tensor_diff(images_of(dir, "same"), images_of(dir, "base")), 0.0);
  auto other = kCall;
  other.insert(other.end(), {"--original_size", "1024", "512", "--crops_coords_top_left", "64", "0",
                             "--guidance_rescale", "0.5"});
  ASSERT_EQ(sample_xl(dir, "other", other).exit_code, 0);
  EXPECT_GT(tensor_diff(images_of(dir, "other"), images_of(dir, "base")), 1e-4);

  // A separate VAE folder (here the same weights) gives the same images.
  auto vae = kCall;
  vae.insert(vae.end(), {"--pretrained_vae_model_name_or_path", kXl + "/vae"});
  ASSERT_EQ(sample_xl(dir, "vae", vae).exit_code, 0);
  EXPECT_EQ(tensor_diff(images_of(dir, "vae"), images_of(dir, "base")), 0.0);

  // Bad input: one line, non-zero.
  auto bad = kCall;
  bad.insert(bad.end(), {"--pretrained_vae_model_name_or_path", dir + "/nope"});
  auto e = sample_xl(dir, "bad", bad);
  EXPECT_NE(e.exit_code, 0);
  EXPECT_NE(e.err.find("nope"), std::string::npos) << e.log();
  auto sd = run({kDifftrain, "sample", "--model",
                 std::string(difftrain_test::source_dir()) + "/tests/golden/sd/tiny_sd", "--prompt",
                 "x", "--original_size", "64", "64", "--output", dir + "/sd.png"},
                {}, 60);
  EXPECT_NE(sd.exit_code, 0);
  EXPECT_NE(sd.err.find("--original_size is an option of the sdxl family"), std::string::npos)
      << sd.log();
}

std::vector<std::string> xl_train_cmd(const std::string& data, const std::string& out,
                                      std::vector<std::string> extra) {
  std::vector<std::string> cmd = {"train",
                                  "--pretrained_model_name_or_path",
                                  kXl,
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

TEST(SdxlCli, LoraWithTextEncodersOnTwoRanksInBucketsLowersLossAndExports) {
  const std::string dir = make_temp_dir("sdxl_lora");
  const std::string data = make_mixed_aspect_folder(dir + "/data");
  const std::string out = dir + "/run";
  auto r = train(
      xl_train_cmd(data, out,
                   {"--max_train_steps", "40", "--train_text_encoder", "--gradient_checkpointing",
                    "--snr_gamma", "5", "--noise_offset", "0.05"}),
      2, 600);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  // Three buckets for the three shapes, each holding its four images.
  EXPECT_NE(r.err.find("aspect-ratio buckets: 12 image(s)"), std::string::npos) << r.log();
  EXPECT_NE(r.err.find("16x48: 4 image(s)"), std::string::npos) << r.log();
  EXPECT_NE(r.err.find("48x16: 4 image(s)"), std::string::npos) << r.log();
  auto l = losses(out);
  ASSERT_EQ(l.size(), 40u);
  double first = 0, last = 0;
  for (int i = 0; i < 10; ++i)
    first += l[static_cast<size_t>(i)] / 10, last += l[l.size() - 1 - i] / 10;
  std::cout << "SDXL loss: first 10 " << first << ", last 10 " << last << "\n";
  EXPECT_LT(last, 0.9 * first);

  // The export holds all three components in Diffusers' layout.
  auto weights = io::read_lora(out + "/pytorch_lora_weights.safetensors");
  EXPECT_EQ(weights.count("unet"),
            4u * 2u * 12u);  // q,k,v,out of attn1+attn2 in 12 transformer blocks
  EXPECT_EQ(weights.count("text_encoder"),
            4u * 1u);  // layer 0 only: hidden_states[-2] is its output
  EXPECT_EQ(weights.count("text_encoder_2"), 4u * 3u);  // of 3 layers
  const std::vector<std::string> prompt = {
      "--prompt", "a red wide picture",    "--height", "16",     "--width",
      "48",       "--num_inference_steps", "4",        "--seed", "0"};
  auto base = sample_xl(dir, "base", prompt);
  ASSERT_EQ(base.exit_code, 0) << base.log();
  auto with_lora = prompt;
  with_lora.insert(with_lora.end(), {"--lora", out + "/pytorch_lora_weights.safetensors"});
  auto tuned = sample_xl(dir, "tuned", with_lora);
  ASSERT_EQ(tuned.exit_code, 0) << tuned.log();
  EXPECT_NE(tuned.err.find("merged into 96 UNet and 16 text encoder modules"), std::string::npos)
      << tuned.log();
  const double changed = tensor_diff(images_of(dir, "tuned"), images_of(dir, "base"));
  std::cout << "SDXL LoRA changes the images by " << changed << "\n";
  EXPECT_GT(changed, 1e-3);

  // The same weights written as kohya (SGM names) and PEFT give the same images.
  for (const auto& [format, tag] : std::vector<std::pair<io::LoraFormat, std::string>>{
           {io::LoraFormat::kKohya, "kohya"}, {io::LoraFormat::kPeft, "peft"}}) {
    io::LoraWeights w = weights;
    if (format == io::LoraFormat::kKohya) {
      // Through `difftrain lora convert`, as a user would.
      auto conv =
          run({kDifftrain, "lora", "convert", "--input", out + "/pytorch_lora_weights.safetensors",
               "--output", dir + "/" + tag + ".safetensors", "--to", tag, "--model", kXl},
              {}, 60);
      ASSERT_EQ(conv.exit_code, 0) << conv.log();
      auto t = io::load_safetensors(dir + "/" + tag + ".safetensors").tensors;
      EXPECT_TRUE(
          t.count("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight"))
          << conv.log();
      EXPECT_TRUE(t.count("lora_te2_text_model_encoder_layers_0_self_attn_q_proj.alpha"));
    } else {
      io::write_lora(dir + "/" + tag + ".safetensors", w, format);
    }
    auto again = prompt;
    again.insert(again.end(), {"--lora", dir + "/" + tag + ".safetensors"});
    ASSERT_EQ(sample_xl(dir, tag, again).exit_code, 0);
    EXPECT_LE(tensor_diff(images_of(dir, tag), images_of(dir, "tuned")), 1e-5) << tag;
  }
}

TEST(SdxlCli, ResumeWithBucketsIsExact) {
  const std::string dir = make_temp_dir("sdxl_resume");
  const std::string data = make_mixed_aspect_folder(dir + "/data");
  auto cmd = [&](const std::string& out, const std::string& steps) {
    return xl_train_cmd(data, out,
                        {"--max_train_steps", steps, "--checkpointing_steps", "3",
                         "--train_text_encoder", "--random_flip", "--train_batch_size", "2"});
  };
  auto straight = train(cmd(dir + "/straight", "6"), 2, 600);
  ASSERT_EQ(straight.exit_code, 0) << straight.log();
  auto first = train(cmd(dir + "/resumed", "3"), 2, 600);
  ASSERT_EQ(first.exit_code, 0) << first.log();
  auto c = cmd(dir + "/resumed", "6");
  c.insert(c.end(), {"--resume_from_checkpoint", "latest"});
  auto second = train(c, 2, 600);
  ASSERT_EQ(second.exit_code, 0) << second.log();
  EXPECT_NE(second.err.find("resumed from"), std::string::npos) << second.log();
  const double d =
      max_abs_diff(io::load_safetensors(dir + "/straight/pytorch_lora_weights.safetensors").tensors,
                   io::load_safetensors(dir + "/resumed/pytorch_lora_weights.safetensors").tensors);
  std::cout << "SDXL resumed vs straight (buckets): " << d << "\n";
  EXPECT_EQ(d, 0.0);
  EXPECT_EQ(losses(dir + "/straight").back(), losses(dir + "/resumed").back());

  // Buckets with prior preservation are refused with the reason.
  auto bad =
      train(xl_train_cmd(data, dir + "/bad",
                         {"--max_train_steps", "1", "--with_prior_preservation", "--class_data_dir",
                          dir + "/class", "--class_prompt", "x", "--instance_prompt", "y"}));
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("--resolution_buckets with --with_prior_preservation"), std::string::npos)
      << bad.log();
}

// DreamBooth with prior preservation (class images drawn from the SDXL pipeline itself), bf16
// with the frozen base in bf16, and cached latents and prompt embeddings (both encoders' states
// and the pooled one) training like the uncached run.
TEST(SdxlCli, DreamBoothBf16AndCachedEmbeddings) {
  const std::string dir = make_temp_dir("sdxl_dreambooth");
  const std::string data = make_mixed_aspect_folder(dir + "/data");
  auto square = [&](const std::string& out, std::vector<std::string> extra) {
    auto c = xl_train_cmd(data, out, extra);
    // Square centre crops (no buckets): DreamBooth and the latent cache need one size.
    c.erase(std::find(c.begin(), c.end(), "--resolution_buckets"));
    c.erase(std::find(c.begin(), c.end(), "--bucket_step"),
            std::find(c.begin(), c.end(), "--bucket_step") + 2);
    return c;
  };
  auto db = train(
      square(dir + "/db",
             {"--max_train_steps", "3", "--instance_prompt", "a photo of sks picture",
              "--with_prior_preservation", "--class_data_dir", dir + "/class", "--class_prompt",
              "a photo of a picture", "--num_class_images", "2", "--validation_inference_steps",
              "2", "--mixed_precision", "bf16", "--validation_prompt", "a photo of sks picture",
              "--num_validation_images", "1"}),
      2, 600);
  ASSERT_EQ(db.exit_code, 0) << db.log();
  EXPECT_NE(db.err.find("generating 2 class image(s)"), std::string::npos) << db.log();
  EXPECT_EQ(std::distance(fs::directory_iterator(dir + "/class"), fs::directory_iterator()), 2);
  EXPECT_TRUE(fs::exists(dir + "/db/samples/step-000003.png")) << db.log();
  for (double l : losses(dir + "/db")) EXPECT_TRUE(std::isfinite(l));
  ExpectedCard card = {kXl, "openrail++", {"text-to-image", "stable-diffusion-xl"}, false, "", 0,
                       ""};
  card.lora = true;
  card.instance_prompt = "a photo of sks picture";
  card.widgets = 1;
  card.widget_text = "a photo of sks picture";
  const auto text = expect_model_card(dir + "/db", card);
  EXPECT_NE(text.find("| mixed precision | bf16 |"), std::string::npos) << text;
  EXPECT_NE(text.find("StableDiffusionXLPipeline.from_pretrained("), std::string::npos) << text;
  // bf16 holds the frozen UNet base, both text encoders and the VAE at 2 bytes per parameter.
  int64_t frozen = 0;
  for (const char* f :
       {"/unet/diffusion_pytorch_model.safetensors", "/vae/diffusion_pytorch_model.safetensors",
        "/text_encoder/model.safetensors", "/text_encoder_2/model.safetensors"}) {
    for (const auto& [key, t] : io::load_safetensors(kXl + f).tensors) frozen += t.numel();
  }
  const auto info = nlohmann::json::parse(std::ifstream(dir + "/db/logs/run_info.rank0.json"));
  EXPECT_EQ(info["state_bytes"]["frozen_param_bytes"].get<int64_t>(), 2 * frozen);

  // A small learning rate keeps Adam from amplifying rounding on near-zero gradients.
  auto plain = train(square(dir + "/plain", {"--max_train_steps", "3", "--learning_rate", "1e-4"}));
  ASSERT_EQ(plain.exit_code, 0) << plain.log();
  auto cached = train(square(
      dir + "/cached", {"--max_train_steps", "3", "--cache_latents", "--learning_rate", "1e-4"}));
  ASSERT_EQ(cached.exit_code, 0) << cached.log();
  EXPECT_NE(cached.err.find("cache_latents: encoded 12 image(s)"), std::string::npos)
      << cached.log();
  EXPECT_NE(cached.err.find("caption(s)"), std::string::npos) << cached.log();
  // The same tolerance as the SD-1.x cache test: batched vs single encoder rounding only.
  const double d =
      max_abs_diff(io::load_safetensors(dir + "/plain/pytorch_lora_weights.safetensors").tensors,
                   io::load_safetensors(dir + "/cached/pytorch_lora_weights.safetensors").tensors);
  std::cout << "SDXL cached vs uncached: " << d << "\n";
  EXPECT_LE(d, 1e-4);
}

// Full fine-tuning of the SDXL UNet with EMA exports a StableDiffusionXLPipeline folder (both
// encoders and tokenizers copied) that `difftrain sample` loads.
TEST(SdxlCli, FullFineTuningExportsAnSdxlPipeline) {
  const std::string dir = make_temp_dir("sdxl_full");
  const std::string data = make_mixed_aspect_folder(dir + "/data");
  auto c = xl_train_cmd(data, dir + "/full", {"--max_train_steps", "2", "--learning_rate", "1e-4"});
  c.erase(std::find(c.begin(), c.end(), "--lora"));
  c.erase(std::find(c.begin(), c.end(), "--rank"), std::find(c.begin(), c.end(), "--rank") + 2);
  *(std::find(c.begin(), c.end(), "--use_ema") + 1) = "true";
  auto r = train(c, 2, 600);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  for (const char* part :
       {"unet", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler"}) {
    EXPECT_TRUE(fs::is_directory(dir + "/full/" + part)) << part;
  }
  expect_model_card(
      dir + "/full",
      {kXl, "openrail++", {"text-to-image", "stable-diffusion-xl"}, false, "", 0, ""});
  auto s = run({kDifftrain, "sample", "--model", dir + "/full", "--prompt", "a red wide picture",
                "--height", "16", "--width", "48", "--num_inference_steps", "2", "--output",
                dir + "/full.png", "--save_tensors", dir + "/full.safetensors"},
               {}, 120);
  ASSERT_EQ(s.exit_code, 0) << s.log();
  EXPECT_NE(s.err.find("StableDiffusionXLPipeline"), std::string::npos) << s.log();
  // The trained UNet differs from the fixture's.
  auto base = io::load_safetensors(kXl + "/unet/diffusion_pytorch_model.safetensors").tensors;
  auto tuned = io::load_safetensors(dir + "/full/unet/diffusion_pytorch_model.safetensors").tensors;
  EXPECT_GT(max_abs_diff(base, tuned), 0.0);
}

// Cached latents of bucketed images (several latent sizes in one cache) train like uncached ones;
// and buckets work for an SD-1.x folder as well.
TEST(SdxlCli, BucketsWithCachedLatentsAndOnSd1) {
  const std::string dir = make_temp_dir("sdxl_bucket_cache");
  const std::string data = make_mixed_aspect_folder(dir + "/data");
  auto plain = train(
      xl_train_cmd(data, dir + "/plain", {"--max_train_steps", "3", "--learning_rate", "1e-4"}));
  ASSERT_EQ(plain.exit_code, 0) << plain.log();
  auto cached =
      train(xl_train_cmd(data, dir + "/cached",
                         {"--max_train_steps", "3", "--learning_rate", "1e-4", "--cache_latents"}));
  ASSERT_EQ(cached.exit_code, 0) << cached.log();
  EXPECT_NE(cached.err.find("cache_latents: encoded 12 image(s)"), std::string::npos)
      << cached.log();
  const double d =
      max_abs_diff(io::load_safetensors(dir + "/plain/pytorch_lora_weights.safetensors").tensors,
                   io::load_safetensors(dir + "/cached/pytorch_lora_weights.safetensors").tensors);
  std::cout << "SDXL bucketed cached vs uncached: " << d << "\n";
  EXPECT_LE(d, 1e-4);
  EXPECT_EQ(losses(dir + "/plain").size(), 3u);

  auto sd = xl_train_cmd(data, dir + "/sd", {"--max_train_steps", "2"});
  *(std::find(sd.begin(), sd.end(), kXl)) =
      std::string(difftrain_test::source_dir()) + "/tests/golden/sd/tiny_sd";
  auto r = train(sd, 2, 300);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_NE(r.err.find("16x48: 4 image(s)"), std::string::npos) << r.log();
  const auto sd_lora = io::read_lora(dir + "/sd/pytorch_lora_weights.safetensors");
  EXPECT_GT(sd_lora.count("unet"), 0u);
  EXPECT_EQ(sd_lora.count("text_encoder_2"), 0u);
}

}  // namespace
}  // namespace difftrain::testing
