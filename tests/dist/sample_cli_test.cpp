// `difftrain sample` and `difftrain forward` end to end: the written tensors equal Diffusers'
// pipeline output for the same seed, the PNG grid exists, LoRA flags apply, bad input exits 1
// with a one-line message.

#include "subprocess.h"

#include "../unit/chain_tolerance.h"
#include "../unit/uncond_chains.h"

#include "difftrain/io/image.h"
#include "difftrain/io/safetensors.h"
#include "program_paths.h"
#include "source_dir.h"

#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

namespace difftrain::testing {
namespace {

namespace fs = std::filesystem;
const std::string kDifftrain = difftrain_test::difftrain_bin();
const std::string kGolden = std::string(difftrain_test::source_dir()) + "/tests/golden/diffusers/";

double max_abs(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

TEST(SampleCommand, DdimFromAPipelineFolderEqualsDiffusers) {
  // A pipeline folder as DDIMPipeline.save_pretrained writes it.
  const auto dir = make_temp_dir("pipe");
  fs::create_directories(dir + "/unet");
  fs::create_directories(dir + "/scheduler");
  for (const char* f : {"config.json", "diffusion_pytorch_model.safetensors"}) {
    fs::copy_file(kGolden + "unet2d_uncond/" + f, dir + "/unet/" + f);
  }
  fs::copy_file(kGolden + "unet2d_uncond/scheduler_config.json",
                dir + "/scheduler/scheduler_config.json");
  std::ofstream(dir + "/model_index.json")
      << R"({"_class_name": "DDIMPipeline", "_diffusers_version": "0.31.0",)"
      << R"( "scheduler": ["diffusers", "DDIMScheduler"], "unet": ["diffusers", "UNet2DModel"]})";
  const auto r = run({kDifftrain, "sample", "--model", dir, "--num_inference_steps", "10",
                      "--num_images", "2", "--seed", "1234", "--output", dir + "/grid.png",
                      "--save_tensors", dir + "/images.safetensors"},
                     {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_NE((r.out + r.err).find("DDIMScheduler, 10 steps"), std::string::npos) << r.log();
  EXPECT_NE((r.out + r.err).find("step 10/10"), std::string::npos) << r.log();
  auto images = io::load_safetensors(dir + "/images.safetensors").tensors.at("images");
  // The DDIM chain amplifies float32 rounding by ~100x, by an amount the CPU's kernels and the
  // thread count decide: the tolerance is measured against the same chain in float64, run here
  // in-process (tests/unit/chain_tolerance.h).
  test::expect_chain_agrees(
      "difftrain sample (DDIM, seed 1234)",
      test::chain_check(images, test::uncond_images("ddim", 2, 10, 1234, torch::kFloat64),
                        test::uncond_reference("ddim_seed1234_steps10.safetensors")));
  auto grid = io::load_image(dir + "/grid.png", 3);
  EXPECT_GT(grid.size(0), 16);
  EXPECT_GT(grid.size(1), 2 * 16);
}

TEST(SampleCommand, DdpmFromAUNetFolderEqualsDiffusers) {
  const auto dir = make_temp_dir("ddpm");
  const auto r = run({kDifftrain, "sample", "--model", kGolden + "unet2d_uncond", "--scheduler",
                      "ddpm", "--num_inference_steps", "20", "--seed", "99", "--output",
                      dir + "/grid.png", "--save_tensors", dir + "/images.safetensors"},
                     {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  auto images = io::load_safetensors(dir + "/images.safetensors").tensors.at("images");
  test::expect_chain_agrees(
      "difftrain sample (DDPM, seed 99)",
      test::chain_check(images, test::uncond_ddpm_float64(1, 20, 99),
                        test::uncond_reference("ddpm_seed99_steps20.safetensors")));
}

TEST(SampleCommand, ClassConditionalWithGuidanceWritesALabelledGrid) {
  // A DDPMPipeline-style folder around the class-conditional UNet.
  const auto dir = make_temp_dir("cls");
  fs::create_directories(dir + "/unet");
  fs::create_directories(dir + "/scheduler");
  for (const char* f : {"config.json", "diffusion_pytorch_model.safetensors"}) {
    fs::copy_file(kGolden + "unet2d/" + f, dir + "/unet/" + f);
  }
  fs::copy_file(kGolden + "unet2d_uncond/scheduler_config.json",
                dir + "/scheduler/scheduler_config.json");
  std::ofstream(dir + "/model_index.json") << R"({"_class_name": "DDPMPipeline"})";
  const auto r = run({kDifftrain,
                      "sample",
                      "--model",
                      dir,
                      "--scheduler",
                      "ddpm",
                      "--num_inference_steps",
                      "5",
                      "--class_labels",
                      "1,2,3",
                      "--guidance_scale",
                      "2",
                      "--seed",
                      "7",
                      "--columns",
                      "3",
                      "--output",
                      dir + "/grid.png",
                      "--save_tensors",
                      dir + "/images.safetensors"},
                     {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_NE((r.out + r.err).find("3 images, seed 7, guidance 2"), std::string::npos) << r.log();
  auto images = io::load_safetensors(dir + "/images.safetensors").tensors.at("images");
  EXPECT_EQ(images.sizes(), (std::vector<int64_t>{3, 16, 16, 3}));
  EXPECT_GE(images.min().item<float>(), 0.0f);
  EXPECT_LE(images.max().item<float>(), 1.0f);
  // Three cells in one row, each with a caption strip under its image.
  auto grid = io::load_image(dir + "/grid.png", 3);
  EXPECT_GT(grid.size(1), 3 * 16);
  EXPECT_GT(grid.size(0), 16 + 4);
}

TEST(ForwardCommand, OutputsEqualDiffusersWithAndWithoutLora) {
  const auto dir = make_temp_dir("fwd");
  auto r = run({kDifftrain, "forward", "--model", kGolden + "unet2d", "--inputs",
                kGolden + "unet2d/io.safetensors", "--output", dir + "/out.safetensors"},
               {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  auto out = io::load_safetensors(dir + "/out.safetensors").tensors.at("out");
  auto ref = io::load_safetensors(kGolden + "unet2d/io.safetensors").tensors.at("out");
  EXPECT_LT(max_abs(out, ref), 1e-4);
  r = run({kDifftrain, "forward", "--model", kGolden + "unet_cond", "--lora",
           kGolden + "lora/kohya_format.safetensors", "--inputs", kGolden + "lora/io.safetensors",
           "--output", dir + "/lora.safetensors"},
          {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  out = io::load_safetensors(dir + "/lora.safetensors").tensors.at("out");
  ref = io::load_safetensors(kGolden + "lora/io.safetensors").tensors.at("out");
  const double diff = max_abs(out, ref);
  std::printf("difftrain forward --lora (kohya): max |out - diffusers| = %.3g (tol 1e-4)\n", diff);
  EXPECT_LT(diff, 1e-4);
  // --lora_scale 0 gives the base model's output.
  r = run({kDifftrain, "forward", "--model", kGolden + "unet_cond", "--lora",
           kGolden + "lora/peft_format.safetensors", "--lora_scale", "0", "--inputs",
           kGolden + "unet_cond/io.safetensors", "--output", dir + "/zero.safetensors"},
          {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  out = io::load_safetensors(dir + "/zero.safetensors").tensors.at("out");
  ref = io::load_safetensors(kGolden + "unet_cond/io.safetensors").tensors.at("out");
  EXPECT_LT(max_abs(out, ref), 1e-4);
}

TEST(SampleCommand, BadInputExitsWithOneLineErrors) {
  const auto dir = make_temp_dir("bad");
  struct Case {
    std::vector<std::string> args;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {{"sample", "--model", dir + "/missing"}, "no such folder"},
      {{"sample", "--model", kGolden + "unet2d"}, "scheduler_config.json: no such file"},
      {{"sample", "--model", kGolden + "unet2d_uncond", "--class_labels", "1,x"},
       "\"x\" is not an integer"},
      {{"sample", "--model", kGolden + "unet2d_uncond", "--lora", dir + "/none.safetensors"},
       "none.safetensors"},
      {{"forward", "--model", kGolden + "unet_cond", "--inputs", kGolden + "unet2d/io.safetensors",
        "--output", dir + "/o.safetensors"},
       "sample must be [B, 4, H, W]"},
      {{"forward", "--model", kGolden + "unet2d", "--inputs", kGolden + "schedulers.safetensors",
        "--output", dir + "/o.safetensors"},
       "no tensor named \"sample\""},
      {{"sample", "--model", kGolden + "unet2d_uncond", "--device", "tpu"},
       "--device 'tpu' is not a device: use auto, cpu, cuda or cuda:N"},
      {{"sample", "--model", kGolden + "unet2d_uncond", "--device", "cuda:7"},
       torch::cuda::is_available() ? "only" : "no CUDA device is visible"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv{kDifftrain};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    const auto r = run(argv, {}, 60);
    EXPECT_EQ(r.exit_code, 1) << r.log();
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.expect << "\n" << r.log();
    EXPECT_EQ(r.err.find("terminate"), std::string::npos) << r.log();
  }
}

}  // namespace
}  // namespace difftrain::testing
