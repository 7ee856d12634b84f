// The state side of estimate-memory for a listed denoiser (denoiser_memory.h).
#include "denoiser_memory.h"
#include "difftrain/core/error.h"
#include "difftrain/models/block_swap.h"

#include <filesystem>

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
                            : param.numel * (param.fp32 ? 4 : dense);
    }
  }
  return s;
}

std::string denoiser_config_path(const std::string& model_path, const std::string& kinds,
                                 bool* pipeline) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path root(model_path);
  *pipeline = fs::is_regular_file(root / "model_index.json", ec);
  const fs::path config =
      fs::is_directory(root, ec)
          ? (*pipeline ? root / "transformer" / "config.json" : root / "config.json")
          : root;
  if (!fs::is_regular_file(config, ec)) {
    throw Error(config.string() + ": no such file; pass " + kinds);
  }
  return config.string();
}

std::vector<DenoiserParam> denoiser_params(
    const torch::nn::Module& m, const std::string& prefix,
    const std::function<bool(const std::string&)>& in_block,
    const std::function<std::string(const std::string&)>& rename,
    const std::vector<std::string>& not_linear) {
  std::vector<DenoiserParam> out;
  for (const auto& p : m.named_parameters()) {
    const std::string& name = p.key();
    if (prefix.empty() ? in_block(name) : name.rfind(prefix, 0) != 0) continue;
    const auto& t = p.value();
    bool linear =
        t.dim() == 2 && name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0;
    for (const auto& n : not_linear) linear = linear && name.find(n) == std::string::npos;
    out.push_back({rename(name), t.numel(), linear ? t.size(1) : 0, linear ? t.size(0) : 0});
  }
  return out;
}

void add_block_swap(const DenoiserBlocks& blocks, const std::vector<std::string>& swapped,
                    const train::MemoryEstimateOptions& options,
                    std::vector<train::MemoryEstimate>& estimates) {
  if (swapped.empty()) return;
  const int64_t dense = options.mixed_precision == "bf16" ? 2 : 4;
  const auto storage =
      models::parse_weight_storage(options.base_weights_dtype, "--base_weights_dtype");
  std::vector<int64_t> sizes;
  int64_t host = 0;
  for (const auto& path : swapped) {
    int64_t bytes = 0;
    bool found = false;
    for (const auto& [name, params] : blocks) {
      if (name != path) continue;
      found = true;
      for (const auto& param : params) {
        bytes += param.in > 0 ? models::stored_weight_bytes(param.numel, param.out, storage, dense)
                              : param.numel * (param.fp32 ? 4 : dense);
      }
    }
    if (!found) throw Error("estimate-memory: no block " + path + " to swap");
    sizes.push_back(bytes);
    host += bytes;
  }
  const int64_t saved = host - models::block_swap_staging_bytes(sizes);
  for (auto& e : estimates) {
    e.block_swap_host_bytes = host;
    e.block_swap_saved_bytes = saved;
  }
}

void add_last_blocks_swap(const DenoiserBlocks& blocks, const std::string& prefix, int64_t count,
                          const train::MemoryEstimateOptions& options,
                          std::vector<train::MemoryEstimate>& estimates) {
  if (options.blocks_to_swap <= 0) return;
  const auto which = models::last_blocks_swapped(options.blocks_to_swap, count);
  std::vector<std::string> swapped;
  for (int64_t i = 0; i < count; ++i) {
    if (which[static_cast<size_t>(i)]) swapped.push_back(prefix + std::to_string(i));
  }
  add_block_swap(blocks, swapped, options, estimates);
}

}  // namespace difftrain::families
