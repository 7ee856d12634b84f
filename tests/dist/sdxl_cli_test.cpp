// SDXL end to end: `difftrain sample --model SDXL_DIR` against the Diffusers reference
// (tests/golden/sdxl), with and without the fixture LoRAs.

#include "train_util.h"

#include "difftrain/io/lora_format.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace difftrain::testing {
namespace {

namespace fs = std::filesystem;

const std::string kGolden = std::string(DIFFTRAIN_SOURCE_DIR) + "/tests/golden/sdxl";
const std::string kXl = kGolden + "/tiny_sdxl";

double tensor_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

ProcessResult sample_xl(const std::string& dir, const std::string& name,
                        std::vector<std::string> extra) {
  std::vector<std::string> argv = {kDifftrain, "sample",   "--model", kXl, "--output",
                                   dir + "/" + name + ".png", "--save_tensors",
                                   dir + "/" + name + ".safetensors"};
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
  other.insert(other.end(), {"--original_size", "1024", "512", "--crops_coords_top_left", "64",
                             "0", "--guidance_rescale", "0.5"});
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
                 std::string(DIFFTRAIN_SOURCE_DIR) + "/tests/golden/sd/tiny_sd", "--prompt", "x",
                 "--original_size", "64", "64", "--output", dir + "/sd.png"},
                {}, 60);
  EXPECT_NE(sd.exit_code, 0);
  EXPECT_NE(sd.err.find("SDXL's micro-conditioning"), std::string::npos) << sd.log();
}

}  // namespace
}  // namespace difftrain::testing
