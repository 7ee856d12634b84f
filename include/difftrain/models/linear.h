#pragma once
// The UNet's Linear and Conv2d layers: LibTorch's, plus a slot for a trainable LoRA adapter whose
// output is added to the layer's (PEFT's `lora.Linear` / `lora.Conv2d` wrapping a base layer).
// Parameters keep LibTorch's names (weight, bias), so Diffusers keys are unchanged; the adapter
// is not a registered child, so state dicts, strict loading and saving never see it — it belongs
// to a models::LoraLayers container (models/lora_training.h). A frozen weight may be stored in 8
// bits instead (quantize_weight, models/quantized_weight.h).
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>

#include "difftrain/models/kernels/quantized_weight.h"

namespace difftrain::models {

/// Options of one LoRA adapter (PEFT's `LoraConfig` for one layer).
struct LoraAdapterOptions {
  /// r, the adapter's rank (> 0).
  TORCH_ARG(int64_t, rank) = 4;
  /// The update is scaled by alpha / rank (PEFT `lora_alpha`; Diffusers' scripts use alpha = r).
  TORCH_ARG(double, alpha) = 4.0;
  /// Dropout on the adapter's input during training (PEFT `lora_dropout`), in [0, 1).
  TORCH_ARG(double, dropout) = 0.0;
};

/// A low-rank update of one layer: y = up(down(dropout(x))) * alpha / rank, with `lora_A` (down:
/// Linear in→r, or Conv2d with the base's kernel, stride and padding) and `lora_B` (up: Linear
/// r→out or 1x1 Conv2d) as PEFT names them. Initialised as PEFT's default: A Kaiming-uniform (a =
/// sqrt(5)), B zero, so a fresh adapter changes nothing.
class LoraAdapterImpl : public torch::nn::Module {
 public:
  /// For a Linear [out, in].
  LoraAdapterImpl(const torch::nn::LinearOptions& base, const LoraAdapterOptions& options);
  /// For a Conv2d [out, in, kh, kw] (groups = 1, dilation 1).
  LoraAdapterImpl(const torch::nn::detail::ConvNdOptions<2>& base,
                  const LoraAdapterOptions& options);

  /// x: the base layer's input ([..., in] or [B, in, H, W]) → the update, the base's output shape.
  torch::Tensor forward(const torch::Tensor& x);

  /// alpha / rank.
  double scale() const { return options_.alpha() / static_cast<double>(options_.rank()); }
  const LoraAdapterOptions& options() const { return options_; }
  /// down's weight: [r, in] or [r, in, kh, kw].
  const torch::Tensor& down_weight() const { return down_weight_; }
  /// up's weight: [out, r] or [out, r, 1, 1].
  const torch::Tensor& up_weight() const { return up_weight_; }
  /// Whether the adapter is for a Conv2d.
  bool is_conv() const { return conv_; }

 private:
  LoraAdapterOptions options_;
  bool conv_ = false;
  torch::nn::detail::ConvNdOptions<2> conv_options_{1, 1, 1};
  torch::Tensor down_weight_, up_weight_;
};
TORCH_MODULE(LoraAdapter);

/// torch::nn::Linear with an optional LoRA adapter: forward(x) = linear(x) + adapter(x).
class LinearImpl : public torch::nn::LinearImpl {
 public:
  using torch::nn::LinearImpl::LinearImpl;
  /// x: [..., in] → [..., out].
  torch::Tensor forward(const torch::Tensor& x);
  /// Attaches (or with nullptr detaches) an adapter; it must have been made for this layer.
  void set_lora(LoraAdapter adapter);
  const LoraAdapter& lora() const { return lora_; }

  /// Stores the frozen weight in 8 bits (quantized_weight.h): `weight` stops being a parameter
  /// (undefined), forward and its input gradient dequantize it per call. Throws difftrain::Error
  /// for a weight that requires grad, or kDense.
  void quantize_weight(WeightStorage storage);
  /// The 8-bit weight (undefined q when dense).
  const QuantizedWeight& quantized_weight() const { return qweight_; }
  /// The dtype the layer computes in: the weight's, or the quantized weight's former one.
  torch::Dtype weight_dtype() const;
  /// Module::to, also moving the 8-bit weight (its scales stay float32, its values 8-bit; a
  /// dtype becomes what it dequantizes to).
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;

 private:
  LoraAdapter lora_{nullptr};
  QuantizedWeight qweight_;
};
TORCH_MODULE(Linear);

/// torch::nn::Conv2d with an optional LoRA adapter: forward(x) = conv(x) + adapter(x).
class Conv2dImpl : public torch::nn::Conv2dImpl {
 public:
  using torch::nn::Conv2dImpl::Conv2dImpl;
  /// x: [B, in, H, W] → [B, out, H', W'].
  torch::Tensor forward(const torch::Tensor& x);
  /// Attaches (or with nullptr detaches) an adapter; it must have been made for this layer.
  void set_lora(LoraAdapter adapter);
  const LoraAdapter& lora() const { return lora_; }

  /// Stores the frozen weight in 8 bits (quantized_weight.h): `weight` stops being a parameter
  /// (undefined), forward and its input gradient dequantize it per call. Throws difftrain::Error
  /// for a weight that requires grad, or kDense.
  void quantize_weight(WeightStorage storage);
  /// The 8-bit weight (undefined q when dense).
  const QuantizedWeight& quantized_weight() const { return qweight_; }
  /// The dtype the layer computes in: the weight's, or the quantized weight's former one.
  torch::Dtype weight_dtype() const;
  /// Module::to, also moving the 8-bit weight (its scales stay float32, its values 8-bit; a
  /// dtype becomes what it dequantizes to).
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;

  /// Whether forward_blocked applies to an input of these plain sizes ([B, in, H, W]): a training
  /// step (grad mode on, or a checkpointed function), a layer without an adapter, and either a
  /// 3x3 stride-1 layer with a Winograd kernel for it, or a 1x1 stride-1 unpadded one
  /// (pointwise_conv2d_blocked; both sides blocked) (models/winograd_conv.h).
  bool blocked_applies(torch::IntArrayRef x_sizes) const;
  /// forward(x) with the input and/or output in oneDNN's blocked layout ([B, C / 16, H, W, 16],
  /// see winograd_conv2d); only where blocked_applies said so (a 1x1 layer: both blocked).
  torch::Tensor forward_blocked(const torch::Tensor& x, bool x_blocked, bool y_blocked);

 private:
  // A 1x1, stride-1, unpadded, ungrouped layer.
  bool is_pointwise() const;
  // The padding a Winograd or small-output convolution would use in a training step, or -1
  // where neither applies to this layer.
  int64_t fast_path_padding() const;
  LoraAdapter lora_{nullptr};
  QuantizedWeight qweight_;
};
TORCH_MODULE(Conv2d);

}  // namespace difftrain::models
