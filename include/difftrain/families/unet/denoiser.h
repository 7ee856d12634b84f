#pragma once
// The UNet families' denoiser: a Diffusers UNet behind diffusion::Denoiser's named-conditioning
// interface (diffusion/denoiser.h).

#include "difftrain/diffusion/denoiser.h"
#include "difftrain/models/unets/unet.h"

namespace difftrain::families::unet {

/// A Diffusers UNet (UNet2DModel / UNet2DConditionModel) as a Denoiser; the names are the fields
/// of models::UNetConditioning.
class UNetDenoiser : public diffusion::Denoiser {
 public:
  explicit UNetDenoiser(models::UNet unet) : unet_(std::move(unet)) {}
  torch::Tensor denoise(const torch::Tensor& x, const torch::Tensor& t,
                        const diffusion::Conditioning& cond) override;
  /// cond as the UNet's own conditioning struct (throws for an unknown name).
  static models::UNetConditioning unet_conditioning(const diffusion::Conditioning& cond);

 private:
  models::UNet unet_;
};

}  // namespace difftrain::families::unet
