#include "difftrain/train/block_swap_option.h"

#include "difftrain/core/error.h"

#include <nlohmann/json.hpp>

#include <string>

namespace difftrain::train {

OptionSpec block_swap_option_spec() {
  return {"blocks_to_swap", "int", 0,
          "transformer blocks whose frozen weights stay in host memory, copied to the device "
          "for each forward and backward (kohya's / musubi-tuner's flag; 0 = off)",
          [](const nlohmann::json& v, const std::string& where) {
            if (v.get<int64_t>() < 0) {
              throw Error(where + " is " + v.dump() +
                          ": it counts blocks, 0 (off) or more; give a number of blocks");
            }
          }};
}

int64_t blocks_to_swap(const FamilyOptions& options, bool lora) {
  const int64_t n =
      options.find("blocks_to_swap") != nullptr ? options.integer("blocks_to_swap") : 0;
  if (n > 0 && !lora) {
    throw Error("--blocks_to_swap " + std::to_string(n) +
                " keeps a LoRA run's frozen blocks in host memory, and this is a full fine-tune "
                "(its weights train: their gradients and optimizer updates need them on the "
                "device); add --lora or leave --blocks_to_swap out");
  }
  return n;
}

void report_block_swap(accel::Accelerator& acc, const models::BlockSwap* swap) {
  if (swap == nullptr) return;
  const auto b = swap->bytes();
  const double mib = 1024.0 * 1024.0;
  acc.print(
      "block swap: {} block(s) in host memory ({:.2f} MiB of frozen weights), staged per block "
      "with at most {:.2f} MiB on the device at once: {:.2f} MiB of device memory saved",
      b.blocks, b.host_bytes / mib, b.staging_bytes / mib, b.saved_bytes() / mib);
}

}  // namespace difftrain::train
