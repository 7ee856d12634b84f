// The rows of the bad-input catalogue (error_catalogue.h): the bad inputs and what each must print.

#include "error_catalogue.h"
#include "train_util.h"

#include "difftrain/io/image.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

namespace difftrain::testing {
namespace {

namespace fs = std::filesystem;

const std::string kGolden = kCatalogueGolden;
const std::string kUncond = kGolden + "/diffusers/unet2d_uncond";
const std::string kSd = kGolden + "/sd/tiny_sd";

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_bytes(const std::string& path, const std::string& bytes) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
}

void write_text(const std::string& path, const std::string& text) { write_bytes(path, text); }

std::string copy_folder(const std::string& from, const std::string& to) {
  fs::copy(from, to, fs::copy_options::recursive);
  return to;
}

// A copy of the unconditional UNet fixture (with scheduler_config.json) at <tmp>/unet.
std::string uncond_copy(const std::string& tmp) { return copy_folder(kUncond, tmp + "/unet"); }

// Rewrites <dir>/diffusion_pytorch_model.safetensors with `edit` applied to its JSON header.
void edit_safetensors_header(const std::string& dir,
                             const std::function<void(nlohmann::json&)>& edit) {
  const std::string path = dir + "/diffusion_pytorch_model.safetensors";
  const std::string bytes = read_bytes(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  auto header = nlohmann::json::parse(bytes.substr(8, n));
  edit(header);
  const std::string text = header.dump();
  const uint64_t m = text.size();
  std::string out(reinterpret_cast<const char*>(&m), 8);
  write_bytes(path, out + text + bytes.substr(8 + n));
}

void edit_json(const std::string& path, const std::function<void(nlohmann::json&)>& edit) {
  auto json = nlohmann::json::parse(read_bytes(path));
  edit(json);
  write_text(path, json.dump(2));
}

// An 8x8 grey RGB PNG.
std::string png_bytes(const std::string& tmp) {
  const std::string path = tmp + "/ok.png";
  io::save_png(path, io::to_uint8_images(torch::zeros({1, 3, 8, 8}))[0]);
  const std::string bytes = read_bytes(path);
  fs::remove(path);
  return bytes;
}

// <tmp>/data: one good image, plus `extra` files; metadata.jsonl when `metadata` is not empty.
std::string image_folder(const std::string& tmp, const std::map<std::string, std::string>& extra,
                         const std::string& metadata = "") {
  const std::string dir = tmp + "/data";
  fs::create_directories(dir);
  write_bytes(dir + "/a.png", png_bytes(tmp));
  for (const auto& [name, bytes] : extra) write_bytes(dir + "/" + name, bytes);
  if (!metadata.empty()) write_bytes(dir + "/metadata.jsonl", metadata);
  return dir;
}

// `difftrain train` of the tiny 8x8 UNet (train_util.h) for one step; errors come before it.
std::vector<std::string> tiny_train(const std::string& tmp, std::vector<std::string> extra) {
  std::vector<std::string> cmd = {"train",
                                  "--model_config_name_or_path",
                                  tiny_config(tmp),
                                  "--resolution",
                                  "8",
                                  "--max_train_samples",
                                  "8",
                                  "--train_batch_size",
                                  "4",
                                  "--max_train_steps",
                                  "1",
                                  "--lr_warmup_steps",
                                  "0",
                                  "--num_validation_images",
                                  "0",
                                  "--checkpointing_steps",
                                  "0",
                                  "--output_dir",
                                  tmp + "/out"};
  cmd.insert(cmd.end(), extra.begin(), extra.end());
  return cmd;
}

// The tiny 8x8 UNet on an image folder (grey: the UNet takes 1 channel).
std::vector<std::string> folder_train(const std::string& tmp, const std::string& data) {
  return tiny_train(tmp, {"--dataset", "imagefolder", "--train_data_dir", data});
}

// LoRA text-to-image training on the tiny Stable Diffusion fixture.
std::vector<std::string> sd_train(const std::string& tmp, const std::string& data,
                                  std::vector<std::string> extra) {
  std::vector<std::string> cmd = {"train",
                                  "--pretrained_model_name_or_path",
                                  kSd,
                                  "--dataset",
                                  "imagefolder",
                                  "--train_data_dir",
                                  data,
                                  "--lora",
                                  "--max_train_steps",
                                  "1",
                                  "--lr_warmup_steps",
                                  "0",
                                  "--num_validation_images",
                                  "0",
                                  "--output_dir",
                                  tmp + "/out"};
  cmd.insert(cmd.end(), extra.begin(), extra.end());
  return cmd;
}

std::vector<std::string> sample(const std::string& model, std::vector<std::string> extra = {}) {
  std::vector<std::string> cmd = {"sample",
                                  "--model",
                                  model,
                                  "--num_inference_steps",
                                  "1",
                                  "--output",
                                  model + "/../samples.png"};
  cmd.insert(cmd.end(), extra.begin(), extra.end());
  return cmd;
}

// A listening TCP socket on a free port of every address, held by the returned pointer.
std::shared_ptr<void> occupy_port(int& port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0) << strerror(errno);
  EXPECT_EQ(::listen(fd, 1), 0);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  port = ntohs(addr.sin_port);
  return std::shared_ptr<void>(nullptr, [fd](void*) { ::close(fd); });
}

}  // namespace

const std::vector<Case>& error_catalogue_cases() {
  static const std::vector<Case> kCases = {
      // ------------------------------------------------------------------ model folders
      {"MissingModelFolder",
       "`difftrain train --pretrained_model_name_or_path DIR` where DIR does not exist",
       "<tmp>/no_such_model: no such folder; expected a Diffusers UNet folder (config.json + "
       "diffusion_pytorch_model.safetensors): check the path",
       1,
       [](const std::string& t) {
         return BadRun{{"train", "--pretrained_model_name_or_path", t + "/no_such_model"}};
       }},
      {"ModelFolderIsAFile",
       "`difftrain train --pretrained_model_name_or_path FILE`: a regular file, not a folder",
       "<tmp>/model.txt: not a folder; expected a Diffusers UNet folder (config.json + "
       "diffusion_pytorch_model.safetensors)",
       1,
       [](const std::string& t) {
         write_text(t + "/model.txt", "not a model\n");
         return BadRun{{"train", "--pretrained_model_name_or_path", t + "/model.txt"}};
       }},
      {"ModelFolderWithoutConfig",
       "`difftrain train --pretrained_model_name_or_path DIR` where DIR has no config.json",
       "<tmp>/model: no config.json; expected a Diffusers UNet folder (config.json + "
       "diffusion_pytorch_model.safetensors, as save_pretrained writes it)",
       1,
       [](const std::string& t) {
         fs::create_directories(t + "/model");
         return BadRun{{"train", "--pretrained_model_name_or_path", t + "/model"}};
       }},
      {"ModelFolderWithPickleWeights",
       "`difftrain sample --model DIR` where DIR has diffusion_pytorch_model.bin instead of "
       ".safetensors",
       "<tmp>/unet: only pickle weights (diffusion_pytorch_model.bin) found; difftrain reads "
       "safetensors only — in Python run `Model.from_pretrained(dir).save_pretrained(dir, "
       "safe_serialization=True)`",
       1,
       [](const std::string& t) {
         const auto dir = uncond_copy(t);
         fs::rename(dir + "/diffusion_pytorch_model.safetensors",
                    dir + "/diffusion_pytorch_model.bin");
         return BadRun{sample(dir)};
       }},
      {"ConfigFieldOfWrongType",
       "`difftrain sample --model DIR` with `\"layers_per_block\": \"one\"` in DIR/config.json",
       "<tmp>/unet/config.json: field \"layers_per_block\" must be an integer for UNet2DModel", 1,
       [](const std::string& t) {
         const auto dir = uncond_copy(t);
         edit_json(dir + "/config.json", [](auto& j) { j["layers_per_block"] = "one"; });
         return BadRun{sample(dir)};
       }},
      {"ModelConfigFieldOfWrongType",
       "`difftrain train --model_config_name_or_path FILE` with `\"sample_size\": \"big\"`",
       "<tmp>/unet.json: field \"sample_size\" must be an integer or [height, width], got \"big\"",
       1,
       [](const std::string& t) {
         write_text(t + "/unet.json", R"({"_class_name": "UNet2DModel", "sample_size": "big"})");
         return BadRun{tiny_train(t, {"--model_config_name_or_path", t + "/unet.json"})};
       }},
      {"UnknownModelClass",
       "`difftrain train --model_config_name_or_path FILE` with `\"_class_name\": \"FooModel\"`",
       "<tmp>/unet.json: field \"_class_name\" is \"FooModel\"; supported: UNet2DModel, "
       "UNet2DConditionModel",
       1,
       [](const std::string& t) {
         write_text(t + "/unet.json", R"({"_class_name": "FooModel"})");
         return BadRun{tiny_train(t, {"--model_config_name_or_path", t + "/unet.json"})};
       }},
      // ------------------------------------------------------------------ safetensors
      {"TruncatedSafetensors",
       "`difftrain sample --model DIR` whose diffusion_pytorch_model.safetensors is cut to half "
       "its size",
       "invalid safetensors file '<tmp>/unet/diffusion_pytorch_model.safetensors': tensor "
       "'up_blocks.0.attentions.1.to_v.weight' has data_offsets [1393036, 1409420] past the "
       "1397738-byte data buffer (truncated file?); the file is corrupt or not safetensors — "
       "re-create or re-download it",
       1,
       [](const std::string& t) {
         const auto dir = uncond_copy(t);
         const auto path = dir + "/diffusion_pytorch_model.safetensors";
         const auto bytes = read_bytes(path);
         write_bytes(path, bytes.substr(0, bytes.size() / 2));
         return BadRun{sample(dir)};
       }},
      {"OverlappingSafetensors",
       "`difftrain sample --model DIR`: the safetensors header gives conv_in.weight the data "
       "range [64, 3520), overlapping conv_in.bias [0, 128)",
       "invalid safetensors file '<tmp>/unet/diffusion_pytorch_model.safetensors': tensor "
       "'conv_in.weight' overlaps the tensor before it; the file is corrupt or not safetensors — "
       "re-create or re-download it",
       1,
       [](const std::string& t) {
         const auto dir = uncond_copy(t);
         edit_safetensors_header(dir, [](auto& h) {
           h["conv_in.weight"]["data_offsets"] = {64, 3520};
         });
         return BadRun{sample(dir)};
       }},
      {"SafetensorsHeaderLengthBeyondFile",
       "`difftrain sample --model DIR`: the first 8 bytes of the safetensors file say the header "
       "is 5000000 bytes long; the file has 2824516",
       "invalid safetensors file '<tmp>/unet/diffusion_pytorch_model.safetensors': header length "
       "5000000 runs past the end of the 2824516-byte file; the file is corrupt or not "
       "safetensors — re-create or re-download it",
       1,
       [](const std::string& t) {
         const auto dir = uncond_copy(t);
         const auto path = dir + "/diffusion_pytorch_model.safetensors";
         auto bytes = read_bytes(path);
         const uint64_t n = 5000000;
         std::memcpy(bytes.data(), &n, 8);
         write_bytes(path, bytes);
         return BadRun{sample(dir)};
       }},
      {"UnsupportedDtype",
       "`difftrain sample --model DIR`: a tensor of dtype F8_E4M3 in the safetensors file",
       "invalid safetensors file '<tmp>/unet/diffusion_pytorch_model.safetensors': tensor "
       "'conv_in.bias' has unsupported dtype 'F8_E4M3' (supported: F64 F32 F16 BF16 I64 I32 I16 "
       "I8 U8 BOOL); the file is corrupt or not safetensors — re-create or re-download it",
       1,
       [](const std::string& t) {
         const auto dir = uncond_copy(t);
         edit_safetensors_header(dir, [](auto& h) {
           h["conv_in.bias"]["dtype"] = "F8_E4M3";
           h["conv_in.bias"]["shape"] = {128};
         });
         return BadRun{sample(dir)};
       }},
      {"IntegerWeightsForAFloatParameter",
       "`difftrain sample --model DIR`: conv_in.bias stored as I32 instead of F32 (dtype "
       "mismatch between config and weights)",
       "<tmp>/unet/diffusion_pytorch_model.safetensors: the weights do not match the model's "
       "config; non-float data for: conv_in.bias (is config.json from the same model?)",
       1,
       [](const std::string& t) {
         const auto dir = uncond_copy(t);
         edit_safetensors_header(dir, [](auto& h) { h["conv_in.bias"]["dtype"] = "I32"; });
         return BadRun{sample(dir)};
       }},
      {"ShapeMismatchBetweenConfigAndWeights",
       "`difftrain sample --model DIR` with in_channels and out_channels 1 in config.json; the "
       "weights have 3",
       "<tmp>/unet/diffusion_pytorch_model.safetensors: the weights do not match the model's "
       "config; wrong shapes: conv_in.weight (file [32, 3, 3, 3], model [32, 1, 3, 3]), "
       "conv_out.bias (file [3], model [1]), conv_out.weight (file [3, 32, 3, 3], model [1, 32, "
       "3, 3]) (is config.json from the same model?)",
       1,
       [](const std::string& t) {
         const auto dir = uncond_copy(t);
         edit_json(dir + "/config.json", [](auto& j) {
           j["in_channels"] = 1;
           j["out_channels"] = 1;
         });
         return BadRun{sample(dir)};
       }},
      {"LoraForAnotherModel",
       "`difftrain sample --model tests/golden/diffusers/unet2d_uncond --lora "
       "tests/golden/diffusers/lora/pytorch_lora_weights.safetensors` (a LoRA of a "
       "cross-attention UNet)",
       "LoRA file '<golden>/diffusers/lora/pytorch_lora_weights.safetensors': unet module "
       "'down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_k' (key "
       "'unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_k.lora') is not in the "
       "model: it has no parameter "
       "'down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_k.weight'; is this LoRA for a "
       "different model?",
       1,
       [](const std::string& t) {
         return BadRun{
             sample(uncond_copy(t),
                    {"--lora", kGolden + "/diffusers/lora/pytorch_lora_weights.safetensors"})};
       }},
      // ------------------------------------------------------------------ schedules, schedulers
      {"UnknownLrScheduler", "`difftrain train ... --lr_scheduler foo`",
       "unknown LR schedule 'foo'; valid choices: linear, cosine, cosine_with_restarts, "
       "polynomial, constant, constant_with_warmup, piecewise_constant",
       1,
       [](const std::string& t) {
         return BadRun{tiny_train(t, {"--lr_scheduler", "foo"})};
       }},
      {"UnknownSchedulerClass",
       "`difftrain sample --model DIR` with `\"_class_name\": \"FooScheduler\"` in "
       "scheduler_config.json",
       "scheduler config <tmp>/unet/scheduler_config.json: _class_name 'FooScheduler' is not a "
       "supported sampler; choose one with --scheduler: use one of ddpm, ddim, pndm, euler, "
       "euler_karras, euler_ancestral, dpmpp_2m, dpmpp_2m_karras, dpmpp_2m_sde, "
       "dpmpp_2m_sde_karras, unipc, flow_match_euler (or a Diffusers class name: DDPMScheduler, "
       "DDIMScheduler, PNDMScheduler, EulerDiscreteScheduler, EulerAncestralDiscreteScheduler, "
       "DPMSolverMultistepScheduler, UniPCMultistepScheduler, FlowMatchEulerDiscreteScheduler)",
       1,
       [](const std::string& t) {
         const auto dir = uncond_copy(t);
         edit_json(dir + "/scheduler_config.json",
                   [](auto& j) { j["_class_name"] = "FooScheduler"; });
         return BadRun{sample(dir)};
       }},
      {"UnknownSchedulerPredictionType",
       "`difftrain sample --model DIR` with `\"prediction_type\": \"foo\"` in "
       "scheduler_config.json",
       "scheduler config <tmp>/unet/scheduler_config.json: unknown prediction_type 'foo'; "
       "supported: epsilon, v_prediction, sample",
       1,
       [](const std::string& t) {
         const auto dir = uncond_copy(t);
         edit_json(dir + "/scheduler_config.json", [](auto& j) { j["prediction_type"] = "foo"; });
         return BadRun{sample(dir)};
       }},
      {"UnknownSampleScheduler", "`difftrain sample --model DIR --scheduler foo`",
       "unknown scheduler 'foo' for scheduler config <tmp>/unet/scheduler_config.json; use one "
       "of ddpm, ddim, pndm, euler, euler_karras, euler_ancestral, dpmpp_2m, dpmpp_2m_karras, "
       "dpmpp_2m_sde, dpmpp_2m_sde_karras, unipc, flow_match_euler (or a Diffusers class name: "
       "DDPMScheduler, DDIMScheduler, PNDMScheduler, EulerDiscreteScheduler, "
       "EulerAncestralDiscreteScheduler, DPMSolverMultistepScheduler, UniPCMultistepScheduler, "
       "FlowMatchEulerDiscreteScheduler)",
       1,
       [](const std::string& t) {
         return BadRun{sample(uncond_copy(t), {"--scheduler", "foo"})};
       }},
      {"UnknownPredictionType", "`difftrain train ... --prediction_type foo`",
       "--prediction_type is \"foo\": expected one of epsilon, v_prediction, sample", 1,
       [](const std::string& t) {
         return BadRun{tiny_train(t, {"--prediction_type", "foo"})};
       }},
      // ------------------------------------------------------------------ training options
      {"ZeroBatchSize", "`difftrain train ... --train_batch_size 0`",
       "--train_batch_size must be at least 1 (it is per process), got 0", 1,
       [](const std::string& t) {
         return BadRun{tiny_train(t, {"--train_batch_size", "0"})};
       }},
      {"NegativeBatchSize", "`difftrain train ... --train_batch_size -1`",
       "--train_batch_size must be at least 1 (it is per process), got -1", 1,
       [](const std::string& t) {
         return BadRun{tiny_train(t, {"--train_batch_size", "-1"})};
       }},
      {"BatchSizeNotANumber", "`difftrain train ... --train_batch_size abc`",
       "--train_batch_size is \"abc\": expected an integer", 1,
       [](const std::string& t) {
         return BadRun{tiny_train(t, {"--train_batch_size", "abc"})};
       }},
      {"ZeroGradientAccumulation", "`difftrain train ... --gradient_accumulation_steps 0`",
       "--gradient_accumulation_steps must be at least 1, got 0", 1,
       [](const std::string& t) {
         return BadRun{tiny_train(t, {"--gradient_accumulation_steps", "0"})};
       }},
      {"UnknownMixedPrecision", "`difftrain train ... --mixed_precision fp8`",
       "--mixed_precision is \"fp8\": expected one of no, bf16, fp16", 1,
       [](const std::string& t) {
         return BadRun{tiny_train(t, {"--mixed_precision", "fp8"})};
       }},
      {"UnknownShardingStrategy", "`difftrain train ... --sharding_strategy FOO`",
       "--sharding_strategy: 'FOO' is not a sharding strategy; use NO_SHARD, SHARD_OPTIMIZER, "
       "SHARD_GRAD_OP or FULL_SHARD (or ZeRO stages zero0..zero3)",
       1,
       [](const std::string& t) {
         return BadRun{tiny_train(t, {"--sharding_strategy", "FOO"})};
       }},
      {"UnknownDataset", "`difftrain train ... --dataset foo`",
       "--dataset is \"foo\": expected one of fashion_mnist, mnist, imagefolder", 1,
       [](const std::string& t) {
         return BadRun{tiny_train(t, {"--dataset", "foo"})};
       }},
      {"LoraWithoutPretrainedModel", "`difftrain train --model_config_name_or_path FILE --lora`",
       "--lora fine-tunes a pretrained model: pass --pretrained_model_name_or_path DIR", 1,
       [](const std::string& t) { return BadRun{tiny_train(t, {"--lora"})}; }},
      {"ResolutionNotAMultipleOfTheVae",
       "`difftrain train --pretrained_model_name_or_path tests/golden/sd/tiny_sd ... --resolution "
       "31` (its VAE halves the size once)",
       "--resolution 31 is not a multiple of 2 (the VAE's downsampling factor); use 30 or 32", 1,
       [](const std::string& t) {
         const auto data = image_folder(t, {},
                                        R"({"file_name": "a.png", "text": "a grey square"})"
                                        "\n");
         return BadRun{sd_train(t, data, {"--resolution", "31"})};
       }},
      // ------------------------------------------------------------------ image folders
      {"TextFileNamedPng", "`difftrain train --dataset imagefolder` with a text file b.png in it",
       "batch 0 of epoch 0: cannot load image '<tmp>/data/b.png': unknown image type (17 bytes); "
       "the file is corrupt, truncated or not a PNG, JPEG, BMP, GIF, TGA, PSD, HDR, PIC or PNM "
       "image — re-create it or convert it to PNG (or set skip_bad_images to drop the files that "
       "cannot be decoded)",
       1,
       [](const std::string& t) {
         return BadRun{folder_train(t, image_folder(t, {{"b.png", "hello, I am text\n"}}))};
       }},
      {"TruncatedPng", "`difftrain train --dataset imagefolder` with a PNG cut after 60 bytes",
       "batch 0 of epoch 0: cannot load image '<tmp>/data/b.png': the data ends early or is "
       "damaged (60 bytes); "
       "the file is corrupt, truncated or not a PNG, JPEG, BMP, GIF, TGA, PSD, HDR, PIC or PNM "
       "image — re-create it or convert it to PNG (or set skip_bad_images to drop the files that "
       "cannot be decoded)",
       1,
       [](const std::string& t) {
         return BadRun{folder_train(t, image_folder(t, {{"b.png", png_bytes(t).substr(0, 60)}}))};
       }},
      {"NonUtf8Caption",
       "`difftrain train --dataset imagefolder` whose metadata.jsonl has a Latin-1 caption "
       "(`caf\\xe9`)",
       "<tmp>/data/metadata.jsonl line 1: not valid UTF-8 (byte 0xE9 at column 36); save "
       "metadata.jsonl as UTF-8, e.g. iconv -f latin1 -t utf-8",
       1,
       [](const std::string& t) {
         return BadRun{folder_train(
             t, image_folder(t, {}, "{\"file_name\": \"a.png\", \"text\": \"caf\xe9\"}\n"))};
       }},
      {"MetadataNotJson",
       "`difftrain train --dataset imagefolder`: a metadata.jsonl line cut short",
       "<tmp>/data/metadata.jsonl line 1: not valid JSON ([json.exception.parse_error.101] parse "
       "error at line 1, column 31: syntax error while parsing value - unexpected end of input; "
       "expected '[', '{', or a literal); each line must be one object such as {\"file_name\": "
       "\"a.png\", \"label\": 0}",
       1,
       [](const std::string& t) {
         return BadRun{
             folder_train(t, image_folder(t, {}, "{\"file_name\": \"a.png\", \"text\":\n"))};
       }},
      {"MetadataPathWithDotDot",
       "`difftrain train --dataset imagefolder`: metadata.jsonl names `../a.png`",
       "<tmp>/data/metadata.jsonl line 1: file_name \"../a.png\" contains '..'; images must lie "
       "inside <tmp>/data (no '..' components)",
       1,
       [](const std::string& t) {
         return BadRun{folder_train(t, image_folder(t, {},
                                                    R"({"file_name": "../a.png", "text": "x"})"
                                                    "\n"))};
       }},
      {"MetadataAbsolutePath",
       "`difftrain train --dataset imagefolder`: metadata.jsonl names `/etc/passwd`",
       "<tmp>/data/metadata.jsonl line 1: file_name \"/etc/passwd\" is absolute; give a path "
       "relative to <tmp>/data",
       1,
       [](const std::string& t) {
         return BadRun{folder_train(t, image_folder(t, {},
                                                    R"({"file_name": "/etc/passwd", "text": "x"})"
                                                    "\n"))};
       }},
      {"MetadataMissingImage",
       "`difftrain train --dataset imagefolder`: metadata.jsonl lists b.png, which is not there",
       "<tmp>/data/metadata.jsonl line 2: file_name \"b.png\" is listed but <tmp>/data/b.png does "
       "not exist",
       1,
       [](const std::string& t) {
         return BadRun{folder_train(t, image_folder(t, {},
                                                    R"({"file_name": "a.png", "text": "x"})"
                                                    "\n"
                                                    R"({"file_name": "b.png", "text": "y"})"
                                                    "\n"))};
       }},
      {"EmptyTrainDataDir", "`difftrain train --dataset imagefolder --train_data_dir EMPTY`",
       "<tmp>/empty: no images found (searched recursively); put PNG, JPEG or BMP files (.png "
       ".jpg .jpeg .bmp) in it",
       1,
       [](const std::string& t) {
         fs::create_directories(t + "/empty");
         return BadRun{folder_train(t, t + "/empty")};
       }},
      // ------------------------------------------------------------------ outputs, resuming
      {"UnwritableOutputDir",
       "`difftrain train ... --output_dir FILE/out` where FILE is a regular file",
       "cannot create output_dir '<tmp>/file/out': Not a directory; pass a writable --output_dir",
       1,
       [](const std::string& t) {
         write_text(t + "/file", "a file\n");
         return BadRun{tiny_train(t, {"--output_dir", t + "/file/out"})};
       }},
      {"ResumeWithADifferentResolution",
       "`difftrain train ... --resolution 16 --resume_from_checkpoint latest` in an --output_dir "
       "trained at --resolution 8",
       "cannot resume from <tmp>/out/checkpoint-1: it was trained with --resolution 8 but this "
       "run has 16; use the same value or start a new --output_dir",
       1,
       [](const std::string& t) {
         const auto first = run([&] {
           std::vector<std::string> a = {kDifftrain};
           for (auto& s : tiny_train(t, {"--checkpointing_steps", "1"})) a.push_back(s);
           return a;
         }());
         EXPECT_EQ(first.exit_code, 0) << first.log();
         return BadRun{tiny_train(t, {"--resolution", "16", "--resume_from_checkpoint", "latest"})};
       }},
      {"ResumeFromAMissingCheckpoint",
       "`difftrain train ... --resume_from_checkpoint DIR` where DIR does not exist",
       "resume_from_checkpoint '<tmp>/checkpoint-7' does not exist; pass a checkpoint-<step> "
       "folder of an earlier run, or latest (the newest one in --output_dir)",
       1,
       [](const std::string& t) {
         return BadRun{tiny_train(t, {"--resume_from_checkpoint", t + "/checkpoint-7"})};
       }},
      {"ResumeFromAFolderThatIsNoCheckpoint",
       "`difftrain train ... --resume_from_checkpoint DIR` where DIR is an empty folder",
       "resume_from_checkpoint '<tmp>/ckpt' is not a complete difftrain checkpoint (no "
       "trainer_state.json); pass a checkpoint-<step> folder or latest",
       1,
       [](const std::string& t) {
         fs::create_directories(t + "/ckpt");
         return BadRun{tiny_train(t, {"--resume_from_checkpoint", t + "/ckpt"})};
       }},
      // ------------------------------------------------------------------ launch
      {"ZeroProcesses", "`difftrain launch --num_processes 0 /bin/true`",
       "--num_processes must be at least 1", 1,
       [](const std::string&) {
         return BadRun{{"launch", "--num_processes", "0", "/bin/true"}};
       }},
      {"LaunchUnknownMixedPrecision", "`difftrain launch --mixed_precision fp8 /bin/true`",
       "--mixed_precision: fp8 not in {no,fp16,bf16}", 105,
       [](const std::string&) {
         return BadRun{{"launch", "--mixed_precision", "fp8", "/bin/true"}};
       },
       true},
      {"LaunchZeroGradientAccumulation",
       "`difftrain launch --gradient_accumulation_steps 0 /bin/true`",
       "--gradient_accumulation_steps must be at least 1", 1,
       [](const std::string&) {
         return BadRun{{"launch", "--gradient_accumulation_steps", "0", "/bin/true"}};
       }},
      {"LaunchUnknownShardingStrategy", "`difftrain launch --sharding_strategy FOO /bin/true`",
       "--sharding_strategy: 'FOO' is not a sharding strategy; use NO_SHARD, SHARD_OPTIMIZER, "
       "SHARD_GRAD_OP or FULL_SHARD (or ZeRO stages zero0..zero3)",
       1,
       [](const std::string&) {
         return BadRun{{"launch", "--sharding_strategy", "FOO", "/bin/true"}};
       }},
      {"PortInUse",
       "`difftrain launch --num_processes 2 --num_machines 2 --machine_rank 0 "
       "--main_process_ip 127.0.0.1 --main_process_port PORT /bin/true` while another program "
       "listens on PORT",
       "machine 0 could not host the rendezvous: port <port> is already in use on this machine; "
       "choose another --main_process_port (the same on every machine)",
       1,
       [](const std::string&) {
         int port = 0;
         auto hold = occupy_port(port);
         return BadRun{{"launch", "--num_processes", "2", "--num_machines", "2", "--machine_rank",
                        "0", "--main_process_ip", "127.0.0.1", "--main_process_port",
                        std::to_string(port), "/bin/true"},
                       {{"<port>", std::to_string(port)}},
                       hold};
       }},
      {"UnresolvableMainAddress",
       "`difftrain launch --num_processes 2 --num_machines 2 --machine_rank 0 "
       "--main_process_ip no-such-host.invalid --main_process_port 29500 /bin/true`",
       "--main_process_ip 'no-such-host.invalid' cannot be resolved (Name or service not known): "
       "give machine 0's IP address, or a host name that every machine resolves",
       1,
       [](const std::string&) {
         return BadRun{{"launch", "--num_processes", "2", "--num_machines", "2", "--machine_rank",
                        "0", "--main_process_ip", "no-such-host.invalid", "--main_process_port",
                        "29500", "/bin/true"}};
       }},
      {"MalformedYamlConfig",
       "`difftrain launch --config_file FILE /bin/true` where FILE has an unclosed `[`",
       "config file <tmp>/bad.yaml: line 2: invalid YAML (end of sequence flow not found): fix "
       "it or rewrite it with `difftrain config`",
       1,
       [](const std::string& t) {
         write_text(t + "/bad.yaml", "num_processes: [1\nmixed_precision: no\n");
         return BadRun{{"launch", "--config_file", t + "/bad.yaml", "/bin/true"}};
       }},
      {"AccelerateConfigWrongType",
       "`difftrain launch --config_file FILE /bin/true` with `num_processes: two`",
       "config file <tmp>/config.yaml: num_processes must be a whole number, got 'two': fix it "
       "or run `difftrain config`",
       1,
       [](const std::string& t) {
         write_text(t + "/config.yaml", "num_processes: two\n");
         return BadRun{{"launch", "--config_file", t + "/config.yaml", "/bin/true"}};
       }},
      {"MissingConfigFile", "`difftrain launch --config_file MISSING /bin/true`",
       "config file <tmp>/none.yaml cannot be read: no such file: check the path or create it "
       "with `difftrain config`",
       1,
       [](const std::string& t) {
         return BadRun{{"launch", "--config_file", t + "/none.yaml", "/bin/true"}};
       }},
      {"MalformedDeepSpeedJson",
       "`difftrain launch --deepspeed_config_file FILE /bin/true` with a trailing comma",
       "DeepSpeed config <tmp>/ds.json: invalid JSON at byte 35 ([json.exception.parse_error.101] "
       "parse error at line 1, column 35: syntax error while parsing object key - unexpected "
       "'}'; expected string literal); fix the file",
       1,
       [](const std::string& t) {
         write_text(t + "/ds.json", "{\"zero_optimization\": {\"stage\": 2,}\n");
         return BadRun{{"launch", "--deepspeed_config_file", t + "/ds.json", "/bin/true"}};
       }},
      // ------------------------------------------------------------------ tokenizer
      {"TokenizerWithoutMerges",
       "`difftrain tokenize --model DIR --prompt 'a cat'` where DIR (a CLIP tokenizer folder) has "
       "no merges.txt",
       "cannot open '<tmp>/tokenizer/merges.txt': a CLIP tokenizer folder needs vocab.json and "
       "merges.txt (as CLIPTokenizer.save_pretrained writes them)",
       1,
       [](const std::string& t) {
         copy_folder(kSd + "/tokenizer", t + "/tokenizer");
         fs::remove(t + "/tokenizer/merges.txt");
         return BadRun{{"tokenize", "--model", t + "/tokenizer", "--prompt", "a cat"}};
       }},
      {"ChatTemplateWithAnUnclosedBlock",
       "`difftrain tokenize --model DIR --prompt 'a cat' --chat_template` where DIR (a Qwen2 "
       "tokenizer folder) has a chat_template whose `{% if %}` is never closed",
       "<tmp>/tokenizer/tokenizer_config.json: chat template line 2: the template ends inside a "
       "block: expected `{% endif %}`: fix the template (tokenizer_config.json's chat_template or "
       "chat_template.jinja)",
       1,
       [](const std::string& t) {
         copy_folder(kGolden + "/z_image/tokenizer", t + "/tokenizer");
         const std::string config = t + "/tokenizer/tokenizer_config.json";
         auto j = nlohmann::json::parse(read_bytes(config));
         j["chat_template"] = "{{ messages[0].content }}\n{% if add_generation_prompt %}x";
         write_text(config, j.dump(2));
         return BadRun{
             {"tokenize", "--model", t + "/tokenizer", "--prompt", "a cat", "--chat_template"}};
       }},
      // ------------------------------------------------------------------ output folders
      {"OutputDirIsThePretrainedFolder",
       "`difftrain train --pretrained_model_name_or_path DIR ... --output_dir DIR` (a UNet folder)",
       "--output_dir '<tmp>/model' is the same folder as --pretrained_model_name_or_path "
       "'<tmp>/model': the run writes (and with --overwrite_output_dir deletes) files there; pass "
       "an --output_dir outside every input folder",
       1,
       [](const std::string& t) {
         copy_folder(kGolden + "/diffusers/unet2d_uncond", t + "/model");
         auto cmd = tiny_train(t, {});
         cmd[1] = "--pretrained_model_name_or_path";
         cmd[2] = t + "/model";
         *(std::find(cmd.begin(), cmd.end(), "--output_dir") + 1) = t + "/model";
         return BadRun{cmd};
       }},
      {"OutputDirInsideTheDataFolder",
       "`difftrain train --dataset imagefolder --train_data_dir DATA ... --output_dir DATA/run`",
       "--output_dir '<tmp>/data/run' lies inside --train_data_dir '<tmp>/data': the run writes "
       "(and with --overwrite_output_dir deletes) files there; pass an --output_dir outside every "
       "input folder",
       1,
       [](const std::string& t) {
         auto cmd = folder_train(t, image_folder(t, {}));
         *(std::find(cmd.begin(), cmd.end(), "--output_dir") + 1) = t + "/data/run";
         return BadRun{cmd};
       }},
      {"OutputDirHoldsAFinishedRun",
       "`difftrain train ...` again into the --output_dir of a finished run, without "
       "--resume_from_checkpoint or --overwrite_output_dir",
       "--output_dir '<tmp>/out' already holds files (README.md, checkpoint-1, logs, ... (7 "
       "entries)); continue that run with --resume_from_checkpoint latest, pass "
       "--overwrite_output_dir to delete them first, or pick another --output_dir",
       1,
       [](const std::string& t) {
         const auto first = run([&] {
           std::vector<std::string> a = {kDifftrain};
           for (auto& s : tiny_train(t, {})) a.push_back(s);
           return a;
         }());
         EXPECT_EQ(first.exit_code, 0) << first.log();
         return BadRun{tiny_train(t, {})};
       }},
      // ------------------------------------------------------------------ issue 56
      {"KohyaOptionName", "`difftrain train ... --network_dim 16` (kohya sd-scripts' name)",
       "--network_dim: \"network_dim\" is another tool's option (kohya sd-scripts, SimpleTuner); "
       "difftrain's is --rank (the LoRA rank) (difftrain train --help lists them)",
       1,
       [](const std::string& t) {
         return BadRun{tiny_train(t, {"--network_dim", "16"})};
       }},
      {"SdxlLoraForFlux",
       "`difftrain sample --model tests/golden/flux/tiny_flux --lora "
       "tests/golden/sdxl/tiny_sdxl_lora/pytorch_lora_weights.safetensors --prompt a`",
       "LoRA <golden>/sdxl/tiny_sdxl_lora/pytorch_lora_weights.safetensors has no transformer "
       "targets (12 text_encoder, 18 text_encoder_2, 132 unet): it is a sdxl LoRA, not one for "
       "<golden>/flux/tiny_flux (flux family); give a LoRA trained on this model's family",
       1,
       [](const std::string& t) {
         return BadRun{{"sample", "--model", kGolden + "/flux/tiny_flux", "--lora",
                        kGolden + "/sdxl/tiny_sdxl_lora/pytorch_lora_weights.safetensors",
                        "--prompt", "a", "--num_inference_steps", "1", "--output", t + "/s.png"}};
       }},
      {"LoraConvertOntoItsInput",
       "`difftrain lora convert --input L.safetensors --output L.safetensors --to kohya`",
       "--output <tmp>/l.safetensors is the --input file; write the converted LoRA to a new file "
       "(the input is not overwritten)",
       1,
       [](const std::string& t) {
         std::filesystem::copy_file(
             kGolden + "/flux/tiny_flux_lora/pytorch_lora_weights.safetensors",
             t + "/l.safetensors");
         return BadRun{{"lora", "convert", "--input", t + "/l.safetensors", "--output",
                        t + "/l.safetensors", "--to", "kohya"}};
       }},
      // ------------------------------------------------------------------ issue 61: epochs
      {"SaveEveryNEpochsZero", "`difftrain train ... --save_every_n_epochs 0`",
       "--save_every_n_epochs must be at least 1, got 0 (leave it out, or null, for none)", 1,
       [](const std::string& t) {
         return BadRun{tiny_train(t, {"--save_every_n_epochs", "0"})};
       }},
      {"SaveLastNEpochsWithoutEpochSaves",
       "`difftrain train ... --save_last_n_epochs 3` without --save_every_n_epochs",
       "--save_last_n_epochs keeps the newest epoch saves, and this run makes none: add "
       "--save_every_n_epochs N (or use --checkpoints_total_limit for checkpoint-<step> folders)",
       1,
       [](const std::string& t) {
         return BadRun{tiny_train(t, {"--save_last_n_epochs", "3"})};
       }},
      {"ValidationEpochsNegative", "`difftrain train ... --validation_epochs -1`",
       "--validation_epochs must be at least 1, got -1 (leave it out, or null, for none)", 1,
       [](const std::string& t) {
         return BadRun{tiny_train(t, {"--validation_epochs", "-1"})};
       }},
  };
  static const std::vector<Case> kAll = [] {
    std::vector<Case> all = kCases;
    for (const Case& c : family_error_cases()) all.push_back(c);
    return all;
  }();
  return kAll;
}

}  // namespace difftrain::testing
