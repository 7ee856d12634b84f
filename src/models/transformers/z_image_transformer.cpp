// Diffusers' ZImageTransformer2DModel (z_image_transformer.h), as transformer_z_image.py computes
// it: per-sample patchify and 32-token padding with learned pad tokens, refiners per stream,
// [image, caption] joint layers with a key mask only for batch padding, interleaved-pair RoPE in
// float32.

#include "difftrain/models/transformers/z_image_transformer.h"

#include "../json_fields.h"
#include "difftrain/core/error.h"
#include "difftrain/io/weight_index.h"
#include "difftrain/models/checkpointing.h"
#include "difftrain/models/layers.h"
#include "difftrain/models/pretrained.h"

#include <torch/torch.h>

#include <array>
#include <filesystem>
#include <limits>

namespace difftrain::models {

namespace fs = std::filesystem;

namespace {

constexpr int64_t kSeqMultiple = 32;  // SEQ_MULTI_OF
constexpr double kQkNormEps = 1e-5;   // Attention(eps=1e-5), whatever norm_eps says

int64_t padded(int64_t n) { return n + (kSeqMultiple - n % kSeqMultiple) % kSeqMultiple; }

std::string patch_key(int64_t p, int64_t f) { return std::to_string(p) + "-" + std::to_string(f); }

// The final layer of one patch size: LayerNorm (no affine) · (1 + adaLN_modulation.1(silu(c))),
// then linear.
class FinalLayerImpl : public torch::nn::Module {
 public:
  FinalLayerImpl(int64_t dim, int64_t adaln_dim, int64_t out) {
    linear = register_module("linear", Linear(torch::nn::LinearOptions(dim, out)));
    auto ada = register_module("adaLN_modulation", std::make_shared<torch::nn::Module>());
    modulation = ada->register_module("1", Linear(torch::nn::LinearOptions(adaln_dim, dim)));
  }
  // x: [B, S, dim], c: [B, adaln_dim].
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& c) {
    const auto scale = 1.0 + modulation(torch::silu(c)).unsqueeze(1);
    const auto normed = torch::layer_norm(x, {x.size(-1)}, {}, {}, 1e-6);
    return linear(normed * scale);
  }
  Linear linear{nullptr}, modulation{nullptr};
};
TORCH_MODULE(FinalLayer);

// Z-Image's RoPE factors: per axis, angles pos · theta^(-2j/d) in float64, cast to float32, then
// cos / sin in float32 (RopeEmbedder's complex64 tables). ids: [N, axes] -> cos, sin [N, hd/2].
std::pair<torch::Tensor, torch::Tensor> rope_factors(const torch::Tensor& ids,
                                                     const ZImageTransformerOptions& o) {
  std::vector<torch::Tensor> angles;
  for (size_t a = 0; a < o.axes_dims.size(); ++a) {
    const int64_t d = o.axes_dims[a];
    const auto freqs = 1.0 / torch::pow(o.rope_theta, torch::arange(0, d, 2, torch::kFloat64) /
                                                          static_cast<double>(d));
    const auto pos = ids.select(1, static_cast<int64_t>(a));
    if (!(pos.max().item<int64_t>() < o.axes_lens[a])) {
      throw Error(c10::str("ZImageTransformer2DModel: RoPE axis ", a, " position ",
                           pos.max().item<int64_t>(), " is beyond axes_lens ", o.axes_lens[a],
                           ": the caption or the latent is too long for this model"));
    }
    angles.push_back(torch::outer(pos.to(torch::kFloat64), freqs).to(torch::kFloat32));
  }
  const auto all = torch::cat(angles, -1);
  return {all.cos(), all.sin()};
}

// x: [B, S, H, hd] rotated by interleaved pairs with cos, sin [B, S, hd/2], in float32.
torch::Tensor rotate_pairs(const torch::Tensor& x, const torch::Tensor& cos,
                           const torch::Tensor& sin) {
  const auto xf = x.to(torch::kFloat32).unflatten(-1, {-1, 2});
  const auto re = xf.select(-1, 0);
  const auto im = xf.select(-1, 1);
  const auto c = cos.unsqueeze(2);
  const auto s = sin.unsqueeze(2);
  return torch::stack({re * c - im * s, re * s + im * c}, -1).flatten(-2).to(x.scalar_type());
}

}  // namespace

ZImageTransformerOptions ZImageTransformerOptions::load(const std::string& path) {
  const nlohmann::json j =
      detail::parse_json_file(path, "a Diffusers ZImageTransformer2DModel config.json");
  if (!j.is_object()) throw Error(path + ": expected a JSON object (a Z-Image transformer config)");
  const detail::JsonFields r(j, path);
  ZImageTransformerOptions o;
  auto ints = [&](const std::string& key, std::vector<int64_t> fallback) {
    if (!r.has(key)) return fallback;
    const auto& v = r.at(key);
    if (!v.is_array() || v.empty()) r.fail(key, "must be a non-empty list of integers");
    std::vector<int64_t> out;
    for (const auto& e : v) {
      if (!e.is_number_integer() || e.get<int64_t>() < 1) {
        r.fail(key, "must be a list of integers >= 1, got " + v.dump());
      }
      out.push_back(e.get<int64_t>());
    }
    return out;
  };
  o.all_patch_size = ints("all_patch_size", o.all_patch_size);
  o.all_f_patch_size = ints("all_f_patch_size", o.all_f_patch_size);
  o.in_channels = r.integer_at_least("in_channels", o.in_channels, 1);
  o.dim = r.integer_at_least("dim", o.dim, 1);
  o.n_layers = r.integer_at_least("n_layers", o.n_layers, 0);
  o.n_refiner_layers = r.integer_at_least("n_refiner_layers", o.n_refiner_layers, 0);
  o.n_heads = r.integer_at_least("n_heads", o.n_heads, 1);
  o.n_kv_heads = r.integer_at_least("n_kv_heads", o.n_heads, 1);
  o.norm_eps = r.number("norm_eps", o.norm_eps);
  o.qk_norm = r.boolean("qk_norm", o.qk_norm);
  o.cap_feat_dim = r.integer_at_least("cap_feat_dim", o.cap_feat_dim, 1);
  o.rope_theta = r.number("rope_theta", o.rope_theta);
  o.t_scale = r.number("t_scale", o.t_scale);
  o.axes_dims = ints("axes_dims", o.axes_dims);
  o.axes_lens = ints("axes_lens", o.axes_lens);
  if (r.has("siglip_feat_dim")) {
    r.fail("siglip_feat_dim",
           "is set: Z-Image-Omni's SigLIP image conditioning is not supported "
           "(Z-Image Turbo and Base have none)");
  }
  if (o.all_patch_size.size() != o.all_f_patch_size.size()) {
    r.fail("all_f_patch_size", "must have as many entries as all_patch_size");
  }
  if (o.dim % o.n_heads != 0) r.fail("n_heads", "must divide dim (" + std::to_string(o.dim) + ")");
  if (o.axes_dims.size() != o.axes_lens.size()) {
    r.fail("axes_lens", "must have as many entries as axes_dims");
  }
  int64_t sum = 0;
  for (const int64_t d : o.axes_dims) {
    if (d % 2 != 0) r.fail("axes_dims", "must be even (RoPE rotates pairs)");
    sum += d;
  }
  if (sum != o.head_dim()) {
    r.fail("axes_dims", "must sum to the head dim dim / n_heads = " + std::to_string(o.head_dim()) +
                            ", they sum to " + std::to_string(sum));
  }
  if (!(o.norm_eps > 0)) r.fail("norm_eps", "must be > 0");
  return o;
}

ZImageTransformerBlockImpl::ZImageTransformerBlockImpl(const ZImageTransformerOptions& o,
                                                       bool modulation)
    : options_(o), modulation_(modulation) {
  const int64_t d = o.dim;
  auto attention = register_module("attention", std::make_shared<torch::nn::Module>());
  auto linear = [](int64_t in, int64_t out) {
    return Linear(torch::nn::LinearOptions(in, out).bias(false));
  };
  to_q_ = attention->register_module("to_q", linear(d, d));
  to_k_ = attention->register_module("to_k", linear(d, d));
  to_v_ = attention->register_module("to_v", linear(d, d));
  auto out = attention->register_module("to_out", torch::nn::ModuleList());
  to_out_ = linear(d, d);
  out->push_back(to_out_);
  if (o.qk_norm) {
    norm_q_ = attention->register_module("norm_q", RMSNorm(o.head_dim(), kQkNormEps));
    norm_k_ = attention->register_module("norm_k", RMSNorm(o.head_dim(), kQkNormEps));
  }
  feed_forward_ = register_module("feed_forward", GatedFeedForward(d, d * 8 / 3, false));
  attention_norm1_ = register_module("attention_norm1", RMSNorm(d, o.norm_eps));
  ffn_norm1_ = register_module("ffn_norm1", RMSNorm(d, o.norm_eps));
  attention_norm2_ = register_module("attention_norm2", RMSNorm(d, o.norm_eps));
  ffn_norm2_ = register_module("ffn_norm2", RMSNorm(d, o.norm_eps));
  if (modulation) {
    auto ada = register_module("adaLN_modulation", torch::nn::ModuleList());
    ada_ = Linear(torch::nn::LinearOptions(o.adaln_dim(), 4 * d));
    ada->push_back(ada_);
  }
}

torch::Tensor ZImageTransformerBlockImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                                  const torch::Tensor& sin,
                                                  const torch::Tensor& key_mask,
                                                  const torch::Tensor& adaln) {
  const int64_t B = x.size(0);
  const int64_t S = x.size(1);
  const int64_t H = options_.n_heads;
  const int64_t hd = options_.head_dim();
  auto attend = [&](const torch::Tensor& h) {
    auto q = to_q_(h).view({B, S, H, hd});
    auto k = to_k_(h).view({B, S, H, hd});
    const auto v = to_v_(h).view({B, S, H, hd}).transpose(1, 2);
    if (options_.qk_norm) {
      q = norm_q_(q);
      k = norm_k_(k);
    }
    q = rotate_pairs(q, cos, sin).transpose(1, 2);
    k = rotate_pairs(k, cos, sin).transpose(1, 2);
    auto scores = torch::matmul(q, k.transpose(2, 3)) * std::pow(static_cast<double>(hd), -0.5);
    if (key_mask.defined()) {
      scores = scores.masked_fill(key_mask.logical_not().view({B, 1, 1, S}),
                                  -std::numeric_limits<double>::infinity());
    }
    const auto probs = torch::softmax(scores, -1);
    return to_out_(torch::matmul(probs, v).transpose(1, 2).reshape({B, S, H * hd}));
  };
  if (!modulation_) {
    const auto h = x + attention_norm2_(attend(attention_norm1_(x)));
    return h + ffn_norm2_(feed_forward_(ffn_norm1_(h)));
  }
  const auto mod = ada_(adaln).unsqueeze(1).chunk(4, 2);
  const auto scale_msa = 1.0 + mod[0];
  const auto gate_msa = mod[1].tanh();
  const auto scale_mlp = 1.0 + mod[2];
  const auto gate_mlp = mod[3].tanh();
  const auto h = x + gate_msa * attention_norm2_(attend(attention_norm1_(x) * scale_msa));
  return h + gate_mlp * ffn_norm2_(feed_forward_(ffn_norm1_(h) * scale_mlp));
}

ZImageTransformer2DModelImpl::ZImageTransformer2DModelImpl(const ZImageTransformerOptions& o)
    : options_(o) {
  auto x_embedders = register_module("all_x_embedder", std::make_shared<torch::nn::Module>());
  auto final_layers = register_module("all_final_layer", std::make_shared<torch::nn::Module>());
  for (size_t i = 0; i < o.all_patch_size.size(); ++i) {
    const int64_t p = o.all_patch_size[i];
    const int64_t f = o.all_f_patch_size[i];
    const int64_t features = f * p * p * o.in_channels;
    const std::string key = patch_key(p, f);
    x_embedders_.emplace(
        key, x_embedders->register_module(key, Linear(torch::nn::LinearOptions(features, o.dim))));
    final_layers_.emplace(
        key, final_layers->register_module(key, FinalLayer(o.dim, o.adaln_dim(), features)));
  }
  auto add_blocks = [&](const char* name, int64_t n, bool modulation,
                        std::vector<ZImageTransformerBlock>& into) {
    auto list = register_module(name, torch::nn::ModuleList());
    for (int64_t i = 0; i < n; ++i) {
      into.push_back(ZImageTransformerBlock(o, modulation));
      list->push_back(into.back());
    }
  };
  add_blocks("noise_refiner", o.n_refiner_layers, true, noise_refiner_);
  add_blocks("context_refiner", o.n_refiner_layers, false, context_refiner_);
  auto t_embedder = register_module("t_embedder", std::make_shared<torch::nn::Module>());
  auto mlp = t_embedder->register_module("mlp", std::make_shared<torch::nn::Module>());
  t_mlp0_ = mlp->register_module("0", Linear(torch::nn::LinearOptions(256, 1024)));
  t_mlp2_ = mlp->register_module("2", Linear(torch::nn::LinearOptions(1024, o.adaln_dim())));
  auto cap = register_module("cap_embedder", std::make_shared<torch::nn::Module>());
  cap_norm_ = cap->register_module("0", RMSNorm(o.cap_feat_dim, o.norm_eps));
  cap_linear_ = cap->register_module("1", Linear(torch::nn::LinearOptions(o.cap_feat_dim, o.dim)));
  x_pad_token_ = register_parameter("x_pad_token", torch::zeros({1, o.dim}));
  cap_pad_token_ = register_parameter("cap_pad_token", torch::zeros({1, o.dim}));
  add_blocks("layers", o.n_layers, true, layers_);
}

std::vector<torch::Tensor> ZImageTransformer2DModelImpl::forward(
    const std::vector<torch::Tensor>& x, const torch::Tensor& t,
    const std::vector<torch::Tensor>& cap_feats, int64_t patch_size, int64_t f_patch_size) {
  const auto B = static_cast<int64_t>(x.size());
  if (!(B >= 1 && static_cast<int64_t>(cap_feats.size()) == B && t.dim() == 1 && t.size(0) == B)) {
    throw Error(c10::str("ZImageTransformer2DModel: x (", B, " latents), cap_feats (",
                         cap_feats.size(), ") and t ", t.sizes(), " must describe the same batch"));
  }
  const std::string key = patch_key(patch_size, f_patch_size);
  if (!(x_embedders_.count(key) != 0)) {
    throw Error(c10::str("ZImageTransformer2DModel: patch size ", patch_size,
                         " / frame patch size ", f_patch_size,
                         " is not in the config's all_patch_size"));
  }
  auto& embedder = *x_embedders_.at(key);
  auto& final_layer = *final_layers_.at(key)->as<FinalLayerImpl>();
  const int64_t C = options_.in_channels;
  const int64_t p = patch_size;
  const int64_t pf = f_patch_size;
  const auto dtype = this->dtype();

  // The timestep embedding: sinusoid of t · t_scale (float32, cos first), then the MLP.
  const auto t_freq = timestep_embedding(t.to(torch::kFloat32) * options_.t_scale, 256, true, 0.0);
  const auto adaln = t_mlp2_(torch::silu(t_mlp0_(t_freq.to(dtype)))).to(dtype);

  struct Stream {
    torch::Tensor tokens;  // [S_i, dim]
    torch::Tensor ids;     // [S_i, 3] positions
  };
  std::vector<Stream> images, captions;
  std::vector<int64_t> real_tokens;
  std::vector<std::array<int64_t, 3>> grids;
  for (int64_t i = 0; i < B; ++i) {
    const auto& xi = x[static_cast<size_t>(i)];
    const auto& ci = cap_feats[static_cast<size_t>(i)];
    if (!(xi.dim() == 4 && xi.size(0) == C && xi.size(1) % pf == 0 && xi.size(2) % p == 0 &&
          xi.size(3) % p == 0)) {
      throw Error(c10::str("ZImageTransformer2DModel: latent ", i, " must be [", C,
                           ", F, H, W] with F divisible by ", pf, " and H, W by ", p, ", got ",
                           xi.sizes()));
    }
    if (!(ci.dim() == 2 && ci.size(1) == options_.cap_feat_dim && ci.size(0) >= 1)) {
      throw Error(c10::str("ZImageTransformer2DModel: cap_feats ", i, " must be [L, ",
                           options_.cap_feat_dim, "] with L >= 1, got ", ci.sizes()));
    }
    // Captions: RMSNorm + Linear, padded with the learned cap_pad_token; positions (1 + k, 0, 0).
    const int64_t L = ci.size(0);
    const int64_t Lp = padded(L);
    auto cap = cap_linear_(cap_norm_(ci.to(dtype)));
    if (Lp > L) cap = torch::cat({cap, cap_pad_token_.to(dtype).expand({Lp - L, options_.dim})});
    auto cap_ids = torch::zeros({Lp, 3}, torch::kInt64);
    cap_ids.select(1, 0).copy_(torch::arange(1, Lp + 1, torch::kInt64));
    captions.push_back({cap, cap_ids});
    // Image: patches in (f, h, w) order, each (pf, ph, pw, c); pads learned, at position 0.
    const int64_t F = xi.size(1) / pf, Hh = xi.size(2) / p, Ww = xi.size(3) / p;
    const int64_t N = F * Hh * Ww;
    const int64_t Np = padded(N);
    const auto patches = xi.to(dtype)
                             .view({C, F, pf, Hh, p, Ww, p})
                             .permute({1, 3, 5, 2, 4, 6, 0})
                             .reshape({N, pf * p * p * C});
    auto img = embedder.forward(patches);
    if (Np > N) img = torch::cat({img, x_pad_token_.to(dtype).expand({Np - N, options_.dim})});
    auto grid = torch::stack(torch::meshgrid({torch::arange(F, torch::kInt64) + Lp + 1,
                                              torch::arange(Hh, torch::kInt64),
                                              torch::arange(Ww, torch::kInt64)},
                                             "ij"),
                             -1)
                    .reshape({N, 3});
    if (Np > N) grid = torch::cat({grid, torch::zeros({Np - N, 3}, torch::kInt64)});
    images.push_back({img, grid});
    real_tokens.push_back(N);
    grids.push_back({F, Hh, Ww});
  }

  // Runs `blocks` over per-sample streams padded to the batch's longest, with a key mask when
  // their lengths differ (a sample's result does not depend on the others).
  // `swap`: the main layers' block swap (the refiners are never swapped).
  auto run = [&](std::vector<ZImageTransformerBlock>& blocks, const std::vector<Stream>& streams,
                 const torch::Tensor& cond, BlockSwap* swap) {
    int64_t S = 0;
    bool equal = true;
    for (const auto& s : streams) {
      equal = equal && (S == 0 || s.tokens.size(0) == S);
      S = std::max(S, s.tokens.size(0));
    }
    std::vector<torch::Tensor> xs, cs, ss, ms;
    for (const auto& s : streams) {
      const int64_t n = s.tokens.size(0);
      const auto [cos, sin] = rope_factors(s.ids, options_);
      xs.push_back(torch::constant_pad_nd(s.tokens, {0, 0, 0, S - n}));
      cs.push_back(torch::constant_pad_nd(cos, {0, 0, 0, S - n}));
      ss.push_back(torch::constant_pad_nd(sin, {0, 0, 0, S - n}));
      ms.push_back(torch::arange(S) < n);
    }
    auto h = torch::stack(xs);
    const auto cos = torch::stack(cs);
    const auto sin = torch::stack(ss);
    const auto mask = equal ? torch::Tensor() : torch::stack(ms);
    const bool ckpt = gradient_checkpointing_ && is_training() && torch::GradMode::is_enabled();
    size_t index = 0;
    for (auto& block : blocks) {
      if (swap) h = swap->enter(index, {h})[0];
      if (ckpt) {
        auto impl = block.ptr();  // captured by value: backward may run after this frame is gone
        h = checkpoint(
            [impl](const std::vector<torch::Tensor>& in) {
              return impl->forward(in[0], in[1], in[2], in[3], in[4]);
            },
            {h, cos, sin, mask, cond});
      } else {
        h = block->forward(h, cos, sin, mask, cond);
      }
      if (swap) h = swap->leave(index, {h})[0];
      ++index;
    }
    return h;
  };

  const auto refined_images = run(noise_refiner_, images, adaln, nullptr);
  const auto refined_captions = run(context_refiner_, captions, torch::Tensor(), nullptr);
  std::vector<Stream> joint;
  for (int64_t i = 0; i < B; ++i) {
    const auto& img = images[static_cast<size_t>(i)];
    const auto& cap = captions[static_cast<size_t>(i)];
    joint.push_back({torch::cat({refined_images[i].narrow(0, 0, img.tokens.size(0)),
                                 refined_captions[i].narrow(0, 0, cap.tokens.size(0))}),
                     torch::cat({img.ids, cap.ids})});
  }
  const auto h = final_layer.forward(run(layers_, joint, adaln, block_swap_.get()), adaln);

  std::vector<torch::Tensor> out;
  for (int64_t i = 0; i < B; ++i) {
    const auto [F, Hh, Ww] = grids[static_cast<size_t>(i)];
    out.push_back(h[i].narrow(0, 0, real_tokens[static_cast<size_t>(i)])
                      .view({F, Hh, Ww, pf, p, p, C})
                      .permute({6, 0, 3, 1, 4, 2, 5})
                      .reshape({C, F * pf, Hh * p, Ww * p}));
  }
  return out;
}

ZImageTransformer2DModel load_z_image_transformer(const std::string& dir, torch::Dtype dtype,
                                                  const std::string& variant) {
  const std::string config =
      model_folder_config(dir,
                          "a Diffusers ZImageTransformer2DModel folder (config.json + "
                          "diffusion_pytorch_model.safetensors, as save_pretrained writes it)");
  ZImageTransformer2DModel model(ZImageTransformerOptions::load(config));
  model->to(dtype);
  load_model_folder_weights(*model, dir, dtype, variant);
  return model;
}

void ZImageTransformer2DModelImpl::enable_block_swap(int64_t n) {
  block_swap_.reset();  // every weight back before another swap takes them
  block_swap_ = swap_last_blocks(layers_, n);
}

}  // namespace difftrain::models
