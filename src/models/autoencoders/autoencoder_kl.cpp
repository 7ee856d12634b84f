#include "difftrain/models/autoencoders/autoencoder_kl.h"

#include "../json_fields.h"
#include "difftrain/core/cpu_convolution_check.h"
#include "difftrain/core/error.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/kernels/fused_ops.h"
#include "difftrain/models/pretrained.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>

namespace difftrain::models {

namespace fs = std::filesystem;

namespace {

const std::vector<std::string> kActivations = {"silu", "swish", "mish", "gelu", "relu"};

// What every VAE block shares: no time embedding, eps 1e-6 (Diffusers' Encoder/Decoder).
BlockOptions vae_block(const AutoencoderKLConfig& c, const std::string& type) {
  BlockOptions o;
  o.type = type;
  o.temb_channels = 0;
  o.eps = 1e-6;
  o.act_fn = c.act_fn;
  o.groups = c.norm_num_groups;
  o.output_scale_factor = 1.0;
  o.time_scale_shift = "default";
  return o;
}

// Diffusers' UNetMidBlock2D as the Encoder and Decoder build it: one attention layer with a single
// head over all channels, its own group norm, residual, bias and an fp32 softmax.
MidBlock vae_mid_block(const AutoencoderKLConfig& c) {
  BlockOptions o = vae_block(c, "UNetMidBlock2D");
  const int64_t ch = c.block_out_channels.back();
  o.num_layers = 1;
  o.in_channels = ch;
  o.out_channels = ch;
  o.attention_head_dim = ch;
  o.attn_groups = c.norm_num_groups;
  o.add_attention = c.mid_block_add_attention;
  return MidBlock(o);
}

torch::nn::GroupNorm vae_norm_out(const AutoencoderKLConfig& c, int64_t channels) {
  return torch::nn::GroupNorm(
      torch::nn::GroupNormOptions(c.norm_num_groups, channels).eps(1e-6).affine(true));
}

Conv2d conv3x3(int64_t in, int64_t out) {
  return Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1));
}

}  // namespace

// ------------------------------------------------------------------ config

AutoencoderKLConfig read_autoencoder_kl_config(const std::string& path) {
  return parse_autoencoder_kl_config(io::read_file(path), path);
}

AutoencoderKLConfig parse_autoencoder_kl_config(const std::string& json_text,
                                                const std::string& path) {
  const nlohmann::json j =
      detail::parse_json_text(json_text, path, "a Diffusers AutoencoderKL config.json");
  if (!j.is_object()) throw Error(path + ": an AutoencoderKL config must be a JSON object");
  detail::JsonFields r(j, path);
  AutoencoderKLConfig c;
  c.source = path;
  r.choice("_class_name", "AutoencoderKL", {"AutoencoderKL"});
  c.in_channels = r.integer_at_least("in_channels", c.in_channels, 1);
  c.out_channels = r.integer_at_least("out_channels", c.out_channels, 1);
  c.down_block_types = r.strings("down_block_types", c.down_block_types);
  c.up_block_types = r.strings("up_block_types", c.up_block_types);
  c.block_out_channels = r.integers("block_out_channels", c.block_out_channels);
  const size_t n = c.block_out_channels.size();
  if (n == 0) r.fail("block_out_channels", "must not be empty");
  for (const auto& t : c.down_block_types) {
    if (t != "DownEncoderBlock2D") {
      r.fail("down_block_types", "has \"" + t + "\"; supported: DownEncoderBlock2D");
    }
  }
  for (const auto& t : c.up_block_types) {
    if (t != "UpDecoderBlock2D") {
      r.fail("up_block_types", "has \"" + t + "\"; supported: UpDecoderBlock2D");
    }
  }
  if (c.down_block_types.size() != n) {
    r.fail("down_block_types", "must have one entry per block_out_channels entry (" +
                                   std::to_string(n) + "), got " +
                                   std::to_string(c.down_block_types.size()));
  }
  if (c.up_block_types.size() != n) {
    r.fail("up_block_types", "must have one entry per block_out_channels entry (" +
                                 std::to_string(n) + "), got " +
                                 std::to_string(c.up_block_types.size()));
  }
  c.layers_per_block = r.integer_at_least("layers_per_block", c.layers_per_block, 1);
  c.act_fn = r.choice("act_fn", c.act_fn, kActivations);
  c.latent_channels = r.integer_at_least("latent_channels", c.latent_channels, 1);
  c.norm_num_groups = r.integer_at_least("norm_num_groups", c.norm_num_groups, 1);
  for (int64_t ch : c.block_out_channels) {
    if (ch <= 0) r.fail("block_out_channels", "must be positive, got " + std::to_string(ch));
    if (ch % c.norm_num_groups != 0) {
      r.fail("norm_num_groups", "(" + std::to_string(c.norm_num_groups) +
                                    ") must divide every block_out_channels entry (" +
                                    std::to_string(ch) + ")");
    }
  }
  if (r.has("sample_size")) {
    const nlohmann::json& v = j.at("sample_size");
    // Some configs give [height, width]; the VAE's arithmetic does not depend on it.
    c.sample_size =
        v.is_array() && !v.empty() ? r.as_int("sample_size", v.at(0)) : r.as_int("sample_size", v);
  }
  c.scaling_factor = r.number("scaling_factor", c.scaling_factor);
  if (c.scaling_factor == 0) r.fail("scaling_factor", "must not be 0");
  c.shift_factor = r.opt_number("shift_factor");
  c.use_quant_conv = r.boolean("use_quant_conv", c.use_quant_conv);
  c.use_post_quant_conv = r.boolean("use_post_quant_conv", c.use_post_quant_conv);
  c.mid_block_add_attention = r.boolean("mid_block_add_attention", c.mid_block_add_attention);
  c.force_upcast = r.boolean("force_upcast", c.force_upcast);
  return c;
}

// ------------------------------------------------------------------ posterior

DiagonalGaussian DiagonalGaussian::from_moments(const torch::Tensor& moments) {
  TORCH_CHECK((moments.dim() == 4 || moments.dim() == 5) && moments.size(1) % 2 == 0,
              "DiagonalGaussian: moments must be [B, 2 * latent_channels, (t,) h, w], got ",
              moments.sizes());
  auto parts = moments.chunk(2, 1);
  DiagonalGaussian g;
  g.mean = parts[0];
  g.logvar = parts[1].clamp(-30.0, 20.0);
  g.std = torch::exp(0.5 * g.logvar);
  return g;
}

torch::Tensor DiagonalGaussian::sample(at::Generator generator) const {
  // As Diffusers' randn_tensor with a CPU generator: draw on the CPU, then move.
  torch::Tensor noise = at::randn(
      mean.sizes(), generator, torch::TensorOptions().dtype(torch::kFloat32).device(torch::kCPU));
  return mean + std * noise.to(mean.device(), mean.scalar_type());
}

// ------------------------------------------------------------------ encoder

VaeEncoderImpl::VaeEncoderImpl(const AutoencoderKLConfig& c) {
  const auto& ch = c.block_out_channels;
  conv_in_ = register_module("conv_in", conv3x3(c.in_channels, ch[0]));
  auto down_blocks = register_module("down_blocks", torch::nn::ModuleList());
  int64_t out = ch[0];
  for (size_t i = 0; i < ch.size(); ++i) {
    const int64_t in = out;
    out = ch[i];
    BlockOptions o = vae_block(c, c.down_block_types[i]);
    o.num_layers = c.layers_per_block;
    o.in_channels = in;
    o.out_channels = out;
    o.add_resample = i + 1 < ch.size();
    o.downsample_padding = 0;  // the stride-2 conv pads right/bottom only
    o.attention_head_dim = out;
    down_blocks_.push_back(DownBlock(o));
    down_blocks->push_back(down_blocks_.back());
  }
  mid_block_ = register_module("mid_block", vae_mid_block(c));
  conv_norm_out_ = register_module("conv_norm_out", vae_norm_out(c, ch.back()));
  conv_out_ = register_module("conv_out", conv3x3(ch.back(), 2 * c.latent_channels));
}

torch::Tensor VaeEncoderImpl::forward(const torch::Tensor& x) {
  // x: [B, in_channels, H, W] -> [B, 2 * latent_channels, H / f, W / f]
  TORCH_CHECK(x.dim() == 4, "VAE encoder: x must be [B, C, H, W], got ", x.sizes());
  torch::Tensor h = conv_in_(x);
  const BlockInputs none;
  for (auto& block : down_blocks_) h = block(h, none).first;
  h = mid_block_(h, none);
  // Diffusers' Encoder/Decoder use SiLU here whatever act_fn says (it applies to the resnets).
  return conv_out_(group_norm_act(*conv_norm_out_, "silu", h));
}

// ------------------------------------------------------------------ decoder

VaeDecoderImpl::VaeDecoderImpl(const AutoencoderKLConfig& c) {
  const std::vector<int64_t> rev(c.block_out_channels.rbegin(), c.block_out_channels.rend());
  conv_in_ = register_module("conv_in", conv3x3(c.latent_channels, rev[0]));
  mid_block_ = register_module("mid_block", vae_mid_block(c));
  auto up_blocks = register_module("up_blocks", torch::nn::ModuleList());
  int64_t out = rev[0];
  for (size_t i = 0; i < rev.size(); ++i) {
    const int64_t prev = out;
    out = rev[i];
    BlockOptions o = vae_block(c, c.up_block_types[i]);
    o.num_layers = c.layers_per_block + 1;
    o.in_channels = prev;
    o.prev_output_channel = prev;
    o.out_channels = out;
    o.add_resample = i + 1 < rev.size();
    o.attention_head_dim = out;
    up_blocks_.push_back(UpBlock(o));
    up_blocks->push_back(up_blocks_.back());
  }
  conv_norm_out_ = register_module("conv_norm_out", vae_norm_out(c, rev.back()));
  conv_out_ = register_module("conv_out", conv3x3(rev.back(), c.out_channels));
}

torch::Tensor VaeDecoderImpl::forward(const torch::Tensor& z) {
  // z: [B, latent_channels, h, w] -> [B, out_channels, h * f, w * f]
  TORCH_CHECK(z.dim() == 4, "VAE decoder: z must be [B, C, h, w], got ", z.sizes());
  torch::Tensor h = conv_in_(z);
  const BlockInputs none;
  h = mid_block_(h, none);
  // Diffusers runs the up blocks in their parameters' dtype (upcast VAEs keep them fp32).
  h = h.to(conv_out_->weight.scalar_type());
  std::vector<torch::Tensor> no_skips;
  for (auto& block : up_blocks_) h = block->forward(h, no_skips, none, {});
  return conv_out_(group_norm_act(*conv_norm_out_, "silu", h));
}

// ------------------------------------------------------------------ AutoencoderKL

AutoencoderKLImpl::AutoencoderKLImpl(const AutoencoderKLConfig& config) : config_(config) {
  core::ensure_correct_cpu_convolutions();
  const auto& c = config;
  TORCH_CHECK(!c.block_out_channels.empty() &&
                  c.down_block_types.size() == c.block_out_channels.size() &&
                  c.up_block_types.size() == c.block_out_channels.size(),
              "AutoencoderKL: down_block_types, up_block_types and block_out_channels must have "
              "the same, non-zero length");
  encoder_ = register_module("encoder", VaeEncoder(c));
  decoder_ = register_module("decoder", VaeDecoder(c));
  if (c.use_quant_conv) {
    quant_conv_ = register_module(
        "quant_conv",
        Conv2d(torch::nn::Conv2dOptions(2 * c.latent_channels, 2 * c.latent_channels, 1)));
  }
  if (c.use_post_quant_conv) {
    post_quant_conv_ =
        register_module("post_quant_conv",
                        Conv2d(torch::nn::Conv2dOptions(c.latent_channels, c.latent_channels, 1)));
  }
}

DiagonalGaussian AutoencoderKLImpl::encode(const torch::Tensor& x) {
  // x: [B, in_channels, H, W] -> posterior over [B, latent_channels, H / f, W / f]
  if (x.dim() == 5) {
    throw Error(fmt::format(
        "AutoencoderKL encodes images [B, C, H, W], and these pixels are clips [{}] (video files "
        "among the training data): this model family trains on images; give it image files",
        fmt::join(x.sizes(), ", ")));
  }
  TORCH_CHECK(x.dim() == 4 && x.size(1) == config_.in_channels,
              "AutoencoderKL.encode: x must be [B, ", config_.in_channels, ", H, W], got ",
              x.sizes());
  const int64_t f = config_.downsample_factor();
  TORCH_CHECK(x.size(2) % f == 0 && x.size(3) % f == 0, "AutoencoderKL.encode: height and width (",
              x.size(2), "x", x.size(3), ") must be multiples of the downsample factor ", f);
  torch::Tensor moments = encoder_(x);
  if (!quant_conv_.is_empty()) moments = quant_conv_(moments);
  return DiagonalGaussian::from_moments(moments);
}

torch::Tensor AutoencoderKLImpl::decode(const torch::Tensor& z) {
  // z: [B, latent_channels, h, w] -> [B, out_channels, h * f, w * f]
  TORCH_CHECK(z.dim() == 4 && z.size(1) == config_.latent_channels,
              "AutoencoderKL.decode: z must be [B, ", config_.latent_channels, ", h, w], got ",
              z.sizes());
  torch::Tensor h = post_quant_conv_.is_empty() ? z : post_quant_conv_(z);
  return decoder_(h);
}

torch::Tensor AutoencoderKLImpl::scale_latents(const torch::Tensor& z) const {
  const torch::Tensor shifted = config_.shift_factor ? z - *config_.shift_factor : z;
  return shifted * config_.scaling_factor;
}

torch::Tensor AutoencoderKLImpl::unscale_latents(const torch::Tensor& latents) const {
  const torch::Tensor z = latents / config_.scaling_factor;
  return config_.shift_factor ? z + *config_.shift_factor : z;
}

AutoencoderKL load_autoencoder_kl(const std::string& dir, const std::string& variant) {
  if (!fs::is_directory(dir)) {
    throw Error(dir +
                ": not a folder; expected a Diffusers AutoencoderKL folder (config.json + "
                "diffusion_pytorch_model.safetensors), e.g. a pipeline's vae/");
  }
  AutoencoderKLConfig config = read_autoencoder_kl_config((fs::path(dir) / "config.json").string());
  AutoencoderKL vae(config);
  const std::string path = weights_path(dir, variant);
  io::Safetensors file = io::load_safetensors(path);
  load_weights(*vae, file.tensors, path);
  return vae;
}

}  // namespace difftrain::models
