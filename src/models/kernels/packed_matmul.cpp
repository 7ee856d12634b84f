#include "difftrain/models/kernels/packed_matmul.h"

#include "difftrain/core/env.h"

#include <ATen/core/grad_mode.h>

#include <atomic>

#if defined(DIFFTRAIN_HAVE_DNNL)
#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>
#endif

namespace difftrain::models {

namespace {

EnvSwitch g_enabled("DIFFTRAIN_PACKED_GRAD", true);
std::atomic<int64_t> g_calls{0};

}  // namespace

void set_packed_linear_grad_enabled(bool enabled) { g_enabled.set(enabled); }

bool packed_linear_grad_enabled() { return g_enabled.get() && packed_linear_grad_available(); }

int64_t packed_linear_grad_calls() { return g_calls.load(); }

bool packed_linear_grad_applies(int64_t rows, const torch::Tensor& weight, torch::Dtype g_dtype) {
  return rows >= kPackedGradMinRows && weight.defined() && weight.dim() == 2 &&
         weight.device().is_cpu() && weight.scalar_type() == torch::kBFloat16 &&
         g_dtype == torch::kBFloat16 && weight.is_contiguous() && packed_linear_grad_enabled();
}

#if !defined(DIFFTRAIN_HAVE_DNNL)

bool packed_linear_grad_available() { return false; }
std::string packed_linear_grad_status() {
  return "packed linear gradients: off (built without oneDNN)";
}
torch::Tensor linear_input_grad(const torch::Tensor& g, const torch::Tensor& weight) {
  return g.matmul(weight);
}

#else

namespace {

using dnnl::memory;
using Tag = memory::format_tag;
constexpr auto kBf16 = memory::data_type::bf16;

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// g [m, n] @ w [n, k]: the matmul with the weight in the layout its kernel chose, and the reorder
// from the plain layout into it; user scratchpads, so that threads (thread-ranks in the tests)
// may run one shape at the same time.
struct Prims {
  memory::desc g_md, w_plain, w_packed, out_md;
  dnnl::matmul matmul;
  dnnl::reorder pack;
  memory::desc matmul_scratch, pack_scratch;
  std::string impl;
};

std::unique_ptr<Prims> make_prims(int64_t m, int64_t n, int64_t k) {
  auto p = std::make_unique<Prims>();
  auto& eng = cpu_engine();
  p->g_md = memory::desc({m, n}, kBf16, Tag::ab);
  p->w_plain = memory::desc({n, k}, kBf16, Tag::ab);
  p->out_md = memory::desc({m, k}, kBf16, Tag::ab);
  const memory::desc w_any({n, k}, kBf16, Tag::any);
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
#if DNNL_VERSION_MAJOR >= 3
  dnnl::matmul::primitive_desc pd(eng, p->g_md, w_any, p->out_md, attr);
#else
  dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(p->g_md, w_any, p->out_md), attr, eng);
#endif
  p->impl = pd.impl_info_str();
  p->w_packed = pd.weights_desc();
  // Only the blocked-weight (brgemm) kernels gain from the reorder; anything else (a CPU without
  // AVX-512 bf16) declines.
  if (p->impl.rfind("brg", 0) != 0 || p->w_packed == p->w_plain) return nullptr;
  p->matmul = dnnl::matmul(pd);
  p->matmul_scratch = pd.scratchpad_desc();
  dnnl::reorder::primitive_desc rpd(eng, p->w_plain, eng, p->w_packed, attr);
  p->pack = dnnl::reorder(rpd);
  p->pack_scratch = rpd.scratchpad_desc();
  return p;
}

// The primitives for a shape, made once; nullptr where oneDNN has no blocked-weight kernel for it.
// Bounded: a run with many shapes (aspect-ratio buckets) starts over past 256; the shared
// pointers keep primitives in use alive across that.
std::shared_ptr<const Prims> prims_for(int64_t m, int64_t n, int64_t k) {
  static std::mutex mutex;
  static std::map<std::tuple<int64_t, int64_t, int64_t>, std::shared_ptr<const Prims> > cache;
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(m, n, k);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  if (cache.size() >= 256) cache.clear();
  std::shared_ptr<const Prims> p;
  try {
    p = make_prims(m, n, k);
  } catch (const dnnl::error&) {
    p.reset();  // unsupported here: the caller falls back to LibTorch's matmul
  }
  return cache.emplace(key, std::move(p)).first->second;
}

// n bytes of this thread's buffer `which` (0: the packed weight, 1: the scratchpad), kept from
// call to call and grown as needed: a FLUX.1 MLP weight packs into 72-90 MiB, above glibc's mmap
// threshold, and a fresh allocation each call paid a page fault and the kernel's zeroing per
// 4 KiB page (the reorder took 35-47 ms in a training step against ~10 ms into reused memory).
void* thread_buffer(int which, size_t n) {
  thread_local torch::Tensor buffers[2];
  torch::Tensor& buffer = buffers[which];
  const auto want = static_cast<int64_t>(std::max<size_t>(n, 1));
  if (!buffer.defined() || buffer.numel() < want) {
    buffer = torch::Tensor();  // the old one goes first: the peak is one buffer
    buffer = torch::empty({want}, torch::kUInt8);
  }
  return buffer.data_ptr();
}

// The product through `p`: g2 [m, n] and w [n, k] contiguous bf16.
torch::Tensor run(const Prims& p, const torch::Tensor& g2, const torch::Tensor& w) {
  auto& eng = cpu_engine();
  auto out = torch::empty({g2.size(0), w.size(1)}, g2.options());
  void* packed = thread_buffer(0, p.w_packed.get_size());
  void* scratch =
      thread_buffer(1, std::max(p.matmul_scratch.get_size(), p.pack_scratch.get_size()));
  memory w_src(p.w_plain, eng, w.data_ptr());
  memory w_dst(p.w_packed, eng, packed);
  memory g_mem(p.g_md, eng, g2.data_ptr());
  memory out_mem(p.out_md, eng, out.data_ptr());
  dnnl::stream stream(eng);
  std::unordered_map<int, memory> pack_args{{DNNL_ARG_FROM, w_src}, {DNNL_ARG_TO, w_dst}};
  if (p.pack_scratch.get_size() > 0) {
    pack_args.insert({DNNL_ARG_SCRATCHPAD, memory(p.pack_scratch, eng, scratch)});
  }
  p.pack.execute(stream, pack_args);
  std::unordered_map<int, memory> args{
      {DNNL_ARG_SRC, g_mem}, {DNNL_ARG_WEIGHTS, w_dst}, {DNNL_ARG_DST, out_mem}};
  if (p.matmul_scratch.get_size() > 0) {
    args.insert({DNNL_ARG_SCRATCHPAD, memory(p.matmul_scratch, eng, scratch)});
  }
  p.matmul.execute(stream, args);
  stream.wait();
  return out;
}

bool probe() {
  try {
    return prims_for(kPackedGradMinRows, 64, 64) != nullptr;
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

bool packed_linear_grad_available() {
  static const bool available = probe();
  return available;
}

std::string packed_linear_grad_status() {
  if (!packed_linear_grad_available()) {
    return "packed linear gradients: off (oneDNN has no blocked-weight bf16 kernel for this CPU)";
  }
  const auto p = prims_for(kPackedGradMinRows, 64, 64);
  return std::string("packed linear gradients: ") + (g_enabled.get() ? "on" : "off") + " (" +
         p->impl + ")";
}

torch::Tensor linear_input_grad(const torch::Tensor& g, const torch::Tensor& weight) {
  const int64_t n = weight.size(0);
  const int64_t rows = g.dim() == 0 ? 0 : g.numel() / std::max<int64_t>(n, 1);
  // A product autograd records (a backward with create_graph) must be differentiable: LibTorch's.
  const bool recorded = at::GradMode::is_enabled() && (g.requires_grad() || weight.requires_grad());
  if (recorded || g.dim() < 1 || g.size(-1) != n || !g.device().is_cpu() ||
      !packed_linear_grad_applies(rows, weight, g.scalar_type())) {
    return g.matmul(weight);
  }
  const auto p = prims_for(rows, n, weight.size(1));
  if (p == nullptr) return g.matmul(weight);
  const auto g2 = g.reshape({rows, n}).contiguous();
  ++g_calls;
  auto out_sizes = g.sizes().vec();
  out_sizes.back() = weight.size(1);
  return run(*p, g2, weight).view(out_sizes);
}

#endif

}  // namespace difftrain::models
