// FLUX.1 LoRA files against a folder: the transformer's sizes turn BFL names (kohya, ComfyUI,
// XLabs) into Diffusers modules (families/flux/lora_layouts.h); CLIP's kohya names resolve against
// text_encoder/'s weights.
#include "difftrain/core/error.h"
#include "difftrain/families/family.h"
#include "difftrain/families/flux/lora_layouts.h"
#include "difftrain/models/transformers/flux_transformer.h"
#include "flux_family.h"

#include <filesystem>

namespace difftrain::families::flux {
namespace fs = std::filesystem;

namespace {

families::flux::FluxLoraDims flux_dims_of(const std::string& dir) {
  const std::string config = (fs::path(flux_transformer_dir(dir)) / "config.json").string();
  const auto o = models::FluxTransformer2DModelOptions::load(config);
  families::flux::FluxLoraDims d;
  d.double_blocks = o.num_layers();
  d.single_blocks = o.num_single_layers();
  d.inner_dim = o.inner_dim();
  d.mlp_dim = 4 * o.inner_dim();  // FluxSingleTransformerBlock's mlp_ratio 4.0
  return d;
}

}  // namespace

io::LoraWeights read_flux_lora(const std::string& path, const std::string& dir,
                               const io::LoraReadOptions& options) {
  io::LoraWeights lora = io::read_lora(path, options);
  families::flux::convert_flux_lora(lora, flux_dims_of(dir));
  if (fs::is_regular_file(fs::path(dir) / "model_index.json")) {
    adapt_text_encoder_lora(lora, dir, "text_encoder");
  }
  return lora;
}

void adapt_flux_lora(io::LoraWeights& lora, const std::string& dir, io::LoraFormat format) {
  const families::flux::FluxLoraDims dims = flux_dims_of(dir);
  families::flux::convert_flux_lora(lora, dims);
  if (fs::is_regular_file(fs::path(dir) / "model_index.json")) {
    adapt_text_encoder_lora(lora, dir, "text_encoder");
  }
  // kohya files name the transformer's modules as BFL does (sd-scripts' networks.lora_flux).
  if (format == io::LoraFormat::kKohya) lora = families::flux::flux_lora_to_bfl(lora, dims.mlp_dim);
}

}  // namespace difftrain::families::flux
