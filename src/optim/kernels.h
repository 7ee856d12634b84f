#pragma once
// The update loops behind AdamW and AdamW8bit (internal to src/optim).

#include <torch/types.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace difftrain::optim::detail {

/// One parameter's slice of a bucket and the scalars of its update.
struct Segment {
  int64_t begin = 0;  ///< element offset in the bucket's parameter buffer
  int64_t end = 0;
  int64_t state_begin = 0;     ///< element offset in the state buffers
  int64_t block_begin = 0;     ///< first quantisation block (8-bit state only)
  const void* grad = nullptr;  ///< contiguous gradient, parameter dtype, end - begin elements
  double lr = 0;
  double weight_decay = 0;
  double bias_correction1 = 1;       ///< 1 − β1^t
  double bias_correction2_sqrt = 1;  ///< √(1 − β2^t)
};

/// The segment of bucket member `member` (offsets from `offsets`) updated with `grad` at step
/// count `step`: torch's bias corrections 1 − β^t computed in double.
inline Segment make_segment(const std::vector<int64_t>& offsets, size_t member, const void* grad,
                            double lr, double weight_decay, double beta1, double beta2,
                            int64_t step) {
  Segment s;
  s.begin = offsets[member];
  s.end = offsets[member + 1];
  s.state_begin = s.begin;
  s.grad = grad;
  s.lr = lr;
  s.weight_decay = weight_decay;
  s.bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  s.bias_correction2_sqrt = std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step)));
  return s;
}

struct Betas {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
};

/// torch.optim.AdamW on CPU buffers: params [N] (float, double, bf16, half), exp_avg /
/// exp_avg_sq / max_exp_avg_sq (undefined unless amsgrad) [M] in the math dtype (double for
/// double params, else float). Segments must be sorted by begin and not overlap.
void adamw_cpu(const torch::Tensor& params, const torch::Tensor& exp_avg,
               const torch::Tensor& exp_avg_sq, const torch::Tensor& max_exp_avg_sq,
               const std::vector<Segment>& segments, const Betas& betas);

/// The same update with tensor ops, one parameter at a time (any device).
void adamw_reference(const torch::Tensor& params, const torch::Tensor& exp_avg,
                     const torch::Tensor& exp_avg_sq, const torch::Tensor& max_exp_avg_sq,
                     const std::vector<Segment>& segments, const Betas& betas);

/// bitsandbytes' blockwise 8-bit Adam update on CPU: codes1/codes2 [M] uint8, absmax1/absmax2
/// [blocks] float, blocks of `block` elements restarting at every segment.
void adamw8bit_cpu(const torch::Tensor& params, const torch::Tensor& codes1,
                   const torch::Tensor& absmax1, const torch::Tensor& codes2,
                   const torch::Tensor& absmax2, const std::vector<Segment>& segments,
                   const Betas& betas, int64_t block);

}  // namespace difftrain::optim::detail
