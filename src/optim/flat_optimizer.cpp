#include "difftrain/optim/flat_optimizer.h"

#include "difftrain/core/error.h"
#include "difftrain/io/atomic_file.h"

#include <c10/util/strides.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <map>
#include <set>
#include <sstream>
#include <tuple>

namespace difftrain::optim {
namespace {

// Elements [offset, offset + numel(sizes)) of a flat buffer as a tensor of `sizes` sharing its
// storage. Unlike narrow().view(), the result is not an autograd view, so LibTorch's
// Optimizer::zero_grad() (which detach_()es gradients) and set_data() treat it as a plain tensor.
torch::Tensor storage_slice(const torch::Tensor& flat, int64_t offset, torch::IntArrayRef sizes) {
  return torch::empty({0}, flat.options())
      .set_(flat.storage(), flat.storage_offset() + offset, sizes, c10::contiguous_strides(sizes));
}

std::string shape_string(torch::IntArrayRef shape) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << ']';
  return out.str();
}

}  // namespace

void save_optimizer_state(const OptimizerState& state, const std::string& path_prefix) {
  io::save_safetensors(path_prefix + ".safetensors", state.tensors);
  io::write_file_atomic(path_prefix + ".json", state.meta.dump(2) + "\n");
}

OptimizerState load_optimizer_state(const std::string& path_prefix) {
  OptimizerState state;
  const std::string json_path = path_prefix + ".json";
  std::string text = io::read_file(json_path);
  try {
    state.meta = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error("optimizer state '" + json_path + "' is not valid JSON (" + e.what() +
                "); the checkpoint is corrupt");
  }
  state.tensors = io::load_safetensors(path_prefix + ".safetensors").tensors;
  return state;
}

FlatOptimizer::FlatOptimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                             torch::optim::AdamWOptions defaults, const char* type_name)
    : torch::optim::Optimizer(std::move(groups),
                              std::make_unique<torch::optim::AdamWOptions>(defaults)),
      type_name_(type_name) {
  std::set<const void*> seen;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    auto& group = param_groups_[g];
    if (!dynamic_cast<torch::optim::AdamWOptions*>(&group.options())) {
      throw Error(type_name_ + ": parameter group " + std::to_string(g) +
                  " has options of another optimizer; give it torch::optim::AdamWOptions");
    }
    const auto& opts = group_options(g);
    const double b1 = std::get<0>(opts.betas()), b2 = std::get<1>(opts.betas());
    if (!(opts.lr() >= 0) || !(opts.eps() >= 0) || !(b1 >= 0 && b1 < 1) || !(b2 >= 0 && b2 < 1) ||
        !(opts.weight_decay() >= 0)) {
      throw Error(type_name_ + ": parameter group " + std::to_string(g) +
                  " has invalid hyperparameters (need lr >= 0, eps >= 0, 0 <= betas < 1, "
                  "weight_decay >= 0)");
    }
    // Bucket key: (dtype, device) in first-seen order.
    std::vector<std::pair<torch::Dtype, torch::Device>> keys;
    std::vector<size_t> bucket_of;
    for (size_t i = 0; i < group.params().size(); ++i) {
      const auto& p = group.params()[i];
      if (!p.defined())
        throw Error(type_name_ + ": parameter " + std::to_string(i) + " of group " +
                    std::to_string(g) + " is undefined");
      if (p.is_sparse()) throw Error(type_name_ + " does not support sparse parameters");
      if (!seen.insert(p.unsafeGetTensorImpl()).second) {
        throw Error(type_name_ + ": a parameter appears more than once (group " +
                    std::to_string(g) + ", index " + std::to_string(i) +
                    "); each parameter may be in one group only");
      }
      std::pair<torch::Dtype, torch::Device> key{p.scalar_type(), p.device()};
      auto it = std::find(keys.begin(), keys.end(), key);
      if (it == keys.end()) {
        keys.push_back(key);
        it = keys.end() - 1;
      }
      bucket_of.push_back(static_cast<size_t>(it - keys.begin()));
    }
    for (size_t k = 0; k < keys.size(); ++k) {
      FlatBucket bucket;
      bucket.group = g;
      bucket.dtype = keys[k].first;
      bucket.device = keys[k].second;
      bucket.offsets.push_back(0);
      for (size_t i = 0; i < bucket_of.size(); ++i) {
        if (bucket_of[i] != k) continue;
        bucket.members.push_back(i);
        bucket.offsets.push_back(bucket.offsets.back() + group.params()[i].numel());
      }
      auto options = torch::TensorOptions().dtype(bucket.dtype).device(bucket.device);
      // Host parameters a CUDA run keeps pinned (the sharding engine's offloaded shards) stay
      // pinned, so their copies to and from the device can run asynchronously.
      if (bucket.device.is_cpu() && torch::cuda::is_available() &&
          group.params()[bucket.members.front()].is_pinned()) {
        options = options.pinned_memory(true);
      }
      bucket.params = torch::empty({bucket.numel()}, options);
      bucket.grads = torch::zeros({bucket.numel()}, options);
      torch::NoGradGuard no_grad;
      for (size_t j = 0; j < bucket.members.size(); ++j) {
        auto& p = group.params()[bucket.members[j]];
        const int64_t n = bucket.offsets[j + 1] - bucket.offsets[j];
        (void)n;
        auto slot = storage_slice(bucket.params, bucket.offsets[j], p.sizes());
        slot.copy_(p.detach());
        p.set_data(slot);
        auto gslot = storage_slice(bucket.grads, bucket.offsets[j], p.sizes());
        if (p.grad().defined()) gslot.copy_(p.grad());
        p.mutable_grad() = gslot;
      }
      buckets_.push_back(std::move(bucket));
    }
    steps_.emplace_back(group.params().size(), 0);
    std::vector<std::string> names;
    for (size_t i = 0; i < group.params().size(); ++i)
      names.push_back(std::to_string(g) + "." + std::to_string(i));
    names_.push_back(std::move(names));
  }
}

void FlatOptimizer::set_parameter_names(const std::vector<std::string>& names) {
  size_t total = 0;
  for (const auto& group : names_) total += group.size();
  if (names.size() != total) {
    throw Error(type_name_ + ": set_parameter_names got " + std::to_string(names.size()) +
                " names for " + std::to_string(total) + " parameters; pass one name per parameter");
  }
  std::set<std::string> unique(names.begin(), names.end());
  if (unique.size() != names.size()) throw Error(type_name_ + ": parameter names must be unique");
  size_t k = 0;
  for (auto& group : names_) {
    for (auto& name : group) name = names[k++];
  }
}

const std::string& FlatOptimizer::parameter_name(size_t group, size_t index) const {
  return names_.at(group).at(index);
}

void FlatOptimizer::save(torch::serialize::OutputArchive&) const {
  throw Error(type_name_ +
              " state cannot go into a LibTorch archive; use state_dict() and "
              "difftrain::optim::save_optimizer_state()");
}

void FlatOptimizer::load(torch::serialize::InputArchive&) {
  throw Error(type_name_ +
              " state cannot come from a LibTorch archive; use "
              "difftrain::optim::load_optimizer_state() and load_state_dict()");
}

torch::optim::AdamWOptions& FlatOptimizer::group_options(size_t g) {
  return static_cast<torch::optim::AdamWOptions&>(param_groups_.at(g).options());
}

const torch::optim::AdamWOptions& FlatOptimizer::group_options(size_t g) const {
  return static_cast<const torch::optim::AdamWOptions&>(param_groups_.at(g).options());
}

void FlatOptimizer::release_storage() {
  for (auto& bucket : buckets_) {
    bucket.params = torch::Tensor();
    bucket.grads = torch::Tensor();
  }
  release_state();
  released_ = true;
}

void FlatOptimizer::refresh_layout() {
  if (released_) {
    throw Error(type_name_ +
                ": this optimizer was prepared for sharded training and handed its parameters "
                "to a per-rank optimizer; step the optimizer that Accelerator::prepare() "
                "returned");
  }
  bool same = param_groups_.size() == steps_.size();
  for (size_t g = 0; same && g < param_groups_.size(); ++g) {
    same = param_groups_[g].params().size() == steps_[g].size();
  }
  if (!same) {
    throw Error(type_name_ +
                ": parameter groups changed after construction; construct a new "
                "optimizer over the new parameters");
  }
  torch::NoGradGuard no_grad;
  for (auto& bucket : buckets_) {
    auto& params = param_groups_[bucket.group].params();
    bool grads_used = false;
    const char* gbase =
        bucket.grads.defined() ? static_cast<const char*>(bucket.grads.data_ptr()) : nullptr;
    const size_t gbytes = bucket.grads.defined() ? bucket.grads.nbytes() : 0;
    for (size_t j = 0; j < bucket.members.size(); ++j) {
      auto& p = params[bucket.members[j]];
      const int64_t n = bucket.offsets[j + 1] - bucket.offsets[j];
      if (p.scalar_type() != bucket.dtype || p.device() != bucket.device || p.numel() != n) {
        throw Error(type_name_ + ": parameter '" + names_[bucket.group][bucket.members[j]] +
                    "' changed dtype, device or size after the optimizer was built; move the "
                    "model first, then construct the optimizer");
      }
      void* expected = static_cast<char*>(bucket.params.data_ptr()) +
                       bucket.offsets[j] * bucket.params.element_size();
      if (p.data_ptr() != expected) {
        // Someone replaced the parameter's storage: take its values back into the bucket.
        auto slot = storage_slice(bucket.params, bucket.offsets[j], p.sizes());
        slot.copy_(p.detach());
        p.set_data(slot);
      }
      if (gbase && p.grad().defined()) {
        const char* gp = static_cast<const char*>(p.grad().data_ptr());
        grads_used = grads_used || (gp >= gbase && gp < gbase + gbytes);
      }
    }
    // DDP hands out its own flat bucket views; then ours is dead weight.
    if (bucket.grads.defined() && !grads_used) bucket.grads = torch::Tensor();
  }
}

void FlatOptimizer::drop_unused_grad_storage() {
  for (auto& bucket : buckets_) {
    if (!bucket.grads.defined()) continue;
    const char* base = static_cast<const char*>(bucket.grads.data_ptr());
    const size_t bytes = bucket.grads.nbytes();
    bool used = false;
    const auto& params = param_groups_[bucket.group].params();
    for (size_t j = 0; j < bucket.members.size() && !used; ++j) {
      const auto& g = params[bucket.members[j]].grad();
      if (!g.defined()) continue;
      const char* gp = static_cast<const char*>(g.data_ptr());
      used = gp >= base && gp < base + bytes;
    }
    if (!used) bucket.grads = torch::Tensor();
  }
}

torch::Tensor FlatOptimizer::begin_step(const LossClosure& closure) {
  torch::Tensor loss;
  if (closure) {
    torch::AutoGradMode grad_mode(true);
    loss = closure();
  }
  refresh_layout();
  return loss;
}

std::vector<FlatOptimizer::GradSlot> FlatOptimizer::take_gradients(size_t b) {
  const auto& bucket = buckets_[b];
  auto& params = param_groups_[bucket.group].params();
  std::vector<GradSlot> out;
  for (size_t j = 0; j < bucket.members.size(); ++j) {
    const size_t i = bucket.members[j];
    const auto& p = params[i];
    if (!p.grad().defined()) continue;
    auto g = p.grad();
    if (g.is_sparse() || g.scalar_type() != bucket.dtype || g.sizes() != p.sizes()) {
      throw Error(type_name_ + ": gradient of parameter '" + names_[bucket.group][i] +
                  "' is sparse or has another dtype or shape than the parameter");
    }
    out.push_back({j, g.contiguous(), ++steps_[bucket.group][i]});
  }
  return out;
}

nlohmann::json FlatOptimizer::meta_json() const {
  nlohmann::json groups = nlohmann::json::array();
  nlohmann::json steps = nlohmann::json::object();
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto& o = group_options(g);
    groups.push_back({{"lr", o.lr()},
                      {"betas", {std::get<0>(o.betas()), std::get<1>(o.betas())}},
                      {"eps", o.eps()},
                      {"weight_decay", o.weight_decay()},
                      {"amsgrad", o.amsgrad()},
                      {"params", names_[g]}});
    for (size_t i = 0; i < names_[g].size(); ++i) steps[names_[g][i]] = steps_[g][i];
  }
  return {{"type", type_name_}, {"format", 1}, {"param_groups", groups}, {"steps", steps}};
}

void FlatOptimizer::load_meta_json(const nlohmann::json& meta) {
  try {
    const std::string type = meta.at("type").get<std::string>();
    if (type != type_name_) {
      throw Error("optimizer state was written by " + type + ", not " + type_name_ +
                  "; resume with the same optimizer (--use_8bit_adam must match)");
    }
    const auto& groups = meta.at("param_groups");
    if (groups.size() != param_groups_.size()) {
      throw Error("optimizer state has " + std::to_string(groups.size()) +
                  " parameter groups but the optimizer has " +
                  std::to_string(param_groups_.size()) + "; the state is for another setup");
    }
    for (size_t g = 0; g < groups.size(); ++g) {
      auto names = groups[g].at("params").get<std::vector<std::string>>();
      for (size_t i = 0; i < std::max(names.size(), names_[g].size()); ++i) {
        if (i >= names.size() || i >= names_[g].size() || names[i] != names_[g][i]) {
          const std::string ours = i < names_[g].size() ? names_[g][i] : "(none)";
          const std::string theirs = i < names.size() ? names[i] : "(none)";
          throw Error("optimizer state does not match the parameters: group " + std::to_string(g) +
                      " position " + std::to_string(i) + " is '" + theirs + "' in the state but '" +
                      ours + "' here; the state is for another model");
        }
      }
    }
    const auto& steps = meta.at("steps");
    for (size_t g = 0; g < groups.size(); ++g) {
      auto& o = group_options(g);
      o.lr(groups[g].at("lr").get<double>());
      auto betas = groups[g].at("betas").get<std::vector<double>>();
      if (betas.size() != 2) throw Error("optimizer state has malformed betas");
      o.betas({betas[0], betas[1]});
      o.eps(groups[g].at("eps").get<double>());
      o.weight_decay(groups[g].at("weight_decay").get<double>());
      o.amsgrad(groups[g].at("amsgrad").get<bool>());
      for (size_t i = 0; i < names_[g].size(); ++i)
        steps_[g][i] = steps.at(names_[g][i]).get<int64_t>();
    }
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("optimizer state JSON is malformed (") + e.what() +
                "); the checkpoint is corrupt or from another program");
  }
}

void FlatOptimizer::load_meta_checked(const nlohmann::json& meta,
                                      const std::function<void()>& verify) {
  auto saved_steps = steps_;
  std::vector<torch::optim::AdamWOptions> saved_options;
  for (size_t g = 0; g < param_groups_.size(); ++g) saved_options.push_back(group_options(g));
  try {
    load_meta_json(meta);
    verify();
  } catch (...) {
    steps_ = saved_steps;
    for (size_t g = 0; g < param_groups_.size(); ++g) group_options(g) = saved_options[g];
    throw;
  }
}

bool FlatOptimizer::bucket_has_state(size_t b) const {
  const auto& bucket = buckets_[b];
  for (size_t i : bucket.members) {
    if (steps_[bucket.group][i] > 0) return true;
  }
  return false;
}

const torch::Tensor& FlatOptimizer::expect_tensor(const OptimizerState& state,
                                                  const std::string& key, torch::IntArrayRef shape,
                                                  torch::Dtype dtype) const {
  auto it = state.tensors.find(key);
  if (it == state.tensors.end()) {
    throw Error("optimizer state has no tensor '" + key +
                "'; the state is for another model or optimizer setting");
  }
  if (it->second.sizes() != shape || it->second.scalar_type() != dtype) {
    throw Error("optimizer state tensor '" + key + "' has shape " +
                shape_string(it->second.sizes()) + " " + c10::toString(it->second.scalar_type()) +
                " but this optimizer needs " + shape_string(shape) + " " + c10::toString(dtype) +
                "; the state was saved for a different model");
  }
  return it->second;
}

torch::Tensor FlatOptimizer::member_state(
    size_t group, size_t index, const std::function<torch::Tensor(size_t)>& buffer) const {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const auto& bucket = buckets_[b];
    if (bucket.group != group) continue;
    for (size_t j = 0; j < bucket.members.size(); ++j) {
      if (bucket.members[j] != index) continue;
      const torch::Tensor buf = buffer(b);
      if (!buf.defined() || steps_[group][index] == 0) return {};
      return buf.narrow(0, bucket.offsets[j], bucket.offsets[j + 1] - bucket.offsets[j])
          .view(param_groups_[group].params()[index].sizes());
    }
  }
  return {};
}

}  // namespace difftrain::optim
