// Sampling as Diffusers' DDIMPipeline / DDPMPipeline on the CPU: the same seed gives the same
// images (fixtures), class-conditional sampling and guidance, and pipeline-folder resolution.

#include "difftrain/families/unet/pipeline.h"
#include "difftrain/core/error.h"
#include "difftrain/diffusion/noise_scheduler.h"
#include "difftrain/diffusion/sampler.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/pretrained.h"

#include <ATen/CPUGeneratorImpl.h>
#include "chain_tolerance.h"
#include "test_util.h"
#include "uncond_chains.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <functional>

namespace {

using difftrain::test::error_of;
using difftrain::test::max_abs;

namespace fs = std::filesystem;
using namespace difftrain;

using difftrain::test::kDiffusersGolden;

using test::uncond_ddpm_float64;
using test::uncond_images;
using test::uncond_reference;

// DDIM with clip_sample from t = 900 divides by sqrt(alphas_cumprod[900]) ~ 0.016, so float32
// rounding of the UNet (~2e-6 per call, the fixtures' own floor) grows ~100x over the chain, and
// how much depends on the CPU's kernels (AVX2 vs AVX-512 paths of oneDNN/OpenBLAS) and thread
// count. The tolerance is therefore measured in this run (chain_tolerance.h): the float64 chain
// must equal Diffusers' images up to the float32 rounding such a chain has, and our float32
// images must lie within that rounding of both.
TEST(Pipeline, DdimTenStepsSeed1234MatchesDiffusers) {
  auto images = uncond_images("ddim", 2, 10, 1234);
  auto ref = uncond_reference("ddim_seed1234_steps10.safetensors");
  ASSERT_EQ(images.sizes(), ref.sizes());
  auto images64 = uncond_images("ddim", 2, 10, 1234, torch::kFloat64);
  test::expect_chain_agrees("DDIMPipeline seed 1234, 10 steps",
                            test::chain_check(images, images64, ref));
  // Another seed gives other images.
  EXPECT_GT(max_abs(uncond_images("ddim", 2, 10, 1235), ref), 1e-2);
}

TEST(Pipeline, DdpmTwentyStepsSeed99MatchesDiffusers) {
  auto images = uncond_images("ddpm", 1, 20, 99);
  auto ref = uncond_reference("ddpm_seed99_steps20.safetensors");
  ASSERT_EQ(images.sizes(), ref.sizes());
  auto images64 = uncond_ddpm_float64(1, 20, 99);
  test::expect_chain_agrees("DDPMPipeline seed 99, 20 steps",
                            test::chain_check(images, images64, ref));
}

// The measured tolerance still catches real semantic errors: each of these scheduler settings
// is a bug a sampler could have (no clipping of x0, the timesteps off by one, the last step
// towards alphas_cumprod[0] instead of 1), run exactly (float64) and compared with Diffusers'
// images under the bounds of the correct float32 chain. Each must be rejected.
TEST(Pipeline, ChainToleranceRejectsSemanticErrors) {
  auto ref = uncond_reference("ddim_seed1234_steps10.safetensors");
  auto images = uncond_images("ddim", 2, 10, 1234);
  auto images64 = uncond_images("ddim", 2, 10, 1234, torch::kFloat64);
  const auto correct = test::chain_check(images, images64, ref);
  ASSERT_TRUE(test::chain_agrees(correct));
  const std::vector<std::pair<std::string, std::function<void(nlohmann::json&)>>> errors = {
      {"clip_sample off", [](nlohmann::json& c) { c["clip_sample"] = false; }},
      {"steps_offset 1", [](nlohmann::json& c) { c["steps_offset"] = 1; }},
      {"set_alpha_to_one false", [](nlohmann::json& c) { c["set_alpha_to_one"] = false; }},
  };
  for (const auto& [name, edit] : errors) {
    auto wrong64 = uncond_images("ddim", 2, 10, 1234, torch::kFloat64, edit);
    // The wrong chain taken as "ours64": is the reference within float32 rounding of it?
    auto c = correct;
    const auto w = test::chain_check(images, wrong64, ref);
    c.ref_max = w.ref_max;
    c.ref_mean = w.ref_mean;
    std::printf(
        "semantic error '%s': max|wrong64 - ref| %.3g (bound %.3g, %.0fx), mean %.3g "
        "(bound %.3g, %.0fx)\n",
        name.c_str(), c.ref_max, c.bound_max, c.ref_max / c.bound_max, c.ref_mean, c.bound_mean,
        c.ref_mean / c.bound_mean);
    EXPECT_FALSE(test::chain_agrees(c)) << name;
  }
}

TEST(Pipeline, ClassConditionalSamplingAndGuidance) {
  auto unet = models::load_unet(kDiffusersGolden + "unet2d");
  auto scheduler =
      diffusion::load_sampler(kDiffusersGolden + "unet2d_uncond/scheduler_config.json", "ddim");
  families::unet::SampleOptions o;
  o.num_images = 2;
  o.num_inference_steps = 4;
  o.class_labels = {1, 7};
  auto a = families::unet::sample_images(*unet, *scheduler, o);
  EXPECT_EQ(a.sizes(), (std::vector<int64_t>{2, 16, 16, 3}));
  // Each image depends on its own label only: swapping labels changes both images.
  o.class_labels = {7, 1};
  auto b = families::unet::sample_images(*unet, *scheduler, o);
  EXPECT_GT(max_abs(a[0], b[0]), 1e-3);
  // Guidance: eps = u + g (c - u) with u from the null class (num_class_embeds - 1 = 9); g = 1
  // equals unguided sampling, so check g > 1 against a manual recomputation of one step.
  o.class_labels = {1, 7};
  o.guidance_scale = 3.0;
  o.num_inference_steps = 1;
  auto guided = families::unet::sample_images(*unet, *scheduler, o);
  scheduler->set_timesteps(1);
  const auto t = scheduler->timesteps()[0];
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(0);
  auto x = at::randn({2, 3, 16, 16}, gen, torch::kFloat32);
  torch::NoGradGuard no_grad;
  models::UNetConditioning c, u;
  c.class_labels = torch::tensor({1, 7});
  u.class_labels = torch::tensor({9, 9});
  auto eps_c = unet->forward(x, t, c), eps_u = unet->forward(x, t, u);
  auto eps = eps_u + 3.0 * (eps_c - eps_u);
  auto expect = scheduler->step(eps, scheduler->timestep(0), x);
  expect = (expect / 2 + 0.5).clamp(0, 1).permute({0, 2, 3, 1});
  const double diff = max_abs(guided, expect);
  std::printf("guided sampling vs manual recomputation: %.3g (tol 1e-5)\n", diff);
  EXPECT_LT(diff, 1e-5);

  o.guidance_scale = 1.0;
  o.class_labels = {1};
  EXPECT_NE(error_of([&] {
              families::unet::sample_images(*unet, *scheduler, o);
            }).find("--class_labels has 1 entries for 2 images"),
            std::string::npos);
  o.class_labels = {1, 10};
  EXPECT_NE(error_of([&] {
              families::unet::sample_images(*unet, *scheduler, o);
            }).find("class label 10 is outside [0, 10)"),
            std::string::npos);
  o.class_labels = {};
  EXPECT_NE(error_of([&] {
              families::unet::sample_images(*unet, *scheduler, o);
            }).find("pass --class_labels"),
            std::string::npos);
}

TEST(Pipeline, ResolvesPipelineAndUNetFolders) {
  const auto dir = fs::temp_directory_path() / ("difftrain_pipe_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "unet");
  fs::create_directories(dir / "scheduler");
  std::ofstream(dir / "model_index.json")
      << R"({"_class_name": "DDIMPipeline", "unet": ["diffusers", "UNet2DModel"]})";
  EXPECT_NE(error_of([&] {
              families::unet::resolve_pipeline_folder(dir.string());
            }).find("scheduler/scheduler_config.json"),
            std::string::npos);
  std::ofstream(dir / "scheduler" / "scheduler_config.json") << "{}";
  auto p = families::unet::resolve_pipeline_folder(dir.string());
  EXPECT_EQ(p.pipeline_class, "DDIMPipeline");
  EXPECT_EQ(p.unet_dir, (dir / "unet").string());
  auto u = families::unet::resolve_pipeline_folder(kDiffusersGolden + "unet2d_uncond");
  EXPECT_EQ(u.unet_dir, kDiffusersGolden + "unet2d_uncond");
  EXPECT_NE(error_of([&] {
              families::unet::resolve_pipeline_folder(kDiffusersGolden + "unet2d");
            }).find("scheduler_config.json: no such file"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              families::unet::resolve_pipeline_folder((dir / "nope").string());
            }).find("no such folder"),
            std::string::npos);
  fs::remove_all(dir);
}

}  // namespace
