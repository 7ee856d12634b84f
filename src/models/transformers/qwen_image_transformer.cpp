// Diffusers' QwenImageTransformer2DModel (qwen_image_transformer.h), as transformer_qwenimage.py
// computes it: img_in / txt_norm + txt_in, the sinusoidal timestep (scale 1000, cos first) through
// TimestepEmbedding, dual-stream blocks with per-stream modulation (shift, scale, gate) around a
// joint [text, image] attention, AdaLayerNormContinuous (scale first) and proj_out.

#include "difftrain/models/transformers/qwen_image_transformer.h"

#include "../json_fields.h"
#include "difftrain/core/error.h"
#include "difftrain/io/weight_index.h"
#include "difftrain/models/checkpointing.h"
#include "difftrain/models/pretrained.h"

#include <torch/torch.h>

#include <cmath>
#include <filesystem>

namespace difftrain::models {

namespace fs = std::filesystem;

namespace {

constexpr double kTheta = 10000.0;
constexpr double kEps = 1e-6;

// Angles of one axis at integer positions `pos`, as rope_params: outer(index, 1 / theta^(2j/d))
// in float32 (torch.pow(10000, float32) and the int64 x float32 outer product stay float32).
torch::Tensor axis_angles(const torch::Tensor& pos, int64_t d) {
  const auto exponent = torch::arange(0, d, 2, torch::kInt64).to(torch::kFloat32) / double(d);
  const auto inv = 1.0 / torch::pow(kTheta, exponent);
  return torch::outer(pos.to(torch::kFloat32), inv);
}

// Positions centred as scale_rope does: [-(n - n/2), ..., -1, 0, ..., n/2 - 1].
torch::Tensor centred(int64_t n) { return torch::arange(-(n - n / 2), n / 2, torch::kInt64); }

RotaryTables tables_of(const torch::Tensor& angles) {
  return {angles.cos().repeat_interleave(2, 1), angles.sin().repeat_interleave(2, 1)};
}

}  // namespace

std::pair<RotaryTables, RotaryTables> qwen_image_rope(const QwenImageGrids& grids, int64_t text_len,
                                                      const std::vector<int64_t>& axes_dims,
                                                      bool layer3d) {
  TORCH_CHECK(axes_dims.size() == 3, "Qwen-Image RoPE has 3 axes, got ", axes_dims.size());
  std::vector<torch::Tensor> parts;
  int64_t max_index = 0;
  const auto last = static_cast<int64_t>(grids.size()) - 1;
  for (int64_t idx = 0; idx <= last; ++idx) {
    const auto [f, h, w] = grids[static_cast<size_t>(idx)];
    // The frame axis counts images (a reference image is frame 1, 2, ...); Layered's condition
    // image, the last one, sits at frame -1.
    const auto frames = layer3d && idx == last ? torch::full({f}, -1, torch::kInt64)
                                               : torch::arange(idx, idx + f, torch::kInt64);
    const auto af = axis_angles(frames, axes_dims[0]).view({f, 1, 1, -1}).expand({f, h, w, -1});
    const auto ah = axis_angles(centred(h), axes_dims[1]).view({1, h, 1, -1}).expand({f, h, w, -1});
    const auto aw = axis_angles(centred(w), axes_dims[2]).view({1, 1, w, -1}).expand({f, h, w, -1});
    parts.push_back(torch::cat({af, ah, aw}, -1).reshape({f * h * w, -1}));
    max_index = std::max({max_index, h / 2, w / 2});
  }
  if (layer3d) max_index = std::max(max_index, last);
  // Text tokens: the same position on every axis, after the image's largest half-extent.
  const auto tpos = torch::arange(max_index, max_index + text_len, torch::kInt64);
  std::vector<torch::Tensor> text;
  for (const int64_t d : axes_dims) text.push_back(axis_angles(tpos, d));
  return {tables_of(torch::cat(parts, 0)), tables_of(torch::cat(text, -1))};
}

QwenImageTransformerOptions QwenImageTransformerOptions::parse(const nlohmann::json& j,
                                                               const std::string& source) {
  if (!j.is_object()) {
    throw Error(source + ": expected a JSON object (a QwenImageTransformer2DModel config)");
  }
  const detail::JsonFields r(j, source);
  QwenImageTransformerOptions o;
  o.patch_size = r.integer_at_least("patch_size", o.patch_size, 1);
  o.in_channels = r.integer_at_least("in_channels", o.in_channels, 1);
  o.out_channels = r.opt_integer("out_channels", o.out_channels);
  o.num_layers = r.integer_at_least("num_layers", o.num_layers, 0);
  o.attention_head_dim = r.integer_at_least("attention_head_dim", o.attention_head_dim, 2);
  o.num_attention_heads = r.integer_at_least("num_attention_heads", o.num_attention_heads, 1);
  o.joint_attention_dim = r.integer_at_least("joint_attention_dim", o.joint_attention_dim, 1);
  o.zero_cond_t = r.boolean("zero_cond_t", false);
  o.use_additional_t_cond = r.boolean("use_additional_t_cond", false);
  o.use_layer3d_rope = r.boolean("use_layer3d_rope", false);
  if (r.boolean("guidance_embeds", false)) {
    r.fail("guidance_embeds",
           "is true: no released Qwen-Image model embeds guidance (Diffusers' forward cannot "
           "run such a config either); set it to false");
  }
  if (r.has("axes_dims_rope")) {
    const auto& v = r.at("axes_dims_rope");
    if (!v.is_array() || v.size() != 3) r.fail("axes_dims_rope", "must be a list of 3 integers");
    o.axes_dims_rope.clear();
    for (const auto& e : v) {
      if (!e.is_number_integer() || e.get<int64_t>() < 2 || e.get<int64_t>() % 2 != 0) {
        r.fail("axes_dims_rope", "must be 3 even integers >= 2, got " + v.dump());
      }
      o.axes_dims_rope.push_back(e.get<int64_t>());
    }
  }
  if (o.out_channels && *o.out_channels < 1) r.fail("out_channels", "must be >= 1");
  const int64_t sum = o.axes_dims_rope[0] + o.axes_dims_rope[1] + o.axes_dims_rope[2];
  if (sum != o.attention_head_dim) {
    r.fail("axes_dims_rope", "must sum to attention_head_dim " +
                                 std::to_string(o.attention_head_dim) + ", they sum to " +
                                 std::to_string(sum));
  }
  return o;
}

QwenImageTransformerOptions QwenImageTransformerOptions::load(const std::string& path) {
  return parse(detail::parse_json_file(path, "a Diffusers QwenImageTransformer2DModel config.json"),
               path);
}

// ------------------------------------------------------------------ block

QwenImageTransformerBlockImpl::QwenImageTransformerBlockImpl(int64_t dim, int64_t heads,
                                                             int64_t head_dim, bool zero_cond_t)
    : zero_cond_t_(zero_cond_t) {
  // img_mod / txt_mod are Sequential(SiLU, Linear): the Linear is ".1".
  auto img_mod = register_module("img_mod", std::make_shared<torch::nn::Module>());
  img_mod_ = img_mod->register_module("1", Linear(dim, 6 * dim));
  attn_ = register_module("attn", DiTAttention(dim, heads, head_dim, /*joint=*/true, kEps));
  img_mlp_ = register_module("img_mlp", FeedForward(dim, "gelu-approximate", 4));
  auto txt_mod = register_module("txt_mod", std::make_shared<torch::nn::Module>());
  txt_mod_ = txt_mod->register_module("1", Linear(dim, 6 * dim));
  txt_mlp_ = register_module("txt_mlp", FeedForward(dim, "gelu-approximate", 4));
}

namespace {

// LayerNorm (no affine, eps 1e-6) · (1 + scale) + shift, with shift/scale/gate per sample [B, D]
// or, under zero_cond_t, chosen per token by `index` from the two halves of a [2B, D] table.
std::pair<torch::Tensor, torch::Tensor> modulated(const torch::Tensor& x, const torch::Tensor& mod,
                                                  const torch::Tensor& index) {
  const auto n = torch::layer_norm(x, {x.size(-1)}, {}, {}, kEps);
  auto p = mod.chunk(3, -1);  // shift, scale, gate
  for (auto& t : p) {
    if (index.defined()) {
      const int64_t B = t.size(0) / 2;
      t = torch::where(index.unsqueeze(-1) == 0, t.narrow(0, 0, B).unsqueeze(1),
                       t.narrow(0, B, B).unsqueeze(1));
    } else {
      t = t.unsqueeze(1);
    }
  }
  return {n * (1 + p[1]) + p[0], p[2]};
}

}  // namespace

std::pair<torch::Tensor, torch::Tensor> QwenImageTransformerBlockImpl::forward(
    const torch::Tensor& img, const torch::Tensor& txt, const torch::Tensor& temb,
    const RotaryTables& rope, const torch::Tensor& key_mask, const torch::Tensor& modulate_index) {
  core::ForwardScope scope(*this);
  const auto img_mod = img_mod_(torch::silu(temb)).chunk(2, -1);
  const auto txt_temb = zero_cond_t_ ? temb.narrow(0, 0, temb.size(0) / 2) : temb;
  const auto txt_mod = txt_mod_(torch::silu(txt_temb)).chunk(2, -1);
  auto [img_in, img_gate1] = modulated(img, img_mod[0], modulate_index);
  auto [txt_in, txt_gate1] = modulated(txt, txt_mod[0], {});
  auto [a_img, a_txt] = attn_(img_in, txt_in, rope, key_mask);
  torch::Tensor h = img + img_gate1 * a_img;
  torch::Tensor e = txt + txt_gate1 * a_txt;
  auto [img_in2, img_gate2] = modulated(h, img_mod[1], modulate_index);
  h = h + img_gate2 * img_mlp_(img_in2);
  auto [txt_in2, txt_gate2] = modulated(e, txt_mod[1], {});
  e = e + txt_gate2 * txt_mlp_(txt_in2);
  if (e.scalar_type() == torch::kFloat16) e = e.clamp(-65504, 65504);
  if (h.scalar_type() == torch::kFloat16) h = h.clamp(-65504, 65504);
  auto outs = scope.outputs({h, e});
  return {outs[0], outs[1]};
}

// ------------------------------------------------------------------ model

QwenImageTransformer2DModelImpl::QwenImageTransformer2DModelImpl(
    const QwenImageTransformerOptions& o)
    : options_(o) {
  const int64_t D = o.inner_dim();
  auto tte = register_module("time_text_embed", std::make_shared<torch::nn::Module>());
  timestep_embedder_ = tte->register_module("timestep_embedder", TimestepEmbedding(256, D));
  if (o.use_additional_t_cond) {
    addition_t_embedding_ =
        tte->register_module("addition_t_embedding", torch::nn::Embedding(2, D));
  }
  txt_norm_ = register_module("txt_norm", RMSNorm(o.joint_attention_dim, kEps));
  img_in_ = register_module("img_in", Linear(o.in_channels, D));
  txt_in_ = register_module("txt_in", Linear(o.joint_attention_dim, D));
  auto list = register_module("transformer_blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.num_layers; ++i) {
    blocks_.push_back(
        QwenImageTransformerBlock(D, o.num_attention_heads, o.attention_head_dim, o.zero_cond_t));
    list->push_back(blocks_.back());
  }
  auto norm_out = register_module("norm_out", std::make_shared<torch::nn::Module>());
  norm_out_linear_ = norm_out->register_module("linear", Linear(D, 2 * D));
  proj_out_ =
      register_module("proj_out", Linear(D, o.patch_size * o.patch_size * o.output_channels()));
}

torch::Tensor QwenImageTransformer2DModelImpl::forward(
    const torch::Tensor& hidden_states, const torch::Tensor& encoder_hidden_states,
    const torch::Tensor& encoder_hidden_states_mask, const torch::Tensor& timestep,
    const std::vector<QwenImageGrids>& img_shapes, const torch::Tensor& additional_t_cond) {
  core::ForwardScope scope(*this);
  const auto& o = options_;
  const std::string me = "QwenImageTransformer2DModel: ";
  if (!(hidden_states.dim() == 3 && hidden_states.size(2) == o.in_channels)) {
    throw Error(c10::str(me, "hidden_states must be [B, N, ", o.in_channels, "], got ",
                         hidden_states.sizes()));
  }
  const int64_t B = hidden_states.size(0), N = hidden_states.size(1);
  if (!(encoder_hidden_states.dim() == 3 && encoder_hidden_states.size(0) == B &&
        encoder_hidden_states.size(2) == o.joint_attention_dim)) {
    throw Error(c10::str(me, "encoder_hidden_states must be [", B, ", S, ", o.joint_attention_dim,
                         "], got ", encoder_hidden_states.sizes()));
  }
  const int64_t S = encoder_hidden_states.size(1);
  if (encoder_hidden_states_mask.defined() &&
      !(encoder_hidden_states_mask.dim() == 2 && encoder_hidden_states_mask.size(0) == B &&
        encoder_hidden_states_mask.size(1) == S)) {
    throw Error(c10::str(me, "encoder_hidden_states_mask must be [", B, ", ", S, "], got ",
                         encoder_hidden_states_mask.sizes()));
  }
  if (!(timestep.dim() == 1 && timestep.size(0) == B)) {
    throw Error(c10::str(me, "timestep must be [", B, "], got ", timestep.sizes()));
  }
  if (static_cast<int64_t>(img_shapes.size()) != B) {
    throw Error(c10::str(me, "img_shapes has ", img_shapes.size(), " entries for a batch of ", B));
  }
  for (int64_t b = 0; b < B; ++b) {
    int64_t n = 0;
    for (const auto& g : img_shapes[static_cast<size_t>(b)]) {
      if (g[0] < 1 || g[1] < 1 || g[2] < 1) {
        throw Error(c10::str(me, "img_shapes[", b, "] has an empty grid"));
      }
      n += g[0] * g[1] * g[2];
    }
    if (img_shapes[static_cast<size_t>(b)].empty() || n != N) {
      throw Error(c10::str(me, "img_shapes[", b, "] covers ", n, " tokens but hidden_states has ",
                           N, " (each (frame, height, width) in 2x2 patches, target first)"));
    }
  }
  if (o.use_additional_t_cond != additional_t_cond.defined()) {
    throw Error(me + (o.use_additional_t_cond
                          ? "this config sets use_additional_t_cond, so additional_t_cond "
                            "(int64 [B], 0 or 1) is needed"
                          : "additional_t_cond is given but the config does not set "
                            "use_additional_t_cond"));
  }
  const auto dtype = this->dtype();
  torch::Tensor img = img_in_(hidden_states.to(dtype));

  // The timestep in the model's dtype; Timesteps rounds its frequencies to that dtype too.
  torch::Tensor t = timestep.to(dtype);
  torch::Tensor modulate_index;
  if (o.zero_cond_t) {
    t = torch::cat({t, t * 0});
    modulate_index = torch::ones({B, N}, torch::kInt32);
    for (int64_t b = 0; b < B; ++b) {
      const auto& g = img_shapes[static_cast<size_t>(b)][0];
      modulate_index[b].narrow(0, 0, g[0] * g[1] * g[2]).zero_();
    }
  }
  const int64_t half = 128;
  auto freqs = torch::exp(-std::log(10000.0) * torch::arange(0, half, torch::kFloat32) / half);
  freqs = freqs.to(t.scalar_type()).to(torch::kFloat32);
  auto args = 1000.0 * (t.to(torch::kFloat32).unsqueeze(1) * freqs.unsqueeze(0));
  const auto t_proj = torch::cat({torch::cos(args), torch::sin(args)}, -1);
  torch::Tensor temb = timestep_embedder_(t_proj.to(dtype));
  if (o.use_additional_t_cond) {
    temb = temb + addition_t_embedding_(additional_t_cond.to(torch::kInt64)).to(dtype);
  }

  torch::Tensor txt = txt_in_(txt_norm_(encoder_hidden_states.to(dtype)));
  torch::Tensor key_mask;
  if (encoder_hidden_states_mask.defined() &&
      !encoder_hidden_states_mask.to(torch::kBool).all().item<bool>()) {
    key_mask = torch::cat(
        {encoder_hidden_states_mask.to(torch::kBool), torch::ones({B, N}, torch::kBool)}, 1);
  }
  const auto [img_rope, txt_rope] =
      qwen_image_rope(img_shapes[0], S, o.axes_dims_rope, o.use_layer3d_rope);
  const RotaryTables rope{torch::cat({txt_rope.cos, img_rope.cos}),
                          torch::cat({txt_rope.sin, img_rope.sin})};

  const bool ckpt = gradient_checkpointing_ && is_training() && torch::GradMode::is_enabled();
  BlockSwap* swap = block_swap_.get();
  size_t index = 0;
  for (auto& block : blocks_) {
    if (swap) {
      const auto in = swap->enter(index, {img, txt});
      img = in[0];
      txt = in[1];
    }
    if (ckpt) {
      auto impl = block.ptr();  // captured by value: backward may run after this frame is gone
      const torch::Tensor both = checkpoint(
          [impl](const std::vector<torch::Tensor>& in) {
            auto [h, e] =
                impl->forward(in[0], in[1], in[2], RotaryTables{in[3], in[4]}, in[5], in[6]);
            return torch::cat({e, h}, 1);
          },
          {img, txt, temb, rope.cos, rope.sin, key_mask, modulate_index});
      txt = both.narrow(1, 0, S);
      img = both.narrow(1, S, N);
    } else {
      std::tie(img, txt) = block->forward(img, txt, temb, rope, key_mask, modulate_index);
    }
    if (swap) {
      const auto out = swap->leave(index, {img, txt});
      img = out[0];
      txt = out[1];
    }
    ++index;
  }
  if (o.zero_cond_t) temb = temb.narrow(0, 0, B);
  const auto ss = norm_out_linear_(torch::silu(temb)).chunk(2, -1);  // scale, shift
  const auto n = torch::layer_norm(img, {img.size(-1)}, {}, {}, kEps) * (1 + ss[0].unsqueeze(1)) +
                 ss[1].unsqueeze(1);
  return scope.output(proj_out_(n));
}

QwenImageTransformer2DModel load_qwen_image_transformer(const std::string& dir, torch::Dtype dtype,
                                                        const std::string& variant) {
  const std::string config =
      model_folder_config(dir,
                          "a Diffusers QwenImageTransformer2DModel folder (config.json + "
                          "diffusion_pytorch_model*.safetensors, as save_pretrained writes it)");
  QwenImageTransformer2DModel model(QwenImageTransformerOptions::load(config));
  model->to(dtype);
  load_model_folder_weights(*model, dir, dtype, variant);
  return model;
}

void QwenImageTransformer2DModelImpl::enable_block_swap(int64_t n) {
  block_swap_.reset();  // every weight back before another swap takes them
  block_swap_ = swap_last_blocks(blocks_, n);
}

}  // namespace difftrain::models
