// Block swap (models/block_swap.h) on a small FLUX.1-shaped transformer: the swapped blocks'
// weights really leave the device between uses, and a LoRA step with the swap gives the same
// prediction, loss and adapter gradients as one without it, bit for bit, with and without
// gradient checkpointing and over an 8-bit base.

#include "difftrain/models/block_swap.h"
#include "difftrain/core/error.h"
#include "difftrain/models/kernels/quantized_weight.h"
#include "difftrain/models/lora/lora_training.h"
#include "difftrain/models/transformers/flux_transformer.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>

namespace {

namespace dm = difftrain::models;
using difftrain::test::error_of;

dm::FluxTransformer2DModel small_flux() {
  auto o = dm::FluxTransformer2DModelOptions()
               .in_channels(8)
               .num_layers(3)
               .num_single_layers(4)
               .attention_head_dim(8)
               .num_attention_heads(2)
               .joint_attention_dim(12)
               .pooled_projection_dim(6)
               .axes_dims_rope({2, 2, 4});
  torch::manual_seed(3);
  dm::FluxTransformer2DModel model(o);
  for (auto& p : model->parameters()) p.set_requires_grad(false);
  return model;
}

struct Step {
  torch::Tensor pred, loss;
  std::vector<torch::Tensor> grads;
};

// The same inputs every call: x [2, 6, 8], 4 text tokens.
torch::Tensor forward(dm::FluxTransformer2DModel& model, torch::Tensor* x_out = nullptr) {
  torch::manual_seed(11);
  const int64_t B = 2, L = 6, S = 4;
  const auto x = torch::randn({B, L, 8}), e = torch::randn({B, S, 12}), p = torch::randn({B, 6});
  const auto t = torch::rand({B});
  const auto img_ids = torch::randint(0, 4, {L, 3}), txt_ids = torch::zeros({S, 3});
  if (x_out) *x_out = x;
  return model->forward(x, e, p, t, {}, img_ids, txt_ids);
}

// One training forward and backward; the adapters' gradients are taken and cleared.
Step step(dm::FluxTransformer2DModel& model, dm::LoraLayers& lora) {
  Step s;
  torch::Tensor x;
  s.pred = forward(model, &x);
  s.loss = (s.pred - x).pow(2).mean();
  s.loss.backward();
  for (auto& q : lora->parameters()) {
    s.grads.push_back(q.grad().clone());
    q.mutable_grad() = torch::Tensor();
  }
  return s;
}

double max_diff(const Step& a, const Step& b) {
  double d = (a.pred - b.pred).abs().max().item<double>();
  d = std::max(d, (a.loss - b.loss).abs().item<double>());
  for (size_t i = 0; i < a.grads.size(); ++i)
    d = std::max(d, (a.grads[i] - b.grads[i]).abs().max().item<double>());
  return d;
}

bool bit_equal(const Step& a, const Step& b) {
  if (!torch::equal(a.pred, b.pred) || !torch::equal(a.loss, b.loss)) return false;
  for (size_t i = 0; i < a.grads.size(); ++i)
    if (!torch::equal(a.grads[i], b.grads[i])) return false;
  return true;
}

// LoRA on the attention and on the modulation linears too, so the shared temb needs a gradient
// that every block adds to.
dm::LoraLayers attach_lora(dm::FluxTransformer2DModel& model) {
  dm::LoraConfig lc;
  lc.rank = 2;
  lc.alpha = 2;
  lc.target_modules = {"to_q",     "to_k",        "to_v",         "to_out.0",
                       "proj_mlp", "norm.linear", "norm1.linear", "linear_1"};
  torch::manual_seed(5);
  dm::LoraLayers lora(*model, lc);
  torch::NoGradGuard no_grad;
  for (auto& q : lora->parameters()) q.normal_(0, 0.1);  // lora_B non-zero
  return lora;
}

void check_same_with_swap(bool checkpointing, dm::WeightStorage storage) {
  auto model = small_flux();
  auto lora = attach_lora(model);
  if (storage != dm::WeightStorage::kDense) dm::quantize_frozen_weights(*model, storage);
  model->train();
  model->set_gradient_checkpointing(checkpointing);
  const Step plain = step(model, lora);
  const Step again = step(model, lora);
  ASSERT_TRUE(bit_equal(plain, again)) << "the run without swap is not deterministic";

  // 3 blocks: 1 double and 4 single of (3, 4) in kohya's split, the last ones of each kind.
  model->enable_block_swap(3);
  const dm::BlockSwap* swap = model->block_swap();
  ASSERT_NE(swap, nullptr);
  EXPECT_FALSE(swap->swapped(0));
  EXPECT_FALSE(swap->swapped(1));
  EXPECT_TRUE(swap->swapped(2));
  for (size_t i = 3; i < 7; ++i) EXPECT_TRUE(swap->swapped(i)) << i;
  // Between uses the swapped weights hold no memory; the others keep theirs.
  auto storage_bytes = [&](const std::string& key) {
    for (const auto& p : model->named_parameters())
      if (p.key() == key) return p.value().storage().nbytes();
    ADD_FAILURE() << "no parameter " << key;
    return size_t{0};
  };
  EXPECT_EQ(storage_bytes("transformer_blocks.2.attn.norm_q.weight"), 0u);
  EXPECT_EQ(storage_bytes("single_transformer_blocks.0.norm.linear.bias"), 0u);
  EXPECT_GT(storage_bytes("transformer_blocks.1.attn.norm_q.weight"), 0u);

  const Step swapped = step(model, lora);
  std::cout << "  checkpointing " << checkpointing << ", base " << dm::to_string(storage)
            << ": max abs difference with swap " << max_diff(plain, swapped) << " (0)\n";
  EXPECT_TRUE(bit_equal(plain, swapped));
  EXPECT_EQ(swap->staged_bytes(), 0) << "weights left on the device after the backward";
  const dm::BlockSwapBytes bytes = swap->bytes();
  EXPECT_EQ(bytes.blocks, 5);
  EXPECT_GT(bytes.host_bytes, 0);
  EXPECT_EQ(swap->peak_staged_bytes(), bytes.staging_bytes) << "measured vs counted staging";
  EXPECT_EQ(bytes.saved_bytes(), bytes.host_bytes - bytes.staging_bytes);

  // Sampling (no grad) with the swap, and the weights back on the device after it is off.
  torch::Tensor sampled;
  {
    torch::NoGradGuard no_grad;
    model->eval();
    sampled = forward(model);
  }
  model->enable_block_swap(0);
  EXPECT_GT(storage_bytes("transformer_blocks.2.attn.norm_q.weight"), 0u);
  {
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(torch::equal(sampled, forward(model)));
  }
  model->train();
  EXPECT_TRUE(bit_equal(plain, step(model, lora)));
}

}  // namespace

TEST(BlockSwap, LoraStepIsBitIdentical) { check_same_with_swap(false, dm::WeightStorage::kDense); }

TEST(BlockSwap, WithGradientCheckpointing) {
  check_same_with_swap(true, dm::WeightStorage::kDense);
}

TEST(BlockSwap, OverAnInt8BaseWithCheckpointing) {
  check_same_with_swap(true, dm::WeightStorage::kInt8);
}

TEST(BlockSwap, OverAnInt8Base) { check_same_with_swap(false, dm::WeightStorage::kInt8); }

TEST(BlockSwap, KohyaFluxSplit) {
  // FLUX.1 (19 double, 38 single): n / 2 double, twice the rest single.
  auto s = dm::flux_block_swap_split(18, 19, 38);
  EXPECT_EQ(s.double_blocks, 9);
  EXPECT_EQ(s.single_blocks, 18);
  EXPECT_TRUE(s.fits);
  s = dm::flux_block_swap_split(7, 19, 38);
  EXPECT_EQ(s.double_blocks, 3);
  EXPECT_EQ(s.single_blocks, 8);
  EXPECT_EQ(dm::flux_max_blocks_to_swap(19, 38), 37);
  const std::string e = error_of([] { dm::flux_swapped_blocks(38, 19, 38); });
  EXPECT_NE(e.find("--blocks_to_swap 38 is too many"), std::string::npos) << e;
  EXPECT_NE(e.find("use --blocks_to_swap 37 or fewer"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  const auto swapped = dm::flux_swapped_blocks(3, 3, 4);
  EXPECT_EQ(swapped, (std::vector<bool>{false, false, true, true, true, true, true}));
}

TEST(BlockSwap, RefusesTrainingWeights) {
  auto model = small_flux();
  for (auto& p : model->parameters()) p.set_requires_grad(true);
  const std::string e = error_of([&] { model->enable_block_swap(2); });
  EXPECT_NE(e.find("trains, and block swap keeps only frozen weights"), std::string::npos) << e;
  EXPECT_EQ(model->block_swap(), nullptr);
}

TEST(BlockSwap, StagingIsTheLargestPairInOrder) {
  EXPECT_EQ(dm::block_swap_staging_bytes({}), 0);
  EXPECT_EQ(dm::block_swap_staging_bytes({7}), 7);
  EXPECT_EQ(dm::block_swap_staging_bytes({4, 2, 4, 1}), 6);
  EXPECT_EQ(dm::block_swap_staging_bytes({10, 5, 5}), 15);
}
