// Diffusers' WanTransformer3DModel (wan_transformer.h), as transformer_wan.py computes it: the
// modulation and the layer norms in float32, the attention in the model's dtype, RoPE products
// in float32.

#include "difftrain/models/transformers/wan_transformer.h"

#include "../json_fields.h"
#include "difftrain/core/error.h"
#include "difftrain/io/weight_index.h"
#include "difftrain/models/checkpointing.h"
#include "difftrain/models/pretrained.h"

#include <torch/torch.h>

#include <cmath>

namespace difftrain::models {

namespace {

const char* const kWanConfig = "a Diffusers WanTransformer3DModel config.json";

// FP32LayerNorm: the input and the affine in float32, the result in the input's dtype.
torch::Tensor fp32_layer_norm(const torch::Tensor& x, const torch::Tensor& weight,
                              const torch::Tensor& bias, double eps) {
  const auto w = weight.defined() ? weight.to(torch::kFloat32) : torch::Tensor();
  const auto b = bias.defined() ? bias.to(torch::kFloat32) : torch::Tensor();
  return torch::layer_norm(x.to(torch::kFloat32), {x.size(-1)}, w, b, eps).to(x.scalar_type());
}

// Diffusers' FeedForward with an explicit inner width: net.0.proj, net.2.
std::pair<Linear, Linear> register_ffn(torch::nn::Module& parent, const std::string& name,
                                       int64_t dim, int64_t inner, int64_t out) {
  auto ffn = parent.register_module(name, std::make_shared<torch::nn::Module>());
  auto net = ffn->register_module("net", torch::nn::ModuleList());
  auto gelu = std::make_shared<torch::nn::Module>();
  Linear in = gelu->register_module("proj", Linear(dim, inner));
  Linear o(inner, out);
  net->push_back(gelu);
  net->push_back(torch::nn::Identity());  // net.1: Dropout, nothing to load
  net->push_back(o);
  return {in, o};
}

// softmax(q k^T / sqrt(d)) v per head. In bf16 / fp16 it runs in float32 and casts back, as
// torch's CPU scaled_dot_product_attention kernel accumulates reduced-precision inputs.
torch::Tensor wan_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            int64_t heads) {
  if (q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kFloat64) {
    return multi_head_attention(q, k, v, heads, false, false);
  }
  return multi_head_attention(q.to(torch::kFloat32), k.to(torch::kFloat32), v.to(torch::kFloat32),
                              heads, false, false)
      .to(q.scalar_type());
}

}  // namespace

std::array<int64_t, 3> WanTransformerOptions::rope_dims() const {
  const int64_t hw = 2 * (attention_head_dim / 6);
  return {attention_head_dim - 2 * hw, hw, hw};
}

WanTransformerOptions WanTransformerOptions::parse(const nlohmann::json& j,
                                                   const std::string& source) {
  if (!j.is_object()) throw Error(source + ": expected a JSON object (" + kWanConfig + ")");
  const detail::JsonFields r(j, source);
  WanTransformerOptions o;
  if (r.has("patch_size")) {
    const auto p = r.integers("patch_size", {});
    if (p.size() != 3 || p[0] < 1 || p[1] < 1 || p[2] < 1) {
      r.fail("patch_size", "must be 3 positive integers (frames, rows, columns)");
    }
    o.patch_size = {p[0], p[1], p[2]};
  }
  o.num_attention_heads = r.integer_at_least("num_attention_heads", o.num_attention_heads, 1);
  o.attention_head_dim = r.integer_at_least("attention_head_dim", o.attention_head_dim, 6);
  o.in_channels = r.integer_at_least("in_channels", o.in_channels, 1);
  o.out_channels = r.has("out_channels") ? r.integer_at_least("out_channels", 1, 1) : o.in_channels;
  o.text_dim = r.integer_at_least("text_dim", o.text_dim, 1);
  o.freq_dim = r.integer_at_least("freq_dim", o.freq_dim, 2);
  o.ffn_dim = r.integer_at_least("ffn_dim", o.ffn_dim, 1);
  o.num_layers = r.integer_at_least("num_layers", o.num_layers, 0);
  o.cross_attn_norm = r.boolean("cross_attn_norm", o.cross_attn_norm);
  o.eps = r.number("eps", o.eps);
  o.image_dim = r.opt_integer("image_dim", std::nullopt);
  o.added_kv_proj_dim = r.opt_integer("added_kv_proj_dim", std::nullopt);
  o.rope_max_seq_len = r.integer_at_least("rope_max_seq_len", o.rope_max_seq_len, 1);
  o.pos_embed_seq_len = r.opt_integer("pos_embed_seq_len", std::nullopt);
  const std::string qk = r.string("qk_norm", "rms_norm_across_heads");
  if (qk != "rms_norm_across_heads") {
    r.fail("qk_norm", "is \"" + qk +
                          "\"; Wan's attention normalises q and k across the heads "
                          "(rms_norm_across_heads)");
  }
  if (o.freq_dim % 2 != 0) r.fail("freq_dim", "must be even");
  const auto d = o.rope_dims();
  if (d[0] % 2 != 0 || d[0] < 2 || d[1] < 2) {
    r.fail("attention_head_dim",
           "must split into even RoPE parts (frames d - 4 (d / 6), rows and columns 2 (d / 6))");
  }
  if (o.image_dim.has_value() != o.added_kv_proj_dim.has_value()) {
    r.fail("added_kv_proj_dim", "and image_dim go together (Wan 2.1 I2V's image branch)");
  }
  return o;
}

WanTransformerOptions WanTransformerOptions::load(const std::string& path) {
  return parse(detail::parse_json_file(path, kWanConfig), path);
}

// ------------------------------------------------------------------ attention

WanAttentionImpl::WanAttentionImpl(int64_t dim, int64_t heads, double eps,
                                   std::optional<int64_t> added_kv_dim)
    : heads_(heads) {
  to_q_ = register_module("to_q", Linear(dim, dim));
  to_k_ = register_module("to_k", Linear(dim, dim));
  to_v_ = register_module("to_v", Linear(dim, dim));
  auto out = register_module("to_out", torch::nn::ModuleList());
  to_out_ = Linear(dim, dim);
  out->push_back(to_out_);
  norm_q_ = register_module("norm_q", RMSNorm(dim, eps));
  norm_k_ = register_module("norm_k", RMSNorm(dim, eps));
  if (added_kv_dim) {
    add_k_proj_ = register_module("add_k_proj", Linear(*added_kv_dim, dim));
    add_v_proj_ = register_module("add_v_proj", Linear(*added_kv_dim, dim));
    norm_added_k_ = register_module("norm_added_k", RMSNorm(dim, eps));
  }
}

torch::Tensor WanAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& context_in,
                                        const RotaryTables* rope) {
  torch::Tensor context = context_in.defined() ? context_in : x;
  torch::Tensor image;
  if (add_k_proj_) {  // the first S - 512 context tokens are the image's (Diffusers hardcodes 512)
    const int64_t n_img = context.size(1) - 512;
    TORCH_CHECK(n_img >= 0, "WanAttention: the I2V context must end with 512 text tokens, got ",
                context.size(1), " tokens");
    image = token_rows(context, 0, n_img);
    context = token_rows(context, n_img, 512);
  }
  const int64_t B = x.size(0), D = x.size(2), hd = D / heads_;
  auto heads = [&](const torch::Tensor& t) { return t.view({B, t.size(1), heads_, hd}); };
  auto q = heads(norm_q_(to_q_(x)));
  auto k = heads(norm_k_(to_k_(context)));
  auto v = heads(to_v_(context));
  if (rope != nullptr) {
    q = apply_rotary_emb(q, *rope);
    k = apply_rotary_emb(k, *rope);
  }
  auto flat = [&](const torch::Tensor& t) { return t.reshape({B, t.size(1), D}); };
  torch::Tensor out = wan_attention(flat(q), flat(k), flat(v), heads_);
  if (image.defined()) {
    const auto ki = norm_added_k_(add_k_proj_(image));
    const auto vi = add_v_proj_(image);
    out = out + wan_attention(flat(q), ki, vi, heads_);
  }
  return to_out_(out);
}

// ------------------------------------------------------------------ block

WanTransformerBlockImpl::WanTransformerBlockImpl(const WanTransformerOptions& o) : eps_(o.eps) {
  const int64_t D = o.inner_dim();
  attn1_ = register_module("attn1", WanAttention(D, o.num_attention_heads, o.eps, std::nullopt));
  attn2_ =
      register_module("attn2", WanAttention(D, o.num_attention_heads, o.eps, o.added_kv_proj_dim));
  if (o.cross_attn_norm) {
    auto norm2 = register_module("norm2", std::make_shared<torch::nn::Module>());
    norm2_weight_ = norm2->register_parameter("weight", torch::ones({D}));
    norm2_bias_ = norm2->register_parameter("bias", torch::zeros({D}));
  }
  std::tie(ffn_in_, ffn_out_) = register_ffn(*this, "ffn", D, o.ffn_dim, D);
  scale_shift_table_ = register_parameter("scale_shift_table", torch::zeros({1, 6, D}));
}

torch::Tensor WanTransformerBlockImpl::forward(const torch::Tensor& x, const torch::Tensor& context,
                                               const torch::Tensor& timestep_proj,
                                               const RotaryTables& rope) {
  core::ForwardScope scope(*this);
  const auto dtype = x.scalar_type();
  // (scale_shift_table + temb.float()).chunk(6): shift, scale, gate, c_shift, c_scale, c_gate.
  std::vector<torch::Tensor> m;
  if (timestep_proj.dim() == 4) {  // per token: [B, N, 6, D]
    const auto all =
        scale_shift_table_.to(torch::kFloat32).unsqueeze(0) + timestep_proj.to(torch::kFloat32);
    for (const auto& c : all.chunk(6, 2)) m.push_back(c.squeeze(2));
  } else {  // [B, 6, D]
    const auto all = scale_shift_table_.to(torch::kFloat32) + timestep_proj.to(torch::kFloat32);
    m = all.chunk(6, 1);
  }
  auto layer_norm = [&](const torch::Tensor& h) {
    return torch::layer_norm(h.to(torch::kFloat32), {h.size(-1)}, {}, {}, eps_);
  };
  auto h = x;
  const auto n1 = (layer_norm(h) * (1 + m[1]) + m[0]).to(dtype);
  const auto a1 = attn1_->forward(n1, {}, &rope);
  h = (h.to(torch::kFloat32) + a1 * m[2]).to(dtype);
  const auto n2 =
      norm2_weight_.defined()
          ? fp32_layer_norm(h.to(torch::kFloat32), norm2_weight_, norm2_bias_, eps_).to(dtype)
          : h;
  h = h + attn2_->forward(n2, context, nullptr);
  const auto n3 = (layer_norm(h) * (1 + m[4]) + m[3]).to(dtype);
  const auto ff = ffn_out_(models::gelu(ffn_in_(n3), /*tanh_approximation=*/true));
  h = (h.to(torch::kFloat32) + ff.to(torch::kFloat32) * m[5]).to(dtype);
  return scope.output(h);
}

// ------------------------------------------------------------------ model

WanTransformer3DModelImpl::WanTransformer3DModelImpl(const WanTransformerOptions& o) : options_(o) {
  const int64_t D = o.inner_dim();
  auto pe = register_module("patch_embedding", std::make_shared<torch::nn::Module>());
  patch_weight_ = pe->register_parameter(
      "weight",
      torch::zeros({D, o.in_channels, o.patch_size[0], o.patch_size[1], o.patch_size[2]}));
  patch_bias_ = pe->register_parameter("bias", torch::zeros({D}));
  auto ce = register_module("condition_embedder", std::make_shared<torch::nn::Module>());
  time_embedder_ = ce->register_module("time_embedder", TimestepEmbedding(o.freq_dim, D));
  time_proj_ = ce->register_module("time_proj", Linear(D, 6 * D));
  auto text = ce->register_module("text_embedder", std::make_shared<torch::nn::Module>());
  text_linear_1_ = text->register_module("linear_1", Linear(o.text_dim, D));
  text_linear_2_ = text->register_module("linear_2", Linear(D, D));
  if (o.image_dim) {
    auto img = ce->register_module("image_embedder", std::make_shared<torch::nn::Module>());
    auto n1 = img->register_module("norm1", std::make_shared<torch::nn::Module>());
    img_norm1_weight_ = n1->register_parameter("weight", torch::ones({*o.image_dim}));
    img_norm1_bias_ = n1->register_parameter("bias", torch::zeros({*o.image_dim}));
    std::tie(img_ff_in_, img_ff_out_) = register_ffn(*img, "ff", *o.image_dim, *o.image_dim, D);
    auto n2 = img->register_module("norm2", std::make_shared<torch::nn::Module>());
    img_norm2_weight_ = n2->register_parameter("weight", torch::ones({D}));
    img_norm2_bias_ = n2->register_parameter("bias", torch::zeros({D}));
    if (o.pos_embed_seq_len) {
      img_pos_embed_ = img->register_parameter(
          "pos_embed", torch::zeros({1, *o.pos_embed_seq_len, *o.image_dim}));
    }
  }
  auto list = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.num_layers; ++i) {
    blocks_.push_back(WanTransformerBlock(o));
    list->push_back(blocks_.back());
  }
  proj_out_ = register_module(
      "proj_out", Linear(D, o.out_channels * o.patch_size[0] * o.patch_size[1] * o.patch_size[2]));
  scale_shift_table_ = register_parameter("scale_shift_table", torch::zeros({1, 2, D}));
}

void WanTransformer3DModelImpl::to_dtype(torch::Dtype dtype) {
  to(dtype);
  if (dtype == torch::kFloat32) return;
  // _keep_in_fp32_modules: "rope", "time_embedder", "scale_shift_table", "norm1", "norm2",
  // "norm3" (matched as substrings of the parameter names, as from_pretrained does).
  for (auto& p : named_parameters()) {
    if (wan_keeps_in_fp32(p.key())) {
      torch::NoGradGuard no_grad;
      p.value().set_data(p.value().to(torch::kFloat32));
    }
  }
}

bool wan_keeps_in_fp32(const std::string& name) {
  for (const char* keep :
       {"time_embedder", "scale_shift_table", "norm1", "norm2", "norm3", "rope"}) {
    if (name.find(keep) != std::string::npos) return true;
  }
  return false;
}

torch::Tensor WanTransformer3DModelImpl::forward(const torch::Tensor& hidden_states,
                                                 const torch::Tensor& timestep,
                                                 const torch::Tensor& encoder_hidden_states,
                                                 const torch::Tensor& encoder_hidden_states_image) {
  core::ForwardScope scope(*this);
  const auto& o = options_;
  const std::string me = "WanTransformer3DModel: ";
  const auto [pt, ph, pw] = o.patch_size;
  if (!(hidden_states.dim() == 5 && hidden_states.size(1) == o.in_channels &&
        hidden_states.size(2) % pt == 0 && hidden_states.size(3) % ph == 0 &&
        hidden_states.size(4) % pw == 0)) {
    throw Error(c10::str(me, "hidden_states must be [B, ", o.in_channels,
                         ", F, H, W] with F, H, W multiples of the patch (", pt, ", ", ph, ", ", pw,
                         "), got ", hidden_states.sizes()));
  }
  const int64_t B = hidden_states.size(0);
  const int64_t F = hidden_states.size(2) / pt, H = hidden_states.size(3) / ph,
                W = hidden_states.size(4) / pw;
  const int64_t N = F * H * W, D = o.inner_dim();
  if (!(encoder_hidden_states.dim() == 3 && encoder_hidden_states.size(0) == B &&
        encoder_hidden_states.size(2) == o.text_dim)) {
    throw Error(c10::str(me, "encoder_hidden_states must be [", B, ", S, ", o.text_dim, "], got ",
                         encoder_hidden_states.sizes()));
  }
  const bool per_token = timestep.dim() == 2;
  if (!((timestep.dim() == 1 && timestep.size(0) == B) ||
        (per_token && timestep.size(0) == B && timestep.size(1) == N))) {
    throw Error(
        c10::str(me, "timestep must be [", B, "] or [", B, ", ", N, "], got ", timestep.sizes()));
  }
  if (o.image_dim.has_value() != encoder_hidden_states_image.defined()) {
    throw Error(me + (o.image_dim ? "this is an image-to-video model (image_dim set): "
                                    "encoder_hidden_states_image [B, 257, image_dim] is needed"
                                  : "encoder_hidden_states_image is given but the config has no "
                                    "image_dim (not an I2V model)"));
  }
  const auto dtype = this->dtype();
  // RoPE over (frame, row, column) of every patch.
  auto grid = torch::stack(
                  torch::meshgrid({torch::arange(F), torch::arange(H), torch::arange(W)}, "ij"), -1)
                  .reshape({N, 3});
  const auto rd = o.rope_dims();
  RotaryTables rope = rotary_tables(grid, {rd[0], rd[1], rd[2]});
  rope.cos = rope.cos.to(hidden_states.device());
  rope.sin = rope.sin.to(hidden_states.device());

  auto x = torch::conv3d(hidden_states.to(dtype), patch_weight_.to(dtype), patch_bias_.to(dtype),
                         /*stride=*/{pt, ph, pw});
  x = x.flatten(2).transpose(1, 2).contiguous();  // [B, N, D]

  // condition_embedder: Timesteps(freq_dim, flip_sin_to_cos) -> time_embedder (its dtype) ->
  // type_as(text) -> time_proj(silu).
  const auto flat_t = per_token ? timestep.reshape({-1}) : timestep;
  auto t_freq = timestep_embedding(flat_t, o.freq_dim, /*flip_sin_to_cos=*/true, 0.0);
  const auto te_dtype = time_embedder_->parameters().front().scalar_type();
  auto temb = time_embedder_(t_freq.to(te_dtype)).to(dtype);
  auto timestep_proj = time_proj_(torch::silu(temb));
  if (per_token) {
    temb = temb.view({B, N, D});
    timestep_proj = timestep_proj.view({B, N, 6, D});
  } else {
    timestep_proj = timestep_proj.view({B, 6, D});
  }
  auto context = text_linear_2_(
      models::gelu(text_linear_1_(encoder_hidden_states.to(dtype)), /*tanh_approximation=*/true));
  if (encoder_hidden_states_image.defined()) {
    auto img = encoder_hidden_states_image.to(dtype);
    if (img_pos_embed_.defined()) {
      img = img.view({-1, 2 * img.size(1), img.size(2)}) + img_pos_embed_.to(dtype);
    }
    img = fp32_layer_norm(img, img_norm1_weight_, img_norm1_bias_, 1e-5);
    img = img_ff_out_(models::gelu(img_ff_in_(img)));
    img = fp32_layer_norm(img, img_norm2_weight_, img_norm2_bias_, 1e-5);
    context = torch::cat({img, context}, 1);
  }

  const bool ckpt = gradient_checkpointing_ && is_training() && torch::GradMode::is_enabled();
  BlockSwap* swap = block_swap_.get();
  size_t index = 0;
  for (auto& block : blocks_) {
    // The text enters every block's cross-attention: its gradient (when it has one) needs the
    // block's weights too.
    if (swap) {
      const auto in = swap->enter(index, {x, context});
      x = in[0];
      context = in[1];
    }
    if (ckpt) {
      auto impl = block.ptr();
      x = checkpoint(
          [impl](const std::vector<torch::Tensor>& in) {
            return impl->forward(in[0], in[1], in[2], RotaryTables{in[3], in[4]});
          },
          {x, context, timestep_proj, rope.cos, rope.sin});
    } else {
      x = block->forward(x, context, timestep_proj, rope);
    }
    if (swap) x = swap->leave(index, {x})[0];
    ++index;
  }
  torch::Tensor shift, scale;
  const auto table = scale_shift_table_.to(torch::kFloat32);
  if (per_token) {  // [1, 1, 2, D] + [B, N, 1, D]
    const auto ss = (table.unsqueeze(0) + temb.to(torch::kFloat32).unsqueeze(2)).chunk(2, 2);
    shift = ss[0].squeeze(2);
    scale = ss[1].squeeze(2);
  } else {  // [1, 2, D] + [B, 1, D]
    const auto ss = (table + temb.to(torch::kFloat32).unsqueeze(1)).chunk(2, 1);
    shift = ss[0];
    scale = ss[1];
  }
  const auto normed =
      torch::layer_norm(x.to(torch::kFloat32), {D}, {}, {}, o.eps) * (1 + scale) + shift;
  auto out = proj_out_(normed.to(dtype));
  // [B, F, H, W, pt, ph, pw, C] -> [B, C, F pt, H ph, W pw]
  out = out.reshape({B, F, H, W, pt, ph, pw, -1})
            .permute({0, 7, 1, 4, 2, 5, 3, 6})
            .reshape({B, -1, F * pt, H * ph, W * pw});
  return scope.output(out);
}

WanTransformer3DModel load_wan_transformer(const std::string& dir, torch::Dtype dtype,
                                           const std::string& variant) {
  const std::string config =
      model_folder_config(dir,
                          "a Diffusers WanTransformer3DModel folder (config.json + "
                          "diffusion_pytorch_model*.safetensors, as save_pretrained writes it)");
  WanTransformer3DModel model(WanTransformerOptions::load(config));
  model->to_dtype(dtype);
  // The file's tensors as stored, each copied into its parameter's dtype: the float32 modules
  // keep a float32 checkpoint's values exactly.
  const io::WeightFiles files = io::find_weight_files(dir, "diffusion_pytorch_model", variant);
  load_weights(*model, io::load_weight_files(files, std::nullopt),
               files.index.empty() ? files.files.at(0) : files.index);
  return model;
}

void WanTransformer3DModelImpl::enable_block_swap(int64_t n) {
  block_swap_.reset();  // every weight back before another swap takes them
  block_swap_ = swap_last_blocks(blocks_, n);
}

}  // namespace difftrain::models
