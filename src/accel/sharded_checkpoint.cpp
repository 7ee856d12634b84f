// The sharding engine's checkpoint state (ShardedModel::checkpoint_state): every rank writes
// the shards it owns into one safetensors file of a sharded set, and rank 0 the index (element
// ranges of each tensor), so a checkpoint reloads into any number of processes and strategies
// (io/sharded_tensors.h). Optimizer state re-shards element by element; 8-bit block state stays
// per rank.
#include "sharded_checkpoint.h"

#include "difftrain/core/error.h"
#include "difftrain/distributed/collectives.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/io/sharded_tensors.h"
#include "difftrain/optim/flat_optimizer.h"

#include <fmt/format.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <map>

namespace difftrain::accel {
namespace sharded_checkpoint {

io::ShardedTensorInfo whole_info(const torch::Tensor& t, const std::string& file) {
  io::ShardedTensorInfo info;
  info.shape = t.sizes().vec();
  info.dtype = t.scalar_type();
  if (t.numel() > 0) info.pieces.push_back({file, 0, t.numel()});
  return info;
}

// State tensors laid out element by element like the shard (AdamW's moments, Prodigy's s and
// p0): saved in the unit's flat numbering, so they re-shard to any number of ranks; anything else
// (8-bit block scales, codes tied to them) is kept per rank.
const std::vector<std::string> kElementwise = {".exp_avg", ".exp_avg_sq", ".max_exp_avg_sq", ".s",
                                               ".p0"};

std::string unit_key(const std::string& plan_name) {
  return plan_name.empty() ? "(root)" : plan_name;
}

}  // namespace sharded_checkpoint

CheckpointState* ShardedModel::checkpoint_state() {
  if (!checkpoint_) checkpoint_ = std::make_unique<ShardedCheckpointState>(*this, group_);
  return checkpoint_.get();
}

std::optional<EngineOptimizer> ShardedModel::make_optimizer(torch::optim::Optimizer& user) {
  if (has_shard_optimizer()) return std::nullopt;
  bool mine = false;
  for (const auto& group : user.param_groups()) {
    for (const auto& p : group.params()) mine = mine || contains(p);
  }
  if (!mine) return std::nullopt;
  auto* flat = dynamic_cast<optim::FlatOptimizer*>(&user);
  if (!flat) {
    throw Error(fmt::format(
        "sharding {} needs a difftrain optimizer (difftrain::optim::AdamW or AdamW8bit): their "
        "flat state can be cut into per-rank shards",
        to_string(strategy())));
  }
  EngineOptimizer out;
  out.optimizer = make_shard_optimizer(*flat);
  out.before_step = [this] { sync_hyperparameters(); };
  out.after_step = [this] { after_step(); };
  return out;
}

ShardedCheckpointState::ShardedCheckpointState(ShardedModel& engine,
                                               distributed::ProcessGroup& group)
    : engine_(engine), group_(group) {}

void ShardedCheckpointState::save_model(torch::nn::Module& module, const std::string& temp_dir,
                                        const std::string& stem) {
  const int world = group_.size(), rank = group_.rank();
  torch::nn::Module* model = &module;
  std::vector<io::TensorPiece> pieces;
  const auto& shards = engine_.shard_parameters();
  for (const auto& r : engine_.owned_ranges(rank)) {
    if (r.begin == r.end) continue;
    pieces.push_back({r.name, r.begin, r.end,
                      shards[r.unit].detach().narrow(0, r.shard_offset, r.end - r.begin)});
  }
  // Frozen parameters and buffers are the same on every rank: rank 0's file holds them whole.
  io::TensorMap replicated;
  for (const auto& item : model->named_parameters(true))
    if (!item.value().requires_grad()) replicated[item.key()] = item.value().detach();
  for (const auto& item : model->named_buffers(true))
    replicated[item.key()] = item.value().detach();
  if (rank == 0) {
    for (const auto& [name, t] : replicated) {
      if (t.numel() > 0) pieces.push_back({name, 0, t.numel(), t.reshape({-1})});
    }
  }
  io::write_tensor_shard(temp_dir, stem, rank, world, pieces);
  if (rank != 0) return;
  std::map<std::string, io::ShardedTensorInfo> infos;
  for (int r = 0; r < world; ++r) {
    const std::string file = io::shard_file_name(stem, r, world);
    for (const auto& o : engine_.owned_ranges(r)) {
      auto& info = infos[o.name];
      info.shape = o.shape;
      info.dtype = shards[o.unit].scalar_type();
      if (o.begin < o.end) info.pieces.push_back({file, o.begin, o.end});
    }
  }
  for (const auto& [name, t] : replicated)
    infos[name] = sharded_checkpoint::whole_info(t, io::shard_file_name(stem, 0, world));
  io::write_shard_index(temp_dir, stem, world, infos,
                        {{"sharding", to_string(engine_.strategy())}, {"num_processes", world}});
}

void ShardedCheckpointState::load_model(torch::nn::Module& module, const std::string& dir,
                                        const std::string& stem) {
  torch::nn::Module* model = &module;
  std::unique_ptr<io::ShardedTensorReader> reader;
  io::TensorMap whole;
  const std::string origin = (fs::path(dir) / stem).string();
  if (io::has_sharded_tensors(dir, stem)) {
    reader = std::make_unique<io::ShardedTensorReader>(dir, stem);
  } else {
    whole = io::load_safetensors(origin + ".safetensors").tensors;
  }
  auto shape_of = [&](const std::string& name) -> std::vector<int64_t> {
    if (reader) {
      if (!reader->has(name)) {
        throw Error("checkpoint '" + origin + "' has no tensor '" + name +
                    "'; it was saved from another model");
      }
      return reader->info(name).shape;
    }
    auto it = whole.find(name);
    if (it == whole.end()) {
      throw Error("checkpoint '" + origin + "' has no tensor '" + name +
                  "'; it was saved from another model");
    }
    return it->second.sizes().vec();
  };
  auto range_of = [&](const std::string& name, int64_t b, int64_t e) {
    return reader ? reader->read_range(name, b, e)
                  : whole.at(name).reshape({-1}).narrow(0, b, e - b);
  };
  torch::NoGradGuard no_grad;
  const auto& shards = engine_.shard_parameters();
  for (const auto& r : engine_.owned_ranges(group_.rank())) {
    const auto shape = shape_of(r.name);
    if (shape != r.shape) {
      throw Error("checkpoint '" + origin + "' has '" + r.name + "' shaped " + c10::str(shape) +
                  " but the model's is " + c10::str(r.shape) +
                  "; it was saved from another model configuration");
    }
    if (r.begin == r.end) continue;
    shards[r.unit]
        .detach()
        .narrow(0, r.shard_offset, r.end - r.begin)
        .copy_(range_of(r.name, r.begin, r.end));
  }
  for (const auto& item : model->named_parameters(true)) {
    if (item.value().requires_grad()) continue;
    auto t = item.value().detach();
    if (shape_of(item.key()) != t.sizes().vec())
      throw Error("checkpoint '" + origin + "' has '" + item.key() + "' of another shape");
    t.copy_(reader ? reader->read(item.key()) : whole.at(item.key()));
  }
  for (const auto& item : model->named_buffers(true)) {
    auto t = item.value().detach();
    if (shape_of(item.key()) != t.sizes().vec())
      throw Error("checkpoint '" + origin + "' has '" + item.key() + "' of another shape");
    t.copy_(reader ? reader->read(item.key()) : whole.at(item.key()));
  }
  engine_.shards_changed();
}

void ShardedCheckpointState::save_optimizer(optim::FlatOptimizer& opt, const std::string& temp_dir,
                                            const std::string& stem) {
  const int world = group_.size(), rank = group_.rank();
  const auto state = opt.state_dict();
  const auto& plans = engine_.units();
  std::vector<io::TensorPiece> pieces;
  std::map<std::string, io::ShardedTensorInfo> infos;  // rank 0: every rank's pieces
  for (const auto& [key, t] : state.tensors) {
    size_t unit = plans.size();
    bool elementwise = false;
    for (size_t u = 0; u < plans.size() && unit == plans.size(); ++u) {
      for (const auto& suffix : sharded_checkpoint::kElementwise) {
        if (key == sharded_checkpoint::unit_key(plans[u].name) + suffix) {
          unit = u;
          elementwise = true;
        }
      }
    }
    if (elementwise) {
      // Element i of unit u's flat numbering, whatever the number of ranks.
      const auto [b, e] = engine_.unit_range(unit, rank);
      if (b < e) pieces.push_back({key, b, e, t.reshape({-1}).narrow(0, 0, e - b)});
      if (rank == 0) {
        auto& info = infos[key];
        info.shape = {plans[unit].numel};
        info.dtype = t.scalar_type();
        for (int r = 0; r < world; ++r) {
          const auto [rb, re] = engine_.unit_range(unit, r);
          if (rb < re) info.pieces.push_back({io::shard_file_name(stem, r, world), rb, re});
        }
      }
    } else {
      // Kept per rank: every rank has the same keys (same units and sizes up to padding).
      for (int r = 0; r < world; ++r) {
        const std::string name = key + "@rank" + std::to_string(r);
        if (r == rank && t.numel() > 0) pieces.push_back({name, 0, t.numel(), t.reshape({-1})});
        if (rank == 0) {
          auto& info = infos[name];
          info.shape = {-1};  // fixed below from the piece sizes rank 0 cannot see
          info.dtype = t.scalar_type();
        }
      }
    }
  }
  // Per-rank tensors: their sizes are the same on every rank except through padding, which only
  // the last rank has; share them so rank 0 can index every piece.
  std::vector<std::string> per_rank;
  for (const auto& [key, t] : state.tensors) {
    bool ew = false;
    for (const auto& u : plans)
      for (const auto& suffix : sharded_checkpoint::kElementwise)
        ew = ew || key == sharded_checkpoint::unit_key(u.name) + suffix;
    if (!ew) per_rank.push_back(key);
  }
  if (!per_rank.empty()) {
    auto sizes = torch::zeros({world, static_cast<int64_t>(per_rank.size())}, torch::kLong);
    for (size_t k = 0; k < per_rank.size(); ++k)
      sizes[rank][static_cast<int64_t>(k)] = state.tensors.at(per_rank[k]).numel();
    distributed::all_reduce(sizes, distributed::ReduceOp::kSum, group_);
    if (rank == 0) {
      for (int r = 0; r < world; ++r) {
        for (size_t k = 0; k < per_rank.size(); ++k) {
          const int64_t n = sizes[r][static_cast<int64_t>(k)].item<int64_t>();
          auto& info = infos[per_rank[k] + "@rank" + std::to_string(r)];
          info.shape = {n};
          if (n > 0) info.pieces.push_back({io::shard_file_name(stem, r, world), 0, n});
        }
      }
    }
  }
  io::write_tensor_shard(temp_dir, stem, rank, world, pieces);
  if (rank != 0) return;
  nlohmann::json meta = {{"sharding", to_string(engine_.strategy())},
                         {"num_processes", world},
                         {"optimizer", state.meta},
                         {"per_rank", per_rank}};
  io::write_shard_index(temp_dir, stem, world, infos, meta);
}

void ShardedCheckpointState::load_optimizer(optim::FlatOptimizer& opt, const std::string& dir,
                                            const std::string& stem) {
  if (!io::has_sharded_tensors(dir, stem)) {
    throw Error("load_state: '" + dir + "' holds unsharded optimizer state but this run uses " +
                to_string(engine_.strategy()) +
                "; resume with the sharding it was saved with (NO_SHARD), then switch");
  }
  io::ShardedTensorReader reader(dir, stem);
  const auto& meta = reader.metadata();
  const int saved_world = meta.value("num_processes", -1);
  const auto per_rank = meta.value("per_rank", std::vector<std::string>{});
  if (!per_rank.empty() && saved_world != group_.size()) {
    throw Error("load_state: '" + reader.index_path() + "' holds " + opt.type_name() +
                " state quantised per rank shard (saved on " + std::to_string(saved_world) +
                " processes); resume it on " + std::to_string(saved_world) +
                " processes (AdamW state re-shards to any number)");
  }
  optim::OptimizerState state;
  state.meta = meta.at("optimizer");
  const auto& plans = engine_.units();
  const auto& shards = engine_.shard_parameters();
  for (const auto& name : reader.names()) {
    bool done = false;
    for (size_t u = 0; u < plans.size() && !done; ++u) {
      for (const auto& suffix : sharded_checkpoint::kElementwise) {
        if (name != sharded_checkpoint::unit_key(plans[u].name) + suffix) continue;
        const auto& info = reader.info(name);
        if (info.shape != std::vector<int64_t>{plans[u].numel}) {
          throw Error("load_state: '" + reader.index_path() + "' has '" + name + "' of " +
                      c10::str(info.shape) + " elements but the unit has " +
                      std::to_string(plans[u].numel) +
                      "; it was saved with another wrap policy or model");
        }
        const auto [b, e] = engine_.unit_range(u, group_.rank());
        auto t = torch::zeros({shards[u].numel()}, torch::TensorOptions().dtype(info.dtype));
        if (b < e) t.narrow(0, 0, e - b).copy_(reader.read_range(name, b, e));
        state.tensors[name] = t;
        done = true;
        break;
      }
    }
  }
  const std::string mine = "@rank" + std::to_string(group_.rank());
  for (const auto& key : per_rank) {
    const std::string name = key + mine;
    state.tensors[key] = reader.has(name) && !reader.info(name).pieces.empty() ? reader.read(name)
                                                                               : torch::empty({0});
  }
  opt.load_state_dict(state);
  engine_.restore_user_hyperparameters();
}

}  // namespace difftrain::accel
