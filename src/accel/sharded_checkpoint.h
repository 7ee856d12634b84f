#pragma once
// Private to src/accel: the sharding engine's CheckpointState (sharded_checkpoint.cpp).

#include "difftrain/accel/grad_sync.h"
#include "difftrain/accel/sharded_model.h"
#include "difftrain/distributed/process_group.h"

namespace difftrain::accel {

class ShardedCheckpointState final : public CheckpointState {
 public:
  ShardedCheckpointState(ShardedModel& engine, distributed::ProcessGroup& group);
  void save_model(torch::nn::Module& model, const std::string& dir,
                  const std::string& stem) override;
  void load_model(torch::nn::Module& model, const std::string& dir,
                  const std::string& stem) override;
  void save_optimizer(optim::FlatOptimizer& optimizer, const std::string& dir,
                      const std::string& stem) override;
  void load_optimizer(optim::FlatOptimizer& optimizer, const std::string& dir,
                      const std::string& stem) override;

 private:
  ShardedModel& engine_;
  distributed::ProcessGroup& group_;
};

}  // namespace difftrain::accel
