#include "difftrain/models/kernels/winograd_conv.h"

#include "difftrain/core/env.h"

#include <c10/util/accumulate.h>
#include <torch/autograd.h>

#if defined(DIFFTRAIN_HAVE_DNNL)
#include <oneapi/dnnl/dnnl.hpp>

#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>
#endif

namespace difftrain::models {

namespace {

EnvSwitch g_enabled("DIFFTRAIN_WINOGRAD", true);
EnvSwitch g_blocked("DIFFTRAIN_WINOGRAD_BLOCKED", true);

}  // namespace

void set_winograd_blocked_layout_enabled(bool enabled) { g_blocked.set(enabled); }

bool winograd_blocked_layout_enabled() { return g_blocked.get(); }

void set_winograd_conv_enabled(bool enabled) { g_enabled.set(enabled); }

bool winograd_conv_enabled() { return g_enabled.get() && winograd_conv_available(); }

#if !defined(DIFFTRAIN_HAVE_DNNL)

bool winograd_conv_available() { return false; }
std::string winograd_conv_status() { return "Winograd: off (built without oneDNN)"; }
bool winograd_conv_applies(torch::IntArrayRef, const torch::Tensor&, const torch::Tensor&,
                           int64_t) {
  return false;
}
torch::Tensor winograd_conv2d(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                              int64_t, bool, bool) {
  return {};
}
bool pointwise_conv_blocked_applies(torch::IntArrayRef, const torch::Tensor&,
                                    const torch::Tensor&) {
  return false;
}
torch::Tensor pointwise_conv2d_blocked(const torch::Tensor&, const torch::Tensor&,
                                       const torch::Tensor&) {
  return {};
}
// Without oneDNN nothing computes in the blocked layout; the conversions still work (LibTorch's
// strided copies, differentiable as they are).
torch::Tensor to_channel_blocks(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 4 && x.size(1) % 16 == 0 && x.scalar_type() == torch::kFloat,
              "to_channel_blocks: expected a float32 [N, C, H, W] tensor with C a multiple of 16, "
              "got ",
              x.sizes(), " ", x.scalar_type());
  return x.reshape({x.size(0), x.size(1) / 16, 16, x.size(2), x.size(3)})
      .permute({0, 1, 3, 4, 2})
      .contiguous();
}
torch::Tensor cat_to_channel_blocks(const torch::Tensor& a, const torch::Tensor& b) {
  return torch::cat({to_channel_blocks(a), to_channel_blocks(b)}, 1);
}
torch::Tensor from_channel_blocks(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 5 && x.size(4) == 16 && x.scalar_type() == torch::kFloat,
              "from_channel_blocks: expected a float32 [N, C / 16, H, W, 16] tensor, got ",
              x.sizes(), " ", x.scalar_type());
  return x.permute({0, 1, 4, 2, 3})
      .reshape({x.size(0), x.size(1) * 16, x.size(2), x.size(3)})
      .contiguous();
}

#else

namespace {

using dnnl::memory;
using Tag = memory::format_tag;
constexpr auto kF32 = memory::data_type::f32;
// oneDNN pads other channel counts up to its 16-float vectors; measured here, a 1-channel input
// (a UNet's conv_in) then runs 6x slower than the direct algorithm, so only full vectors qualify.
constexpr int64_t kChannelMultiple = 16;

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// The geometry a set of primitives is made for: a k x k (3: Winograd, 1: oneDNN's direct 1x1
// kernel) stride-1 convolution.
struct Shape {
  int64_t n, c, h, w, o, pad;
  bool bias;
  int64_t k = 3;
  int64_t oh() const { return h + 2 * pad - k + 1; }
  int64_t ow() const { return w + 2 * pad - k + 1; }
  auto key() const { return std::tie(n, c, h, w, o, pad, bias, k); }
  bool operator<(const Shape& other) const { return key() < other.key(); }
  std::vector<int64_t> to_list() const { return {n, c, h, w, o, pad, bias ? 1 : 0, k}; }
  static Shape from_list(const std::vector<int64_t>& v) {
    return {v.at(0), v.at(1), v.at(2), v.at(3), v.at(4), v.at(5), v.at(6) != 0, v.at(7)};
  }
};

// Forward, backward-data and backward-weights primitives of one shape, with user-managed
// scratchpads so that threads (thread-ranks in the tests) can run them at the same time.
struct Prims {
  memory::desc src_plain, weights_plain, dst_plain, bias_plain;
  memory::desc src_blocked, dst_blocked;  // nChw16c: [N, C / 16, H, W, 16]
  dnnl::convolution_forward::primitive_desc fwd_pd;
  dnnl::convolution_backward_data::primitive_desc bwd_data_pd;
  dnnl::convolution_backward_weights::primitive_desc bwd_weights_pd;
  dnnl::convolution_forward fwd;
  dnnl::convolution_backward_data bwd_data;
  dnnl::convolution_backward_weights bwd_weights;
};

std::unique_ptr<Prims> make_prims(const Shape& s) {
  const memory::dims src{s.n, s.c, s.h, s.w}, wei{s.o, s.c, s.k, s.k}, bias{s.o};
  const memory::dims dst{s.n, s.o, s.oh(), s.ow()};
  const memory::dims strides{1, 1}, pad{s.pad, s.pad};
  // A 1x1 layer runs in the blocked layout its neighbours use (no reorders); Winograd picks its
  // own.
  const Tag act_tag = s.k == 1 ? Tag::nChw16c : Tag::any;
  const memory::desc src_any(src, kF32, act_tag), wei_any(wei, kF32, Tag::any),
      dst_any(dst, kF32, act_tag), bias_md(bias, kF32, Tag::x);
  const auto alg =
      s.k == 1 ? dnnl::algorithm::convolution_direct : dnnl::algorithm::convolution_winograd;
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  auto& eng = cpu_engine();
  auto p = std::make_unique<Prims>();
  p->src_plain = memory::desc(src, kF32, Tag::nchw);
  p->weights_plain = memory::desc(wei, kF32, Tag::oihw);
  p->dst_plain = memory::desc(dst, kF32, Tag::nchw);
  p->src_blocked = memory::desc(src, kF32, Tag::nChw16c);
  p->dst_blocked = memory::desc(dst, kF32, Tag::nChw16c);
  p->bias_plain = bias_md;
  const auto fwd_prop = dnnl::prop_kind::forward_training;
#if DNNL_VERSION_MAJOR >= 3
  const memory::desc no_bias;
  p->fwd_pd = dnnl::convolution_forward::primitive_desc(eng, fwd_prop, alg, src_any, wei_any,
                                                        s.bias ? bias_md : no_bias, dst_any,
                                                        strides, pad, pad, attr);
  p->bwd_data_pd = dnnl::convolution_backward_data::primitive_desc(
      eng, alg, src_any, wei_any, dst_any, strides, pad, pad, p->fwd_pd, attr);
  p->bwd_weights_pd = dnnl::convolution_backward_weights::primitive_desc(
      eng, alg, src_any, wei_any, s.bias ? bias_md : no_bias, dst_any, strides, pad, pad, p->fwd_pd,
      attr);
#else
  auto fwd_desc = s.bias ? dnnl::convolution_forward::desc(fwd_prop, alg, src_any, wei_any, bias_md,
                                                           dst_any, strides, pad, pad)
                         : dnnl::convolution_forward::desc(fwd_prop, alg, src_any, wei_any, dst_any,
                                                           strides, pad, pad);
  p->fwd_pd = dnnl::convolution_forward::primitive_desc(fwd_desc, attr, eng);
  p->bwd_data_pd = dnnl::convolution_backward_data::primitive_desc(
      dnnl::convolution_backward_data::desc(alg, src_any, wei_any, dst_any, strides, pad, pad),
      attr, eng, p->fwd_pd);
  auto bwd_weights_desc = s.bias ? dnnl::convolution_backward_weights::desc(
                                       alg, src_any, wei_any, bias_md, dst_any, strides, pad, pad)
                                 : dnnl::convolution_backward_weights::desc(
                                       alg, src_any, wei_any, dst_any, strides, pad, pad);
  p->bwd_weights_pd =
      dnnl::convolution_backward_weights::primitive_desc(bwd_weights_desc, attr, eng, p->fwd_pd);
#endif
  p->fwd = dnnl::convolution_forward(p->fwd_pd);
  p->bwd_data = dnnl::convolution_backward_data(p->bwd_data_pd);
  p->bwd_weights = dnnl::convolution_backward_weights(p->bwd_weights_pd);
  return p;
}

// The primitives for a shape, made once; nullptr when oneDNN has no Winograd kernel for it
// (for example channel counts that are not a multiple of the SIMD width, or a CPU without
// AVX-512). Bounded: a run with many shapes (aspect-ratio buckets) starts over past 256; the
// shared pointers keep primitives in use alive across that.
std::shared_ptr<const Prims> prims_for(const Shape& s) {
  static std::mutex mutex;
  static std::map<Shape, std::shared_ptr<const Prims> > cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(s);
  if (it != cache.end()) return it->second;
  if (cache.size() >= 256) cache.clear();
  std::shared_ptr<const Prims> p;
  try {
    p = make_prims(s);
  } catch (const dnnl::error&) {
    p.reset();  // unsupported here: the caller falls back to torch::conv2d
  }
  return cache.emplace(s, std::move(p)).first->second;
}

torch::Tensor bytes(size_t n) { return torch::empty({static_cast<int64_t>(n)}, torch::kUInt8); }

// Runs primitives on one stream, keeping the temporary buffers alive until it is done.
class Runner {
 public:
  Runner() : stream_(cpu_engine()) {}

  // A plain tensor as oneDNN memory (t must be contiguous and stay alive).
  memory wrap(const memory::desc& md, const torch::Tensor& t) {
    return memory(md, cpu_engine(), t.data_ptr());
  }
  // `in` in the layout `want`: itself when the layouts agree, else a reordered copy.
  memory as(const memory::desc& want, memory in) {
    if (want == in.get_desc()) return in;
    memory out = fresh(want);
    dnnl::reorder(in, out).execute(stream_, in, out);
    return out;
  }
  memory fresh(const memory::desc& md) {
    keep_.push_back(bytes(md.get_size()));
    return memory(md, cpu_engine(), keep_.back().data_ptr());
  }
  // Runs `prim`, writing its output argument `out_arg` (layout `produced`) into `target`.
  void run(const dnnl::primitive& prim, std::unordered_map<int, memory> args,
           const memory::desc& scratch, int out_arg, const memory::desc& produced, memory target) {
    memory out = produced == target.get_desc() ? target : fresh(produced);
    args.insert({out_arg, out});
    if (scratch.get_size() > 0) args.insert({DNNL_ARG_SCRATCHPAD, fresh(scratch)});
    prim.execute(stream_, args);
    if (out != target) dnnl::reorder(out, target).execute(stream_, out, target);
  }
  void wait() { stream_.wait(); }

 private:
  dnnl::stream stream_;
  std::vector<torch::Tensor> keep_;
};

class WinogradConv : public torch::autograd::Function<WinogradConv> {
 public:
  // x: [N, C, H, W] (or [N, C / 16, H, W, 16] when x_blocked), weight: [O, C, 3, 3], bias: [O]
  // or [0] (none) -> [N, O, H', W'] (or [N, O / 16, H', W', 16] when y_blocked)
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const torch::Tensor& bias,
                               const std::vector<int64_t>& shape, bool x_blocked, bool y_blocked) {
    const auto p = prims_for(Shape::from_list(shape));
    ctx->saved_data["shape"] = shape;
    ctx->saved_data["x_blocked"] = x_blocked;
    ctx->saved_data["y_blocked"] = y_blocked;
    const Shape s = Shape::from_list(shape);
    const int64_t oh = s.oh(), ow = s.ow();
    auto y = y_blocked ? torch::empty({s.n, s.o / kChannelMultiple, oh, ow, kChannelMultiple},
                                      x.options())
                       : torch::empty({s.n, s.o, oh, ow}, x.options());
    const auto& src_md = x_blocked ? p->src_blocked : p->src_plain;
    const auto& dst_md = y_blocked ? p->dst_blocked : p->dst_plain;
    torch::NoGradGuard no_grad;
    Runner r;
    // The backward reads the input only for the weight (and bias) gradient: a frozen layer
    // (LoRA fine-tuning) does not keep it alive. (Keeping the forward's reordered copy instead of
    // x, to skip that reorder in the backward, was measured: no faster, and 25 MB more at peak on
    // the default model, since x is usually alive elsewhere too.)
    const bool needs_src = weight.requires_grad() || (bias.numel() > 0 && bias.requires_grad());
    ctx->save_for_backward({needs_src ? x : torch::Tensor(), weight});
    std::unordered_map<int, memory> args{
        {DNNL_ARG_SRC, r.as(p->fwd_pd.src_desc(), r.wrap(src_md, x))},
        {DNNL_ARG_WEIGHTS, r.as(p->fwd_pd.weights_desc(), r.wrap(p->weights_plain, weight))}};
    if (bias.numel() > 0) args.insert({DNNL_ARG_BIAS, r.wrap(p->bias_plain, bias)});
    r.run(p->fwd, std::move(args), p->fwd_pd.scratchpad_desc(), DNNL_ARG_DST, p->fwd_pd.dst_desc(),
          r.wrap(dst_md, y));
    r.wait();
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const Shape shape = Shape::from_list(ctx->saved_data["shape"].toIntVector());
    const bool has_bias = shape.bias;
    const auto p = prims_for(shape);
    const bool x_blocked = ctx->saved_data["x_blocked"].toBool();
    const auto& src_md = x_blocked ? p->src_blocked : p->src_plain;
    const auto& dst_md = ctx->saved_data["y_blocked"].toBool() ? p->dst_blocked : p->dst_plain;
    const auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];  // undefined when neither weight nor bias wants a gradient
    const auto& weight = saved[1];
    const auto gy = grads[0].contiguous();
    torch::Tensor gx, gw, gb;
    Runner r;
    const memory gy_plain = r.wrap(dst_md, gy);  // in y's layout
    memory gy_data;  // gy as backward-data wanted it: reused by backward-weights when it agrees
    if (ctx->needs_input_grad(0)) {
      gx = x_blocked ? torch::empty({shape.n, shape.c / kChannelMultiple, shape.h, shape.w,
                                     kChannelMultiple},
                                    weight.options())
                     : torch::empty({shape.n, shape.c, shape.h, shape.w}, weight.options());
      const auto& pd = p->bwd_data_pd;
      r.run(p->bwd_data,
            {{DNNL_ARG_DIFF_DST, gy_data = r.as(pd.diff_dst_desc(), gy_plain)},
             {DNNL_ARG_WEIGHTS, r.as(pd.weights_desc(), r.wrap(p->weights_plain, weight))}},
            pd.scratchpad_desc(), DNNL_ARG_DIFF_SRC, pd.diff_src_desc(), r.wrap(src_md, gx));
    }
    if (ctx->needs_input_grad(1) || (has_bias && ctx->needs_input_grad(2))) {
      gw = torch::empty_like(weight);
      const auto& pd = p->bwd_weights_pd;
      std::unordered_map<int, memory> args{
          {DNNL_ARG_SRC, r.as(pd.src_desc(), r.wrap(src_md, x))},
          {DNNL_ARG_DIFF_DST, gy_data && gy_data.get_desc() == pd.diff_dst_desc()
                                  ? gy_data
                                  : r.as(pd.diff_dst_desc(), gy_plain)}};
      if (has_bias) {
        gb = torch::empty({weight.size(0)}, weight.options());
        args.insert({DNNL_ARG_DIFF_BIAS, r.wrap(p->bias_plain, gb)});
      }
      r.run(p->bwd_weights, std::move(args), pd.scratchpad_desc(), DNNL_ARG_DIFF_WEIGHTS,
            pd.diff_weights_desc(), r.wrap(p->weights_plain, gw));
    }
    r.wait();
    if (!ctx->needs_input_grad(1)) gw = torch::Tensor();
    return {gx, gw, gb, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

bool probe() {
  try {
    // The smallest layer oneDNN's AVX-512 Winograd kernels take: 16 channels in and out.
    return prims_for(Shape{1, 16, 8, 8, 16, 1, true}) != nullptr;
  } catch (...) {
    return false;
  }
}

}  // namespace

bool winograd_conv_available() {
  static const bool available = probe();
  return available;
}

std::string winograd_conv_status() {
  const auto* v = dnnl::version();
  std::string s = "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
                  std::to_string(v->patch) + ", Winograd: ";
  if (!winograd_conv_available()) return s + "off (no oneDNN Winograd kernel for this CPU)";
  return s + (g_enabled.get() ? "on" : "off (DIFFTRAIN_WINOGRAD=0)");
}

namespace {

bool is_f32_cpu(const torch::Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.layout() == torch::kStrided;
}

}  // namespace

bool winograd_conv_applies(torch::IntArrayRef x_sizes, const torch::Tensor& weight,
                           const torch::Tensor& bias, int64_t padding) {
  if (!winograd_conv_enabled() || !is_f32_cpu(weight) || x_sizes.size() != 4 || weight.dim() != 4 ||
      weight.size(2) != 3 || weight.size(3) != 3 || weight.size(1) != x_sizes[1] ||
      (padding != 0 && padding != 1) || x_sizes[2] + 2 * padding < 3 ||
      x_sizes[3] + 2 * padding < 3 || c10::multiply_integers(x_sizes) == 0 ||
      x_sizes[1] % kChannelMultiple != 0 || weight.size(0) % kChannelMultiple != 0) {
    return false;
  }
  if (bias.defined() && (!is_f32_cpu(bias) || bias.dim() != 1 || bias.size(0) != weight.size(0))) {
    return false;
  }
  const Shape s{x_sizes[0],     x_sizes[1], x_sizes[2],    x_sizes[3],
                weight.size(0), padding,    bias.defined()};
  return prims_for(s) != nullptr;
}

torch::Tensor winograd_conv2d(const torch::Tensor& x, const torch::Tensor& weight,
                              const torch::Tensor& bias, int64_t padding, bool x_blocked,
                              bool y_blocked) {
  if (!is_f32_cpu(x) || x.dim() != (x_blocked ? 5 : 4)) return {};
  if (x_blocked && x.size(4) != kChannelMultiple) return {};
  const std::vector<int64_t> sizes =
      x_blocked
          ? std::vector<int64_t>{x.size(0), x.size(1) * kChannelMultiple, x.size(2), x.size(3)}
          : x.sizes().vec();
  if (!winograd_conv_applies(sizes, weight, bias, padding)) return {};
  const Shape s{sizes[0], sizes[1], sizes[2], sizes[3], weight.size(0), padding, bias.defined()};
  const auto b = bias.defined() ? bias.contiguous() : torch::empty({0}, weight.options());
  return WinogradConv::apply(x.contiguous(), weight.contiguous(), b, s.to_list(), x_blocked,
                             y_blocked);
}

bool pointwise_conv_blocked_applies(torch::IntArrayRef x_sizes, const torch::Tensor& weight,
                                    const torch::Tensor& bias) {
  if (!winograd_conv_enabled() || !is_f32_cpu(weight) || x_sizes.size() != 4 || weight.dim() != 4 ||
      weight.size(2) != 1 || weight.size(3) != 1 || weight.size(1) != x_sizes[1] ||
      c10::multiply_integers(x_sizes) == 0 || x_sizes[1] % kChannelMultiple != 0 ||
      weight.size(0) % kChannelMultiple != 0) {
    return false;
  }
  if (bias.defined() && (!is_f32_cpu(bias) || bias.dim() != 1 || bias.size(0) != weight.size(0))) {
    return false;
  }
  Shape s{x_sizes[0], x_sizes[1], x_sizes[2], x_sizes[3], weight.size(0), 0, bias.defined()};
  s.k = 1;
  return prims_for(s) != nullptr;
}

torch::Tensor pointwise_conv2d_blocked(const torch::Tensor& x, const torch::Tensor& weight,
                                       const torch::Tensor& bias) {
  if (!is_f32_cpu(x) || x.dim() != 5 || x.size(4) != kChannelMultiple) return {};
  const std::vector<int64_t> sizes{x.size(0), x.size(1) * kChannelMultiple, x.size(2), x.size(3)};
  if (!pointwise_conv_blocked_applies(sizes, weight, bias)) return {};
  Shape s{sizes[0], sizes[1], sizes[2], sizes[3], weight.size(0), 0, bias.defined()};
  s.k = 1;
  const auto b = bias.defined() ? bias.contiguous() : torch::empty({0}, weight.options());
  return WinogradConv::apply(x.contiguous(), weight.contiguous(), b, s.to_list(), true, true);
}

namespace {

// [N, C, H, W] <-> [N, C / 16, H, W, 16] by oneDNN's reorder (its JIT kernels move the 16-float
// vectors about twice as fast as a strided LibTorch copy); each direction's gradient is the other.
torch::Tensor reorder_channel_blocks(const torch::Tensor& x, bool to_blocked) {
  const auto src = x.contiguous();
  const int64_t n = src.size(0), c = to_blocked ? src.size(1) : src.size(1) * kChannelMultiple;
  const int64_t h = src.size(2), w = src.size(3);
  const memory::dims dims{n, c, h, w};
  const memory::desc plain(dims, kF32, Tag::nchw), blocked(dims, kF32, Tag::nChw16c);
  auto y = to_blocked
               ? torch::empty({n, c / kChannelMultiple, h, w, kChannelMultiple}, src.options())
               : torch::empty({n, c, h, w}, src.options());
  memory in(to_blocked ? plain : blocked, cpu_engine(), src.data_ptr());
  memory out(to_blocked ? blocked : plain, cpu_engine(), y.data_ptr());
  dnnl::stream stream(cpu_engine());
  dnnl::reorder(in, out).execute(stream, in, out);
  stream.wait();
  return y;
}

class ChannelBlocks : public torch::autograd::Function<ChannelBlocks> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               bool to_blocked) {
    ctx->saved_data["to_blocked"] = to_blocked;
    torch::NoGradGuard no_grad;
    return reorder_channel_blocks(x, to_blocked);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {reorder_channel_blocks(grads[0], !ctx->saved_data["to_blocked"].toBool()),
            torch::Tensor()};
  }
};

// The concatenation along channels of two plain [N, C_i, H, W] parts, written straight into one
// blocked [N, (C_a + C_b) / 16, H, W, 16] tensor: each part is reordered into the channel blocks it
// occupies (a oneDNN sub-memory of the output), so the plain concatenation is never written; the
// backward reorders each part's channel blocks of the gradient back to a plain tensor.
class CatChannelBlocks : public torch::autograd::Function<CatChannelBlocks> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& a,
                               const torch::Tensor& b) {
    torch::NoGradGuard no_grad;
    const std::vector<torch::Tensor> parts{a, b};
    const int64_t n = parts[0].size(0), h = parts[0].size(2), w = parts[0].size(3);
    std::vector<int64_t> channels;
    int64_t total = 0;
    for (const auto& p : parts) channels.push_back(p.size(1)), total += p.size(1);
    ctx->saved_data["channels"] = channels;
    auto y =
        torch::empty({n, total / kChannelMultiple, h, w, kChannelMultiple}, parts[0].options());
    const memory::desc whole({n, total, h, w}, kF32, Tag::nChw16c);
    memory out_all(whole, cpu_engine(), y.data_ptr());
    dnnl::stream stream(cpu_engine());
    int64_t offset = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      const auto src = parts[i].contiguous();
      const memory::dims dims{n, channels[i], h, w};
      memory in(memory::desc(dims, kF32, Tag::nchw), cpu_engine(), src.data_ptr());
      memory out(whole.submemory_desc(dims, {0, offset, 0, 0}), cpu_engine(), y.data_ptr());
      dnnl::reorder(in, out).execute(stream, in, out);
      offset += channels[i];
    }
    stream.wait();
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto channels = ctx->saved_data["channels"].toIntVector();
    const auto gy = grads[0].contiguous();
    const int64_t n = gy.size(0), h = gy.size(2), w = gy.size(3);
    const memory::desc whole({n, gy.size(1) * kChannelMultiple, h, w}, kF32, Tag::nChw16c);
    dnnl::stream stream(cpu_engine());
    torch::autograd::variable_list out;
    int64_t offset = 0;
    for (size_t i = 0; i < channels.size(); ++i) {
      const memory::dims dims{n, channels[i], h, w};
      auto g = torch::empty({n, channels[i], h, w}, gy.options());
      memory in(whole.submemory_desc(dims, {0, offset, 0, 0}), cpu_engine(), gy.data_ptr());
      memory dst(memory::desc(dims, kF32, Tag::nchw), cpu_engine(), g.data_ptr());
      dnnl::reorder(in, dst).execute(stream, in, dst);
      out.push_back(g);
      offset += channels[i];
    }
    stream.wait();
    return out;
  }
};

}  // namespace

torch::Tensor cat_to_channel_blocks(const torch::Tensor& a, const torch::Tensor& b) {
  for (const auto& p : {a, b}) {
    TORCH_CHECK(is_f32_cpu(p) && p.dim() == 4 && p.size(1) % kChannelMultiple == 0 &&
                    p.size(0) == a.size(0) && p.size(2) == a.size(2) && p.size(3) == a.size(3),
                "cat_to_channel_blocks: expected float32 CPU [N, C_i, H, W] tensors of one N, H, "
                "W with each C_i a multiple of ",
                kChannelMultiple, ", got ", p.sizes(), " ", p.scalar_type());
  }
  return CatChannelBlocks::apply(a, b);
}

torch::Tensor to_channel_blocks(const torch::Tensor& x) {
  TORCH_CHECK(is_f32_cpu(x) && x.dim() == 4 && x.size(1) % kChannelMultiple == 0,
              "to_channel_blocks: expected a float32 CPU [N, C, H, W] tensor with C a multiple of ",
              kChannelMultiple, ", got ", x.sizes(), " ", x.scalar_type());
  return ChannelBlocks::apply(x, true);
}

torch::Tensor from_channel_blocks(const torch::Tensor& x) {
  TORCH_CHECK(is_f32_cpu(x) && x.dim() == 5 && x.size(4) == kChannelMultiple,
              "from_channel_blocks: expected a float32 CPU [N, C / ", kChannelMultiple, ", H, W, ",
              kChannelMultiple, "] tensor, got ", x.sizes(), " ", x.scalar_type());
  return ChannelBlocks::apply(x, false);
}

#endif

}  // namespace difftrain::models
