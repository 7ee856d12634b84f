// The shared DiT blocks (models/transformers/dit_blocks.h, patchify.h), each against a float64
// recomputation of its formula; FLUX.1's transformer is made of them and its fixture parity
// (flux_transformer_test.cpp) checks them in place.

#include "difftrain/models/transformers/dit_blocks.h"
#include "difftrain/models/transformers/patchify.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <array>
#include <cmath>
#include <string>
#include <vector>

namespace difftrain {
namespace {

using test::error_of;
using test::max_abs;
namespace m = models;

torch::Tensor f64(const torch::Tensor& t) { return t.detach().to(torch::kFloat64); }

// The message of the TORCH_CHECK `f` fails (the blocks check shapes as LibTorch's modules do).
template <typename F>
std::string check_of(F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  ADD_FAILURE() << "expected a c10::Error";
  return "";
}

TEST(DiTBlocks, RotaryTablesCoverAnyNumberOfAxes) {
  for (const auto& axes : std::vector<std::vector<int64_t>>{{8}, {4, 6}, {2, 4, 6}}) {
    const int64_t n = 5, k = static_cast<int64_t>(axes.size());
    const auto ids = torch::randint(0, 9, {n, k}, torch::kInt64);
    const auto rope = m::rotary_tables(ids, axes, 1000.0);
    int64_t total = 0;
    for (const int64_t d : axes) total += d;
    ASSERT_EQ(rope.cos.sizes(), (c10::IntArrayRef{n, total}));
    double worst = 0;
    for (int64_t row = 0; row < n; ++row) {
      int64_t col = 0;
      for (int64_t a = 0; a < k; ++a) {
        const int64_t d = axes[static_cast<size_t>(a)];
        for (int64_t j = 0; j < d / 2; ++j) {
          const double angle = static_cast<double>(ids[row][a].item<int64_t>()) *
                               std::pow(1000.0, -2.0 * static_cast<double>(j) / d);
          for (int64_t twice = 0; twice < 2; ++twice) {
            worst = std::max(worst, std::abs(rope.cos[row][col].item<double>() - std::cos(angle)));
            worst = std::max(worst, std::abs(rope.sin[row][col].item<double>() - std::sin(angle)));
            ++col;
          }
        }
      }
    }
    EXPECT_LT(worst, 1e-6) << "axes " << k;
  }
  EXPECT_NE(check_of([] {
              m::rotary_tables(torch::zeros({3, 2}), {4, 4, 4});
            }).find("[N, 3]"),
            std::string::npos);
}

TEST(DiTBlocks, RotaryEmbeddingRotatesInterleavedPairs) {
  torch::manual_seed(1);
  const auto x = torch::randn({2, 5, 3, 8});
  const auto rope = m::rotary_tables(torch::arange(5).unsqueeze(1), {8});
  const auto y = m::apply_rotary_emb(x, rope);
  auto want = f64(x).clone();
  const auto c = f64(rope.cos), s = f64(rope.sin), xd = f64(x);
  for (int64_t p = 0; p < 4; ++p) {
    const auto a = xd.select(3, 2 * p), b = xd.select(3, 2 * p + 1);
    const auto cs = c.select(1, 2 * p).view({1, 5, 1}), sn = s.select(1, 2 * p).view({1, 5, 1});
    want.select(3, 2 * p).copy_(a * cs - b * sn);
    want.select(3, 2 * p + 1).copy_(b * cs + a * sn);
  }
  const double d = max_abs(y, want);
  std::cout << "apply_rotary_emb vs float64: " << d << "\n";
  EXPECT_LT(d, 1e-6);
  EXPECT_EQ(m::apply_rotary_emb(x.to(torch::kBFloat16), rope).scalar_type(), torch::kBFloat16);
}

TEST(DiTBlocks, NormsAndModulationFollowTheirFormulas) {
  torch::manual_seed(2);
  m::RMSNorm norm(6, 1e-5);
  torch::NoGradGuard no_grad;
  norm->weight.copy_(torch::randn({6}));
  const auto x = torch::randn({2, 4, 6});
  const auto xd = f64(x);
  const auto want = xd / (xd.pow(2).mean(-1, true) + 1e-5).sqrt() * f64(norm->weight);
  EXPECT_LT(max_abs(norm(x), want), 1e-5);
  const auto shift = torch::randn({2, 6}), scale = torch::randn({2, 6});
  const auto mean = xd.mean(-1, true), var = (xd - mean).pow(2).mean(-1, true);
  const auto mod =
      (xd - mean) / (var + 1e-6).sqrt() * (1 + f64(scale).unsqueeze(1)) + f64(shift).unsqueeze(1);
  EXPECT_LT(max_abs(m::modulate(x, shift, scale), mod), 1e-5);
  m::AdaLayerNormZero ada(6, 3);
  const auto temb = torch::randn({2, 6});
  const auto chunks = ada(temb);
  ASSERT_EQ(chunks.size(), 3u);
  const auto params = ada->named_parameters();
  const auto lin =
      torch::silu(f64(temb)).matmul(f64(params["linear.weight"]).t()) + f64(params["linear.bias"]);
  for (int64_t i = 0; i < 3; ++i) EXPECT_LT(max_abs(chunks[i], lin.narrow(1, 6 * i, 6)), 1e-5);
}

TEST(DiTBlocks, GatedFeedForwardIsSwiGLUUnderItsNames) {
  torch::manual_seed(3);
  m::GatedFeedForward ff(4, 10);
  const auto p = ff->named_parameters();
  EXPECT_EQ(p.size(), 3u);  // w1, w2, w3 without bias
  const auto x = torch::randn({3, 4});
  const auto xd = f64(x);
  const auto g = xd.matmul(f64(p["w1.weight"]).t());
  const auto want =
      (torch::silu(g) * xd.matmul(f64(p["w3.weight"]).t())).matmul(f64(p["w2.weight"]).t());
  EXPECT_LT(max_abs(ff(x), want), 1e-5);
  m::GatedFeedForward llm(4, 10, true,
                          std::array<std::string, 3>{"gate_proj", "up_proj", "down_proj"});
  const auto q = llm->named_parameters();
  EXPECT_EQ(q.size(), 6u);
  EXPECT_TRUE(q.contains("gate_proj.weight") && q.contains("down_proj.bias"));
}

TEST(DiTBlocks, SingleStreamAttentionIsSoftmaxOverNormedRotatedHeads) {
  torch::manual_seed(4);
  const int64_t B = 2, N = 5, D = 8, H = 2, hd = 4;
  m::DiTAttention attn(D, H, hd, /*joint=*/false);
  const auto x = torch::randn({B, N, D});
  const auto rope = m::rotary_tables(
      torch::stack({torch::zeros({N}), torch::arange(N, torch::kFloat32)}, 1), {2, 2});
  torch::NoGradGuard no_grad;
  const auto [o, none] = attn(x, torch::Tensor(), rope);
  EXPECT_FALSE(none.defined());
  auto p = attn->named_parameters();
  const auto proj = [&](const std::string& name) {
    return (f64(x).matmul(f64(p[name + ".weight"]).t()) + f64(p[name + ".bias"]))
        .view({B, N, H, hd});
  };
  const auto rms = [&](const torch::Tensor& t, const std::string& name) {
    return t / (t.pow(2).mean(-1, true) + 1e-6).sqrt() * f64(p[name + ".weight"]);
  };
  const auto q = f64(m::apply_rotary_emb(rms(proj("to_q"), "norm_q").to(torch::kFloat32), rope));
  const auto k = f64(m::apply_rotary_emb(rms(proj("to_k"), "norm_k").to(torch::kFloat32), rope));
  const auto v = proj("to_v");
  const auto scores = torch::einsum("bnhd,bmhd->bhnm", {q, k}) / std::sqrt(double(hd));
  const auto want = torch::einsum("bhnm,bmhd->bnhd", {scores.softmax(-1), v}).reshape({B, N, D});
  const double d = max_abs(o, want);
  std::cout << "DiTAttention vs float64: " << d << "\n";
  EXPECT_LT(d, 1e-5);
  EXPECT_NE(check_of([&] { attn(x, x, rope); }).find("takes no text stream"), std::string::npos);
  m::DiTAttention joint(D, H, hd, /*joint=*/true);
  EXPECT_TRUE(joint->named_parameters().contains("to_out.0.weight"));
  EXPECT_TRUE(joint->named_parameters().contains("norm_added_k.weight"));
}

TEST(DiTBlocks, PatchifyOrdersTokensAndChannelsEitherWay) {
  // An image, channels first: FLUX.1's _pack_latents formula.
  const auto z = torch::arange(2 * 3 * 4 * 6).to(torch::kFloat32).reshape({2, 3, 4, 6});
  const auto t = m::patchify(z, {2, 2});
  ASSERT_EQ(t.sizes(), (c10::IntArrayRef{2, 6, 12}));
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t j = 0; j < 3; ++j)
      for (int64_t c = 0; c < 3; ++c)
        for (int64_t dy = 0; dy < 2; ++dy)
          for (int64_t dx = 0; dx < 2; ++dx)
            ASSERT_EQ(t[1][i * 3 + j][c * 4 + 2 * dy + dx].item<float>(),
                      z[1][c][2 * i + dy][2 * j + dx].item<float>());
  EXPECT_TRUE(torch::equal(m::unpatchify(t, {4, 6}, {2, 2}), z));
  // A clip [B, C, F, H, W], patch (1, 2, 2), channels last: token (f, i, j), feature
  // (pf, dy, dx, c).
  const auto v = torch::randn({1, 3, 2, 4, 2});
  const auto tv = m::patchify(v, {1, 2, 2}, m::PatchChannels::kLast);
  ASSERT_EQ(tv.sizes(), (c10::IntArrayRef{1, 2 * 2 * 1, 12}));
  for (int64_t f = 0; f < 2; ++f)
    for (int64_t i = 0; i < 2; ++i)
      for (int64_t dy = 0; dy < 2; ++dy)
        for (int64_t dx = 0; dx < 2; ++dx)
          for (int64_t c = 0; c < 3; ++c)
            ASSERT_EQ(tv[0][f * 2 + i][(dy * 2 + dx) * 3 + c].item<float>(),
                      v[0][c][f][2 * i + dy][dx].item<float>());
  EXPECT_TRUE(torch::equal(m::unpatchify(tv, {2, 4, 2}, {1, 2, 2}, m::PatchChannels::kLast), v));
  // The ids of the patch grid, in the tokens' order.
  const auto ids = m::grid_ids({2, 3}, 1);
  ASSERT_EQ(ids.sizes(), (c10::IntArrayRef{6, 3}));
  EXPECT_TRUE(torch::equal(ids[4], torch::tensor({0.f, 1.f, 1.f})));
  EXPECT_TRUE(torch::equal(m::grid_ids({2, 2, 2})[5], torch::tensor({1.f, 0.f, 1.f})));
  // Bad shapes: one line naming both.
  EXPECT_NE(error_of([&] {
              m::patchify(z, {2, 4});
            }).find("multiple of the patch [2, 4]"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              m::unpatchify(t, {4, 8}, {2, 2});
            }).find("latent sizes [4, 8]"),
            std::string::npos);
}

}  // namespace
}  // namespace difftrain
