// Accelerator::save_state / load_state: the resumable state of a prepared training run in one
// folder (Accelerate's `save_state` / `load_state`), with safetensors for tensors and JSON for
// the rest.

#include "difftrain/accel/accelerator.h"

#include "difftrain/accel/checkpoint_manifest.h"

#include "difftrain/core/error.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/io/sharded_tensors.h"
#include "difftrain/optim/flat_optimizer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <filesystem>
#include <mutex>

namespace difftrain::accel {
namespace fs = std::filesystem;
namespace {

std::string indexed(const std::string& stem, size_t i) {
  return i == 0 ? stem : stem + "_" + std::to_string(i);
}

io::TensorMap module_tensors(const torch::nn::Module& module) {
  io::TensorMap out;
  for (const auto& item : module.named_parameters(true)) out[item.key()] = item.value().detach();
  for (const auto& item : module.named_buffers(true)) out[item.key()] = item.value().detach();
  return out;
}

// The whole tensors of a model saved as `<dir>/<stem>.safetensors` or sharded
// (`<stem>.index.json`): either loads into any run, whatever its sharding.
io::TensorMap read_model_tensors(const std::string& dir, const std::string& stem) {
  if (io::has_sharded_tensors(dir, stem)) return io::ShardedTensorReader(dir, stem).read_all();
  return io::load_safetensors((fs::path(dir) / (stem + ".safetensors")).string()).tensors;
}

void load_module(torch::nn::Module& module, const std::string& dir, const std::string& stem) {
  const std::string path =
      (fs::path(dir) /
       (stem + (io::has_sharded_tensors(dir, stem) ? ".index.json" : ".safetensors")))
          .string();
  auto file = read_model_tensors(dir, stem);
  auto ours = module_tensors(module);
  torch::NoGradGuard no_grad;
  for (auto& [name, tensor] : ours) {
    auto it = file.find(name);
    if (it == file.end()) {
      throw Error("checkpoint '" + path + "' has no tensor '" + name +
                  "'; it was saved from another model");
    }
    if (it->second.sizes() != tensor.sizes()) {
      throw Error("checkpoint '" + path + "' has '" + name + "' shaped " +
                  c10::str(it->second.sizes()) + " but the model's is " + c10::str(tensor.sizes()) +
                  "; it was saved from another model configuration");
    }
  }
  for (const auto& [name, tensor] : file) {
    if (!ours.count(name)) {
      throw Error("checkpoint '" + path + "' has tensor '" + name +
                  "' that the model does not have; it was saved from another model");
    }
  }
  for (auto& [name, tensor] : ours) tensor.copy_(file.at(name));
}

// Every rank learns whether every rank succeeded; a failing rank rethrows its own error, the
// others name it. Keeps ranks from waiting at a barrier for a rank that gave up.
void agree(distributed::ProcessGroup& group, const std::exception_ptr& error,
           const std::string& what) {
  auto flag = torch::tensor({error ? group.rank() + 1 : 0}, torch::kInt64);
  distributed::all_reduce(flag, distributed::ReduceOp::kMax, group);
  if (error) std::rethrow_exception(error);
  const int64_t bad = flag.item<int64_t>();
  if (bad > 0) {
    throw Error(what + " failed on rank " + std::to_string(bad - 1) + "; see that rank's error");
  }
}

}  // namespace

void Accelerator::save_state(const std::string& dir,
                             const std::function<void(const std::string&)>& extra) {
  const fs::path target = fs::path(dir);
  const fs::path temp = fs::path(dir + ".tmp");
  auto& group = *group_;
  std::exception_ptr error;
  if (is_main_process()) {
    try {
      std::error_code ec;
      fs::remove_all(temp, ec);
      fs::create_directories(temp);
    } catch (...) {
      error = std::current_exception();
    }
  }
  agree(group, error, "save_state (creating " + temp.string() + ")");
  state_->finish_reduction();
  try {
    // Sharded models and optimizers: every rank writes its own shard, in parallel.
    for (size_t i = 0; i < models_.size(); ++i) {
      if (auto* engine = sharded_engine_of_model(i)) save_sharded_model(i, *engine, temp.string());
    }
    for (size_t i = 0; i < optimizers_.size(); ++i) {
      auto opt = optimizers_[i].lock();
      auto* engine = sharded_engine_of_optimizer(i);
      if (!opt || !engine) continue;
      auto* flat = dynamic_cast<optim::FlatOptimizer*>(&opt->optimizer());
      if (flat) save_sharded_optimizer(i, *engine, *flat, temp.string());
    }
    if (is_main_process()) {
      for (size_t i = 0; i < models_.size(); ++i) {
        auto model = models_[i].lock();
        if (!model) {
          throw Error("save_state: prepared model " + std::to_string(i) +
                      " was prepared by reference or no longer exists; prepare it through its "
                      "module holder or a shared_ptr");
        }
        if (sharded_engine_of_model(i)) continue;
        io::save_safetensors((temp / (indexed("model", i) + ".safetensors")).string(),
                             module_tensors(*model), {{"format", "pt"}});
      }
      for (size_t i = 0; i < optimizers_.size(); ++i) {
        auto opt = optimizers_[i].lock();
        if (!opt) continue;
        if (sharded_engine_of_optimizer(i)) continue;
        auto* flat = dynamic_cast<optim::FlatOptimizer*>(&opt->optimizer());
        if (!flat) {
          throw Error("save_state: prepared optimizer " + std::to_string(i) +
                      " is not a difftrain optimizer; use difftrain::optim::AdamW or AdamW8bit "
                      "(LibTorch optimizers have no safetensors state)");
        }
        optim::save_optimizer_state(flat->state_dict(), (temp / indexed("optimizer", i)).string());
      }
      for (size_t i = 0; i < schedulers_.size(); ++i) {
        auto sched = schedulers_[i].lock();
        if (!sched || !sched->has_state()) continue;
        io::write_file_atomic((temp / (indexed("scheduler", i) + ".json")).string(),
                              sched->state_dict().dump(2) + "\n");
      }
      nlohmann::json meta = state_dict();
      meta["num_processes"] = num_processes();
      meta["sharding"] = to_string(sharding_.strategy);
      io::write_file_atomic((temp / "accelerator.json").string(), meta.dump(2) + "\n");
    }
    auto gen = at::detail::getDefaultCPUGenerator();
    torch::Tensor rng;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      rng = gen.get_state();
    }
    io::save_safetensors(
        (temp / ("random_states_" + std::to_string(process_index()) + ".safetensors")).string(),
        {{"cpu", rng}});
    if (extra) extra(temp.string());
  } catch (...) {
    error = std::current_exception();
  }
  // A failed save leaves no half-written folder behind (and gives back the space on a full disk).
  auto discard_temp = [&]() {
    if (!is_main_process()) return;
    std::error_code ec;
    fs::remove_all(temp, ec);
  };
  try {
    agree(group, error, "save_state (writing " + temp.string() + ")");
  } catch (...) {
    discard_temp();
    throw;
  }
  if (is_main_process()) {
    try {
      // Every rank's files are in place: record their sizes and CRC32s for load_state().
      write_checkpoint_manifest(temp.string());
    } catch (...) {
      error = std::current_exception();
    }
  }
  try {
    agree(group, error, "save_state (writing " + (temp / kChecksumsFile).string() + ")");
  } catch (...) {
    discard_temp();
    throw;
  }
  if (is_main_process()) {
    try {
      // Swap the finished folder in; the old one survives until the new one is in place.
      const fs::path old = fs::path(dir + ".old");
      std::error_code ec;
      fs::remove_all(old, ec);
      if (fs::exists(target)) fs::rename(target, old);
      fs::rename(temp, target);
      fs::remove_all(old, ec);
    } catch (const std::exception& e) {
      error = std::make_exception_ptr(Error("save_state: cannot move '" + temp.string() + "' to '" +
                                            target.string() + "': " + e.what()));
    }
  }
  agree(group, error, "save_state (renaming to " + target.string() + ")");
}

void Accelerator::load_state(const std::string& dir, bool verify) {
  const fs::path root(dir);
  if (!fs::is_directory(root)) {
    throw Error("load_state: '" + dir +
                "' is not a folder written by save_state(); check the path");
  }
  if (verify) verify_checkpoint(dir);
  const std::string meta_path = (root / "accelerator.json").string();
  nlohmann::json meta;
  try {
    meta = nlohmann::json::parse(io::read_file(meta_path));
  } catch (const nlohmann::json::exception& e) {
    throw Error("load_state: '" + meta_path + "' is not valid JSON (" + e.what() + ")");
  }
  state_->finish_reduction();
  for (size_t i = 0; i < models_.size(); ++i) {
    auto model = models_[i].lock();
    if (!model) {
      throw Error("load_state: prepared model " + std::to_string(i) +
                  " was prepared by reference or no longer exists; prepare it through its module "
                  "holder or a shared_ptr");
    }
    if (auto* engine = sharded_engine_of_model(i)) {
      load_sharded_model(i, *engine, dir);
    } else {
      load_module(*model, dir, indexed("model", i));
    }
  }
  for (size_t i = 0; i < optimizers_.size(); ++i) {
    auto opt = optimizers_[i].lock();
    if (!opt) continue;
    auto* flat = dynamic_cast<optim::FlatOptimizer*>(&opt->optimizer());
    if (!flat)
      throw Error("load_state: prepared optimizer " + std::to_string(i) +
                  " is not a difftrain optimizer");
    const bool saved_sharded = io::has_sharded_tensors(dir, indexed("optimizer", i));
    ShardedModel* engine = sharded_engine_of_optimizer(i);
    if (engine) {
      if (!saved_sharded) {
        throw Error("load_state: '" + dir + "' holds unsharded optimizer state but this run uses " +
                    to_string(sharding_.strategy) +
                    "; resume with the sharding it was saved with (NO_SHARD), then switch");
      }
      load_sharded_optimizer(i, *engine, *flat, dir);
      continue;
    }
    if (saved_sharded) {
      throw Error("load_state: '" + dir +
                  "' holds sharded optimizer state; resume with a sharding strategy (e.g. "
                  "--sharding_strategy FULL_SHARD), any number of processes");
    }
    flat->load_state_dict(optim::load_optimizer_state((root / indexed("optimizer", i)).string()));
  }
  for (size_t i = 0; i < schedulers_.size(); ++i) {
    auto sched = schedulers_[i].lock();
    if (!sched || !sched->has_state()) continue;
    const std::string path = (root / (indexed("scheduler", i) + ".json")).string();
    try {
      sched->load_state_dict(nlohmann::json::parse(io::read_file(path)));
    } catch (const nlohmann::json::exception& e) {
      throw Error("load_state: '" + path + "' is not valid JSON (" + e.what() + ")");
    }
  }
  load_state_dict(meta);
  const fs::path rng_path =
      root / ("random_states_" + std::to_string(process_index()) + ".safetensors");
  if (fs::exists(rng_path)) {
    auto rng = io::load_safetensors(rng_path.string()).tensors.at("cpu");
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(rng);
  } else {
    log::warn(
        "load_state: no random state for rank {} in '{}' (saved with {} processes); this "
        "rank's random numbers will not continue the saved run",
        process_index(), dir, meta.value("num_processes", -1));
  }
}

// ------------------------------------------------------------------ sharded state

namespace {

io::ShardedTensorInfo whole_info(const torch::Tensor& t, const std::string& file) {
  io::ShardedTensorInfo info;
  info.shape = t.sizes().vec();
  info.dtype = t.scalar_type();
  if (t.numel() > 0) info.pieces.push_back({file, 0, t.numel()});
  return info;
}

// State tensors laid out element by element like the shard (re-shardable); anything else
// (8-bit block scales, codes tied to them) is kept per rank.
const std::vector<std::string> kElementwise = {".exp_avg", ".exp_avg_sq", ".max_exp_avg_sq"};

std::string unit_key(const std::string& plan_name) {
  return plan_name.empty() ? "(root)" : plan_name;
}

}  // namespace

void Accelerator::save_sharded_model(size_t index, ShardedModel& engine,
                                     const std::string& temp_dir) {
  const std::string stem = indexed("model", index);
  const int world = num_processes(), rank = process_index();
  auto model = models_[index].lock();
  if (!model) throw Error("save_state: prepared model " + std::to_string(index) + " is gone");
  std::vector<io::TensorPiece> pieces;
  const auto& shards = engine.shard_parameters();
  for (const auto& r : engine.owned_ranges(rank)) {
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
    for (const auto& o : engine.owned_ranges(r)) {
      auto& info = infos[o.name];
      info.shape = o.shape;
      info.dtype = shards[o.unit].scalar_type();
      if (o.begin < o.end) info.pieces.push_back({file, o.begin, o.end});
    }
  }
  for (const auto& [name, t] : replicated)
    infos[name] = whole_info(t, io::shard_file_name(stem, 0, world));
  io::write_shard_index(temp_dir, stem, world, infos,
                        {{"sharding", to_string(engine.strategy())}, {"num_processes", world}});
}

void Accelerator::load_sharded_model(size_t index, ShardedModel& engine, const std::string& dir) {
  const std::string stem = indexed("model", index);
  auto model = models_[index].lock();
  if (!model) throw Error("load_state: prepared model " + std::to_string(index) + " is gone");
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
  const auto& shards = engine.shard_parameters();
  for (const auto& r : engine.owned_ranges(process_index())) {
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
  engine.shards_changed();
}

void Accelerator::save_sharded_optimizer(size_t index, ShardedModel& engine,
                                         optim::FlatOptimizer& opt, const std::string& temp_dir) {
  const std::string stem = indexed("optimizer", index);
  const int world = num_processes(), rank = process_index();
  const auto state = opt.state_dict();
  const auto& plans = engine.units();
  std::vector<io::TensorPiece> pieces;
  std::map<std::string, io::ShardedTensorInfo> infos;  // rank 0: every rank's pieces
  for (const auto& [key, t] : state.tensors) {
    size_t unit = plans.size();
    bool elementwise = false;
    for (size_t u = 0; u < plans.size() && unit == plans.size(); ++u) {
      for (const auto& suffix : kElementwise) {
        if (key == unit_key(plans[u].name) + suffix) {
          unit = u;
          elementwise = true;
        }
      }
    }
    if (elementwise) {
      // Element i of unit u's flat numbering, whatever the number of ranks.
      const auto [b, e] = engine.unit_range(unit, rank);
      if (b < e) pieces.push_back({key, b, e, t.reshape({-1}).narrow(0, 0, e - b)});
      if (rank == 0) {
        auto& info = infos[key];
        info.shape = {plans[unit].numel};
        info.dtype = t.scalar_type();
        for (int r = 0; r < world; ++r) {
          const auto [rb, re] = engine.unit_range(unit, r);
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
      for (const auto& suffix : kElementwise) ew = ew || key == unit_key(u.name) + suffix;
    if (!ew) per_rank.push_back(key);
  }
  if (!per_rank.empty()) {
    auto sizes = torch::zeros({world, static_cast<int64_t>(per_rank.size())}, torch::kLong);
    for (size_t k = 0; k < per_rank.size(); ++k)
      sizes[rank][static_cast<int64_t>(k)] = state.tensors.at(per_rank[k]).numel();
    distributed::all_reduce(sizes, distributed::ReduceOp::kSum, *group_);
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
  nlohmann::json meta = {{"sharding", to_string(engine.strategy())},
                         {"num_processes", world},
                         {"optimizer", state.meta},
                         {"per_rank", per_rank}};
  io::write_shard_index(temp_dir, stem, world, infos, meta);
}

void Accelerator::load_sharded_optimizer(size_t index, ShardedModel& engine,
                                         optim::FlatOptimizer& opt, const std::string& dir) {
  const std::string stem = indexed("optimizer", index);
  io::ShardedTensorReader reader(dir, stem);
  const auto& meta = reader.metadata();
  const int saved_world = meta.value("num_processes", -1);
  const auto per_rank = meta.value("per_rank", std::vector<std::string>{});
  if (!per_rank.empty() && saved_world != num_processes()) {
    throw Error("load_state: '" + reader.index_path() + "' holds " + opt.type_name() +
                " state quantised per rank shard (saved on " + std::to_string(saved_world) +
                " processes); resume it on " + std::to_string(saved_world) +
                " processes (AdamW state re-shards to any number)");
  }
  optim::OptimizerState state;
  state.meta = meta.at("optimizer");
  const auto& plans = engine.units();
  const auto& shards = engine.shard_parameters();
  for (const auto& name : reader.names()) {
    bool done = false;
    for (size_t u = 0; u < plans.size() && !done; ++u) {
      for (const auto& suffix : kElementwise) {
        if (name != unit_key(plans[u].name) + suffix) continue;
        const auto& info = reader.info(name);
        if (info.shape != std::vector<int64_t>{plans[u].numel}) {
          throw Error("load_state: '" + reader.index_path() + "' has '" + name + "' of " +
                      c10::str(info.shape) + " elements but the unit has " +
                      std::to_string(plans[u].numel) +
                      "; it was saved with another wrap policy or model");
        }
        const auto [b, e] = engine.unit_range(u, process_index());
        auto t = torch::zeros({shards[u].numel()}, torch::TensorOptions().dtype(info.dtype));
        if (b < e) t.narrow(0, 0, e - b).copy_(reader.read_range(name, b, e));
        state.tensors[name] = t;
        done = true;
        break;
      }
    }
  }
  const std::string mine = "@rank" + std::to_string(process_index());
  for (const auto& key : per_rank) {
    const std::string name = key + mine;
    state.tensors[key] = reader.has(name) && !reader.info(name).pieces.empty() ? reader.read(name)
                                                                               : torch::empty({0});
  }
  opt.load_state_dict(state);
  engine.restore_user_hyperparameters();
}

}  // namespace difftrain::accel
