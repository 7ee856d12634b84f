// `difftrain estimate-memory`'s flags into MemoryEstimateOptions, with the trainer's rules
// (train/memory_estimate.h: memory_estimate_options).
#include "difftrain/accel/precision.h"
#include "difftrain/accel/sharding.h"
#include "difftrain/settings/sharding_options.h"
#include "difftrain/train/memory_estimate.h"

#include <cctype>

namespace difftrain::train {
namespace {

std::string with_case(std::string s, bool up) {
  for (auto& c : s) {
    c = static_cast<char>(up ? std::toupper(static_cast<unsigned char>(c))
                             : std::tolower(static_cast<unsigned char>(c)));
  }
  return s;
}

}  // namespace

MemoryEstimateOptions memory_estimate_options(const MemoryEstimateFlags& f) {
  MemoryEstimateOptions o;
  o.num_processes = f.num_processes;
  o.strategy = accel::parse_sharding_strategy(f.sharding_strategy, "--sharding_strategy");
  o.mixed_precision = accel::to_string(accel::parse_mixed_precision(f.mixed_precision));
  o.use_8bit_adam = f.use_8bit_adam;
  o.optimizer = with_case(f.optimizer, false);
  o.lora = f.lora;
  o.lora_rank = f.rank;
  o.lora_target_modules = f.lora_target_modules;
  o.base_weights_dtype = with_case(f.base_weights_dtype, false);
  o.train_text_encoder = f.train_text_encoder;
  o.batch_size = f.batch_size;
  o.resolution = f.resolution;
  o.gradient_checkpointing = f.gradient_checkpointing;
  o.encoder_sequence_length = f.encoder_sequence_length;
  o.auto_wrap.policy = with_case(f.auto_wrap_policy, true);
  o.auto_wrap.classes = f.wrap_classes;
  o.auto_wrap.min_num_params = f.min_num_params;
  o.offload_optimizer =
      settings::parse_offload_device(f.offload_optimizer_device, "--offload_optimizer_device");
  o.offload_params =
      settings::parse_offload_device(f.offload_param_device, "--offload_param_device");
  accel::ShardingOptions requested;  // the trainer's rules for the run asked about
  requested.strategy = o.strategy;
  requested.offload_optimizer = o.offload_optimizer;
  requested.offload_params = o.offload_params;
  settings::check_offload(requested);
  return o;
}

}  // namespace difftrain::train
