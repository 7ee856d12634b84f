#include "difftrain/models/block_swap.h"

#include "difftrain/core/error.h"
#include "difftrain/models/linear.h"

#include <ATen/core/ivalue.h>
#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>

#ifdef DIFFTRAIN_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>

namespace difftrain::models {
namespace detail {

// One device storage of a swapped block and its bytes on the host.
struct SwappedStorage {
  c10::intrusive_ptr<c10::StorageImpl> storage;
  at::Tensor host;  // [nbytes] uint8, pinned on CUDA
  size_t nbytes = 0;
  c10::Device device{c10::kCPU};
};

// A uint8 view of `n` bytes at `data` on `device`, for the copies (no ownership).
static at::Tensor byte_view(void* data, size_t n, c10::Device device) {
  return at::from_blob(data, {static_cast<int64_t>(n)},
                       at::TensorOptions().dtype(at::kByte).device(device));
}

// Every tensor of `block` that does not train and is not an adapter's: frozen parameters,
// buffers, and the 8-bit weights and scales of its layers.
static std::vector<at::Tensor> frozen_tensors(torch::nn::Module& block, const std::string& what) {
  std::vector<at::Tensor> out;
  for (const auto& p : block.named_parameters()) {
    if (p.value().requires_grad()) {
      throw Error(what + ": parameter '" + p.key() +
                  "' trains, and block swap keeps only frozen weights in host memory (a full "
                  "fine-tune's gradients and optimizer updates need its weights on the device); "
                  "train LoRA adapters or leave --blocks_to_swap at 0");
    }
    out.push_back(p.value());
  }
  for (const auto& b : block.buffers()) out.push_back(b);
  for (const auto& m : block.modules(/*include_self=*/true)) {
    const QuantizedWeight* q = nullptr;
    if (const auto* l = dynamic_cast<const LinearImpl*>(m.get())) q = &l->quantized_weight();
    if (const auto* c = dynamic_cast<const Conv2dImpl*>(m.get())) q = &c->quantized_weight();
    if (q != nullptr && q->defined()) {
      out.push_back(q->q);
      out.push_back(q->scale);
    }
  }
  return out;
}

struct BlockSwapState : torch::CustomClassHolder {
  struct Block {
    std::vector<SwappedStorage> storages;
    int64_t bytes = 0;
    bool swapped = false;
    bool staged = true;       // weights on the device now
    bool input_grad = false;  // last forward: a gradient flows into the block's inputs
#ifdef DIFFTRAIN_WITH_CUDA
    std::unique_ptr<at::cuda::CUDAEvent> ready;  // the staging copy's end, on the side stream
#endif
  };
  std::vector<Block> blocks;
  int64_t staged_bytes = 0, peak_staged = 0;
  bool callback_queued = false;
#ifdef DIFFTRAIN_WITH_CUDA
  std::optional<c10::cuda::CUDAStream> side;
#endif

  std::optional<size_t> next_swapped(size_t i) const {
    for (size_t j = i + 1; j < blocks.size(); ++j)
      if (blocks[j].swapped) return j;
    return std::nullopt;
  }
  std::optional<size_t> previous_swapped(size_t i) const {
    for (size_t j = i; j-- > 0;)
      if (blocks[j].swapped) return j;
    return std::nullopt;
  }

  // Allocates block i's storages on the device again and starts the copy of its host bytes
  // (on CUDA on the side stream, after the compute stream's work so far: a freed block the
  // allocator hands back may still be read by queued kernels).
  void stage(size_t i) {
    Block& b = blocks.at(i);
    if (!b.swapped || b.staged) return;
#ifdef DIFFTRAIN_WITH_CUDA
    const bool cuda = !b.storages.empty() && b.storages[0].device.is_cuda();
    std::optional<c10::cuda::CUDAStream> compute;
    if (cuda) {
      const auto index = b.storages[0].device.index();
      compute = c10::cuda::getCurrentCUDAStream(index);
      if (!side) side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index);
      at::cuda::CUDAEvent queued;
      queued.record(*compute);
      queued.block(*side);
    }
#endif
    for (auto& s : b.storages) {
      s.storage->set_data_ptr_noswap(c10::GetAllocator(s.device.type())->allocate(s.nbytes));
      s.storage->set_nbytes(s.nbytes);
      void* data = s.storage->data_ptr().get();
#ifdef DIFFTRAIN_WITH_CUDA
      if (cuda) {
        c10::cuda::CUDAStreamGuard on_side(*side);
        byte_view(data, s.nbytes, s.device).copy_(s.host, /*non_blocking=*/true);
        // The allocation belongs to the compute stream; the copy's use on the side stream must
        // end before the memory is reused.
        c10::cuda::CUDACachingAllocator::recordStream(s.storage->data_ptr(), *side);
        continue;
      }
#endif
      byte_view(data, s.nbytes, s.device).copy_(s.host);
    }
#ifdef DIFFTRAIN_WITH_CUDA
    if (cuda) {
      b.ready = std::make_unique<at::cuda::CUDAEvent>();
      b.ready->record(*side);
    }
#endif
    b.staged = true;
    staged_bytes += b.bytes;
    peak_staged = std::max(peak_staged, staged_bytes);
  }

  // Makes the compute stream wait for block i's staging copy (nothing to wait for on the CPU).
  void wait(size_t i) {
#ifdef DIFFTRAIN_WITH_CUDA
    Block& b = blocks.at(i);
    if (b.ready) {
      b.ready->block(c10::cuda::getCurrentCUDAStream(b.storages.at(0).device.index()));
      b.ready.reset();
    }
#else
    (void)i;
#endif
  }

  // Drops block i's device storages (their tensors keep shape, dtype and device).
  void release(size_t i) {
    Block& b = blocks.at(i);
    if (!b.swapped || !b.staged) return;
    for (auto& s : b.storages) {
      s.storage->set_data_ptr_noswap(at::DataPtr(nullptr, s.device));
      s.storage->set_nbytes(0);
    }
#ifdef DIFFTRAIN_WITH_CUDA
    b.ready.reset();
#endif
    b.staged = false;
    staged_bytes -= b.bytes;
  }

  void release_all() {
    for (size_t i = 0; i < blocks.size(); ++i) release(i);
  }
};

}  // namespace detail

namespace {

using detail::BlockSwapState;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Which swap and block a node belongs to.
struct SwapNodeState : torch::CustomClassHolder {
  c10::intrusive_ptr<BlockSwapState> swap;
  size_t block = 0;
  std::vector<bool> needs_grad;  // per input
};

c10::intrusive_ptr<SwapNodeState> node_state(const AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<SwapNodeState>(ctx->saved_data.at("swap").toCapsule());
}

// The identity forward shared by both nodes; outputs of inputs that need no gradient are
// marked non-differentiable, so the block computes no gradient it would not without the swap.
variable_list identity_forward(AutogradContext* ctx, at::TensorList xs,
                               const c10::intrusive_ptr<SwapNodeState>& state) {
  ctx->saved_data["swap"] = c10::IValue::make_capsule(state);
  variable_list out = xs.vec();
  variable_list constant;
  for (size_t k = 0; k < out.size(); ++k)
    if (!state->needs_grad[k]) constant.push_back(out[k]);
  if (!constant.empty()) ctx->mark_non_differentiable(constant);
  return out;
}

variable_list identity_backward(const SwapNodeState& s, variable_list grads) {
  for (size_t k = 0; k < grads.size(); ++k)
    if (!s.needs_grad[k]) grads[k] = torch::Tensor();
  grads.push_back(torch::Tensor());  // the state
  return grads;
}

// At a swapped block's input: its backward runs once the block's whole backward is done (every
// node of the block feeds it, and the engine runs the block's nodes, created after this one,
// first), and releases the block's weights.
class EnterNode : public torch::autograd::Function<EnterNode> {
 public:
  static variable_list forward(AutogradContext* ctx, at::TensorList xs,
                               c10::intrusive_ptr<SwapNodeState> state) {
    return identity_forward(ctx, xs, state);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = node_state(ctx);
    s->swap->release(s->block);
    return identity_backward(*s, std::move(grads));
  }
};

// At a swapped block's output: its backward runs before any node of the block's backward (or
// its checkpointed recomputation), and stages the block's weights, prefetching the previous
// swapped block. A backward that ends with blocks still staged (a block whose inputs needed no
// gradient has no EnterNode in the graph) releases them at its end.
class LeaveNode : public torch::autograd::Function<LeaveNode> {
 public:
  static variable_list forward(AutogradContext* ctx, at::TensorList ys,
                               c10::intrusive_ptr<SwapNodeState> state) {
    return identity_forward(ctx, ys, state);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = node_state(ctx);
    BlockSwapState& swap = *s->swap;
    swap.stage(s->block);
    swap.wait(s->block);
    if (swap.blocks[s->block].input_grad) {
      if (auto p = swap.previous_swapped(s->block)) swap.stage(*p);
    }
    if (!swap.callback_queued) {
      swap.callback_queued = true;
      c10::intrusive_ptr<BlockSwapState> keep = s->swap;
      torch::autograd::Engine::get_default_engine().queue_callback([keep] {
        keep->release_all();
        keep->callback_queued = false;
      });
    }
    return identity_backward(*s, std::move(grads));
  }
};

// Runs `Node` on the defined tensors of `xs` when one of them needs a gradient.
template <class Node>
std::vector<torch::Tensor> through(const c10::intrusive_ptr<BlockSwapState>& swap, size_t i,
                                   std::vector<torch::Tensor> xs) {
  if (!torch::GradMode::is_enabled()) return xs;
  auto state = c10::make_intrusive<SwapNodeState>();
  state->swap = swap;
  state->block = i;
  std::vector<torch::Tensor> defined;
  bool any = false;
  for (const auto& x : xs) {
    if (!x.defined()) continue;
    defined.push_back(x);
    state->needs_grad.push_back(x.requires_grad());
    any = any || x.requires_grad();
  }
  if (!any) return xs;
  const variable_list out = Node::apply(at::TensorList(defined), state);
  size_t next = 0;
  for (auto& x : xs)
    if (x.defined()) x = out[next++];
  return xs;
}

}  // namespace

int64_t block_swap_staging_bytes(const std::vector<int64_t>& block_bytes) {
  int64_t most = block_bytes.size() == 1 ? block_bytes[0] : 0;
  for (size_t i = 1; i < block_bytes.size(); ++i)
    most = std::max(most, block_bytes[i - 1] + block_bytes[i]);
  return most;
}

std::vector<bool> last_blocks_swapped(int64_t n, int64_t count) {
  if (n < 0 || n >= count) {
    throw Error("--blocks_to_swap " + std::to_string(n) +
                " is too many for this transformer: it has " + std::to_string(count) +
                " blocks, and at least one stays on the device; use --blocks_to_swap " +
                std::to_string(std::max<int64_t>(0, count - 1)) + " or fewer");
  }
  std::vector<bool> swapped;
  for (int64_t i = 0; i < count; ++i) swapped.push_back(i >= count - n);
  return swapped;
}

BlockSwap::BlockSwap(std::vector<torch::nn::Module*> blocks, const std::vector<bool>& swapped)
    : state_(c10::make_intrusive<BlockSwapState>()) {
  if (swapped.size() != blocks.size()) {
    throw Error("BlockSwap: " + std::to_string(swapped.size()) + " swap flags for " +
                std::to_string(blocks.size()) + " blocks");
  }
  torch::NoGradGuard no_grad;
  // Every block checked before any weight moves: a refusal leaves the model as it was.
  std::vector<std::vector<at::Tensor>> tensors(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (swapped[i]) tensors[i] = detail::frozen_tensors(*blocks[i], "block " + std::to_string(i));
  }
  state_->blocks.resize(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (!swapped[i]) continue;
    auto& b = state_->blocks[i];
    std::unordered_set<const c10::StorageImpl*> seen;
    for (const auto& t : tensors[i]) {
      if (!t.defined() || !t.has_storage()) continue;
      c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
      if (impl->nbytes() == 0 || !seen.insert(impl).second) continue;
      detail::SwappedStorage s;
      s.storage = c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(impl);
      s.nbytes = impl->nbytes();
      s.device = t.device();
      s.host = at::empty({static_cast<int64_t>(s.nbytes)},
                         at::TensorOptions().dtype(at::kByte).pinned_memory(s.device.is_cuda()));
      s.host.copy_(detail::byte_view(impl->data_ptr().get(), s.nbytes, s.device));
      b.bytes += static_cast<int64_t>(s.nbytes);
      b.storages.push_back(std::move(s));
    }
    b.swapped = true;
    state_->staged_bytes += b.bytes;
    state_->release(i);
  }
  state_->peak_staged = 0;
}

BlockSwap::~BlockSwap() {
  try {
    restore();
  } catch (...) {  // a destructor does not throw; the weights are lost with the swap anyway
  }
}

std::vector<torch::Tensor> BlockSwap::enter(size_t i, std::vector<torch::Tensor> xs) {
  auto& s = *state_;
  auto& b = s.blocks.at(i);
  if (!b.swapped) return xs;
  s.stage(i);
  s.wait(i);
  if (auto next = s.next_swapped(i)) s.stage(*next);
  b.input_grad = false;
  if (torch::GradMode::is_enabled()) {
    for (const auto& x : xs) b.input_grad = b.input_grad || (x.defined() && x.requires_grad());
  }
  return through<EnterNode>(state_, i, std::move(xs));
}

std::vector<torch::Tensor> BlockSwap::leave(size_t i, std::vector<torch::Tensor> ys) {
  auto& s = *state_;
  if (!s.blocks.at(i).swapped) return ys;
  s.release(i);
  return through<LeaveNode>(state_, i, std::move(ys));
}

bool BlockSwap::swapped(size_t i) const { return state_->blocks.at(i).swapped; }

BlockSwapBytes BlockSwap::bytes() const {
  BlockSwapBytes out;
  std::vector<int64_t> sizes;
  for (const auto& b : state_->blocks) {
    if (!b.swapped) continue;
    ++out.blocks;
    out.host_bytes += b.bytes;
    sizes.push_back(b.bytes);
  }
  out.staging_bytes = block_swap_staging_bytes(sizes);
  return out;
}

int64_t BlockSwap::peak_staged_bytes() const { return state_->peak_staged; }
int64_t BlockSwap::staged_bytes() const { return state_->staged_bytes; }

void BlockSwap::restore() {
  auto& s = *state_;
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < s.blocks.size(); ++i) {
    auto& b = s.blocks[i];
    if (!b.swapped) continue;
    s.stage(i);
    s.wait(i);
    b.swapped = false;
    s.staged_bytes -= b.bytes;
    b.storages.clear();  // the host copies
  }
}

}  // namespace difftrain::models
