#include "difftrain/models/unets/unet_blocks.h"

#include "difftrain/core/error.h"
#include "difftrain/models/checkpointing.h"

namespace difftrain::models {
namespace {

bool is_cross_attn(const std::string& type) { return type.find("CrossAttn") != std::string::npos; }
bool is_attn(const std::string& type) { return type.rfind("Attn", 0) == 0; }

ResnetBlock2DOptions resnet_options(const BlockOptions& o, int64_t in, int64_t out) {
  return ResnetBlock2DOptions(in, out)
      .temb_channels(o.temb_channels)
      .groups(o.groups)
      .eps(o.eps)
      .dropout(o.dropout)
      .time_embedding_norm(o.time_scale_shift)
      .non_linearity(o.act_fn)
      .output_scale_factor(o.output_scale_factor);
}

ResnetBlock2D make_resnet(const BlockOptions& o, int64_t in, int64_t out) {
  return ResnetBlock2D(resnet_options(o, in, out));
}

int64_t layers_at(const std::vector<int64_t>& per_layer, size_t i) {
  return per_layer.size() == 1 ? per_layer[0] : per_layer.at(i);
}

// The attention that follows resnet `i` in a block with `channels` output channels.
std::shared_ptr<SpatialLayer> make_attention(const BlockOptions& o, int64_t channels, size_t i,
                                             int64_t norm_groups) {
  if (is_cross_attn(o.type)) {
    const int64_t heads = o.num_attention_heads;
    return Transformer2DModel(heads, channels / heads, channels, layers_at(o.transformer_layers, i),
                              o.cross_attention_dim, o.groups, o.use_linear_projection,
                              o.only_cross_attention, o.upcast_attention)
        .ptr();
  }
  TORCH_CHECK(o.attention_head_dim > 0 && channels % o.attention_head_dim == 0, o.type,
              ": attention_head_dim ", o.attention_head_dim, " must divide the channel count ",
              channels);
  return Attention(AttentionOptions(channels, channels / o.attention_head_dim, o.attention_head_dim)
                       .bias(true)
                       .upcast_softmax(true)
                       .norm_num_groups(norm_groups)
                       .eps(o.eps)
                       .residual_connection(true)
                       .rescale_output_factor(o.output_scale_factor))
      .ptr();
}

torch::Tensor run_resnet(ResnetBlock2D resnet, const torch::Tensor& x, const BlockInputs& in) {
  if (!in.gradient_checkpointing) return resnet->forward(x, in.temb);
  auto impl = resnet.ptr();  // captured by value: backward may run after this frame is gone
  return checkpoint(
      [impl](const std::vector<torch::Tensor>& t) { return impl->forward(t[0], t[1]); },
      {x, in.temb});
}

torch::Tensor run_attention(const std::shared_ptr<SpatialLayer>& attn, const torch::Tensor& x,
                            const BlockInputs& in) {
  if (!in.gradient_checkpointing) return attn->forward(x, in.encoder_hidden_states);
  auto impl = attn;
  return checkpoint(
      [impl](const std::vector<torch::Tensor>& t) { return impl->forward(t[0], t[1]); },
      {x, in.encoder_hidden_states});
}

}  // namespace

// ------------------------------------------------------------------ down

DownBlockImpl::DownBlockImpl(const BlockOptions& o) {
  type_ = o.type;
  auto resnets = register_module("resnets", torch::nn::ModuleList());
  torch::nn::ModuleList attentions;
  const bool with_attention = is_attn(o.type) || is_cross_attn(o.type);
  if (with_attention) attentions = register_module("attentions", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.num_layers; ++i) {
    resnets_.push_back(make_resnet(o, i == 0 ? o.in_channels : o.out_channels, o.out_channels));
    resnets->push_back(resnets_.back());
    if (with_attention) {
      attentions_.push_back(make_attention(o, o.out_channels, i, o.groups));
      attentions->push_back(attentions_.back());
    }
  }
  if (o.add_resample) {
    auto downsamplers = register_module("downsamplers", torch::nn::ModuleList());
    if (o.resample_type == "resnet") {
      resnet_down_ = ResnetBlock2D(resnet_options(o, o.out_channels, o.out_channels).down(true));
      downsamplers->push_back(resnet_down_);
    } else {
      downsample_ = Downsample2D(o.out_channels, true, o.out_channels, o.downsample_padding);
      downsamplers->push_back(downsample_);
    }
  }
}

std::pair<torch::Tensor, std::vector<torch::Tensor>> DownBlockImpl::forward_impl(
    torch::Tensor x, const BlockInputs& in) {
  std::vector<torch::Tensor> states;
  for (size_t i = 0; i < resnets_.size(); ++i) {
    x = run_resnet(resnets_[i], x, in);
    if (!attentions_.empty()) x = run_attention(attentions_[i], x, in);
    states.push_back(x);
  }
  if (!downsample_.is_empty()) {
    x = downsample_(x);
    states.push_back(x);
  } else if (!resnet_down_.is_empty()) {
    x = resnet_down_(x, in.temb);
    states.push_back(x);
  }
  return {x, states};
}

// ------------------------------------------------------------------ mid

MidBlockImpl::MidBlockImpl(const BlockOptions& o) {
  type_ = o.type;
  const int64_t ch = o.in_channels;
  auto resnets = register_module("resnets", torch::nn::ModuleList());
  resnets_.push_back(make_resnet(o, ch, ch));
  resnets->push_back(resnets_.back());
  const bool with_attention = is_cross_attn(o.type) || o.add_attention;
  torch::nn::ModuleList attentions;
  if (with_attention && o.num_layers > 0) {
    attentions = register_module("attentions", torch::nn::ModuleList());
  }
  for (int64_t i = 0; i < o.num_layers; ++i) {
    if (with_attention) {
      attentions_.push_back(make_attention(o, ch, static_cast<size_t>(i), o.attn_groups));
      attentions->push_back(attentions_.back());
    } else {
      attentions_.push_back(nullptr);
    }
    resnets_.push_back(make_resnet(o, ch, ch));
    resnets->push_back(resnets_.back());
  }
}

torch::Tensor MidBlockImpl::forward_impl(torch::Tensor x, const BlockInputs& in) {
  x = run_resnet(resnets_[0], x, in);
  for (size_t i = 0; i < attentions_.size(); ++i) {
    if (attentions_[i]) x = run_attention(attentions_[i], x, in);
    x = run_resnet(resnets_[i + 1], x, in);
  }
  return x;
}

// ------------------------------------------------------------------ up

UpBlockImpl::UpBlockImpl(const BlockOptions& o) {
  type_ = o.type;
  takes_skips_ = o.type != "UpDecoderBlock2D";
  auto resnets = register_module("resnets", torch::nn::ModuleList());
  torch::nn::ModuleList attentions;
  const bool with_attention = is_attn(o.type) || is_cross_attn(o.type);
  if (with_attention) attentions = register_module("attentions", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.num_layers; ++i) {
    int64_t in = 0;
    if (takes_skips_) {
      const int64_t skip = i == o.num_layers - 1 ? o.in_channels : o.out_channels;
      in = (i == 0 ? o.prev_output_channel : o.out_channels) + skip;
    } else {
      // The VAE decoder's block: a plain chain of resnets from in_channels.
      in = i == 0 ? o.in_channels : o.out_channels;
    }
    resnets_.push_back(make_resnet(o, in, o.out_channels));
    resnets->push_back(resnets_.back());
    if (with_attention) {
      attentions_.push_back(make_attention(o, o.out_channels, i, o.groups));
      attentions->push_back(attentions_.back());
    }
  }
  if (o.add_resample) {
    auto upsamplers = register_module("upsamplers", torch::nn::ModuleList());
    if (o.resample_type == "resnet") {
      resnet_up_ = ResnetBlock2D(resnet_options(o, o.out_channels, o.out_channels).up(true));
      upsamplers->push_back(resnet_up_);
    } else {
      upsample_ = Upsample2D(o.out_channels, true, o.out_channels);
      upsamplers->push_back(upsample_);
    }
  }
}

torch::Tensor UpBlockImpl::forward_impl(torch::Tensor x, std::vector<torch::Tensor>& skips,
                                        const BlockInputs& in,
                                        const std::vector<int64_t>& upsample_size) {
  for (size_t i = 0; i < resnets_.size(); ++i) {
    if (takes_skips_) {
      TORCH_CHECK(!skips.empty(), "UpBlock: ran out of skip connections");
      torch::Tensor skip = std::move(skips.back());
      skips.pop_back();
      if (!in.gradient_checkpointing) {
        x = resnets_[i]->forward_cat(x, skip, in.temb);  // no plain concatenation where blocked
      } else {
        x = run_resnet(resnets_[i], torch::cat({x, skip}, 1), in);
      }
    } else {
      x = run_resnet(resnets_[i], x, in);
    }
    if (!attentions_.empty()) x = run_attention(attentions_[i], x, in);
  }
  if (!upsample_.is_empty()) x = upsample_(x, upsample_size);
  if (!resnet_up_.is_empty()) x = resnet_up_(x, in.temb);
  return x;
}

std::pair<torch::Tensor, std::vector<torch::Tensor>> DownBlockImpl::forward(torch::Tensor x,
                                                                            const BlockInputs& in) {
  core::ForwardScope scope(*this);
  auto [out, states] = forward_impl(std::move(x), in);
  std::vector<torch::Tensor> all{out};
  all.insert(all.end(), states.begin(), states.end());
  all = scope.outputs(std::move(all));
  return {all[0], std::vector<torch::Tensor>(all.begin() + 1, all.end())};
}

torch::Tensor MidBlockImpl::forward(torch::Tensor x, const BlockInputs& in) {
  core::ForwardScope scope(*this);
  return scope.output(forward_impl(std::move(x), in));
}

torch::Tensor UpBlockImpl::forward(torch::Tensor x, std::vector<torch::Tensor>& skips,
                                   const BlockInputs& in,
                                   const std::vector<int64_t>& upsample_size) {
  core::ForwardScope scope(*this);
  return scope.output(forward_impl(std::move(x), skips, in, upsample_size));
}

}  // namespace difftrain::models
