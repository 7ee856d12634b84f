// The unconditional / class-conditional UNet task (Diffusers' train_unconditional.py): MNIST-like
// data or an image folder, a fresh or pretrained UNet2DModel, validation grids sampled with the
// training scheduler, a DDPMPipeline folder at the end.
#include "difftrain/families/unet/diffusion_task.h"

#include "difftrain/core/env.h"
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/core/paths.h"
#include "difftrain/core/sample_rng.h"
#include "difftrain/data/mnist.h"
#include "difftrain/diffusion/sampler.h"
#include "difftrain/families/unet/pipeline.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/models/pretrained.h"
#include "difftrain/models/unets/unet_config.h"

#include <torch/torch.h>

#include <filesystem>
#include <fstream>

namespace difftrain::families::unet {
using namespace difftrain::train;
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

class UNetTask final : public DiffusionTask {
 public:
  // The class-label options are the family's (its family.cpp), when the run's options have them.
  explicit UNetTask(TaskOptions options) : DiffusionTask(std::move(options)) {
    const auto& f = o_.family;
    if (f.find("class_dropout_prob") == nullptr) return;
    const auto& conditional = f.at("class_conditional");
    o_.model.class_conditional =
        conditional.is_null() ? std::nullopt : std::optional<bool>(conditional.get<bool>());
    o_.model.class_dropout_prob = f.number("class_dropout_prob");
    const auto& only = f.at("only_class");
    o_.data.only_class =
        only.is_null() ? std::nullopt : std::optional<int64_t>(only.get<int64_t>());
  }

  std::string name() const override { return "unconditional"; }
  int64_t num_classes() const override { return num_classes_; }

  void build(accel::Accelerator& acc, const std::string& /*output_dir*/) override {
    channels_ = image_channels();
    build_dataset();
    build_model();
    const auto& uc = unet_->config();
    if (uc.kind == models::UNetKind::kUNet2D && !uc.sample_size.empty() &&
        uc.sample_size[0] != o_.data.resolution && o_.model.pretrained_model_name_or_path.empty()) {
      log::warn("the UNet's sample_size is {} but --resolution is {}", uc.sample_size[0],
                o_.data.resolution);
    }
    build_noise_scheduler();
    build_trainable(acc, nullptr);
  }

  torch::Tensor loss(const data::Batch& batch, int64_t epoch, torch::Device device) override {
    const auto& x0 = batch.at("pixel_values");  // [B, C, H, W] in [-1, 1]
    const auto index = batch.at("index").to(torch::kCPU);
    const int64_t B = x0.size(0);
    // Per-sample randomness keyed by (seed, epoch, dataset index): independent of the rank that
    // holds the sample and of the batch it is in.
    std::vector<int64_t> keys;
    std::vector<int64_t> labels;
    const bool cond = class_conditional_ && batch.count("class_labels");
    auto label_cpu = cond ? batch.at("class_labels").to(torch::kCPU) : torch::Tensor();
    const double dropout = o_.model.class_dropout_prob;
    for (int64_t i = 0; i < B; ++i) {
      const int64_t idx = index[i].item<int64_t>();
      keys.push_back(idx);
      if (cond) {
        int64_t label = label_cpu[i].item<int64_t>();
        if (dropout > 0 && null_class_ >= 0) {
          auto gd = core::sample_generator(o_.noise.seed, epoch, idx, core::SampleStream::kDropout);
          if (torch::rand({1}, gd).item<double>() < dropout) label = null_class_;
        }
        labels.push_back(label);
      }
    }
    diffusion::Conditioning conditioning;
    if (cond) conditioning["class_labels"] = torch::tensor(labels, torch::kInt64).to(device);
    if (unet_->needs_encoder_hidden_states()) {
      // A conditional UNet outside a text-to-image folder: an all-zero context of one token.
      const auto& cad = unet_->config().cross_attention_dim;
      conditioning["encoder_hidden_states"] =
          torch::zeros({B, 1, cad.empty() ? 1 : cad[0]}, x0.options());
    }
    return denoising_losses(x0, keys, epoch, device, conditioning).mean();
  }

  std::string validation_unavailable() const override {
    return unet_->needs_encoder_hidden_states()
               ? "sampling a UNet2DConditionModel needs a text encoder"
               : "";
  }

  // One batch of this rank's images from one generator seeded by the rank's first index, with
  // the training scheduler's config run by the validation sampler.
  ValidationImages render_validation(const std::vector<int64_t>& mine, int64_t begin,
                                     const SamplerStepCallback& on_step) override {
    const auto& v = o_.validation;
    families::unet::UNetPipeline pipe(
        unet_, diffusion::make_sampler(noise_scheduler_->config().to_json(), v.scheduler,
                                       "the training scheduler"));
    diffusion::GenerateRequest r;
    r.num_images = static_cast<int64_t>(mine.size());
    r.num_inference_steps = v.inference_steps;
    r.guidance_scale = v.guidance_scale;
    r.seed = v.seed + 1000003ULL * static_cast<uint64_t>(begin + 1);
    r.seeding = diffusion::Seeding::kBatch;
    r.on_step = on_step;
    if (class_conditional_) {
      const int64_t classes = num_classes_ > 0 ? num_classes_ : 1;
      for (int64_t i : mine) r.class_labels.push_back(i % classes);
    }
    return {pipe.generate(r).images};
  }

  std::vector<std::string> validation_labels(int64_t K) const override {
    std::vector<std::string> labels;
    if (!class_conditional_) return labels;
    const int64_t classes = num_classes_ > 0 ? num_classes_ : 1;
    for (int64_t i = 0; i < K; ++i) {
      const int64_t label = i % classes;
      labels.push_back(label < static_cast<int64_t>(class_names_.size()) ? class_names_[label]
                                                                         : std::to_string(label));
    }
    return labels;
  }

  // Diffusers' train_unconditional.py writes no card; this one follows the DreamBooth scripts'
  // layout. A UNet built here has no base model (licence mit); DDPMPipeline takes no class
  // labels, so a class-conditional UNet's snippet runs the pipeline's loop with them.
  train::ModelCard model_card() const override {
    train::ModelCard card;
    const auto& m = o_.model;
    const bool lora = o_.lora.enabled;
    card.base_model = m.pretrained_model_name_or_path;
    const std::string kind = class_conditional_ ? "class-conditional" : "unconditional";
    const std::string data = o_.data.dataset == "fashion_mnist" ? "Fashion-MNIST"
                             : o_.data.dataset == "mnist"       ? "MNIST"
                                                                : "an image folder";
    card.title = lora ? "DDPM " + kind + " UNet LoRA" : "DDPM " + kind + " UNet";
    card.description =
        "A " + kind + " UNet2DModel (DDPM, " + o_.noise.prediction_type + " prediction) " +
        (lora                      ? "LoRA fine-tune of `" + card.base_model + "`"
         : card.base_model.empty() ? std::string("trained from scratch")
                                   : "fine-tuned from `" + card.base_model + "`") +
        " on " + data + " with `difftrain train` (Diffusers' train_unconditional.py).";
    card.license = card.base_model.empty() ? "mit" : "other";
    if (!card.base_model.empty()) card.license_note = "The base model's licence applies.";
    card.tags = {"unconditional-image-generation", "ddpm"};
    card.pipeline_class = "DDPMPipeline";
    card.lora = lora;
    card.lora_weight_name = "pytorch_lora_weights.safetensors";
    card.lora_loader = "pipeline.unet.load_lora_adapter";
    card.lora_loader_args = ", prefix=\"unet\"";
    train::add_task_details(card, o_);
    if (class_conditional_) {
      const int64_t shown = std::min<int64_t>(std::max<int64_t>(num_classes_, 1), 10);
      const auto names = validation_labels(shown);
      std::string ids, listed;
      for (int64_t i = 0; i < shown; ++i) {
        ids += (i ? "," : "") + std::to_string(i);
        listed += (i ? ", " : "") + std::to_string(i) + " " + names[static_cast<size_t>(i)];
      }
      train::set_card_detail(card, "classes", std::to_string(num_classes_) + ": " + listed);
      // The validation render's settings, so the snippet and the command draw what the card's
      // images show: its step count, and classifier-free guidance against the null class.
      const auto& v = o_.validation;
      const bool guided = null_class_ >= 0 && v.guidance_scale > 1;
      const std::string steps = std::to_string(v.inference_steps);
      const std::string scale = fmt::format("{:g}", v.guidance_scale);
      const std::string sampler = diffusion::make_sampler(noise_scheduler_->config().to_json(),
                                                          v.scheduler, "the training scheduler")
                                      ->class_name();
      const bool own_sampler = sampler == noise_scheduler_->class_name();
      card.python_generate =
          "# DDPMPipeline passes no class labels: its loop, with them" +
          std::string(guided ? " and classifier-free guidance" : "") +
          ".\n"
          "labels = torch.tensor([" +
          ids + "], device=pipeline.device)\n" +
          (guided ? "null = torch.full_like(labels, " + std::to_string(null_class_) + ")\n" : "") +
          "unet, scheduler = pipeline.unet, pipeline.scheduler\n" +
          (own_sampler ? std::string()
                       : "from diffusers import " + sampler + "\nscheduler = " + sampler +
                             ".from_config(scheduler.config)  # the validation sampler\n") +
          "size = unet.config.sample_size\n"
          "generator = torch.manual_seed(0)\n"
          "x = torch.randn(len(labels), unet.config.in_channels, size, size, "
          "generator=generator).to(pipeline.device)\n"
          "scheduler.set_timesteps(" +
          steps +
          ")\n"
          "x = x * scheduler.init_noise_sigma\n"
          "for t in scheduler.timesteps:\n"
          "    x_in = scheduler.scale_model_input(x, t)\n"
          "    with torch.no_grad():\n" +
          (guided ? "        cond, uncond = unet(torch.cat([x_in, x_in]), t, "
                    "class_labels=torch.cat([labels, null])).sample.chunk(2)\n"
                    "    out = uncond + " +
                        scale + " * (cond - uncond)\n"
                  : "        out = unet(x_in, t, class_labels=labels).sample\n") +
          "    x = scheduler.step(out, t, x, generator=generator).prev_sample\n"
          "image = pipeline.numpy_to_pil((x / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu()."
          "numpy())[0]\n";
      card.sample_flags = {"--class_labels", ids, "--num_inference_steps", steps};
      if (!own_sampler) card.sample_flags.insert(card.sample_flags.end(), {"--scheduler", sampler});
      if (guided) card.sample_flags.insert(card.sample_flags.end(), {"--guidance_scale", scale});
    } else {
      card.python_generate = "image = pipeline().images[0]\n";
      card.sample_flags = {"--num_images", "4"};
    }
    return card;
  }

  int64_t validation_columns() const override {
    return class_conditional_ ? std::max<int64_t>(num_classes_, 1) : 0;
  }

  void export_to(const fs::path& out) override {
    if (o_.lora.enabled) {
      export_lora(out);
      return;
    }
    models::save_unet(*unet_, (out / "unet").string());
    diffusion::SchedulerConfig sc = noise_scheduler_->config();
    sc.class_name = "DDPMScheduler";
    fs::create_directories(out / "scheduler");
    sc.save((out / "scheduler" / "scheduler_config.json").string());
    const std::string unet_class =
        unet_->config().kind == models::UNetKind::kUNet2D ? "UNet2DModel" : "UNet2DConditionModel";
    nlohmann::json index = {{"_class_name", "DDPMPipeline"},
                            {"_diffusers_version", "0.31.0"},
                            {"scheduler", {"diffusers", "DDPMScheduler"}},
                            {"unet", {"diffusers", unet_class}}};
    io::write_file_atomic((out / "model_index.json").string(), index.dump(2) + "\n");
    log::info("pipeline folder (DDPMPipeline): {}", out.string());
  }

 private:
  // MNIST-like data is grey; an image folder gives what the model takes (RGB unless a pretrained
  // or configured UNet says 1).
  int64_t image_channels() const {
    const auto& m = o_.model;
    if (o_.data.dataset != "imagefolder") return 1;
    std::string cfg;
    if (!m.pretrained_model_name_or_path.empty()) {
      fs::path p(m.pretrained_model_name_or_path);
      cfg = (fs::exists(p / "model_index.json") ? p / "unet" / "config.json" : p / "config.json")
                .string();
    } else if (!m.model_config_name_or_path.empty()) {
      cfg = fs::is_directory(m.model_config_name_or_path)
                ? (fs::path(m.model_config_name_or_path) / "config.json").string()
                : m.model_config_name_or_path;
    }
    if (!cfg.empty() && fs::exists(cfg)) {
      const auto json = read_json_file(cfg);
      if (json.contains("in_channels") && json["in_channels"].is_number_integer()) {
        return json["in_channels"].get<int64_t>();
      }
    }
    return 3;
  }

  void build_dataset() {
    const auto& d = o_.data;
    if (d.crop_width > 0) {
      throw Error("--resolution " + std::to_string(d.crop_width) + "," +
                  std::to_string(d.crop_height) +
                  ": a UNet is trained on square images here; give one side (--resolution N)");
    }
    if (d.dataset == "imagefolder") {
      data::ImageFolderOptions o =
          image_folder_options(d, d.train_data_dir, static_cast<int>(channels_));
      // Sub-folders are classes here (HF imagefolder), also when named like kohya's "1_dog".
      o.kohya_repeat_folders = false;
      auto ds = std::make_shared<data::ImageFolderDataset>(o);
      // Skipped images (--skip_bad_images) are reported once, by the dataset on the main rank.
      num_classes_ = ds->num_classes();
      class_names_ = ds->class_names();
      set_epoch_ = [ds](int64_t e) { ds->set_epoch(e); };
      dataset_ = ds;
      if (d.only_class) throw Error("--only_class works with fashion_mnist and mnist only");
    } else {
      data::MnistOptions o;
      o.dir = d.train_data_dir.empty() ? data::default_dataset_dir(d.dataset) : d.train_data_dir;
      o.split = "train";
      o.resolution = d.resolution;
      o.random_flip = d.random_flip;
      o.seed = d.seed;
      o.only_class = d.only_class;
      if (env_switch("DIFFTRAIN_DATASET_CACHE", true)) o.cache_dir = user_cache_dir();
      auto ds = std::make_shared<data::MnistDataset>(o);
      num_classes_ = ds->num_classes();
      if (d.dataset == "fashion_mnist")
        class_names_ = data::MnistDataset::fashion_mnist_class_names();
      set_epoch_ = [ds](int64_t e) { ds->set_epoch(e); };
      dataset_ = ds;
    }
    if (dataset_->size() == 0) throw Error("the training dataset is empty");
    if (d.max_train_samples > 0 && d.max_train_samples < dataset_->size()) {
      dataset_ = std::make_shared<Subset>(dataset_, d.max_train_samples);
    }
  }

  void build_model() {
    const auto& m = o_.model;
    const auto& dataset = o_.data.dataset;
    models::UNetConfig uc;
    if (!m.pretrained_model_name_or_path.empty()) {
      const std::string dir = m.pretrained_model_name_or_path;
      fs::path unet_dir = fs::path(dir);
      if (fs::exists(unet_dir / "model_index.json")) unet_dir /= "unet";
      unet_ = models::load_unet(unet_dir.string(), m.variant);
      uc = unet_->config();
      class_conditional_ = uc.num_class_embeds.has_value();
      if (m.class_conditional && *m.class_conditional != class_conditional_) {
        throw Error("--class_conditional " + std::string(*m.class_conditional ? "true" : "false") +
                    " does not match the pretrained UNet in " + dir + " (num_class_embeds " +
                    (uc.num_class_embeds ? std::to_string(*uc.num_class_embeds) : "null") + ")");
      }
      if (class_conditional_) null_class_ = *uc.num_class_embeds - 1;
    } else {
      nlohmann::json json;
      std::string source = "built-in default UNet";
      if (!m.model_config_name_or_path.empty()) {
        source = m.model_config_name_or_path;
        if (fs::is_directory(source)) source = (fs::path(source) / "config.json").string();
        json = read_json_file(source);
      } else {
        json = default_unet_config(o_.data.resolution, channels_);
      }
      class_conditional_ = m.class_conditional.value_or(num_classes_ > 0);
      if (class_conditional_) {
        if (num_classes_ == 0) {
          throw Error("--class_conditional needs labels, and dataset " + dataset +
                      " has none (use sub-folders or metadata.jsonl labels)");
        }
        const int64_t embeds = num_classes_ + (m.class_dropout_prob > 0 ? 1 : 0);
        json["num_class_embeds"] = embeds;
        if (m.class_dropout_prob > 0) null_class_ = embeds - 1;
      } else {
        json.erase("num_class_embeds");
      }
      uc = models::UNetConfig::from_json(json, source);
      unet_ = models::UNet(uc);
    }
    if (uc.in_channels != channels_) {
      throw Error("the UNet takes " + std::to_string(uc.in_channels) + " channel(s) but the " +
                  dataset + " images have " + std::to_string(channels_) +
                  "; use a UNet config with in_channels " + std::to_string(channels_));
    }
    if (class_conditional_ && num_classes_ > 0 && uc.num_class_embeds &&
        *uc.num_class_embeds < num_classes_) {
      throw Error("the UNet has " + std::to_string(*uc.num_class_embeds) +
                  " class embeddings but the dataset has " + std::to_string(num_classes_) +
                  " classes");
    }
    if (m.gradient_checkpointing) unet_->set_gradient_checkpointing(true);
  }

  int64_t channels_ = 1;
  int64_t num_classes_ = 0;  // labels of the dataset (0: unlabelled)
  std::vector<std::string> class_names_;
  bool class_conditional_ = false;
  int64_t null_class_ = -1;  // label used for class dropout and guidance (-1: none)
};

}  // namespace

std::unique_ptr<TrainingTask> make_unet_task(TaskOptions options) {
  return std::make_unique<UNetTask>(std::move(options));
}

}  // namespace difftrain::families::unet
