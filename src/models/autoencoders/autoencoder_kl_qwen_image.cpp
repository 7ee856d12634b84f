// AutoencoderKLQwenImage (autoencoder_kl_qwen_image.h), as autoencoder_kl_qwenimage.py computes it,
// feature cache included: every causal convolution with a temporal kernel keeps the last (up to 2)
// frames of its input from the previous chunk and prepends them instead of zero padding.

#include "difftrain/models/autoencoders/autoencoder_kl_qwen_image.h"

#include "../json_fields.h"
#include "difftrain/core/error.h"
#include "difftrain/io/weight_index.h"
#include "difftrain/models/attention.h"
#include "difftrain/models/pretrained.h"

#include <torch/torch.h>

#include <array>
#include <filesystem>

namespace difftrain::models {

namespace fs = std::filesystem;

// Named rather than anonymous: the model's Parts hold these types.
namespace qwen_vae {

constexpr int64_t kCacheT = 2;  // CACHE_T

// One cache slot per causal convolution, in call order. `rep` marks an upsample3d that has seen
// its first chunk (Diffusers' "Rep").
struct Slot {
  bool set = false;
  bool rep = false;
  torch::Tensor x;
};
struct Cache {
  std::vector<Slot> slots;
  size_t idx = 0;
  Slot& next() {
    if (idx >= slots.size()) slots.resize(idx + 1);
    return slots[idx++];
  }
};

// The frames to keep for the next chunk: the last 2, or the last 1 with the previous chunk's last
// frame before it.
torch::Tensor cache_frames(const torch::Tensor& x, const Slot& slot) {
  torch::Tensor c =
      x.narrow(2, x.size(2) - std::min(kCacheT, x.size(2)), std::min(kCacheT, x.size(2))).clone();
  if (c.size(2) < 2 && slot.set && !slot.rep && slot.x.defined()) {
    c = torch::cat({slot.x.narrow(2, slot.x.size(2) - 1, 1), c}, 2);
  }
  return c;
}

class CausalConv3dImpl : public torch::nn::Module {
 public:
  CausalConv3dImpl(int64_t in, int64_t out, std::array<int64_t, 3> k,
                   std::array<int64_t, 3> stride = {1, 1, 1},
                   std::array<int64_t, 3> padding = {0, 0, 0})
      : stride_(stride), padding_(padding) {
    weight = register_parameter("weight", torch::empty({out, in, k[0], k[1], k[2]}));
    bias = register_parameter("bias", torch::zeros({out}));
  }
  // Pads (w, w, h, h, 2t before, 0 after); cached frames replace that much of the time padding.
  torch::Tensor forward(const torch::Tensor& x_in, const torch::Tensor& cache = {}) {
    torch::Tensor x = x_in;
    int64_t front = 2 * padding_[0];
    if (cache.defined() && front > 0) {
      x = torch::cat({cache.to(x.device()), x}, 2);
      front -= cache.size(2);
    }
    x = torch::constant_pad_nd(x, {padding_[2], padding_[2], padding_[1], padding_[1], front, 0});
    // Contiguous: LibTorch 1.13's slow conv3d (float64) misreads a strided view (a tile).
    return torch::conv3d(x.contiguous(), weight, bias, {stride_[0], stride_[1], stride_[2]});
  }
  torch::Tensor weight, bias;

 private:
  std::array<int64_t, 3> stride_, padding_;
};
TORCH_MODULE(CausalConv3d);

CausalConv3d causal(int64_t in, int64_t out, std::array<int64_t, 3> k,
                    std::array<int64_t, 3> stride = {1, 1, 1},
                    std::array<int64_t, 3> padding = {0, 0, 0}) {
  return CausalConv3d(in, out, k, stride, padding);
}

// A convolution fed through the cache, as the residual blocks and the encoder/decoder ends do.
torch::Tensor cached_conv(CausalConv3d& conv, const torch::Tensor& x, Cache& cache) {
  Slot& slot = cache.next();
  torch::Tensor keep = cache_frames(x, slot);
  torch::Tensor out = conv(x, slot.set ? slot.x : torch::Tensor());
  slot.set = true;
  slot.x = keep;
  return out;
}

// F.normalize over channels (x / max(||x||, 1e-12)) · sqrt(C) · gamma, in float32 for half types.
class RmsNormImpl : public torch::nn::Module {
 public:
  RmsNormImpl(int64_t dim, bool images) : scale_(std::sqrt(static_cast<double>(dim))) {
    gamma = register_parameter("gamma",
                               images ? torch::ones({dim, 1, 1}) : torch::ones({dim, 1, 1, 1}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const bool up = x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat16;
    const torch::Tensor xf = up ? x.to(torch::kFloat32) : x;
    const torch::Tensor n = (xf / xf.norm(2, {1}, true).clamp_min(1e-12)).to(x.scalar_type());
    return n * scale_ * gamma;
  }
  torch::Tensor gamma;

 private:
  double scale_;
};
TORCH_MODULE(RmsNorm);

class ResidualBlockImpl : public torch::nn::Module {
 public:
  ResidualBlockImpl(int64_t in, int64_t out) {
    norm1 = register_module("norm1", RmsNorm(in, false));
    conv1 = register_module("conv1", causal(in, out, {3, 3, 3}, {1, 1, 1}, {1, 1, 1}));
    norm2 = register_module("norm2", RmsNorm(out, false));
    conv2 = register_module("conv2", causal(out, out, {3, 3, 3}, {1, 1, 1}, {1, 1, 1}));
    if (in != out) {
      shortcut = register_module("conv_shortcut", causal(in, out, {1, 1, 1}));
    }
  }
  torch::Tensor forward(const torch::Tensor& x, Cache& cache) {
    const torch::Tensor h = shortcut.is_empty() ? x : shortcut(x);
    torch::Tensor y = cached_conv(conv1, torch::silu(norm1(x)), cache);
    y = cached_conv(conv2, torch::silu(norm2(y)), cache);
    return y + h;
  }
  RmsNorm norm1{nullptr}, norm2{nullptr};
  CausalConv3d conv1{nullptr}, conv2{nullptr}, shortcut{nullptr};
};
TORCH_MODULE(ResidualBlock);

// Single-head spatial self-attention, frame by frame.
class AttentionBlockImpl : public torch::nn::Module {
 public:
  explicit AttentionBlockImpl(int64_t dim) {
    norm = register_module("norm", RmsNorm(dim, true));
    to_qkv =
        register_module("to_qkv", torch::nn::Conv2d(torch::nn::Conv2dOptions(dim, 3 * dim, 1)));
    proj = register_module("proj", torch::nn::Conv2d(torch::nn::Conv2dOptions(dim, dim, 1)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t B = x.size(0), C = x.size(1), T = x.size(2), H = x.size(3), W = x.size(4);
    torch::Tensor h = x.permute({0, 2, 1, 3, 4}).reshape({B * T, C, H, W});
    const auto qkv = to_qkv(norm(h)).reshape({B * T, 3 * C, H * W}).permute({0, 2, 1});
    const auto parts = qkv.chunk(3, -1);  // [BT, HW, C] each
    // One head over the frame's pixels (chunked over queries: a 1024-px image has 16k of them).
    h = multi_head_attention(parts[0].contiguous(), parts[1].contiguous(), parts[2].contiguous(), 1,
                             /*upcast_attention=*/false, /*upcast_softmax=*/false);
    h = proj(h.permute({0, 2, 1}).reshape({B * T, C, H, W}));
    return h.view({B, T, C, H, W}).permute({0, 2, 1, 3, 4}) + x;
  }
  RmsNorm norm{nullptr};
  torch::nn::Conv2d to_qkv{nullptr}, proj{nullptr};
};
TORCH_MODULE(AttentionBlock);

enum class Mode { kNone, kUp2d, kUp3d, kDown2d, kDown3d };

class ResampleImpl : public torch::nn::Module {
 public:
  // `up_out`: an upsampler's output channels (Wan 2.1 / Qwen-Image: dim / 2; Wan 2.2's residual
  // decoder: dim).
  ResampleImpl(int64_t dim, Mode mode, int64_t up_out = 0) : mode_(mode) {
    auto seq = register_module("resample", std::make_shared<torch::nn::Module>());
    const bool up = mode == Mode::kUp2d || mode == Mode::kUp3d;
    conv = seq->register_module(
        "1", torch::nn::Conv2d(
                 torch::nn::Conv2dOptions(dim, up ? (up_out > 0 ? up_out : dim / 2) : dim, 3)
                     .padding(up ? 1 : 0)
                     .stride(up ? 1 : 2)));
    if (mode == Mode::kUp3d) {
      time_conv =
          register_module("time_conv", causal(dim, 2 * dim, {3, 1, 1}, {1, 1, 1}, {1, 0, 0}));
    } else if (mode == Mode::kDown3d) {
      time_conv = register_module("time_conv", causal(dim, dim, {3, 1, 1}, {2, 1, 1}));
    }
  }
  torch::Tensor forward(torch::Tensor x, Cache& cache) {
    const int64_t B = x.size(0), C = x.size(1), H = x.size(3), W = x.size(4);
    if (mode_ == Mode::kUp3d) {
      Slot& slot = cache.next();
      if (!slot.set) {
        slot.set = true;  // the first chunk (one frame) is not doubled in time
        slot.rep = true;
      } else {
        const int64_t T = x.size(2);
        torch::Tensor keep = x.narrow(2, T - std::min(kCacheT, T), std::min(kCacheT, T)).clone();
        if (keep.size(2) < 2 && !slot.rep) {
          keep = torch::cat({slot.x.narrow(2, slot.x.size(2) - 1, 1), keep}, 2);
        } else if (keep.size(2) < 2 && slot.rep) {
          keep = torch::cat({torch::zeros_like(keep), keep}, 2);
        }
        x = slot.rep ? time_conv(x) : time_conv(x, slot.x);
        slot.x = keep;
        slot.rep = false;
        // The two channel halves are consecutive frames.
        x = x.reshape({B, 2, C, T, H, W});
        x = torch::stack({x.select(1, 0), x.select(1, 1)}, 3).reshape({B, C, T * 2, H, W});
      }
    }
    const int64_t T = x.size(2);
    torch::Tensor y = x.permute({0, 2, 1, 3, 4}).reshape({B * T, C, H, W});
    if (mode_ == Mode::kUp2d || mode_ == Mode::kUp3d) {
      // nn.Upsample(scale 2, nearest-exact) in float32, back to the input's dtype.
      y = torch::upsample_nearest2d(y.to(torch::kFloat32), std::vector<int64_t>{2 * H, 2 * W})
              .to(x.scalar_type());
    } else if (mode_ == Mode::kDown2d || mode_ == Mode::kDown3d) {
      y = torch::constant_pad_nd(y, {0, 1, 0, 1});
    }
    y = conv(y);
    y = y.view({B, T, y.size(1), y.size(2), y.size(3)}).permute({0, 2, 1, 3, 4});
    if (mode_ == Mode::kDown3d) {
      Slot& slot = cache.next();
      if (!slot.set) {
        slot.set = true;
        slot.x = y.clone();
      } else {
        torch::Tensor keep = y.narrow(2, y.size(2) - 1, 1).clone();
        y = time_conv(torch::cat({slot.x.narrow(2, slot.x.size(2) - 1, 1), y}, 2));
        slot.x = keep;
      }
    }
    return y;
  }
  torch::nn::Conv2d conv{nullptr};
  CausalConv3d time_conv{nullptr};

 private:
  Mode mode_;
};
TORCH_MODULE(Resample);

class MidBlockImpl : public torch::nn::Module {
 public:
  explicit MidBlockImpl(int64_t dim) {
    auto r = register_module("resnets", torch::nn::ModuleList());
    auto a = register_module("attentions", torch::nn::ModuleList());
    res0 = ResidualBlock(dim, dim);
    attn = AttentionBlock(dim);
    res1 = ResidualBlock(dim, dim);
    r->push_back(res0);
    r->push_back(res1);
    a->push_back(attn);
  }
  torch::Tensor forward(const torch::Tensor& x, Cache& cache) {
    return res1->forward(attn(res0->forward(x, cache)), cache);
  }
  ResidualBlock res0{nullptr}, res1{nullptr};
  AttentionBlock attn{nullptr};
};
TORCH_MODULE(MidBlock);

// Wan 2.2's AvgDown3D shortcut: the time axis padded at the front to a multiple of ft, each
// ft x fs x fs block's channels gathered, then groups of them averaged down to `out` channels.
torch::Tensor avg_down(torch::Tensor x, int64_t out, int64_t ft, int64_t fs) {
  const int64_t pad_t = (ft - x.size(2) % ft) % ft;
  if (pad_t > 0) x = torch::constant_pad_nd(x, {0, 0, 0, 0, pad_t, 0});
  const int64_t B = x.size(0), C = x.size(1), T = x.size(2), H = x.size(3), W = x.size(4);
  x = x.view({B, C, T / ft, ft, H / fs, fs, W / fs, fs})
          .permute({0, 1, 3, 5, 7, 2, 4, 6})
          .contiguous()
          .view({B, C * ft * fs * fs, T / ft, H / fs, W / fs});
  return x.view({B, out, C * ft * fs * fs / out, T / ft, H / fs, W / fs}).mean(2);
}

// Wan 2.2's DupUp3D shortcut: channels repeated, spread over ft x fs x fs; the first chunk keeps
// its last frame only.
torch::Tensor dup_up(const torch::Tensor& in, int64_t out, int64_t ft, int64_t fs,
                     bool first_chunk) {
  const int64_t repeats = out * ft * fs * fs / in.size(1);
  torch::Tensor x = in.repeat_interleave(repeats, 1);
  const int64_t B = x.size(0), T = x.size(2), H = x.size(3), W = x.size(4);
  x = x.view({B, out, ft, fs, fs, T, H, W})
          .permute({0, 1, 5, 2, 6, 3, 7, 4})
          .contiguous()
          .view({B, out, T * ft, H * fs, W * fs});
  if (first_chunk) x = x.narrow(2, ft - 1, x.size(2) - (ft - 1));
  return x;
}

// Wan 2.2's WanResidualDownBlock: residual blocks and a downsampler, plus the averaged shortcut.
class ResidualDownBlockImpl : public torch::nn::Module {
 public:
  ResidualDownBlockImpl(int64_t in, int64_t out, int64_t num_res_blocks, bool temporal, bool down)
      : out_(out), ft_(temporal ? 2 : 1), fs_(down ? 2 : 1) {
    auto list = register_module("resnets", torch::nn::ModuleList());
    for (int64_t r = 0; r < num_res_blocks; ++r) {
      resnets.push_back(ResidualBlock(in, out));
      list->push_back(resnets.back());
      in = out;
    }
    if (down) {
      downsampler =
          register_module("downsampler", Resample(out, temporal ? Mode::kDown3d : Mode::kDown2d));
    }
  }
  torch::Tensor forward(const torch::Tensor& x, Cache& cache) {
    torch::Tensor h = x;
    for (auto& r : resnets) h = r->forward(h, cache);
    if (!downsampler.is_empty()) h = downsampler->forward(h, cache);
    return h + avg_down(x, out_, ft_, fs_);
  }
  std::vector<ResidualBlock> resnets;
  Resample downsampler{nullptr};

 private:
  int64_t out_, ft_, fs_;
};
TORCH_MODULE(ResidualDownBlock);

// Wan 2.2's WanResidualUpBlock: num_res_blocks + 1 residual blocks and an upsampler keeping its
// width, plus the duplicated shortcut.
class ResidualUpBlockImpl : public torch::nn::Module {
 public:
  ResidualUpBlockImpl(int64_t in, int64_t out, int64_t num_res_blocks, bool temporal, bool up)
      : out_(out), ft_(temporal ? 2 : 1), up_(up) {
    auto list = register_module("resnets", torch::nn::ModuleList());
    for (int64_t r = 0; r < num_res_blocks + 1; ++r) {
      resnets.push_back(ResidualBlock(in, out));
      list->push_back(resnets.back());
      in = out;
    }
    if (up) {
      upsampler =
          register_module("upsampler", Resample(out, temporal ? Mode::kUp3d : Mode::kUp2d, out));
    }
  }
  torch::Tensor forward(const torch::Tensor& x, Cache& cache, bool first_chunk) {
    torch::Tensor h = x;
    for (auto& r : resnets) h = r->forward(h, cache);
    if (!upsampler.is_empty()) h = upsampler->forward(h, cache);
    if (up_) h = h + dup_up(x, out_, ft_, 2, first_chunk);
    return h;
  }
  std::vector<ResidualBlock> resnets;
  Resample upsampler{nullptr};

 private:
  int64_t out_, ft_;
  bool up_;
};
TORCH_MODULE(ResidualUpBlock);

// A down_blocks / up-block entry: one of the layer kinds.
struct Layer {
  ResidualBlock res{nullptr};
  AttentionBlock attn{nullptr};
  Resample resample{nullptr};
  ResidualDownBlock down{nullptr};
  ResidualUpBlock up{nullptr};
  torch::Tensor forward(const torch::Tensor& x, Cache& cache, bool first_chunk = false) {
    if (!res.is_empty()) return res->forward(x, cache);
    if (!attn.is_empty()) return attn(x);
    if (!down.is_empty()) return down->forward(x, cache);
    if (!up.is_empty()) return up->forward(x, cache, first_chunk);
    return resample->forward(x, cache);
  }
};

class Encoder3dImpl : public torch::nn::Module {
 public:
  explicit Encoder3dImpl(const AutoencoderKLQwenImageConfig& c) {
    std::vector<int64_t> dims = {c.base_dim};
    for (const int64_t m : c.dim_mult) dims.push_back(c.base_dim * m);
    conv_in = register_module("conv_in",
                              causal(c.input_channels, dims[0], {3, 3, 3}, {1, 1, 1}, {1, 1, 1}));
    auto list = register_module("down_blocks", torch::nn::ModuleList());
    double scale = 1.0;
    int64_t out = dims[0];
    for (size_t i = 0; i + 1 < dims.size(); ++i) {
      int64_t in = dims[i];
      out = dims[i + 1];
      if (c.is_residual) {
        const bool last = i + 1 == c.dim_mult.size();
        Layer l;
        l.down =
            ResidualDownBlock(in, out, c.num_res_blocks, !last && c.temperal_downsample[i], !last);
        layers.push_back(l);
        list->push_back(layers.back().down);
        continue;
      }
      for (int64_t r = 0; r < c.num_res_blocks; ++r) {
        layers.push_back({ResidualBlock(in, out), nullptr, nullptr});
        list->push_back(layers.back().res);
        if (std::find(c.attn_scales.begin(), c.attn_scales.end(), scale) != c.attn_scales.end()) {
          layers.push_back({nullptr, AttentionBlock(out), nullptr});
          list->push_back(layers.back().attn);
        }
        in = out;
      }
      if (i + 1 != c.dim_mult.size()) {
        layers.push_back({nullptr, nullptr,
                          Resample(out, c.temperal_downsample[i] ? Mode::kDown3d : Mode::kDown2d)});
        list->push_back(layers.back().resample);
        scale /= 2.0;
      }
    }
    mid = register_module("mid_block", MidBlock(out));
    norm_out = register_module("norm_out", RmsNorm(out, false));
    conv_out =
        register_module("conv_out", causal(out, 2 * c.z_dim, {3, 3, 3}, {1, 1, 1}, {1, 1, 1}));
  }
  torch::Tensor forward(const torch::Tensor& x, Cache& cache) {
    cache.idx = 0;
    torch::Tensor h = cached_conv(conv_in, x, cache);
    for (auto& l : layers) h = l.forward(h, cache);
    h = mid->forward(h, cache);
    return cached_conv(conv_out, torch::silu(norm_out(h)), cache);
  }
  CausalConv3d conv_in{nullptr}, conv_out{nullptr};
  std::vector<Layer> layers;
  MidBlock mid{nullptr};
  RmsNorm norm_out{nullptr};
};
TORCH_MODULE(Encoder3d);

class Decoder3dImpl : public torch::nn::Module {
 public:
  explicit Decoder3dImpl(const AutoencoderKLQwenImageConfig& c) {
    const int64_t base = c.decoder_base_dim > 0 ? c.decoder_base_dim : c.base_dim;
    std::vector<int64_t> dims = {base * c.dim_mult.back()};
    for (auto it = c.dim_mult.rbegin(); it != c.dim_mult.rend(); ++it) {
      dims.push_back(base * *it);
    }
    std::vector<bool> temporal_up(c.temperal_downsample.rbegin(), c.temperal_downsample.rend());
    conv_in = register_module("conv_in", causal(c.z_dim, dims[0], {3, 3, 3}, {1, 1, 1}, {1, 1, 1}));
    mid = register_module("mid_block", MidBlock(dims[0]));
    auto ups = register_module("up_blocks", torch::nn::ModuleList());
    int64_t out = dims[0];
    for (size_t i = 0; i + 1 < dims.size(); ++i) {
      if (c.is_residual) {
        const bool up = i + 1 != c.dim_mult.size();
        out = dims[i + 1];
        Layer l;
        l.up = ResidualUpBlock(dims[i], out, c.num_res_blocks, up && temporal_up[i], up);
        layers.push_back(l);
        ups->push_back(layers.back().up);
        continue;
      }
      int64_t in = i > 0 ? dims[i] / 2 : dims[i];
      out = dims[i + 1];
      auto block = std::make_shared<torch::nn::Module>("QwenImageUpBlock");
      auto resnets = block->register_module("resnets", torch::nn::ModuleList());
      for (int64_t r = 0; r < c.num_res_blocks + 1; ++r) {
        layers.push_back({ResidualBlock(in, out), nullptr, nullptr});
        resnets->push_back(layers.back().res);
        in = out;
      }
      if (i + 1 != c.dim_mult.size()) {
        auto ups_list = block->register_module("upsamplers", torch::nn::ModuleList());
        layers.push_back(
            {nullptr, nullptr, Resample(out, temporal_up[i] ? Mode::kUp3d : Mode::kUp2d)});
        ups_list->push_back(layers.back().resample);
      }
      ups->push_back(block);
    }
    norm_out = register_module("norm_out", RmsNorm(out, false));
    conv_out =
        register_module("conv_out", causal(out, c.input_channels, {3, 3, 3}, {1, 1, 1}, {1, 1, 1}));
  }
  // `first_chunk`: the clip's first latent frame (Wan 2.2's shortcuts keep one frame of it).
  torch::Tensor forward(const torch::Tensor& z, Cache& cache, bool first_chunk = false) {
    cache.idx = 0;
    torch::Tensor h = cached_conv(conv_in, z, cache);
    h = mid->forward(h, cache);
    for (auto& l : layers) h = l.forward(h, cache, first_chunk);
    return cached_conv(conv_out, torch::silu(norm_out(h)), cache);
  }
  CausalConv3d conv_in{nullptr}, conv_out{nullptr};
  MidBlock mid{nullptr};
  std::vector<Layer> layers;
  RmsNorm norm_out{nullptr};
};
TORCH_MODULE(Decoder3d);

// Diffusers' blend_v / blend_h: b's first `extent` rows (columns) fade in from a's last ones, the
// weights y / extent as Python floats applied to float tensors.
torch::Tensor blend(const torch::Tensor& a, torch::Tensor b, int64_t extent, int64_t dim) {
  extent = std::min({a.size(dim), b.size(dim), extent});
  if (extent <= 0) return b;
  std::vector<float> wa, wb;
  for (int64_t y = 0; y < extent; ++y) {
    wb.push_back(static_cast<float>(static_cast<double>(y) / static_cast<double>(extent)));
    wa.push_back(static_cast<float>(1.0 - static_cast<double>(y) / static_cast<double>(extent)));
  }
  std::vector<int64_t> shape(static_cast<size_t>(b.dim()), 1);
  shape[static_cast<size_t>(dim)] = extent;
  const auto ta = torch::tensor(wa).view(shape).to(b.device(), b.scalar_type());
  const auto tb = torch::tensor(wb).view(shape).to(b.device(), b.scalar_type());
  b = b.clone();
  b.narrow(dim, 0, extent)
      .copy_(a.narrow(dim, a.size(dim) - extent, extent) * ta + b.narrow(dim, 0, extent) * tb);
  return b;
}

}  // namespace qwen_vae

struct AutoencoderKLQwenImageImpl::Parts {
  qwen_vae::Encoder3d encoder{nullptr};
  qwen_vae::Decoder3d decoder{nullptr};
  qwen_vae::CausalConv3d quant_conv{nullptr}, post_quant_conv{nullptr};
};

AutoencoderKLQwenImageImpl::AutoencoderKLQwenImageImpl(const AutoencoderKLQwenImageConfig& c)
    : config_(c), parts_(std::make_shared<Parts>()) {
  parts_->encoder = register_module("encoder", qwen_vae::Encoder3d(c));
  parts_->quant_conv =
      register_module("quant_conv", qwen_vae::causal(2 * c.z_dim, 2 * c.z_dim, {1, 1, 1}));
  parts_->post_quant_conv =
      register_module("post_quant_conv", qwen_vae::causal(c.z_dim, c.z_dim, {1, 1, 1}));
  parts_->decoder = register_module("decoder", qwen_vae::Decoder3d(c));
}

AutoencoderKLQwenImageImpl::~AutoencoderKLQwenImageImpl() = default;

void AutoencoderKLQwenImageImpl::enable_tiling(const QwenImageVaeTiling& tiling) {
  if (tiling.tile_sample_min_height < 1 || tiling.tile_sample_min_width < 1 ||
      tiling.tile_sample_stride_height < 1 || tiling.tile_sample_stride_width < 1) {
    throw Error("AutoencoderKLQwenImage: tile sizes and strides must be >= 1");
  }
  tiling_ = true;
  tile_ = tiling;
}

torch::Tensor AutoencoderKLQwenImageImpl::encode_moments(const torch::Tensor& x) {
  qwen_vae::Cache cache;
  const int64_t T = x.size(2);
  std::vector<torch::Tensor> outs;
  for (int64_t i = 0; i < 1 + (T - 1) / 4; ++i) {
    const auto chunk =
        i == 0 ? x.narrow(2, 0, 1)
               : x.narrow(2, 1 + 4 * (i - 1), std::min<int64_t>(4, T - 1 - 4 * (i - 1)));
    outs.push_back(parts_->encoder->forward(chunk, cache));
  }
  return parts_->quant_conv(torch::cat(outs, 2));
}

namespace qwen_vae {

// Wan 2.2's patchify: [B, C, F, H, W] -> [B, C p p, F, H / p, W / p], channel c * p * p + pw * p +
// ph (Diffusers' permute(0, 1, 6, 4, 2, 3, 5)); unpatchify its inverse.
torch::Tensor patchify(const torch::Tensor& x, int64_t p) {
  if (p == 1) return x;
  const int64_t B = x.size(0), C = x.size(1), F = x.size(2), H = x.size(3), W = x.size(4);
  return x.view({B, C, F, H / p, p, W / p, p})
      .permute({0, 1, 6, 4, 2, 3, 5})
      .contiguous()
      .view({B, C * p * p, F, H / p, W / p});
}

torch::Tensor unpatchify(const torch::Tensor& x, int64_t p) {
  if (p == 1) return x;
  const int64_t B = x.size(0), C = x.size(1) / (p * p), F = x.size(2), H = x.size(3), W = x.size(4);
  return x.view({B, C, p, p, F, H, W})
      .permute({0, 1, 4, 5, 3, 6, 2})
      .contiguous()
      .view({B, C, F, H * p, W * p});
}

}  // namespace qwen_vae

DiagonalGaussian AutoencoderKLQwenImageImpl::encode(const torch::Tensor& x) {
  const auto& c = config_;
  if (!(x.dim() == 5 && x.size(1) == c.image_channels())) {
    throw Error(c10::str("AutoencoderKLQwenImage: encode takes [B, ", c.image_channels(),
                         ", frames, H, W], got ", x.sizes()));
  }
  if (x.size(3) % c.patch_size != 0 || x.size(4) % c.patch_size != 0) {
    throw Error(c10::str("AutoencoderKLWan: height and width must be divisible by patch_size ",
                         c.patch_size, ", got ", x.sizes()));
  }
  const torch::Tensor in =
      qwen_vae::patchify(x.to(parts_->quant_conv->weight.scalar_type()), c.patch_size);
  const bool tiled = tiling_ && (x.size(4) > tile_.tile_sample_min_width ||
                                 x.size(3) > tile_.tile_sample_min_height);
  return DiagonalGaussian::from_moments(tiled ? tiled_encode(in) : encode_moments(in));
}

torch::Tensor AutoencoderKLQwenImageImpl::decode(const torch::Tensor& z_in) {
  const auto& c = config_;
  if (!(z_in.dim() == 5 && z_in.size(1) == c.z_dim)) {
    throw Error(c10::str("AutoencoderKLQwenImage: decode takes [B, ", c.z_dim,
                         ", frames, h, w], got ", z_in.sizes()));
  }
  const torch::Tensor z = z_in.to(parts_->quant_conv->weight.scalar_type());
  const int64_t ratio = c.spatial_compression_ratio();
  if (tiling_ && (z.size(4) > tile_.tile_sample_min_width / ratio ||
                  z.size(3) > tile_.tile_sample_min_height / ratio)) {
    return c.wan ? tiled_decode(z).clamp(-1.0, 1.0) : tiled_decode(z);
  }
  qwen_vae::Cache cache;
  const torch::Tensor x = parts_->post_quant_conv(z);
  std::vector<torch::Tensor> outs;
  for (int64_t i = 0; i < z.size(2); ++i) {
    outs.push_back(parts_->decoder->forward(x.narrow(2, i, 1), cache, i == 0));
  }
  return qwen_vae::unpatchify(torch::cat(outs, 2), c.patch_size).clamp(-1.0, 1.0);
}

torch::Tensor AutoencoderKLQwenImageImpl::tiled_encode(const torch::Tensor& x) {
  // x is patchified; the tile sizes apply to it as given (Diffusers' tiled_encode).
  const int64_t T = x.size(2), H = x.size(3), W = x.size(4);
  const int64_t r = config_.encoder_compression_ratio();
  const int64_t min_h = tile_.tile_sample_min_height / r, min_w = tile_.tile_sample_min_width / r;
  const int64_t stride_h = tile_.tile_sample_stride_height / r;
  const int64_t stride_w = tile_.tile_sample_stride_width / r;
  std::vector<std::vector<torch::Tensor>> rows;
  for (int64_t i = 0; i < H; i += tile_.tile_sample_stride_height) {
    std::vector<torch::Tensor> row;
    for (int64_t j = 0; j < W; j += tile_.tile_sample_stride_width) {
      const auto tile = x.narrow(3, i, std::min(tile_.tile_sample_min_height, H - i))
                            .narrow(4, j, std::min(tile_.tile_sample_min_width, W - j));
      qwen_vae::Cache cache;
      std::vector<torch::Tensor> time;
      for (int64_t k = 0; k < 1 + (T - 1) / 4; ++k) {
        const auto chunk =
            k == 0 ? tile.narrow(2, 0, 1)
                   : tile.narrow(2, 1 + 4 * (k - 1), std::min<int64_t>(4, T - 1 - 4 * (k - 1)));
        time.push_back(parts_->quant_conv(parts_->encoder->forward(chunk, cache)));
      }
      row.push_back(torch::cat(time, 2));
    }
    rows.push_back(std::move(row));
  }
  std::vector<torch::Tensor> result_rows;
  for (size_t i = 0; i < rows.size(); ++i) {
    std::vector<torch::Tensor> result_row;
    for (size_t j = 0; j < rows[i].size(); ++j) {
      torch::Tensor tile = rows[i][j];
      if (i > 0) tile = qwen_vae::blend(rows[i - 1][j], tile, min_h - stride_h, 3);
      if (j > 0) tile = qwen_vae::blend(rows[i][j - 1], tile, min_w - stride_w, 4);
      rows[i][j] = tile;
      result_row.push_back(tile.narrow(3, 0, std::min(stride_h, tile.size(3)))
                               .narrow(4, 0, std::min(stride_w, tile.size(4))));
    }
    result_rows.push_back(torch::cat(result_row, 4));
  }
  const auto enc = torch::cat(result_rows, 3);
  return enc.narrow(3, 0, std::min(H / r, enc.size(3))).narrow(4, 0, std::min(W / r, enc.size(4)));
}

torch::Tensor AutoencoderKLQwenImageImpl::tiled_decode(const torch::Tensor& z) {
  const int64_t T = z.size(2), h = z.size(3), w = z.size(4);
  const int64_t r = config_.spatial_compression_ratio();
  const int64_t min_h = tile_.tile_sample_min_height / r, min_w = tile_.tile_sample_min_width / r;
  const int64_t stride_h = tile_.tile_sample_stride_height / r;
  const int64_t stride_w = tile_.tile_sample_stride_width / r;
  if (stride_h < 1 || stride_w < 1) {
    throw Error(
        "AutoencoderKLQwenImage: the tile strides must be at least the compression "
        "ratio (" +
        std::to_string(r) + " pixels)");
  }
  // The decoder's output is still patchified: sample sizes, strides and blends divided by p.
  const int64_t p = config_.patch_size;
  const int64_t out_stride_h = tile_.tile_sample_stride_height / p;
  const int64_t out_stride_w = tile_.tile_sample_stride_width / p;
  const int64_t blend_h = tile_.tile_sample_min_height / p - out_stride_h;
  const int64_t blend_w = tile_.tile_sample_min_width / p - out_stride_w;
  std::vector<std::vector<torch::Tensor>> rows;
  for (int64_t i = 0; i < h; i += stride_h) {
    std::vector<torch::Tensor> row;
    for (int64_t j = 0; j < w; j += stride_w) {
      qwen_vae::Cache cache;
      std::vector<torch::Tensor> time;
      for (int64_t k = 0; k < T; ++k) {
        const auto tile = z.narrow(2, k, 1)
                              .narrow(3, i, std::min(min_h, h - i))
                              .narrow(4, j, std::min(min_w, w - j));
        time.push_back(parts_->decoder->forward(parts_->post_quant_conv(tile), cache, k == 0));
      }
      row.push_back(torch::cat(time, 2));
    }
    rows.push_back(std::move(row));
  }
  std::vector<torch::Tensor> result_rows;
  for (size_t i = 0; i < rows.size(); ++i) {
    std::vector<torch::Tensor> result_row;
    for (size_t j = 0; j < rows[i].size(); ++j) {
      torch::Tensor tile = rows[i][j];
      if (i > 0) tile = qwen_vae::blend(rows[i - 1][j], tile, blend_h, 3);
      if (j > 0) tile = qwen_vae::blend(rows[i][j - 1], tile, blend_w, 4);
      rows[i][j] = tile;
      result_row.push_back(tile.narrow(3, 0, std::min(out_stride_h, tile.size(3)))
                               .narrow(4, 0, std::min(out_stride_w, tile.size(4))));
    }
    result_rows.push_back(torch::cat(result_row, 4));
  }
  const auto dec = torch::cat(result_rows, 3);
  return qwen_vae::unpatchify(dec.narrow(3, 0, std::min(h * r / p, dec.size(3)))
                                  .narrow(4, 0, std::min(w * r / p, dec.size(4))),
                              p);
}

namespace qwen_vae {

// torch.tensor(config list) (float32) viewed to broadcast over dim 1 of a rank-`dim` tensor.
torch::Tensor channel_stats(const std::vector<double>& values, int64_t dim, torch::Device device) {
  std::vector<int64_t> shape(static_cast<size_t>(dim), 1);
  shape[1] = static_cast<int64_t>(values.size());
  return torch::tensor(values).to(torch::kFloat32).view(shape).to(device);
}

}  // namespace qwen_vae

torch::Tensor AutoencoderKLQwenImageImpl::normalize_latents(const torch::Tensor& z) const {
  // As the training scripts: (z - mean) * (1.0 / std), the inverse taken in float32 and then cast.
  const auto mean =
      qwen_vae::channel_stats(config_.latents_mean, z.dim(), z.device()).to(z.scalar_type());
  const auto inv =
      (1.0 / qwen_vae::channel_stats(config_.latents_std, z.dim(), z.device())).to(z.scalar_type());
  return (z - mean) * inv;
}

torch::Tensor AutoencoderKLQwenImageImpl::denormalize_latents(const torch::Tensor& latents) const {
  // As the pipelines: latents / (1.0 / std) + mean, the inverse taken in the latents' dtype.
  const auto dtype = latents.scalar_type();
  const auto mean =
      qwen_vae::channel_stats(config_.latents_mean, latents.dim(), latents.device()).to(dtype);
  const auto inv =
      1.0 / qwen_vae::channel_stats(config_.latents_std, latents.dim(), latents.device()).to(dtype);
  return latents / inv + mean;
}

AutoencoderKLQwenImage load_autoencoder_kl_qwen_image(const std::string& dir, torch::Dtype dtype,
                                                      const std::string& variant) {
  const std::string config =
      model_folder_config(dir,
                          "a Diffusers AutoencoderKLQwenImage folder (config.json + "
                          "diffusion_pytorch_model.safetensors), e.g. a QwenImagePipeline's vae/");
  AutoencoderKLQwenImage model(AutoencoderKLQwenImageConfig::load(config));
  model->to(dtype);
  load_model_folder_weights(*model, dir, dtype, variant);
  return model;
}

}  // namespace difftrain::models
