// 8-bit frozen weights (quantized_weight.h): quantization, the dequantize-per-call Linear and
// Conv2d as autograd functions that keep only the 8-bit tensor, and the whole-model pass.
#include "difftrain/models/kernels/quantized_weight.h"

#include "difftrain/core/error.h"
#include "difftrain/core/torch_compat.h"
#include "difftrain/models/kernels/packed_matmul.h"
#include "difftrain/models/linear.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/autograd.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace difftrain::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

#if DIFFTRAIN_TORCH_AT_LEAST(2, 1)
constexpr bool kHasFloat8 = true;
const torch::Dtype kFloat8 = torch::kFloat8_e4m3fn;
#else
constexpr bool kHasFloat8 = false;
const torch::Dtype kFloat8 = torch::kInt8;  // never used: parse refuses fp8 here
#endif

// The largest magnitude each storage holds: int8's 127, float8_e4m3fn's 448.
double storage_max(WeightStorage s) { return s == WeightStorage::kInt8 ? 127.0 : 448.0; }

// One row: out[c] = in[c] * s in float32. Plain loops over raw pointers, cloned for AVX-512 and
// AVX2 (the one picked at load time runs 16 or 8 weights a lane-wide multiply); the default clone
// runs anywhere.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DIFFTRAIN_DEQUANT_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DIFFTRAIN_DEQUANT_CLONES
#endif

DIFFTRAIN_DEQUANT_CLONES void dequantize_span_f32(const int8_t* in, float s, float* out,
                                                  int64_t n) {
  for (int64_t c = 0; c < n; ++c) out[c] = static_cast<float>(in[c]) * s;
}

// The same rounded once to bf16 as c10::BFloat16 rounds (to nearest, ties to even; NaN to
// 0x7FC0), written as integer operations on the float's bits so that the loop vectorises: the
// constructor's call per weight made this 1.2 ns a weight, two to three passes a step.
DIFFTRAIN_DEQUANT_CLONES void dequantize_span_bf16(const int8_t* in, float s, uint16_t* out,
                                                   int64_t n) {
  for (int64_t c = 0; c < n; ++c) {
    const float f = static_cast<float>(in[c]) * s;
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    out[c] = static_cast<uint16_t>(f != f ? 0x7FC0u : rounded);
  }
}

// Writes q[r, c] * scale[r], computed in float32 and rounded once to T, for rows [begin, end).
template <typename T>
void dequantize_rows(const int8_t* q, const float* scale, T* out, int64_t cols, int64_t begin,
                     int64_t end) {
  static_assert(sizeof(c10::BFloat16) == sizeof(uint16_t), "bf16 is 16 bits");
  for (int64_t r = begin; r < end; ++r) {
    if constexpr (std::is_same_v<T, float>) {
      dequantize_span_f32(q + r * cols, scale[r], out + r * cols, cols);
    } else {
      dequantize_span_bf16(q + r * cols, scale[r], reinterpret_cast<uint16_t*>(out + r * cols),
                           cols);
    }
  }
}

// q * scale per output channel (row) in float32, rounded once to `to`: the same values as
// (q.to(float32) * scale).to(to), in one pass over the 8 bits for a contiguous int8 weight on the
// CPU into float32 or bf16 (no float32 temporaries: the per-call dequantization of a LoRA step's
// frozen base costs about a third of the three-pass form here), else by those tensor ops.
//
// With `scratch` the result is a view of a per-thread buffer that the next such call on the thread
// overwrites, for a weight used once and dropped (the Functions below, with grad mode off): a fresh
// tensor per call is, for FLUX.1's 3072 x 12288 MLP weights (72 MiB in bf16), above glibc's 32 MiB
// mmap threshold, so every call mapped new pages and paid a page fault and the kernel's zeroing
// per 4 KiB: a third of an int8 LoRA step at 256 tokens here. The buffer keeps the largest weight
// dequantized so far per thread and dtype (the size one call needed anyway).
torch::Tensor dequantize_to(const torch::Tensor& q, const torch::Tensor& scale, torch::Dtype to,
                            bool scratch = false) {
  if (q.device().is_cpu() && q.scalar_type() == torch::kInt8 && q.is_contiguous() &&
      q.numel() > 0 && (to == torch::kFloat32 || to == torch::kBFloat16)) {
    torch::Tensor out;
    if (scratch) {
      thread_local torch::Tensor buffers[2];  // float32, bf16
      torch::Tensor& buffer = buffers[to == torch::kFloat32 ? 0 : 1];
      if (!buffer.defined() || buffer.numel() < q.numel()) {
        buffer = torch::Tensor();  // the old one goes first: the peak is one buffer
        buffer = torch::empty({q.numel()}, q.options().dtype(to));
      }
      out = buffer.narrow(0, 0, q.numel()).view(q.sizes());
    } else {
      out = torch::empty(q.sizes(), q.options().dtype(to));
    }
    const auto s = scale.to(torch::kFloat32).contiguous();
    const int64_t rows = q.size(0), cols = q.numel() / rows;
    const int8_t* in = q.data_ptr<int8_t>();
    const float* sp = s.data_ptr<float>();
    const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(cols, 1));
    if (to == torch::kFloat32) {
      float* o = out.data_ptr<float>();
      at::parallel_for(0, rows, grain,
                       [&](int64_t b, int64_t e) { dequantize_rows(in, sp, o, cols, b, e); });
    } else {
      auto* o = out.data_ptr<c10::BFloat16>();
      at::parallel_for(0, rows, grain,
                       [&](int64_t b, int64_t e) { dequantize_rows(in, sp, o, cols, b, e); });
    }
    return out;
  }
  std::vector<int64_t> shape(static_cast<size_t>(q.dim()), 1);
  shape[0] = q.size(0);
  return (q.to(torch::kFloat32) * scale.view(shape)).to(to);
}

// The dequantized weight in the dtype the call computes in: under autocast the matmul casts it
// anyway, so it is made in the layer's own dtype; otherwise in the input's, as Linear needs.
torch::Tensor weight_for(const torch::Tensor& q, const torch::Tensor& scale, torch::Dtype dtype,
                         const torch::Tensor& x) {
  const bool autocast = compat::autocast_enabled(x.device().type());
  // The scratch buffer only where nothing can keep the weight (a graph recorded in a backward
  // with create_graph would).
  return dequantize_to(q, scale, autocast ? dtype : x.scalar_type(),
                       /*scratch=*/!torch::GradMode::is_enabled());
}

// y = x W^T + b; backward gives x's gradient only (the weight and bias are frozen).
class QuantizedLinearFn : public torch::autograd::Function<QuantizedLinearFn> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& q,
                               const torch::Tensor& scale, const torch::Tensor& bias,
                               int64_t dtype) {
    ctx->save_for_backward({q, scale});
    ctx->saved_data["dtype"] = dtype;
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    const auto w = weight_for(q, scale, static_cast<torch::Dtype>(dtype), x);
    return torch::linear(x, w, bias.numel() > 0 ? bias : torch::Tensor());
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& g = grads[0];
    const auto w = dequantize_to(saved[0], saved[1], g.scalar_type(),
                                 /*scratch=*/!torch::GradMode::is_enabled());
    const auto x_dtype = static_cast<torch::Dtype>(ctx->saved_data["x_dtype"].toInt());
    return {linear_input_grad(g, w).to(x_dtype), {}, {}, {}, {}};
  }
};

// conv2d with the same rule; the input gradient is the transposed convolution of the output's.
class QuantizedConv2dFn : public torch::autograd::Function<QuantizedConv2dFn> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& q,
                               const torch::Tensor& scale, const torch::Tensor& bias, int64_t dtype,
                               std::vector<int64_t> geometry) {
    // geometry: stride (2), padding (2), dilation (2), groups.
    ctx->save_for_backward({q, scale});
    ctx->saved_data["geometry"] = geometry;
    ctx->saved_data["x_size"] = x.sizes().vec();
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    const auto w = weight_for(q, scale, static_cast<torch::Dtype>(dtype), x);
    return torch::conv2d(x, w, bias.numel() > 0 ? bias : torch::Tensor(),
                         {geometry[0], geometry[1]}, {geometry[2], geometry[3]},
                         {geometry[4], geometry[5]}, geometry[6]);
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto geo = ctx->saved_data["geometry"].toIntVector();
    const auto x_size = ctx->saved_data["x_size"].toIntVector();
    const auto x_dtype = static_cast<torch::Dtype>(ctx->saved_data["x_dtype"].toInt());
    // LibTorch 1.13's CPU transposed convolution refuses bf16 (it checks the input against the
    // weight as a forward convolution would): float32 there.
    const auto& g_in = grads[0];
    const bool cpu_half = g_in.device().is_cpu() && g_in.scalar_type() != torch::kFloat32 &&
                          g_in.scalar_type() != torch::kFloat64;
    const auto g = cpu_half ? g_in.to(torch::kFloat32) : g_in;
    const auto w = dequantize_to(saved[0], saved[1], g.scalar_type(),
                                 /*scratch=*/!torch::GradMode::is_enabled());
    // The transposed convolution's output_padding restores the input's size where the stride
    // dropped rows or columns.
    std::vector<int64_t> out_pad(2);
    for (size_t d = 0; d < 2; ++d) {
      const int64_t k = w.size(static_cast<int64_t>(d) + 2);
      const int64_t full = (g.size(static_cast<int64_t>(d) + 2) - 1) * geo[d] - 2 * geo[2 + d] +
                           geo[4 + d] * (k - 1) + 1;
      out_pad[d] = x_size[d + 2] - full;
    }
    auto gx = torch::conv_transpose2d(g, w, {}, {geo[0], geo[1]}, {geo[2], geo[3]}, out_pad, geo[6],
                                      {geo[4], geo[5]});
    return {gx.to(x_dtype), {}, {}, {}, {}, {}};
  }
};

}  // namespace

WeightStorage parse_weight_storage(const std::string& name, const std::string& flag) {
  if (name.empty() || name == "none" || name == "bf16" || name == "fp32" || name == "fp16") {
    return WeightStorage::kDense;
  }
  if (name == "int8") return WeightStorage::kInt8;
  if (name == "fp8_e4m3" || name == "float8_e4m3fn" || name == "fp8") {
    if (!kHasFloat8) {
      throw Error(flag + " " + name + ": this LibTorch (" +
                  std::to_string(compat::kTorchVersion / 100) + "." +
                  std::to_string(compat::kTorchVersion % 100) +
                  ") has no float8; use int8, or a LibTorch 2.1+ build (scripts/debian13)");
    }
    return WeightStorage::kFloat8E4M3;
  }
  throw Error(flag + " is \"" + name + "\": expected one of none, int8, fp8_e4m3");
}

std::string to_string(WeightStorage storage) {
  switch (storage) {
    case WeightStorage::kDense: return "none";
    case WeightStorage::kInt8: return "int8";
    case WeightStorage::kFloat8E4M3: return "fp8_e4m3";
  }
  return "none";
}

bool float8_available() { return kHasFloat8; }

torch::Tensor QuantizedWeight::dequantize() const { return dequantize_to(q, scale, dtype); }

int64_t QuantizedWeight::bytes() const {
  return defined() ? static_cast<int64_t>(q.nbytes() + scale.nbytes()) : 0;
}

QuantizedWeight quantize(const torch::Tensor& w, WeightStorage storage) {
  if (storage == WeightStorage::kDense) throw Error("quantize: kDense is not an 8-bit storage");
  torch::NoGradGuard no_grad;
  QuantizedWeight out;
  out.dtype = w.scalar_type();
  const auto rows = w.detach().to(torch::kFloat32).reshape({w.size(0), -1});
  auto amax = rows.abs().amax(1);
  auto scale = amax / storage_max(storage);
  scale = torch::where(amax > 0, scale, torch::ones_like(scale));
  const auto scaled = rows / scale.unsqueeze(1);
  const auto q = storage == WeightStorage::kInt8 ? scaled.round().clamp(-127, 127).to(torch::kInt8)
                                                 : scaled.clamp(-448, 448).to(kFloat8);
  out.q = q.reshape(w.sizes()).contiguous();
  out.scale = scale.contiguous();
  return out;
}

namespace {
// Autograd functions take defined tensors only (LibTorch 1.13 records each input's device): a
// missing bias goes in as an empty one.
torch::Tensor quantized_bias_arg(const torch::Tensor& bias, const torch::Tensor& x) {
  return bias.defined() ? bias : torch::empty({0}, x.options());
}
}  // namespace

torch::Tensor quantized_linear(const torch::Tensor& x, const QuantizedWeight& w,
                               const torch::Tensor& bias) {
  return QuantizedLinearFn::apply(x, w.q, w.scale, quantized_bias_arg(bias, x),
                                  static_cast<int64_t>(w.dtype));
}

torch::Tensor quantized_conv2d(const torch::Tensor& x, const QuantizedWeight& w,
                               const torch::Tensor& bias, torch::IntArrayRef stride,
                               torch::IntArrayRef padding, torch::IntArrayRef dilation,
                               int64_t groups) {
  std::vector<int64_t> geometry = {stride[0],   stride[1],   padding[0], padding[1],
                                   dilation[0], dilation[1], groups};
  return QuantizedConv2dFn::apply(x, w.q, w.scale, bias, static_cast<int64_t>(w.dtype), geometry);
}

QuantizeSummary quantize_frozen_weights(torch::nn::Module& model, WeightStorage storage) {
  QuantizeSummary s;
  if (storage == WeightStorage::kDense) return s;
  auto visit = [&](auto* layer) {
    if (layer == nullptr || layer->quantized_weight().defined()) return;
    const torch::Tensor& w = layer->weight;
    if (!w.defined() || w.requires_grad()) return;
    if (!quantizes(w.numel(), w.size(0))) {
      ++s.kept_dense;
      return;
    }
    s.bytes_before += static_cast<int64_t>(w.nbytes());
    s.weights += w.numel();
    layer->quantize_weight(storage);
    s.bytes_after += layer->quantized_weight().bytes();
    ++s.layers;
  };
  visit(dynamic_cast<LinearImpl*>(&model));
  visit(dynamic_cast<Conv2dImpl*>(&model));
  for (const auto& m : model.modules(/*include_self=*/false)) {
    visit(dynamic_cast<LinearImpl*>(m.get()));
    visit(dynamic_cast<Conv2dImpl*>(m.get()));
  }
  return s;
}

int64_t quantized_weight_bytes(const torch::nn::Module& model) {
  auto bytes_of = [](const torch::nn::Module* m) -> int64_t {
    if (const auto* l = dynamic_cast<const LinearImpl*>(m)) return l->quantized_weight().bytes();
    if (const auto* c = dynamic_cast<const Conv2dImpl*>(m)) return c->quantized_weight().bytes();
    return 0;
  };
  int64_t n = bytes_of(&model);
  for (const auto& m : model.modules(/*include_self=*/false)) n += bytes_of(m.get());
  return n;
}

int64_t quantized_weight_count(const torch::nn::Module& model) {
  auto count_of = [](const torch::nn::Module* m) -> int64_t {
    if (const auto* l = dynamic_cast<const LinearImpl*>(m)) {
      return l->quantized_weight().defined() ? l->quantized_weight().q.numel() : 0;
    }
    if (const auto* c = dynamic_cast<const Conv2dImpl*>(m)) {
      return c->quantized_weight().defined() ? c->quantized_weight().q.numel() : 0;
    }
    return 0;
  };
  int64_t n = count_of(&model);
  for (const auto& m : model.modules(/*include_self=*/false)) n += count_of(m.get());
  return n;
}

int64_t stored_model_bytes(const torch::nn::Module& model, WeightStorage storage,
                           int64_t dense_bytes) {
  int64_t bytes = 0;
  for (const auto& p : model.parameters()) bytes += p.numel() * dense_bytes;
  auto adjust = [&](const torch::nn::Module* m) {
    const torch::Tensor* w = nullptr;
    if (const auto* l = dynamic_cast<const LinearImpl*>(m)) w = &l->weight;
    if (const auto* c = dynamic_cast<const Conv2dImpl*>(m)) w = &c->weight;
    if (w == nullptr || !w->defined()) return;
    bytes += stored_weight_bytes(w->numel(), w->size(0), storage, dense_bytes) -
             w->numel() * dense_bytes;
  };
  adjust(&model);
  for (const auto& m : model.modules(/*include_self=*/false)) adjust(m.get());
  return bytes;
}

}  // namespace difftrain::models
