// LR schedules: every schedule against a dump of Diffusers' get_scheduler (tests/golden), hand-
// computed edge values, several param groups, resume through state_dict, and every error path.

#include "difftrain/optim/lr_schedule.h"
#include "difftrain/core/error.h"
#include "source_dir.h"

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace difftrain::optim {

// GoogleTest prints a failing parameter by its name (found by ADL, so outside the anonymous
// namespace).
void PrintTo(ScheduleType type, std::ostream* os) { *os << to_string(type); }

namespace {

using nlohmann::json;

// Relative tolerance against the Diffusers dump. The schedules repeat Diffusers' double-precision
// operations in the same order, so the expected difference is 0 (the dump's decimal text round
// trips to the same doubles); 1e-9 leaves room for a libm whose cos/pow differ in the last ulp,
// while any formula slip (an off-by-one step, a wrong warmup divisor) is 1e-3 or more.
constexpr double kRelTol = 1e-9;

constexpr ScheduleType kAllTypes[] = {
    ScheduleType::kLinear,           ScheduleType::kCosine,   ScheduleType::kCosineWithRestarts,
    ScheduleType::kPolynomial,       ScheduleType::kConstant, ScheduleType::kConstantWithWarmup,
    ScheduleType::kPiecewiseConstant};

const json& golden() {
  static const json data = [] {
    const std::string path =
        std::string(difftrain_test::source_dir()) + "/tests/golden/lr_schedules.json";
    std::ifstream file(path);
    if (!file) throw std::runtime_error("cannot open golden file " + path);
    return json::parse(file);
  }();
  return data;
}

// get_scheduler's arguments for `name` as the golden file was made: its warmup / training steps
// and the schedule's own kwargs.
LRScheduleOptions golden_options(const std::string& name) {
  const json& g = golden();
  LRScheduleOptions o;
  o.name = name;
  o.num_warmup_steps = g.at("num_warmup_steps").get<int64_t>();
  o.num_training_steps = g.at("num_training_steps").get<int64_t>();
  for (const auto& [key, value] : g.at("schedules").at(name).at("kwargs").items()) {
    if (key == "num_cycles") {
      o.num_cycles = value.get<double>();
    } else if (key == "power") {
      o.power = value.get<double>();
    } else if (key == "lr_end") {
      o.lr_end = value.get<double>();
    } else if (key == "step_rules") {
      o.step_rules = value.get<std::string>();
    } else {
      throw std::runtime_error("golden kwarg '" + key + "' of " + name + " is not understood");
    }
  }
  return o;
}

double rel_diff(double a, double b) {
  if (a == b) return 0;
  return std::abs(a - b) / std::max(std::abs(a), std::abs(b));
}

double group_lr(const torch::optim::Optimizer& optimizer, size_t g) {
  return optimizer.param_groups().at(g).options().get_lr();
}

torch::Tensor make_param(int64_t n, double value) {
  return torch::full({n}, value, torch::dtype(torch::kFloat64)).requires_grad_();
}

// One real SGD update on loss = sum(w^2) over every parameter (gradient 2w).
void train_step(torch::optim::Optimizer& optimizer, const std::vector<torch::Tensor>& params) {
  optimizer.zero_grad();
  torch::Tensor loss = torch::zeros({}, torch::dtype(torch::kFloat64));
  for (const auto& p : params) loss = loss + (p * p).sum();
  loss.backward();
  optimizer.step();
}

// SGD over two parameters in two groups with lrs `lr0` and `lr1`, and default lr `default_lr`
// (what polynomial reads as the initial lr, like Diffusers' optimizer.defaults["lr"]).
struct TwoGroups {
  TwoGroups(double lr0, double lr1, double default_lr = 1e-3)
      : w0(make_param(3, 1.0)), w1(make_param(2, 0.5)) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<torch::Tensor>{w0},
                        std::make_unique<torch::optim::SGDOptions>(lr0));
    groups.emplace_back(std::vector<torch::Tensor>{w1},
                        std::make_unique<torch::optim::SGDOptions>(lr1));
    sgd = std::make_unique<torch::optim::SGD>(groups, torch::optim::SGDOptions(default_lr));
  }
  void step() { train_step(*sgd, {w0, w1}); }
  torch::Tensor w0, w1;
  std::unique_ptr<torch::optim::SGD> sgd;
};

// The difftrain::Error message `f` throws; a test failure if it throws nothing. Any other
// exception type escapes and fails the test.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << "not one line: " << message;
    return message;
  }
  ADD_FAILURE() << "expected a difftrain::Error";
  return "";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// ------------------------------------------------------------------ against Diffusers

class LRScheduleGolden : public ::testing::TestWithParam<ScheduleType> {};

// The LR before each of 101 steps of a real SGD run equals Diffusers' get_scheduler(name,
// warmup 10, training 100, lr 1e-3) — reaching past num_training_steps by one step.
TEST_P(LRScheduleGolden, MatchesDiffusersGetScheduler) {
  const std::string name = to_string(GetParam());
  const json& g = golden();
  ASSERT_TRUE(g.at("schedules").contains(name)) << "golden file has no schedule " << name;
  const json& expected = g.at("schedules").at(name).at("lr");
  ASSERT_EQ(expected.size(), 101u);
  const double base_lr = g.at("base_lr").get<double>();

  torch::Tensor w = make_param(4, 1.0);
  torch::optim::SGD sgd({w}, torch::optim::SGDOptions(base_lr));
  LRScheduler sched(sgd, golden_options(name));

  double max_rel = 0;
  size_t worst = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const double lr = group_lr(sgd, 0);
    const double want = expected[i].get<double>();
    ASSERT_EQ(sched.last_epoch(), static_cast<int64_t>(i));
    ASSERT_EQ(sched.get_last_lr(), std::vector<double>{lr});
    const double rel = rel_diff(lr, want);
    EXPECT_LE(rel, kRelTol) << name << " step " << i << ": lr " << lr << ", Diffusers " << want;
    if (rel > max_rel) {
      max_rel = rel;
      worst = i;
    }
    train_step(sgd, {w});
    sched.step();
  }
  if (max_rel == 0) {
    std::printf("%s: max rel diff 0 (bit-exact) over 101 steps, tolerance %.0e\n", name.c_str(),
                kRelTol);
  } else {
    std::printf("%s: max rel diff %.3g (at step %zu) over 101 steps, tolerance %.0e\n",
                name.c_str(), max_rel, worst, kRelTol);
  }
}

INSTANTIATE_TEST_SUITE_P(LRSchedule, LRScheduleGolden, ::testing::ValuesIn(kAllTypes),
                         [](const ::testing::TestParamInfo<ScheduleType>& info) {
                           return to_string(info.param);
                         });

// Every schedule of the golden file is one we test, and the reverse (the parametrized test above
// covers our side): a schedule added to the dump cannot go unchecked.
TEST(LRSchedule, GoldenFileHoldsExactlyTheSevenSchedules) {
  std::vector<std::string> ours;
  for (ScheduleType t : kAllTypes) ours.push_back(to_string(t));
  std::vector<std::string> theirs;
  for (const auto& [name, value] : golden().at("schedules").items()) theirs.push_back(name);
  std::sort(ours.begin(), ours.end());
  std::sort(theirs.begin(), theirs.end());
  EXPECT_EQ(ours, theirs);
}

// Diffusers' multipliers where the warm-up is longer than the run, equal to it, or the run has 0
// steps (tests/golden/lr_schedule_edges.json, made by make_lr_schedule_edges.py with lr 1e-3,
// num_cycles 2, power 2, step_rules "1:2,0.5"). These settings were refused before; a short
// smoke run with the default 100 warm-up steps depends on them. null marks Diffusers' one
// undefined point (polynomial at step T == W), checked against the limit in the test below.
TEST(LRSchedule, WarmupLongerThanTheRunMatchesDiffusers) {
  const std::string path =
      std::string(difftrain_test::source_dir()) + "/tests/golden/lr_schedule_edges.json";
  std::ifstream file(path);
  ASSERT_TRUE(file) << path;
  const json edges = json::parse(file);
  int checked = 0;
  double worst = 0;
  for (const auto& [key, values] : edges.items()) {
    std::istringstream fields(key);
    LRScheduleOptions o;
    fields >> o.name >> o.num_warmup_steps >> o.num_training_steps;
    if (o.name == "cosine_with_restarts") o.num_cycles = 2;
    if (o.name == "polynomial") o.power = 2;
    if (o.name == "piecewise_constant") o.step_rules = "1:2,0.5";
    if (values.is_string()) {  // get_scheduler itself raised (polynomial with T == W == 0)
      EXPECT_EQ(key, "polynomial 0 0") << values;
      continue;
    }
    const auto lambda = make_lr_lambda(o, 1e-3);
    for (size_t step = 0; step < values.size(); ++step) {
      if (values[step].is_null()) continue;
      const double diff = rel_diff(lambda(static_cast<int64_t>(step)), values[step].get<double>());
      worst = std::max(worst, diff);
      EXPECT_LE(diff, kRelTol) << key << " at step " << step;
      ++checked;
    }
  }
  std::printf("LR schedule edges: %d values, max rel diff %g (tol %g)\n", checked, worst, kRelTol);
  EXPECT_GE(checked, 7 * 4 * 12);
}

// ------------------------------------------------------------------ hand-computed values

struct Case {
  int64_t step;
  double multiplier;
};

void expect_lambda(const LRScheduleOptions& o, double initial_lr, const std::vector<Case>& cases) {
  const auto lambda = make_lr_lambda(o, initial_lr);
  for (const Case& c : cases) {
    EXPECT_NEAR(lambda(c.step), c.multiplier, 1e-15)
        << o.name << " (W " << o.num_warmup_steps << ", T " << o.num_training_steps << ", rules '"
        << o.step_rules << "') at step " << c.step;
  }
}

LRScheduleOptions opts(const std::string& name, int64_t warmup, int64_t total) {
  LRScheduleOptions o;
  o.name = name;
  o.num_warmup_steps = warmup;
  o.num_training_steps = total;
  return o;
}

// Values worked out by hand from Diffusers' formulas for settings the golden file does not use:
// no warmup, T == W, non-integer cycles, lr_end and power other than the defaults, unsorted and
// spaced step rules, and steps past num_training_steps.
TEST(LRSchedule, HandComputedEdgeValues) {
  expect_lambda(opts("constant", 5, -1), 1e-3, {{0, 1.0}, {7, 1.0}});
  expect_lambda(opts("constant_with_warmup", 0, -1), 1e-3, {{0, 1.0}, {3, 1.0}});
  expect_lambda(opts("constant_with_warmup", 4, -1), 1e-3, {{0, 0.0}, {2, 0.5}, {4, 1.0}});

  expect_lambda(opts("linear", 0, 4), 1e-3,
                {{0, 1.0}, {1, 0.75}, {2, 0.5}, {3, 0.25}, {4, 0.0}, {5, 0.0}});
  expect_lambda(opts("linear", 0, 0), 1e-3, {{0, 0.0}, {1, 0.0}});
  expect_lambda(opts("linear", 3, 3), 1e-3, {{0, 0.0}, {1, 1.0 / 3}, {3, 0.0}});

  // Diffusers' cosine does not clamp progress: past T it climbs again (step 8: cos(1.5 pi) = 0).
  expect_lambda(opts("cosine", 2, 6), 1e-3,
                {{0, 0.0}, {1, 0.5}, {2, 1.0}, {4, 0.5}, {6, 0.0}, {8, 0.5}});

  LRScheduleOptions restarts = opts("cosine_with_restarts", 0, 4);
  restarts.num_cycles = 2;
  expect_lambda(restarts, 1e-3, {{0, 1.0}, {1, 0.5}, {2, 1.0}, {3, 0.5}, {4, 0.0}, {9, 0.0}});
  restarts.num_cycles = 1.5;  // progress 0.5 -> 0.75 of a cycle; 0.75 -> 1.125, i.e. 0.125
  expect_lambda(restarts, 1e-3, {{2, 0.14644660940672624}, {3, 0.9619397662556434}});

  LRScheduleOptions poly = opts("polynomial", 0, 4);
  poly.lr_end = 0.0;
  poly.power = 0.5;
  expect_lambda(poly, 1.0, {{0, 1.0}, {1, 0.8660254037844386}, {4, 0.0}, {5, 0.0}});
  poly = opts("polynomial", 2, 6);
  poly.lr_end = 0.1;
  // lr 2: multipliers of 2, e.g. step 4 is (1.9 * 0.5 + 0.1) / 2, past T it is lr_end / lr.
  expect_lambda(poly, 2.0, {{1, 0.5}, {2, 1.0}, {4, 0.525}, {6, 0.05}, {7, 0.05}});

  LRScheduleOptions piecewise = opts("piecewise_constant", 5, -1);  // warmup is ignored
  piecewise.step_rules = "0.5:3,2:1,0.25";
  expect_lambda(piecewise, 1e-3, {{0, 2.0}, {1, 0.5}, {2, 0.5}, {3, 0.25}, {100, 0.25}});
  piecewise.step_rules = " 1 : 10 , 0.1:20 , +0.01 ";  // Python's float()/int() strip spaces
  expect_lambda(piecewise, 1e-3, {{9, 1.0}, {10, 0.1}, {19, 0.1}, {20, 0.01}});
  piecewise.step_rules = "0.5";
  expect_lambda(piecewise, 1e-3, {{0, 0.5}, {50, 0.5}});
  piecewise.step_rules = "1:10,2:10,0.5";  // a repeated step keeps its last multiplier
  expect_lambda(piecewise, 1e-3, {{5, 2.0}, {10, 0.5}});
}

// ------------------------------------------------------------------ the scheduler

// Each group follows its own base lr times the same multiplier (Diffusers' linear, from the
// golden file), and SGD's update really uses the scheduled lr.
TEST(LRSchedule, ParamGroupsScaleIndependently) {
  const json& g = golden();
  const double golden_base = g.at("base_lr").get<double>();
  const json& linear = g.at("schedules").at("linear").at("lr");
  const double lr0 = golden_base;
  const double lr1 = 0.05;

  TwoGroups model(lr0, lr1);
  LRScheduler sched(*model.sgd, golden_options("linear"));
  EXPECT_EQ(sched.base_lrs(), (std::vector<double>{lr0, lr1}));
  double max_rel = 0;
  for (size_t i = 0; i < linear.size(); ++i) {
    const double multiplier = linear[i].get<double>() / golden_base;
    const std::vector<double> last = sched.get_last_lr();
    ASSERT_EQ(last.size(), 2u);
    EXPECT_EQ(last[0], group_lr(*model.sgd, 0));
    EXPECT_EQ(last[1], group_lr(*model.sgd, 1));
    for (size_t k = 0; k < 2; ++k) {
      const double want = (k == 0 ? lr0 : lr1) * multiplier;
      const double rel = rel_diff(last[k], want);
      EXPECT_LE(rel, kRelTol) << "group " << k << " step " << i;
      max_rel = std::max(max_rel, rel);
    }
    // loss = sum(w^2): SGD sets w <- w - lr * 2w = w * (1 - 2 lr), with each group's own lr.
    const torch::Tensor w0 = model.w0.detach().clone();
    const torch::Tensor w1 = model.w1.detach().clone();
    model.step();
    EXPECT_TRUE(torch::allclose(model.w0, w0 * (1 - 2 * last[0]), 1e-12, 0)) << "step " << i;
    EXPECT_TRUE(torch::allclose(model.w1, w1 * (1 - 2 * last[1]), 1e-12, 0)) << "step " << i;
    sched.step();
  }
  std::printf("two groups: max rel diff %.3g against the golden multipliers, tolerance %.0e\n",
              max_rel, kRelTol);
}

// Save after 37 steps, load into a fresh optimizer + scheduler, continue: every lr of every group
// equals the uninterrupted run's bit for bit, for every schedule.
TEST(LRSchedule, ResumeMidRunEqualsAnUninterruptedRun) {
  constexpr size_t kSteps = 101;
  constexpr int64_t kSaveAt = 37;
  for (ScheduleType type : kAllTypes) {
    const std::string name = to_string(type);
    SCOPED_TRACE(name);
    const LRScheduleOptions o = golden_options(name);

    std::vector<std::vector<double>> uninterrupted;
    {
      TwoGroups model(1e-3, 0.05);
      LRScheduler sched(*model.sgd, o);
      for (size_t i = 0; i < kSteps; ++i) {
        uninterrupted.push_back({group_lr(*model.sgd, 0), group_lr(*model.sgd, 1)});
        model.step();
        sched.step();
      }
    }

    json saved;
    {
      TwoGroups model(1e-3, 0.05);
      LRScheduler sched(*model.sgd, o);
      for (int64_t i = 0; i < kSaveAt; ++i) {
        model.step();
        sched.step();
      }
      saved = json::parse(sched.state_dict().dump());  // through text, as a checkpoint file
    }
    EXPECT_EQ(saved.at("last_epoch"), kSaveAt);
    EXPECT_EQ(saved.at("base_lrs"), json::array({1e-3, 0.05}));
    EXPECT_EQ(saved.at("schedule").at("name"), name);
    EXPECT_EQ(saved.at("schedule").at("num_warmup_steps"), o.num_warmup_steps);
    EXPECT_EQ(saved.at("schedule").at("num_training_steps"), o.num_training_steps);
    EXPECT_EQ(saved.at("schedule").at("num_cycles"), o.num_cycles);
    EXPECT_EQ(saved.at("schedule").at("power"), o.power);
    EXPECT_EQ(saved.at("schedule").at("lr_end"), o.lr_end);
    EXPECT_EQ(saved.at("schedule").at("step_rules"), o.step_rules);

    // The resumed optimizer's groups start from other lrs (as one restored from a checkpoint
    // would hold the scheduled ones): the base lrs must come from the state, not from the
    // optimizer. Its default lr is the run's --learning_rate again, as in a real resume.
    TwoGroups model(0.3, 0.7, 1e-3);
    LRScheduler sched(*model.sgd, o);
    sched.load_state_dict(saved);
    EXPECT_EQ(sched.last_epoch(), kSaveAt);
    EXPECT_EQ(sched.base_lrs(), (std::vector<double>{1e-3, 0.05}));
    for (size_t i = kSaveAt; i < kSteps; ++i) {
      const std::vector<double> lrs{group_lr(*model.sgd, 0), group_lr(*model.sgd, 1)};
      ASSERT_EQ(lrs, uninterrupted[i]) << "step " << i;
      ASSERT_EQ(sched.get_last_lr(), uninterrupted[i]) << "step " << i;
      model.step();
      sched.step();
    }
  }
}

TEST(LRSchedule, LoadStateDictRefusesForeignOrMalformedStates) {
  TwoGroups model(1e-3, 0.05);
  LRScheduler sched(*model.sgd, golden_options("linear"));
  for (int i = 0; i < 12; ++i) sched.step();
  const json good = sched.state_dict();
  const std::vector<double> lrs_before = sched.get_last_lr();

  struct Bad {
    const char* what;
    std::function<void(json&)> edit;
    const char* field;  // the message must name it
  };
  const std::vector<Bad> bad = {
      {"other schedule", [](json& s) { s["schedule"]["name"] = "cosine"; }, "schedule.name"},
      {"one group fewer", [](json& s) { s["base_lrs"] = json::array({1e-3}); }, "base_lrs"},
      {"one group more", [](json& s) { s["base_lrs"].push_back(1e-4); }, "base_lrs"},
      {"no last_epoch", [](json& s) { s.erase("last_epoch"); }, "last_epoch"},
      {"negative last_epoch", [](json& s) { s["last_epoch"] = -1; }, "last_epoch"},
      {"text last_epoch", [](json& s) { s["last_epoch"] = "12"; }, "last_epoch"},
      {"float last_epoch", [](json& s) { s["last_epoch"] = 12.5; }, "last_epoch"},
      {"no base_lrs", [](json& s) { s.erase("base_lrs"); }, "base_lrs"},
      {"text base lr", [](json& s) { s["base_lrs"][1] = "0.05"; }, "base_lrs"},
      {"no schedule", [](json& s) { s.erase("schedule"); }, "schedule"},
      {"no name", [](json& s) { s["schedule"].erase("name"); }, "schedule.name"},
      {"text power", [](json& s) { s["schedule"]["power"] = "2"; }, "schedule.power"},
      {"not an object",
       [](json& s) {
         s = json::array({1, 2});
       },
       "(root)"},
  };
  for (const Bad& b : bad) {
    json state = good;
    b.edit(state);
    const std::string message = error_of([&] { sched.load_state_dict(state); });
    EXPECT_TRUE(contains(message, std::string("'") + b.field + "'"))
        << b.what << ": '" << message << "' does not name " << b.field;
    // A refused state changes nothing.
    EXPECT_EQ(sched.last_epoch(), 12) << b.what;
    EXPECT_EQ(sched.get_last_lr(), lrs_before) << b.what;
    EXPECT_EQ(group_lr(*model.sgd, 1), lrs_before[1]) << b.what;
  }

  // Other options may change between runs (e.g. training longer): accepted, the current ones hold.
  json longer = good;
  longer["schedule"]["num_training_steps"] = 50;
  longer["last_epoch"] = 40;
  sched.load_state_dict(longer);
  EXPECT_EQ(sched.last_epoch(), 40);
  // Current T = 100, W = 10: (100 - 40) / 90, not the saved T's (50 - 40) / 40.
  EXPECT_NEAR(group_lr(*model.sgd, 1), 0.05 * 60.0 / 90.0, 1e-15);
}

// Adding a param group after the scheduler was built is refused at the next step, not ignored.
TEST(LRSchedule, StepRefusesAChangedNumberOfParamGroups) {
  torch::Tensor w = make_param(2, 1.0);
  torch::optim::SGD sgd({w}, torch::optim::SGDOptions(1e-3));
  LRScheduler sched(sgd, golden_options("linear"));
  sched.step();
  sgd.add_param_group(
      torch::optim::OptimizerParamGroup(std::vector<torch::Tensor>{make_param(2, 1.0)}));
  const std::string message = error_of([&] { sched.step(); });
  EXPECT_TRUE(contains(message, "2 param group")) << message;
  EXPECT_EQ(sched.last_epoch(), 1);
}

TEST(LRSchedule, ScaleLrMultipliesAccumulationBatchAndProcesses) {
  EXPECT_DOUBLE_EQ(scale_lr(1e-4, 4, 8, 2), 6.4e-3);
  EXPECT_DOUBLE_EQ(scale_lr(1e-4, 3, 5, 7), 1.05e-2);
  EXPECT_EQ(scale_lr(2e-5, 1, 1, 1), 2e-5);
  EXPECT_TRUE(contains(error_of([] { scale_lr(1e-4, 0, 8, 2); }), "gradient_accumulation_steps"));
  EXPECT_TRUE(contains(error_of([] { scale_lr(1e-4, 1, -2, 2); }), "per_device_batch_size is -2"));
  EXPECT_TRUE(contains(error_of([] { scale_lr(1e-4, 1, 8, 0); }), "num_processes is 0"));
  EXPECT_TRUE(contains(error_of([] { scale_lr(-1e-4, 1, 8, 2); }), "-0.0001"));
  EXPECT_TRUE(contains(error_of([] { scale_lr(std::nan(""), 1, 8, 2); }), "nan"));
}

// ------------------------------------------------------------------ names and errors

TEST(LRSchedule, NamesRoundTripAndUnknownNamesListTheChoices) {
  const std::vector<std::string> names = {"linear",
                                          "cosine",
                                          "cosine_with_restarts",
                                          "polynomial",
                                          "constant",
                                          "constant_with_warmup",
                                          "piecewise_constant"};
  for (const std::string& name : names) EXPECT_EQ(to_string(parse_schedule_type(name)), name);
  for (ScheduleType t : kAllTypes) EXPECT_EQ(parse_schedule_type(to_string(t)), t);

  for (const std::string bad : {"cosine_restarts", "Linear", "", "linear "}) {
    const std::string message = error_of([&] { parse_schedule_type(bad); });
    EXPECT_TRUE(contains(message, "'" + bad + "'")) << message;
    for (const std::string& name : names) {
      EXPECT_TRUE(contains(message, name)) << "'" << message << "' does not list " << name;
    }
  }
  // Also through the scheduler.
  torch::Tensor w = make_param(2, 1.0);
  torch::optim::SGD sgd({w}, torch::optim::SGDOptions(1e-3));
  EXPECT_TRUE(contains(error_of([&] {
                         LRScheduler{sgd, opts("warmup_cosine", 0, 10)};
                       }),
                       "'warmup_cosine'"));
}

TEST(LRSchedule, MissingOrInconsistentStepCountsAreErrors) {
  for (const std::string name : {"linear", "cosine", "cosine_with_restarts", "polynomial"}) {
    const std::string message = error_of([&] { make_lr_lambda(opts(name, 0, -1), 1e-3); });
    EXPECT_TRUE(contains(message, "'" + name + "'") && contains(message, "num_training_steps"))
        << message;
    // A warm-up longer than the run is accepted, as get_scheduler accepts it.
    EXPECT_NO_THROW(make_lr_lambda(opts(name, 20, 10), 1e-3));
  }
  // The schedules Diffusers builds without num_training_steps need none.
  EXPECT_NO_THROW(make_lr_lambda(opts("constant", 0, -1), 1e-3));
  EXPECT_NO_THROW(make_lr_lambda(opts("constant_with_warmup", 500, -1), 1e-3));
  LRScheduleOptions piecewise = opts("piecewise_constant", 0, -1);
  piecewise.step_rules = "1:10,0.5";
  EXPECT_NO_THROW(make_lr_lambda(piecewise, 1e-3));

  for (const std::string name : {"linear", "constant_with_warmup", "constant"}) {
    const std::string message = error_of([&] { make_lr_lambda(opts(name, -3, 100), 1e-3); });
    EXPECT_TRUE(contains(message, "num_warmup_steps -3")) << message;
  }

  // The scheduler validates at construction, before touching the optimizer's lr.
  torch::Tensor w = make_param(2, 1.0);
  torch::optim::SGD sgd({w}, torch::optim::SGDOptions(1e-3));
  EXPECT_TRUE(contains(error_of([&] { LRScheduler{sgd, opts("cosine", 10, -1)}; }), "'cosine'"));
  EXPECT_EQ(group_lr(sgd, 0), 1e-3);
}

TEST(LRSchedule, PolynomialRefusesLrEndAtOrAboveTheLrAndBadShapes) {
  LRScheduleOptions o = opts("polynomial", 10, 100);
  o.lr_end = 1e-3;
  EXPECT_TRUE(contains(error_of([&] { make_lr_lambda(o, 1e-3); }), "lr_end (0.001)"));
  o.lr_end = 1e-2;
  EXPECT_TRUE(contains(error_of([&] { make_lr_lambda(o, 1e-3); }), "lr_end (0.01)"));
  // The scheduler checks against the optimizer's default lr, as Diffusers' optimizer.defaults.
  torch::Tensor w = make_param(2, 1.0);
  torch::optim::SGD sgd({w}, torch::optim::SGDOptions(5e-3));
  EXPECT_TRUE(contains(error_of([&] { LRScheduler{sgd, o}; }), "initial lr (0.005)"));
  o.lr_end = 1e-7;
  EXPECT_NO_THROW((LRScheduler{sgd, o}));

  o = opts("polynomial", 10, 10);  // Diffusers divides by zero at step 10: the limit, lr_end / lr
  EXPECT_EQ(make_lr_lambda(o, 1e-3)(10), 1e-7 / 1e-3);
  EXPECT_EQ(make_lr_lambda(opts("polynomial", 0, 0), 1e-3)(0), 1e-7 / 1e-3);
  o = opts("polynomial", 0, 10);
  o.power = -1;
  EXPECT_TRUE(contains(error_of([&] { make_lr_lambda(o, 1e-3); }), "power -1"));
  o.power = 1;
  o.lr_end = -1e-7;
  EXPECT_TRUE(contains(error_of([&] { make_lr_lambda(o, 1e-3); }), "lr_end -1e-07"));

  LRScheduleOptions restarts = opts("cosine_with_restarts", 0, 10);
  restarts.num_cycles = -2;
  EXPECT_TRUE(contains(error_of([&] { make_lr_lambda(restarts, 1e-3); }), "num_cycles -2"));
  restarts.num_cycles = std::nan("");
  EXPECT_TRUE(contains(error_of([&] { make_lr_lambda(restarts, 1e-3); }), "num_cycles nan"));
}

TEST(LRSchedule, BadStepRulesShowTheExpectedForm) {
  const std::vector<std::string> bad = {
      "",             // empty (also the default of LRScheduleOptions)
      "   ",          // blank
      "1:10,0.1:20",  // no final multiplier
      "1:10,",        // empty final multiplier
      "1-10,0.5",     // a rule without ':'
      "1:10:20,0.5",  // two ':'
      "a:10,0.5",     // non-numeric multiplier
      "1:x,0.5",      // non-numeric step
      "1:10.5,0.5",   // non-integer step (Python's int() refuses it too)
      "1:-5,0.5",     // negative step
      "-1:5,0.5",     // negative multiplier
      "1:10,nan",     // non-finite multiplier
      "1:10,,0.5",    // empty rule
  };
  for (const std::string& rules : bad) {
    LRScheduleOptions o = opts("piecewise_constant", 0, -1);
    o.step_rules = rules;
    const std::string message = error_of([&] { make_lr_lambda(o, 1e-3); });
    EXPECT_TRUE(contains(message, "1:10,0.1:20,0.01:30,0.005")) << message;
    EXPECT_TRUE(contains(message, "'" + rules + "'")) << message;
  }
}

}  // namespace
}  // namespace difftrain::optim
