// The UNet families' denoiser: a Diffusers UNet behind the named-conditioning interface.
#include "difftrain/families/unet/denoiser.h"

#include "difftrain/core/error.h"

#include <fmt/format.h>

namespace difftrain::families::unet {
using namespace difftrain::diffusion;

models::UNetConditioning UNetDenoiser::unet_conditioning(const Conditioning& cond) {
  models::UNetConditioning c;
  for (const auto& [name, tensor] : cond) {
    if (name == "class_labels") {
      c.class_labels = tensor;
    } else if (name == "encoder_hidden_states") {
      c.encoder_hidden_states = tensor;
    } else if (name == "timestep_cond") {
      c.timestep_cond = tensor;
    } else if (name == "text_embeds") {
      c.text_embeds = tensor;
    } else if (name == "time_ids") {
      c.time_ids = tensor;
    } else {
      throw Error(fmt::format(
          "a UNet takes no conditioning '{}'; it takes class_labels, encoder_hidden_states, "
          "timestep_cond, text_embeds and time_ids",
          name));
    }
  }
  return c;
}

torch::Tensor UNetDenoiser::denoise(const torch::Tensor& x, const torch::Tensor& t,
                                    const Conditioning& cond) {
  return unet_->forward(x, t, unet_conditioning(cond));
}

}  // namespace difftrain::families::unet
