// QwenImagePipeline (Diffusers 0.40): loading a folder and QwenImagePipeline.__call__'s order of
// operations, so that a seed gives Diffusers' images number for number:
//   1. encode_prompt: each prompt in the system template, tokenized (padding to the batch's
//      longest, cut at 1024 + 34), the Qwen2.5-VL language model's last hidden state at the real
//      tokens with the template's first 34 dropped, zero-padded; then cut to max_sequence_length
//      and repeated per image; an all-true mask is no mask. With true CFG (true_cfg_scale > 1 and
//      a negative prompt) the negative prompts the same way;
//   2. latents = randn([K, 1, C, 2 (H / 16), 2 (W / 16)], CPU generator(seed)) in float32, packed
//      into 2x2 patches (sizes are floored to multiples of 16, as the pipeline does);
//   3. sigmas linspace(1, 1/N, N), mu = calculate_shift(patches), the scheduler's dynamic shift
//      and terminal stretch;
//   4. each step: the transformer at t / 1000; with CFG, neg + s (pos - neg) rescaled to the
//      conditional prediction's norm per token; an Euler step;
//   5. unpacked, latents / (1 / latents_std) + latents_mean, vae.decode of the one frame,
//      (x / 2 + 0.5).clamp(0, 1).
// One deliberate difference: with several prompts of different lengths and
// num_images_per_prompt > 1, Diffusers repeats the mask rows in another order than the embedding
// rows (p0 p1 p0 p1 against p0 p0 p1 p1); here each copy keeps its own prompt's mask.
#include "qwen_image_pipeline.h"

#include "../pipeline_folder.h"

#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/diffusion/qwen3_text_encoder.h"
#include "difftrain/families/family.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/image.h"
#include "difftrain/models/lora/lora.h"
#include "difftrain/models/module_info.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <filesystem>

namespace difftrain::families::qwen_image {
namespace fs = std::filesystem;

const char* const kQwenImagePromptTemplate =
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n";

namespace {

constexpr int64_t kDefaultSampleSize = 128;  // default_sample_size (x vae_scale_factor = 1024 px)
constexpr int64_t kDefaultMaxSequenceLength = 512;
constexpr int64_t kDefaultSteps = 50;
constexpr double kDefaultTrueCfg = 4.0;

class QwenImagePromptEmbeds final : public diffusion::PromptComposition {
 public:
  QwenImagePromptEmbeds(int64_t drop, int64_t length) : drop_(drop), length_(length) {}
  std::string name() const override {
    return "LLM last hidden state at the real tokens, the template's first " +
           std::to_string(drop_) + " dropped" +
           (length_ > 0 ? ", cut and padded to " + std::to_string(length_) : std::string());
  }
  void check(const diffusion::TextEncoders& encoders) const override {
    if (encoders.size() != 1) {
      throw Error("the " + name() + " composition takes one text encoder, got " +
                  std::to_string(encoders.size()));
    }
  }
  int64_t embed_dim(const diffusion::TextEncoders& encoders) const override {
    return encoders.at(0)->hidden_size();
  }
  diffusion::PromptEmbeds compose(const diffusion::TextEncoders& encoders,
                                  const std::vector<diffusion::Tokens>& tokens,
                                  int64_t /*clip_skip*/) const override {
    const diffusion::TextEncoding e = encoders[0]->encode(tokens[0], {});
    const torch::Tensor& hidden = e.last_hidden_state;
    const torch::Tensor mask = tokens[0].attention_mask.defined()
                                   ? tokens[0].attention_mask.to(torch::kBool)
                                   : torch::ones({hidden.size(0), hidden.size(1)}, torch::kBool);
    std::vector<torch::Tensor> kept;
    int64_t longest = 0;
    for (int64_t i = 0; i < hidden.size(0); ++i) {
      torch::Tensor real = hidden[i].index({mask[i].to(hidden.device())});
      if (real.size(0) <= drop_) {
        throw Error(fmt::format(
            "{}: a prompt has {} tokens with its template, so nothing is left after the "
            "template's first {} are dropped; is the tokenizer the pipeline's own?",
            encoders[0]->component(), real.size(0), drop_));
      }
      kept.push_back(real.narrow(0, drop_, real.size(0) - drop_));
      if (length_ > 0 && kept.back().size(0) > length_)
        kept.back() = kept.back().narrow(0, 0, length_);
      longest = std::max(longest, kept.back().size(0));
    }
    if (length_ > 0) longest = length_;
    diffusion::PromptEmbeds out;
    std::vector<torch::Tensor> rows, masks;
    for (const auto& k : kept) {
      rows.push_back(torch::constant_pad_nd(k, {0, 0, 0, longest - k.size(0)}, 0));
      masks.push_back(torch::cat({torch::ones({k.size(0)}, torch::kInt64),
                                  torch::zeros({longest - k.size(0)}, torch::kInt64)}));
    }
    out.embeds = torch::stack(rows);
    out.attention_mask = torch::stack(masks).to(out.embeds.device());
    return out;
  }

 private:
  int64_t drop_;
  int64_t length_;  ///< > 0: cut to and pad to this many (a training run's cached captions)
};

// numpy's linspace(1.0, 1 / n, n) in float64.
std::vector<double> default_sigmas(int64_t n) {
  std::vector<double> s;
  const double stop = 1.0 / static_cast<double>(n);
  const double step = n > 1 ? (stop - 1.0) / static_cast<double>(n - 1) : 0.0;
  for (int64_t i = 0; i < n; ++i) s.push_back(i + 1 == n ? stop : 1.0 + step * i);
  return s;
}

struct Embeds {
  torch::Tensor embeds;  ///< [K, L, D]
  torch::Tensor mask;    ///< [K, L] or undefined (every token real)
};

// encode_prompt's cut to max_sequence_length, the repetition per image and the all-true rule.
Embeds finish_embeds(const torch::Tensor& embeds, const torch::Tensor& mask_in, int64_t msl,
                     int64_t k) {
  const int64_t L = std::min(msl, embeds.size(1));
  Embeds out;
  out.embeds = embeds.narrow(1, 0, L).repeat_interleave(k, 0);
  const torch::Tensor mask = mask_in.defined()
                                 ? mask_in.narrow(1, 0, L).repeat_interleave(k, 0).to(torch::kInt64)
                                 : torch::Tensor();
  if (mask.defined() && !mask.to(torch::kBool).all().item<bool>()) out.mask = mask;
  return out;
}

struct Run {
  torch::Tensor images, latents, embeds;
};

// The Edit pipelines' references, prepared once per generate().
struct EditContext {
  std::vector<torch::Tensor> condition;  ///< what the vision tower sees
  torch::Tensor latents;                 ///< [1, Lr, 4 z_dim] packed, normalised
  models::QwenImageGrids grids;          ///< each reference's (1, h/2, w/2)
};

Run run_once(QwenImagePipeline& p, const diffusion::GenerateRequest& r,
             const std::vector<std::string>& prompts, const std::vector<std::string>& negatives,
             int64_t first, int64_t k, uint64_t seed, int64_t* step_counter, int64_t total_steps,
             const EditContext* edit) {
  const torch::Device device = models::module_device(*p.transformer);
  const auto dtype = p.transformer->dtype();
  const auto& tcfg = p.transformer->options();
  const int64_t vsf = p.vae->config().spatial_compression_ratio();
  const int64_t n = static_cast<int64_t>(prompts.size());
  const double true_cfg = r.options.at("true_cfg_scale").get<double>();
  const bool has_negative = !negatives.empty() || r.negative_prompt_embeds.defined();
  const bool cfg = true_cfg > 1 && has_negative;

  // 1. encode_prompt, or the embeddings given (rows `first`..).
  auto encode = [&](const std::vector<std::string>& texts, const torch::Tensor& given,
                    const torch::Tensor& given_mask) {
    if (given.defined()) {  // (the Edit pipelines cut no embeddings, given or not)
      return finish_embeds(given.narrow(0, first, n),
                           given_mask.defined() ? given_mask.narrow(0, first, n) : torch::Tensor(),
                           edit != nullptr ? given.size(1) : r.max_sequence_length, k);
    }
    if (edit != nullptr) {  // the Edit pipelines keep every token (no max_sequence_length cut)
      const auto& encoder = p.text_encoders.as<diffusion::Qwen3TextEncoder>(0);
      const auto [e, m] =
          encode_edit_prompts(encoder, p.visual, p.processor, texts, edit->condition, p.edit);
      return finish_embeds(e, m, e.size(1), k);
    }
    const diffusion::PromptEmbeds e = p.text_encoders.encode(texts);
    return finish_embeds(e.embeds, e.attention_mask, r.max_sequence_length, k);
  };
  const Embeds pos = encode(prompts, r.prompt_embeds, r.prompt_attention_mask);
  Embeds neg;
  if (cfg) neg = encode(negatives, r.negative_prompt_embeds, r.negative_attention_mask);

  // 2. prepare_latents: randn [K, 1, C, h, w] on the CPU generator in float32, then packed.
  const int64_t h = 2 * (r.height / (vsf * 2)), w = 2 * (r.width / (vsf * 2));
  const int64_t C = tcfg.in_channels / 4;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const torch::Tensor noise = at::randn({n * k, 1, C, h, w}, gen, torch::kFloat32);
  torch::Tensor latents = pack_qwen_latents(noise.view({n * k, C, h, w})).to(device);
  models::QwenImageGrids grids{{1, h / 2, w / 2}};
  torch::Tensor references;  // the Edit pipelines' [K, Lr, D], after the noisy latents
  if (edit != nullptr) {
    grids.insert(grids.end(), edit->grids.begin(), edit->grids.end());
    references = edit->latents.to(device, dtype).expand({n * k, -1, -1});
  }
  const std::vector<models::QwenImageGrids> img_shapes(static_cast<size_t>(n * k), grids);
  const auto model_input = [&](const torch::Tensor& x) {
    return references.defined() ? torch::cat({x.to(dtype), references}, 1) : x.to(dtype);
  };
  const int64_t noisy = latents.size(1);

  // 3. the schedule.
  diffusion::TimestepOptions ts;
  ts.sigmas = r.options.contains("sigmas") && r.options["sigmas"].is_array()
                  ? r.options["sigmas"].get<std::vector<double>>()
                  : default_sigmas(r.num_inference_steps);
  ts.mu = diffusion::flow_match_mu(latents.size(1), p.scheduler->config());
  p.scheduler->set_timesteps_with(static_cast<int64_t>(ts.sigmas.size()), ts);
  const torch::Tensor timesteps = p.scheduler->timesteps().to(torch::kFloat32);

  // 4. the loop.
  const auto on_device = [&](const torch::Tensor& t) {
    return t.defined() ? t.to(device) : torch::Tensor();
  };
  const torch::Tensor pos_e = pos.embeds.to(device, dtype), pos_m = on_device(pos.mask);
  const torch::Tensor neg_e = cfg ? neg.embeds.to(device, dtype) : torch::Tensor();
  const torch::Tensor neg_m = cfg ? on_device(neg.mask) : torch::Tensor();
  for (int64_t i = 0; i < timesteps.size(0); ++i) {
    const torch::Tensor t = timesteps[i].expand({latents.size(0)}).to(latents.scalar_type());
    const torch::Tensor model_t = (t / 1000).to(device);
    torch::Tensor pred =
        p.transformer->forward(model_input(latents), pos_e, pos_m, model_t, img_shapes)
            .narrow(1, 0, noisy)
            .to(torch::kFloat32);
    if (cfg) {
      const torch::Tensor neg_pred =
          p.transformer->forward(model_input(latents), neg_e, neg_m, model_t, img_shapes)
              .narrow(1, 0, noisy)
              .to(torch::kFloat32);
      const torch::Tensor comb = neg_pred + true_cfg * (pred - neg_pred);
      const torch::Tensor cond_norm = torch::norm(pred, 2, {-1}, true);
      const torch::Tensor noise_norm = torch::norm(comb, 2, {-1}, true);
      pred = comb * (cond_norm / noise_norm);
    }
    latents = p.scheduler->step(pred, p.scheduler->timestep(i), latents);
    if (r.on_step) r.on_step(++*step_counter, total_steps);
  }

  // 5. decode.
  const auto vae_dtype = models::module_dtype(*p.vae);
  torch::Tensor z = unpack_qwen_latents(latents, h, w).unsqueeze(2).to(vae_dtype);
  z = p.vae->denormalize_latents(z);
  const torch::Tensor decoded = p.vae->decode(z).select(2, 0);
  Run out;
  out.images = (decoded.to(torch::kCPU, torch::kFloat32) / 2 + 0.5)
                   .clamp(0, 1)
                   .permute({0, 2, 3, 1})
                   .contiguous();
  out.latents = latents.to(torch::kCPU, torch::kFloat32);
  out.embeds = pos.embeds.to(torch::kCPU, torch::kFloat32);
  return out;
}

// Each prompt's negative prompt: none, one for all, or one per prompt.
std::vector<std::string> negative_prompts(const diffusion::GenerateRequest& r) {
  if (r.negative_prompts.empty()) return {};
  if (r.negative_prompts.size() == 1) {
    return std::vector<std::string>(r.prompts.size(), r.negative_prompts[0]);
  }
  if (r.negative_prompts.size() != r.prompts.size()) {
    throw Error(fmt::format("got {} --negative_prompt for {} prompts; give one, or one per prompt",
                            r.negative_prompts.size(), r.prompts.size()));
  }
  return r.negative_prompts;
}

}  // namespace

QwenImageFolder resolve_qwen_image_folder(const std::string& dir) {
  return resolve_transformer_folder(dir, "QwenImagePipeline");
}

std::string qwen_image_transformer_dir(const std::string& dir) {
  return component_or_self(dir, "transformer");
}

std::shared_ptr<const diffusion::PromptComposition> qwen_image_prompt_composition(int64_t drop,
                                                                                  int64_t length) {
  return std::make_shared<const QwenImagePromptEmbeds>(drop, length);
}

diffusion::TextEncoderStack load_qwen_image_text_encoders(const QwenImageFolder& f,
                                                          const std::string& variant,
                                                          torch::Dtype dtype, int64_t length,
                                                          io::TensorMap* visual) {
  diffusion::Qwen3PromptFormat format;
  format.chat_template = false;
  format.text_template = kQwenImagePromptTemplate;
  format.pad_to_longest = true;
  format.sequence_length = kQwenImageTokenizerMaxLength + kQwenImageTemplateDrop;
  diffusion::TextEncoders encoders = {diffusion::Qwen3TextEncoder::load(
      {"text_encoder", "tokenizer", f.text_encoder_dir, f.tokenizer_dir}, variant, dtype, format,
      visual)};
  return diffusion::TextEncoderStack(qwen_image_prompt_composition(kQwenImageTemplateDrop, length),
                                     std::move(encoders));
}

torch::Tensor pack_qwen_latents(const torch::Tensor& latents) {
  const int64_t B = latents.size(0), C = latents.size(1), h = latents.size(2), w = latents.size(3);
  return latents.view({B, C, h / 2, 2, w / 2, 2})
      .permute({0, 2, 4, 1, 3, 5})
      .reshape({B, (h / 2) * (w / 2), C * 4});
}

torch::Tensor unpack_qwen_latents(const torch::Tensor& packed, int64_t h, int64_t w) {
  const int64_t B = packed.size(0), C = packed.size(2) / 4;
  return packed.view({B, h / 2, w / 2, C, 2, 2}).permute({0, 3, 1, 4, 2, 5}).reshape({B, C, h, w});
}

void QwenImagePipeline::to(const torch::Device& device, std::optional<torch::Dtype> dtype) {
  if (text_encoders.empty() || !transformer || !vae) {
    throw Error(
        "QwenImagePipeline::to: the pipeline is missing its text encoder, transformer or VAE");
  }
  text_encoders.to(device, dtype);
  if (dtype) {
    transformer->to(device, *dtype);
    vae->to(device, *dtype);
    if (visual) visual->to(device, *dtype);
  } else {
    transformer->to(device);
    vae->to(device);
    if (visual) visual->to(device);
  }
}

diffusion::GenerateRequest QwenImagePipeline::resolve(diffusion::GenerateRequest r) const {
  const int64_t size = kDefaultSampleSize * vae->config().spatial_compression_ratio();
  if (r.num_images == 0) r.num_images = 1;
  if (r.num_inference_steps == 0) r.num_inference_steps = kDefaultSteps;
  if (r.max_sequence_length == 0) r.max_sequence_length = kDefaultMaxSequenceLength;
  if (r.height == 0) r.height = size;
  if (r.width == 0) r.width = size;
  if (!r.options.contains("true_cfg_scale") || r.options["true_cfg_scale"].is_null()) {
    r.options["true_cfg_scale"] = kDefaultTrueCfg;
  }
  return r;
}

diffusion::GenerateResult QwenImagePipeline::generate(const diffusion::GenerateRequest& request) {
  // The Edit pipelines' references: their size is the default output size.
  std::optional<EditImages> edit_images;
  diffusion::GenerateRequest sized = request;
  if (edit != EditKind::kNone) {
    std::vector<torch::Tensor> given = images;
    if (request.options.contains("image") && !request.options["image"].is_null()) {
      given.clear();
      const auto& paths = request.options["image"];
      for (const auto& path : paths.is_array() ? paths : nlohmann::json::array({paths})) {
        given.push_back(io::load_image(path.get<std::string>(), 3));
      }
    }
    edit_images = prepare_edit_images(given, edit);
    if (sized.height == 0) sized.height = edit_images->height;
    if (sized.width == 0) sized.width = edit_images->width;
  } else if (request.options.contains("image") && !request.options["image"].is_null()) {
    throw Error(
        "--image is for the Edit pipelines: this folder is a QwenImagePipeline (text to image); "
        "use a Qwen-Image-Edit folder, or --pipeline QwenImageEditPipeline / "
        "QwenImageEditPlusPipeline with one that has the vision tower");
  }
  const diffusion::GenerateRequest r = resolve(sized);
  if (!r.class_labels.empty()) throw Error("--class_labels is for class-conditional UNets");
  if (r.prompts.empty()) throw Error("Qwen-Image needs at least one prompt (--prompt)");
  if (r.guidance_scale) {
    throw Error(
        "--guidance_scale is for guidance-distilled models, and no Qwen-Image model is one: "
        "classifier-free guidance is --true_cfg_scale (> 1) with a --negative_prompt");
  }
  const int64_t rows = static_cast<int64_t>(r.prompts.size());
  auto check_embeds = [&](const torch::Tensor& e, const torch::Tensor& mask, const char* what) {
    if (!e.defined()) return;
    if (e.dim() != 3 || e.size(0) != rows ||
        (mask.defined() &&
         (mask.dim() != 2 || mask.size(0) != rows || mask.size(1) != e.size(1)))) {
      throw Error(fmt::format(
          "QwenImagePipeline: {} must be [{}, L, D] (one row per prompt) with a mask [{}, L]", what,
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
  if (r.max_sequence_length < 1 || r.max_sequence_length > kQwenImageTokenizerMaxLength) {
    throw Error(fmt::format("--max_sequence_length must be in [1, {}] (QwenImagePipeline), got {}",
                            kQwenImageTokenizerMaxLength, r.max_sequence_length));
  }
  const double true_cfg = r.options.at("true_cfg_scale").get<double>();
  const int64_t multiple = 2 * vae->config().spatial_compression_ratio();
  for (const auto& [what, v] : {std::pair<const char*, int64_t>{"height", r.height},
                                std::pair<const char*, int64_t>{"width", r.width}}) {
    if (v < multiple) {
      throw Error(fmt::format("--{} {} is below {} (2 x the VAE factor), the smallest size", what,
                              v, multiple));
    }
    if (v % multiple != 0) {
      log::warn("--{} {} is not a multiple of {}: QwenImagePipeline floors it to {}", what, v,
                multiple, v / multiple * multiple);
    }
  }
  const std::vector<std::string> negatives = negative_prompts(r);
  const bool has_negative = !negatives.empty() || r.negative_prompt_embeds.defined();
  if (true_cfg > 1 && !has_negative) {
    log::warn(
        "true_cfg_scale is {}, but classifier-free guidance is not enabled since no "
        "negative prompt is given",
        true_cfg);
  } else if (true_cfg <= 1 && has_negative) {
    log::warn(
        "a negative prompt is given but classifier-free guidance is off: true_cfg_scale "
        "{} <= 1",
        true_cfg);
  }
  transformer->eval();
  vae->eval();
  for (auto* m : text_encoders.modules()) m->eval();
  if (visual) visual->eval();
  torch::NoGradGuard no_grad;

  const int64_t k = r.num_images;
  const int64_t n = rows;
  int64_t counter = 0;
  std::optional<EditContext> edit_context;
  if (edit_images) {
    edit_context.emplace();
    edit_context->condition = edit_images->condition;
    edit_context->latents =
        encode_reference_latents(vae, edit_images->vae_pixels, &edit_context->grids);
  }
  const EditContext* ctx = edit_context ? &*edit_context : nullptr;
  diffusion::GenerateResult out;
  std::vector<torch::Tensor> embeds;
  if (r.seeding == diffusion::Seeding::kBatch) {
    Run run = run_once(*this, r, r.prompts, negatives, 0, k, r.seed, &counter,
                       r.num_inference_steps, ctx);
    out.images = run.images;
    out.latents = run.latents;
    out.prompt_embeds = run.embeds;
  } else {
    std::vector<torch::Tensor> images, latents;
    int64_t longest = 0;
    const int64_t total = n * k * r.num_inference_steps;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < k; ++j) {
        const auto idx = static_cast<size_t>(i);
        const std::vector<std::string> neg = negatives.empty()
                                                 ? std::vector<std::string>{}
                                                 : std::vector<std::string>{negatives[idx]};
        Run run = run_once(*this, r, {r.prompts[idx]}, neg, i, 1,
                           r.seed + static_cast<uint64_t>(i * k + j), &counter, total, ctx);
        images.push_back(run.images);
        latents.push_back(run.latents);
        embeds.push_back(run.embeds);
        longest = std::max(longest, run.embeds.size(1));
      }
    }
    for (auto& e : embeds) e = torch::constant_pad_nd(e, {0, 0, 0, longest - e.size(1)}, 0);
    out.images = torch::cat(images);
    out.latents = torch::cat(latents);
    out.prompt_embeds = torch::cat(embeds);
  }
  out.labels = diffusion::prompt_labels(r.prompts, k);
  return out;
}

QwenImagePipeline load_qwen_image_pipeline(const std::string& dir,
                                           const diffusion::PipelineLoadOptions& options,
                                           const std::string& pipeline_class) {
  QwenImagePipeline p;
  p.folder = resolve_qwen_image_folder(dir);
  const QwenImageFolder& f = p.folder;
  p.edit = pipeline_class.empty()
               ? edit_kind_of(f.pipeline_class, dir + "/model_index.json's _class_name")
               : edit_kind_of(pipeline_class, "--pipeline");
  const torch::Dtype dtype = options.dtype.value_or(torch::kFloat32);
  io::TensorMap visual_weights;
  p.text_encoders = load_qwen_image_text_encoders(
      f, options.variant, dtype, 0, p.edit == EditKind::kNone ? nullptr : &visual_weights);
  if (p.edit != EditKind::kNone) {
    p.visual = models::make_qwen2_5_vl_vision(
        (std::filesystem::path(f.text_encoder_dir) / "config.json").string(), visual_weights,
        f.text_encoder_dir, dtype);
    visual_weights.clear();
    const auto processor = std::filesystem::path(dir) / "processor" / "preprocessor_config.json";
    std::error_code ec;
    if (std::filesystem::is_regular_file(processor, ec)) {
      p.processor = models::Qwen2VLImageProcessorOptions::load(processor.string());
    }
  }
  p.transformer = models::load_qwen_image_transformer(f.transformer_dir, dtype, options.variant);
  p.vae = models::load_autoencoder_kl_qwen_image(options.vae.empty() ? f.vae_dir : options.vae,
                                                 dtype, options.variant);
  p.scheduler = diffusion::load_sampler(f.scheduler_config, options.scheduler);
  if (p.scheduler->class_name() != "FlowMatchEulerDiscreteScheduler") {
    throw Error("--scheduler " + options.scheduler + " is a " + p.scheduler->class_name() +
                "; Qwen-Image is a flow-matching model: use flow_match_euler (or leave "
                "--scheduler out for the folder's own)");
  }
  const auto& tcfg = p.transformer->options();
  if (tcfg.in_channels != 4 * p.vae->config().z_dim) {
    throw Error(fmt::format(
        "{}: in_channels {} is not 4 x the VAE's z_dim {} (2x2 packed latents); the folder mixes "
        "models",
        f.transformer_dir, tcfg.in_channels, p.vae->config().z_dim));
  }
  if (tcfg.joint_attention_dim != p.text_encoders.embed_dim()) {
    throw Error(fmt::format(
        "{}: joint_attention_dim {} differs from the text encoder's hidden_size {}; the folder "
        "mixes models",
        f.transformer_dir, tcfg.joint_attention_dim, p.text_encoders.embed_dim()));
  }
  if (!options.lora.empty()) {
    const io::LoraWeights lora = read_qwen_image_lora(options.lora, dir);
    check_lora_fits_family(lora, options.lora, dir);
    const auto t = models::merge_lora(*p.transformer, lora, options.lora_scale, "transformer");
    log::info("LoRA {} ({} format): merged into {} transformer modules, scale {}", options.lora,
              io::format_label(lora), t.modules_merged, options.lora_scale);
    if (t.other_component_targets > 0) {
      log::warn("LoRA {}: {} targets for other components (e.g. text_encoder) were not applied",
                options.lora, t.other_component_targets);
    }
  }
  return p;
}

const DitLoraLayout& qwen_image_lora_layout() {
  static const DitLoraLayout layout{"Qwen-Image",
                                    {"transformer_blocks", "img_in", "txt_in", "txt_norm",
                                     "proj_out", "norm_out", "time_text_embed"},
                                    {},
                                    qwen_image_transformer_dir,
                                    {}};
  return layout;
}

io::LoraWeights read_qwen_image_lora(const std::string& path, const std::string& dir,
                                     const io::LoraReadOptions& options) {
  return read_dit_lora(qwen_image_lora_layout(), path, dir, options);
}

}  // namespace difftrain::families::qwen_image
