// Z-Image through the command line on the tiny fixture folder (tests/golden/z_image): `difftrain
// sample` from prompt strings equals ZImagePipeline's images (sample_e2e, make_sample_e2e.py),
// with its flags of the same names (cfg_normalization, max_sequence_length with the cut said);
// `difftrain forward` writes out.<i> per sample; `lora convert` / `lora merge` take the
// ComfyUI form; bad input is one line and a non-zero exit.
#include "train_util.h"

#include "difftrain/io/safetensors.h"
#include "source_dir.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>

namespace difftrain::testing {
namespace {

namespace fs = std::filesystem;

const std::string kZGolden = std::string(difftrain_test::source_dir()) + "/tests/golden/z_image";
const std::string kZ = kZGolden + "/tiny_z_image";
const std::string kZFlux =
    std::string(difftrain_test::source_dir()) + "/tests/golden/flux/tiny_flux";

#define EXPECT_Z_LOG_HAS(result, part)                                                  \
  EXPECT_NE((result).err.find(part), std::string::npos) << "lacks '" << (part) << "'\n" \
                                                        << (result).log()

double z_max_abs(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

TEST(ZImageCli, SampleEqualsZImagePipelineAndSaysTheCut) {
  const std::string dir = make_temp_dir("z_sample");
  const auto ref = io::load_safetensors(kZ + "/sample_e2e.safetensors").tensors;
  // The `truncated` case: the rendered prompt (32 tokens) cut to 12.
  auto cut = run({kDifftrain,
                  "sample",
                  "--model",
                  kZ,
                  "--prompt",
                  "text with <|im_start|> and <think> inside",
                  "--max_sequence_length",
                  "12",
                  "--guidance_scale",
                  "0",
                  "--num_inference_steps",
                  "2",
                  "--height",
                  "32",
                  "--width",
                  "32",
                  "--seed",
                  "5",
                  "--output",
                  dir + "/cut.png",
                  "--save_tensors",
                  dir + "/cut.safetensors"},
                 {}, 120);
  ASSERT_EQ(cut.exit_code, 0) << cut.log();
  EXPECT_Z_LOG_HAS(cut, "(ZImagePipeline)");
  EXPECT_Z_LOG_HAS(cut, "no guidance");
  EXPECT_Z_LOG_HAS(cut, "truncated");
  auto got = io::load_safetensors(dir + "/cut.safetensors").tensors;
  EXPECT_LT(z_max_abs(got.at("images"), ref.at("truncated.image")), 1e-4);
  EXPECT_TRUE(fs::exists(dir + "/cut.png"));
  // `cfg_default_negative`: CFG against "" with the norm kept (--cfg_normalization true).
  auto cfg = run({kDifftrain,
                  "sample",
                  "--model",
                  kZ,
                  "--prompt",
                  "a cat",
                  "--guidance_scale",
                  "2",
                  "--cfg_normalization",
                  "true",
                  "--num_inference_steps",
                  "2",
                  "--height",
                  "32",
                  "--width",
                  "32",
                  "--seed",
                  "3",
                  "--output",
                  dir + "/cfg.png",
                  "--save_tensors",
                  dir + "/cfg.safetensors"},
                 {}, 120);
  ASSERT_EQ(cfg.exit_code, 0) << cfg.log();
  EXPECT_Z_LOG_HAS(cfg, "guidance 2");
  got = io::load_safetensors(dir + "/cfg.safetensors").tensors;
  EXPECT_LT(z_max_abs(got.at("images"), ref.at("cfg_default_negative.image")), 1e-4);
  EXPECT_LT(z_max_abs(got.at("latents"), ref.at("cfg_default_negative.latents")), 1e-4);
}

TEST(ZImageCli, BadInputIsOneLineAndNonZero) {
  const std::string dir = make_temp_dir("z_bad");
  auto height = run({kDifftrain, "sample", "--model", kZ, "--prompt", "a", "--height", "50",
                     "--width", "32", "--num_inference_steps", "1", "--output", dir + "/s.png"},
                    {}, 120);
  EXPECT_NE(height.exit_code, 0) << height.log();
  EXPECT_Z_LOG_HAS(height, "--height 50 must be a positive multiple of 16");
  EXPECT_FALSE(fs::exists(dir + "/s.png"));
  auto norm = run({kDifftrain, "sample", "--model", kZ, "--prompt", "a", "--cfg_normalization",
                   "maybe", "--output", dir + "/s.png"},
                  {}, 120);
  EXPECT_NE(norm.exit_code, 0) << norm.log();
  EXPECT_Z_LOG_HAS(norm, "--cfg_normalization is \"maybe\": expected true, false or a number");
  // Z-Image's flags on a FLUX.1 folder name their family.
  auto other = run({kDifftrain, "sample", "--model", kZFlux, "--prompt", "a", "--cfg_truncation",
                    "0.5", "--output", dir + "/s.png"},
                   {}, 120);
  EXPECT_NE(other.exit_code, 0) << other.log();
  EXPECT_Z_LOG_HAS(other, "--cfg_truncation is an option of the z-image family");
  auto clip = run({kDifftrain, "sample", "--model", kZ, "--prompt", "a", "--clip_skip", "2",
                   "--output", dir + "/s.png"},
                  {}, 120);
  EXPECT_NE(clip.exit_code, 0) << clip.log();
  EXPECT_Z_LOG_HAS(clip, "--clip_skip does not apply to Z-Image");
}

TEST(ZImageCli, ForwardWritesOneOutputPerSampleAndLorasConvertAndMerge) {
  const std::string dir = make_temp_dir("z_forward");
  const auto ref = io::load_safetensors(kZ + "/forward.safetensors").tensors;
  io::TensorMap inputs;
  for (const auto& [key, t] : ref) {
    if (key.rfind("a.", 0) == 0 && key.find(".out.") == std::string::npos) {
      inputs[key.substr(2)] = t;
    }
  }
  io::save_safetensors(dir + "/in.safetensors", inputs);
  auto fwd =
      run({kDifftrain, "forward", "--model", kZ, "--inputs", dir + "/in.safetensors", "--output",
           dir + "/out.safetensors", "--lora", kZGolden + "/lora/comfyui.safetensors"},
          {}, 120);
  ASSERT_EQ(fwd.exit_code, 0) << fwd.log();
  EXPECT_Z_LOG_HAS(fwd, "out.0 16x1x8x8, out.1 16x1x8x8");
  const auto out = io::load_safetensors(dir + "/out.safetensors").tensors;
  const auto lora_ref = io::load_safetensors(kZGolden + "/lora/expected.safetensors").tensors;
  EXPECT_LT(z_max_abs(out.at("out.0"), lora_ref.at("comfyui.out.0")), 1e-5);
  EXPECT_LT(z_max_abs(out.at("out.1"), lora_ref.at("comfyui.out.1")), 1e-5);

  auto convert =
      run({kDifftrain, "lora", "convert", "--input", kZGolden + "/lora/comfyui.safetensors",
           "--output", dir + "/k.safetensors", "--to", "kohya", "--model", kZ},
          {}, 120);
  ASSERT_EQ(convert.exit_code, 0) << convert.log();
  const auto kohya = io::load_safetensors(dir + "/k.safetensors").tensors;
  EXPECT_EQ(kohya.count("lora_unet_layers_1_attention_to_v.lora_up.weight"), 1u);
  auto merge = run({kDifftrain, "lora", "merge", "--model", kZ, "--lora", dir + "/k.safetensors",
                    "--lora_scale", "0.5", "--output", dir + "/merged"},
                   {}, 120);
  ASSERT_EQ(merge.exit_code, 0) << merge.log();
  EXPECT_Z_LOG_HAS(merge, "merged into 16 transformer");
  // The merged folder samples as the LoRA fused at 0.5 (its forward: the fixture's fused_out).
  auto merged = run({kDifftrain, "forward", "--model", dir + "/merged", "--inputs",
                     dir + "/in.safetensors", "--output", dir + "/merged_out.safetensors"},
                    {}, 120);
  ASSERT_EQ(merged.exit_code, 0) << merged.log();
  const auto fused = io::load_safetensors(dir + "/merged_out.safetensors").tensors;
  EXPECT_LT(z_max_abs(fused.at("out.0"), lora_ref.at("comfyui.fused_out.0")), 1e-5);
}

TEST(ZImageCli, EstimateMemoryOfZImageTurboConfigsCountsTheSixBillionParameters) {
  // configs/z-image-turbo: the transformer's parameters from depth-reduced copies at the real
  // width, against the count written out from the architecture: 30 layers and 2 noise refiners
  // (attention 4 D^2 + q/k norms, SwiGLU 3 D H with H = 8 D / 3, 4 norms, adaLN 4 D x 256 + bias),
  // 2 context refiners without adaLN, and the embedders, final layer and pad tokens.
  const int64_t D = 3840, H = 10240, head = 128;
  const int64_t block = 4 * D * D + 2 * head + 3 * D * H + 4 * D;
  const int64_t modulated = block + 4 * D * 256 + 4 * D;
  const int64_t root = (1024 * 256 + 1024) + (256 * 1024 + 256)  // t_embedder
                       + 2560 + (D * 2560 + D)                   // cap_embedder
                       + (D * 64 + D)                            // all_x_embedder.2-1
                       + (64 * D + 64) + (D * 256 + D)           // all_final_layer.2-1
                       + 2 * D;                                  // the pad tokens
  const int64_t expected = 32 * modulated + 2 * block + root;
  EXPECT_EQ(expected, 6154908736);
  const std::string configs = std::string(difftrain_test::source_dir()) + "/configs/z-image-turbo";
  auto full = run({kDifftrain, "estimate-memory", "--model", configs, "--resolution", "4",
                   "--encoder_sequence_length", "4", "--json"},
                  {}, 300);
  ASSERT_EQ(full.exit_code, 0) << full.log();
  auto j = nlohmann::json::parse(full.out);
  EXPECT_EQ(j.at("trainable_params").get<int64_t>(), expected);
  EXPECT_EQ(j.at("frozen_params").get<int64_t>(), 83819683);  // the VAE; Qwen3 is released
  EXPECT_EQ(j.at("num_units").get<int64_t>(), 35);            // 34 blocks and the root
  auto lora = run({kDifftrain, "estimate-memory", "--model", configs, "--lora", "--rank", "16",
                   "--resolution", "4", "--encoder_sequence_length", "4", "--json"},
                  {}, 300);
  ASSERT_EQ(lora.exit_code, 0) << lora.log();
  j = nlohmann::json::parse(lora.out);
  // A [16, D] and B [D, 16] on to_q, to_k, to_v, to_out.0 of each of the 34 blocks.
  EXPECT_EQ(j.at("trainable_params").get<int64_t>(), 34 * 4 * 2 * 16 * D);
  EXPECT_EQ(j.at("frozen_params").get<int64_t>(), expected + 83819683);
}

}  // namespace
}  // namespace difftrain::testing
