#pragma once
// `--blocks_to_swap N` (kohya sd-scripts' and musubi-tuner's name), a family option the
// transformer families declare: the frozen weights of N transformer blocks stay in host memory
// and are staged onto the device per block (models/block_swap.h). A family that does not
// declare it refuses it in one line naming those that do.

#include "difftrain/accel/accelerator.h"
#include "difftrain/models/block_swap.h"
#include "difftrain/train/option_spec.h"

#include <cstdint>

namespace difftrain::train {

/// --blocks_to_swap, an int >= 0, default 0 (off); a change changes no number (the swap is
/// bit-exact), so it is neither structural nor an exactness option.
OptionSpec block_swap_option_spec();

/// The run's --blocks_to_swap (0 when the family does not declare it). Throws difftrain::Error
/// (one line) for N > 0 in a run that is not `lora`: a full fine-tune's weights train.
int64_t blocks_to_swap(const FamilyOptions& options, bool lora);

/// Prints what the swap holds and saves on the main rank (nothing when `swap` is null).
void report_block_swap(accel::Accelerator& acc, const models::BlockSwap* swap);

}  // namespace difftrain::train
