#pragma once
// Gradient checkpointing (PyTorch's torch.utils.checkpoint, reentrant variant): run a piece of a
// model without keeping its activations, and run it again during backward to get them back.

#include <torch/types.h>

#include <functional>
#include <vector>

namespace difftrain::models {

/// A piece of a model as a function of its tensor inputs (parameters are captured, not passed).
using CheckpointedFn = std::function<torch::Tensor(const std::vector<torch::Tensor>& inputs)>;

/// Returns fn(inputs). When grad mode is on, the forward runs without recording a graph and only
/// the inputs are kept; backward runs fn again with grad enabled (restoring the CPU random state
/// first, so dropout draws the same mask) and back-propagates through it, which fills the
/// parameters' .grad as an ordinary backward would. Works when no input requires grad (frozen
/// base, trainable LoRA) because the node always takes part in the graph. Undefined inputs are
/// passed through to fn as undefined. Diffusers: `torch.utils.checkpoint.checkpoint(module, ...)`
/// under `enable_gradient_checkpointing()`.
torch::Tensor checkpoint(const CheckpointedFn& fn, const std::vector<torch::Tensor>& inputs);

/// True on this thread while checkpoint() runs its function, in the forward (no graph) and in the
/// recomputation during backward. Layers with a training-only algorithm (Conv2d's Winograd path,
/// models/winograd_conv.h) take it in both, so the recomputation reproduces the forward exactly.
bool in_checkpointed_function();

}  // namespace difftrain::models
