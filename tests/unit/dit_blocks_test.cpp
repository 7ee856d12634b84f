// The shared DiT blocks (models/transformers/dit_blocks.h, patchify.h), each against a float64
// recomputation of its formula; FLUX.1's transformer is made of them and its fixture parity
// (flux_transformer_test.cpp) checks them in place.

#include "difftrain/models/transformers/dit_blocks.h"
#include "difftrain/core/torch_compat.h"
#include "difftrain/models/kernels/fused_ops.h"
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

TEST(DiTBlocks, FusedRotaryEmbeddingMatchesTheTensorExpression) {
  // The one-pass kernel (on by default on the CPU) against the tensor expression it replaces
  // (DIFFTRAIN_FUSED_KERNELS=0): float32 bit for bit, forward and backward; bf16 rounds once
  // where the expression rounds its parts, so within one bf16 step of it.
  torch::manual_seed(3);
  const int64_t B = 2, N = 7, H = 3, D = 16;
  const auto ids = torch::randint(0, 50, {N, 3}).to(torch::kFloat32);
  const auto rope = m::rotary_tables(ids, {4, 6, 6});
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    // A non-contiguous x (a narrowed view), as the joint attention's halves can be.
    const auto base = torch::randn({B, N, H, D + 4}).to(dtype);
    const auto g = torch::randn({B, N, H, D}).to(dtype);
    std::vector<torch::Tensor> outs, grads;
    for (const bool fused : {true, false}) {
      m::set_fused_kernels_enabled(fused);
      auto x = base.narrow(3, 2, D).detach().requires_grad_();
      auto y = m::apply_rotary_emb(x, rope);
      outs.push_back(y.detach());
      grads.push_back(torch::autograd::grad({y}, {x}, {g})[0]);
    }
    m::set_fused_kernels_enabled(true);
    EXPECT_EQ(outs[0].scalar_type(), dtype);
    EXPECT_EQ(grads[0].scalar_type(), dtype);
    if (dtype == torch::kFloat32) {
      EXPECT_TRUE(torch::equal(outs[0], outs[1]));
      EXPECT_TRUE(torch::equal(grads[0], grads[1]));
    } else {
      const double step = 1.0 / 128;  // bf16's relative spacing
      EXPECT_LE(max_abs(outs[0], outs[1]), step * f64(outs[1]).abs().max().item<double>());
      EXPECT_LE(max_abs(grads[0], grads[1]), 2 * step * f64(grads[1]).abs().max().item<double>());
    }
  }
}

TEST(DiTBlocks, FusedRMSNormMatchesTheTensorExpression) {
  // The one-pass RMSNorm (on by default on the CPU) against the tensor expression
  // (DIFFTRAIN_FUSED_KERNELS=0), for every pairing of float32 / bf16 input and weight, with the
  // weight frozen (LoRA) and trained (a full fine-tune): the same output dtype, and values within
  // float32 rounding, or a bf16 step or two (the fused op rounds once where the expression
  // rounds each part).
  torch::manual_seed(4);
  const int64_t dim = 96;
  for (const auto xt : {torch::kFloat32, torch::kBFloat16}) {
    for (const auto wt : {torch::kFloat32, torch::kBFloat16}) {
      for (const bool train_weight : {false, true}) {
        SCOPED_TRACE(std::string(c10::toString(xt)) + " x, " + c10::toString(wt) + " weight" +
                     (train_weight ? ", trained" : ""));
        const auto x0 = (torch::randn({3, 5, dim}) * 3).to(xt);
        const auto w0 = (1 + 0.5 * torch::randn({dim})).to(wt);
        std::vector<torch::Tensor> ys, dxs, dws;
        for (const bool fused : {true, false}) {
          m::set_fused_kernels_enabled(fused);
          m::RMSNorm norm(dim, 1e-6);
          {
            torch::NoGradGuard no_grad;
            norm->weight.set_data(w0.clone());
          }
          norm->weight.requires_grad_(train_weight);
          auto x = x0.clone().requires_grad_();
          auto y = norm(x);
          torch::manual_seed(9);  // the same incoming gradient for both
          const auto g = torch::randn(y.sizes()).to(y.scalar_type());
          std::vector<torch::Tensor> inputs{x};
          if (train_weight) inputs.push_back(norm->weight);
          const auto grads = torch::autograd::grad({y}, inputs, {g});
          ys.push_back(y.detach());
          dxs.push_back(grads[0]);
          if (train_weight) dws.push_back(grads[1]);
        }
        m::set_fused_kernels_enabled(true);
        EXPECT_EQ(ys[0].scalar_type(), ys[1].scalar_type());
        EXPECT_EQ(dxs[0].scalar_type(), xt);
        const bool any_bf16 = xt == torch::kBFloat16 || wt == torch::kBFloat16;
        const double tol = any_bf16 ? 2.0 / 128 : 1e-5;
        const auto rel = [](const torch::Tensor& a, const torch::Tensor& b) {
          return max_abs(a, b) / f64(b).abs().max().item<double>();
        };
        EXPECT_LT(rel(ys[0], ys[1]), tol);
        EXPECT_LT(rel(dxs[0], dxs[1]), 2 * tol);
        if (train_weight) {
          EXPECT_EQ(dws[0].scalar_type(), wt);
          EXPECT_LT(rel(dws[0], dws[1]), 2 * tol);
        }
      }
    }
  }
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

// softmax(scale q k^T, masked keys -inf) v and its gradients in float64, by autograd over the
// plain ops: the reference for attention_core.
std::vector<torch::Tensor> reference_attention(const torch::Tensor& q, const torch::Tensor& k,
                                               const torch::Tensor& v, const torch::Tensor& mask,
                                               double scale, const torch::Tensor& dout) {
  auto q64 = f64(q).requires_grad_(), k64 = f64(k).requires_grad_(), v64 = f64(v).requires_grad_();
  auto scores = torch::bmm(q64, k64.transpose(1, 2)) * scale;
  if (mask.defined()) {
    const int64_t B = mask.size(0), BH = q.size(0), S = k.size(1);
    scores = scores.masked_fill(
        mask.logical_not().view({B, 1, 1, S}).expand({B, BH / B, 1, S}).reshape({BH, 1, S}),
        -INFINITY);
  }
  auto out = torch::bmm(scores.softmax(-1), v64);
  auto grads = torch::autograd::grad({out}, {q64, k64, v64}, {f64(dout)});
  return {out.detach(), grads[0], grads[1], grads[2]};
}

TEST(DiTBlocks, AttentionCoreBackwardRunsUnderTheForwardsAutocast) {
  // A full fine-tune under bf16 autocast: float32 q and k (RMSNorm with float32 weights) with a
  // bf16 v. The forward's products ran under autocast; the backward (outside the caller's
  // autocast region) must run its products under the same, as autograd's own graph would.
  torch::manual_seed(6);
  const int64_t BH = 4, N = 40, S = 40, d = 16;
  const auto q0 = torch::randn({BH, N, d}), k0 = torch::randn({BH, S, d});
  const auto v0 = torch::randn({BH, S, d}).to(torch::kBFloat16);
  const auto dout = torch::randn({BH, N, d});
  std::vector<torch::Tensor> ours, ref;
  for (const bool core : {true, false}) {
    auto q = q0.clone().requires_grad_(), k = k0.clone().requires_grad_(),
         v = v0.clone().requires_grad_();
    torch::Tensor out;
    {
      const compat::AutocastRestore autocast(c10::DeviceType::CPU, {true, torch::kBFloat16});
      if (core) {
        out = m::attention_core(q, k, v, {}, {1.0 / std::sqrt(double(d)), true, torch::kFloat32});
      } else {
        auto scores =
            (torch::bmm(q, k.transpose(1, 2)) * (1.0 / std::sqrt(double(d)))).to(torch::kFloat32);
        out = torch::bmm(scores.softmax(-1).to(torch::kFloat32), v);
      }
    }
    auto grads = torch::autograd::grad({out}, {q, k, v}, {dout.to(out.scalar_type())});
    (core ? ours : ref) = std::vector<torch::Tensor>{out.detach(), grads[0], grads[1], grads[2]};
  }
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(ours[i].scalar_type(), ref[i].scalar_type()) << i;
    EXPECT_LE(max_abs(ours[i], ref[i]), f64(ref[i]).abs().max().item<double>() / 128) << i;
  }
}

// The forward's ops in q's dtype (bf16 scores, a float32 softmax), unchunked, and their gradients
// by autograd: what attention_core computed before its backward recomputed the probabilities.
std::vector<torch::Tensor> same_dtype_attention(const torch::Tensor& q, const torch::Tensor& k,
                                                const torch::Tensor& v, const torch::Tensor& mask,
                                                double scale, const torch::Tensor& dout) {
  auto q1 = q.detach().requires_grad_(), k1 = k.detach().requires_grad_(),
       v1 = v.detach().requires_grad_();
  auto scores = (torch::bmm(q1, k1.transpose(1, 2)) * scale).to(torch::kFloat32);
  if (mask.defined()) {
    const int64_t B = mask.size(0), BH = q.size(0), S = k.size(1);
    scores = scores.masked_fill(
        mask.logical_not().view({B, 1, 1, S}).expand({B, BH / B, 1, S}).reshape({BH, 1, S}),
        -INFINITY);
  }
  auto out = torch::bmm(scores.softmax(-1).to(q.scalar_type()), v1);
  auto grads = torch::autograd::grad({out}, {q1, k1, v1}, {dout});
  return {out.detach(), grads[0], grads[1], grads[2]};
}

TEST(DiTBlocks, AttentionCoreRecomputesItsProbabilitiesInTheBackward) {
  // Enough scores that the work runs in several chunks (4M scores per chunk): 32 heads of 300 x
  // 2,100 in chunks of 6 heads (the last one short); 2 heads of 2,100 x 2,100 (more than a chunk
  // each) one head at a time in query chunks, with the backward's float32 sums of dK and dV over
  // them. The backward's per-chunk recomputation in both; bf16 with the one-pass softmax kernel
  // and with the tensor ops (kernels off).
  torch::manual_seed(0);
  struct Shape {
    int64_t B, heads, N, S;
  };
  for (const Shape& shape : {Shape{2, 16, 300, 2100}, Shape{1, 2, 2100, 2100}}) {
    for (const bool masked : {false, true}) {
      for (const bool fused : {true, false}) {
        m::set_fused_kernels_enabled(fused);
        for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
          const int64_t B = shape.B, heads = shape.heads, N = shape.N, S = shape.S, d = 8;
          const double scale = 1.0 / std::sqrt(double(d));
          auto q = torch::randn({B * heads, N, d}).to(dtype).requires_grad_();
          auto k = torch::randn({B * heads, S, d}).to(dtype).requires_grad_();
          auto v = torch::randn({B * heads, S, d}).to(dtype).requires_grad_();
          torch::Tensor mask;
          if (masked) {
            mask = torch::ones({B, S}, torch::kBool);
            mask.index_put_({B - 1, torch::indexing::Slice(1500)}, false);
          }
          const auto dout = torch::randn({B * heads, N, d}).to(dtype);
          const auto out =
              m::attention_core(q, k, v, mask, {scale, /*upcast_softmax=*/true, dtype});
          const auto grads = torch::autograd::grad({out}, {q, k, v}, {dout});
          const auto ref = reference_attention(q, k, v, mask, scale, dout);
          const auto same_ops = same_dtype_attention(q, k, v, mask, scale, dout);
          const auto rel = [](const torch::Tensor& a, const torch::Tensor& r) {
            return max_abs(f64(a), f64(r)) / f64(r).abs().max().item<double>();
          };
          SCOPED_TRACE(std::string(masked ? "masked " : "") + (fused ? "fused " : "ops ") +
                       c10::toString(dtype) + " heads " + std::to_string(heads) + " queries " +
                       std::to_string(N));
          EXPECT_EQ(out.scalar_type(), dtype);
          // float32: against the same ops under autograd (what the recomputation replaces) and
          // float64, to float32's rounding. bf16: the one-pass softmax scales the bf16 scores in
          // float32 where the ops round the scaled scores to bf16 again (moving the probabilities
          // by about 1%), so it is held to float64: at least as close as the ops it replaces, and
          // to them within a few bf16 steps.
          const std::vector<torch::Tensor> ours{out, grads[0], grads[1], grads[2]};
          for (size_t i = 0; i < ours.size(); ++i) {
            SCOPED_TRACE("output " + std::to_string(i) + " (0: out, then dq, dk, dv)");
            EXPECT_EQ(ours[i].scalar_type(), dtype);
            if (dtype == torch::kFloat32) {
              EXPECT_LT(rel(ours[i], same_ops[i]), 1e-5);
              EXPECT_LT(rel(ours[i], ref[i]), 1e-5);
            } else {
              // The root-mean-square error (the maximum is one element's bf16 rounding).
              const auto rms_err = [&](const torch::Tensor& a) {
                return (f64(a) - f64(ref[i])).pow(2).mean().sqrt().item<double>() /
                       f64(ref[i]).pow(2).mean().sqrt().item<double>();
              };
              const double err = rms_err(ours[i]), ops_err = rms_err(same_ops[i]);
              // One pass: about a quarter less error than the ops; the ops themselves (kernels
              // off) as close as autograd's, chunking and float32 sums aside.
              EXPECT_LE(err, fused ? ops_err : ops_err * 1.05);
              EXPECT_LT(rel(ours[i], ref[i]), 5e-2);
              EXPECT_LT(rel(ours[i], same_ops[i]), 1.0 / 32);
            }
          }
          // The forward with grad mode off is the same computation, bit for bit.
          torch::NoGradGuard no_grad;
          EXPECT_TRUE(
              torch::equal(m::attention_core(q, k, v, mask, {scale, true, dtype}), out.detach()));
        }
      }
    }
  }
  m::set_fused_kernels_enabled(true);
}

// token_rows: the rows of x[:, start : start + length], for one sample with the batch stride a
// matmul folds (LibTorch 2.x copies the weight on every call otherwise), for a batch a copy.
TEST(DiTBlocks, TokenRowsKeepOneSamplesMemoryWithAFoldableStride) {
  const auto x = torch::randn({1, 10, 4});
  const auto r = difftrain::models::token_rows(x, 3, 5);
  EXPECT_TRUE(torch::equal(r, x.narrow(1, 3, 5)));
  EXPECT_EQ(r.data_ptr(), x.narrow(1, 3, 5).data_ptr());  // no copy
  EXPECT_EQ(r.stride(0), 5 * 4);                          // narrow's view keeps 10 * 4
  EXPECT_EQ(x.narrow(1, 3, 5).stride(0), 10 * 4);
  const auto xb = torch::randn({2, 10, 4});
  const auto rb = difftrain::models::token_rows(xb, 3, 5);
  EXPECT_TRUE(torch::equal(rb, xb.narrow(1, 3, 5)));
  EXPECT_EQ(rb.stride(0), 5 * 4);
  // Gradients flow to the rows taken.
  const auto xg = torch::randn({1, 6, 2}).requires_grad_();
  difftrain::models::token_rows(xg, 2, 3).sum().backward();
  EXPECT_TRUE(
      torch::equal(xg.grad().sum(2).squeeze(0), torch::tensor({0.f, 0.f, 2.f, 2.f, 2.f, 0.f})));
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
