#pragma once
// Private to src/settings: the small helpers the DeepSpeed reader (deepspeed_config.cpp) and the
// Accelerate reader (accelerate_config.cpp) share.

#include "difftrain/settings/sharding_options.h"

#include <cstdint>
#include <string>
#include <vector>

namespace difftrain::settings::detail {

/// `s` in upper case (ASCII).
std::string upper(std::string s);

/// The whole text of the file at `path`; throws difftrain::Error "WHAT PATH cannot be read: ..."
/// (`what`: "DeepSpeed config", "Accelerate config").
std::string read_text(const std::string& path, const char* what);

/// `items` joined with commas (no spaces), as DIFFTRAIN_FSDP_TRANSFORMER_CLS_TO_WRAP and
/// fsdp_transformer_layer_cls_to_wrap spell a class list.
std::string join(const std::vector<std::string>& items);

/// DeepSpeed's ZeRO stage 0-3 (checked by the caller) as a strategy: NO_SHARD,
/// SHARD_OPTIMIZER, SHARD_GRAD_OP, FULL_SHARD.
ShardingStrategy strategy_of_zero_stage(int64_t stage);

}  // namespace difftrain::settings::detail
