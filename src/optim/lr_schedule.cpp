#include "difftrain/optim/lr_schedule.h"

#include "difftrain/core/error.h"
#include "difftrain/core/log.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <map>
#include <memory>
#include <string_view>
#include <utility>

namespace difftrain::optim {

namespace {

struct NamedSchedule {
  ScheduleType type;
  const char* name;
};

// Diffusers' SchedulerType order.
constexpr std::array<NamedSchedule, 7> kSchedules{{
    {ScheduleType::kLinear, "linear"},
    {ScheduleType::kCosine, "cosine"},
    {ScheduleType::kCosineWithRestarts, "cosine_with_restarts"},
    {ScheduleType::kPolynomial, "polynomial"},
    {ScheduleType::kConstant, "constant"},
    {ScheduleType::kConstantWithWarmup, "constant_with_warmup"},
    {ScheduleType::kPiecewiseConstant, "piecewise_constant"},
}};

// Python's math.pi (the shortest repr of the double nearest pi).
constexpr double kPi = 3.141592653589793;

constexpr const char* kStepRulesExample = "1:10,0.1:20,0.01:30,0.005";

std::string one_line(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  std::replace(text.begin(), text.end(), '\r', ' ');
  return text;
}

bool needs_training_steps(ScheduleType type) {
  return type == ScheduleType::kLinear || type == ScheduleType::kCosine ||
         type == ScheduleType::kCosineWithRestarts || type == ScheduleType::kPolynomial;
}

// ------------------------------------------------------------------ step_rules

// Python's float() and int() ignore surrounding whitespace and accept a leading '+'.
std::string_view number_text(std::string_view text) {
  const auto is_space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  while (!text.empty() && is_space(text.front())) text.remove_prefix(1);
  while (!text.empty() && is_space(text.back())) text.remove_suffix(1);
  if (!text.empty() && text.front() == '+') text.remove_prefix(1);
  return text;
}

template <typename T>
bool parse_number(std::string_view text, T& out) {
  text = number_text(text);
  if (text.empty()) return false;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, out);
  return ec == std::errc() && ptr == end;
}

std::vector<std::string_view> split(std::string_view text, char sep) {
  std::vector<std::string_view> parts;
  for (;;) {
    const size_t at = text.find(sep);
    parts.push_back(text.substr(0, at));
    if (at == std::string_view::npos) return parts;
    text.remove_prefix(at + 1);
  }
}

struct StepRules {
  std::map<int64_t, double> multipliers;  // step s -> multiplier while step < s
  double last = 1.0;                      // after the largest s
};

[[noreturn]] void bad_step_rules(const std::string& rules, const std::string& why) {
  throw Error(one_line(fmt::format(
      "piecewise_constant step_rules '{}' is malformed: {}; expected "
      "'multiplier:step,...,final_multiplier' with multipliers >= 0 and integer steps >= 0, "
      "e.g. '{}'",
      rules, why, kStepRulesExample)));
}

bool valid_multiplier(std::string_view text, double& value) {
  return parse_number(text, value) && std::isfinite(value) && value >= 0;
}

// Diffusers' get_piecewise_constant_schedule parsing: split on ',', every item but the last is
// "multiplier:step", the last is the multiplier after the last step.
StepRules parse_step_rules(const std::string& rules) {
  if (number_text(rules).empty()) bad_step_rules(rules, "it is empty");
  const std::vector<std::string_view> items = split(rules, ',');
  StepRules parsed;
  for (size_t i = 0; i + 1 < items.size(); ++i) {
    const std::vector<std::string_view> parts = split(items[i], ':');
    if (parts.size() != 2) {
      bad_step_rules(rules, fmt::format("rule '{}' is not one 'multiplier:step' pair", items[i]));
    }
    double multiplier = 0;
    if (!valid_multiplier(parts[0], multiplier)) {
      bad_step_rules(rules, fmt::format("multiplier '{}' is not a number >= 0", parts[0]));
    }
    int64_t step = 0;
    if (!parse_number(parts[1], step) || step < 0) {
      bad_step_rules(rules, fmt::format("step '{}' is not an integer >= 0", parts[1]));
    }
    parsed.multipliers[step] = multiplier;  // a repeated step keeps its last value, as a dict
  }
  const std::string_view last = items.back();
  if (last.find(':') != std::string_view::npos) {
    bad_step_rules(rules,
                   fmt::format("it ends with the rule '{}' instead of the final multiplier", last));
  }
  if (!valid_multiplier(last, parsed.last)) {
    bad_step_rules(rules, fmt::format("final multiplier '{}' is not a number >= 0", last));
  }
  return parsed;
}

// ------------------------------------------------------------------ validation

void check_options(const LRScheduleOptions& o, ScheduleType type, double initial_lr) {
  if (o.num_warmup_steps < 0) {
    throw Error(fmt::format(
        "num_warmup_steps {} is negative; use 0 for no warmup or a number of optimizer updates",
        o.num_warmup_steps));
  }
  if (needs_training_steps(type)) {
    if (o.num_training_steps < 0) {
      throw Error(fmt::format(
          "LR schedule '{}' needs num_training_steps (got {}); pass the total number of "
          "optimizer updates (--max_train_steps)",
          o.name, o.num_training_steps == -1 ? "none" : std::to_string(o.num_training_steps)));
    }
    // A warm-up as long as the run or longer is fine: Diffusers' lambdas simply stay in warm-up.
  }
  if (type == ScheduleType::kCosineWithRestarts &&
      !(std::isfinite(o.num_cycles) && o.num_cycles >= 0)) {
    throw Error(fmt::format(
        "num_cycles {} is not valid for cosine_with_restarts; use a finite number >= 0 (e.g. 1)",
        o.num_cycles));
  }
  if (type == ScheduleType::kPolynomial) {
    if (!(std::isfinite(o.power) && o.power >= 0)) {
      throw Error(fmt::format(
          "power {} is not valid for the polynomial LR schedule; use a finite number >= 0 "
          "(1 decays linearly)",
          o.power));
    }
    if (!(std::isfinite(o.lr_end) && o.lr_end >= 0)) {
      throw Error(fmt::format(
          "lr_end {} is not valid for the polynomial LR schedule; use a finite lr >= 0 (default "
          "1e-7)",
          o.lr_end));
    }
    // Diffusers: `if not (lr_init > lr_end): raise ValueError(...)`.
    if (!(initial_lr > o.lr_end)) {
      throw Error(fmt::format(
          "lr_end ({}) must be smaller than the initial lr ({}) for the polynomial LR schedule; "
          "lower lr_end or raise the learning rate",
          o.lr_end, initial_lr));
    }
  }
}

}  // namespace

ScheduleType parse_schedule_type(const std::string& name) {
  for (const auto& s : kSchedules) {
    if (name == s.name) return s.type;
  }
  std::string valid;
  for (const auto& s : kSchedules) {
    valid += valid.empty() ? s.name : std::string(", ") + s.name;
  }
  throw Error(one_line(fmt::format("unknown LR schedule '{}'; valid choices: {}", name, valid)));
}

std::string to_string(ScheduleType type) {
  for (const auto& s : kSchedules) {
    if (s.type == type) return s.name;
  }
  return "?";
}

// The lambdas below follow diffusers/optimization.py line by line; Python's int -> float
// conversions are exact here, and its `/` on two ints is the double division of their values.
std::function<double(int64_t)> make_lr_lambda(const LRScheduleOptions& options, double initial_lr) {
  const ScheduleType type = parse_schedule_type(options.name);
  check_options(options, type, initial_lr);
  const int64_t warmup = options.num_warmup_steps;
  const int64_t total = options.num_training_steps;

  // float(step) / float(max(1, num_warmup_steps)), shared by every schedule with a warmup.
  const auto warmup_factor = [warmup](int64_t step) {
    return static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup));
  };
  // float(step - W) / float(max(1, T - W)).
  const auto progress = [warmup, total](int64_t step) {
    return static_cast<double>(step - warmup) /
           static_cast<double>(std::max<int64_t>(1, total - warmup));
  };

  switch (type) {
    case ScheduleType::kConstant: return [](int64_t) { return 1.0; };

    case ScheduleType::kConstantWithWarmup:
      return [warmup, warmup_factor](int64_t step) {
        return step < warmup ? warmup_factor(step) : 1.0;
      };

    case ScheduleType::kLinear:
      return [warmup, total, warmup_factor](int64_t step) {
        if (step < warmup) return warmup_factor(step);
        return std::max(0.0, static_cast<double>(total - step) /
                                 static_cast<double>(std::max<int64_t>(1, total - warmup)));
      };

    case ScheduleType::kCosine:
      // get_scheduler never passes num_cycles to the cosine schedule: its default 0.5 holds.
      return [warmup, warmup_factor, progress](int64_t step) {
        if (step < warmup) return warmup_factor(step);
        constexpr double kHalfCycle = 0.5;
        return std::max(0.0, 0.5 * (1.0 + std::cos(kPi * kHalfCycle * 2.0 * progress(step))));
      };

    case ScheduleType::kCosineWithRestarts: {
      const double cycles = options.num_cycles;
      return [warmup, cycles, warmup_factor, progress](int64_t step) {
        if (step < warmup) return warmup_factor(step);
        const double p = progress(step);
        if (p >= 1.0) return 0.0;
        // Python's `x % 1.0` equals fmod for the x >= 0 that cycles >= 0 and p >= 0 give.
        return std::max(0.0, 0.5 * (1.0 + std::cos(kPi * std::fmod(cycles * p, 1.0))));
      };
    }

    case ScheduleType::kPolynomial: {
      const double lr_init = initial_lr;
      const double lr_end = options.lr_end;
      const double power = options.power;
      return [warmup, total, lr_init, lr_end, power, warmup_factor](int64_t step) {
        if (step < warmup) return warmup_factor(step);
        // Both branches return a multiplier of lr_init, as LambdaLR multiplies by it.
        // Diffusers divides by zero at step == T when T == W (and fails to build for T == W == 0);
        // the limit of its values, lr_end, is used there instead.
        if (step > total || total == warmup) return lr_end / lr_init;
        const double lr_range = lr_init - lr_end;
        const double pct_remaining =
            1.0 - static_cast<double>(step - warmup) / static_cast<double>(total - warmup);
        const double decay = lr_range * std::pow(pct_remaining, power) + lr_end;
        return decay / lr_init;
      };
    }

    case ScheduleType::kPiecewiseConstant: {
      auto rules = std::make_shared<const StepRules>(parse_step_rules(options.step_rules));
      return [rules](int64_t step) {
        // The first rule step s (in increasing order) with step < s.
        const auto it = rules->multipliers.upper_bound(step);
        return it == rules->multipliers.end() ? rules->last : it->second;
      };
    }
  }
  throw Error(fmt::format("LR schedule '{}' has no lambda", options.name));
}

// ------------------------------------------------------------------ LRScheduler

namespace {

// OptimizerOptions' base get_lr()/set_lr() throw a multi-line c10::Error; say what to do instead.
[[noreturn]] void no_lr_accessors() {
  throw Error(
      "LRScheduler: the optimizer's options do not implement get_lr()/set_lr(); override both in "
      "its OptimizerOptions subclass (torch's SGD, Adam, AdamW, Adagrad and RMSprop do)");
}

double get_lr(const torch::optim::OptimizerOptions& options) {
  try {
    return options.get_lr();
  } catch (const c10::Error&) {
    no_lr_accessors();
  }
}

void set_lr(torch::optim::OptimizerOptions& options, double lr) {
  try {
    options.set_lr(lr);
  } catch (const c10::Error&) {
    no_lr_accessors();
  }
}

[[noreturn]] void bad_state(const std::string& field, const std::string& why) {
  throw Error(one_line(fmt::format(
      "LR scheduler state field '{}' {}; load the state_dict() saved by an LRScheduler with the "
      "same --lr_scheduler and optimizer param groups",
      field, why)));
}

}  // namespace

LRScheduler::LRScheduler(torch::optim::Optimizer& optimizer, LRScheduleOptions options)
    : optimizer_(optimizer), options_(std::move(options)) {
  // Diffusers' polynomial schedule reads optimizer.defaults["lr"], not a group's lr.
  lambda_ = make_lr_lambda(options_, get_lr(optimizer_.defaults()));
  std::vector<double> base_lrs;
  for (const auto& group : optimizer_.param_groups()) base_lrs.push_back(get_lr(group.options()));
  apply(0, std::move(base_lrs));
}

void LRScheduler::step() { apply(last_epoch_ + 1, base_lrs_); }

void LRScheduler::apply(int64_t epoch, std::vector<double> base_lrs) {
  auto& groups = optimizer_.param_groups();
  if (groups.size() != base_lrs.size()) {
    throw Error(fmt::format(
        "LRScheduler: the optimizer has {} param group(s) but the scheduler holds {} base lr(s); "
        "add param groups before building the scheduler",
        groups.size(), base_lrs.size()));
  }
  const double factor = lambda_(epoch);
  std::vector<double> lrs;
  lrs.reserve(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    lrs.push_back(base_lrs[g] * factor);
    set_lr(groups[g].options(), lrs.back());
  }
  last_epoch_ = epoch;
  base_lrs_ = std::move(base_lrs);
  last_lrs_ = std::move(lrs);
}

nlohmann::json LRScheduler::state_dict() const {
  return nlohmann::json{{"last_epoch", last_epoch_},
                        {"base_lrs", base_lrs_},
                        {"schedule",
                         {{"name", options_.name},
                          {"num_warmup_steps", options_.num_warmup_steps},
                          {"num_training_steps", options_.num_training_steps},
                          {"num_cycles", options_.num_cycles},
                          {"power", options_.power},
                          {"lr_end", options_.lr_end},
                          {"step_rules", options_.step_rules}}}};
}

void LRScheduler::load_state_dict(const nlohmann::json& state) {
  if (!state.is_object()) {
    bad_state("(root)", fmt::format("is a {}, not an object", state.type_name()));
  }

  if (!state.contains("last_epoch") || !state.at("last_epoch").is_number_integer() ||
      state.at("last_epoch").get<int64_t>() < 0) {
    bad_state("last_epoch", fmt::format("must be an integer >= 0, got {}",
                                        state.contains("last_epoch") ? state.at("last_epoch").dump()
                                                                     : "nothing"));
  }
  const int64_t last_epoch = state.at("last_epoch").get<int64_t>();

  if (!state.contains("base_lrs") || !state.at("base_lrs").is_array()) {
    bad_state("base_lrs", "must be an array of lrs, one per param group");
  }
  std::vector<double> base_lrs;
  for (const auto& lr : state.at("base_lrs")) {
    if (!lr.is_number() || !std::isfinite(lr.get<double>())) {
      bad_state("base_lrs", fmt::format("holds {}, not a finite lr", lr.dump()));
    }
    base_lrs.push_back(lr.get<double>());
  }
  if (base_lrs.size() != optimizer_.param_groups().size()) {
    bad_state("base_lrs", fmt::format("has {} entries but the optimizer has {} param group(s)",
                                      base_lrs.size(), optimizer_.param_groups().size()));
  }

  if (!state.contains("schedule") || !state.at("schedule").is_object()) {
    bad_state("schedule", "must be an object of schedule options");
  }
  const nlohmann::json& saved = state.at("schedule");
  const auto field = [&saved](const char* key, bool (nlohmann::json::*is_type)() const noexcept,
                              const char* type_name) -> const nlohmann::json& {
    if (!saved.contains(key) || !(saved.at(key).*is_type)()) {
      bad_state(std::string("schedule.") + key, fmt::format("must be {}", type_name));
    }
    return saved.at(key);
  };
  const std::string name = field("name", &nlohmann::json::is_string, "a string").get<std::string>();
  if (name != options_.name) {
    bad_state("schedule.name",
              fmt::format("is '{}' but this scheduler is '{}'", name, options_.name));
  }
  // The rest only differ when the run was reconfigured (e.g. trained longer): keep the current
  // options, as torch's LambdaLR keeps its current lambda, but say so.
  std::vector<std::string> changed;
  const auto compare = [&changed](const char* key, const auto& was, const auto& now) {
    if (was != now) changed.push_back(fmt::format("{} {} -> {}", key, was, now));
  };
  using J = nlohmann::json;
  compare("num_warmup_steps",
          field("num_warmup_steps", &J::is_number_integer, "an integer").get<int64_t>(),
          options_.num_warmup_steps);
  compare("num_training_steps",
          field("num_training_steps", &J::is_number_integer, "an integer").get<int64_t>(),
          options_.num_training_steps);
  compare("num_cycles", field("num_cycles", &J::is_number, "a number").get<double>(),
          options_.num_cycles);
  compare("power", field("power", &J::is_number, "a number").get<double>(), options_.power);
  compare("lr_end", field("lr_end", &J::is_number, "a number").get<double>(), options_.lr_end);
  compare("step_rules", field("step_rules", &J::is_string, "a string").get<std::string>(),
          options_.step_rules);

  apply(last_epoch, std::move(base_lrs));
  if (!changed.empty()) {
    std::string list;
    for (const auto& c : changed) list += list.empty() ? c : ", " + c;
    log::warn(
        "LR scheduler '{}' resumed with options that differ from its checkpoint ({}); "
        "continuing with the current ones",
        options_.name, list);
  }
}

// ------------------------------------------------------------------ --scale_lr

double scale_lr(double lr, int64_t gradient_accumulation_steps, int64_t per_device_batch_size,
                int64_t num_processes) {
  if (!(std::isfinite(lr) && lr >= 0)) {
    throw Error(fmt::format("scale_lr: learning rate {} is not a finite number >= 0", lr));
  }
  const std::pair<const char*, int64_t> counts[] = {
      {"gradient_accumulation_steps", gradient_accumulation_steps},
      {"per_device_batch_size", per_device_batch_size},
      {"num_processes", num_processes}};
  for (const auto& [name, value] : counts) {
    if (value < 1) {
      throw Error(fmt::format("scale_lr: {} is {} but must be >= 1; fix the run configuration",
                              name, value));
    }
  }
  // Diffusers: learning_rate * gradient_accumulation_steps * train_batch_size * num_processes.
  return lr * static_cast<double>(gradient_accumulation_steps) *
         static_cast<double>(per_device_batch_size) * static_cast<double>(num_processes);
}

}  // namespace difftrain::optim
