// 8-bit frozen weights (models/quantized_weight.h): the quantization's rounding bound, Linear and
// Conv2d layers that compute and backpropagate exactly as with the dequantized weight while
// holding only 8 bits, LoRA training on top, the whole-model pass with its size rule, and the
// forward error against the bf16 base on the FLUX.1 and SD fixtures.

#include "difftrain/models/kernels/quantized_weight.h"
#include "difftrain/core/error.h"
#include "difftrain/core/torch_compat.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/linear.h"
#include "difftrain/models/lora/lora_training.h"
#include "difftrain/models/pretrained.h"
#include "difftrain/models/transformers/flux_transformer.h"
#include "difftrain/models/unets/unet.h"
#include "source_dir.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <limits>

namespace difftrain {
namespace {

using test::error_of;

using models::WeightStorage;

const std::string kGoldenRoot = std::string(difftrain_test::source_dir()) + "/tests/golden";

double qw_max_abs(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

TEST(QuantizedWeight, Int8RoundsEachRowWithinHalfItsScale) {
  torch::manual_seed(0);
  auto w = torch::randn({24, 40}) * torch::linspace(0.01, 3, 24).unsqueeze(1);
  w[5].zero_();
  const auto q = models::quantize(w, WeightStorage::kInt8);
  EXPECT_EQ(q.q.scalar_type(), torch::kInt8);
  EXPECT_EQ(q.scale.scalar_type(), torch::kFloat32);
  EXPECT_EQ(q.dtype, torch::kFloat32);
  EXPECT_EQ(q.bytes(), 24 * 40 + 24 * 4);
  const auto err = (q.dequantize() - w).abs().amax(1);
  for (int64_t r = 0; r < 24; ++r) {
    EXPECT_LE(err[r].item<float>(), q.scale[r].item<float>() * 0.5f * (1 + 1e-6f)) << r;
  }
  EXPECT_EQ(q.dequantize()[5].abs().max().item<float>(), 0.0f);
  EXPECT_EQ(q.q.abs().max().item<int>(), 127);
  EXPECT_THROW(models::quantize(w, WeightStorage::kDense), Error);
}

TEST(QuantizedWeight, StorageNamesAndFloat8WhereTheLibTorchHasIt) {
  EXPECT_EQ(models::parse_weight_storage("none", "--x"), WeightStorage::kDense);
  EXPECT_EQ(models::parse_weight_storage("int8", "--x"), WeightStorage::kInt8);
  const std::string bad = error_of([] { models::parse_weight_storage("int4", "--x"); });
  EXPECT_NE(bad.find("expected one of none, int8, fp8_e4m3"), std::string::npos) << bad;
  if (!models::float8_available()) {
    // LibTorch 1.13: refused in one line, with the way out.
    const std::string msg = error_of([] { models::parse_weight_storage("fp8_e4m3", "--x"); });
    EXPECT_NE(msg.find("has no float8; use int8"), std::string::npos) << msg;
    return;
  }
  torch::manual_seed(1);
  const auto w = torch::randn({16, 64});
  const auto q = models::quantize(w, models::parse_weight_storage("fp8_e4m3", "--x"));
  EXPECT_EQ(q.q.element_size(), 1);
  // e4m3 keeps 3 mantissa bits: relative error at most 2^-4 of each value (plus subnormals).
  const auto rel =
      ((q.dequantize() - w).abs() / (w.abs() + q.scale.unsqueeze(1) * std::ldexp(1.0, -9)))
          .max()
          .item<double>();
  EXPECT_LE(rel, 0.0625 + 1e-6);
}

TEST(QuantizedWeight, OnePassDequantizationEqualsTheTensorOpsBitForBit) {
  // The CPU int8 path writes q * scale in one pass; it must give exactly what
  // (q.to(float32) * scale).to(dtype) gives, in float32 and bf16, for Linear and Conv shapes.
  torch::manual_seed(4);
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    for (const std::vector<int64_t>& shape :
         std::vector<std::vector<int64_t>>{{96, 200}, {32, 16, 3, 3}, {3, 1}}) {
      const auto q = models::quantize(torch::randn(shape).to(dtype), WeightStorage::kInt8);
      std::vector<int64_t> view(shape.size(), 1);
      view[0] = shape[0];
      const auto ops = (q.q.to(torch::kFloat32) * q.scale.view(view)).to(dtype);
      const auto fused = q.dequantize();
      EXPECT_EQ(fused.scalar_type(), dtype);
      EXPECT_TRUE(torch::equal(fused, ops)) << c10::toString(dtype) << " " << shape.size();
    }
  }
}

TEST(QuantizedWeight, OnePassBf16RoundingMatchesTorchAtTiesTinyHugeAndNaNScales) {
  // The bf16 loop rounds the float32 product with integer operations on its bits; it must round
  // as torch does at ties (scale 1 + 2^-8 makes odd multiples land halfway), for subnormal and
  // huge products, for infinities and NaN (as a NaN: torch's own casts give NaN different bits),
  // over every int8 value and lengths that leave tails.
  const std::vector<float> scales{1.0F + 1.0F / 256.0F,
                                  1.0F + 3.0F / 256.0F,
                                  1e-40F,
                                  3e36F,
                                  std::numeric_limits<float>::infinity(),
                                  std::numeric_limits<float>::quiet_NaN(),
                                  0.0F,
                                  -2.5F};
  for (const int64_t cols : {int64_t{255}, int64_t{17}, int64_t{1}}) {
    auto q = (torch::arange(static_cast<int64_t>(scales.size()) * cols) % 255 - 127)
                 .to(torch::kInt8)
                 .view({static_cast<int64_t>(scales.size()), cols});
    models::QuantizedWeight w;
    w.q = q;
    w.scale = torch::tensor(scales);
    w.dtype = torch::kBFloat16;
    const auto ops = (q.to(torch::kFloat32) * w.scale.view({-1, 1})).to(torch::kBFloat16);
    const auto fused = w.dequantize();
    // Bits where the value is a number; NaN where torch's is (its vectorised and scalar casts
    // give NaN different bits themselves).
    const auto nan = torch::isnan(ops);
    EXPECT_TRUE(torch::equal(torch::isnan(fused), nan)) << cols;
    EXPECT_TRUE(torch::equal(fused.view(torch::kInt16).masked_fill(nan, 0),
                             ops.view(torch::kInt16).masked_fill(nan, 0)))
        << cols;
    w.dtype = torch::kFloat32;
    const auto f32 = w.dequantize();
    const auto f32_ops = q.to(torch::kFloat32) * w.scale.view({-1, 1});
    const auto nan32 = torch::isnan(f32_ops);
    EXPECT_TRUE(torch::equal(torch::isnan(f32), nan32)) << cols;
    EXPECT_TRUE(torch::equal(f32.view(torch::kInt32).masked_fill(nan32, 0),
                             f32_ops.view(torch::kInt32).masked_fill(nan32, 0)))
        << cols;
  }
}

TEST(QuantizedWeight, ChainedLayersShareTheDequantizationBufferSafely) {
  // Three int8 layers of different sizes (the buffer grows, then is reused smaller) in a chain,
  // forward and backward, in float32 and under bf16 autocast: the values of the same chain on
  // the dequantized weights. Then a second-order gradient (create_graph), where the weight must
  // not be the reused buffer.
  torch::manual_seed(5);
  std::vector<models::Linear> layers;
  for (const auto& [in, out] :
       std::vector<std::pair<int64_t, int64_t>>{{32, 96}, {96, 64}, {64, 24}}) {
    layers.emplace_back(torch::nn::LinearOptions(in, out));
    for (auto& p : layers.back()->parameters()) p.set_requires_grad(false);
    layers.back()->quantize_weight(WeightStorage::kInt8);
  }
  const auto chain = [&](torch::Tensor h, bool dense) {
    for (auto& l : layers) {
      h = dense ? torch::linear(h, l->quantized_weight().dequantize(), l->bias) : l->forward(h);
      h = torch::tanh(h);
    }
    return h;
  };
  for (const bool autocast : {false, true}) {
    SCOPED_TRACE(autocast ? "bf16 autocast" : "float32");
    const compat::AutocastRestore guard(c10::DeviceType::CPU, {autocast, torch::kBFloat16});
    const auto x = torch::randn({4, 7, 32});
    auto a = x.clone().requires_grad_(), b = x.clone().requires_grad_();
    const auto ya = chain(a, false), yb = chain(b, true);
    EXPECT_EQ(qw_max_abs(ya, yb), 0.0);
    const auto g = torch::randn_like(ya);
    ya.backward(g);
    yb.backward(g);
    EXPECT_LE(qw_max_abs(a.grad(), b.grad()), autocast ? 1e-2 : 1e-6);
  }
  auto x = torch::randn({3, 32}, torch::requires_grad());
  auto xd = x.detach().clone().requires_grad_();
  const auto gx = torch::autograd::grad({chain(x, false).pow(2).sum()}, {x}, {}, true, true)[0];
  const auto gxd = torch::autograd::grad({chain(xd, true).pow(2).sum()}, {xd}, {}, true, true)[0];
  EXPECT_LE(qw_max_abs(gx, gxd), 1e-5);
  ASSERT_TRUE(gx.requires_grad());
  // The second-order pass reads the weights the first-order backward's graph kept.
  const auto ggx = torch::autograd::grad({gx.pow(2).sum()}, {x})[0];
  const auto ggxd = torch::autograd::grad({gxd.pow(2).sum()}, {xd})[0];
  EXPECT_LE(qw_max_abs(ggx, ggxd), 1e-4 * (1 + ggxd.abs().max().item<double>()));
}

TEST(QuantizedWeight, LinearComputesAndBackpropagatesAsItsDequantizedWeight) {
  torch::manual_seed(2);
  models::Linear layer(torch::nn::LinearOptions(48, 40));
  for (auto& p : layer->parameters()) p.set_requires_grad(false);
  const int64_t params_before = static_cast<int64_t>(layer->parameters().size());
  layer->quantize_weight(WeightStorage::kInt8);
  EXPECT_FALSE(layer->weight.defined());
  EXPECT_EQ(static_cast<int64_t>(layer->parameters().size()), params_before - 1);  // bias only
  EXPECT_EQ(layer->weight_dtype(), torch::kFloat32);
  const auto w = layer->quantized_weight().dequantize();

  auto x = torch::randn({3, 5, 48}, torch::requires_grad());
  auto y = layer->forward(x);
  EXPECT_EQ(qw_max_abs(y, torch::linear(x, w, layer->bias)), 0.0);
  const auto g = torch::randn_like(y);
  y.backward(g);
  auto x2 = x.detach().clone().requires_grad_(true);
  torch::linear(x2, w, layer->bias).backward(g);
  EXPECT_LE(qw_max_abs(x.grad(), x2.grad()), 1e-6);

  // Casting the layer keeps the 8 bits and the float32 scales; it computes in the new dtype.
  layer->to(torch::kBFloat16);
  EXPECT_EQ(layer->quantized_weight().q.scalar_type(), torch::kInt8);
  EXPECT_EQ(layer->quantized_weight().scale.scalar_type(), torch::kFloat32);
  EXPECT_EQ(layer->weight_dtype(), torch::kBFloat16);
  EXPECT_EQ(layer->forward(x.detach().to(torch::kBFloat16)).scalar_type(), torch::kBFloat16);
  // A weight that trains is refused.
  models::Linear trained(torch::nn::LinearOptions(48, 40));
  EXPECT_THROW(trained->quantize_weight(WeightStorage::kInt8), Error);
}

TEST(QuantizedWeight, Conv2dComputesAndBackpropagatesAsItsDequantizedWeight) {
  torch::manual_seed(3);
  for (const auto& [stride, padding, groups] :
       std::vector<std::array<int64_t, 3>>{{1, 1, 1}, {2, 1, 1}, {2, 0, 2}}) {
    SCOPED_TRACE(stride * 100 + padding * 10 + groups);
    models::Conv2d conv(
        torch::nn::Conv2dOptions(8, 12, 3).stride(stride).padding(padding).groups(groups));
    for (auto& p : conv->parameters()) p.set_requires_grad(false);
    conv->quantize_weight(WeightStorage::kInt8);
    const auto w = conv->quantized_weight().dequantize();
    // An odd size, so a stride of 2 drops a row and the input gradient needs output_padding.
    auto x = torch::randn({2, 8, 11, 9}, torch::requires_grad());
    auto y = conv->forward(x);
    const auto ref = torch::conv2d(x, w, conv->bias, stride, padding, 1, groups);
    EXPECT_LE(qw_max_abs(y, ref), 1e-6);
    const auto g = torch::randn_like(y);
    y.backward(g);
    auto x2 = x.detach().clone().requires_grad_(true);
    torch::conv2d(x2, w, conv->bias, stride, padding, 1, groups).backward(g);
    EXPECT_LE(qw_max_abs(x.grad(), x2.grad()), 1e-5);
    // bf16 (a bf16 base under autocast): the backward runs too.
    conv->to(torch::kBFloat16);
    auto xb = torch::randn({2, 8, 11, 9}, torch::requires_grad());
    {
      compat::set_autocast_enabled(c10::DeviceType::CPU, true);
      compat::set_autocast_dtype(c10::DeviceType::CPU, torch::kBFloat16);
      auto yb = conv->forward(xb);
      compat::set_autocast_enabled(c10::DeviceType::CPU, false);
      yb.to(torch::kFloat32).sum().backward();
    }
    EXPECT_EQ(xb.grad().sizes(), xb.sizes());
  }
}

TEST(QuantizedWeight, LoraAdaptersTrainOnTopOfAnInt8Base) {
  torch::manual_seed(4);
  auto make = [] {
    torch::manual_seed(5);
    auto net = std::make_shared<torch::nn::Module>();
    net->register_module("to_q", models::Linear(torch::nn::LinearOptions(32, 64)));
    net->register_module("to_k", models::Linear(torch::nn::LinearOptions(64, 32)));
    for (auto& p : net->parameters()) p.set_requires_grad(false);
    return net;
  };
  auto forward = [](torch::nn::Module& net, const torch::Tensor& x) {
    auto q = std::dynamic_pointer_cast<models::LinearImpl>(net.named_children()["to_q"]);
    auto k = std::dynamic_pointer_cast<models::LinearImpl>(net.named_children()["to_k"]);
    return k->forward(torch::gelu(q->forward(x)));
  };
  models::LoraConfig lc;
  lc.rank = 4;
  lc.alpha = 8;
  lc.target_modules = {"to_q", "to_k"};
  // The reference: a dense base holding the dequantized weights.
  auto quantized = make();
  auto dense = make();
  models::LoraLayers lora_q(*quantized, lc);  // attached before quantizing ...
  const auto s = models::quantize_frozen_weights(*quantized, WeightStorage::kInt8);
  EXPECT_EQ(s.layers, 2);
  EXPECT_EQ(s.weights, 2 * 32 * 64);
  EXPECT_EQ(s.bytes_before, 2 * 32 * 64 * 4);
  EXPECT_EQ(s.bytes_after, 2 * 32 * 64 + (64 + 32) * 4);
  EXPECT_EQ(models::quantized_weight_bytes(*quantized), s.bytes_after);
  for (const auto& item : dense->named_children()) {
    auto d = std::dynamic_pointer_cast<models::LinearImpl>(item.value());
    auto q = std::dynamic_pointer_cast<models::LinearImpl>(quantized->named_children()[item.key()]);
    torch::NoGradGuard no_grad;
    d->weight.copy_(q->quantized_weight().dequantize());
  }
  models::LoraLayers lora_d(*dense, lc);
  {
    torch::NoGradGuard no_grad;
    auto pq = lora_q->parameters(), pd = lora_d->parameters();
    for (size_t i = 0; i < pq.size(); ++i) {
      pq[i].normal_();
      pd[i].copy_(pq[i]);
    }
  }
  const auto x = torch::randn({6, 32});
  forward(*quantized, x).pow(2).sum().backward();
  forward(*dense, x).pow(2).sum().backward();
  auto pq = lora_q->parameters(), pd = lora_d->parameters();
  ASSERT_EQ(pq.size(), 4u);
  for (size_t i = 0; i < pq.size(); ++i) {
    ASSERT_TRUE(pq[i].grad().defined());
    EXPECT_LE(qw_max_abs(pq[i].grad(), pd[i].grad()),
              1e-4 * pd[i].grad().abs().max().item<double>());
  }
  // ... and after: an adapter attaches to an already 8-bit layer on its device.
  auto late = make();
  models::quantize_frozen_weights(*late, WeightStorage::kInt8);
  models::LoraLayers lora_late(*late, lc);
  EXPECT_EQ(lora_late->module_names().size(), 2u);
}

// The forward error of an 8-bit base against the bf16 base on the fixtures: FLUX.1's transformer
// (io case A) and SD's UNet, as docs/FLUX.md reports. The size rule keeps tiny layers dense.
TEST(QuantizedWeight, FixtureForwardErrorAgainstTheBf16Base) {
  torch::NoGradGuard no_grad;
  {
    const std::string dir = kGoldenRoot + "/flux/tiny_flux/transformer";
    const auto io = io::load_safetensors(dir + "/io.safetensors").tensors;
    auto run = [&](WeightStorage storage, models::QuantizeSummary* summary) {
      auto t = models::load_flux_transformer(dir, torch::kBFloat16);
      for (auto& p : t->parameters()) p.set_requires_grad(false);
      if (storage != WeightStorage::kDense) *summary = models::quantize_frozen_weights(*t, storage);
      auto bf = [&](const char* n) { return io.at(std::string("A.") + n).to(torch::kBFloat16); };
      return t
          ->forward(bf("hidden_states"), bf("encoder_hidden_states"), bf("pooled_projections"),
                    bf("timestep"), bf("guidance"), bf("img_ids"), bf("txt_ids"))
          .to(torch::kFloat32);
    };
    models::QuantizeSummary s;
    const auto base = run(WeightStorage::kDense, nullptr);
    const auto q8 = run(WeightStorage::kInt8, &s);
    const double abs = qw_max_abs(q8, base);
    const double rel = ((q8 - base).norm() / base.norm()).item<double>();
    std::printf(
        "FLUX tiny transformer int8 vs bf16 base: %lld of %lld layers 8-bit, max abs %.4g, "
        "relative L2 %.4g (bf16 base vs float32 reference: %.4g)\n",
        static_cast<long long>(s.layers), static_cast<long long>(s.layers + s.kept_dense), abs, rel,
        qw_max_abs(base, io.at("A.out")));
    EXPECT_GT(s.layers, 0);
    EXPECT_LE(rel, 0.05);
    EXPECT_GT(abs, 0.0);
  }
  {
    const std::string dir = kGoldenRoot + "/sd/tiny_sd/unet";
    const auto io = io::load_safetensors(dir + "/io.safetensors").tensors;
    auto run = [&](WeightStorage storage, models::QuantizeSummary* summary) {
      auto unet = models::load_unet(dir);
      unet->to(torch::kBFloat16);
      for (auto& p : unet->parameters()) p.set_requires_grad(false);
      if (storage != WeightStorage::kDense)
        *summary = models::quantize_frozen_weights(*unet, storage);
      models::UNetConditioning cond;
      cond.encoder_hidden_states = io.at("encoder_hidden_states").to(torch::kBFloat16);
      return unet->forward(io.at("sample").to(torch::kBFloat16), io.at("timestep"), cond)
          .to(torch::kFloat32);
    };
    models::QuantizeSummary s;
    const auto base = run(WeightStorage::kDense, nullptr);
    const auto q8 = run(WeightStorage::kInt8, &s);
    const double rel = ((q8 - base).norm() / base.norm()).item<double>();
    std::printf(
        "SD tiny UNet int8 vs bf16 base: %lld of %lld layers 8-bit, max abs %.4g, "
        "relative L2 %.4g\n",
        static_cast<long long>(s.layers), static_cast<long long>(s.layers + s.kept_dense),
        qw_max_abs(q8, base), rel);
    EXPECT_GT(s.layers, 0);
    EXPECT_LE(rel, 0.05);
  }
}

}  // namespace
}  // namespace difftrain
