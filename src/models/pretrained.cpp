#include "difftrain/models/pretrained.h"

#include "difftrain/core/error.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/weight_index.h"

#include <filesystem>

namespace difftrain::models {

namespace fs = std::filesystem;

namespace {

std::string sizes_text(c10::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

std::string first_names(const std::vector<std::string>& names, size_t limit = 4) {
  std::string s;
  for (size_t i = 0; i < names.size() && i < limit; ++i) s += (i ? ", " : "") + names[i];
  if (names.size() > limit) s += ", ... (" + std::to_string(names.size()) + " in all)";
  return s;
}

}  // namespace

io::TensorMap named_tensors(const torch::nn::Module& module) {
  io::TensorMap out;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) out[p.key()] = p.value();
  for (const auto& b : module.named_buffers(/*recurse=*/true)) out[b.key()] = b.value();
  return out;
}

void load_weights(torch::nn::Module& module, const io::TensorMap& weights,
                  const std::string& source) {
  io::TensorMap own = named_tensors(module);
  std::vector<std::string> missing, unexpected, mismatched, bad_dtype;
  for (const auto& [name, t] : own) {
    auto it = weights.find(name);
    if (it == weights.end()) {
      missing.push_back(name);
    } else if (it->second.sizes() != t.sizes()) {
      mismatched.push_back(name + " (file " + sizes_text(it->second.sizes()) + ", model " +
                           sizes_text(t.sizes()) + ")");
    } else if (!it->second.is_floating_point() && t.is_floating_point()) {
      bad_dtype.push_back(name);
    }
  }
  for (const auto& [name, t] : weights) {
    if (!own.count(name)) unexpected.push_back(name);
  }
  if (!missing.empty() || !unexpected.empty() || !mismatched.empty() || !bad_dtype.empty()) {
    std::string msg = source + ": the weights do not match the model's config";
    if (!missing.empty()) msg += "; missing keys: " + first_names(missing);
    if (!unexpected.empty()) msg += "; unexpected keys: " + first_names(unexpected);
    if (!mismatched.empty()) msg += "; wrong shapes: " + first_names(mismatched, 3);
    if (!bad_dtype.empty()) msg += "; non-float data for: " + first_names(bad_dtype);
    throw Error(msg + " (is config.json from the same model?)");
  }
  torch::NoGradGuard no_grad;
  for (auto& [name, t] : own) t.copy_(weights.at(name));
}

std::string weights_path(const std::string& dir, const std::string& variant) {
  const std::string stem = "diffusion_pytorch_model";
  const std::string file =
      variant.empty() ? stem + ".safetensors" : stem + "." + variant + ".safetensors";
  fs::path path = fs::path(dir) / file;
  if (fs::exists(path)) return path.string();
  if (fs::exists(fs::path(dir) / (stem + ".safetensors.index.json"))) {
    throw Error(dir + ": sharded weights (" + stem +
                ".safetensors.index.json) are not supported yet; save the model unsharded");
  }
  if (fs::exists(fs::path(dir) / (stem + ".bin"))) {
    throw Error(dir + ": only pickle weights (" + stem +
                ".bin) found; difftrain reads safetensors only — in Python run "
                "`Model.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)`");
  }
  throw Error(path.string() +
              ": no such file; expected a Diffusers model folder with config.json "
              "and " +
              file);
}

UNet load_unet(const std::string& dir, const std::string& variant) {
  if (!fs::exists(dir)) {
    throw Error(dir + ": no such folder; expected a Diffusers UNet folder (config.json + " +
                "diffusion_pytorch_model.safetensors): check the path");
  }
  if (!fs::is_directory(dir)) {
    throw Error(dir + ": not a folder; expected a Diffusers UNet folder (config.json + " +
                "diffusion_pytorch_model.safetensors)");
  }
  const fs::path config_path = fs::path(dir) / "config.json";
  if (!fs::exists(config_path)) {
    throw Error(dir + ": no config.json; expected a Diffusers UNet folder (config.json + " +
                "diffusion_pytorch_model.safetensors, as save_pretrained writes it)");
  }
  UNetConfig config = UNetConfig::load(config_path.string());
  UNet unet(config);
  const std::string path = weights_path(dir, variant);
  io::Safetensors file = io::load_safetensors(path);
  load_weights(*unet, file.tensors, path);
  return unet;
}

void save_unet(UNetImpl& unet, const std::string& dir, const std::string& variant) {
  io::write_file_atomic((fs::path(dir) / "config.json").string(),
                        unet.config().to_json().dump(2) + "\n");
  io::TensorMap tensors;
  for (const auto& [name, t] : named_tensors(unet)) tensors[name] = t.detach();
  const std::string file = variant.empty() ? "diffusion_pytorch_model.safetensors"
                                           : "diffusion_pytorch_model." + variant + ".safetensors";
  io::save_safetensors((fs::path(dir) / file).string(), tensors, {{"format", "pt"}});
}

std::string model_folder_config(const std::string& dir, const std::string& what) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    throw Error(dir + ": no such folder; expected " + what);
  }
  const std::filesystem::path config = std::filesystem::path(dir) / "config.json";
  if (!std::filesystem::is_regular_file(config, ec)) {
    throw Error(dir + ": no config.json; expected " + what);
  }
  return config.string();
}

void load_model_folder_weights(torch::nn::Module& model, const std::string& dir, torch::Dtype dtype,
                               const std::string& variant, const std::string& prefix) {
  const io::WeightFiles files = io::find_weight_files(dir, prefix, variant);
  load_weights(model, io::load_weight_files(files, dtype),
               files.index.empty() ? files.files.at(0) : files.index);
}

}  // namespace difftrain::models
