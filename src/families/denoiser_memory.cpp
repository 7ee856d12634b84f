// The state side of estimate-memory for a listed denoiser (denoiser_memory.h).
#include "denoiser_memory.h"

#include "difftrain/models/kernels/quantized_weight.h"

namespace difftrain::families {

DenoiserState denoiser_state(const DenoiserBlocks& blocks,
                             const train::MemoryEstimateOptions& options,
                             const std::vector<std::string>& default_targets,
                             const std::function<std::string(const std::string&)>& block_class) {
  const std::vector<std::string>& targets =
      options.lora_target_modules.empty() ? default_targets : options.lora_target_modules;
  DenoiserState s;
  for (const auto& [name, params] : blocks) {
    accel::UnitPlan u;
    u.name = name;
    u.module_class = name.empty() ? "root" : block_class(name);
    for (const auto& param : params) {
      s.params += param.numel;
      if (!options.lora) {
        u.params.push_back(param.name);
        u.numel += param.numel;
        s.numels.push_back(param.numel);
        continue;
      }
      const std::string& pname = param.name;
      for (const auto& target : targets) {
        const std::string suffix = "." + target + ".weight";
        if (param.in == 0 || pname.size() < suffix.size() ||
            pname.compare(pname.size() - suffix.size(), suffix.size(), suffix) != 0) {
          continue;
        }
        const std::string module = pname.substr(0, pname.size() - 7);
        for (const auto& [ab, count] :
             {std::pair<const char*, int64_t>{".lora_A.weight", options.lora_rank * param.in},
              {".lora_B.weight", param.out * options.lora_rank}}) {
          u.params.push_back(module + ab);
          u.numel += count;
          s.numels.push_back(count);
        }
      }
    }
    if (u.numel > 0) s.units.push_back(std::move(u));
  }
  if (options.auto_wrap.policy == "NO_WRAP") {
    accel::UnitPlan all;
    all.module_class = "root";
    for (const auto& u : s.units) {
      all.numel += u.numel;
      all.params.insert(all.params.end(), u.params.begin(), u.params.end());
    }
    s.units = {all};
  }
  if (!options.lora) return s;
  // The frozen base: bf16 under bf16 as the trainer keeps it, its Linear weights 8-bit under
  // --base_weights_dtype (the trainer's size rule).
  const int64_t dense = options.mixed_precision == "bf16" ? 2 : 4;
  const auto storage =
      models::parse_weight_storage(options.base_weights_dtype, "--base_weights_dtype");
  s.frozen = s.params;
  for (const auto& [name, params] : blocks) {
    for (const auto& param : params) {
      s.frozen_bytes += param.in > 0
                            ? models::stored_weight_bytes(param.numel, param.out, storage, dense)
                            : param.numel * dense;
    }
  }
  return s;
}

}  // namespace difftrain::families
