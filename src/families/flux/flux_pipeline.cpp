// FluxPipeline (Diffusers v0.31): loading a folder and FluxPipeline.__call__'s order of
// operations, so that a seed gives Diffusers' images number for number:
//   1. encode_prompt: pooled = CLIP pooler_output of the 77-token ids, prompt_embeds = T5
//      last_hidden_state of max_sequence_length ids (no mask), text_ids = zeros [L, 3];
//   2. latents = randn([K, C, 2*(H/VSF), 2*(W/VSF)], CPU generator(seed)) in float32, packed
//      into 2x2 patches [K, h/2 * w/2, 4C], latent_image_ids (0, i, j);
//   3. sigmas = linspace(1, 1/N, N), mu = calculate_shift(sequence length), set_timesteps;
//   4. per step: v = transformer(x, t/1000, guidance (dev only), pooled, prompt_embeds, ids),
//      x = scheduler.step(v, t, x);
//   5. unpack, latents / scaling_factor + shift_factor, vae.decode, (x/2 + 0.5).clamp(0, 1).
#include "flux_pipeline.h"

#include "../pipeline_folder.h"

#include "flux_family.h"

#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/models/lora/lora.h"
#include "difftrain/models/module_info.h"
#include "difftrain/models/transformers/flux_packing.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <filesystem>

namespace difftrain::families::flux {
namespace fs = std::filesystem;

namespace {

constexpr int64_t kFluxDefaultSampleSize = 128;  // FluxPipeline.default_sample_size
constexpr int64_t kFluxMaxSequenceLength = 512;  // FluxPipeline.check_inputs' limit

// Each prompt's T5 prompt: none (the prompts themselves), one for all, or one per prompt.
std::vector<std::string> flux_second_prompts(const diffusion::GenerateRequest& r) {
  if (r.prompts_2.empty()) return r.prompts;
  if (r.prompts_2.size() == 1) return std::vector<std::string>(r.prompts.size(), r.prompts_2[0]);
  if (r.prompts_2.size() != r.prompts.size()) {
    throw Error(fmt::format("got {} --prompt_2 for {} prompts; give one, or one per prompt",
                            r.prompts_2.size(), r.prompts.size()));
  }
  return r.prompts_2;
}

struct FluxRun {
  torch::Tensor images, latents, prompt_embeds, pooled;
};

// One FluxPipeline.__call__ for `prompts` (r.prompts from row `first`) x k images from one
// generator seeded `seed`.
FluxRun flux_run(FluxPipeline& p, const diffusion::GenerateRequest& r,
                 const std::vector<std::string>& prompts, const std::vector<std::string>& prompts_2,
                 int64_t first, int64_t k, uint64_t seed, int64_t* step_counter,
                 int64_t total_steps) {
  const torch::Device device = models::module_device(*p.transformer);
  const auto dtype = models::module_dtype(*p.transformer);
  const auto& tcfg = p.transformer->options();
  const int64_t vsf = flux_vae_scale_factor(p.vae->config());
  const int64_t n = static_cast<int64_t>(prompts.size());
  const int64_t h = 2 * (r.height / vsf), w = 2 * (r.width / vsf);
  const int64_t channels = tcfg.in_channels() / 4;

  // 1. encode_prompt (each embedding in its encoder's dtype, then the transformer's), or the
  // embeddings given.
  diffusion::PromptEmbeds text;
  if (r.prompt_embeds.defined()) {
    text.embeds = r.prompt_embeds.narrow(0, first, n);
    text.pooled = r.pooled_prompt_embeds.narrow(0, first, n);
  } else {
    p.text_encoders.set_max_sequence_length(r.max_sequence_length);
    text = p.text_encoders.encode(prompts, 0, prompts_2);
  }
  const torch::Tensor embeds = text.embeds.repeat_interleave(k, 0).to(device, dtype);
  const torch::Tensor pooled = text.pooled.repeat_interleave(k, 0).to(device, dtype);
  const torch::Tensor txt_ids =
      torch::zeros({embeds.size(1), 3}, torch::TensorOptions().device(device).dtype(dtype));

  // 2. prepare_latents: randn_tensor on the CPU generator in float32, then moved; packed.
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const torch::Tensor noise = at::randn({n * k, channels, h, w}, gen, torch::kFloat32);
  torch::Tensor x = models::pack_latents(noise.to(device, dtype));
  const torch::Tensor img_ids = models::latent_image_ids(h / 2, w / 2).to(device, dtype);

  // 3. timesteps: numpy's linspace(1, 1/N, N) and mu from the packed sequence length.
  const int64_t steps = r.num_inference_steps;
  // numpy.linspace: start + i * step, the last value exactly `stop`.
  std::vector<double> sigmas(static_cast<size_t>(steps), 1.0);
  const double last = 1.0 / static_cast<double>(steps);
  if (steps > 1) {
    const double step = (last - 1.0) / static_cast<double>(steps - 1);
    for (int64_t i = 0; i < steps; ++i)
      sigmas[static_cast<size_t>(i)] = 1.0 + static_cast<double>(i) * step;
    sigmas.back() = last;
  }
  diffusion::TimestepOptions schedule;
  schedule.sigmas = sigmas;
  schedule.mu = diffusion::flow_match_mu(x.size(1), p.scheduler->config());
  p.scheduler->set_timesteps_with(steps, schedule);

  // 4. the loop; guidance only for guidance-distilled models (FLUX.1-dev).
  torch::Tensor guidance;
  if (tcfg.guidance_embeds()) {
    guidance = torch::full({n * k}, *r.guidance_scale,
                           torch::TensorOptions().device(device).dtype(torch::kFloat32));
  }
  const torch::Tensor timesteps = p.scheduler->timesteps();
  for (int64_t i = 0; i < timesteps.size(0); ++i) {
    const double t = p.scheduler->timestep(i);
    const torch::Tensor timestep = timesteps[i].expand({n * k}).to(device, x.scalar_type()) / 1000;
    const torch::Tensor v =
        p.transformer->forward(x, embeds, pooled, timestep, guidance, img_ids, txt_ids);
    x = p.scheduler->step(v, t, x);
    if (r.on_step) r.on_step(++*step_counter, total_steps);
  }

  // 5. decode.
  const torch::Tensor z = models::unpack_latents(x, h, w);
  const auto vae_dtype = models::module_dtype(*p.vae);
  const torch::Tensor decoded = p.vae->decode(p.vae->unscale_latents(z.to(vae_dtype)));
  FluxRun out;
  out.images = (decoded.to(torch::kCPU, torch::kFloat32) / 2 + 0.5)
                   .clamp(0, 1)
                   .permute({0, 2, 3, 1})
                   .contiguous();
  out.latents = z.to(torch::kCPU, torch::kFloat32);
  out.prompt_embeds = embeds.to(torch::kCPU, torch::kFloat32);
  out.pooled = pooled.to(torch::kCPU, torch::kFloat32);
  return out;
}

}  // namespace

FluxFolder resolve_flux_folder(const std::string& dir) {
  const PipelineComponents c = resolve_pipeline_components(
      dir, "FluxPipeline",
      {"transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"},
      "transformer, vae, text_encoder, tokenizer, text_encoder_2, tokenizer_2 and scheduler");
  FluxFolder f;
  f.dir = dir;
  f.pipeline_class = c.pipeline_class;
  f.transformer_dir = c.paths.at("transformer");
  f.vae_dir = c.paths.at("vae");
  f.text_encoder_dir = c.paths.at("text_encoder");
  f.tokenizer_dir = c.paths.at("tokenizer");
  f.text_encoder_2_dir = c.paths.at("text_encoder_2");
  f.tokenizer_2_dir = c.paths.at("tokenizer_2");
  f.scheduler_config = c.scheduler_config;
  return f;
}

int64_t flux_vae_scale_factor(const models::AutoencoderKLConfig& vae) {
  return int64_t{1} << static_cast<int64_t>(vae.block_out_channels.size());
}

void FluxPipeline::to(const torch::Device& device, std::optional<torch::Dtype> dtype) {
  if (text_encoders.empty() || !transformer || !vae) {
    throw Error("FluxPipeline::to: the pipeline is missing its text encoders, transformer or VAE");
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

diffusion::GenerateRequest FluxPipeline::resolve(diffusion::GenerateRequest r) const {
  if (r.num_images == 0) r.num_images = 1;
  if (r.num_inference_steps == 0) r.num_inference_steps = 28;
  if (!r.guidance_scale) r.guidance_scale = 3.5;
  if (r.max_sequence_length == 0) r.max_sequence_length = kFluxMaxSequenceLength;
  const int64_t side = kFluxDefaultSampleSize * flux_vae_scale_factor(vae->config());
  if (r.height == 0) r.height = side;
  if (r.width == 0) r.width = side;
  return r;
}

diffusion::GenerateResult FluxPipeline::generate(const diffusion::GenerateRequest& request) {
  const diffusion::GenerateRequest r = resolve(request);
  if (!r.class_labels.empty()) throw Error("--class_labels is for class-conditional UNets");
  if (r.prompts.empty()) throw Error("FLUX.1 needs at least one prompt (--prompt)");
  if (!r.negative_prompts.empty()) {
    throw Error(
        "FluxPipeline takes no negative prompt (FLUX.1 samples without classifier-free "
        "guidance); leave --negative_prompt out");
  }
  if (r.num_images < 1) {
    throw Error("--num_images_per_prompt must be >= 1, got " + std::to_string(r.num_images));
  }
  if (r.max_sequence_length > kFluxMaxSequenceLength) {
    throw Error(fmt::format("--max_sequence_length {} is more than FluxPipeline's {}",
                            r.max_sequence_length, kFluxMaxSequenceLength));
  }
  // FluxPipeline.check_inputs (v0.31): multiples of 8; the latent size then floors to the VAE.
  if (r.height % 8 != 0 || r.width % 8 != 0) {
    throw Error(fmt::format("--height {} and --width {} must be multiples of 8 (FluxPipeline)",
                            r.height, r.width));
  }
  const int64_t vsf = flux_vae_scale_factor(vae->config());
  if (r.height < vsf || r.width < vsf) {
    throw Error(fmt::format("--height {} and --width {} must be at least {} (the VAE factor x 2)",
                            r.height, r.width, vsf));
  }
  const std::vector<std::string> prompts_2 = flux_second_prompts(r);
  if (r.prompt_embeds.defined() != r.pooled_prompt_embeds.defined() ||
      (r.prompt_embeds.defined() &&
       (r.prompt_embeds.dim() != 3 || r.pooled_prompt_embeds.dim() != 2 ||
        r.prompt_embeds.size(0) != static_cast<int64_t>(r.prompts.size()) ||
        r.pooled_prompt_embeds.size(0) != r.prompt_embeds.size(0)))) {
    throw Error(fmt::format(
        "FluxPipeline: prompt_embeds and pooled_prompt_embeds go together, one row per prompt "
        "([{}, L, D] and [{}, P])",
        r.prompts.size(), r.prompts.size()));
  }
  transformer->eval();
  vae->eval();
  for (auto* m : text_encoders.modules()) m->eval();
  torch::NoGradGuard no_grad;

  const int64_t k = r.num_images;
  const int64_t n = static_cast<int64_t>(r.prompts.size());
  int64_t counter = 0;
  diffusion::GenerateResult out;
  if (r.seeding == diffusion::Seeding::kBatch) {
    const FluxRun run =
        flux_run(*this, r, r.prompts, prompts_2, 0, k, r.seed, &counter, r.num_inference_steps);
    out.images = run.images;
    out.latents = run.latents;
    out.prompt_embeds = run.prompt_embeds;
    out.pooled_prompt_embeds = run.pooled;
  } else {
    std::vector<torch::Tensor> images, latents, embeds, pooled;
    const int64_t total = n * k * r.num_inference_steps;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < k; ++j) {
        const auto idx = static_cast<size_t>(i);
        const FluxRun run = flux_run(*this, r, {r.prompts[idx]}, {prompts_2[idx]}, i, 1,
                                     r.seed + static_cast<uint64_t>(i * k + j), &counter, total);
        images.push_back(run.images);
        latents.push_back(run.latents);
        embeds.push_back(run.prompt_embeds);
        pooled.push_back(run.pooled);
      }
    }
    out.images = torch::cat(images);
    out.latents = torch::cat(latents);
    out.prompt_embeds = torch::cat(embeds);
    out.pooled_prompt_embeds = torch::cat(pooled);
  }
  out.labels = diffusion::prompt_labels(r.prompts, k);
  return out;
}

void check_flux_parts(const FluxFolder& f, const models::FluxTransformer2DModelImpl& transformer,
                      const models::AutoencoderKLImpl& vae,
                      const diffusion::TextEncoderStack& text) {
  const auto& tcfg = transformer.options();
  const auto& vcfg = vae.config();
  if (tcfg.in_channels() != 4 * vcfg.latent_channels) {
    throw Error(fmt::format(
        "{}: in_channels {} differs from 4 x the VAE's latent_channels {} (2x2 patches); the "
        "folder mixes models",
        f.transformer_dir, tcfg.in_channels(), vcfg.latent_channels));
  }
  if (tcfg.joint_attention_dim() != text.embed_dim()) {
    throw Error(fmt::format(
        "{}: joint_attention_dim {} differs from text_encoder_2's d_model {}; the folder mixes "
        "models",
        f.transformer_dir, tcfg.joint_attention_dim(), text.embed_dim()));
  }
  if (tcfg.pooled_projection_dim() != text.pooled_dim()) {
    throw Error(fmt::format(
        "{}: pooled_projection_dim {} differs from text_encoder's hidden_size {}; the folder "
        "mixes models",
        f.transformer_dir, tcfg.pooled_projection_dim(), text.pooled_dim()));
  }
}

diffusion::TextEncoderStack load_flux_text_encoders(const FluxFolder& f, const std::string& variant,
                                                    torch::Dtype dtype) {
  diffusion::TextEncoders encoders = {
      diffusion::ClipTextEncoder::load(
          {"text_encoder", "tokenizer", f.text_encoder_dir, f.tokenizer_dir},
          /*with_projection=*/false, variant, dtype),
      diffusion::T5TextEncoder::load(
          {"text_encoder_2", "tokenizer_2", f.text_encoder_2_dir, f.tokenizer_2_dir}, variant,
          dtype)};
  return diffusion::TextEncoderStack(diffusion::pooled_and_sequence(0, 1), std::move(encoders));
}

FluxPipeline load_flux_pipeline(const std::string& dir,
                                const diffusion::PipelineLoadOptions& options, torch::Dtype dtype) {
  FluxPipeline p;
  p.folder = resolve_flux_folder(dir);
  const FluxFolder& f = p.folder;
  if (options.dtype) dtype = *options.dtype;
  p.text_encoders = load_flux_text_encoders(f, options.variant, dtype);
  // The big models are read straight in `dtype` (the LoRA merge below adds in float32 per module).
  p.transformer = models::load_flux_transformer(f.transformer_dir, dtype, options.variant);
  p.vae =
      models::load_autoencoder_kl(options.vae.empty() ? f.vae_dir : options.vae, options.variant);
  p.scheduler = diffusion::load_sampler(f.scheduler_config, options.scheduler);
  if (p.scheduler->class_name() != "FlowMatchEulerDiscreteScheduler") {
    throw Error("--scheduler " + options.scheduler + " is a " + p.scheduler->class_name() +
                "; FLUX.1 is a flow-matching model: use flow_match_euler (or leave --scheduler "
                "out for the folder's own)");
  }
  check_flux_parts(f, *p.transformer, *p.vae, p.text_encoders);
  if (!options.lora.empty()) {
    const io::LoraWeights lora = read_flux_lora(options.lora, dir);
    check_lora_fits_family(lora, options.lora, dir);
    const auto t = models::merge_lora(*p.transformer, lora, options.lora_scale, "transformer");
    int64_t te_merged = 0;
    for (const auto& e : p.text_encoders.encoders()) {
      // The CLIP only, as before the encoders were components: T5 LoRA keys are not merged.
      if (lora.count(e->component()) == 0 || e->class_name() == "T5EncoderModel") continue;
      te_merged +=
          models::merge_lora(*e->module(), lora, options.lora_scale, e->component()).modules_merged;
    }
    log::info(
        "LoRA {} ({} format): merged into {} transformer and {} text encoder modules, "
        "scale {}",
        options.lora, io::format_label(lora), t.modules_merged, te_merged, options.lora_scale);
    const int64_t others = t.other_component_targets - te_merged;
    if (others > 0) {
      log::warn("LoRA {}: {} targets for other components (e.g. text_encoder_2) were not applied",
                options.lora, others);
    }
  }
  if (dtype != torch::kFloat32) p.vae->to(dtype);
  return p;
}

}  // namespace difftrain::families::flux
