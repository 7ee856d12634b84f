#include "difftrain/settings/sharding_options.h"

#include "config_reader_util.h"

#include "difftrain/core/error.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <map>
#include <set>

namespace difftrain::settings {
namespace {

using detail::upper;

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

bool parse_bool(const std::string& text, const char* name) {
  const std::string u = upper(text);
  if (u == "1" || u == "TRUE" || u == "YES") return true;
  if (u == "0" || u == "FALSE" || u == "NO") return false;
  // FSDP's backward_prefetch values: BACKWARD_PRE / BACKWARD_POST prefetch, NO_PREFETCH does not.
  if (u == "BACKWARD_PRE" || u == "BACKWARD_POST") return true;
  if (u == "NO_PREFETCH") return false;
  throw Error(fmt::format("{}='{}' is not a boolean (true/false)", name, text));
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::string item;
  for (char c : text + ",") {
    if (c == ',' || c == ' ') {
      if (!item.empty()) out.push_back(item);
      item.clear();
    } else {
      item += c;
    }
  }
  return out;
}

}  // namespace

const char* to_string(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::kNoShard: return "NO_SHARD";
    case ShardingStrategy::kShardOptimizer: return "SHARD_OPTIMIZER";
    case ShardingStrategy::kShardGradOp: return "SHARD_GRAD_OP";
    case ShardingStrategy::kFullShard: return "FULL_SHARD";
  }
  return "?";
}

ShardingStrategy parse_sharding_strategy(const std::string& text, const std::string& origin) {
  const std::string u = upper(text);
  if (u == "NO_SHARD" || u == "3" || u == "ZERO0" || u == "DDP") return ShardingStrategy::kNoShard;
  if (u == "SHARD_OPTIMIZER" || u == "ZERO1") return ShardingStrategy::kShardOptimizer;
  if (u == "SHARD_GRAD_OP" || u == "2" || u == "ZERO2") return ShardingStrategy::kShardGradOp;
  if (u == "FULL_SHARD" || u == "1" || u == "ZERO3") return ShardingStrategy::kFullShard;
  throw Error(fmt::format(
      "{}: '{}' is not a sharding strategy; use NO_SHARD, SHARD_OPTIMIZER, SHARD_GRAD_OP or "
      "FULL_SHARD (or ZeRO stages zero0..zero3)",
      origin, text));
}

bool parse_offload_device(const std::string& text, const std::string& origin) {
  std::string l = text;
  std::transform(l.begin(), l.end(), l.begin(), [](unsigned char c) { return std::tolower(c); });
  if (l.empty() || l == "none" || l == "false" || l == "no") return false;
  if (l == "cpu" || l == "true" || l == "yes") return true;
  if (l == "nvme") {
    throw Error(fmt::format("{}: '{}': NVMe offload is not supported; use cpu (host memory)",
                            origin, text));
  }
  throw Error(fmt::format("{}: '{}' is not an offload device; use none or cpu", origin, text));
}

void check_offload(const ShardingOptions& o) {
  if (o.offload_params && !o.offload_optimizer) {
    throw Error(
        "offload_param_device cpu needs offload_optimizer_device cpu too (the host shards are "
        "the optimizer's master weights): add --offload_optimizer_device cpu");
  }
  if (o.offload_optimizer && o.strategy == ShardingStrategy::kNoShard) {
    throw Error(
        "offload_optimizer_device cpu needs a sharding strategy (ZeRO stage 1-3): add "
        "--sharding_strategy SHARD_OPTIMIZER, SHARD_GRAD_OP or FULL_SHARD");
  }
  if (o.offload_params && o.strategy != ShardingStrategy::kFullShard) {
    throw Error(fmt::format(
        "offload_param_device cpu needs FULL_SHARD (ZeRO-3): under {} every rank keeps the full "
        "parameters on its device; use --sharding_strategy FULL_SHARD or drop the parameter "
        "offload",
        to_string(o.strategy)));
  }
}

ShardingOptions ShardingOptions::from_env() { return from_env(ShardingOptions{}); }

ShardingOptions ShardingOptions::from_env(const ShardingOptions& base) {
  ShardingOptions o = base;
  if (auto v = env("DIFFTRAIN_SHARDING_STRATEGY"))
    o.strategy = parse_sharding_strategy(*v, "DIFFTRAIN_SHARDING_STRATEGY");
  if (auto v = env("DIFFTRAIN_FSDP_AUTO_WRAP_POLICY")) o.auto_wrap.policy = upper(*v);
  if (auto v = env("DIFFTRAIN_FSDP_TRANSFORMER_CLS_TO_WRAP")) o.auto_wrap.classes = split_list(*v);
  if (auto v = env("DIFFTRAIN_FSDP_MIN_NUM_PARAMS")) {
    char* end = nullptr;
    const long long n = std::strtoll(v->c_str(), &end, 10);
    if (end == v->c_str() || *end != '\0' || n < 1) {
      throw Error(fmt::format(
          "DIFFTRAIN_FSDP_MIN_NUM_PARAMS='{}' is not a positive number of parameters", *v));
    }
    o.auto_wrap.min_num_params = n;
  }
  if (auto v = env("DIFFTRAIN_FSDP_FORWARD_PREFETCH"))
    o.forward_prefetch = parse_bool(*v, "DIFFTRAIN_FSDP_FORWARD_PREFETCH");
  if (auto v = env("DIFFTRAIN_FSDP_BACKWARD_PREFETCH"))
    o.backward_prefetch = parse_bool(*v, "DIFFTRAIN_FSDP_BACKWARD_PREFETCH");
  if (auto v = env("DIFFTRAIN_SYNC_EACH_BATCH"))
    o.sync_each_batch = parse_bool(*v, "DIFFTRAIN_SYNC_EACH_BATCH");
  if (auto v = env("DIFFTRAIN_OFFLOAD_OPTIMIZER_DEVICE"))
    o.offload_optimizer = parse_offload_device(*v, "DIFFTRAIN_OFFLOAD_OPTIMIZER_DEVICE");
  if (auto v = env("DIFFTRAIN_OFFLOAD_PARAM_DEVICE"))
    o.offload_params = parse_offload_device(*v, "DIFFTRAIN_OFFLOAD_PARAM_DEVICE");
  return o;
}

}  // namespace difftrain::settings
