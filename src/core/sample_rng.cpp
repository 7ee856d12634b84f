#include "difftrain/core/sample_rng.h"

#include <ATen/CPUGeneratorImpl.h>

namespace difftrain::core {
namespace {

uint64_t mix(uint64_t x) {
  // splitmix64's finaliser: a bijection with good avalanche.
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

uint64_t sample_seed(uint64_t seed, int64_t epoch, int64_t index, SampleStream stream) {
  uint64_t h = mix(seed);
  h = mix(h ^ static_cast<uint64_t>(epoch));
  h = mix(h ^ static_cast<uint64_t>(index));
  h = mix(h ^ static_cast<uint64_t>(stream));
  return h;
}

at::Generator sample_generator(uint64_t seed, int64_t epoch, int64_t index, SampleStream stream) {
  return at::make_generator<at::CPUGeneratorImpl>(sample_seed(seed, epoch, index, stream));
}

}  // namespace difftrain::core
