// `difftrain train` options: YAML then flags (flags win), bare boolean flags, Diffusers names,
// and one-line errors for unknown names, wrong types and impossible combinations.

#include "difftrain/train/train_config.h"
#include "difftrain/accel/sharding.h"
#include "difftrain/core/error.h"
#include "difftrain/families/family.h"

#include "test_util.h"

#include <gtest/gtest.h>

#include <fstream>

namespace {

using difftrain::test::error_of;
using difftrain::test::temp_dir;
using difftrain::train::parse_train_config;
// With the registry: the run's family's options (the default family's without a model).
difftrain::train::TrainConfig family_config(const std::vector<std::string>& args) {
  return difftrain::families::parse_train_config(args);
}
const std::string kUNetFolder =
    std::string(difftrain_test::source_dir()) + "/tests/golden/diffusers/unet2d_uncond";

TEST(TrainConfig, DefaultsAreTheBuiltInFashionMnistRun) {
  const auto c = family_config({});
  EXPECT_EQ(c.dataset, "fashion_mnist");
  EXPECT_EQ(c.resolution, 32);
  EXPECT_EQ(c.family.family, "unet");
  // decided by the dataset: labelled -> yes
  EXPECT_TRUE(c.family.at("class_conditional").is_null());
  EXPECT_TRUE(c.use_ema);
  EXPECT_EQ(c.report_to, "all");
  EXPECT_EQ(c.lora_target_modules, (std::vector<std::string>{"to_q", "to_k", "to_v", "to_out.0"}));
  // The trainer alone has no objective or class-label options: they are the family's.
  for (const char* family_option : {"prediction_type", "snr_gamma", "class_dropout_prob"}) {
    EXPECT_HAS(error_of([&] {
                 parse_train_config({std::string("--") + family_option, "1"});
               }),
               std::string("unknown option \"") + family_option + "\"");
  }
}

// The built-in UNet trained from scratch gets the recipe measured best on the default job
// (docs/QUALITY.md): v-prediction with min-SNR-5 (the UNet family's configure_training). What is
// given wins, and a pretrained or configured model keeps Diffusers' defaults (epsilon, no
// weighting).
TEST(TrainConfig, TheBuiltInJobTrainsWithTheMeasuredRecipe) {
  const auto c = family_config({});
  EXPECT_EQ(c.family.text("prediction_type"), "v_prediction");
  EXPECT_DOUBLE_EQ(c.family.number("snr_gamma"), 5.0);
  EXPECT_EQ(c.family.text("ddpm_beta_schedule"), "squaredcos_cap_v2");
  EXPECT_DOUBLE_EQ(c.adam_beta2, 0.99);
  EXPECT_DOUBLE_EQ(c.family.number("class_dropout_prob"), 0.1);
  EXPECT_EQ(c.validation_scheduler, "ddpm");
  EXPECT_DOUBLE_EQ(c.guidance_scale.value_or(0), 1.5);
  const auto given = family_config({"--prediction_type", "epsilon", "--ddpm_beta_schedule",
                                    "linear", "--adam_beta2", "0.999", "--validation_scheduler",
                                    "ddim", "--guidance_scale", "3"});
  EXPECT_DOUBLE_EQ(given.adam_beta2, 0.999);
  EXPECT_EQ(given.validation_scheduler, "ddim");
  EXPECT_DOUBLE_EQ(given.guidance_scale.value_or(0), 3.0);
  EXPECT_DOUBLE_EQ(given.family.number("class_dropout_prob"), 0.1);
  // Without label dropout there is no null class to guide against, so no guidance either.
  const auto no_dropout = family_config({"--class_dropout_prob", "0"});
  EXPECT_FALSE(no_dropout.guidance_scale.has_value());
  EXPECT_EQ(given.family.text("prediction_type"), "epsilon");
  EXPECT_EQ(given.family.text("ddpm_beta_schedule"), "linear");
  EXPECT_DOUBLE_EQ(given.family.number("snr_gamma"), 5.0);
  const auto dir = temp_dir("train_config_recipe");
  std::ofstream(dir + "/r.yaml") << "snr_gamma: 3\n";
  const auto yaml = family_config({"--config", dir + "/r.yaml"});
  EXPECT_DOUBLE_EQ(yaml.family.number("snr_gamma"), 3.0);
  EXPECT_EQ(yaml.family.text("prediction_type"), "v_prediction");
  for (const auto& model : {"--model_config_name_or_path", "--pretrained_model_name_or_path"}) {
    const auto other = family_config({model, kUNetFolder});
    EXPECT_EQ(other.family.family, "unet") << model;
    EXPECT_EQ(other.family.text("prediction_type"), "epsilon") << model;
    EXPECT_TRUE(other.family.at("snr_gamma").is_null()) << model;
    EXPECT_EQ(other.family.text("ddpm_beta_schedule"), "linear") << model;
    EXPECT_DOUBLE_EQ(other.adam_beta2, 0.999) << model;
    EXPECT_DOUBLE_EQ(other.family.number("class_dropout_prob"), 0.0) << model;
    EXPECT_EQ(other.validation_scheduler, "ddim") << model;
    EXPECT_FALSE(other.guidance_scale.has_value()) << model;
  }
}

// The objective's and the class labels' options keep their checks and messages as family options.
TEST(TrainConfig, TheFamilyOptionsKeepTheirChecks) {
  EXPECT_HAS(error_of([] {
               family_config({"--guidance_scale", "3", "--class_dropout_prob", "0"});
             }),
             "--guidance_scale > 1 needs a null class: train with --class_dropout_prob (e.g. 0.1)");
  EXPECT_HAS(error_of([] {
               family_config({"--snr_gamma", "0"});
             }),
             "--snr_gamma must be positive (Diffusers uses 5.0)");
  EXPECT_HAS(error_of([] {
               family_config({"--noise_offset", "-1"});
             }),
             "--noise_offset and --input_perturbation must be >= 0");
  EXPECT_HAS(error_of([] {
               family_config({"--ddpm_num_steps", "0"});
             }),
             "--ddpm_num_steps must be at least 1");
  EXPECT_HAS(error_of([] {
               family_config({"--prediction_type", "noise"});
             }),
             "--prediction_type is \"noise\": expected one of epsilon, v_prediction, sample");
  EXPECT_HAS(error_of([] {
               family_config({"--class_dropout_prob", "1"});
             }),
             "--class_dropout_prob must be in [0, 1)");
  EXPECT_HAS(error_of([] { family_config({"--only_class", "-2"}); }), "--only_class must be >= 0");
  EXPECT_HAS(error_of([] {
               family_config({"--class_conditional", "maybe"});
             }),
             "--class_conditional is \"maybe\": expected true or false");
  // Given, they reach the task's options through the family.
  const auto c = family_config({"--only_class", "3", "--noise_offset", "0.05", "--snr_gamma", "2"});
  EXPECT_EQ(c.family.integer("only_class"), 3);
  EXPECT_TRUE(c.given.count("noise_offset"));
  EXPECT_DOUBLE_EQ(c.family.number("noise_offset"), 0.05);
}

// configs/fashion_mnist.yaml is the built-in default written out: it trains what `difftrain train`
// alone trains (it went stale once: epsilon after the default became v-prediction). Only where
// the run's outputs go may differ.
TEST(TrainConfig, TheWrittenOutDefaultIsTheBuiltInDefault) {
  const auto yaml = std::string(difftrain_test::source_dir()) + "/configs/fashion_mnist.yaml";
  auto written = family_config({"--config", yaml}).to_json();
  auto builtin = family_config({}).to_json();
  for (const auto* key :
       {"output_dir", "report_to", "checkpointing_steps", "checkpoints_total_limit"}) {
    written.erase(key);
    builtin.erase(key);
  }
  const auto diff = nlohmann::json::diff(builtin, written);
  EXPECT_TRUE(diff.empty()) << "configs/fashion_mnist.yaml differs from the built-in default: "
                            << diff.dump();
}

// Diffusers derives the steps from --num_train_epochs unless --max_train_steps is given; the
// built-in default's 1200 updates stand only when neither is (issue 38: the epochs were ignored).
TEST(TrainConfig, EpochsDecideTheLengthUnlessStepsAreGiven) {
  EXPECT_EQ(parse_train_config({}).max_train_steps, 1200);
  const auto epochs = parse_train_config({"--num_train_epochs", "2"});
  EXPECT_EQ(epochs.max_train_steps, 0);
  EXPECT_EQ(epochs.num_train_epochs, 2);
  EXPECT_EQ(
      parse_train_config({"--num_train_epochs", "2", "--max_train_steps", "5"}).max_train_steps, 5);
  const auto dir = temp_dir("train_config_epochs");
  std::ofstream(dir + "/e.yaml") << "num_train_epochs: 3\n";
  EXPECT_EQ(parse_train_config({"--config", dir + "/e.yaml"}).max_train_steps, 0);
  EXPECT_EQ(
      parse_train_config({"--config", dir + "/e.yaml", "--max_train_steps", "9"}).max_train_steps,
      9);
}

TEST(TrainConfig, YamlThenFlagsWithBareBooleans) {
  const auto dir = temp_dir("train_config");
  const std::string yaml = dir + "/run.yaml";
  std::ofstream(yaml) << "train_batch_size: 8\nlearning_rate: 2.0e-4\nuse_ema: false\n"
                         "lora_target_modules: [to_q, to_v]\nsnr_gamma: 5\nrandom_flip: true\n";
  const auto c = family_config({"--train_batch_size", "4", "--config", yaml, "--use_ema",
                                "--max_train_steps=7", "--random_flip", "false",
                                "--checkpoints_total_limit", "2"});
  EXPECT_EQ(c.train_batch_size, 4);  // the flag wins over the file, wherever --config is
  EXPECT_DOUBLE_EQ(c.learning_rate, 2e-4);
  EXPECT_TRUE(c.use_ema);  // bare flag
  EXPECT_FALSE(c.random_flip);
  EXPECT_EQ(c.max_train_steps, 7);
  EXPECT_EQ(c.lora_target_modules, (std::vector<std::string>{"to_q", "to_v"}));
  EXPECT_DOUBLE_EQ(c.family.number("snr_gamma"), 5.0);
  EXPECT_EQ(c.checkpoints_total_limit.value_or(0), 2);
  // The resolved configuration lists every option, the family's included.
  const auto json = c.to_json();
  EXPECT_EQ(json.at("train_batch_size"), 4);
  EXPECT_TRUE(json.at("class_conditional").is_null());
  EXPECT_EQ(json.size(), difftrain::train::train_option_table().size() + c.family.specs.size());
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
             "--lora fine-tunes a pretrained model");
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

TEST(TrainConfig, ShardingOptionsFromFlags) {
  const auto d = parse_train_config({});
  EXPECT_EQ(d.sharding_strategy, "NO_SHARD");
  EXPECT_EQ(d.fsdp_auto_wrap_policy, "TRANSFORMER_BASED_WRAP");
  EXPECT_EQ(d.fsdp_min_num_params, 100000000);
  EXPECT_TRUE(d.warnings.empty());
  EXPECT_TRUE(d.sharding_options().auto_wrap.classes.empty());

  const auto c = parse_train_config(
      {"--sharding_strategy", "zero2", "--fsdp_auto_wrap_policy", "size_based_wrap",
       "--fsdp_transformer_layer_cls_to_wrap", "ResnetBlock2D, Transformer2DModel",
       "--fsdp_min_num_params=5000", "--fsdp_forward_prefetch", "false", "--sync_each_batch"});
  EXPECT_EQ(c.sharding_strategy, "SHARD_GRAD_OP");  // stored under its canonical name
  EXPECT_EQ(c.fsdp_auto_wrap_policy, "SIZE_BASED_WRAP");
  const auto o = c.sharding_options();
  EXPECT_EQ(o.strategy, difftrain::accel::ShardingStrategy::kShardGradOp);
  EXPECT_EQ(o.auto_wrap.policy, "SIZE_BASED_WRAP");
  EXPECT_EQ(o.auto_wrap.classes, (std::vector<std::string>{"ResnetBlock2D", "Transformer2DModel"}));
  EXPECT_EQ(o.auto_wrap.min_num_params, 5000);
  EXPECT_FALSE(o.forward_prefetch);
  EXPECT_TRUE(o.backward_prefetch);
  EXPECT_TRUE(o.sync_each_batch);
  const auto json = c.to_json();
  EXPECT_EQ(json.at("sharding_strategy"), "SHARD_GRAD_OP");
  EXPECT_EQ(json.at("fsdp_min_num_params"), 5000);
  EXPECT_EQ(json.at("deepspeed_config"), "");
  EXPECT_FALSE(json.contains("warnings"));

  EXPECT_HAS(error_of([] {
               parse_train_config({"--sharding_strategy", "zero4"});
             }),
             "--sharding_strategy: 'zero4' is not a sharding strategy; use NO_SHARD, "
             "SHARD_OPTIMIZER, SHARD_GRAD_OP or FULL_SHARD");
  EXPECT_HAS(error_of([] {
               parse_train_config({"--fsdp_auto_wrap_policy", "layer_wrap"});
             }),
             "--fsdp_auto_wrap_policy is \"LAYER_WRAP\": expected one of TRANSFORMER_BASED_WRAP, "
             "SIZE_BASED_WRAP, NO_WRAP");
  EXPECT_HAS(error_of([] {
               parse_train_config({"--fsdp_min_num_params", "0"});
             }),
             "--fsdp_min_num_params must be at least 1");
}

TEST(TrainConfig, DeepSpeedConfigFillsWhatIsNotSetExplicitly) {
  const auto dir = temp_dir("train_config_ds");
  const std::string ds = dir + "/ds.json";
  std::ofstream(ds) << R"({"zero_optimization": {"stage": 3}, "bf16": {"enabled": true},
    "gradient_accumulation_steps": 4, "gradient_clipping": 0.5,
    "train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW"}})";
  const auto c = parse_train_config({"--deepspeed_config", ds});
  EXPECT_EQ(c.sharding_strategy, "FULL_SHARD");
  EXPECT_EQ(c.mixed_precision, "bf16");
  EXPECT_EQ(c.gradient_accumulation_steps, 4);
  EXPECT_DOUBLE_EQ(c.max_grad_norm, 0.5);
  EXPECT_EQ(c.train_batch_size, 8);
  ASSERT_EQ(c.warnings.size(), 1u);
  EXPECT_HAS(c.warnings[0], ds + ": optimizer=\"AdamW\": not used");

  // Explicit options (flags or the YAML) win, each with a warning when they differ.
  const std::string yaml = dir + "/run.yaml";
  std::ofstream(yaml) << "gradient_accumulation_steps: 4\nmixed_precision: fp16\n";
  const auto e = parse_train_config({"--config", yaml, "--deepspeed_config", ds,
                                     "--train_batch_size", "2", "--sharding_strategy", "zero2"});
  EXPECT_EQ(e.train_batch_size, 2);
  EXPECT_EQ(e.sharding_strategy, "SHARD_GRAD_OP");
  EXPECT_EQ(e.mixed_precision, "fp16");
  EXPECT_EQ(e.gradient_accumulation_steps, 4);  // same as the file's: no warning
  EXPECT_DOUBLE_EQ(e.max_grad_norm, 0.5);
  ASSERT_EQ(e.warnings.size(), 4u) << ::testing::PrintToString(e.warnings);
  EXPECT_EQ(e.warnings[1],
            "--sharding_strategy=\"SHARD_GRAD_OP\" (set explicitly) wins over \"FULL_SHARD\" "
            "from " +
                ds);
  EXPECT_EQ(e.warnings[2],
            "--mixed_precision=\"fp16\" (set explicitly) wins over \"bf16\" from " + ds);
  EXPECT_EQ(e.warnings[3], "--train_batch_size=2 (set explicitly) wins over 8 from " + ds);

  // "auto" keeps the trainer's values.
  std::ofstream(dir + "/auto.json")
      << R"({"zero_optimization": {"stage": 1}, "fp16": {"enabled": "auto"},
             "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
             "train_micro_batch_size_per_gpu": "auto"})";
  const auto a = parse_train_config({"--deepspeed_config", dir + "/auto.json"});
  EXPECT_EQ(a.sharding_strategy, "SHARD_OPTIMIZER");
  EXPECT_EQ(a.mixed_precision, "");
  EXPECT_EQ(a.gradient_accumulation_steps, 1);
  EXPECT_DOUBLE_EQ(a.max_grad_norm, 1.0);
  EXPECT_EQ(a.train_batch_size, 16);
  EXPECT_TRUE(a.warnings.empty()) << ::testing::PrintToString(a.warnings);

  std::ofstream(dir + "/bad.json") << R"({"zero_optimization": {"stage": 4}})";
  EXPECT_HAS(error_of([&] {
               parse_train_config({"--deepspeed_config", dir + "/bad.json"});
             }),
             "zero_optimization.stage is 4: expected 0, 1, 2 or 3");
}

TEST(TrainConfig, AccelerateConfigFileFillsShardingOptions) {
  const auto dir = temp_dir("train_config_acc");
  const std::string yaml = dir + "/fsdp.yaml";
  std::ofstream(yaml) << "distributed_type: FSDP\nnum_processes: 2\nmixed_precision: bf16\n"
                         "fsdp_config:\n  fsdp_sharding_strategy: 1\n"
                         "  fsdp_transformer_layer_cls_to_wrap: [ResnetBlock2D, DownBlock2D]\n"
                         "  fsdp_backward_prefetch: NO_PREFETCH\n"
                         "  fsdp_offload_params: true\n  fsdp_min_num_params: 5000\n";
  const auto c = parse_train_config({"--accelerate_config_file", yaml, "--fsdp_min_num_params",
                                     "77", "--fsdp_auto_wrap_policy", "NO_WRAP"});
  EXPECT_EQ(c.sharding_strategy, "FULL_SHARD");
  EXPECT_EQ(c.fsdp_transformer_layer_cls_to_wrap, "ResnetBlock2D,DownBlock2D");
  EXPECT_FALSE(c.fsdp_backward_prefetch);
  EXPECT_EQ(c.fsdp_min_num_params, 77);
  EXPECT_EQ(c.mixed_precision, "bf16");
  // fsdp_offload_params under FULL_SHARD: optimizer and parameters in host memory.
  EXPECT_EQ(c.offload_optimizer_device, "cpu");
  EXPECT_EQ(c.offload_param_device, "cpu");
  EXPECT_TRUE(c.sharding_options().offload_params);
  ASSERT_EQ(c.warnings.size(), 1u) << ::testing::PrintToString(c.warnings);
  EXPECT_EQ(c.warnings[0], "--fsdp_min_num_params=77 (set explicitly) wins over 5000 from " + yaml);
  EXPECT_EQ(c.fsdp_auto_wrap_policy, "NO_WRAP");  // the file did not say: no warning
}

// Other tools' option names are refused naming difftrain's equivalent (issue 56); Diffusers'
// --repeats is read as --dataset_repeats.
TEST(TrainConfig, OtherToolsOptionsNameDifftrainsEquivalent) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--network_dim", "difftrain's is --rank"},
      {"--network_alpha", "difftrain's is --lora_alpha"},
      {"--fp8_base", "--base_weights_dtype fp8_e4m3"},
      {"--text_encoder_lr", "difftrain's is --learning_rate"},
      {"--enable_bucket", "--resolution_buckets"},
      {"--xformers", "leave it out"},
  };
  for (const auto& [flag, hint] : cases) {
    const auto e = error_of([&, flag = flag] { parse_train_config({flag, "8"}); });
    EXPECT_HAS(e, "\"" + flag.substr(2) + "\" is another tool's option");
    EXPECT_HAS(e, hint);
  }
  EXPECT_EQ(parse_train_config({"--repeats", "3"}).dataset_repeats, 3);
  EXPECT_EQ(parse_train_config({"--dataset_repeats", "2"}).dataset_repeats, 2);
  EXPECT_HAS(error_of([] {
               parse_train_config({"--dataset_repeats", "0"});
             }),
             "--dataset_repeats must be at least 1");
}

// kohya's --resolution W,H (width, height): a W x H crop, square when the sides agree, and with
// buckets the buckets' area (resolution round(sqrt(W H))).
TEST(TrainConfig, ResolutionTakesKohyasWidthCommaHeight) {
  const auto wide = parse_train_config({"--resolution", "512,768"});
  EXPECT_EQ(wide.resolution_width, 512);
  EXPECT_EQ(wide.resolution_height, 768);
  EXPECT_EQ(wide.to_json()["resolution"], "512,768");
  const auto square = parse_train_config({"--resolution", "64,64"});
  EXPECT_EQ(square.resolution, 64);
  EXPECT_EQ(square.resolution_width, 0);
  EXPECT_EQ(square.to_json()["resolution"], 64);
  const auto buckets = parse_train_config({"--resolution", "512,768", "--resolution_buckets"});
  EXPECT_EQ(buckets.resolution, 627);  // sqrt(512 * 768) = 627.1
  EXPECT_EQ(buckets.resolution_width, 0);
  EXPECT_HAS(error_of([] {
               parse_train_config({"--resolution", "512,x"});
             }),
             "--resolution is \"x\": expected an integer");
  EXPECT_HAS(error_of([] {
               parse_train_config({"--resolution", "4,512"});
             }),
             "expected N or W,H (kohya's width,height) with sides >= 8");
}

// The options a run was given are recorded; a script's defaults fill only the others.
TEST(TrainConfig, ScriptDefaultsFillOnlyWhatWasNotGiven) {
  auto c = parse_train_config(
      {"--learning_rate", "3e-4", "--pretrained_model_name_or_path", "x", "--lora"});
  EXPECT_TRUE(c.given.count("learning_rate"));
  EXPECT_FALSE(c.given.count("lr_scheduler"));
  difftrain::train::ScriptDefaults d;
  d.script = "train_x.py";
  d.lora_target_modules = {"a", "b"};
  d.not_applicable = {"logging_dir"};
  difftrain::train::apply_script_defaults(c, d);
  EXPECT_DOUBLE_EQ(c.learning_rate, 3e-4);  // given wins
  EXPECT_EQ(c.lr_scheduler, "constant");
  EXPECT_EQ(c.lr_warmup_steps, 500);
  EXPECT_DOUBLE_EQ(c.adam_beta1, 0.9);
  EXPECT_FALSE(c.use_ema);
  EXPECT_EQ(c.train_batch_size, 4);
  EXPECT_EQ(c.max_train_steps, 0);  // Diffusers' None: the epochs decide
  EXPECT_EQ(c.num_train_epochs, 1);
  EXPECT_EQ(c.lora_target_modules, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(c.defaults_from, "train_x.py");
  const auto shown = c.shown_json();
  EXPECT_FALSE(shown.contains("logging_dir"));
  EXPECT_FALSE(shown.contains("ema_max_decay"));  // no EMA: its settings do not apply
  EXPECT_TRUE(shown.contains("rank"));
  EXPECT_TRUE(c.to_json().contains("logging_dir"));  // checkpoints keep every option
  // Steps given: the epochs do not replace them; a DeepSpeed file's batch counts as given.
  auto steps = parse_train_config({"--max_train_steps", "7"});
  difftrain::train::apply_script_defaults(steps, d);
  EXPECT_EQ(steps.max_train_steps, 7);
  const auto dir = temp_dir("train_config_script_defaults");
  std::ofstream(dir + "/ds.json") << R"({"train_micro_batch_size_per_gpu": 2})";
  auto ds = parse_train_config({"--deepspeed_config", dir + "/ds.json"});
  difftrain::train::apply_script_defaults(ds, d);
  EXPECT_EQ(ds.train_batch_size, 2);
}

// kohya's --save_every_n_epochs / --save_last_n_epochs and Diffusers' --validation_epochs are
// difftrain's own options: given alone, an epoch cadence turns its step cadence's default off
// (a script's default too); given with it, both apply. Nonsense is one line.
TEST(TrainConfig, EpochCadencesReplaceTheStepDefaultsOnlyWhenGivenAlone) {
  const auto alone = parse_train_config({"--save_every_n_epochs", "2", "--validation_epochs", "1"});
  EXPECT_EQ(alone.save_every_n_epochs.value_or(0), 2);
  EXPECT_EQ(alone.validation_epochs.value_or(0), 1);
  EXPECT_EQ(alone.checkpointing_steps, 0);
  EXPECT_EQ(alone.validation_steps, 0);
  const auto both = parse_train_config({"--save_every_n_epochs", "2", "--checkpointing_steps", "50",
                                        "--validation_epochs", "3", "--validation_steps", "40",
                                        "--save_last_n_epochs", "4"});
  EXPECT_EQ(both.checkpointing_steps, 50);
  EXPECT_EQ(both.validation_steps, 40);
  EXPECT_EQ(both.save_last_n_epochs.value_or(0), 4);
  const auto none = parse_train_config({});
  EXPECT_FALSE(none.save_every_n_epochs || none.validation_epochs || none.save_last_n_epochs);
  EXPECT_EQ(none.checkpointing_steps, 400);
  auto scripted = parse_train_config({"--save_every_n_epochs", "1"});
  difftrain::train::apply_script_defaults(scripted, difftrain::train::ScriptDefaults{});
  EXPECT_EQ(scripted.checkpointing_steps, 0);
  for (const char* name : {"save_every_n_epochs", "save_last_n_epochs", "validation_epochs"}) {
    EXPECT_HAS(error_of([&] {
                 parse_train_config({"--save_every_n_epochs", "1", std::string("--") + name, "0"});
               }),
               std::string("--") + name + " must be at least 1, got 0");
  }
  EXPECT_HAS(error_of([] {
               parse_train_config({"--save_last_n_epochs", "2"});
             }),
             "--save_last_n_epochs keeps the newest epoch saves, and this run makes none");
}

}  // namespace
