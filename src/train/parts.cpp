// Building a run's parts (dataset, loader, UNet, LoRA, optimizer, schedules, EMA) and the
// training loss.
#include "difftrain/core/error.h"
#include "difftrain/data/image_folder.h"
#include "difftrain/data/mnist.h"
#include "difftrain/data/sample_rng.h"
#include "difftrain/diffusion/pipeline.h"
#include "difftrain/diffusion/scheduler_config.h"
#include "difftrain/diffusion/sd_pipeline.h"
#include "difftrain/models/pretrained.h"
#include "difftrain/models/unet_config.h"
#include "difftrain/optim/adamw.h"
#include "difftrain/optim/adamw8bit.h"
#include "train_parts.h"

#include <torch/torch.h>

#include <filesystem>
#include <fstream>

namespace difftrain::train {
namespace fs = std::filesystem;
namespace {

// The first `n` examples of a dataset (Diffusers' --max_train_samples).
class Subset : public data::Dataset {
 public:
  Subset(std::shared_ptr<data::Dataset> base, int64_t n) : base_(std::move(base)), n_(n) {}
  int64_t size() const override { return n_; }
  data::Example get(int64_t index) const override { return base_->get(index); }

 private:
  std::shared_ptr<data::Dataset> base_;
  int64_t n_;
};

// The UNet2DModel `difftrain train` builds when no config is given: small enough to train on a
// 2-core CPU in minutes, large enough to draw recognisable Fashion-MNIST garments.
nlohmann::json default_unet_config(int64_t resolution, int64_t channels) {
  return {{"_class_name", "UNet2DModel"},
          {"_diffusers_version", "0.31.0"},
          {"sample_size", resolution},
          {"in_channels", channels},
          {"out_channels", channels},
          {"layers_per_block", 1},
          {"block_out_channels", {32, 64, 64}},
          {"down_block_types", {"DownBlock2D", "DownBlock2D", "AttnDownBlock2D"}},
          {"up_block_types", {"AttnUpBlock2D", "UpBlock2D", "UpBlock2D"}},
          {"norm_num_groups", 8},
          {"attention_head_dim", 32}};
}

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error("cannot read '" + path + "'; check the path");
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw Error("'" + path + "' is not valid JSON (" + e.what() + ")");
  }
}

void build_dataset(const TrainConfig& c, TrainParts& parts) {
  if (c.dataset == "imagefolder") {
    data::ImageFolderOptions o =
        image_folder_options(c, c.train_data_dir, static_cast<int>(parts.channels));
    auto ds = std::make_shared<data::ImageFolderDataset>(o);
    if (ds->skipped() > 0) {
      spdlog::warn("skipped {} unreadable image(s) in {} (--skip_bad_images), e.g. {}",
                   ds->skipped(), o.dir, ds->skipped_files().front());
    }
    parts.num_classes = ds->num_classes();
    parts.class_names = ds->class_names();
    parts.set_epoch = [ds](int64_t e) { ds->set_epoch(e); };
    parts.dataset = ds;
    if (c.only_class) throw Error("--only_class works with fashion_mnist and mnist only");
  } else {
    data::MnistOptions o;
    o.dir = c.train_data_dir.empty() ? data::default_dataset_dir(c.dataset) : c.train_data_dir;
    o.split = "train";
    o.resolution = c.resolution;
    o.random_flip = c.random_flip;
    o.seed = c.seed;
    o.only_class = c.only_class;
    auto ds = std::make_shared<data::MnistDataset>(o);
    parts.num_classes = ds->num_classes();
    if (c.dataset == "fashion_mnist")
      parts.class_names = data::MnistDataset::fashion_mnist_class_names();
    parts.set_epoch = [ds](int64_t e) { ds->set_epoch(e); };
    parts.dataset = ds;
  }
  if (parts.dataset->size() == 0) throw Error("the training dataset is empty");
  if (c.max_train_samples > 0 && c.max_train_samples < parts.dataset->size()) {
    parts.dataset = std::make_shared<Subset>(parts.dataset, c.max_train_samples);
  }
}

void build_model(const TrainConfig& c, TrainParts& parts) {
  models::UNetConfig uc;
  if (!c.pretrained_model_name_or_path.empty()) {
    const std::string dir = c.pretrained_model_name_or_path;
    fs::path unet_dir = fs::path(dir);
    if (fs::exists(unet_dir / "model_index.json")) unet_dir /= "unet";
    parts.unet = models::load_unet(unet_dir.string(), c.variant);
    uc = parts.unet->config();
    parts.class_conditional = uc.num_class_embeds.has_value();
    if (c.class_conditional && *c.class_conditional != parts.class_conditional) {
      throw Error("--class_conditional " + std::string(*c.class_conditional ? "true" : "false") +
                  " does not match the pretrained UNet in " + dir + " (num_class_embeds " +
                  (uc.num_class_embeds ? std::to_string(*uc.num_class_embeds) : "null") + ")");
    }
    if (parts.class_conditional) parts.null_class = *uc.num_class_embeds - 1;
  } else {
    nlohmann::json json;
    std::string source = "built-in default UNet";
    if (!c.model_config_name_or_path.empty()) {
      source = c.model_config_name_or_path;
      if (fs::is_directory(source)) source = (fs::path(source) / "config.json").string();
      json = read_json_file(source);
    } else {
      json = default_unet_config(c.resolution, parts.channels);
    }
    parts.class_conditional = c.class_conditional.value_or(parts.num_classes > 0);
    if (parts.class_conditional) {
      if (parts.num_classes == 0) {
        throw Error("--class_conditional needs labels, and dataset " + c.dataset +
                    " has none (use sub-folders or metadata.jsonl labels)");
      }
      const int64_t embeds = parts.num_classes + (c.class_dropout_prob > 0 ? 1 : 0);
      json["num_class_embeds"] = embeds;
      if (c.class_dropout_prob > 0) parts.null_class = embeds - 1;
    } else {
      json.erase("num_class_embeds");
    }
    uc = models::UNetConfig::from_json(json, source);
    parts.unet = models::UNet(uc);
  }
  if (uc.in_channels != parts.channels) {
    throw Error("the UNet takes " + std::to_string(uc.in_channels) + " channel(s) but the " +
                c.dataset + " images have " + std::to_string(parts.channels) +
                "; use a UNet config with in_channels " + std::to_string(parts.channels));
  }
  if (parts.class_conditional && parts.num_classes > 0 && uc.num_class_embeds &&
      *uc.num_class_embeds < parts.num_classes) {
    throw Error("the UNet has " + std::to_string(*uc.num_class_embeds) +
                " class embeddings but the dataset has " + std::to_string(parts.num_classes) +
                " classes");
  }
  if (c.gradient_checkpointing) parts.unet->set_gradient_checkpointing(true);
}

// The dataset and UNet of an unconditional or class-conditional run.
void build_unet_parts(const TrainConfig& c, TrainParts& parts) {
  // Channels: MNIST-like data is grey; an image folder gives what the model takes (RGB unless a
  // pretrained or configured UNet says 1).
  parts.channels = c.dataset == "imagefolder" ? 3 : 1;
  if (c.dataset == "imagefolder") {
    std::string cfg;
    if (!c.pretrained_model_name_or_path.empty()) {
      fs::path p(c.pretrained_model_name_or_path);
      cfg = (fs::exists(p / "model_index.json") ? p / "unet" / "config.json" : p / "config.json")
                .string();
    } else if (!c.model_config_name_or_path.empty()) {
      cfg = fs::is_directory(c.model_config_name_or_path)
                ? (fs::path(c.model_config_name_or_path) / "config.json").string()
                : c.model_config_name_or_path;
    }
    if (!cfg.empty() && fs::exists(cfg)) {
      const auto json = read_json_file(cfg);
      if (json.contains("in_channels") && json["in_channels"].is_number_integer()) {
        parts.channels = json["in_channels"].get<int64_t>();
      }
    }
  }
  build_dataset(c, parts);
  build_model(c, parts);
  {
    const auto& uc = parts.unet->config();
    if (uc.kind == models::UNetKind::kUNet2D && !uc.sample_size.empty() &&
        uc.sample_size[0] != c.resolution && c.pretrained_model_name_or_path.empty()) {
      spdlog::warn("the UNet's sample_size is {} but --resolution is {}", uc.sample_size[0],
                   c.resolution);
    }
  }
}

}  // namespace

data::ImageFolderOptions image_folder_options(const TrainConfig& c, const std::string& dir,
                                              int channels) {
  data::ImageFolderOptions o;
  o.dir = dir;
  o.resolution = c.resolution;
  o.center_crop = c.center_crop;
  o.random_flip = c.random_flip;
  o.skip_bad_images = c.skip_bad_images;
  o.seed = c.seed;
  o.caption_column = c.caption_column;
  o.channels = channels;
  return o;
}

double TrainParts::current_lr() const { return lr_schedule->get_last_lr().at(0); }

// What a text-to-image LoRA run trains when the text encoder trains too: both adapter sets,
// under "unet" and "text_encoder", prepared, optimised and checkpointed as one module.
class TextToImageLoraImpl : public torch::nn::Module {
 public:
  TextToImageLoraImpl(models::LoraLayers unet, models::LoraLayers text_encoder) {
    register_module("unet", std::move(unet));
    register_module("text_encoder", std::move(text_encoder));
  }
};
TORCH_MODULE(TextToImageLora);

TrainParts build_parts(const TrainConfig& c, accel::Accelerator& acc) {
  TrainParts parts;
  const bool text_to_image = !c.pretrained_model_name_or_path.empty() &&
                             diffusion::is_stable_diffusion_folder(c.pretrained_model_name_or_path);
  if (text_to_image) {
    parts.t2i = build_text_to_image(c, acc, parts.unet, parts.dataset, parts.set_epoch);
    parts.channels = parts.unet->config().in_channels;
    if (c.gradient_checkpointing) parts.unet->set_gradient_checkpointing(true);
  } else {
    build_unet_parts(c, parts);
  }
  // Noise scheduler: the pretrained folder's when it has one, else from the flags.
  diffusion::SchedulerConfig sc;
  bool have_scheduler = false;
  if (!c.pretrained_model_name_or_path.empty()) {
    const fs::path p(c.pretrained_model_name_or_path);
    for (const auto& f : {p / "scheduler" / "scheduler_config.json", p / "scheduler_config.json"}) {
      if (fs::exists(f)) {
        sc = diffusion::SchedulerConfig::load(f.string());
        have_scheduler = true;
        break;
      }
    }
  }
  if (!have_scheduler) {
    sc.num_train_timesteps = c.ddpm_num_steps;
    sc.beta_schedule = diffusion::parse_beta_schedule(c.ddpm_beta_schedule);
  }
  sc.prediction_type = diffusion::parse_prediction_type(c.prediction_type);
  sc.class_name = "DDPMScheduler";
  parts.noise_scheduler = diffusion::make_scheduler(sc, "ddpm");

  // What trains.
  if (c.lora) {
    for (auto& p : parts.unet->parameters()) p.set_requires_grad(false);
    parts.unet->to(acc.device());
    models::LoraConfig lc;
    lc.rank = c.rank;
    lc.alpha = c.lora_alpha.value_or(static_cast<double>(c.rank));
    lc.dropout = c.lora_dropout;
    lc.target_modules = c.lora_target_modules;
    parts.lora = models::LoraLayers(*parts.unet, lc);
    parts.trainable = parts.lora.ptr();
    if (c.train_text_encoder) {
      models::LoraConfig tc = lc;
      tc.target_modules = c.text_encoder_lora_target_modules;
      parts.t2i->text_lora = models::LoraLayers(*parts.t2i->text_encoder, tc);
      parts.trainable = TextToImageLora(parts.lora, parts.t2i->text_lora).ptr();
    }
  } else {
    parts.trainable = parts.unet.ptr();
  }
  // bf16 runs keep frozen weights (the LoRA base, the VAE, the text encoder) in bf16: half the
  // memory, while what trains (adapters, their gradients and AdamW state) stays fp32.
  if (acc.mixed_precision() == accel::MixedPrecision::kBf16) {
    if (c.lora) parts.unet->to(torch::kBFloat16);
    if (parts.t2i) {
      parts.t2i->vae->to(torch::kBFloat16);
      parts.t2i->text_encoder->to(torch::kBFloat16);
    }
  }

  data::DataLoaderOptions lo;
  lo.batch_size = c.train_batch_size;
  lo.shuffle = true;
  lo.num_workers = static_cast<int>(c.dataloader_num_workers);
  lo.seed = c.seed;
  parts.loader = std::make_shared<data::DataLoader>(parts.dataset, lo);

  parts.learning_rate = c.learning_rate;
  if (c.scale_lr) {
    parts.learning_rate *= static_cast<double>(c.gradient_accumulation_steps * c.train_batch_size *
                                               acc.num_processes());
  }
  auto adam = torch::optim::AdamWOptions(parts.learning_rate)
                  .betas({c.adam_beta1, c.adam_beta2})
                  .weight_decay(c.adam_weight_decay)
                  .eps(c.adam_epsilon);
  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  for (const auto& p : parts.trainable->named_parameters()) {
    if (!p.value().requires_grad()) continue;
    params.push_back(p.value());
    names.push_back(p.key());
  }
  if (c.use_8bit_adam) {
    parts.raw_optimizer = std::make_shared<optim::AdamW8bit>(params, adam);
  } else {
    parts.raw_optimizer = std::make_shared<optim::AdamW>(params, adam);
  }
  parts.raw_optimizer->set_parameter_names(names);

  acc.prepare_module(*parts.trainable);
  parts.optimizer = acc.prepare_optimizer(parts.raw_optimizer);
  parts.loader = acc.prepare_data_loader(parts.loader);

  parts.updates_per_epoch =
      (parts.loader->size() + c.gradient_accumulation_steps - 1) / c.gradient_accumulation_steps;
  parts.total_steps =
      c.max_train_steps > 0 ? c.max_train_steps : c.num_train_epochs * parts.updates_per_epoch;

  optim::LRScheduleOptions so;
  so.name = c.lr_scheduler;
  so.num_warmup_steps = c.lr_warmup_steps;
  so.num_training_steps = parts.total_steps;
  so.num_cycles = c.lr_num_cycles;
  so.power = c.lr_power;
  parts.lr_schedule = std::make_shared<optim::LRScheduler>(*parts.raw_optimizer, so);
  auto sched = parts.lr_schedule;
  parts.scheduler =
      acc.prepare_scheduler([sched] { sched->step(); }, [sched] { return sched->state_dict(); },
                            [sched](const nlohmann::json& s) { sched->load_state_dict(s); });

  if (c.use_ema) {
    diffusion::EMAOptions eo;
    eo.decay = c.ema_max_decay;
    eo.use_ema_warmup = true;
    eo.inv_gamma = c.ema_inv_gamma;
    eo.power = c.ema_power;
    auto full = acc.summon_full_params();
    parts.ema = std::make_unique<diffusion::EMAModel>(*parts.trainable, eo);
  }
  return parts;
}

void print_run_header(const TrainConfig& c, accel::Accelerator& acc, const TrainParts& parts) {
  if (!acc.is_main_process()) return;
  int64_t trainable = 0, total = 0;
  for (const auto& p : parts.unet->parameters()) total += p.numel();
  for (const auto& p : parts.trainable->parameters())
    trainable += p.requires_grad() ? p.numel() : 0;
  if (c.lora) total += trainable;
  spdlog::info("difftrain train: resolved configuration\n{}", c.to_json().dump(2));
  spdlog::info(
      "  examples {} | classes {} | processes {} on {} ({}) | batch per process {} | "
      "accumulation {} | global batch {}",
      parts.dataset->size(), parts.num_classes, acc.num_processes(), acc.device().str(),
      acc.group().backend_name(), c.train_batch_size, c.gradient_accumulation_steps,
      c.train_batch_size * acc.num_processes() * c.gradient_accumulation_steps);
  spdlog::info("  updates per epoch {} | total updates {} | parameters {} (trainable {}{})",
               parts.updates_per_epoch, parts.total_steps, total, trainable,
               c.lora ? ", LoRA" : "");
}

namespace {

// Diffusers' objective on x0 [B, C, H, W] with each sample's noise, timestep and input
// perturbation drawn from its own stream `keys[i]`: the per-sample loss [B] (mean over C, H, W;
// min-SNR weighted with --snr_gamma), float32.
torch::Tensor denoising_losses(const TrainConfig& c, TrainParts& parts, const torch::Tensor& x0,
                               const std::vector<int64_t>& keys, int64_t epoch,
                               torch::Device device, const models::UNetConditioning& cond) {
  const int64_t T = parts.noise_scheduler->num_train_timesteps();
  std::vector<torch::Tensor> noises, timesteps, perturb;
  auto shape = x0.sizes().slice(1).vec();
  for (int64_t key : keys) {
    auto gn = data::sample_generator(c.seed, epoch, key, data::SampleStream::kNoise);
    auto n = torch::randn(shape, gn, torch::kFloat32);
    if (c.noise_offset > 0) {
      n = n + c.noise_offset * torch::randn({shape[0], 1, 1}, gn, torch::kFloat32);
    }
    noises.push_back(n);
    auto gt = data::sample_generator(c.seed, epoch, key, data::SampleStream::kTimestep);
    timesteps.push_back(torch::randint(0, T, {1}, gt, torch::kInt64));
    if (c.input_perturbation > 0) {
      auto gp = data::sample_generator(c.seed, epoch, key, data::SampleStream::kPerturbation);
      perturb.push_back(torch::randn(shape, gp, torch::kFloat32));
    }
  }
  auto noise = torch::stack(noises).to(device);
  auto t = torch::cat(timesteps).to(device);
  // Diffusers: input perturbation noises the input with a perturbed noise, but the target keeps
  // the original noise.
  auto noisy = parts.noise_scheduler->add_noise(
      x0,
      c.input_perturbation > 0 ? noise + c.input_perturbation * torch::stack(perturb).to(device)
                               : noise,
      t);
  auto pred = parts.unet->forward(noisy, t, cond).to(torch::kFloat32);
  auto target = parts.noise_scheduler->training_target(x0, noise, t).to(torch::kFloat32);
  auto per_sample = (pred - target).pow(2).mean({1, 2, 3});
  if (!c.snr_gamma) return per_sample;
  auto weights = diffusion::min_snr_weights(parts.noise_scheduler->snr(t), *c.snr_gamma,
                                            parts.noise_scheduler->config().prediction_type);
  return per_sample * weights.to(per_sample.dtype());
}

// Text-to-image: latents and caption embeddings of the batch (plus the DreamBooth class half,
// weighted by prior_loss_weight).
torch::Tensor text_to_image_loss(const TrainConfig& c, TrainParts& parts, const data::Batch& batch,
                                 int64_t epoch, torch::Device device) {
  const auto index = batch.at("index").to(torch::kCPU);
  std::vector<int64_t> keys(index.data_ptr<int64_t>(), index.data_ptr<int64_t>() + index.numel());
  auto inst = encode_batch(c, *parts.t2i, batch, "", keys, epoch, device);
  if (!parts.t2i->prior) {
    models::UNetConditioning cond;
    cond.encoder_hidden_states = inst.embeds;
    return denoising_losses(c, parts, inst.latents, keys, epoch, device, cond).mean();
  }
  std::vector<int64_t> class_keys;
  for (int64_t k : keys) class_keys.push_back(class_key(k));
  auto cls = encode_batch(c, *parts.t2i, batch, "class_", class_keys, epoch, device);
  std::vector<int64_t> all = keys;
  all.insert(all.end(), class_keys.begin(), class_keys.end());
  models::UNetConditioning cond;
  cond.encoder_hidden_states = torch::cat({inst.embeds, cls.embeds});
  auto losses =
      denoising_losses(c, parts, torch::cat({inst.latents, cls.latents}), all, epoch, device, cond);
  const int64_t B = static_cast<int64_t>(keys.size());
  return losses.narrow(0, 0, B).mean() + c.prior_loss_weight * losses.narrow(0, B, B).mean();
}

}  // namespace

torch::Tensor training_loss(const TrainConfig& c, TrainParts& parts, const data::Batch& batch,
                            int64_t epoch, torch::Device device) {
  if (parts.t2i) return text_to_image_loss(c, parts, batch, epoch, device);
  const auto& x0 = batch.at("pixel_values");  // [B, C, H, W] in [-1, 1]
  const auto index = batch.at("index").to(torch::kCPU);
  const int64_t B = x0.size(0);
  // Per-sample randomness keyed by (seed, epoch, dataset index): independent of the rank that
  // holds the sample and of the batch it is in.
  std::vector<int64_t> keys;
  std::vector<int64_t> labels;
  const bool cond = parts.class_conditional && batch.count("class_labels");
  auto label_cpu = cond ? batch.at("class_labels").to(torch::kCPU) : torch::Tensor();
  for (int64_t i = 0; i < B; ++i) {
    const int64_t idx = index[i].item<int64_t>();
    keys.push_back(idx);
    if (cond) {
      int64_t label = label_cpu[i].item<int64_t>();
      if (c.class_dropout_prob > 0 && parts.null_class >= 0) {
        auto gd = data::sample_generator(c.seed, epoch, idx, data::SampleStream::kDropout);
        if (torch::rand({1}, gd).item<double>() < c.class_dropout_prob) label = parts.null_class;
      }
      labels.push_back(label);
    }
  }
  models::UNetConditioning conditioning;
  if (cond) conditioning.class_labels = torch::tensor(labels, torch::kInt64).to(device);
  if (parts.unet->needs_encoder_hidden_states()) {
    // A conditional UNet outside a text-to-image folder: an all-zero context of one token.
    const auto& cad = parts.unet->config().cross_attention_dim;
    conditioning.encoder_hidden_states =
        torch::zeros({B, 1, cad.empty() ? 1 : cad[0]}, x0.options());
  }
  auto losses = denoising_losses(c, parts, x0, keys, epoch, device, conditioning);
  return losses.mean();
}

}  // namespace difftrain::train
