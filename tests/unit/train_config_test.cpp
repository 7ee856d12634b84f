// `difftrain train` options: YAML then flags (flags win), bare boolean flags, Diffusers names,
// and one-line errors for unknown names, wrong types and impossible combinations.

#include "difftrain/train/train_config.h"
#include "difftrain/core/error.h"

#include "test_util.h"

#include <gtest/gtest.h>

#include <fstream>

namespace {

using difftrain::test::error_of;
using difftrain::test::temp_dir;
using difftrain::train::parse_train_config;

#define EXPECT_HAS(text, part)                               \
  EXPECT_NE(std::string(text).find(part), std::string::npos) \
      << "'" << (text) << "' lacks '" << (part) << "'"

TEST(TrainConfig, DefaultsAreTheBuiltInFashionMnistRun) {
  const auto c = parse_train_config({});
  EXPECT_EQ(c.dataset, "fashion_mnist");
  EXPECT_EQ(c.resolution, 32);
  EXPECT_FALSE(c.class_conditional.has_value());  // decided by the dataset: labelled -> yes
  EXPECT_TRUE(c.use_ema);
  EXPECT_EQ(c.report_to, "all");
  EXPECT_EQ(c.lora_target_modules, (std::vector<std::string>{"to_q", "to_k", "to_v", "to_out.0"}));
}

TEST(TrainConfig, YamlThenFlagsWithBareBooleans) {
  const auto dir = temp_dir("train_config");
  const std::string yaml = dir + "/run.yaml";
  std::ofstream(yaml) << "train_batch_size: 8\nlearning_rate: 2.0e-4\nuse_ema: false\n"
                         "lora_target_modules: [to_q, to_v]\nsnr_gamma: 5\nrandom_flip: true\n";
  const auto c = parse_train_config({"--train_batch_size", "4", "--config", yaml, "--use_ema",
                                     "--max_train_steps=7", "--random_flip", "false",
                                     "--checkpoints_total_limit", "2"});
  EXPECT_EQ(c.train_batch_size, 4);  // the flag wins over the file, wherever --config is
  EXPECT_DOUBLE_EQ(c.learning_rate, 2e-4);
  EXPECT_TRUE(c.use_ema);  // bare flag
  EXPECT_FALSE(c.random_flip);
  EXPECT_EQ(c.max_train_steps, 7);
  EXPECT_EQ(c.lora_target_modules, (std::vector<std::string>{"to_q", "to_v"}));
  ASSERT_TRUE(c.snr_gamma.has_value());
  EXPECT_DOUBLE_EQ(*c.snr_gamma, 5.0);
  EXPECT_EQ(c.checkpoints_total_limit.value_or(0), 2);
  // The resolved configuration lists every option.
  const auto json = c.to_json();
  EXPECT_EQ(json.at("train_batch_size"), 4);
  EXPECT_TRUE(json.at("class_conditional").is_null());
  EXPECT_EQ(json.size(), difftrain::train::train_option_table().size());
}

TEST(TrainConfig, BadInputIsOneLineError) {
  EXPECT_HAS(error_of([] {
               parse_train_config({"--learning_rat", "1"});
             }),
             "unknown option \"learning_rat\"; did you mean learning_rate?");
  EXPECT_HAS(error_of([] {
               parse_train_config({"--train_batch_size", "many"});
             }),
             "--train_batch_size is \"many\": expected an integer");
  EXPECT_HAS(error_of([] {
               parse_train_config({"--use_ema", "maybe"});
             }),
             "--use_ema is \"maybe\": expected true or false");
  EXPECT_HAS(error_of([] {
               parse_train_config({"--train_batch_size", "0"});
             }),
             "--train_batch_size must be at least 1");
  EXPECT_HAS(error_of([] { parse_train_config({"--lora"}); }),
             "--lora fine-tunes a pretrained UNet");
  EXPECT_HAS(error_of([] {
               parse_train_config({"--mixed_precision", "fp8"});
             }),
             "expected one of no, bf16, fp16");
  EXPECT_HAS(error_of([] {
               parse_train_config({"--report_to", "wandb"});
             }),
             "--report_to is \"wandb\"");
  EXPECT_HAS(error_of([] { parse_train_config({"--learning_rate"}); }),
             "--learning_rate needs a value");
  EXPECT_HAS(error_of([] { parse_train_config({"stray"}); }), "unexpected argument \"stray\"");
  EXPECT_HAS(error_of([] {
               parse_train_config({"--dataset", "imagefolder"});
             }),
             "needs --train_data_dir");
  EXPECT_HAS(error_of([] { parse_train_config({"--guidance_scale", "3"}); }), "null class");
  EXPECT_HAS(error_of([] {
               parse_train_config({"--config", "/nonexistent.yaml"});
             }),
             "/nonexistent.yaml: no such file");
  const auto dir = temp_dir("train_config_bad");
  std::ofstream(dir + "/bad.yaml") << "train_batch_size: [1, {a: 2}]\n";
  EXPECT_HAS(error_of([&] {
               parse_train_config({"--config", dir + "/bad.yaml"});
             }),
             "train_batch_size must be a list of plain values");
  std::ofstream(dir + "/unknown.yaml") << "nope: 1\n";
  EXPECT_HAS(error_of([&] {
               parse_train_config({"--config", dir + "/unknown.yaml"});
             }),
             "unknown option \"nope\"");
  std::ofstream(dir + "/broken.yaml") << "a: [1, 2\n";
  EXPECT_HAS(error_of([&] {
               parse_train_config({"--config", dir + "/broken.yaml"});
             }),
             "not valid YAML");
}

}  // namespace
