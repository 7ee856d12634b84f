#include "difftrain/models/linear.h"

#include "difftrain/core/error.h"
#include "difftrain/core/torch_compat.h"
#include "difftrain/models/checkpointing.h"
#include "difftrain/models/kernels/fused_ops.h"
#include "difftrain/models/kernels/packed_matmul.h"
#include "difftrain/models/kernels/winograd_conv.h"

#include <torch/nn/functional/conv.h>
#include <torch/nn/functional/dropout.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/init.h>

#include <cmath>
#include <optional>
#include <string>

namespace difftrain::models {
namespace {

void check_options(const LoraAdapterOptions& o) {
  if (o.rank() < 1) {
    throw Error("LoRA rank is " + std::to_string(o.rank()) + ": it must be at least 1");
  }
  if (!(o.alpha() > 0) || !std::isfinite(o.alpha())) {
    throw Error("LoRA alpha is " + std::to_string(o.alpha()) + ": it must be a positive number");
  }
  if (!(o.dropout() >= 0 && o.dropout() < 1)) {
    throw Error("LoRA dropout is " + std::to_string(o.dropout()) + ": it must be in [0, 1)");
  }
}

}  // namespace

LoraAdapterImpl::LoraAdapterImpl(const torch::nn::LinearOptions& base,
                                 const LoraAdapterOptions& options)
    : options_(options) {
  check_options(options);
  const int64_t r = options.rank();
  // Submodule-like names (lora_A.weight) without the submodules: two parameters in two children.
  auto a = register_module("lora_A", std::make_shared<torch::nn::Module>());
  auto b = register_module("lora_B", std::make_shared<torch::nn::Module>());
  down_weight_ = a->register_parameter("weight", torch::empty({r, base.in_features()}));
  up_weight_ = b->register_parameter("weight", torch::zeros({base.out_features(), r}));
  torch::NoGradGuard no_grad;
  torch::nn::init::kaiming_uniform_(down_weight_, std::sqrt(5.0));
}

LoraAdapterImpl::LoraAdapterImpl(const torch::nn::detail::ConvNdOptions<2>& base,
                                 const LoraAdapterOptions& options)
    : options_(options), conv_(true), conv_options_(base) {
  check_options(options);
  if (base.groups() != 1) throw Error("LoRA on a grouped convolution is not supported");
  const int64_t r = options.rank();
  const auto k = base.kernel_size();
  auto a = register_module("lora_A", std::make_shared<torch::nn::Module>());
  auto b = register_module("lora_B", std::make_shared<torch::nn::Module>());
  down_weight_ =
      a->register_parameter("weight", torch::empty({r, base.in_channels(), (*k)[0], (*k)[1]}));
  up_weight_ = b->register_parameter("weight", torch::zeros({base.out_channels(), r, 1, 1}));
  torch::NoGradGuard no_grad;
  torch::nn::init::kaiming_uniform_(down_weight_, std::sqrt(5.0));
}

torch::Tensor LoraAdapterImpl::forward(const torch::Tensor& x) {
  torch::Tensor h = x;
  if (options_.dropout() > 0 && is_training()) {
    h = torch::dropout(h, options_.dropout(), /*train=*/true);
  }
  // up(down(h)) · scale, the scale applied to the rank-r values in between (the same map; rank
  // numbers a value instead of out_features), and not at all when it is 1 (alpha = rank).
  const double s = scale();
  if (!conv_) {
    torch::Tensor low = torch::linear(h, down_weight_);
    return torch::linear(s == 1.0 ? low : low.mul(s), up_weight_);
  }
  const auto& o = conv_options_;
  const auto* padding = compat::variant_get_if<torch::ExpandingArray<2>>(&o.padding());
  if (padding == nullptr) throw Error("LoRA on a convolution with string padding is not supported");
  h = torch::conv2d(h, down_weight_, {}, *o.stride(), **padding, *o.dilation());
  return torch::conv2d(s == 1.0 ? h : h.mul(s), up_weight_);
}

namespace {

// linear(x, weight, bias) for a weight (and bias) that does not train: the backward computes the
// input gradient alone, through linear_input_grad (kernels/packed_matmul.h).
class FrozenLinearFn : public torch::autograd::Function<FrozenLinearFn> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const torch::Tensor& bias) {
    ctx->save_for_backward({weight});
    // torch::nn::functional::linear, as LinearImpl computes otherwise (for 3-D inputs a bf16
    // product, then the bias added: not at::linear's one rounding), so the forward's numbers do
    // not depend on which path a layer takes.
    return torch::nn::functional::linear(x, weight, bias.numel() > 0 ? bias : torch::Tensor());
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    return {linear_input_grad(grads[0], saved[0]), {}, {}};
  }
};

// The dtype x is multiplied in: bf16 under CPU autocast to bf16 (autocast casts it), else its own.
torch::Dtype compute_dtype(const torch::Tensor& x) {
  if (x.device().is_cpu() && x.scalar_type() == torch::kFloat32 &&
      compat::autocast_enabled(c10::DeviceType::CPU) &&
      compat::autocast_dtype(c10::DeviceType::CPU) == torch::kBFloat16) {
    return torch::kBFloat16;
  }
  return x.scalar_type();
}

}  // namespace

torch::Tensor LinearImpl::forward(const torch::Tensor& x) {
  torch::Tensor y;
  if (qweight_.defined()) {
    y = quantized_linear(x, qweight_, bias);
  } else if (torch::GradMode::is_enabled() && x.requires_grad() && x.dim() > 0 &&
             !weight.requires_grad() && (!bias.defined() || !bias.requires_grad()) &&
             packed_linear_grad_applies(x.numel() / std::max<int64_t>(x.size(-1), 1), weight,
                                        compute_dtype(x))) {
    // A frozen layer (a LoRA step's base) in a step with enough rows for the packed path.
    y = FrozenLinearFn::apply(x.to(torch::kBFloat16), weight,
                              bias.defined() ? bias : torch::empty({0}, weight.options()));
  } else {
    y = torch::nn::LinearImpl::forward(x);
  }
  if (lora_.is_empty()) return y;
  return y + lora_->forward(x);
}

void LinearImpl::set_lora(LoraAdapter adapter) {
  if (!adapter.is_empty()) {
    if (adapter->is_conv() || adapter->down_weight().size(1) != options.in_features() ||
        adapter->up_weight().size(0) != options.out_features()) {
      throw Error("LoRA adapter does not fit a Linear(" + std::to_string(options.in_features()) +
                  ", " + std::to_string(options.out_features()) + ")");
    }
  }
  lora_ = std::move(adapter);
}

// Winograd (models/winograd_conv.h), or for 1-4 output channels the row-vectorised kernel
// (models/fused_ops.h), for a 3x3, stride-1 layer in a training step: grad mode on, or inside a
// checkpointed function (whose forward runs without grad; both its passes then agree). Not
// otherwise (no_grad inference and sampling keep LibTorch's convolution, whose numbers match
// Diffusers'), nor where the layer does not qualify.
int64_t Conv2dImpl::fast_path_padding() const {
  const auto& o = options;
  const auto* pad = compat::variant_get_if<torch::ExpandingArray<2>>(&o.padding());
  // Not keyed on train/eval mode: a run that resumes from a checkpoint must compute exactly what
  // an uninterrupted one does, whatever mode its frozen modules happen to be left in.
  const bool training_step = torch::GradMode::is_enabled() || in_checkpointed_function();
  if (!training_step || pad == nullptr || (*pad)->at(0) != (*pad)->at(1) ||
      (*o.kernel_size())[0] != 3 || (*o.kernel_size())[1] != 3 || (*o.stride())[0] != 1 ||
      (*o.stride())[1] != 1 || (*o.dilation())[0] != 1 || (*o.dilation())[1] != 1 ||
      o.groups() != 1 ||
      compat::variant_get_if<torch::enumtype::kZeros>(&o.padding_mode()) == nullptr) {
    return -1;
  }
  return (*pad)->at(0);
}

bool Conv2dImpl::blocked_applies(torch::IntArrayRef x_sizes) const {
  if (qweight_.defined()) return false;
  if (is_pointwise()) {
    const bool training_step = torch::GradMode::is_enabled() || in_checkpointed_function();
    return training_step && lora_.is_empty() &&
           pointwise_conv_blocked_applies(x_sizes, weight, bias);
  }
  const int64_t pad = fast_path_padding();
  return pad >= 0 && lora_.is_empty() && winograd_conv_applies(x_sizes, weight, bias, pad);
}

bool Conv2dImpl::is_pointwise() const {
  const auto& o = options;
  const auto* pad = compat::variant_get_if<torch::ExpandingArray<2>>(&o.padding());
  return pad != nullptr && (*pad)->at(0) == 0 && (*pad)->at(1) == 0 && (*o.kernel_size())[0] == 1 &&
         (*o.kernel_size())[1] == 1 && (*o.stride())[0] == 1 && (*o.stride())[1] == 1 &&
         o.groups() == 1;
}

torch::Tensor Conv2dImpl::forward_blocked(const torch::Tensor& x, bool x_blocked, bool y_blocked) {
  torch::Tensor y;
  if (is_pointwise()) {
    if (x_blocked && y_blocked && lora_.is_empty()) y = pointwise_conv2d_blocked(x, weight, bias);
    if (!y.defined())
      throw Error("Conv2d::forward_blocked: the blocked-layout path does not apply");
    return y;
  }
  const int64_t pad = fast_path_padding();
  if (pad >= 0 && lora_.is_empty()) y = winograd_conv2d(x, weight, bias, pad, x_blocked, y_blocked);
  if (!y.defined()) throw Error("Conv2d::forward_blocked: the blocked-layout path does not apply");
  return y;
}

torch::Tensor Conv2dImpl::forward(const torch::Tensor& x) {
  torch::Tensor y;
  if (qweight_.defined()) {
    const auto* pad = compat::variant_get_if<torch::ExpandingArray<2>>(&options.padding());
    if (pad == nullptr) throw Error("an 8-bit Conv2d with string padding is not supported");
    y = quantized_conv2d(x, qweight_, bias, *options.stride(), **pad, *options.dilation(),
                         options.groups());
    return lora_.is_empty() ? y : y + lora_->forward(x);
  }
  const int64_t pad = fast_path_padding();
  if (pad >= 0) {
    y = winograd_conv2d(x, weight, bias, pad);
    if (!y.defined()) y = small_out_conv2d(x, weight, bias, pad);
  }
  if (!y.defined()) y = torch::nn::Conv2dImpl::forward(x);
  if (lora_.is_empty()) return y;
  return y + lora_->forward(x);
}

void Conv2dImpl::set_lora(LoraAdapter adapter) {
  if (!adapter.is_empty()) {
    if (!adapter->is_conv() || adapter->down_weight().size(1) != options.in_channels() ||
        adapter->up_weight().size(0) != options.out_channels()) {
      throw Error("LoRA adapter does not fit a Conv2d(" + std::to_string(options.in_channels()) +
                  ", " + std::to_string(options.out_channels()) + ")");
    }
  }
  lora_ = std::move(adapter);
}

namespace {

// Drops `weight` from a layer's parameters for its 8-bit form (quantized_weight.h).
QuantizedWeight quantize_layer_weight(torch::Tensor& weight,
                                      torch::OrderedDict<std::string, torch::Tensor>& params,
                                      WeightStorage storage) {
  if (!weight.defined()) throw Error("quantize_weight: the layer's weight is already quantized");
  if (weight.requires_grad()) {
    throw Error("quantize_weight: the weight trains; only frozen weights are stored in 8 bits");
  }
  QuantizedWeight q = quantize(weight, storage);
  params.erase("weight");
  weight = torch::Tensor();
  return q;
}

void move_quantized(QuantizedWeight& q, std::optional<torch::Device> device,
                    std::optional<torch::Dtype> dtype, bool non_blocking) {
  if (!q.defined()) return;
  if (device) {
    q.q = q.q.to(*device, non_blocking);
    q.scale = q.scale.to(*device, non_blocking);
  }
  if (dtype) q.dtype = *dtype;
}

}  // namespace

#define DIFFTRAIN_QUANTIZED_LAYER(Impl, Base)                                  \
  void Impl::quantize_weight(WeightStorage storage) {                          \
    qweight_ = quantize_layer_weight(weight, parameters_, storage);            \
  }                                                                            \
  torch::Dtype Impl::weight_dtype() const {                                    \
    return qweight_.defined() ? qweight_.dtype : weight.scalar_type();         \
  }                                                                            \
  void Impl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) { \
    Base::to(device, dtype, non_blocking);                                     \
    move_quantized(qweight_, device, dtype, non_blocking);                     \
  }                                                                            \
  void Impl::to(torch::Dtype dtype, bool non_blocking) {                       \
    Base::to(dtype, non_blocking);                                             \
    move_quantized(qweight_, std::nullopt, dtype, non_blocking);               \
  }                                                                            \
  void Impl::to(torch::Device device, bool non_blocking) {                     \
    Base::to(device, non_blocking);                                            \
    move_quantized(qweight_, device, std::nullopt, non_blocking);              \
  }

DIFFTRAIN_QUANTIZED_LAYER(LinearImpl, torch::nn::LinearImpl)
DIFFTRAIN_QUANTIZED_LAYER(Conv2dImpl, torch::nn::Conv2dImpl)

#undef DIFFTRAIN_QUANTIZED_LAYER

}  // namespace difftrain::models
