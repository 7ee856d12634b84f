// Writing LoRA files: the inverse of parse_lora() in lora_format.cpp, one key layout per format.
// The reader and the writer share only the key grammar documented in lora_format.h; a round trip
// through both is what tests/unit/lora_writer_test.cpp checks.

#include "difftrain/core/error.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/lora_adapter_config.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/io/lora_layout.h"
#include "difftrain/io/safetensors.h"

#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <sstream>

namespace difftrain::io {
namespace {

// `where` starts every message: "lora_to_tensors" or "cannot write LoRA file '<path>'".
[[noreturn]] void writer_fail(const std::string& where, const std::string& what) {
  throw Error(where + ": " + what);
}

// Shortest readable form of a number: 1e-60, 0.5, 3 (std::to_string gives 0.000000 for 1e-60).
std::string num(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

std::string describe(const std::string& component, const LoraTarget& t) {
  std::string s = component + " target '" + t.module + "'";
  if (!t.key.empty() && t.key != t.module) s += " (key '" + t.key + "')";
  return s;
}

// The same pair rules parse_lora() enforces, so a written file always reads back.
void check_pair(const std::string& where, const std::string& component, const LoraTarget& t) {
  if (!t.down.defined() || !t.up.defined()) {
    writer_fail(where, describe(component, t) + " has no down or no up tensor; set both");
  }
  if (!torch::isFloatingType(t.down.scalar_type()) || !torch::isFloatingType(t.up.scalar_type())) {
    writer_fail(where, describe(component, t) + " has down " + shape_and_dtype(t.down) +
                           " and up " + shape_and_dtype(t.up) +
                           ": LoRA weights must be floating point; convert them first");
  }
  const bool linear = t.down.dim() == 2 && t.up.dim() == 2;
  const bool conv = t.down.dim() == 4 && t.up.dim() == 4 && t.up.size(2) == 1 && t.up.size(3) == 1;
  if ((!linear && !conv) || t.down.size(0) != t.up.size(1) || t.down.size(0) < 1) {
    writer_fail(where, describe(component, t) + " has down " + shape_and_dtype(t.down) +
                           " and up " + shape_and_dtype(t.up) +
                           ": a LoRA pair is [r, in] and [out, r] (Linear) or [r, in, kh, kw] and "
                           "[out, r, 1, 1] (Conv2d) with the same r >= 1");
  }
  if (t.alpha && !std::isfinite(*t.alpha)) {
    writer_fail(where, describe(component, t) + " has alpha " + num(*t.alpha) +
                           ": alpha must be a finite number (or unset for scale 1)");
  }
}

// Whether a pipeline component is a text encoder ("text_encoder", "text_encoder_2", ...); every
// other component a LoRA adapts is the denoiser.
bool is_text_encoder(const std::string& component) {
  return component.rfind("text_encoder", 0) == 0;
}

// kohya's prefix of `component`: lora_<component>_ for the denoiser; a lone text encoder is
// lora_te_, a pair lora_te1_/lora_te2_.
std::string kohya_prefix(const std::string& component, bool several_text_encoders) {
  if (component == "text_encoder") return several_text_encoders ? "lora_te1_" : "lora_te_";
  const std::string te = "text_encoder_";
  if (component.rfind(te, 0) == 0) return "lora_te" + component.substr(te.size()) + "_";
  return "lora_" + component + "_";  // the denoiser's component, as the reader takes it
}

// up * scale, formed in float64 and rounded once to up's dtype; up itself when scale is 1 or
// when the scale is kept beside the weights (`fold` false).
torch::Tensor folded_up(const LoraTarget& t, bool fold) {
  const double scale = t.scale();
  if (scale == 1.0 || !fold) return t.up.contiguous();
  return (t.up.to(torch::kFloat64) * scale).to(t.up.scalar_type()).contiguous();
}

std::map<std::string, torch::Tensor> to_tensors(const LoraWeights& lora, LoraFormat format,
                                                const std::string& where, bool fold) {
  std::map<std::string, torch::Tensor> out;
  auto put = [&](const std::string& key, const torch::Tensor& tensor, const std::string& component,
                 const LoraTarget& t) {
    if (!out.emplace(key, tensor).second) {
      writer_fail(where, describe(component, t) + " and another target both become key '" + key +
                             "' in " + to_string(format) + " format; remove one of them" +
                             (format == LoraFormat::kKohya || format == LoraFormat::kComfyUI
                                  ? " or write a Diffusers or PEFT file"
                                  : ""));
    }
  };
  // SDXL's pair, SD3's three, and FLUX.1's CLIP (sd-scripts numbers it lora_te1_, and Diffusers'
  // FLUX loader rejects lora_te_) are numbered; SD 1.x/2.x's lone CLIP is lora_te_.
  const bool several_te =
      lora.components.count("text_encoder_2") > 0 || lora.components.count("text_encoder_3") > 0 ||
      lora.components.count("transformer") > 0 || lora.kohya_numbered_text_encoders;
  size_t targets = 0;
  for (const auto& [component, list] : lora.components) {
    if (list.empty()) continue;
    if (!is_lora_component(component)) {
      std::string known;
      for (const auto& c : lora_components()) known += (known.empty() ? "" : ", ") + c;
      writer_fail(where, "component '" + component +
                             "' is no pipeline component a registered model family has; use " +
                             known);
    }
    for (const auto& t : list) {
      ++targets;
      if (t.module.empty())
        writer_fail(where, component + " target with key '" + t.key + "' has no module");
      check_pair(where, component, t);
      if (!t.resolved && format != LoraFormat::kKohya && format != LoraFormat::kComfyUI) {
        writer_fail(where,
                    describe(component, t) +
                        " is an unresolved kohya name; call io::resolve_kohya_names(lora, \"" +
                        component +
                        "\", models::lora_module_names(model)) first, or write kohya format");
      }
      const torch::Tensor down = t.down.contiguous();
      switch (format) {
        case LoraFormat::kDiffusers: {
          // Diffusers names a denoiser's layers `.lora.`, a text encoder's `.lora_linear_layer.`.
          const std::string layer = is_text_encoder(component) ? ".lora_linear_layer." : ".lora.";
          const std::string stem = component + "." + t.module + layer;
          put(stem + "down.weight", down, component, t);
          put(stem + "up.weight", folded_up(t, fold), component, t);
          break;
        }
        case LoraFormat::kPeft: {
          const std::string stem = component + "." + t.module + ".";
          put(stem + "lora_A.weight", down, component, t);
          put(stem + "lora_B.weight", folded_up(t, fold), component, t);
          break;
        }
        case LoraFormat::kKohya:
        case LoraFormat::kComfyUI: {
          // ComfyUI / musubi-tuner: the denoiser's resolved modules under diffusion_model.,
          // dotted; text encoders (and unresolved names) as kohya's.
          const bool comfy =
              format == LoraFormat::kComfyUI && !is_text_encoder(component) && t.resolved;
          const std::string stem = comfy
                                       ? "diffusion_model." + t.module
                                       : kohya_prefix(component, several_te) + kohya_name(t.module);
          // kohya's rule reads alpha 0 as alpha = r, so an unset or zero alpha is written as r.
          const double alpha =
              t.alpha && *t.alpha != 0.0 ? *t.alpha : static_cast<double>(t.rank());
          const float alpha32 = static_cast<float>(alpha);
          if (!std::isfinite(alpha32) || alpha32 == 0.0f) {
            writer_fail(where,
                        describe(component, t) + " has alpha " + num(alpha) +
                            ", which a float32 kohya alpha cannot hold; write a Diffusers or PEFT "
                            "file (the scale is folded into up there)");
          }
          put(stem + ".lora_down.weight", down, component, t);
          put(stem + ".lora_up.weight", t.up.contiguous(), component, t);
          put(stem + ".alpha", torch::tensor(alpha32, torch::kFloat32), component, t);
          break;
        }
      }
    }
  }
  if (targets == 0) writer_fail(where, "the LoRA has no targets; there is nothing to write");
  return out;
}

}  // namespace

std::map<std::string, torch::Tensor> lora_to_tensors(const LoraWeights& lora, LoraFormat format) {
  return to_tensors(lora, format, "lora_to_tensors", /*fold=*/true);
}

void write_lora(const std::string& path, const LoraWeights& lora, LoraFormat format,
                const std::map<std::string, std::string>& metadata) {
  const std::string where = "cannot write LoRA file '" + path + "'";
  // r and alpha go beside the weights (metadata, adapter_config.json), so nothing is folded.
  const auto tensors = to_tensors(lora, format, where, /*fold=*/false);
  Metadata meta = metadata;
  meta.emplace("format", "pt");
  std::map<std::string, LoraAdapterConfig> configs;
  if (format != LoraFormat::kKohya && format != LoraFormat::kComfyUI) {
    for (const auto& [component, targets] : lora.components) {
      if (!targets.empty()) configs[component] = make_lora_adapter_config(targets);
    }
    meta.emplace(kLoraAdapterMetadataKey, lora_adapter_metadata_json(configs));
  }
  save_safetensors(path, tensors, meta);
  if (format == LoraFormat::kPeft) {
    // PEFT's adapter_config.json describes one model: the denoiser's targets when present.
    auto main = configs.begin();
    for (auto it = configs.begin(); it != configs.end(); ++it) {
      if (!is_text_encoder(it->first)) {
        main = it;
        break;
      }
    }
    const auto config_path =
        (std::filesystem::path(path).parent_path() / kPeftAdapterConfigName).string();
    write_file_atomic(config_path, lora_adapter_config_json(main->second));
  }
}

}  // namespace difftrain::io
