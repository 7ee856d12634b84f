// Z-Image LoRA files: Diffusers / PEFT (`transformer.<module>.lora_A.weight`, alphas in the
// metadata or beside the weights), the ComfyUI / musubi-tuner form (`diffusion_model.<module>`
// with lora_down / lora_up / .alpha, read as `transformer.` keys) and kohya names
// (`lora_unet_layers_0_attention_to_q`, resolved against the transformer's weight names), as
// Diffusers' ZImageLoraLoaderMixin reads them (_convert_non_diffusers_z_image_lora_to_diffusers).
#include "../dit_lora.h"
#include "z_image_pipeline.h"

namespace difftrain::families::z_image {

namespace {

const DitLoraLayout& z_image_layout() {
  static const DitLoraLayout layout{
      "Z-Image",
      {"layers", "noise_refiner", "context_refiner", "all_final_layer", "all_x_embedder",
       "cap_embedder", "t_embedder"},
      // The original checkpoint's attention output `out` is Diffusers' `to_out.0`.
      {{R"(\.attention\.out$)", ".attention.to_out.0"}},
      z_image_transformer_dir,
      {}};
  return layout;
}

}  // namespace

io::LoraWeights read_z_image_lora(const std::string& path, const std::string& dir,
                                  const io::LoraReadOptions& options) {
  return read_dit_lora(z_image_layout(), path, dir, options);
}

void adapt_z_image_lora(io::LoraWeights& lora, const std::string& dir, io::LoraFormat format) {
  adapt_dit_lora(z_image_layout(), lora, dir, format);
}

io::LoraKeyLayout z_image_lora_key_layout() { return dit_comfyui_key_layout(z_image_layout()); }

}  // namespace difftrain::families::z_image
