// Text-to-image training parts: captioned data, DreamBooth class images, the latent / text
// embedding cache, validation renders and the final pipeline folder.
#include "text_to_image.h"

#include "train_parts.h"

#include "difftrain/core/error.h"
#include "difftrain/data/image_folder.h"
#include "difftrain/data/sample_rng.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/image.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/pretrained.h"

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <filesystem>
#include <set>

namespace difftrain::train {
namespace fs = std::filesystem;
namespace {

// The class half of a DreamBooth batch draws its randomness under keys far from the instance
// indices, so the two halves never share a stream.
constexpr int64_t kClassKeyOffset = int64_t{1} << 40;

uint64_t fnv1a(const std::string& s, uint64_t h = 1469598103934665603ULL) {
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ULL;
  return h;
}

// What identifies a file's contents cheaply: its path, size and modification time.
std::string file_stamp(const fs::path& p) {
  std::error_code ec;
  const auto size = fs::file_size(p, ec);
  const auto time = fs::last_write_time(p, ec).time_since_epoch().count();
  return p.string() + ":" + std::to_string(ec ? 0 : size) + ":" + std::to_string(time) + ";";
}

std::string folder_stamp(const fs::path& dir) {
  std::vector<std::string> entries;
  std::error_code ec;
  for (const auto& e : fs::recursive_directory_iterator(dir, ec)) {
    if (e.is_regular_file()) entries.push_back(file_stamp(e.path()));
  }
  std::sort(entries.begin(), entries.end());
  std::string out;
  for (const auto& e : entries) out += e;
  return out;
}

std::string hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

torch::Device module_device(const torch::nn::Module& m) {
  const auto p = m.parameters();
  return p.empty() ? torch::Device(torch::kCPU) : p[0].device();
}

torch::Dtype module_dtype(const torch::nn::Module& m) {
  const auto p = m.parameters();
  return p.empty() ? torch::kFloat32 : p[0].scalar_type();
}

// Images plus a caption each: the instance images (metadata.jsonl captions or one prompt), and
// for DreamBooth the class images with the class prompt. Cached latents / embeddings replace
// the pixels / token ids when present.
class TextImageDataset : public data::Dataset {
 public:
  struct Half {
    std::shared_ptr<data::ImageFolderDataset> images;
    std::vector<std::string> captions;  // one per image
    torch::Tensor mean, logvar;         // cached posteriors [N, C, h, w], or undefined
  };

  TextImageDataset(Half instance, std::optional<Half> cls, const models::ClipTokenizer& tokenizer)
      : instance_(std::move(instance)), class_(std::move(cls)), tokenizer_(tokenizer) {}

  int64_t size() const override {
    const int64_t n = instance_.images->size();
    return class_ ? std::max(n, class_->images->size()) : n;
  }

  data::Example get(int64_t index) const override {
    data::Example ex;
    ex["index"] = torch::tensor(index, torch::kInt64);
    add(ex, "", instance_, index % instance_.images->size());
    if (class_) add(ex, "class_", *class_, index % class_->images->size());
    return ex;
  }

  void set_epoch(int64_t epoch) {
    instance_.images->set_epoch(epoch);
    if (class_) class_->images->set_epoch(epoch);
  }

  Half& instance() { return instance_; }
  std::optional<Half>& class_half() { return class_; }
  /// Cached text embeddings by caption (empty: tokenise instead).
  std::map<std::string, torch::Tensor> embeddings;

 private:
  void add(data::Example& ex, const std::string& prefix, const Half& half, int64_t i) const {
    if (half.mean.defined()) {
      ex[prefix + "latent_mean"] = half.mean[i];
      ex[prefix + "latent_logvar"] = half.logvar[i];
    } else {
      ex[prefix + "pixel_values"] = half.images->get(i).at("pixel_values");
    }
    const std::string& caption = half.captions[static_cast<size_t>(i)];
    auto it = embeddings.find(caption);
    if (it != embeddings.end()) {
      ex[prefix + "prompt_embeds"] = it->second;
    } else {
      ex[prefix + "input_ids"] = torch::tensor(tokenizer_.encode(caption).input_ids, torch::kInt64);
    }
  }

  Half instance_;
  std::optional<Half> class_;
  models::ClipTokenizer tokenizer_;
};

int64_t count_images(const fs::path& dir) {
  int64_t n = 0;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return 0;
  for (const auto& e : fs::recursive_directory_iterator(dir, ec)) {
    std::string ext = e.path().extension().string();
    std::transform(ext.begin(), ext.end(), ext.begin(),
                   [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
    if (e.is_regular_file() && (ext == ".png" || ext == ".jpg" || ext == ".jpeg" || ext == ".bmp"))
      ++n;
  }
  return n;
}

diffusion::StableDiffusion as_pipeline(TextToImageParts& t2i, models::UNet& unet,
                                       const diffusion::SchedulerConfig& scheduler,
                                       const std::string& sampler) {
  diffusion::StableDiffusion sd;
  sd.folder = t2i.folder;
  sd.tokenizer = t2i.tokenizer;
  sd.text_encoder = t2i.text_encoder;
  sd.vae = t2i.vae;
  sd.unet = unet;
  sd.scheduler = diffusion::make_sampler(scheduler.to_json(), sampler, "the training scheduler");
  return sd;
}

// DreamBooth: the class folder needs num_class_images images; the missing ones are drawn from
// the pretrained pipeline with the class prompt (image i from seed + i), split across ranks.
void generate_class_images(const TrainConfig& c, accel::Accelerator& acc, TextToImageParts& t2i,
                           models::UNet& unet) {
  const fs::path dir(c.class_data_dir);
  const int64_t have = count_images(dir);
  if (have >= c.num_class_images) return;
  if (fs::exists(dir / "metadata.jsonl")) {
    throw Error(c.class_data_dir + " has " + std::to_string(have) + " of --num_class_images " +
                std::to_string(c.num_class_images) +
                " images and a metadata.jsonl; add the images, lower --num_class_images, or "
                "remove metadata.jsonl so difftrain can generate the rest");
  }
  const int64_t missing = c.num_class_images - have;
  acc.print("prior preservation: generating {} class image(s) of \"{}\" into {}", missing,
            c.class_prompt, c.class_data_dir);
  if (acc.is_main_process()) fs::create_directories(dir);
  acc.wait_for_everyone();
  const auto [begin, end] = acc.split_range(missing);
  {
    diffusion::SchedulerConfig sc = diffusion::SchedulerConfig::load(t2i.folder.scheduler_config);
    auto sd = as_pipeline(t2i, unet, sc, "ddim");
    auto autocast = acc.autocast();
    for (int64_t i = begin; i < end; ++i) {
      diffusion::TextToImageOptions o;
      o.prompts = {c.class_prompt};
      o.num_inference_steps = c.validation_inference_steps;
      o.guidance_scale = c.guidance_scale > 1 ? c.guidance_scale : 7.5;
      o.height = o.width = c.resolution;
      o.seed = c.seed + static_cast<uint64_t>(have + i);
      o.clip_skip = t2i.skip;
      auto img = diffusion::text_to_image(sd, o).images;  // [1, H, W, 3]
      char name[64];
      std::snprintf(name, sizeof name, "class_%06lld.png", static_cast<long long>(have + i));
      io::save_png((dir / name).string(), io::to_uint8_images(img.permute({0, 3, 1, 2}))[0]);
    }
  }
  acc.wait_for_everyone();
}

// Every rank encodes its share of the images, the main rank assembles one file, every rank
// loads it. Returns {mean, logvar} [N, C, h, w] float32 on the CPU.
std::pair<torch::Tensor, torch::Tensor> cached_latents(const TrainConfig& c,
                                                       accel::Accelerator& acc,
                                                       TextToImageParts& t2i,
                                                       const data::ImageFolderDataset& images,
                                                       const fs::path& file) {
  const auto load = [&] {
    auto st = io::load_safetensors(file.string());
    if (!st.tensors.count("mean") || !st.tensors.count("logvar") ||
        st.tensors.at("mean").size(0) != images.size()) {
      throw Error(file.string() + ": not a latent cache of " + std::to_string(images.size()) +
                  " images; delete it (it is rebuilt)");
    }
    return std::make_pair(st.tensors.at("mean").clone(), st.tensors.at("logvar").clone());
  };
  if (fs::exists(file)) {
    acc.print("cache_latents: reusing {}", file.string());
    return load();
  }
  const int64_t n = images.size();
  const int rank = acc.process_index(), world = acc.num_processes();
  const fs::path part = file.string() + ".part" + std::to_string(rank);
  {
    std::vector<int64_t> mine;
    for (int64_t i = rank; i < n; i += world) mine.push_back(i);
    std::vector<torch::Tensor> means, logvars;
    torch::NoGradGuard no_grad;
    auto autocast = acc.autocast();
    const auto device = module_device(*t2i.vae);
    const auto dtype = module_dtype(*t2i.vae);
    for (size_t s = 0; s < mine.size(); s += static_cast<size_t>(c.train_batch_size)) {
      std::vector<torch::Tensor> px;
      for (size_t k = s; k < std::min(mine.size(), s + c.train_batch_size); ++k)
        px.push_back(images.get(mine[k]).at("pixel_values"));
      auto post = t2i.vae->encode(torch::stack(px).to(device, dtype));
      means.push_back(post.mean.to(torch::kCPU, torch::kFloat32));
      logvars.push_back(post.logvar.to(torch::kCPU, torch::kFloat32));
    }
    io::TensorMap tensors = {{"indices", torch::tensor(mine, torch::kInt64)}};
    if (!means.empty())
      tensors["mean"] = torch::cat(means), tensors["logvar"] = torch::cat(logvars);
    io::save_safetensors(part.string(), tensors);
  }
  acc.wait_for_everyone();
  if (acc.is_main_process()) {
    torch::Tensor mean, logvar;
    for (int r = 0; r < world; ++r) {
      const fs::path p = file.string() + ".part" + std::to_string(r);
      auto st = io::load_safetensors(p.string());
      if (!st.tensors.count("mean")) continue;
      const auto& idx = st.tensors.at("indices");
      if (!mean.defined()) {
        auto shape = st.tensors.at("mean").sizes().vec();
        shape[0] = n;
        mean = torch::empty(shape, torch::kFloat32);
        logvar = torch::empty(shape, torch::kFloat32);
      }
      mean.index_copy_(0, idx, st.tensors.at("mean"));
      logvar.index_copy_(0, idx, st.tensors.at("logvar"));
    }
    io::save_safetensors(file.string(), {{"mean", mean}, {"logvar", logvar}},
                         {{"images", std::to_string(n)}});
    for (int r = 0; r < world; ++r) fs::remove(file.string() + ".part" + std::to_string(r));
    spdlog::info("cache_latents: encoded {} image(s) into {}", n, file.string());
  }
  acc.wait_for_everyone();
  return load();
}

}  // namespace

std::shared_ptr<TextToImageParts> build_text_to_image(const TrainConfig& c, accel::Accelerator& acc,
                                                      models::UNet& unet,
                                                      std::shared_ptr<data::Dataset>& dataset,
                                                      std::function<void(int64_t)>& set_epoch) {
  if (c.dataset != "imagefolder") {
    throw Error(c.pretrained_model_name_or_path +
                " is a text-to-image pipeline: train it on captioned images with --dataset "
                "imagefolder --train_data_dir DIR (metadata.jsonl captions or --instance_prompt)");
  }
  if (c.cache_latents && (!c.center_crop || c.random_flip)) {
    throw Error(
        "--cache_latents encodes each image once, so it needs the same pixels every epoch: add "
        "--center_crop and drop --random_flip (or train without --cache_latents)");
  }
  auto t2i = std::make_shared<TextToImageParts>();
  t2i->folder = diffusion::resolve_stable_diffusion_folder(c.pretrained_model_name_or_path);
  for (const auto& note : t2i->folder.notes) acc.print("{}", note);
  t2i->tokenizer = models::ClipTokenizer::from_folder(t2i->folder.tokenizer_dir);
  t2i->text_encoder = models::load_clip_text_model(t2i->folder.text_encoder_dir, c.variant);
  const auto& tcfg = t2i->text_encoder->config();
  if (t2i->tokenizer.model_max_length() > tcfg.max_position_embeddings)
    t2i->tokenizer.set_model_max_length(tcfg.max_position_embeddings);
  if (c.clip_skip > tcfg.num_hidden_layers) {
    throw Error("--clip_skip " + std::to_string(c.clip_skip) + " is more than the text encoder's " +
                std::to_string(tcfg.num_hidden_layers) + " layers");
  }
  t2i->skip = c.clip_skip - 1;
  t2i->vae = models::load_autoencoder_kl(t2i->folder.vae_dir, c.variant);
  unet = models::load_unet(t2i->folder.unet_dir, c.variant);
  if (!unet->needs_encoder_hidden_states()) {
    throw Error(t2i->folder.unet_dir +
                ": the UNet has no cross-attention; a text-to-image "
                "pipeline needs a UNet2DConditionModel");
  }
  for (auto& p : t2i->text_encoder->parameters()) p.set_requires_grad(false);
  for (auto& p : t2i->vae->parameters()) p.set_requires_grad(false);
  t2i->text_encoder->to(acc.device());
  t2i->vae->to(acc.device());
  t2i->vae->eval();
  t2i->text_encoder->eval();
  const int64_t factor = t2i->vae->config().downsample_factor();
  if (c.resolution % factor != 0) {
    const int64_t below = c.resolution / factor * factor;
    throw Error("--resolution " + std::to_string(c.resolution) + " is not a multiple of " +
                std::to_string(factor) + " (the VAE's downsampling factor); use " +
                (below >= 8 ? std::to_string(below) + " or " : "") +
                std::to_string(below + factor));
  }

  TextImageDataset::Half inst;
  inst.images =
      std::make_shared<data::ImageFolderDataset>(image_folder_options(c, c.train_data_dir, 3));
  if (inst.images->skipped() > 0) {
    acc.print("warning: skipped {} unreadable image(s) in {} (--skip_bad_images)",
              inst.images->skipped(), c.train_data_dir);
  }
  for (int64_t i = 0; i < inst.images->size(); ++i) {
    if (!c.instance_prompt.empty()) {
      inst.captions.push_back(c.instance_prompt);
      continue;
    }
    auto caption = inst.images->caption(i);
    if (!caption) {
      throw Error(inst.images->file(i) + " has no caption: add a \"" + c.caption_column +
                  "\" field to its line of " + c.train_data_dir +
                  "/metadata.jsonl (--caption_column), or give every image one --instance_prompt");
    }
    inst.captions.push_back(*caption);
  }
  if (c.max_train_samples > 0 && c.max_train_samples < inst.images->size()) {
    acc.print("warning: --max_train_samples is not applied to text-to-image data");
  }

  std::optional<TextImageDataset::Half> cls;
  if (c.with_prior_preservation) {
    t2i->prior = true;
    generate_class_images(c, acc, *t2i, unet);
    TextImageDataset::Half h;
    h.images =
        std::make_shared<data::ImageFolderDataset>(image_folder_options(c, c.class_data_dir, 3));
    h.captions.assign(static_cast<size_t>(h.images->size()), c.class_prompt);
    cls = std::move(h);
  }

  auto ds = std::make_shared<TextImageDataset>(std::move(inst), std::move(cls), t2i->tokenizer);
  if (c.cache_latents) {
    const fs::path dir =
        c.cache_dir.empty() ? fs::path(c.output_dir) / "cache" : fs::path(c.cache_dir);
    if (acc.is_main_process()) {
      std::error_code ec;
      fs::create_directories(dir, ec);
      if (ec) throw Error("cannot create cache_dir " + dir.string() + ": " + ec.message());
    }
    acc.wait_for_everyone();
    // The key changes when the VAE, the images or their preprocessing change.
    const std::string vae_key = "latents-v1;" +
                                io::read_file(t2i->folder.vae_dir + "/config.json") +
                                file_stamp(models::weights_path(t2i->folder.vae_dir, c.variant)) +
                                std::to_string(c.resolution) + ";" + std::to_string(c.center_crop);
    auto cache_half = [&](TextImageDataset::Half& half, const std::string& name,
                          const std::string& data_dir) {
      const std::string key = vae_key + folder_stamp(data_dir);
      const fs::path file = dir / (name + "-" + hex(fnv1a(key)) + ".safetensors");
      std::tie(half.mean, half.logvar) = cached_latents(c, acc, *t2i, *half.images, file);
    };
    cache_half(ds->instance(), "latents", c.train_data_dir);
    if (ds->class_half()) cache_half(*ds->class_half(), "class-latents", c.class_data_dir);
    t2i->latents_cached = true;

    if (!c.train_text_encoder) {
      std::set<std::string> unique(ds->instance().captions.begin(), ds->instance().captions.end());
      if (ds->class_half()) unique.insert(c.class_prompt);
      std::string key = "embeds-v1;" +
                        io::read_file(t2i->folder.text_encoder_dir + "/config.json") +
                        folder_stamp(t2i->folder.text_encoder_dir) +
                        folder_stamp(t2i->folder.tokenizer_dir) + std::to_string(t2i->skip);
      for (const auto& s : unique) key += "\n" + s;
      const fs::path file = dir / ("text-embeddings-" + hex(fnv1a(key)) + ".safetensors");
      const std::vector<std::string> captions(unique.begin(), unique.end());
      if (!fs::exists(file) && acc.is_main_process()) {
        torch::NoGradGuard no_grad;
        auto autocast = acc.autocast();
        std::vector<torch::Tensor> rows;
        for (size_t s = 0; s < captions.size(); s += 64) {
          std::vector<std::string> chunk(captions.begin() + s,
                                         captions.begin() + std::min(captions.size(), s + 64));
          rows.push_back(
              diffusion::encode_prompts(t2i->tokenizer, *t2i->text_encoder, chunk, t2i->skip)
                  .to(torch::kCPU, torch::kFloat32));
        }
        io::save_safetensors(file.string(), {{"embeds", torch::cat(rows)}},
                             {{"captions", nlohmann::json(captions).dump()}});
        spdlog::info("cache_latents: encoded {} caption(s) into {}", captions.size(),
                     file.string());
      }
      acc.wait_for_everyone();
      auto st = io::load_safetensors(file.string());
      const auto stored = nlohmann::json::parse(st.metadata.at("captions"));
      const auto embeds = st.tensors.at("embeds").clone();
      for (size_t i = 0; i < stored.size(); ++i)
        ds->embeddings[stored[i].get<std::string>()] = embeds[static_cast<int64_t>(i)];
      t2i->embeddings_cached = true;
    }
  }
  set_epoch = [ds](int64_t e) { ds->set_epoch(e); };
  dataset = ds;
  return t2i;
}

EncodedBatch encode_batch(const TrainConfig& c, TextToImageParts& t2i,
                          const std::map<std::string, torch::Tensor>& batch,
                          const std::string& prefix, const std::vector<int64_t>& keys,
                          int64_t epoch, torch::Device device) {
  EncodedBatch out;
  torch::Tensor mean, logvar;
  if (batch.count(prefix + "latent_mean")) {
    mean = batch.at(prefix + "latent_mean").to(torch::kCPU, torch::kFloat32);
    logvar = batch.at(prefix + "latent_logvar").to(torch::kCPU, torch::kFloat32);
  } else {
    torch::NoGradGuard no_grad;
    const auto& px = batch.at(prefix + "pixel_values");
    auto post = t2i.vae->encode(px.to(module_device(*t2i.vae), module_dtype(*t2i.vae)));
    mean = post.mean.to(torch::kCPU, torch::kFloat32);
    logvar = post.logvar.to(torch::kCPU, torch::kFloat32);
  }
  // Each sample's posterior draw comes from its own stream (cached or not, the same numbers).
  std::vector<torch::Tensor> z;
  const auto shape = mean.sizes().slice(1).vec();
  for (size_t i = 0; i < keys.size(); ++i) {
    auto g = data::sample_generator(c.seed, epoch, keys[i], data::SampleStream::kLatent);
    const auto k = static_cast<int64_t>(i);
    z.push_back(mean[k] + (0.5 * logvar[k]).exp() * torch::randn(shape, g, torch::kFloat32));
  }
  out.latents = t2i.vae->scale_latents(torch::stack(z)).to(device);
  if (batch.count(prefix + "prompt_embeds")) {
    out.embeds = batch.at(prefix + "prompt_embeds").to(device, torch::kFloat32);
  } else {
    const auto ids = batch.at(prefix + "input_ids").to(module_device(*t2i.text_encoder));
    if (c.train_text_encoder) {
      out.embeds = t2i.text_encoder->forward(ids, t2i.skip).last_hidden_state;
    } else {
      torch::NoGradGuard no_grad;
      out.embeds = t2i.text_encoder->forward(ids, t2i.skip).last_hidden_state;
    }
    out.embeds = out.embeds.to(device);
  }
  return out;
}

int64_t class_key(int64_t index) { return index + kClassKeyOffset; }

torch::Tensor render_validation(const TrainConfig& c, TextToImageParts& t2i, models::UNet& unet,
                                const diffusion::SchedulerConfig& scheduler,
                                const std::vector<int64_t>& image_indices) {
  auto sd = as_pipeline(t2i, unet, scheduler, c.validation_scheduler);
  std::vector<torch::Tensor> images;
  for (int64_t i : image_indices) {
    diffusion::TextToImageOptions o;
    o.prompts = {c.validation_prompt};
    o.negative_prompts = {c.validation_negative_prompt};
    o.num_inference_steps = c.validation_inference_steps;
    o.guidance_scale = c.guidance_scale > 1 ? c.guidance_scale : 7.5;
    o.height = o.width = c.resolution;
    o.seed = c.seed + static_cast<uint64_t>(i);
    o.clip_skip = t2i.skip;
    images.push_back(diffusion::text_to_image(sd, o).images);
  }
  if (images.empty()) return torch::zeros({0, c.resolution, c.resolution, 3});
  return torch::cat(images);
}

void export_text_to_image_pipeline(const TextToImageParts& t2i, const std::string& out_dir) {
  const fs::path src(t2i.folder.root), out(out_dir);
  for (const char* part : {"vae", "text_encoder", "tokenizer", "scheduler"}) {
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

}  // namespace difftrain::train
