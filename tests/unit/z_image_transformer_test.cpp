// ZImageTransformer2DModel against Diffusers' own forward (tests/golden/z_image/tiny_z_image,
// make_transformer.py): odd caption lengths, non-square latents, unequal sizes in one batch
// (the key mask), exact multiples of 32 (no pad token), bf16; refused configs.
#include "difftrain/models/transformers/z_image_transformer.h"

#include "difftrain/io/safetensors.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace {

using difftrain::models::load_z_image_transformer;
using difftrain::test::error_of;
using difftrain::test::kGoldenDir;
using difftrain::test::max_abs;
using difftrain::test::temp_dir;
using difftrain::test::write_text;
namespace fs = std::filesystem;

const std::string kTinyZImage = kGoldenDir + "z_image/tiny_z_image";

const difftrain::io::TensorMap& z_image_forward() {
  static const auto f =
      difftrain::io::load_safetensors(kTinyZImage + "/forward.safetensors").tensors;
  return f;
}

std::vector<torch::Tensor> list_of(const std::string& prefix,
                                   torch::Dtype dtype = torch::kFloat32) {
  std::vector<torch::Tensor> out;
  for (int i = 0;; ++i) {
    const auto it = z_image_forward().find(prefix + "." + std::to_string(i));
    if (it == z_image_forward().end()) return out;
    out.push_back(it->second.to(dtype));
  }
}

TEST(ZImageTransformer, EveryForwardCaseMatchesDiffusers) {
  torch::NoGradGuard no_grad;
  auto model = load_z_image_transformer(kTinyZImage + "/transformer");
  for (const char* c : {"a", "b", "c"}) {
    const std::string k = c;
    const auto out = model->forward(list_of(k + ".x"), z_image_forward().at(k + ".t"),
                                    list_of(k + ".cap_feats"));
    const auto want = list_of(k + ".out");
    ASSERT_EQ(out.size(), want.size()) << k;
    for (size_t i = 0; i < out.size(); ++i) {
      ASSERT_EQ(out[i].sizes(), want[i].sizes()) << k << " " << i;
      const double diff = max_abs(out[i], want[i]);
      std::cout << "case " << k << " out." << i << " max abs diff " << diff << " (tol 1e-4)\n";
      EXPECT_LT(diff, 1e-4) << k << " " << i;
    }
  }
}

TEST(ZImageTransformer, Bf16StaysAsCloseAsDiffusersBf16) {
  torch::NoGradGuard no_grad;
  auto model = load_z_image_transformer(kTinyZImage + "/transformer", torch::kBFloat16);
  const auto out = model->forward(list_of("a.x", torch::kBFloat16), z_image_forward().at("a.t"),
                                  list_of("a.cap_feats", torch::kBFloat16));
  const auto want = list_of("a_bf16.out");
  const auto f32 = list_of("a.out");
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_EQ(out[i].scalar_type(), torch::kBFloat16);
    const double diff = max_abs(out[i], want[i]);
    const double theirs = max_abs(want[i], f32[i]);
    const double ours = max_abs(out[i], f32[i]);
    std::cout << "bf16 out." << i << ": vs Diffusers bf16 " << diff << ", ours vs float32 " << ours
              << ", Diffusers bf16 vs float32 " << theirs << "\n";
    EXPECT_LT(ours, 2 * theirs + 1e-3);
  }
}

TEST(ZImageTransformer, GradientCheckpointingGivesTheSameGradients) {
  // Case a (unequal caption lengths: the key mask goes through the checkpoint too).
  auto model = load_z_image_transformer(kTinyZImage + "/transformer");
  model->train();
  auto grads = [&](bool ckpt) {
    model->set_gradient_checkpointing(ckpt);
    model->zero_grad();
    const auto out =
        model->forward(list_of("a.x"), z_image_forward().at("a.t"), list_of("a.cap_feats"));
    (out[0].square().sum() + out[1].square().mean()).backward();
    std::vector<torch::Tensor> g;
    for (const auto& p : model->parameters()) g.push_back(p.grad().clone());
    return g;
  };
  const auto plain = grads(false);
  const auto ckpt = grads(true);
  ASSERT_EQ(plain.size(), ckpt.size());
  double worst = 0;
  for (size_t i = 0; i < plain.size(); ++i) {
    ASSERT_TRUE(plain[i].defined() && ckpt[i].defined()) << i;
    worst = std::max(worst, max_abs(plain[i], ckpt[i]));
  }
  std::cout << "checkpointed vs plain gradients: max abs diff " << worst << " (tol 1e-6)\n";
  EXPECT_LT(worst, 1e-6);
  EXPECT_GT(plain.front().abs().sum().item<double>(), 0);
}

TEST(ZImageTransformer, BadConfigsAndInputsAreRefused) {
  const auto dir = temp_dir("z_image_transformer_config");
  std::ifstream in(kTinyZImage + "/transformer/config.json");
  const auto config = nlohmann::json::parse(in);
  auto refused = [&](const std::string& key, const nlohmann::json& value) {
    auto c = config;
    c[key] = value;
    write_text(dir + "/config.json", c.dump(2));
    return error_of(
        [&] { difftrain::models::ZImageTransformerOptions::load(dir + "/config.json"); });
  };
  EXPECT_HAS(refused("axes_dims", {4, 4, 6}), "must sum to the head dim dim / n_heads = 16");
  EXPECT_HAS(refused("siglip_feat_dim", 1152), "SigLIP");
  EXPECT_HAS(refused("n_heads", 5), "must divide dim");
  EXPECT_HAS(refused("all_f_patch_size", {1, 1}), "as many entries as all_patch_size");
  torch::NoGradGuard no_grad;
  auto model = load_z_image_transformer(kTinyZImage + "/transformer");
  const auto cap = std::vector<torch::Tensor>{torch::randn({3, 48})};
  EXPECT_HAS(error_of([&] {
               model->forward({torch::randn({16, 1, 5, 4})}, torch::ones({1}), cap);
             }),
             "H, W by 2");
  EXPECT_HAS(
      error_of([&] {
        model->forward({torch::randn({16, 1, 4, 4})}, torch::ones({1}), {torch::randn({3, 40})});
      }),
      "cap_feats 0 must be [L, 48]");
  // Longer than axes_lens allows on the caption axis (256 positions).
  EXPECT_HAS(
      error_of([&] {
        model->forward({torch::randn({16, 1, 4, 4})}, torch::ones({1}), {torch::randn({300, 48})});
      }),
      "beyond axes_lens");
  EXPECT_HAS(error_of([&] { load_z_image_transformer(dir + "/missing"); }), "no such folder");
}

}  // namespace
