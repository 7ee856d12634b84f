#pragma once
// Per-sample random streams, keyed by (seed, epoch, dataset index, stream): the randomness a
// sample gets (its augmentation, its noise and timestep) does not depend on which rank loads it
// or on how the global batch is cut, so a run gives the same model on 1, 2 or 4 ranks.
#include <ATen/core/Generator.h>
#include <cstdint>

namespace difftrain::core {

/// The streams the trainer and the datasets draw from; one key per purpose, so that adding a draw
/// to one purpose never shifts another's numbers.
enum class SampleStream : uint64_t {
  kAugmentation = 1,  ///< crops and flips of a dataset's get()
  kNoise = 2,         ///< the diffusion noise and noise offset of a training sample
  kTimestep = 3,      ///< the diffusion timestep of a training sample
  kPerturbation = 4,  ///< input_perturbation noise
  kDropout = 5,       ///< anything else the trainer draws per sample
  kLatent = 6,        ///< the VAE posterior draw of a text-to-image training sample
  kCaption = 7,       ///< caption dropout, shuffling and tag dropout
};

/// A 64-bit seed mixing all four parts (splitmix64 finaliser over each in turn): distinct keys
/// give unrelated seeds.
uint64_t sample_seed(uint64_t seed, int64_t epoch, int64_t index, SampleStream stream);

/// A CPU generator seeded sample_seed(...).
at::Generator sample_generator(uint64_t seed, int64_t epoch, int64_t index, SampleStream stream);

}  // namespace difftrain::core
