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
  MemoryEstimateOptions o = f.options;
  o.strategy = accel::parse_sharding_strategy(f.sharding_strategy, "--sharding_strategy");
  o.mixed_precision = accel::to_string(accel::parse_mixed_precision(f.mixed_precision));
  o.optimizer = with_case(o.optimizer, false);
  o.base_weights_dtype = with_case(o.base_weights_dtype, false);
  o.auto_wrap.policy = with_case(o.auto_wrap.policy, true);
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
