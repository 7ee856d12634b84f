// Qwen-Image through the command line on the tiny fixture folder (tests/golden/qwen_image):
// `difftrain sample` from prompt strings equals QwenImagePipeline's images (sample_e2e,
// make_sample_e2e.py) with its flags of the same names (true_cfg_scale, negative_prompt,
// max_sequence_length, odd sizes floored); `difftrain forward` on Diffusers' argument names;
// `lora convert` / `lora merge` / `forward --lora` with the ComfyUI, kohya and Diffusers forms.
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

const std::string kQGolden = std::string(difftrain_test::source_dir()) + "/tests/golden/qwen_image";
const std::string kQ = kQGolden + "/tiny_qwen_image";

#define EXPECT_Q_LOG_HAS(result, part)                                                  \
  EXPECT_NE((result).err.find(part), std::string::npos) << "lacks '" << (part) << "'\n" \
                                                        << (result).log()

double q_max_abs(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

nlohmann::json q_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

TEST(QwenImageCli, SampleFromPromptStringsEqualsQwenImagePipeline) {
  const std::string dir = make_temp_dir("q_sample");
  const auto ref = io::load_safetensors(kQ + "/sample_e2e.safetensors").tensors;
  const auto cases = q_json(kQ + "/sample_e2e.json").at("cases");
  for (const auto& [name, c] : cases.items()) {
    SCOPED_TRACE(name);
    const auto& a = c.at("arguments");
    std::vector<std::string> cmd = {kDifftrain, "sample", "--model", kQ};
    for (const auto& p : a.at("prompt")) {
      cmd.push_back("--prompt");
      cmd.push_back(p.get<std::string>());
    }
    if (a.contains("negative_prompt") && !a.at("negative_prompt").is_null()) {
      cmd.push_back("--negative_prompt");
      cmd.push_back(a.at("negative_prompt").get<std::string>());
    }
    for (const char* flag : {"true_cfg_scale", "max_sequence_length", "height", "width",
                             "num_inference_steps", "seed"}) {
      if (!a.contains(flag) || a.at(flag).is_null()) continue;
      cmd.push_back(std::string("--") + flag);
      cmd.push_back(a.at(flag).dump());
    }
    cmd.push_back("--output");
    cmd.push_back(dir + "/" + name + ".png");
    cmd.push_back("--save_tensors");
    cmd.push_back(dir + "/" + name + ".safetensors");
    auto r = run(cmd, {}, 180);
    ASSERT_EQ(r.exit_code, 0) << r.log();
    EXPECT_Q_LOG_HAS(r, "(QwenImagePipeline)");
    const auto got = io::load_safetensors(dir + "/" + name + ".safetensors").tensors;
    ASSERT_EQ(got.at("images").sizes(), ref.at(name + ".image").sizes()) << r.log();
    const double d = q_max_abs(got.at("images"), ref.at(name + ".image"));
    std::cout << name << ": images max abs diff " << d << "\n";
    EXPECT_LT(d, 1e-4);
  }
}

TEST(QwenImageCli, ForwardTakesDiffusersArgumentNamesAndLorasConvertAndMerge) {
  const std::string dir = make_temp_dir("q_forward");
  const auto ref = io::load_safetensors(kQ + "/forward.safetensors").tensors;
  io::TensorMap inputs;
  for (const auto& [key, t] : ref) {
    if (key.rfind("a.", 0) == 0 && key.rfind("a.inter.", 0) != 0 && key != "a.out") {
      inputs[key.substr(2)] = t;
    }
  }
  io::save_safetensors(dir + "/in.safetensors", inputs);
  auto plain = run({kDifftrain, "forward", "--model", kQ, "--inputs", dir + "/in.safetensors",
                    "--output", dir + "/plain.safetensors"},
                   {}, 120);
  ASSERT_EQ(plain.exit_code, 0) << plain.log();
  EXPECT_LT(q_max_abs(io::load_safetensors(dir + "/plain.safetensors").tensors.at("out"),
                      ref.at("a.out")),
            2e-5);

  const auto lora_ref = io::load_safetensors(kQGolden + "/lora/expected.safetensors").tensors;
  auto fwd =
      run({kDifftrain, "forward", "--model", kQ, "--inputs", dir + "/in.safetensors", "--output",
           dir + "/out.safetensors", "--lora", kQGolden + "/lora/comfyui.safetensors"},
          {}, 120);
  ASSERT_EQ(fwd.exit_code, 0) << fwd.log();
  const auto out = io::load_safetensors(dir + "/out.safetensors").tensors;
  EXPECT_LT(q_max_abs(out.at("out"), lora_ref.at("comfyui.out")), 2e-5);

  auto convert =
      run({kDifftrain, "lora", "convert", "--input", kQGolden + "/lora/comfyui.safetensors",
           "--output", dir + "/k.safetensors", "--to", "kohya", "--model", kQ},
          {}, 120);
  ASSERT_EQ(convert.exit_code, 0) << convert.log();
  const auto kohya = io::load_safetensors(dir + "/k.safetensors").tensors;
  EXPECT_EQ(kohya.count("lora_unet_transformer_blocks_1_attn_to_v.lora_up.weight"), 1u);
  auto back = run({kDifftrain, "lora", "convert", "--input", dir + "/k.safetensors", "--output",
                   dir + "/c.safetensors", "--to", "comfyui", "--model", kQ},
                  {}, 120);
  ASSERT_EQ(back.exit_code, 0) << back.log();
  EXPECT_EQ(io::load_safetensors(dir + "/c.safetensors")
                .tensors.count("diffusion_model.transformer_blocks.1.attn.to_v.lora_up.weight"),
            1u);
  auto merge = run({kDifftrain, "lora", "merge", "--model", kQ, "--lora", dir + "/k.safetensors",
                    "--lora_scale", "0.5", "--output", dir + "/merged"},
                   {}, 120);
  ASSERT_EQ(merge.exit_code, 0) << merge.log();
  auto merged = run({kDifftrain, "forward", "--model", dir + "/merged", "--inputs",
                     dir + "/in.safetensors", "--output", dir + "/merged_out.safetensors"},
                    {}, 120);
  ASSERT_EQ(merged.exit_code, 0) << merged.log();
  const auto fused = io::load_safetensors(dir + "/merged_out.safetensors").tensors;
  EXPECT_LT(q_max_abs(fused.at("out"), lora_ref.at("comfyui.fused_out")), 2e-5);
}

TEST(QwenImageCli, BadInputIsOneLineAndNonZero) {
  const std::string dir = make_temp_dir("q_bad");
  auto big = run({kDifftrain, "sample", "--model", kQ, "--prompt", "a", "--max_sequence_length",
                  "2048", "--output", dir + "/s.png"},
                 {}, 60);
  EXPECT_NE(big.exit_code, 0);
  EXPECT_Q_LOG_HAS(big, "max_sequence_length");
  io::TensorMap inputs = {{"hidden_states", torch::zeros({1, 4, 64})}};
  io::save_safetensors(dir + "/in.safetensors", inputs);
  auto fwd = run({kDifftrain, "forward", "--model", kQ, "--inputs", dir + "/in.safetensors",
                  "--output", dir + "/o.safetensors"},
                 {}, 60);
  EXPECT_NE(fwd.exit_code, 0);
  EXPECT_Q_LOG_HAS(fwd, "no 'encoder_hidden_states'");
}

TEST(QwenImageCli, EstimateMemoryOfQwenImageCountsTheTwentyBillionParameters) {
  // configs/qwen-image: the transformer's parameters from depth-reduced copies at the real width,
  // against the count written out from the architecture (D = 3072, J = 3584): per block img_mod
  // and txt_mod (D x 6D + 6D each), q/k/v/out and their text twins (8 (D^2 + D)), four q/k
  // RMSNorms of 128, two GELU MLPs (8 D^2 + 5 D each); the root: the timestep MLP, txt_norm,
  // img_in, txt_in, norm_out and proj_out.
  const int64_t D = 3072, J = 3584;
  const int64_t block = 36 * D * D + 30 * D + 512;
  const int64_t root = 3 * D * D + 390 * D + J * (D + 1) + 64;
  const int64_t expected = 60 * block + root;
  EXPECT_EQ(expected, 20430401088);
  const std::string configs = std::string(difftrain_test::source_dir()) + "/configs/qwen-image";
  auto full = run({kDifftrain, "estimate-memory", "--model", configs, "--resolution", "4",
                   "--encoder_sequence_length", "4", "--json"},
                  {{"DIFFTRAIN_NUM_THREADS", "2"}}, 300);
  ASSERT_EQ(full.exit_code, 0) << full.log();
  auto j = nlohmann::json::parse(full.out);
  EXPECT_EQ(j.at("trainable_params").get<int64_t>(), expected);
  EXPECT_EQ(j.at("frozen_params").get<int64_t>(), 126892531);  // the VAE; Qwen2.5-VL released
  EXPECT_EQ(j.at("num_units").get<int64_t>(), 61);             // 60 blocks and the root
  auto lora = run({kDifftrain, "estimate-memory", "--model", configs, "--lora", "--rank", "16",
                   "--resolution", "4", "--encoder_sequence_length", "4", "--json"},
                  {{"DIFFTRAIN_NUM_THREADS", "2"}}, 300);
  ASSERT_EQ(lora.exit_code, 0) << lora.log();
  j = nlohmann::json::parse(lora.out);
  // A [16, D] and B [D, 16] on to_q, to_k, to_v, to_out.0 of each of the 60 blocks.
  EXPECT_EQ(j.at("trainable_params").get<int64_t>(), 60 * 4 * 2 * 16 * D);
  EXPECT_EQ(j.at("frozen_params").get<int64_t>(), expected + 126892531);
}

}  // namespace
}  // namespace difftrain::testing
