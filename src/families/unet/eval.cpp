#include "difftrain/families/unet/eval.h"

#include "difftrain/accel/accelerator.h"
#include "difftrain/core/error.h"
#include "difftrain/core/paths.h"
#include "difftrain/data/mnist.h"
#include "difftrain/diffusion/scheduler_config.h"
#include "difftrain/families/unet/pipeline.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/pretrained.h"
#include "difftrain/optim/adamw.h"
#include "difftrain/optim/lr_schedule.h"

#include <torch/torch.h>

#include <unistd.h>
#include <chrono>
#include <cstdlib>

#include <filesystem>

namespace difftrain::families::unet {
namespace fs = std::filesystem;

ClassifierImpl::ClassifierImpl() {
  auto conv = [&](const char* name, int64_t in, int64_t out) {
    return register_module(name,
                           torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1)));
  };
  conv1_ = conv("conv1", 1, 16);
  conv2_ = conv("conv2", 16, 32);
  conv3_ = conv("conv3", 32, 64);
  norm1_ = register_module("norm1", torch::nn::BatchNorm2d(16));
  norm2_ = register_module("norm2", torch::nn::BatchNorm2d(32));
  norm3_ = register_module("norm3", torch::nn::BatchNorm2d(64));
  dense_ = register_module("dense", torch::nn::Linear(64 * 4 * 4, 128));
  fc_ = register_module("fc", torch::nn::Linear(128, 10));
}

torch::Tensor ClassifierImpl::features(const torch::Tensor& x) {
  auto h = torch::max_pool2d(torch::relu(norm1_(conv1_(x))), 2);  // [B, 16, 16, 16]
  h = torch::max_pool2d(torch::relu(norm2_(conv2_(h))), 2);       // [B, 32, 8, 8]
  h = torch::max_pool2d(torch::relu(norm3_(conv3_(h))), 2);       // [B, 64, 4, 4]
  return torch::relu(dense_(h.flatten(1)));                       // [B, 128]
}

torch::Tensor ClassifierImpl::forward(const torch::Tensor& x) { return fc_(features(x)); }

double frechet_distance(const torch::Tensor& a_in, const torch::Tensor& b_in) {
  TORCH_CHECK(a_in.dim() == 2 && b_in.dim() == 2 && a_in.size(1) == b_in.size(1),
              "frechet_distance needs [N, D] and [M, D] features");
  const auto a = a_in.to(torch::kFloat64);
  const auto b = b_in.to(torch::kFloat64);
  auto cov = [](const torch::Tensor& x) {
    auto centred = x - x.mean(0, true);
    return centred.t().mm(centred) / static_cast<double>(std::max<int64_t>(x.size(0) - 1, 1));
  };
  const auto mu = a.mean(0) - b.mean(0);
  const auto s1 = cov(a), s2 = cov(b);
  // sqrt(S1) by eigendecomposition; then tr((sqrt(S1) S2 sqrt(S1))^1/2) from the eigenvalues of
  // that symmetric PSD matrix (equal to tr((S1 S2)^1/2), without a non-symmetric sqrtm).
  auto [e1, v1] = at::linalg_eigh(s1, "L");
  const auto root1 = v1.mm(torch::diag(e1.clamp_min(0).sqrt())).mm(v1.t());
  const auto m = root1.mm(s2).mm(root1);
  const auto em = at::linalg_eigvalsh((m + m.t()) / 2, "L");
  const double trace_root = em.clamp_min(0).sqrt().sum().item<double>();
  return mu.dot(mu).item<double>() + s1.trace().item<double>() + s2.trace().item<double>() -
         2.0 * trace_root;
}

namespace {

torch::Tensor all_images(const data::Dataset& ds, torch::Tensor* labels) {
  std::vector<torch::Tensor> xs, ys;
  for (int64_t i = 0; i < ds.size(); ++i) {
    auto e = ds.get(i);
    xs.push_back(e.at("pixel_values"));
    if (labels) ys.push_back(e.at("class_labels"));
  }
  if (labels) *labels = torch::stack(ys);
  return torch::stack(xs);
}

torch::Tensor batched_features(Classifier& net, const torch::Tensor& x, torch::Tensor* logits) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> fs_, ls;
  for (int64_t i = 0; i < x.size(0); i += 500) {
    auto f = net->features(x.slice(0, i, std::min(i + 500, x.size(0))));
    fs_.push_back(f);
    if (logits) ls.push_back(net->forward(x.slice(0, i, std::min(i + 500, x.size(0)))));
  }
  if (logits) *logits = torch::cat(ls);
  return torch::cat(fs_);
}

Classifier train_or_load_classifier(const EvalOptions& o, accel::Accelerator& acc) {
  const std::string cache = o.cache_dir.empty() ? user_cache_dir() : o.cache_dir;
  const std::string path =
      (fs::path(cache) / ("fashion_mnist_classifier_v3_e" + std::to_string(o.classifier_epochs) +
                          "_n" + std::to_string(o.classifier_train_samples) + ".safetensors"))
          .string();
  Classifier net;
  if (fs::exists(path)) {
    models::load_weights(*net, io::load_safetensors(path).tensors, path);
    acc.print("classifier: loaded {}", path);
    return net;
  }
  acc.print("classifier: training on Fashion-MNIST ({} epoch(s)); cached afterwards in {}",
            o.classifier_epochs, path);
  torch::manual_seed(o.seed);
  data::MnistOptions mo;
  mo.dir = o.data_dir;
  mo.split = "train";
  mo.resolution = 32;
  mo.limit = o.classifier_train_samples;
  auto dataset = std::make_shared<data::MnistDataset>(mo);
  data::DataLoaderOptions lo;
  lo.batch_size = 128;
  lo.shuffle = true;
  lo.seed = o.seed;
  auto loader = acc.prepare_data_loader(std::make_shared<data::DataLoader>(dataset, lo));
  acc.prepare_module(*net);
  auto adamw = std::make_shared<optim::AdamW>(net->parameters(),
                                              torch::optim::AdamWOptions(6e-3).weight_decay(1e-4));
  auto opt = acc.prepare_optimizer(adamw);
  // One cycle: a tenth of the updates warming up, then a cosine decay to 0.
  optim::LRScheduleOptions so;
  so.name = "cosine";
  so.num_training_steps = loader->size() * o.classifier_epochs;
  so.num_warmup_steps = so.num_training_steps / 10;
  optim::LRScheduler schedule(*adamw, so);
  net->train();
  const auto started = std::chrono::steady_clock::now();
  for (int64_t epoch = 0; epoch < o.classifier_epochs; ++epoch) {
    loader->set_epoch(epoch);
    double total = 0;
    int64_t n = 0;
    for (const auto& batch : *loader) {
      auto step = acc.accumulate();
      auto loss = torch::cross_entropy_loss(net->forward(batch.at("pixel_values")),
                                            batch.at("class_labels"));
      acc.backward(loss);
      opt->step();
      opt->zero_grad();
      schedule.step();
      total += loss.item<double>();
      ++n;
    }
    acc.print("classifier: epoch {} loss {:.4f}", epoch + 1, total / std::max<int64_t>(n, 1));
  }
  acc.print("classifier: trained in {:.1f} s",
            std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  net->eval();
  if (acc.is_main_process()) {
    if (fs::create_directories(cache)) {
      fs::permissions(cache, fs::perms::owner_all, fs::perm_options::replace);
    }
    io::save_safetensors(path, models::named_tensors(*net), {{"format", "pt"}});
  }
  acc.wait_for_everyone();
  return net;
}

}  // namespace

nlohmann::json evaluate_model(const EvalOptions& o) {
  accel::Accelerator acc;
  const auto folder = families::unet::resolve_pipeline_folder(o.model);
  models::UNet unet = families::unet::load_unet_with_lora(folder.unet_dir, o.lora);
  const auto& uc = unet->config();
  if (!uc.num_class_embeds || *uc.num_class_embeds < 10 || uc.in_channels != 1 ||
      uc.sample_size.empty() || uc.sample_size[0] != 32) {
    throw Error(
        "difftrain eval scores class-conditional Fashion-MNIST models (1x32x32, at least "
        "10 class embeddings); " +
        o.model + " is not one");
  }
  if (o.guidance_scale > 1 && *uc.num_class_embeds < 11) {
    throw Error("--guidance_scale > 1 needs a null class after the 10 garment classes; " + o.model +
                " has num_class_embeds " + std::to_string(*uc.num_class_embeds) +
                " (train it with --class_dropout_prob, e.g. 0.1)");
  }
  Classifier net = train_or_load_classifier(o, acc);
  net->eval();
  nlohmann::json result;
  if (acc.is_main_process()) {
    data::MnistOptions mo;
    mo.dir = o.data_dir;
    mo.split = "test";
    mo.resolution = 32;
    mo.limit = o.test_samples;
    data::MnistDataset test(mo);
    torch::Tensor test_labels, test_logits;
    const auto test_x = all_images(test, &test_labels);
    const auto test_features = batched_features(net, test_x, &test_logits);
    const double test_accuracy =
        test_logits.argmax(1).eq(test_labels).to(torch::kFloat64).mean().item<double>();
    const int64_t half = test_features.size(0) / 2;
    const double reference =
        frechet_distance(test_features.slice(0, 0, half), test_features.slice(0, half));

    diffusion::SamplerOptions sampler_options;
    sampler_options.eta = o.eta;
    auto sampler = diffusion::load_sampler(folder.scheduler_config, o.scheduler, sampler_options);
    families::unet::SampleOptions so;
    so.num_images = 10 * o.num_per_class;
    so.num_inference_steps = o.num_inference_steps;
    so.seed = o.seed;
    so.guidance_scale = o.guidance_scale;
    for (int64_t i = 0; i < so.num_images; ++i) so.class_labels.push_back(i % 10);
    const auto images =
        families::unet::sample_images(*unet, *sampler, so);  // [K, 32, 32, 1] in [0, 1]
    const auto x = images.permute({0, 3, 1, 2}).mul(2).sub(1).contiguous();
    torch::Tensor logits;
    const auto features = batched_features(net, x, &logits);
    const auto labels = torch::tensor(so.class_labels, torch::kInt64);
    const auto correct = logits.argmax(1).eq(labels).to(torch::kFloat64);
    std::vector<double> per_class;
    for (int64_t c = 0; c < 10; ++c) {
      per_class.push_back(correct.index({labels.eq(c)}).mean().item<double>());
    }
    result = {{"model", o.model},
              {"num_images", so.num_images},
              {"num_inference_steps", o.num_inference_steps},
              {"scheduler", sampler->class_name()},
              {"eta", o.eta},
              {"guidance_scale", o.guidance_scale},
              {"accuracy", correct.mean().item<double>()},
              {"per_class_accuracy", per_class},
              {"frechet_distance", frechet_distance(features, test_features)},
              {"reference_distance", reference},
              {"classifier_test_accuracy", test_accuracy}};
  }
  acc.wait_for_everyone();
  return result;
}

}  // namespace difftrain::families::unet
