// ZImagePipeline (Diffusers 0.40): loading a folder and ZImagePipeline.__call__'s order of
// operations, so that a seed gives Diffusers' images number for number:
//   1. encode_prompt: each prompt as a user message through the chat template
//      (add_generation_prompt, enable_thinking), ids padded / cut to max_sequence_length,
//      Qwen3's hidden_states[-2] at the real tokens; with CFG (guidance_scale > 0) the negative
//      prompts the same way ("" for each prompt when none are given);
//   2. latents = randn([K, 16, 2 (H / 16), 2 (W / 16)], CPU generator(seed)) in float32;
//   3. embeddings repeated per image (p0, p0, p1, p1, ...);
//   4. the denoising loop (denoise.h);
//   5. latents / scaling_factor + shift_factor, vae.decode, (x / 2 + 0.5).clamp(0, 1).
#include "z_image_pipeline.h"

#include "../pipeline_folder.h"

#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/diffusion/qwen3_text_encoder.h"
#include "difftrain/families/family.h"
#include "difftrain/families/z_image/denoise.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/models/lora/lora.h"
#include "difftrain/models/module_info.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <filesystem>

namespace difftrain::families::z_image {
namespace fs = std::filesystem;

namespace {

constexpr int64_t kZImageDefaultSize = 1024;       // ZImagePipeline: height or 1024
constexpr int64_t kZImageMaxSequenceLength = 512;  // its default max_sequence_length
constexpr int64_t kZImageDefaultSteps = 50;        // __call__'s num_inference_steps
constexpr double kZImageDefaultGuidance = 5.0;     // __call__'s guidance_scale

class LlmPenultimateHiddenState final : public diffusion::PromptComposition {
 public:
  std::string name() const override { return "LLM hidden_states[-2] at the real tokens"; }
  void check(const diffusion::TextEncoders& encoders) const override {
    if (encoders.size() != 1) {
      throw Error("the " + name() + " composition takes one text encoder, got " +
                  std::to_string(encoders.size()));
    }
    if (encoders[0]->num_layers() < 2) {
      throw Error(encoders[0]->component() + " (" + encoders[0]->class_name() + ") has " +
                  std::to_string(encoders[0]->num_layers()) +
                  " layer(s); hidden_states[-2] needs at least 2");
    }
  }
  int64_t embed_dim(const diffusion::TextEncoders& encoders) const override {
    return encoders.at(0)->hidden_size();
  }
  diffusion::PromptEmbeds compose(const diffusion::TextEncoders& encoders,
                                  const std::vector<diffusion::Tokens>& tokens,
                                  int64_t /*clip_skip*/) const override {
    diffusion::EncodeRequest request;
    request.skip_layers = 1;  // hidden_states[-2]: the last layer's input
    diffusion::TextEncoding e = encoders[0]->encode(tokens[0], request);
    diffusion::PromptEmbeds out;
    out.embeds = e.last_hidden_state;
    out.attention_mask =
        tokens[0].attention_mask.defined()
            ? tokens[0].attention_mask.to(out.embeds.device())
            : torch::ones({out.embeds.size(0), out.embeds.size(1)},
                          torch::TensorOptions().dtype(torch::kInt64).device(out.embeds.device()));
    return out;
  }
};

struct Run {
  torch::Tensor images, latents;
  std::vector<torch::Tensor> embeds;
};

// One ZImagePipeline.__call__ for `prompts` (r.prompts from row `first`) x k images from one
// generator seeded `seed`.
Run run_once(ZImagePipeline& p, const diffusion::GenerateRequest& r,
             const std::vector<std::string>& prompts, const std::vector<std::string>& negatives,
             int64_t first, int64_t k, uint64_t seed, int64_t* step_counter, int64_t total_steps) {
  const torch::Device device = models::module_device(*p.transformer);
  const auto& tcfg = p.transformer->options();
  const int64_t vsf = z_image_vae_scale_factor(p.vae->config());
  const int64_t n = static_cast<int64_t>(prompts.size());
  const double guidance = *r.guidance_scale;
  const bool cfg = guidance > 0;

  // 1. encode_prompt, or the embeddings given (rows `first`..).
  auto given = [&](const torch::Tensor& embeds, const torch::Tensor& mask) {
    diffusion::PromptEmbeds e;
    e.embeds = embeds.narrow(0, first, n);
    e.attention_mask =
        mask.defined() ? mask.narrow(0, first, n) : torch::ones({n, embeds.size(1)}, torch::kInt64);
    return real_token_embeds(e);
  };
  p.text_encoders.set_max_sequence_length(r.max_sequence_length);
  const std::vector<torch::Tensor> pos = r.prompt_embeds.defined()
                                             ? given(r.prompt_embeds, r.prompt_attention_mask)
                                             : real_token_embeds(p.text_encoders.encode(prompts));
  std::vector<torch::Tensor> neg;
  if (cfg) {
    neg = r.negative_prompt_embeds.defined()
              ? given(r.negative_prompt_embeds, r.negative_attention_mask)
              : real_token_embeds(p.text_encoders.encode(negatives));
  }

  // 2. prepare_latents: randn on the CPU generator in float32, then moved.
  const int64_t h = 2 * (r.height / (vsf * 2)), w = 2 * (r.width / (vsf * 2));
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const torch::Tensor noise = at::randn({n * k, tcfg.in_channels, h, w}, gen, torch::kFloat32);

  // 3. repeated per image, prompt by prompt.
  std::vector<torch::Tensor> pos_k, neg_k;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < k; ++j) {
      pos_k.push_back(pos[static_cast<size_t>(i)].to(device));
      if (cfg) neg_k.push_back(neg[static_cast<size_t>(i)].to(device));
    }
  }

  // 4. the loop.
  DenoiseOptions o;
  o.num_inference_steps = r.num_inference_steps;
  o.guidance_scale = guidance;
  const auto& normalization = r.options.at("cfg_normalization");
  o.cfg_normalization = normalization.is_boolean() ? (normalization.get<bool>() ? 1.0 : 0.0)
                                                   : normalization.get<double>();
  o.cfg_truncation = r.options.value("cfg_truncation", 1.0);
  const torch::Tensor latents = denoise(*p.transformer, *p.scheduler, p.scheduler->config(),
                                        noise.to(device), pos_k, neg_k, o, [&](int64_t, int64_t) {
                                          if (r.on_step) r.on_step(++*step_counter, total_steps);
                                        });

  // 5. decode.
  const auto vae_dtype = models::module_dtype(*p.vae);
  const torch::Tensor decoded = p.vae->decode(p.vae->unscale_latents(latents.to(vae_dtype)));
  Run out;
  out.images = (decoded.to(torch::kCPU, torch::kFloat32) / 2 + 0.5)
                   .clamp(0, 1)
                   .permute({0, 2, 3, 1})
                   .contiguous();
  out.latents = latents.to(torch::kCPU, torch::kFloat32);
  for (const auto& e : pos_k) out.embeds.push_back(e.to(torch::kCPU, torch::kFloat32));
  return out;
}

// Each prompt's negative prompt: "" for all, one for all, or one per prompt.
std::vector<std::string> negative_prompts(const diffusion::GenerateRequest& r) {
  if (r.negative_prompts.empty()) return std::vector<std::string>(r.prompts.size(), "");
  if (r.negative_prompts.size() == 1) {
    return std::vector<std::string>(r.prompts.size(), r.negative_prompts[0]);
  }
  if (r.negative_prompts.size() != r.prompts.size()) {
    throw Error(fmt::format("got {} --negative_prompt for {} prompts; give one, or one per prompt",
                            r.negative_prompts.size(), r.prompts.size()));
  }
  return r.negative_prompts;
}

// [K, L_max, D]: the lists zero-padded to the longest.
torch::Tensor pad_embeds(const std::vector<torch::Tensor>& list) {
  int64_t longest = 0;
  for (const auto& e : list) longest = std::max(longest, e.size(0));
  std::vector<torch::Tensor> rows;
  for (const auto& e : list) {
    rows.push_back(torch::constant_pad_nd(e, {0, 0, 0, longest - e.size(0)}, 0));
  }
  return torch::stack(rows);
}

}  // namespace

ZImageFolder resolve_z_image_folder(const std::string& dir) {
  return resolve_transformer_folder(dir, "ZImagePipeline");
}

std::string z_image_transformer_dir(const std::string& dir) {
  return component_or_self(dir, "transformer");
}

int64_t z_image_vae_scale_factor(const models::AutoencoderKLConfig& vae) {
  return int64_t{1} << (static_cast<int64_t>(vae.block_out_channels.size()) - 1);
}

std::shared_ptr<const diffusion::PromptComposition> llm_penultimate_hidden_state() {
  static const auto composition = std::make_shared<const LlmPenultimateHiddenState>();
  return composition;
}

std::vector<torch::Tensor> real_token_embeds(const diffusion::PromptEmbeds& embeds) {
  std::vector<torch::Tensor> out;
  for (int64_t i = 0; i < embeds.embeds.size(0); ++i) {
    const torch::Tensor keep = embeds.attention_mask[i].to(torch::kBool);
    out.push_back(embeds.embeds[i].index({keep.to(embeds.embeds.device())}));
  }
  return out;
}

diffusion::TextEncoderStack load_z_image_text_encoders(const ZImageFolder& f,
                                                       const std::string& variant,
                                                       torch::Dtype dtype) {
  diffusion::Qwen3PromptFormat format;
  format.sequence_length = kZImageMaxSequenceLength;
  diffusion::TextEncoders encoders = {diffusion::Qwen3TextEncoder::load(
      {"text_encoder", "tokenizer", f.text_encoder_dir, f.tokenizer_dir}, variant, dtype, format)};
  return diffusion::TextEncoderStack(llm_penultimate_hidden_state(), std::move(encoders));
}

void ZImagePipeline::to(const torch::Device& device, std::optional<torch::Dtype> dtype) {
  if (text_encoders.empty() || !transformer || !vae) {
    throw Error("ZImagePipeline::to: the pipeline is missing its text encoder, transformer or VAE");
  }
  text_encoders.to(device, dtype);
  if (dtype) {
    transformer->to(device, *dtype);
    vae->to(device, *dtype);
  } else {
    transformer->to(device);
    vae->to(device);
  }
}

diffusion::GenerateRequest ZImagePipeline::resolve(diffusion::GenerateRequest r) const {
  if (r.num_images == 0) r.num_images = 1;
  if (r.num_inference_steps == 0) r.num_inference_steps = kZImageDefaultSteps;
  if (!r.guidance_scale) r.guidance_scale = kZImageDefaultGuidance;
  if (r.max_sequence_length == 0) r.max_sequence_length = kZImageMaxSequenceLength;
  if (r.height == 0) r.height = kZImageDefaultSize;
  if (r.width == 0) r.width = kZImageDefaultSize;
  if (!r.options.contains("cfg_normalization") || r.options["cfg_normalization"].is_null()) {
    r.options["cfg_normalization"] = 0.0;
  }
  if (!r.options.contains("cfg_truncation") || r.options["cfg_truncation"].is_null()) {
    r.options["cfg_truncation"] = 1.0;
  }
  return r;
}

diffusion::GenerateResult ZImagePipeline::generate(const diffusion::GenerateRequest& request) {
  const diffusion::GenerateRequest r = resolve(request);
  if (!r.class_labels.empty()) throw Error("--class_labels is for class-conditional UNets");
  if (r.prompts.empty()) throw Error("Z-Image needs at least one prompt (--prompt)");
  const int64_t rows = static_cast<int64_t>(r.prompts.size());
  auto check_embeds = [&](const torch::Tensor& e, const torch::Tensor& mask, const char* what) {
    if (!e.defined()) return;
    if (e.dim() != 3 || e.size(0) != rows ||
        (mask.defined() &&
         (mask.dim() != 2 || mask.size(0) != rows || mask.size(1) != e.size(1)))) {
      throw Error(fmt::format(
          "ZImagePipeline: {} must be [{}, L, D] (one row per prompt) with a mask [{}, L]", what,
          rows, rows));
    }
  };
  check_embeds(r.prompt_embeds, r.prompt_attention_mask, "prompt_embeds");
  check_embeds(r.negative_prompt_embeds, r.negative_attention_mask, "negative_prompt_embeds");
  if (r.num_images < 1) {
    throw Error("--num_images_per_prompt must be >= 1, got " + std::to_string(r.num_images));
  }
  if (r.num_inference_steps < 1) {
    throw Error("--num_inference_steps must be >= 1, got " + std::to_string(r.num_inference_steps));
  }
  if (r.max_sequence_length < 1) {
    throw Error("--max_sequence_length must be >= 1, got " + std::to_string(r.max_sequence_length));
  }
  if (*r.guidance_scale < 0) {
    throw Error(fmt::format("--guidance_scale {} must be >= 0 (0 runs without guidance: Turbo)",
                            *r.guidance_scale));
  }
  // ZImagePipeline refuses sizes that are not multiples of 2 x vae_scale_factor; it does not round.
  const int64_t multiple = 2 * z_image_vae_scale_factor(vae->config());
  for (const auto& [what, v] : {std::pair<const char*, int64_t>{"height", r.height},
                                std::pair<const char*, int64_t>{"width", r.width}}) {
    if (v % multiple != 0 || v < multiple) {
      throw Error(fmt::format(
          "--{} {} must be a positive multiple of {} (ZImagePipeline: 2 x the VAE factor; it "
          "does not round); try {}",
          what, v, multiple, std::max(multiple, (v + multiple / 2) / multiple * multiple)));
    }
  }
  const std::vector<std::string> negatives = negative_prompts(r);
  transformer->eval();
  vae->eval();
  for (auto* m : text_encoders.modules()) m->eval();
  torch::NoGradGuard no_grad;

  const int64_t k = r.num_images;
  const int64_t n = static_cast<int64_t>(r.prompts.size());
  int64_t counter = 0;
  diffusion::GenerateResult out;
  std::vector<torch::Tensor> embeds;
  if (r.seeding == diffusion::Seeding::kBatch) {
    Run run =
        run_once(*this, r, r.prompts, negatives, 0, k, r.seed, &counter, r.num_inference_steps);
    out.images = run.images;
    out.latents = run.latents;
    embeds = std::move(run.embeds);
  } else {
    std::vector<torch::Tensor> images, latents;
    const int64_t total = n * k * r.num_inference_steps;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < k; ++j) {
        const auto idx = static_cast<size_t>(i);
        Run run = run_once(*this, r, {r.prompts[idx]}, {negatives[idx]}, i, 1,
                           r.seed + static_cast<uint64_t>(i * k + j), &counter, total);
        images.push_back(run.images);
        latents.push_back(run.latents);
        embeds.push_back(run.embeds.front());
      }
    }
    out.images = torch::cat(images);
    out.latents = torch::cat(latents);
  }
  out.prompt_embeds = pad_embeds(embeds);
  out.labels = diffusion::prompt_labels(r.prompts, k);
  return out;
}

void check_z_image_parts(const ZImageFolder& f,
                         const models::ZImageTransformer2DModelImpl& transformer,
                         const models::AutoencoderKLImpl& vae,
                         const diffusion::TextEncoderStack& text) {
  const auto& tcfg = transformer.options();
  const auto& vcfg = vae.config();
  if (tcfg.in_channels != vcfg.latent_channels) {
    throw Error(fmt::format(
        "{}: in_channels {} differs from the VAE's latent_channels {}; the folder mixes models",
        f.transformer_dir, tcfg.in_channels, vcfg.latent_channels));
  }
  if (tcfg.cap_feat_dim != text.embed_dim()) {
    throw Error(fmt::format(
        "{}: cap_feat_dim {} differs from the text encoder's hidden_size {}; the folder mixes "
        "models",
        f.transformer_dir, tcfg.cap_feat_dim, text.embed_dim()));
  }
}

ZImagePipeline load_z_image_pipeline(const std::string& dir,
                                     const diffusion::PipelineLoadOptions& options) {
  ZImagePipeline p;
  p.folder = resolve_z_image_folder(dir);
  const ZImageFolder& f = p.folder;
  const torch::Dtype dtype = options.dtype.value_or(torch::kFloat32);
  p.text_encoders = load_z_image_text_encoders(f, options.variant, dtype);
  p.transformer = models::load_z_image_transformer(f.transformer_dir, dtype, options.variant);
  p.vae =
      models::load_autoencoder_kl(options.vae.empty() ? f.vae_dir : options.vae, options.variant);
  p.scheduler = diffusion::load_sampler(f.scheduler_config, options.scheduler);
  if (p.scheduler->class_name() != "FlowMatchEulerDiscreteScheduler") {
    throw Error("--scheduler " + options.scheduler + " is a " + p.scheduler->class_name() +
                "; Z-Image is a flow-matching model: use flow_match_euler (or leave --scheduler "
                "out for the folder's own)");
  }
  check_z_image_parts(f, *p.transformer, *p.vae, p.text_encoders);
  if (!options.lora.empty()) {
    const io::LoraWeights lora = read_z_image_lora(options.lora, dir);
    check_lora_fits_family(lora, options.lora, dir);
    const auto t = models::merge_lora(*p.transformer, lora, options.lora_scale, "transformer");
    log::info("LoRA {} ({} format): merged into {} transformer modules, scale {}", options.lora,
              io::format_label(lora), t.modules_merged, options.lora_scale);
    if (t.other_component_targets > 0) {
      log::warn("LoRA {}: {} targets for other components (e.g. text_encoder) were not applied",
                options.lora, t.other_component_targets);
    }
  }
  if (dtype != torch::kFloat32) p.vae->to(dtype);
  return p;
}

}  // namespace difftrain::families::z_image
