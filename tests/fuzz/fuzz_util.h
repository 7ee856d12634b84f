#pragma once
// Shared by the libFuzzer targets: which exceptions count as a parser rejecting bad input.

#include <c10/util/Exception.h>
#include <torch/utils.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>

#include "difftrain/core/error.h"

namespace difftrain::fuzz {

/// Runs `parse` on one fuzz input. A parser may reject bad input only with difftrain::Error or a
/// TORCH_CHECK (c10::Error): those carry the one-line messages users see. Any other exception
/// (a raw std::out_of_range, a JSON library error without the file name, ...) is a finding: it is
/// printed and the fuzzer aborts, as for a crash.
template <typename Parse>
int run_one(const uint8_t* data, size_t size, Parse&& parse) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    parse(bytes);
  } catch (const difftrain::Error&) {
  } catch (const c10::Error&) {
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: unexpected exception type escaped the parser: %s\n", e.what());
    std::abort();
  }
  return 0;
}

/// One intra-op thread: fuzzing runs many small inputs, and LibTorch's pool only adds noise.
inline void init_torch() { torch::set_num_threads(1); }

}  // namespace difftrain::fuzz
