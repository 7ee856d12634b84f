// The data side of the text-to-image tasks (text_image_data.h).
#include "text_image_data.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <optional>
#include <set>
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/core/sample_rng.h"
#include "difftrain/data/media_reader.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/image.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/module_info.h"
#include "difftrain/models/pretrained.h"
#include "difftrain/train/class_images.h"
#include "difftrain/train/training_cache.h"

namespace difftrain::families {
using namespace difftrain::train;
namespace fs = std::filesystem;

void TextImageData::check_options(const TaskOptions& o, const std::string& model) {
  const auto& d = o.data;
  const auto& t = o.text;
  if (d.dataset != "imagefolder") {
    throw Error(model +
                " is a text-to-image pipeline: train it on captioned images with --dataset "
                "imagefolder --train_data_dir DIR (metadata.jsonl captions or --instance_prompt)");
  }
  if (t.cache_latents && (!d.center_crop || d.random_flip)) {
    throw Error(
        "--cache_latents encodes each image once, so it needs the same pixels every epoch: add "
        "--center_crop and drop --random_flip (or train without --cache_latents)");
  }
  if (d.crop_width > 0 && t.with_prior_preservation) {
    throw Error(
        "--resolution W,H with --with_prior_preservation is not supported: the class images are "
        "square; give one side (--resolution N) for DreamBooth with prior preservation");
  }
  if (d.resolution_buckets && t.with_prior_preservation) {
    throw Error(
        "--resolution_buckets with --with_prior_preservation is not supported: a batch holds "
        "instance and class images together, so they would need one size; train DreamBooth "
        "with square crops");
  }
}

void TextImageData::build(accel::Accelerator& acc, const std::string& output_dir, Parts parts,
                          const ClassImages& class_images, bool cache_text) {
  parts_ = std::move(parts);
  const auto& d = o_.data;
  const auto& t = o_.text;
  const int64_t factor = parts_.size_multiple;
  for (const int64_t side : {d.crop_width, d.crop_height}) {  // --resolution W,H
    if (side > 0 && side % factor != 0) {
      const int64_t below = side / factor * factor;
      throw Error("--resolution " + std::to_string(d.width()) + "," + std::to_string(d.height()) +
                  ": " + std::to_string(side) + " is not a multiple of " + std::to_string(factor) +
                  " (" + parts_.size_reason + "); use " +
                  (below >= 8 ? std::to_string(below) + " or " : "") +
                  std::to_string(below + factor));
    }
  }
  if (d.resolution % factor != 0) {
    const int64_t below = d.resolution / factor * factor;
    throw Error("--resolution " + std::to_string(d.resolution) + " is not a multiple of " +
                std::to_string(factor) + " (" + parts_.size_reason + "); use " +
                (below >= 8 ? std::to_string(below) + " or " : "") +
                std::to_string(below + factor));
  }
  TextImageDataset::Half inst = captioned_images(d, d.train_data_dir, t.instance_prompt);
  // kohya's prefix and suffix are fixed text: part of every epoch's caption (and the cache's).
  if (t.captions.affixes()) {
    for (auto& c : inst.captions) c = t.captions.fixed(c);
  }
  if (t.captions.varies() && cache_text) {
    if (!parts_.text_cache_reason.empty()) {
      throw Error(
          std::string(t.captions.shuffle ? "--shuffle_caption" : "--caption_tag_dropout_rate") +
          " changes the captions every epoch, and this run trains on cached text "
          "embeddings (" +
          parts_.text_cache_reason + "): leave it out");
    }
    cache_text = false;  // the captions are encoded batch by batch instead
  }
  if (d.max_train_samples > 0 && d.max_train_samples < inst.images->size()) {
    acc.warn("--max_train_samples is not applied to text-to-image data");
  }
  std::optional<TextImageDataset::Half> cls;
  if (t.with_prior_preservation) {
    prior_ = true;
    train::generate_class_images(
        acc, {t.class_data_dir, t.class_prompt, t.num_class_images, o_.data.seed}, class_images);
    DataOptions class_data = d;
    class_data.masked_loss = false;  // class images train whole (kohya: no mask = all ones)
    cls = captioned_images(class_data, t.class_data_dir, t.class_prompt);
  }
  std::shared_ptr<data::ImageFolderDataset> instance_images = inst.images;
  if (acc.is_main_process()) {
    // Once per run, for every caption: what the tokenizers will cut.
    std::set<std::string> unique(inst.captions.begin(), inst.captions.end());
    if (cls) unique.insert(cls->captions.begin(), cls->captions.end());
    for (const auto& line :
         parts_.text->truncation_report({unique.begin(), unique.end()}, "caption")) {
      log::warn("{}", line);
    }
  }
  parts_.text->set_truncation_reported();  // the caption cache's encode() stays silent
  dataset_ = std::make_shared<TextImageDataset>(std::move(inst), std::move(cls), caption_ids());
  dataset_->set_caption_processing(t.captions, d.seed);
  if (d.resolution_buckets) {
    assign_buckets(acc, *instance_images, *dataset_);
  } else if (d.crop_width > 0) {
    // kohya's --resolution W,H: every image cropped to W x H.
    instance_images->set_target_sizes(std::vector<std::array<int64_t, 2>>(
        static_cast<size_t>(instance_images->size()), {d.crop_height, d.crop_width}));
  }
  if (t.cache_latents || cache_text) fill_cache(acc, *dataset_, output_dir, cache_text);
}

std::function<std::vector<int64_t>(int64_t)> TextImageData::sampler() const {
  if (!buckets_) return {};
  auto layout = buckets_;
  const uint64_t seed = o_.data.seed;
  return [layout, seed](int64_t epoch) { return layout->epoch_order(seed, epoch); };
}

CaptionIds TextImageData::caption_ids() const {
  // Tokenizing needs no model: the dataset keeps none alive.
  auto text = parts_.text->tokenizers_only();
  return [text](data::Example& ex, const std::string& prefix, const std::string& caption) {
    for (auto& [key, ids] : text.tokenize(caption)) ex[prefix + key] = ids;
  };
}

diffusion::PromptEmbeds TextImageData::encode_ids(const data::Batch& batch,
                                                  const std::string& prefix) {
  const auto tokens = parts_.text->tokens_of(batch, prefix);
  std::optional<torch::NoGradGuard> no_grad;
  if (!o_.lora.train_text_encoder) no_grad.emplace();
  return parts_.text->encode_tokens(tokens, parts_.clip_skip);
}

std::map<std::string, torch::Tensor> TextImageData::encode_captions(
    const std::vector<std::string>& captions) {
  const auto e = parts_.text->encode(captions, parts_.clip_skip);
  std::map<std::string, torch::Tensor> out = {
      {"prompt_embeds", e.embeds.to(torch::kCPU, torch::kFloat32)}};
  if (e.pooled.defined()) out["pooled_prompt_embeds"] = e.pooled.to(torch::kCPU, torch::kFloat32);
  if (e.attention_mask.defined()) {
    out["prompt_attention_mask"] = e.attention_mask.to(torch::kCPU, torch::kInt64);
  }
  return out;
}

std::string TextImageData::text_cache_key() const {
  // The first encoder's config, files and clip_skip, then each further encoder's files (the
  // names caches written before the stack had); what else an encoder's embeddings depend on
  // (a T5's token count).
  const auto& text = *parts_.text;
  std::string key = io::read_file(text[0].model_dir() + "/config.json") +
                    folder_stamp(text[0].model_dir()) + folder_stamp(text[0].tokenizer_dir()) +
                    std::to_string(parts_.clip_skip);
  // The first encoder's own rule (a decoder LLM's token count and template) and what the
  // composition makes of the states (Qwen-Image's cut), when they say anything.
  const std::string first = text[0].cache_key();
  if (!first.empty()) key += ";first " + first;
  if (text.composition()) key += ";composition " + text.composition()->name();
  for (size_t i = 1; i < text.size(); ++i) {
    key += (i == 1 ? "xl;" : ";") + folder_stamp(text[i].model_dir()) +
           folder_stamp(text[i].tokenizer_dir());
    const std::string extra = text[i].cache_key();
    if (!extra.empty()) key += ";" + extra;
  }
  return key;
}

void TextImageData::assign_buckets(accel::Accelerator& acc, data::ImageFolderDataset& images,
                                   TextImageDataset& ds) {
  const auto& d = o_.data;
  const int64_t factor = parts_.size_multiple;
  if (d.bucket_step % factor != 0) {
    throw Error("--bucket_step " + std::to_string(d.bucket_step) + " is not a multiple of " +
                std::to_string(factor) + " (" + parts_.size_reason + ")");
  }
  data::BucketOptions bo;
  bo.resolution = d.resolution;
  bo.step = d.bucket_step;
  bo.min_side = d.bucket_min_side;
  bo.max_side = d.bucket_max_side;
  std::vector<std::array<int64_t, 2>> sizes;
  for (int64_t i = 0; i < images.size(); ++i) sizes.push_back(data::media_size(images.file(i)));
  const int64_t group = acc.options().split_batches
                            ? d.train_batch_size
                            : d.train_batch_size * static_cast<int64_t>(acc.num_processes());
  buckets_ = std::make_shared<data::BucketLayout>(data::make_buckets(bo), sizes, group);
  images.set_target_sizes(buckets_->image_targets());
  std::vector<int64_t> slots;
  for (int64_t k = 0; k < buckets_->num_slots(); ++k) slots.push_back(buckets_->image_of_slot(k));
  ds.set_slots(std::move(slots));
  std::string lines;
  for (const auto& line : buckets_->summary()) lines += (lines.empty() ? "" : ", ") + line;
  acc.print("aspect-ratio buckets: {} image(s) in {} slot(s) ({}), batches of one bucket",
            images.size(), buckets_->num_slots(), lines);
}

void TextImageData::fill_cache(accel::Accelerator& acc, TextImageDataset& ds,
                               const std::string& output_dir, bool cache_text) {
  const auto& d = o_.data;
  const auto& t = o_.text;
  const fs::path dir = t.cache_dir.empty() ? fs::path(output_dir) / "cache" : fs::path(t.cache_dir);
  if (acc.is_main_process()) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw Error("cannot create cache_dir " + dir.string() + ": " + ec.message());
  }
  acc.wait_for_everyone();
  if (t.cache_latents) {
    // The key changes when the VAE, the images or their preprocessing change.
    const std::string vae_key =
        "latents-v2;" + io::read_file(parts_.vae_dir + "/config.json") +
        file_stamp(models::weights_path(parts_.vae_dir, parts_.vae_variant)) +
        std::to_string(d.resolution) + ";" + std::to_string(d.center_crop) + ";" +
        (d.crop_width > 0 ? fmt::format("crop {}x{};", d.crop_width, d.crop_height)
                          : std::string()) +
        (d.resolution_buckets
             ? fmt::format("buckets {} {} {};", d.bucket_step, d.bucket_min_side, d.bucket_max_side)
             : std::string());
    auto cache_half = [&](TextImageDataset::Half& half, const std::string& name,
                          const std::string& data_dir) {
      const fs::path file =
          dir / (name + "-" + cache_key(vae_key + folder_stamp(data_dir)) + ".safetensors");
      std::tie(half.mean, half.logvar) =
          cached_latents(acc, *half.images, file, parts_.vae.encode, o_.encode_batch_size);
      // The cache needs centre crops without flips: each image's geometry is fixed, so is its
      // mask.
      half.geometry = centre_crop_geometry(*half.images);
      if (half.images->options().masks) {
        half.masks.clear();
        for (int64_t i = 0; i < half.images->size(); ++i) {
          half.masks.push_back(half.images->get(i).at("mask"));
        }
      }
    };
    cache_half(ds.instance(), "latents", d.train_data_dir);
    if (ds.class_half()) cache_half(*ds.class_half(), "class-latents", t.class_data_dir);
  }

  if (!cache_text || o_.lora.train_text_encoder) return;
  std::set<std::string> unique(ds.instance().captions.begin(), ds.instance().captions.end());
  if (ds.class_half()) unique.insert(t.class_prompt);
  if (t.captions.drops()) unique.insert("");  // a dropped caption is the empty one
  std::string key = "embeds-v2;" + text_cache_key();
  for (const auto& s : unique) key += "\n" + s;
  const fs::path file = dir / ("text-embeddings-" + cache_key(key) + ".safetensors");
  const std::vector<std::string> captions(unique.begin(), unique.end());
  if (!fs::exists(file)) {
    build_text_embedding_cache(acc, captions, file, [this](const std::vector<std::string>& c) {
      return encode_captions(c);
    });
  }
  acc.wait_for_everyone();
  ds.cached_text = load_text_embedding_cache(file);
  text_cache_filled_ = true;
}

EncodedBatch TextImageData::encode_batch(const data::Batch& batch, int64_t epoch,
                                         torch::Device device, std::vector<int64_t>& keys) {
  const auto index = batch.at("index").to(torch::kCPU);
  keys.assign(index.data_ptr<int64_t>(), index.data_ptr<int64_t>() + index.numel());
  EncodedBatch in = encode(batch, "", keys, epoch, device);
  if (!prior_) return in;
  std::vector<int64_t> class_keys;
  for (int64_t k : keys) class_keys.push_back(train::class_key(k));
  const EncodedBatch cls = encode(batch, "class_", class_keys, epoch, device);
  const auto join = [](const torch::Tensor& a, const torch::Tensor& b) {
    return a.defined() && b.defined() ? torch::cat({a, b}) : a;
  };
  in.latents = join(in.latents, cls.latents);
  in.embeds = join(in.embeds, cls.embeds);
  in.pooled = join(in.pooled, cls.pooled);
  in.time_ids = join(in.time_ids, cls.time_ids);
  in.attention_mask = join(in.attention_mask, cls.attention_mask);
  if (in.loss_mask.defined()) {
    auto ones = torch::ones({cls.latents.size(0), 1, in.loss_mask.size(2), in.loss_mask.size(3)},
                            in.loss_mask.options());
    in.loss_mask = torch::cat({in.loss_mask, ones});
  }
  keys.insert(keys.end(), class_keys.begin(), class_keys.end());
  return in;
}

torch::Tensor TextImageData::reduce_losses(const torch::Tensor& losses) const {
  if (!prior_) return losses.mean();
  const int64_t B = losses.size(0) / 2;
  return losses.narrow(0, 0, B).mean() + o_.text.prior_loss_weight * losses.narrow(0, B, B).mean();
}

train::ModelCard TextImageTask::transformer_model_card(
    const std::string& family, const std::string& script, const std::string& tag,
    const std::string& pipeline_class, const std::vector<std::string>& lora_targets) const {
  train::ModelCard card;
  const bool lora = o_.lora.enabled, dreambooth = !o_.text.instance_prompt.empty();
  card.base_model = o_.model.pretrained_model_name_or_path;
  card.title = family + " " + (dreambooth ? "DreamBooth " : "") + (lora ? "LoRA" : "fine-tune");
  card.description =
      "A text-to-image " + std::string(dreambooth ? "DreamBooth " : "") + "fine-tune of `" +
      card.base_model + "` (" +
      (lora ? std::string("LoRA adapters on the transformer") : "the whole transformer") +
      "), trained with `difftrain train` (Diffusers' " + script + ") on " +
      (o_.data.train_data_dir.empty() ? std::string("its dataset")
                                      : "`" + o_.data.train_data_dir + "`") +
      ".";
  card.license = "apache-2.0";
  card.tags = {"text-to-image", "diffusers-training", "diffusers", tag};
  card.pipeline_class = pipeline_class;
  card.torch_dtype = "torch.bfloat16";
  card.lora = lora;
  card.lora_weight_name = "pytorch_lora_weights.safetensors";
  train::add_task_details(card, o_);
  if (lora) {
    train::set_card_detail(card, "LoRA target modules",
                           fmt::format("{}", fmt::join(lora_targets, ", ")));
  }
  card.sample_flags = {"--prompt", train::card_prompt(o_),
                       "--height", std::to_string(o_.data.height()),
                       "--width",  std::to_string(o_.data.width())};
  return card;
}

void TextImageTask::export_transformer_run(const fs::path& out, const TransformerFolder& folder,
                                           const torch::nn::Module& transformer,
                                           const models::LoraLayers& lora,
                                           const std::function<void(io::LoraWeights&)>& to_kohya,
                                           const std::string& pipeline_class) const {
  if (!o_.lora.enabled) {
    const fs::path dir = out / "transformer";
    fs::create_directories(dir);
    io::write_file_atomic((dir / "config.json").string(),
                          io::read_file(folder.transformer_dir + "/config.json"));
    io::TensorMap tensors;
    for (const auto& [name, t] : models::named_tensors(transformer)) tensors[name] = t.detach();
    io::save_safetensors((dir / "diffusion_pytorch_model.safetensors").string(), tensors,
                         {{"format", "pt"}});
    std::vector<std::string> parts = {"vae", "scheduler", "text_encoder", "tokenizer"};
    std::error_code ec;
    if (fs::is_directory(fs::path(folder.dir) / "processor", ec)) parts.push_back("processor");
    copy_pipeline_parts(folder.dir, out, parts);
    // A run that trained another pipeline of the family (Qwen-Image-Edit from a Qwen-Image
    // folder) names its own class.
    const fs::path index = out / "model_index.json";
    nlohmann::json j = nlohmann::json::parse(io::read_file(index.string()));
    if (j.value("_class_name", std::string()) != pipeline_class) {
      j["_class_name"] = pipeline_class;
      io::write_file_atomic(index.string(), j.dump(2) + "\n");
    }
    log::info("pipeline folder ({}): {}", pipeline_class, out.string());
    return;
  }
  write_transformer_lora(out, o_, lora, [&](io::LoraWeights& l, io::LoraFormat format) {
    if (format == io::LoraFormat::kKohya) to_kohya(l);
  });
}

void write_transformer_lora(const fs::path& out, const train::TaskOptions& o,
                            const models::LoraLayers& lora,
                            const std::function<void(io::LoraWeights&, io::LoraFormat)>& adapt) {
  const io::LoraWeights weights = lora->to_lora_weights("transformer");
  const auto path = (out / "pytorch_lora_weights.safetensors").string();
  const std::map<std::string, std::string> meta = {
      {"difftrain_rank", std::to_string(o.lora.rank)},
      {"difftrain_lora_alpha", std::to_string(o.lora.alpha)}};
  if (o.lora.format == "kohya") {
    // lora_unet_<module> with .alpha: what musubi-tuner and Diffusers' converters read.
    io::LoraWeights kohya = weights;
    adapt(kohya, io::LoraFormat::kKohya);
    io::write_lora(path, kohya, io::LoraFormat::kKohya, meta);
  } else if (o.lora.format == "comfyui") {
    // diffusion_model.<module>.lora_down / lora_up / .alpha: ComfyUI's and musubi-tuner's keys.
    io::LoraWeights comfy = weights;
    adapt(comfy, io::LoraFormat::kComfyUI);
    io::write_lora(path, comfy, io::LoraFormat::kComfyUI, meta);
  } else if (o.lora.format == "peft") {
    io::write_lora(path, weights, io::LoraFormat::kPeft, meta);
  } else {
    // As the pipeline's save_lora_weights of the PEFT state dict: "transformer.<module>.lora_A
    // .weight", alpha / r folded into lora_B.
    io::Metadata m(meta.begin(), meta.end());
    m.emplace("format", "pt");
    io::save_safetensors(path, io::lora_to_tensors(weights, io::LoraFormat::kPeft), m);
  }
  log::info("LoRA weights ({} format): {}", o.lora.format, path);
}

ImageVae image_vae(const models::AutoencoderKL& vae) {
  models::AutoencoderKL v = vae;  // a handle: the same module
  ImageVae out;
  out.module = v.ptr();
  out.encode = [v](const torch::Tensor& px) mutable {
    return v->encode(px.to(models::module_device(*v), models::module_dtype(*v)));
  };
  out.scale = [v](const torch::Tensor& z) { return v->scale_latents(z); };
  return out;
}

EncodedBatch TextImageData::encode(const data::Batch& batch, const std::string& prefix,
                                   const std::vector<int64_t>& keys, int64_t epoch,
                                   torch::Device device) {
  EncodedBatch out;
  torch::Tensor mean, logvar;
  if (batch.count(prefix + "latent_mean")) {
    mean = batch.at(prefix + "latent_mean").to(torch::kCPU, torch::kFloat32);
    logvar = batch.at(prefix + "latent_logvar").to(torch::kCPU, torch::kFloat32);
  } else {
    torch::NoGradGuard no_grad;
    const auto& px = batch.at(prefix + "pixel_values");
    auto post = parts_.vae.encode(px.to(torch::kCPU, torch::kFloat32));
    mean = post.mean.to(torch::kCPU, torch::kFloat32);
    logvar = post.logvar.to(torch::kCPU, torch::kFloat32);
  }
  // Each sample's posterior draw comes from its own stream (cached or not, the same numbers).
  std::vector<torch::Tensor> z;
  const auto shape = mean.sizes().slice(1).vec();
  for (size_t i = 0; i < keys.size(); ++i) {
    auto g = core::sample_generator(o_.noise.seed, epoch, keys[i], core::SampleStream::kLatent);
    const auto k = static_cast<int64_t>(i);
    if (parts_.latent_mode) {
      z.push_back(mean[k]);
      continue;
    }
    z.push_back(mean[k] + (0.5 * logvar[k]).exp() * torch::randn(shape, g, torch::kFloat32));
  }
  out.latents = parts_.vae.scale(torch::stack(z)).to(device);
  if (batch.count(prefix + "mask")) out.loss_mask = batch.at(prefix + "mask").to(device);
  if (batch.count(prefix + "prompt_embeds")) {
    out.embeds = batch.at(prefix + "prompt_embeds").to(device, torch::kFloat32);
    if (batch.count(prefix + "pooled_prompt_embeds")) {
      out.pooled = batch.at(prefix + "pooled_prompt_embeds").to(device, torch::kFloat32);
    }
    if (batch.count(prefix + "prompt_attention_mask")) {
      out.attention_mask = batch.at(prefix + "prompt_attention_mask").to(device, torch::kInt64);
    }
  } else {
    auto text = encode_ids(batch, prefix);
    out.embeds = text.embeds.to(device);
    if (text.pooled.defined()) out.pooled = text.pooled.to(device);
    if (text.attention_mask.defined()) out.attention_mask = text.attention_mask.to(device);
  }
  return out;
}

std::string prompt_validation_unavailable(const TaskOptions& o) {
  return o.validation.prompt.empty() ? "give --validation_prompt to render images during training"
                                     : "";
}

std::vector<std::string> prompt_validation_labels(const TaskOptions& o, int64_t K) {
  std::vector<std::string> labels;
  for (int64_t i = 0; i < K; ++i)
    labels.push_back("seed " + std::to_string(o.validation.seed + static_cast<uint64_t>(i)));
  return labels;
}

void copy_pipeline_parts(const fs::path& src, const fs::path& out,
                         const std::vector<std::string>& parts) {
  for (const auto& part : parts) {
    std::error_code ec;
    fs::remove_all(out / part, ec);
    fs::copy(src / part, out / part, fs::copy_options::recursive, ec);
    if (ec) {
      throw Error("cannot copy " + (src / part).string() + " to " + (out / part).string() + ": " +
                  ec.message());
    }
  }
  io::write_file_atomic((out / "model_index.json").string(),
                        io::read_file((src / "model_index.json").string()));
}

}  // namespace difftrain::families
