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

// Parameters whole and equal on every rank: rank 0 writes, every rank reads.
class ReplicatedCheckpointState final : public CheckpointState {
 public:
  explicit ReplicatedCheckpointState(int rank) : rank_(rank) {}

  void save_model(torch::nn::Module& model, const std::string& dir,
                  const std::string& stem) override {
    if (rank_ != 0) return;
    io::save_safetensors((fs::path(dir) / (stem + ".safetensors")).string(), module_tensors(model),
                         {{"format", "pt"}});
  }
  void load_model(torch::nn::Module& model, const std::string& dir,
                  const std::string& stem) override {
    load_module(model, dir, stem);
  }
  void save_optimizer(optim::FlatOptimizer& optimizer, const std::string& dir,
                      const std::string& stem) override {
    if (rank_ != 0) return;
    optim::save_optimizer_state(optimizer.state_dict(), (fs::path(dir) / stem).string());
  }
  void load_optimizer(optim::FlatOptimizer& optimizer, const std::string& dir,
                      const std::string& stem) override {
    if (io::has_sharded_tensors(dir, stem)) {
      throw Error("load_state: '" + dir +
                  "' holds sharded optimizer state; resume with a sharding strategy (e.g. "
                  "--sharding_strategy FULL_SHARD), any number of processes");
    }
    optimizer.load_state_dict(optim::load_optimizer_state((fs::path(dir) / stem).string()));
  }

 private:
  int rank_;
};

}  // namespace

std::unique_ptr<CheckpointState> replicated_checkpoint_state(int rank) {
  return std::make_unique<ReplicatedCheckpointState>(rank);
}

namespace {

// Entry `index` of a per-model or per-optimizer engine list: that engine's CheckpointState, else
// the replicated one (made on first use).
CheckpointState& engine_checkpoint_state(const std::vector<GradSync*>& engines, size_t index,
                                         std::unique_ptr<CheckpointState>& replicated, int rank) {
  GradSync* engine = index < engines.size() ? engines[index] : nullptr;
  if (CheckpointState* own = engine ? engine->checkpoint_state() : nullptr) return *own;
  if (!replicated) replicated = replicated_checkpoint_state(rank);
  return *replicated;
}

}  // namespace

CheckpointState& Accelerator::checkpoint_state_of_model(size_t index) {
  return engine_checkpoint_state(grad_sync_of_model_, index, replicated_checkpoint_,
                                 process_index());
}

CheckpointState& Accelerator::checkpoint_state_of_optimizer(size_t index) {
  return engine_checkpoint_state(engine_of_optimizer_, index, replicated_checkpoint_,
                                 process_index());
}

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
    // Every model's and optimizer's state as its engine holds it: each rank its own shard, in
    // parallel, or the main rank the whole of a replicated one.
    for (size_t i = 0; i < models_.size(); ++i) {
      auto model = models_[i].lock();
      if (!model) {
        throw Error("save_state: prepared model " + std::to_string(i) +
                    " was prepared by reference or no longer exists; prepare it through its "
                    "module holder or a shared_ptr");
      }
      checkpoint_state_of_model(i).save_model(*model, temp.string(), indexed("model", i));
    }
    for (size_t i = 0; i < optimizers_.size(); ++i) {
      auto opt = optimizers_[i].lock();
      if (!opt) continue;
      auto* flat = dynamic_cast<optim::FlatOptimizer*>(&opt->optimizer());
      if (!flat) {
        throw Error("save_state: prepared optimizer " + std::to_string(i) +
                    " is not a difftrain optimizer; use difftrain::optim::AdamW or AdamW8bit "
                    "(LibTorch optimizers have no safetensors state)");
      }
      checkpoint_state_of_optimizer(i).save_optimizer(*flat, temp.string(),
                                                      indexed("optimizer", i));
    }
    if (is_main_process()) {
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
    checkpoint_state_of_model(i).load_model(*model, dir, indexed("model", i));
  }
  for (size_t i = 0; i < optimizers_.size(); ++i) {
    auto opt = optimizers_[i].lock();
    if (!opt) continue;
    auto* flat = dynamic_cast<optim::FlatOptimizer*>(&opt->optimizer());
    if (!flat)
      throw Error("load_state: prepared optimizer " + std::to_string(i) +
                  " is not a difftrain optimizer");
    checkpoint_state_of_optimizer(i).load_optimizer(*flat, dir, indexed("optimizer", i));
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

}  // namespace difftrain::accel
