#include "difftrain/models/transformers/flux_transformer.h"

#include "difftrain/io/weight_index.h"

#include "../json_fields.h"
#include "difftrain/core/error.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/models/block_swap.h"
#include "difftrain/models/checkpointing.h"
#include "difftrain/models/pretrained.h"

#include <nlohmann/json.hpp>

#include <filesystem>

namespace difftrain::models {

namespace fs = std::filesystem;

namespace {

// Width of the sinusoidal timestep / guidance features (Diffusers' Timesteps(256, ...)).
constexpr int64_t kFluxTimeProjDim = 256;

// A size field; absent, Diffusers' __init__ default (FLUX.1's value) applies, as from_pretrained
// fills it (FLUX.1-dev's own config.json has no axes_dims_rope, for one).
int64_t flux_required_int(const detail::JsonFields& r, const std::string& key, int64_t fallback,
                          int64_t min) {
  return r.integer_at_least(key, fallback, min);
}

// ids [N, A] or [B, N, A] (v0.31 takes [0] of a 3-D one, with a deprecation warning) -> [N, A].
torch::Tensor flux_ids_2d(const torch::Tensor& ids, const char* name, int64_t n, size_t axes) {
  TORCH_CHECK(ids.defined(), "FluxTransformer2DModel: ", name, " is required");
  torch::Tensor out = ids.dim() == 3 ? ids[0] : ids;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == n && out.size(1) == static_cast<int64_t>(axes),
              "FluxTransformer2DModel: ", name, " must be [", n, ", ", axes,
              "] (one row per token, one column per axes_dims_rope entry), got ", ids.sizes());
  return out.to(torch::kFloat32);
}

std::pair<torch::Tensor, torch::Tensor> block_pair(const std::vector<torch::Tensor>& v) {
  return {v.at(0), v.at(1)};
}

}  // namespace

FluxBlockSwapSplit flux_block_swap_split(int64_t n, int64_t num_layers, int64_t num_single_layers) {
  FluxBlockSwapSplit s;
  s.double_blocks = n / 2;
  s.single_blocks = (n - s.double_blocks) * 2;
  s.fits = n >= 0 && s.double_blocks <= num_layers && s.single_blocks <= num_single_layers &&
           s.double_blocks + s.single_blocks < num_layers + num_single_layers;
  return s;
}

int64_t flux_max_blocks_to_swap(int64_t num_layers, int64_t num_single_layers) {
  int64_t n = 0;
  while (flux_block_swap_split(n + 1, num_layers, num_single_layers).fits) ++n;
  return n;
}

std::vector<bool> flux_swapped_blocks(int64_t n, int64_t num_layers, int64_t num_single_layers) {
  const FluxBlockSwapSplit split = flux_block_swap_split(n, num_layers, num_single_layers);
  if (!split.fits) {
    throw Error("--blocks_to_swap " + std::to_string(n) +
                " is too many for this transformer: kohya's FLUX.1 split makes it " +
                std::to_string(split.double_blocks) + " double-stream blocks (it has " +
                std::to_string(num_layers) + ") and " + std::to_string(split.single_blocks) +
                " single-stream blocks (it has " + std::to_string(num_single_layers) +
                "), and at least one block stays on the device; use --blocks_to_swap " +
                std::to_string(flux_max_blocks_to_swap(num_layers, num_single_layers)) +
                " or fewer");
  }
  // The last blocks of each kind, as kohya keeps the first ones on the device.
  std::vector<bool> swapped;
  for (int64_t i = 0; i < num_layers; ++i) swapped.push_back(i >= num_layers - split.double_blocks);
  for (int64_t i = 0; i < num_single_layers; ++i)
    swapped.push_back(i >= num_single_layers - split.single_blocks);
  return swapped;
}

// ------------------------------------------------------------------ options

void FluxTransformer2DModelOptions::validate(const std::string& source) const {
  auto fail = [&](const std::string& key, const std::string& what) {
    throw Error(source + ": field \"" + key + "\" " + what);
  };
  auto positive = [&](const std::string& key, int64_t v, int64_t min = 1) {
    if (v < min) {
      fail(key, "must be >= " + std::to_string(min) + ", got " + std::to_string(v));
    }
  };
  positive("patch_size", patch_size());
  positive("in_channels", in_channels());
  if (out_channels()) positive("out_channels", *out_channels());
  positive("num_layers", num_layers(), 0);
  positive("num_single_layers", num_single_layers(), 0);
  positive("attention_head_dim", attention_head_dim());
  positive("num_attention_heads", num_attention_heads());
  positive("joint_attention_dim", joint_attention_dim());
  positive("pooled_projection_dim", pooled_projection_dim());
  const auto& axes = axes_dims_rope();
  if (axes.empty()) fail("axes_dims_rope", "must list at least one RoPE axis, got []");
  int64_t sum = 0;
  std::string listed;
  for (int64_t d : axes) {
    listed += (listed.empty() ? "" : ", ") + std::to_string(d);
    sum += d;
  }
  for (int64_t d : axes) {
    if (d <= 0 || d % 2 != 0) {
      fail("axes_dims_rope",
           "must hold positive even dims (RoPE rotates pairs), got [" + listed + "]");
    }
  }
  if (sum != attention_head_dim()) {
    fail("axes_dims_rope", "sums to " + std::to_string(sum) + " ([" + listed +
                               "]) but attention_head_dim is " +
                               std::to_string(attention_head_dim()) +
                               "; the RoPE axes must cover one head exactly: fix either field");
  }
}

FluxTransformer2DModelOptions FluxTransformer2DModelOptions::parse(const std::string& json_text,
                                                                   const std::string& source) {
  const nlohmann::json j =
      detail::parse_json_text(json_text, source, "a Diffusers FluxTransformer2DModel config.json");
  if (!j.is_object()) {
    throw Error(source + ": expected a JSON object (a FluxTransformer2DModel config.json)");
  }
  detail::JsonFields r(j, source);
  r.choice("_class_name", "FluxTransformer2DModel", {"FluxTransformer2DModel"});
  FluxTransformer2DModelOptions o;
  o.patch_size(r.integer("patch_size", 1));
  o.in_channels(flux_required_int(r, "in_channels", 64, 1));
  o.out_channels(r.opt_integer("out_channels", std::nullopt));
  o.num_layers(flux_required_int(r, "num_layers", 19, 0));
  o.num_single_layers(flux_required_int(r, "num_single_layers", 38, 0));
  o.attention_head_dim(flux_required_int(r, "attention_head_dim", 128, 1));
  o.num_attention_heads(flux_required_int(r, "num_attention_heads", 24, 1));
  o.joint_attention_dim(flux_required_int(r, "joint_attention_dim", 4096, 1));
  o.pooled_projection_dim(flux_required_int(r, "pooled_projection_dim", 768, 1));
  o.guidance_embeds(r.boolean("guidance_embeds", false));
  o.axes_dims_rope(r.integers("axes_dims_rope", {16, 56, 56}));
  o.validate(source);
  return o;
}

FluxTransformer2DModelOptions FluxTransformer2DModelOptions::load(const std::string& path) {
  if (!fs::exists(path)) {
    throw Error(path + ": no such file; expected a Diffusers FluxTransformer2DModel config.json");
  }
  return parse(io::read_file(path), path);
}

nlohmann::json FluxTransformer2DModelOptions::to_json() const {
  nlohmann::json j;
  j["_class_name"] = "FluxTransformer2DModel";
  j["_diffusers_version"] = "0.31.0";
  j["patch_size"] = patch_size();
  j["in_channels"] = in_channels();
  j["out_channels"] = out_channels() ? nlohmann::json(*out_channels()) : nlohmann::json(nullptr);
  j["num_layers"] = num_layers();
  j["num_single_layers"] = num_single_layers();
  j["attention_head_dim"] = attention_head_dim();
  j["num_attention_heads"] = num_attention_heads();
  j["joint_attention_dim"] = joint_attention_dim();
  j["pooled_projection_dim"] = pooled_projection_dim();
  j["guidance_embeds"] = guidance_embeds();
  j["axes_dims_rope"] = axes_dims_rope();
  return j;
}

// ------------------------------------------------------------------ model

FluxTransformer2DModelImpl::FluxTransformer2DModelImpl(const FluxTransformer2DModelOptions& o)
    : options_(o) {
  options_.validate("FluxTransformer2DModelOptions");
  const int64_t D = o.inner_dim(), heads = o.num_attention_heads(), hd = o.attention_head_dim();
  // Diffusers' CombinedTimestepGuidanceTextProjEmbeddings (dev) or
  // CombinedTimestepTextProjEmbeddings (schnell); text_embedder is a PixArtAlphaTextProjection
  // (linear_1, silu, linear_2), the same layers as a TimestepEmbedding.
  auto tte = register_module("time_text_embed",
                             std::make_shared<torch::nn::Module>(
                                 o.guidance_embeds() ? "CombinedTimestepGuidanceTextProjEmbeddings"
                                                     : "CombinedTimestepTextProjEmbeddings"));
  timestep_embedder_ =
      tte->register_module("timestep_embedder", TimestepEmbedding(kFluxTimeProjDim, D));
  if (o.guidance_embeds()) {
    guidance_embedder_ =
        tte->register_module("guidance_embedder", TimestepEmbedding(kFluxTimeProjDim, D));
  }
  text_embedder_ =
      tte->register_module("text_embedder", TimestepEmbedding(o.pooled_projection_dim(), D));
  context_embedder_ = register_module("context_embedder", Linear(o.joint_attention_dim(), D));
  x_embedder_ = register_module("x_embedder", Linear(o.in_channels(), D));
  auto blocks = register_module("transformer_blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.num_layers(); ++i) {
    transformer_blocks_.push_back(FluxTransformerBlock(D, heads, hd));
    blocks->push_back(transformer_blocks_.back());
  }
  auto singles = register_module("single_transformer_blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.num_single_layers(); ++i) {
    single_transformer_blocks_.push_back(FluxSingleTransformerBlock(D, heads, hd));
    singles->push_back(single_transformer_blocks_.back());
  }
  // AdaLayerNormContinuous: (scale, shift) = linear(silu(temb)).chunk(2).
  norm_out_ = register_module("norm_out", AdaLayerNormZero(D, 2));
  proj_out_ =
      register_module("proj_out", Linear(D, o.patch_size() * o.patch_size() * o.output_channels()));
}

void FluxTransformer2DModelImpl::enable_block_swap(int64_t n) {
  block_swap_.reset();
  if (n == 0) return;
  std::vector<torch::nn::Module*> blocks;
  for (auto& b : transformer_blocks_) blocks.push_back(b.ptr().get());
  for (auto& b : single_transformer_blocks_) blocks.push_back(b.ptr().get());
  block_swap_ = std::make_shared<BlockSwap>(
      blocks, flux_swapped_blocks(n, options_.num_layers(), options_.num_single_layers()));
}

torch::Tensor FluxTransformer2DModelImpl::time_text_embed(const torch::Tensor& timestep,
                                                          const torch::Tensor& guidance,
                                                          const torch::Tensor& pooled) {
  // The sinusoids are float32 whatever the model's dtype, then cast to the pooled input's dtype.
  auto features = [&](const torch::Tensor& v) {
    return timestep_embedding(v, kFluxTimeProjDim, /*flip_sin_to_cos=*/true,
                              /*downscale_freq_shift=*/0)
        .to(pooled.scalar_type());
  };
  torch::Tensor temb = timestep_embedder_(features(timestep));
  if (guidance.defined()) temb = temb + guidance_embedder_(features(guidance));
  return temb + text_embedder_(pooled);
}

torch::Tensor FluxTransformer2DModelImpl::forward(
    const torch::Tensor& hidden_states, const torch::Tensor& encoder_hidden_states,
    const torch::Tensor& pooled_projections, const torch::Tensor& timestep,
    const torch::Tensor& guidance, const torch::Tensor& img_ids, const torch::Tensor& txt_ids,
    FluxTransformerIntermediates* intermediates) {
  core::ForwardScope scope(*this);
  return scope.output(forward_impl(hidden_states, encoder_hidden_states, pooled_projections,
                                   timestep, guidance, img_ids, txt_ids, intermediates));
}

torch::Tensor FluxTransformer2DModelImpl::forward_impl(
    const torch::Tensor& hidden_states, const torch::Tensor& encoder_hidden_states,
    const torch::Tensor& pooled_projections, const torch::Tensor& timestep,
    const torch::Tensor& guidance, const torch::Tensor& img_ids, const torch::Tensor& txt_ids,
    FluxTransformerIntermediates* intermediates) {
  const auto& o = options_;
  TORCH_CHECK(hidden_states.dim() == 3 && hidden_states.size(2) == o.in_channels(),
              "FluxTransformer2DModel: hidden_states must be [B, L, in_channels=", o.in_channels(),
              "] (packed latents), got ", hidden_states.sizes());
  const int64_t B = hidden_states.size(0), L = hidden_states.size(1);
  TORCH_CHECK(encoder_hidden_states.defined() && encoder_hidden_states.dim() == 3 &&
                  encoder_hidden_states.size(0) == B &&
                  encoder_hidden_states.size(2) == o.joint_attention_dim(),
              "FluxTransformer2DModel: encoder_hidden_states must be [B=", B,
              ", S, joint_attention_dim=", o.joint_attention_dim(), "]");
  const int64_t S = encoder_hidden_states.size(1);
  TORCH_CHECK(pooled_projections.defined() && pooled_projections.dim() == 2 &&
                  pooled_projections.size(0) == B &&
                  pooled_projections.size(1) == o.pooled_projection_dim(),
              "FluxTransformer2DModel: pooled_projections must be [B=", B,
              ", pooled_projection_dim=", o.pooled_projection_dim(), "]");
  TORCH_CHECK(timestep.defined() && timestep.dim() == 1 && timestep.size(0) == B,
              "FluxTransformer2DModel: timestep must be [B=", B, "] (scheduler timestep / 1000)");
  // Diffusers raises a TypeError for both mismatches (the embedder's forward takes a different
  // number of arguments); a silent drop would hide a dev/schnell mix-up.
  if (o.guidance_embeds() && !guidance.defined()) {
    throw Error(
        "FluxTransformer2DModel: this model has guidance_embeds true in its config.json "
        "(FLUX.1-dev style) and needs guidance [B] (e.g. 3.5); pass it");
  }
  if (!o.guidance_embeds() && guidance.defined()) {
    throw Error(
        "FluxTransformer2DModel: this model has guidance_embeds false in its config.json "
        "(FLUX.1-schnell style, no guidance_embedder) but guidance was given; pass none");
  }
  if (guidance.defined()) {
    TORCH_CHECK(guidance.dim() == 1 && guidance.size(0) == B,
                "FluxTransformer2DModel: guidance must be [B=", B, "], got ", guidance.sizes());
  }
  const size_t axes = o.axes_dims_rope().size();
  const torch::Tensor ids = torch::cat(
      {flux_ids_2d(txt_ids, "txt_ids", S, axes), flux_ids_2d(img_ids, "img_ids", L, axes)}, 0);

  torch::Tensor img = x_embedder_(hidden_states);
  const auto dtype = img.scalar_type();
  // Diffusers: timestep.to(hidden_states.dtype) * 1000 (the pipeline divided by 1000).
  const torch::Tensor t = timestep.to(dtype) * 1000;
  const torch::Tensor g = guidance.defined() ? guidance.to(dtype) * 1000 : torch::Tensor();
  const torch::Tensor temb = time_text_embed(t, g, pooled_projections);
  torch::Tensor txt = context_embedder_(encoder_hidden_states);
  RotaryTables rope = rotary_tables(ids, o.axes_dims_rope());
  rope.cos = rope.cos.to(img.device());
  rope.sin = rope.sin.to(img.device());
  if (intermediates) {
    *intermediates = FluxTransformerIntermediates();
    intermediates->temb = temb;
    intermediates->rope_cos = rope.cos;
    intermediates->rope_sin = rope.sin;
  }

  const bool ckpt = gradient_checkpointing_ && is_training() && torch::GradMode::is_enabled();
  BlockSwap* swap = block_swap_.get();
  size_t index = 0;  // the block's place in forward order (double blocks, then single ones)
  for (auto& block : transformer_blocks_) {
    if (swap) std::tie(img, txt) = block_pair(swap->enter(index, {img, txt}));
    if (ckpt) {
      auto impl = block.ptr();  // captured by value: backward may run after this frame is gone
      torch::Tensor both = checkpoint(
          [impl](const std::vector<torch::Tensor>& in) {
            auto [h, e] = impl->forward(in[0], in[1], in[2], RotaryTables{in[3], in[4]});
            return torch::cat({e, h}, 1);
          },
          {img, txt, temb, rope.cos, rope.sin});
      txt = both.narrow(1, 0, S);
      img = both.narrow(1, S, L);
    } else {
      std::tie(img, txt) = block->forward(img, txt, temb, rope);
    }
    if (swap) std::tie(img, txt) = block_pair(swap->leave(index, {img, txt}));
    ++index;
    if (intermediates) {
      intermediates->double_img.push_back(img);
      intermediates->double_txt.push_back(txt);
    }
  }
  torch::Tensor h = torch::cat({txt, img}, 1);  // [B, S + L, D], text first
  // The model's output drops the text rows: the last single block computes only the image rows
  // (exactly those rows of its whole output) unless the caller asked for every block's output.
  bool text_dropped = false;
  for (auto& block : single_transformer_blocks_) {
    const bool last = &block == &single_transformer_blocks_.back();
    const int64_t keep_from = last && intermediates == nullptr ? S : 0;
    if (swap) h = swap->enter(index, {h})[0];
    if (ckpt) {
      auto impl = block.ptr();
      h = checkpoint(
          [impl, keep_from](const std::vector<torch::Tensor>& in) {
            return impl->forward(in[0], in[1], RotaryTables{in[2], in[3]}, keep_from);
          },
          {h, temb, rope.cos, rope.sin});
    } else {
      h = block->forward(h, temb, rope, keep_from);
    }
    text_dropped = keep_from > 0;
    if (swap) h = swap->leave(index, {h})[0];
    ++index;
    if (intermediates) intermediates->single.push_back(h);
  }
  const std::vector<torch::Tensor> scale_shift = norm_out_(temb);  // scale FIRST
  torch::Tensor n = modulate(text_dropped ? h : h.narrow(1, S, L), scale_shift[1], scale_shift[0]);
  if (intermediates) intermediates->norm_out = n;
  return proj_out_(n);
}

// ------------------------------------------------------------------ folders

io::TensorMap load_flux_weights(const std::string& dir, torch::Dtype dtype,
                                const std::string& variant) {
  // One file or save_pretrained's shards by their index, converted file by file.
  return io::load_weight_files(io::find_weight_files(dir, "diffusion_pytorch_model", variant),
                               dtype);
}

FluxTransformer2DModel load_flux_transformer(const std::string& dir, torch::Dtype dtype,
                                             const std::string& variant) {
  const std::string what =
      "a Diffusers FluxTransformer2DModel folder (config.json + "
      "diffusion_pytorch_model.safetensors, as save_pretrained writes it)";
  if (!fs::is_directory(dir)) {
    throw Error(dir + (fs::exists(dir) ? ": not a folder" : ": no such folder") + "; expected " +
                what);
  }
  const fs::path config = fs::path(dir) / "config.json";
  if (!fs::exists(config)) throw Error(dir + ": no config.json; expected " + what);
  FluxTransformer2DModel model(FluxTransformer2DModelOptions::load(config.string()));
  model->to(dtype);
  const io::WeightFiles files = io::find_weight_files(dir, "diffusion_pytorch_model", variant);
  const io::TensorMap weights = io::load_weight_files(files, dtype);
  load_weights(*model, weights, files.index.empty() ? files.files.at(0) : files.index);
  return model;
}

void save_flux_transformer(FluxTransformer2DModelImpl& model, const std::string& dir,
                           const std::string& variant) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw Error(dir + ": cannot create the folder (" + ec.message() + ")");
  io::write_file_atomic((fs::path(dir) / "config.json").string(),
                        model.options().to_json().dump(2) + "\n");
  io::TensorMap tensors;
  for (const auto& [name, t] : named_tensors(model)) tensors[name] = t.detach();
  const std::string file = variant.empty() ? "diffusion_pytorch_model.safetensors"
                                           : "diffusion_pytorch_model." + variant + ".safetensors";
  io::save_safetensors((fs::path(dir) / file).string(), tensors, {{"format", "pt"}});
}

}  // namespace difftrain::models
