#include "difftrain/models/lora/lora_folder.h"

#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/lora/lora.h"
#include "difftrain/models/pretrained.h"
#include "difftrain/models/text_encoders/clip_text_model.h"

#include <cmath>
#include <filesystem>
#include <optional>
#include <system_error>

namespace difftrain::models {

namespace fs = std::filesystem;

namespace {

// The UNet's folder inside `model_dir`, relative to it: "unet" for a pipeline, "" for a UNet.
fs::path unet_subfolder(const std::string& model_dir) {
  const fs::path root(model_dir);
  if (!fs::is_directory(root)) {
    throw Error(model_dir +
                ": no such folder; expected a Diffusers pipeline folder (model_index.json + "
                "unet/) or a UNet folder (config.json + diffusion_pytorch_model.safetensors)");
  }
  if (fs::exists(root / "model_index.json")) {
    if (!fs::is_directory(root / "unet")) {
      throw Error(model_dir +
                  ": pipeline folder without unet/; expected unet/config.json and "
                  "unet/diffusion_pytorch_model.safetensors");
    }
    return "unet";
  }
  if (fs::exists(root / "config.json")) return "";
  throw Error(model_dir +
              ": neither model_index.json (pipeline folder) nor config.json (UNet folder) found");
}

bool inside(const fs::path& child, const fs::path& parent) {
  auto c = child.begin(), p = parent.begin();
  for (; p != parent.end(); ++p, ++c) {
    if (p->empty()) continue;  // a trailing separator
    if (c == child.end() || *c != *p) return false;
  }
  return true;
}

void check_output(const std::string& model_dir, const std::string& output_dir) {
  if (output_dir.empty()) throw Error("the output folder is empty; give a new folder to write");
  const fs::path in = fs::weakly_canonical(model_dir), out = fs::weakly_canonical(output_dir);
  if (in == out) {
    throw Error(output_dir + ": the output is the input folder " + model_dir +
                "; give a new folder (the input is never overwritten)");
  }
  if (inside(out, in)) {
    throw Error(output_dir + ": the output lies inside the input folder " + model_dir +
                "; give a folder outside it");
  }
  if (fs::exists(output_dir)) {
    if (!fs::is_directory(output_dir)) {
      throw Error(output_dir + ": exists and is not a folder; give a new folder");
    }
    if (!fs::is_empty(output_dir)) {
      throw Error(output_dir + ": exists and is not empty; give a new folder or remove this one");
    }
  }
}

// The one floating dtype of every floating tensor in `file`, if they share one.
std::optional<torch::Dtype> common_float_dtype(const std::string& file) {
  std::optional<torch::Dtype> dtype;
  for (const auto& [name, t] : io::load_safetensors(file).tensors) {
    if (!t.is_floating_point()) continue;
    if (dtype && *dtype != t.scalar_type()) return std::nullopt;
    dtype = t.scalar_type();
  }
  return dtype;
}

bool is_unet_weights(const fs::path& name) {
  return name.filename().string().rfind("diffusion_pytorch_model", 0) == 0;
}

// Copies `from` into `to` except the UNet's config and weights in `unet_rel`, which save_unet
// writes. Returns the number of files copied; skipped weight files go to `skipped`.
int64_t copy_except_unet(const fs::path& from, const fs::path& to, const fs::path& unet_rel,
                         const fs::path& merged_file, std::vector<std::string>& skipped) {
  int64_t copied = 0;
  fs::create_directories(to / unet_rel);
  for (auto it =
           fs::recursive_directory_iterator(from, fs::directory_options::follow_directory_symlink);
       it != fs::recursive_directory_iterator(); ++it) {
    // Lexical, not fs::relative: that resolves symlinks (Hugging Face cache files link to blobs).
    const fs::path rel = it->path().lexically_relative(from);
    if (it->is_directory()) {
      fs::create_directories(to / rel);
      continue;
    }
    if (!it->is_regular_file()) continue;  // sockets, dangling links
    if (rel.parent_path() == unet_rel &&
        (rel.filename() == "config.json" || is_unet_weights(rel))) {
      if (is_unet_weights(rel) && rel.filename() != merged_file) skipped.push_back(rel.string());
      continue;
    }
    fs::copy_file(it->path(), to / rel);
    ++copied;
  }
  return copied;
}

}  // namespace

LoraFolderMergeSummary merge_lora_into_folder(const std::string& model_dir,
                                              const std::string& lora_path,
                                              const std::string& output_dir,
                                              const LoraFolderMergeOptions& options) {
  if (!std::isfinite(options.lora_scale)) {
    throw Error("lora_scale is " + std::to_string(options.lora_scale) +
                ": it must be a finite number (1 applies the LoRA as trained)");
  }
  const fs::path unet_rel = unet_subfolder(model_dir);
  check_output(model_dir, output_dir);
  // A folder is a PEFT adapter folder (adapter_model.safetensors + adapter_config.json) or a
  // Diffusers one (pytorch_lora_weights.safetensors); read_lora picks the file.
  if (!fs::is_regular_file(lora_path) && !fs::is_directory(lora_path)) {
    throw Error(lora_path +
                ": no such LoRA file; give a .safetensors file in Diffusers, PEFT or kohya format");
  }

  LoraFolderMergeSummary summary;
  summary.unet_dir = (fs::path(model_dir) / unet_rel).string();
  const io::LoraWeights lora = io::read_lora(lora_path, options.read);
  summary.format = lora.format;
  // A pipeline's text encoders take their targets too (Diffusers' fuse_lora fuses them).
  const bool pipeline = !unet_rel.empty();
  std::map<std::string, io::TensorMap> merged_encoders;  // component -> its new model.safetensors
  for (const auto& [component, targets] : lora.components) {
    if (component == "unet" || targets.empty()) continue;
    const fs::path dir = fs::path(model_dir) / component;
    const bool encoder = component == "text_encoder" || component == "text_encoder_2";
    const fs::path file =
        dir / (options.variant.empty() ? "model.safetensors"
                                       : "model." + options.variant + ".safetensors");
    if (!pipeline || !encoder || !fs::is_regular_file(file)) {
      summary.skipped_components[component] = static_cast<int64_t>(targets.size());
      continue;
    }
    ClipTextModel te =
        load_clip_text_model(dir.string(), options.variant, component == "text_encoder_2");
    summary.text_encoder_modules_merged +=
        merge_lora(*te, lora, options.lora_scale, component).modules_merged;
    // Every tensor of the file again, the merged ones in the file's dtype.
    io::TensorMap tensors = io::load_safetensors(file.string()).tensors;
    const auto params = te->named_parameters(/*recurse=*/true);
    for (auto& [name, t] : tensors) {
      if (const torch::Tensor* p = params.find(name))
        t = p->detach().to(t.scalar_type()).contiguous();
    }
    merged_encoders[component] = std::move(tensors);
  }
  if (lora.count("unet") == 0) {
    throw Error("LoRA file '" + lora_path +
                "' has no UNet targets (only other components, e.g. text encoders); nothing to "
                "merge into the UNet");
  }

  const std::string weights = weights_path(summary.unet_dir, options.variant);
  UNet unet = load_unet(summary.unet_dir, options.variant);
  summary.modules_merged = merge_lora(*unet, lora, options.lora_scale, "unet").modules_merged;
  if (const auto dtype = common_float_dtype(weights); dtype && *dtype != torch::kFloat32) {
    unet->to(*dtype);
  }

  // Built beside the output and renamed at the end, so a failure leaves no half-written folder.
  fs::path out = fs::absolute(output_dir).lexically_normal();
  if (out.filename().empty()) out = out.parent_path();  // "out/" names the folder "out"

  io::write_folder_atomic(out, "merged model", output_dir, [&](const fs::path& staging) {
    fs::path from = fs::path(model_dir).lexically_normal();
    if (from.filename().empty()) from = from.parent_path();
    summary.files_copied = copy_except_unet(from, staging, unet_rel, fs::path(weights).filename(),
                                            summary.skipped_files);
    save_unet(*unet, (staging / unet_rel).string(), options.variant);
    for (const auto& [component, tensors] : merged_encoders) {
      const std::string name = options.variant.empty()
                                   ? "model.safetensors"
                                   : "model." + options.variant + ".safetensors";
      io::save_safetensors((staging / component / name).string(), tensors, {{"format", "pt"}});
      summary.weights_written.push_back((out / component / name).string());
      // Other weight files of the encoder hold it without the LoRA.
      for (const auto& e : fs::directory_iterator(staging / component)) {
        const std::string f = e.path().filename().string();
        if (f != name && (f.rfind("model", 0) == 0 || f.rfind("pytorch_model", 0) == 0) &&
            f != "model_index.json") {
          summary.skipped_files.push_back((fs::path(component) / f).string());
          fs::remove(e.path());
        }
      }
    }
  });
  summary.weights_written.insert(summary.weights_written.begin(),
                                 (out / unet_rel / fs::path(weights).filename()).string());

  log::info("LoRA {} ({} format): merged into {} UNet modules{} with lora_scale {}; wrote {}",
            lora_path, io::format_label(lora), summary.modules_merged,
            merged_encoders.empty()
                ? std::string()
                : fmt::format(" and {} text encoder modules", summary.text_encoder_modules_merged),
            options.lora_scale, output_dir);
  for (const auto& [component, n] : summary.skipped_components) {
    log::warn(
        "LoRA {}: {} targets for the {} were not merged (a UNet folder, or no {}/model.safetensors "
        "in the pipeline)",
        lora_path, n, component, component);
  }
  for (const auto& file : summary.skipped_files) {
    log::warn("{}: not copied: it holds the model without the LoRA; merge that variant separately",
              (fs::path(model_dir) / file).string());
  }
  return summary;
}

}  // namespace difftrain::models
