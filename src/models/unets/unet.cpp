#include "difftrain/models/unets/unet.h"

#include "difftrain/models/kernels/fused_ops.h"

#include "difftrain/core/cpu_convolution_check.h"
#include "difftrain/core/error.h"

#include <algorithm>

namespace difftrain::models {

namespace {

template <typename T>
std::vector<T> reversed(std::vector<T> v) {
  std::reverse(v.begin(), v.end());
  return v;
}

// What every block of the model shares: resnet settings and the cross-attention switches.
BlockOptions shared_block_options(const UNetConfig& c, int64_t groups, int64_t temb_channels) {
  BlockOptions o;
  o.temb_channels = temb_channels;
  o.eps = c.norm_eps;
  o.act_fn = c.act_fn;
  o.groups = groups;
  o.dropout = c.dropout;
  o.time_scale_shift = c.resnet_time_scale_shift;
  o.use_linear_projection = c.use_linear_projection;
  o.upcast_attention = c.upcast_attention;
  return o;
}

}  // namespace

UNetImpl::UNetImpl(const UNetConfig& c) : config_(c) {
  core::ensure_correct_cpu_convolutions();
  const bool cond = c.kind == UNetKind::kUNet2DCondition;
  const auto& boc = c.block_out_channels;
  const size_t n = boc.size();
  if (!c.norm_num_groups) {
    throw Error(c.class_name() +
                ": norm_num_groups null is not supported (the resnet blocks "
                "need a group count); set it to an integer such as 32");
  }
  const int64_t groups = *c.norm_num_groups;

  // ---- input and time embedding
  const int64_t k_in = cond ? c.conv_in_kernel : 3;
  conv_in_ = register_module(
      "conv_in",
      Conv2d(torch::nn::Conv2dOptions(c.in_channels, boc[0], k_in).padding((k_in - 1) / 2)));
  int64_t time_embed_dim = boc[0] * 4;
  int64_t timestep_input_dim = boc[0];
  if (c.time_embedding_type == "fourier") {
    if (cond) {
      time_embed_dim = c.time_embedding_dim.value_or(boc[0] * 2);
      if (time_embed_dim % 2 != 0) {
        throw Error("UNet2DConditionModel: time_embedding_dim must be even for fourier, got " +
                    std::to_string(time_embed_dim));
      }
      fourier_ = register_module("time_proj", GaussianFourierProjection(time_embed_dim / 2, 1.0,
                                                                        false, c.flip_sin_to_cos));
      timestep_input_dim = time_embed_dim;
    } else {
      fourier_ = register_module("time_proj", GaussianFourierProjection(boc[0], 16.0, true, false));
      timestep_input_dim = 2 * boc[0];
    }
  } else if (c.time_embedding_type == "learned") {
    learned_time_ =
        register_module("time_proj", torch::nn::Embedding(*c.num_train_timesteps, boc[0]));
  } else if (cond) {
    time_embed_dim = c.time_embedding_dim.value_or(boc[0] * 4);
  }
  time_embedding_ = register_module(
      "time_embedding", cond ? TimestepEmbedding(timestep_input_dim, time_embed_dim, c.act_fn,
                                                 c.timestep_post_act, c.time_cond_proj_dim)
                             : TimestepEmbedding(timestep_input_dim, time_embed_dim));

  // ---- class embedding
  if (!c.class_embed_type && c.num_class_embeds) {
    class_embedding_table_ = register_module(
        "class_embedding", torch::nn::Embedding(*c.num_class_embeds, time_embed_dim));
  } else if (c.class_embed_type == "timestep") {
    class_embedding_mlp_ = register_module(
        "class_embedding",
        TimestepEmbedding(timestep_input_dim, time_embed_dim, cond ? c.act_fn : "silu"));
  } else if (c.class_embed_type == "projection") {
    class_embedding_mlp_ = register_module(
        "class_embedding",
        TimestepEmbedding(*c.projection_class_embeddings_input_dim, time_embed_dim, c.act_fn));
  } else if (c.class_embed_type == "simple_projection") {
    class_embedding_linear_ = register_module(
        "class_embedding", Linear(*c.projection_class_embeddings_input_dim, time_embed_dim));
  }
  if (cond && c.addition_embed_type == "text_time") {
    // add_time_proj (Timesteps) has no parameters; add_embedding is a TimestepEmbedding (silu).
    add_embedding_ = register_module(
        "add_embedding",
        TimestepEmbedding(*c.projection_class_embeddings_input_dim, time_embed_dim));
  }
  const int64_t block_temb = c.class_embeddings_concat ? 2 * time_embed_dim : time_embed_dim;

  // ---- down
  auto down_list = register_module("down_blocks", torch::nn::ModuleList());
  int64_t output_channel = boc[0];
  for (size_t i = 0; i < n; ++i) {
    BlockOptions o = shared_block_options(c, groups, block_temb);
    o.type = c.down_block_types[i];
    o.num_layers = c.layers_per_block[i];
    o.in_channels = output_channel;
    output_channel = boc[i];
    o.out_channels = output_channel;
    o.add_resample = i + 1 < n;
    o.downsample_padding = c.downsample_padding;
    o.resample_type = c.downsample_type;
    o.attention_head_dim = c.attention_head_dim[i].value_or(output_channel);
    if (cond) {
      o.num_attention_heads = c.num_attention_heads[i];
      o.cross_attention_dim = c.cross_attention_dim[i];
      o.transformer_layers = c.transformer_layers_per_block[i];
      o.only_cross_attention = c.only_cross_attention[i];
    }
    down_blocks_.push_back(DownBlock(o));
    down_list->push_back(down_blocks_.back());
  }

  // ---- mid
  if (!c.mid_block_type.empty()) {
    BlockOptions o = shared_block_options(c, groups, block_temb);
    o.type = c.mid_block_type;
    o.in_channels = boc.back();
    o.out_channels = boc.back();
    o.output_scale_factor = c.mid_block_scale_factor;
    if (c.mid_block_type == "UNetMidBlock2DCrossAttn") {
      o.num_layers = 1;
      o.num_attention_heads = c.num_attention_heads.back();
      o.cross_attention_dim = c.cross_attention_dim.back();
      o.transformer_layers = c.transformer_layers_per_block.back();
    } else if (cond) {
      o.num_layers = 0;  // UNet2DConditionModel's UNetMidBlock2D: one resnet, no attention
      o.add_attention = false;
    } else {
      o.num_layers = 1;
      o.add_attention = c.add_attention;
      o.attention_head_dim = c.attention_head_dim.back().value_or(boc.back());
      o.attn_groups = c.attn_norm_num_groups.value_or(
          c.resnet_time_scale_shift == "default" ? groups : int64_t{0});
    }
    mid_block_ = register_module("mid_block", MidBlock(o));
  }

  // ---- up
  auto up_list = register_module("up_blocks", torch::nn::ModuleList());
  const auto rboc = reversed(boc);
  const auto rlayers = reversed(c.layers_per_block);
  const auto rheads = reversed(c.num_attention_heads);
  const auto rcross = reversed(c.cross_attention_dim);
  const auto ronly = reversed(c.only_cross_attention);
  const auto rtlpb = c.reverse_transformer_layers_per_block.empty()
                         ? reversed(c.transformer_layers_per_block)
                         : c.reverse_transformer_layers_per_block;
  output_channel = rboc[0];
  for (size_t i = 0; i < n; ++i) {
    BlockOptions o = shared_block_options(c, groups, block_temb);
    o.type = c.up_block_types[i];
    o.num_layers = rlayers[i] + 1;
    o.prev_output_channel = output_channel;
    output_channel = rboc[i];
    o.out_channels = output_channel;
    o.in_channels = rboc[std::min(i + 1, n - 1)];
    o.add_resample = i + 1 < n;
    if (o.add_resample) ++num_upsamplers_;
    o.resample_type = c.upsample_type;
    // Not reversed: Diffusers indexes attention_head_dim by the up block's position.
    o.attention_head_dim = c.attention_head_dim[i].value_or(output_channel);
    if (cond) {
      o.num_attention_heads = rheads[i];
      o.cross_attention_dim = rcross[i];
      o.transformer_layers = rtlpb[i];
      o.only_cross_attention = ronly[i];
    }
    up_blocks_.push_back(UpBlock(o));
    up_list->push_back(up_blocks_.back());
  }

  // ---- out
  conv_norm_out_ = register_module(
      "conv_norm_out",
      torch::nn::GroupNorm(torch::nn::GroupNormOptions(groups, boc[0]).eps(c.norm_eps)));
  const int64_t k_out = cond ? c.conv_out_kernel : 3;
  conv_out_ = register_module(
      "conv_out",
      Conv2d(torch::nn::Conv2dOptions(boc[0], c.out_channels, k_out).padding((k_out - 1) / 2)));
}

bool UNetImpl::needs_encoder_hidden_states() const {
  if (config_.kind != UNetKind::kUNet2DCondition) return false;
  for (const auto& t : config_.down_block_types) {
    if (t.find("CrossAttn") != std::string::npos) return true;
  }
  for (const auto& t : config_.up_block_types) {
    if (t.find("CrossAttn") != std::string::npos) return true;
  }
  return config_.mid_block_type == "UNetMidBlock2DCrossAttn";
}

torch::Tensor UNetImpl::time_features(const torch::Tensor& timesteps, const torch::Tensor& like) {
  torch::Tensor f;
  if (!fourier_.is_empty()) {
    f = fourier_(timesteps);
  } else if (!learned_time_.is_empty()) {
    f = learned_time_(timesteps.to(torch::kLong));
  } else {
    f = timestep_embedding(timesteps, config_.block_out_channels[0], config_.flip_sin_to_cos,
                           config_.freq_shift);
  }
  return f.to(like.scalar_type());
}

torch::Tensor UNetImpl::forward_impl(const torch::Tensor& sample_in, const torch::Tensor& timestep,
                                     const UNetConditioning& cond) {
  const auto& c = config_;
  TORCH_CHECK(sample_in.dim() == 4 && sample_in.size(1) == c.in_channels, c.class_name(),
              ": sample must be [B, ", c.in_channels, ", H, W], got ", sample_in.sizes());
  const int64_t B = sample_in.size(0);
  torch::Tensor sample = sample_in;
  if (c.center_input_sample) sample = 2 * sample - 1.0;

  TORCH_CHECK(timestep.defined() && timestep.dim() <= 1, c.class_name(),
              ": timestep must be a scalar or [B], got ",
              timestep.defined() ? timestep.sizes() : c10::IntArrayRef{});
  torch::Tensor timesteps = timestep.to(sample.device()).reshape({-1});
  TORCH_CHECK(timesteps.size(0) == 1 || timesteps.size(0) == B, c.class_name(), ": timestep has ",
              timesteps.size(0), " entries for a batch of ", B);
  timesteps = timesteps.expand({B});

  torch::Tensor emb = time_embedding_(time_features(timesteps, sample), cond.timestep_cond);
  const bool has_class_embedding =
      !class_embedding_table_.is_empty() || !class_embedding_mlp_.is_empty() ||
      !class_embedding_linear_.is_empty() || c.class_embed_type == "identity";
  if (has_class_embedding) {
    if (!cond.class_labels.defined()) {
      throw Error(c.class_name() +
                  ": this model is class-conditional (num_class_embeds / "
                  "class_embed_type); pass class labels");
    }
    torch::Tensor labels = cond.class_labels.to(sample.device());
    torch::Tensor class_emb;
    if (!class_embedding_table_.is_empty()) {
      TORCH_CHECK(labels.dim() == 1 && labels.size(0) == B, "class_labels must be [B=", B,
                  "], got ", labels.sizes());
      const int64_t lo = labels.min().item<int64_t>(), hi = labels.max().item<int64_t>();
      if (lo < 0 || hi >= *c.num_class_embeds) {
        throw Error(c.class_name() + ": class label " + std::to_string(lo < 0 ? lo : hi) +
                    " is outside [0, " + std::to_string(*c.num_class_embeds) +
                    ") (num_class_embeds)");
      }
      class_emb = class_embedding_table_(labels.to(torch::kLong));
    } else {
      if (c.class_embed_type == "timestep") labels = time_features(labels.reshape({-1}), sample);
      labels = labels.to(sample.scalar_type());
      if (!class_embedding_mlp_.is_empty()) {
        class_emb = class_embedding_mlp_(labels);
      } else if (!class_embedding_linear_.is_empty()) {
        class_emb = class_embedding_linear_(labels);
      } else {
        class_emb = labels;
      }
    }
    class_emb = class_emb.to(sample.scalar_type());
    emb = c.class_embeddings_concat ? torch::cat({emb, class_emb}, -1) : emb + class_emb;
  } else if (cond.class_labels.defined()) {
    throw Error(c.class_name() +
                ": class labels were given but the model has no class "
                "embedding (num_class_embeds is null)");
  }
  if (!add_embedding_.is_empty()) {
    if (!cond.text_embeds.defined() || !cond.time_ids.defined()) {
      throw Error(c.class_name() +
                  ": addition_embed_type \"text_time\" (SDXL) needs text_embeds [B, D] and "
                  "time_ids [B, 6]; pass both (added_cond_kwargs)");
    }
    const int64_t width = *c.addition_time_embed_dim;
    TORCH_CHECK(cond.text_embeds.dim() == 2 && cond.text_embeds.size(0) == B, c.class_name(),
                ": text_embeds must be [B=", B, ", D], got ", cond.text_embeds.sizes());
    TORCH_CHECK(cond.time_ids.dim() == 2 && cond.time_ids.size(0) == B, c.class_name(),
                ": time_ids must be [B=", B, ", K], got ", cond.time_ids.sizes());
    TORCH_CHECK(cond.text_embeds.size(1) + cond.time_ids.size(1) * width ==
                    *c.projection_class_embeddings_input_dim,
                c.class_name(), ": text_embeds ", cond.text_embeds.sizes(), " and time_ids ",
                cond.time_ids.sizes(), " give ",
                cond.text_embeds.size(1) + cond.time_ids.size(1) * width,
                " features, but projection_class_embeddings_input_dim is ",
                *c.projection_class_embeddings_input_dim);
    torch::Tensor time_embeds = timestep_embedding(cond.time_ids.to(sample.device()).reshape({-1}),
                                                   width, c.flip_sin_to_cos, c.freq_shift)
                                    .reshape({B, -1});
    torch::Tensor add =
        torch::cat({cond.text_embeds.to(sample.device(), time_embeds.scalar_type()), time_embeds},
                   -1)
            .to(emb.scalar_type());
    emb = emb + add_embedding_(add);
  } else if (cond.text_embeds.defined() || cond.time_ids.defined()) {
    throw Error(c.class_name() +
                ": text_embeds / time_ids were given but the model has no added conditioning "
                "(addition_embed_type is null)");
  }
  if (c.time_embedding_act_fn) emb = activation(*c.time_embedding_act_fn, emb);

  if (needs_encoder_hidden_states() && !cond.encoder_hidden_states.defined()) {
    throw Error(c.class_name() +
                ": this model has cross-attention blocks; pass "
                "encoder_hidden_states [B, S, " +
                std::to_string(c.cross_attention_dim[0]) + "]");
  }
  BlockInputs in;
  in.temb = emb;
  in.encoder_hidden_states = cond.encoder_hidden_states;
  in.gradient_checkpointing =
      gradient_checkpointing_ && is_training() && torch::GradMode::is_enabled();

  // Sizes that are not multiples of 2^num_upsamplers upsample to the skip's exact size.
  const int64_t factor = int64_t{1} << num_upsamplers_;
  const bool forward_upsample_size = sample.size(2) % factor != 0 || sample.size(3) % factor != 0;

  // Channels-last activations on the CPU (float32, fused kernels on): oneDNN's convolutions run
  // without reorders and the fused GroupNorm keeps the layout. The output is contiguous again.
  const bool channels_last = use_channels_last(sample);
  if (channels_last) sample = sample.contiguous(at::MemoryFormat::ChannelsLast);
  torch::Tensor x = conv_in_(sample);
  // With one input channel the sample is contiguous and channels-last at once, and oneDNN answers
  // contiguous: the layout is set again on conv_in's output.
  if (channels_last) x = x.contiguous(at::MemoryFormat::ChannelsLast);
  std::vector<torch::Tensor> skips{x};
  for (auto& block : down_blocks_) {
    auto [out, states] = block->forward(x, in);
    x = out;
    skips.insert(skips.end(), states.begin(), states.end());
  }
  if (!mid_block_.is_empty()) x = mid_block_->forward(x, in);
  for (size_t i = 0; i < up_blocks_.size(); ++i) {
    auto& block = up_blocks_[i];
    std::vector<int64_t> upsample_size;
    const size_t take = block->num_resnets();
    if (i + 1 < up_blocks_.size() && forward_upsample_size && skips.size() > take) {
      const auto& next = skips[skips.size() - take - 1];
      upsample_size = {next.size(2), next.size(3)};
    }
    x = block->forward(x, skips, in, upsample_size);
  }
  x = group_norm_act(*conv_norm_out_, c.kind == UNetKind::kUNet2DCondition ? c.act_fn : "silu", x);
  x = conv_out_(x);
  if (channels_last) x = leave_channels_last(x);
  if (c.kind == UNetKind::kUNet2D && c.time_embedding_type == "fourier") {
    x = x / timesteps.to(x.scalar_type()).reshape({B, 1, 1, 1});
  }
  return x;
}

torch::Tensor UNetImpl::forward(const torch::Tensor& sample, const torch::Tensor& timestep,
                                const UNetConditioning& cond) {
  core::ForwardScope scope(*this);
  return scope.output(forward_impl(sample, timestep, cond));
}

}  // namespace difftrain::models
