// FLUX.1 end to end through the CLI on the tiny fixture: `difftrain sample` seed-exact against
// FluxPipeline (with and without a kohya LoRA), `difftrain forward` on the transformer's io
// tensors, and one-line errors for what a FLUX folder cannot do.

#include "train_util.h"

#include "source_dir.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <iostream>

namespace difftrain::testing {
namespace {

namespace fs = std::filesystem;

const std::string kFlux =
    std::string(difftrain_test::source_dir()) + "/tests/golden/flux/tiny_flux";
const std::string kFluxLora =
    std::string(difftrain_test::source_dir()) + "/tests/golden/flux/tiny_flux_lora";

double flux_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

ProcessResult flux_sample(const std::string& dir, std::vector<std::string> extra,
                          const std::string& height = "48") {
  std::vector<std::string> argv = {kDifftrain,
                                   "sample",
                                   "--model",
                                   kFlux,
                                   "--prompt",
                                   "a photo of a cat",
                                   "--prompt",
                                   "An astronaut riding a horse on Mars, highly detailed, 8k",
                                   "--height",
                                   height,
                                   "--width",
                                   "64",
                                   "--num_inference_steps",
                                   "6",
                                   "--max_sequence_length",
                                   "32",
                                   "--seed",
                                   "42",
                                   "--output",
                                   dir + "/grid.png",
                                   "--save_tensors",
                                   dir + "/out.safetensors"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return run(argv, {}, 120);
}

TEST(FluxCli, SampleMatchesFluxPipelineWithAndWithoutLora) {
  const std::string dir = make_temp_dir("flux_sample");
  auto r = flux_sample(dir, {});
  ASSERT_EQ(r.exit_code, 0) << r.log();
  auto ref = io::load_safetensors(kFlux + "/txt2img_seed42.safetensors").tensors;
  auto got = io::load_safetensors(dir + "/out.safetensors").tensors;
  const double d = flux_diff(got.at("images"), ref.at("images"));
  const double p = flux_diff(got.at("pooled_prompt_embeds"), ref.at("pooled_prompt_embeds"));
  std::cout << "CLI images vs FluxPipeline: " << d << ", pooled " << p << "\n";
  EXPECT_LE(d, 1e-4);
  EXPECT_LE(p, 1e-4);
  EXPECT_TRUE(fs::exists(dir + "/grid.png"));
  EXPECT_NE(r.err.find("step 6/6"), std::string::npos) << r.log();
  EXPECT_NE(r.err.find("guidance 3.5"), std::string::npos) << r.log();

  auto l = flux_sample(dir, {"--lora", kFluxLora + "/kohya_flux_lora.safetensors"});
  ASSERT_EQ(l.exit_code, 0) << l.log();
  auto lora_ref = io::load_safetensors(kFluxLora + "/txt2img_lora_seed42.safetensors").tensors;
  const double dl = flux_diff(io::load_safetensors(dir + "/out.safetensors").tensors.at("images"),
                              lora_ref.at("images"));
  std::cout << "CLI images with the kohya LoRA vs FluxPipeline: " << dl << "\n";
  EXPECT_LE(dl, 1e-4);

  // bf16 end to end (FLUX.1 ships bf16): close to the float32 reference.
  auto b = flux_sample(dir, {"--dtype", "bf16"});
  ASSERT_EQ(b.exit_code, 0) << b.log();
  const torch::Tensor bf = io::load_safetensors(dir + "/out.safetensors").tensors.at("images");
  const double rel = ((bf - ref.at("images")).norm() / ref.at("images").norm()).item<double>();
  std::cout << "CLI bf16 images vs float32 FluxPipeline: relative L2 " << rel << "\n";
  EXPECT_LE(rel, 0.25);  // bf16 timesteps, as Diffusers runs them (flux_pipeline_test.cpp)

  // What FluxPipeline does not take, as one-line errors.
  auto neg = flux_sample(dir, {"--negative_prompt", "blurry"});
  EXPECT_NE(neg.exit_code, 0);
  EXPECT_NE(neg.err.find("no negative prompt"), std::string::npos) << neg.log();
  auto odd = flux_sample(dir, {}, "44");
  EXPECT_NE(odd.exit_code, 0);
  EXPECT_NE(odd.err.find("multiples of 8"), std::string::npos) << odd.log();
}

TEST(FluxCli, MergedAndConvertedLorasSampleLikeTheLoraReference) {
  const std::string dir = make_temp_dir("flux_lora_cli");
  auto lora_ref = io::load_safetensors(kFluxLora + "/txt2img_lora_seed42.safetensors").tensors;
  // lora merge: the kohya file folded into a copy of the folder, sampled without --lora.
  auto m = run({kDifftrain, "lora", "merge", "--model", kFlux, "--lora",
                kFluxLora + "/kohya_flux_lora.safetensors", "--output", dir + "/merged"},
               {}, 120);
  ASSERT_EQ(m.exit_code, 0) << m.log();
  EXPECT_TRUE(fs::exists(dir + "/merged/transformer/diffusion_pytorch_model.safetensors"));
  EXPECT_TRUE(fs::exists(dir + "/merged/text_encoder_2/model.safetensors"));
  std::vector<std::string> argv = {kDifftrain,
                                   "sample",
                                   "--model",
                                   dir + "/merged",
                                   "--prompt",
                                   "a photo of a cat",
                                   "--prompt",
                                   "An astronaut riding a horse on Mars, highly detailed, 8k",
                                   "--height",
                                   "48",
                                   "--width",
                                   "64",
                                   "--num_inference_steps",
                                   "6",
                                   "--max_sequence_length",
                                   "32",
                                   "--seed",
                                   "42",
                                   "--output",
                                   dir + "/m.png",
                                   "--save_tensors",
                                   dir + "/m.safetensors"};
  auto s = run(argv, {}, 120);
  ASSERT_EQ(s.exit_code, 0) << s.log();
  const double dm = flux_diff(io::load_safetensors(dir + "/m.safetensors").tensors.at("images"),
                              lora_ref.at("images"));
  std::cout << "merged kohya LoRA vs FluxPipeline with the LoRA: " << dm << "\n";
  EXPECT_LE(dm, 1e-4);
  // lora convert: kohya -> Diffusers, and the Diffusers file -> kohya (BFL names) -> sample.
  auto c = run(
      {kDifftrain, "lora", "convert", "--input", kFluxLora + "/pytorch_lora_weights.safetensors",
       "--output", dir + "/kohya.safetensors", "--to", "kohya", "--model", kFlux},
      {}, 60);
  ASSERT_EQ(c.exit_code, 0) << c.log();
  auto header = io::read_safetensors_header(dir + "/kohya.safetensors");
  EXPECT_EQ(header.tensors.count("lora_unet_double_blocks_1_txt_attn_qkv.lora_down.weight"), 1u);
  auto k = flux_sample(dir, {"--lora", dir + "/kohya.safetensors"});
  ASSERT_EQ(k.exit_code, 0) << k.log();
  const double dk = flux_diff(io::load_safetensors(dir + "/out.safetensors").tensors.at("images"),
                              lora_ref.at("images"));
  std::cout << "Diffusers LoRA converted to kohya vs the reference: " << dk << "\n";
  EXPECT_LE(dk, 1e-4);
}

TEST(FluxCli, EstimateMemoryOfFlux1DevConfigsHasThePublicParameterCounts) {
  // configs/flux1-dev: the transformer and T5-XXL counted from their configs (never built),
  // CLIP-L and the VAE built; tiny activations (2x2 latents, 4 text tokens) keep it quick.
  const std::string configs = std::string(difftrain_test::source_dir()) + "/configs/flux1-dev";
  auto r = run({kDifftrain, "estimate-memory", "--model", configs, "--resolution", "2",
                "--encoder_sequence_length", "4", "--json"},
               {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  const auto j = nlohmann::json::parse(r.out);
  const auto& e = j;
  std::cout << "trainable " << e.at("trainable_params") << ", frozen " << e.at("frozen_params")
            << ", total peak " << e.at("total_peak_bytes") << "\n";
  EXPECT_EQ(e.at("trainable_params").get<int64_t>(), 11901408320);
  // The VAE, 83,819,683; training releases CLIP-L (123,060,480) and T5-XXL's encoder
  // (4,762,310,656) once the captions are cached.
  EXPECT_EQ(e.at("frozen_params").get<int64_t>(), 83819683);
}

TEST(FluxCli, ForwardOfTheTransformerEqualsDiffusers) {
  const std::string dir = make_temp_dir("flux_forward");
  // Case B of the io file: arbitrary ids on all three axes.
  auto io = io::load_safetensors(kFlux + "/transformer/io.safetensors").tensors;
  io::TensorMap inputs;
  for (const char* name : {"hidden_states", "encoder_hidden_states", "pooled_projections",
                           "timestep", "guidance", "img_ids", "txt_ids", "out"}) {
    inputs[name] = io.at(std::string("B.") + name);
  }
  io::save_safetensors(dir + "/in.safetensors", inputs);
  auto r = run({kDifftrain, "forward", "--model", kFlux, "--inputs", dir + "/in.safetensors",
                "--output", dir + "/out.safetensors"},
               {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  const double d =
      flux_diff(io::load_safetensors(dir + "/out.safetensors").tensors.at("out"), io.at("B.out"));
  std::cout << "forward vs Diffusers: " << d << "\n";
  EXPECT_LE(d, 1e-4);
  // A LoRA of another family is refused here too (issue 56).
  auto sdxl =
      run({kDifftrain, "forward", "--model", kFlux, "--inputs", dir + "/in.safetensors", "--lora",
           std::string(difftrain_test::source_dir()) +
               "/tests/golden/sdxl/tiny_sdxl_lora/pytorch_lora_weights.safetensors",
           "--output", dir + "/sdxl.safetensors"},
          {}, 120);
  EXPECT_NE(sdxl.exit_code, 0) << sdxl.log();
  EXPECT_NE(sdxl.err.find("it is a sdxl LoRA"), std::string::npos) << sdxl.log();
  EXPECT_FALSE(fs::exists(dir + "/sdxl.safetensors"));
}

}  // namespace
}  // namespace difftrain::testing
