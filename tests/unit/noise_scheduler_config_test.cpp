// scheduler_config.json: reading Diffusers' files, the defaults of missing fields, writing them
// back, and one-line errors for unknown names, wrong types, broken files and unknown kinds.

#include "difftrain/core/error.h"
#include "difftrain/diffusion/noise_scheduler.h"
#include "test_util.h"

#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace difftrain::diffusion::config_tests {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// test::error_of, and the message must be one line.
template <typename F>
std::string one_line_error(F&& f) {
  const std::string message = test::error_of(std::forward<F>(f));
  EXPECT_EQ(message.find('\n'), std::string::npos) << "not one line: " << message;
  return message;
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(NoiseSchedulerConfig, ReadsAndRewritesDiffusersSchedulerConfigJson) {
  const std::string path = test::kDiffusersGolden + "unet2d_uncond/scheduler_config.json";
  const SchedulerConfig c = SchedulerConfig::load(path);
  EXPECT_EQ(c.class_name, "DDIMScheduler");
  EXPECT_EQ(c.num_train_timesteps, 1000);
  EXPECT_EQ(c.beta_start, 0.0001);
  EXPECT_EQ(c.beta_end, 0.02);
  EXPECT_EQ(c.beta_schedule, BetaSchedule::kLinear);
  EXPECT_FALSE(c.trained_betas.has_value());
  EXPECT_TRUE(c.clip_sample);
  EXPECT_EQ(c.prediction_type, PredictionType::kEpsilon);
  EXPECT_EQ(c.timestep_spacing, TimestepSpacing::kLeading);
  EXPECT_TRUE(c.set_alpha_to_one);
  EXPECT_TRUE(c.extra.empty());

  // Written back, it is the file Diffusers wrote, key for key and value for value.
  std::ifstream in(path);
  const json file = json::parse(in);
  EXPECT_EQ(c.to_json(), file) << c.to_json().dump(2);

  // The factory follows _class_name; an explicit kind overrides it and renames the class.
  const auto ddim = make_scheduler(c);
  EXPECT_EQ(ddim->class_name(), "DDIMScheduler");
  EXPECT_NE(dynamic_cast<DDIMScheduler*>(ddim.get()), nullptr);
  const auto ddpm = make_scheduler(c, "ddpm");
  EXPECT_NE(dynamic_cast<DDPMScheduler*>(ddpm.get()), nullptr);
  EXPECT_EQ(ddpm->config().class_name, "DDPMScheduler");
  EXPECT_TRUE(ddpm->config().to_json().contains("variance_type"));
  EXPECT_FALSE(ddpm->config().to_json().contains("set_alpha_to_one"));
}

TEST(NoiseSchedulerConfig, MissingFieldsTakeDiffusersDefaults) {
  const SchedulerConfig c = SchedulerConfig::from_json(json::object(), "empty.json");
  SchedulerConfig expected;
  expected.class_name = "";
  EXPECT_TRUE(c == expected);
  EXPECT_EQ(c.num_train_timesteps, 1000);
  EXPECT_EQ(c.variance_type, VarianceType::kFixedSmall);
  EXPECT_EQ(c.dynamic_thresholding_ratio, 0.995);
  EXPECT_EQ(c.steps_offset, 0);
  EXPECT_FALSE(c.rescale_betas_zero_snr);
  // trained_betas null is "not given"; unknown keys are kept, '_' keys are not.
  const SchedulerConfig pndm =
      SchedulerConfig::from_json(json{{"_class_name", "PNDMScheduler"},
                                      {"trained_betas", nullptr},
                                      {"skip_prk_steps", true},
                                      {"_use_default_values", json::array({"a"})}},
                                 "pndm.json");
  EXPECT_FALSE(pndm.trained_betas.has_value());
  EXPECT_EQ(pndm.extra, (json{{"skip_prk_steps", true}}));
  EXPECT_EQ(pndm.to_json().at("skip_prk_steps"), true);
}

TEST(NoiseSchedulerConfig, RoundTripsThroughJsonAndFiles) {
  SchedulerConfig c;
  c.num_train_timesteps = 5;
  c.beta_start = 0.00085;
  c.beta_end = 0.012;
  c.beta_schedule = BetaSchedule::kScaledLinear;
  c.trained_betas = std::vector<double>{0.001, 0.002, 0.0035, 0.01, 0.2};
  c.clip_sample = false;
  c.clip_sample_range = 2.5;
  c.prediction_type = PredictionType::kVPrediction;
  c.thresholding = true;
  c.dynamic_thresholding_ratio = 0.9;
  c.sample_max_value = 1.7;
  c.timestep_spacing = TimestepSpacing::kTrailing;
  c.steps_offset = 1;
  c.rescale_betas_zero_snr = true;
  c.extra = json{{"skip_prk_steps", true}};
  const std::string dir = test::temp_dir("sched_config");
  for (const std::string cls : {"DDPMScheduler", "DDIMScheduler", "PNDMScheduler"}) {
    SchedulerConfig x = c;
    x.class_name = cls;
    // Fields the class does not write come back as defaults.
    x.variance_type =
        cls == "DDIMScheduler" ? VarianceType::kFixedSmall : VarianceType::kFixedSmallLog;
    x.set_alpha_to_one = cls != "DDPMScheduler" ? false : true;
    const json j = x.to_json();
    EXPECT_EQ(j.at("_diffusers_version"), "0.31.0");
    EXPECT_EQ(j.at("_class_name"), cls);
    EXPECT_TRUE(SchedulerConfig::from_json(j, "memory") == x) << cls << ": " << j.dump();
    const std::string path = dir + "/" + cls + ".json";
    x.save(path);
    EXPECT_TRUE(SchedulerConfig::load(path) == x) << cls;
  }
  fs::remove_all(dir);
}

TEST(NoiseSchedulerConfig, UnknownNamesAndWrongTypesAreOneLineErrors) {
  const std::string src = "model/scheduler/scheduler_config.json";
  struct Bad {
    std::string field;
    json value;
    std::vector<std::string> must_contain;
  };
  const std::vector<Bad> bad = {
      {"beta_schedule",
       "cosine",
       {"beta_schedule", "'cosine'", "linear", "scaled_linear", "squaredcos_cap_v2", "sigmoid"}},
      {"prediction_type",
       "v-prediction",
       {"prediction_type", "'v-prediction'", "epsilon", "v_prediction", "sample"}},
      {"variance_type",
       "fixed",
       {"variance_type", "'fixed'", "fixed_small", "fixed_small_log", "fixed_large",
        "learned_range"}},
      {"timestep_spacing",
       "Leading",
       {"timestep_spacing", "'Leading'", "leading", "trailing", "linspace"}},
      {"num_train_timesteps", "1000", {"num_train_timesteps", "an integer", "\"1000\""}},
      {"num_train_timesteps", 1000.5, {"num_train_timesteps", "an integer"}},
      {"steps_offset", nullptr, {"steps_offset", "an integer", "null"}},
      {"beta_start", "0.0001", {"beta_start", "a number"}},
      {"clip_sample", 1, {"clip_sample", "true or false"}},
      {"beta_schedule", 3, {"beta_schedule", "a string"}},
      {"trained_betas", "none", {"trained_betas", "a list of numbers or null"}},
      {"trained_betas", json::array({0.1, "x"}), {"trained_betas[1]", "a number"}},
      {"_class_name", 7, {"_class_name", "a string"}},
      {"num_train_timesteps", 0, {"num_train_timesteps is 0", "at least 1"}},
      {"steps_offset", -1, {"steps_offset is -1"}},
      {"beta_end", 1.5, {"beta_end is 1.5", "[0, 1)"}},
      {"dynamic_thresholding_ratio", 1.5, {"dynamic_thresholding_ratio is 1.5", "(0, 1]"}},
      {"clip_sample_range", 0, {"clip_sample_range is 0"}},
      {"sample_max_value", -1, {"sample_max_value is -1"}},
  };
  for (const Bad& b : bad) {
    json j = json::parse(R"({"_class_name": "DDPMScheduler", "num_train_timesteps": 1000})");
    j[b.field] = b.value;
    const std::string message = one_line_error([&] { SchedulerConfig::from_json(j, src); });
    EXPECT_TRUE(has(message, src)) << message;
    for (const std::string& part : b.must_contain) {
      EXPECT_TRUE(has(message, part)) << b.field << ": '" << message << "' lacks " << part;
    }
  }
  // trained_betas of the wrong length.
  json j = {{"num_train_timesteps", 3}, {"trained_betas", {0.1, 0.2}}};
  EXPECT_TRUE(has(one_line_error([&] { SchedulerConfig::from_json(j, src); }),
                  "trained_betas has 2 values but num_train_timesteps is 3"));
  // Not an object.
  EXPECT_TRUE(has(one_line_error([&] { SchedulerConfig::from_json(json::array(), src); }),
                  "expected a JSON object"));
  // The parse functions without a file.
  EXPECT_EQ(one_line_error([] { parse_beta_schedule("cosine"); }),
            "unknown beta_schedule 'cosine'; supported: linear, scaled_linear, squaredcos_cap_v2, "
            "sigmoid");
  for (const PredictionType p :
       {PredictionType::kEpsilon, PredictionType::kVPrediction, PredictionType::kSample}) {
    EXPECT_EQ(parse_prediction_type(to_string(p)), p);
  }

  // Files: invalid JSON and a missing file name the path.
  const std::string dir = test::temp_dir("sched_config");
  const std::string broken = dir + "/broken.json";
  std::ofstream(broken) << "{\"beta_start\": 0.1,";
  const std::string message = one_line_error([&] { SchedulerConfig::load(broken); });
  EXPECT_TRUE(has(message, broken) && has(message, "invalid JSON")) << message;
  EXPECT_TRUE(
      has(one_line_error([&] { SchedulerConfig::load(dir + "/none.json"); }), dir + "/none.json"));
  fs::remove_all(dir);
}

TEST(NoiseSchedulerConfig, FactoryRefusesUnknownKindsAndClasses) {
  SchedulerConfig c;
  const std::string kind = one_line_error([&] { make_scheduler(c, "pndm"); });
  EXPECT_TRUE(has(kind, "'pndm'") && has(kind, "ddpm") && has(kind, "ddim")) << kind;
  c.class_name = "PNDMScheduler";
  const std::string cls = one_line_error([&] { make_scheduler(c); });
  EXPECT_TRUE(has(cls, "'PNDMScheduler'") && has(cls, "DDPMScheduler") && has(cls, "DDIMScheduler"))
      << cls;
  EXPECT_NE(dynamic_cast<DDIMScheduler*>(make_scheduler(c, "ddim").get()), nullptr);
  c.class_name = "DDPMScheduler";
  EXPECT_NE(dynamic_cast<DDPMScheduler*>(make_scheduler(c).get()), nullptr);
}

}  // namespace
}  // namespace difftrain::diffusion::config_tests
