// Sharded tensor checkpoints: tensors of several shapes and dtypes split unevenly over 2 and 3
// ranks read back bit-identical, whole and as any element range; a checkpoint written by 2 ranks
// is read by 3; a gap, an overlap, a missing or truncated shard file, a missing key and a wrong
// dtype each give a one-line error naming the file and the tensor.

#include "difftrain/io/sharded_tensors.h"
#include "difftrain/core/error.h"
#include "difftrain/io/safetensors.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>

namespace {

using difftrain::test::error_of;
using difftrain::test::read_json;
using difftrain::test::temp_dir;

namespace fs = std::filesystem;
namespace io = difftrain::io;

#define EXPECT_ONE_LINE(text) \
  EXPECT_EQ(std::string(text).find('\n'), std::string::npos) << "not one line: " << (text)

using Range = std::pair<int64_t, int64_t>;  // [begin, end); begin == end: the rank has no piece

// The whole tensors the tests shard: fp32, bf16 and int64, 4-D, 1-D, 2-D, 0-D and empty.
io::TensorMap sample_tensors() {
  torch::manual_seed(3);
  io::TensorMap t;
  t["unet.conv_in.weight"] = torch::randn({4, 3, 3, 3});
  t["unet.norm.bias"] = torch::randn({5}).to(torch::kBFloat16);
  t["optimizer.step"] =
      torch::tensor(std::vector<int64_t>{int64_t{1} << 40, -7, 3, 0, int64_t{1} << 62, -1})
          .view({2, 3});
  t["unet.small"] = torch::randn({2, 2});
  t["scale"] = torch::tensor(2.5f);                    // 0-D, one element
  t["empty"] = torch::empty({0, 3}, torch::kFloat32);  // no elements, no pieces
  return t;
}

// FSDP-style even split with the remainder on the last ranks: ceil(numel / world) per rank, the
// last ranges clipped at numel (possibly empty).
std::vector<Range> even_split(int64_t numel, int world) {
  const int64_t chunk = (numel + world - 1) / world;
  std::vector<Range> out;
  for (int r = 0; r < world; ++r) {
    out.emplace_back(std::min<int64_t>(r * chunk, numel),
                     std::min<int64_t>((r + 1) * chunk, numel));
  }
  return out;
}

// Uneven layouts: a rank with no piece of some tensors, ranges ending exactly at numel.
std::map<std::string, std::vector<Range>> layout(int world) {
  if (world == 2) {
    return {{"unet.conv_in.weight", {{0, 70}, {70, 108}}},
            {"unet.norm.bias", {{0, 0}, {0, 5}}},  // rank 0 holds none of it
            {"optimizer.step", {{0, 1}, {1, 6}}},
            {"unet.small", even_split(4, 2)},
            {"scale", {{0, 1}, {1, 1}}},
            {"empty", {{0, 0}, {0, 0}}}};
  }
  return {{"unet.conv_in.weight", even_split(108, 3)},
          {"unet.norm.bias", {{0, 2}, {2, 4}, {4, 5}}},
          {"optimizer.step", {{0, 0}, {0, 4}, {4, 6}}},
          {"unet.small", even_split(4, 3)},  // [0,2) [2,4) [4,4): rank 2 has none
          {"scale", {{0, 0}, {0, 0}, {0, 1}}},
          {"empty", {{0, 0}, {0, 0}, {0, 0}}}};
}

// Writes `tensors` as `world` ranks would, each its own shard, then the index.
void write_checkpoint(const std::string& dir, const io::TensorMap& tensors, int world,
                      const std::map<std::string, std::vector<Range>>& ranges,
                      const nlohmann::json& metadata = {}) {
  std::map<std::string, io::ShardedTensorInfo> infos;
  for (int r = 0; r < world; ++r) {
    std::vector<io::TensorPiece> pieces;
    for (const auto& [name, t] : tensors) {
      const auto [b, e] = ranges.at(name)[r];
      auto& info = infos[name];
      info.shape = t.sizes().vec();
      info.dtype = t.scalar_type();
      if (b == e) continue;
      pieces.push_back({name, b, e, t.reshape({-1}).slice(0, b, e).clone()});
      info.pieces.push_back({io::shard_file_name("model", r, world), b, e});
    }
    io::write_tensor_shard(dir, "model", r, world, pieces);
  }
  io::write_shard_index(dir, "model", world, infos, metadata);
}

void write_json(const std::string& path, const nlohmann::json& j) { std::ofstream(path) << j; }

TEST(ShardedTensors, FileNamesFollowDiffusersShardNaming) {
  EXPECT_EQ(io::shard_file_name("model", 0, 2), "model-00001-of-00002.safetensors");
  EXPECT_EQ(io::shard_file_name("model_1", 2, 3), "model_1-00003-of-00003.safetensors");
  EXPECT_HAS(error_of([] { io::shard_file_name("model", 2, 2); }), "rank 2 of world 2");
  EXPECT_HAS(error_of([] { io::shard_file_name("model", 0, 0); }), "rank 0 of world 0");
}

TEST(ShardedTensors, WholeTensorsReadBackBitIdentical) {
  const auto tensors = sample_tensors();
  for (int world : {2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    const auto dir = temp_dir("sharded_whole_" + std::to_string(world));
    write_checkpoint(dir, tensors, world, layout(world), {{"lora", false}, {"step", 12}});
    EXPECT_TRUE(io::has_sharded_tensors(dir, "model"));
    EXPECT_FALSE(io::has_sharded_tensors(dir, "model_1"));

    io::ShardedTensorReader reader(dir, "model");
    EXPECT_EQ(reader.num_shards(), world);
    EXPECT_EQ(reader.metadata().at("step"), 12);
    const std::vector<std::string> names = {
        "empty", "optimizer.step", "scale", "unet.conv_in.weight", "unet.norm.bias", "unet.small"};
    EXPECT_EQ(reader.names(), names);
    for (const auto& [name, t] : tensors) {
      SCOPED_TRACE(name);
      ASSERT_TRUE(reader.has(name));
      EXPECT_EQ(reader.info(name).shape, t.sizes().vec());
      EXPECT_EQ(reader.info(name).dtype, t.scalar_type());
      const auto got = reader.read(name);
      EXPECT_EQ(got.sizes(), t.sizes());
      EXPECT_EQ(got.scalar_type(), t.scalar_type());
      EXPECT_TRUE(torch::equal(got, t));
    }
    const auto all = reader.read_all();
    ASSERT_EQ(all.size(), tensors.size());
    for (const auto& [name, t] : tensors) EXPECT_TRUE(torch::equal(all.at(name), t)) << name;
    EXPECT_FALSE(reader.has("nope"));
    EXPECT_HAS(error_of([&] { reader.info("nope"); }), "no tensor 'nope'");

    // The index is Transformers-compatible and each shard file records its ranges.
    const auto index = read_json(dir + "/model.index.json");
    EXPECT_EQ(index.at("format"), "difftrain-sharded");
    EXPECT_EQ(index.at("version"), 1);
    EXPECT_EQ(index.at("num_shards"), world);
    EXPECT_EQ(index.at("tensors").at("unet.norm.bias").at("dtype"), "BF16");
    EXPECT_EQ(index.at("weight_map").at("unet.norm.bias"),
              io::shard_file_name("model", world == 2 ? 1 : 0, world));
    const auto last =
        io::load_safetensors(dir + "/" + io::shard_file_name("model", world - 1, world));
    EXPECT_EQ(last.metadata.at("format"), "difftrain-sharded");
    EXPECT_EQ(last.metadata.at("unet.conv_in.weight"), world == 2 ? "70:108" : "72:108");
    EXPECT_EQ(last.tensors.at("unet.conv_in.weight").dim(), 1);
    EXPECT_EQ(last.tensors.count("unet.small"), world == 2 ? 1u : 0u);
    fs::remove_all(dir);
  }
}

TEST(ShardedTensors, ReadRangeAcrossPieceBoundaries) {
  const auto tensors = sample_tensors();
  const auto dir = temp_dir("sharded_range");
  write_checkpoint(dir, tensors, 3, layout(3));
  io::ShardedTensorReader reader(dir, "model");
  int checked = 0;
  for (const auto& [name, t] : tensors) {
    const auto flat = t.reshape({-1});
    const int64_t n = flat.numel();
    // Every range of the small tensors; for the 108-element one, ends next to its piece
    // boundaries (multiples of 36) and every 7th element.
    std::vector<int64_t> ends;
    for (int64_t p = 0; p <= n; ++p) {
      if (n <= 20 || p % 36 <= 1 || p % 36 == 35 || p % 7 == 0) ends.push_back(p);
    }
    for (size_t i = 0; i < ends.size(); ++i) {
      for (size_t j = i; j < ends.size(); ++j) {
        const int64_t b = ends[i], e = ends[j];
        const auto got = reader.read_range(name, b, e);
        ASSERT_EQ(got.dim(), 1);
        ASSERT_TRUE(torch::equal(got, flat.slice(0, b, e)))
            << name << " [" << b << ", " << e << ")";
        ++checked;
      }
    }
  }
  std::printf("read_range: %d ranges bit-identical\n", checked);
  EXPECT_GT(checked, 300);
  const auto msg = error_of([&] { reader.read_range("unet.small", 2, 5); });
  EXPECT_HAS(msg, "range [2, 5) of tensor 'unet.small' is outside its 4 elements");
  EXPECT_HAS(error_of([&] { reader.read_range("unet.small", 3, 2); }), "[3, 2)");
  EXPECT_HAS(error_of([&] { reader.read_range("nope", 0, 1); }), "no tensor 'nope'");
  fs::remove_all(dir);
}

TEST(ShardedTensors, ReshardTwoRanksToThree) {
  const auto tensors = sample_tensors();
  const auto dir = temp_dir("sharded_reshard");
  write_checkpoint(dir, tensors, 2, layout(2));
  for (const auto& [name, t] : tensors) {
    const auto ranges = even_split(t.numel(), 3);
    std::vector<torch::Tensor> parts;
    for (int r = 0; r < 3; ++r) {  // each new rank has its own reader, as separate processes do
      io::ShardedTensorReader reader(dir, "model");
      parts.push_back(reader.read_range(name, ranges[r].first, ranges[r].second));
      EXPECT_EQ(parts.back().numel(), ranges[r].second - ranges[r].first);
    }
    EXPECT_TRUE(torch::equal(torch::cat(parts).view(t.sizes()), t)) << name;
  }
  fs::remove_all(dir);
}

TEST(ShardedTensors, ConcurrentReadsShareOneReader) {
  const auto tensors = sample_tensors();
  const auto dir = temp_dir("sharded_threads");
  write_checkpoint(dir, tensors, 3, layout(3));
  io::ShardedTensorReader reader(dir, "model");
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&] {
      for (const auto& [name, t] : reader.read_all()) bad += !torch::equal(t, tensors.at(name));
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  fs::remove_all(dir);
}

TEST(ShardedTensors, WriterRejectsBadPieces) {
  const auto dir = temp_dir("sharded_writer");
  io::ShardedTensorInfo info;
  info.shape = {10};
  info.pieces = {{"model-00001-of-00002.safetensors", 0, 4},
                 {"model-00002-of-00002.safetensors", 5, 10}};
  auto msg = error_of([&] { io::write_shard_index(dir, "model", 2, {{"w", info}}); });
  EXPECT_HAS(msg, "tensor 'w' has a gap: elements [4, 5) are in no piece");
  info.pieces[1].begin = 3;
  msg = error_of([&] { io::write_shard_index(dir, "model", 2, {{"w", info}}); });
  EXPECT_HAS(msg, "tensor 'w' has overlapping pieces [0, 4)");
  info.pieces[1] = {"model-00002-of-00002.safetensors", 4, 11};
  msg = error_of([&] { io::write_shard_index(dir, "model", 2, {{"w", info}}); });
  EXPECT_HAS(msg, "outside its 10 elements");
  EXPECT_FALSE(fs::exists(dir + "/model.index.json"));

  msg = error_of([&] {
    io::write_tensor_shard(dir, "model", 0, 2, {{"w", 0, 4, torch::zeros({3})}});
  });
  EXPECT_HAS(msg, "piece [0, 4) of 'w' holds 3 elements");
  msg = error_of([&] {
    io::write_tensor_shard(dir, "model", 0, 2,
                           {{"w", 0, 2, torch::zeros({2})}, {"w", 2, 4, torch::zeros({2})}});
  });
  EXPECT_HAS(msg, "two pieces of tensor 'w'");
  EXPECT_FALSE(fs::exists(dir + "/model-00001-of-00002.safetensors"));
  fs::remove_all(dir);
}

// A valid 2-rank checkpoint, damaged by `damage`, must fail with a message holding `parts`.
void expect_damage_reported(const std::string& tag,
                            const std::function<void(const std::string& dir)>& damage,
                            const std::vector<std::string>& parts) {
  SCOPED_TRACE(tag);
  const auto dir = temp_dir("sharded_" + tag);
  write_checkpoint(dir, sample_tensors(), 2, layout(2));
  damage(dir);
  const auto msg = error_of([&] { io::ShardedTensorReader(dir, "model").read_all(); });
  std::printf("%s: %s\n", tag.c_str(), msg.c_str());
  EXPECT_ONE_LINE(msg);
  for (const auto& p : parts) EXPECT_HAS(msg, p);
  fs::remove_all(dir);
}

TEST(ShardedTensors, DamagedCheckpointsGiveOneLineErrors) {
  const std::string rank0 = "model-00001-of-00002.safetensors";
  const std::string rank1 = "model-00002-of-00002.safetensors";
  auto edit_index = [](const std::string& dir, const std::function<void(nlohmann::json&)>& f) {
    auto j = read_json(dir + "/model.index.json");
    f(j);
    write_json(dir + "/model.index.json", j);
  };
  expect_damage_reported("gap",
                         [&](const std::string& dir) {
                           edit_index(dir, [](auto& j) {
                             j["tensors"]["unet.conv_in.weight"]["pieces"][0]["end"] = 60;
                           });
                         },
                         {"model.index.json", "tensor 'unet.conv_in.weight'",
                          "gap: elements [60, 70)", "resume from an earlier checkpoint"});
  expect_damage_reported("overlap",
                         [&](const std::string& dir) {
                           edit_index(dir, [](auto& j) {
                             j["tensors"]["unet.conv_in.weight"]["pieces"][0]["end"] = 80;
                           });
                         },
                         {"model.index.json", "tensor 'unet.conv_in.weight'",
                          "overlapping pieces [0, 80)", "[70, 108)"});
  expect_damage_reported("missing_file",
                         [&](const std::string& dir) { fs::remove(dir + "/" + rank1); },
                         {rank1, "shard file is missing", "resume from an earlier checkpoint"});
  expect_damage_reported(
      "truncated",
      [&](const std::string& dir) {
        fs::resize_file(dir + "/" + rank0, fs::file_size(dir + "/" + rank0) - 13);
      },
      {rank0, "cannot be read", "truncated", "resume from an earlier checkpoint"});
  expect_damage_reported("missing_key",
                         [&](const std::string& dir) {
                           // Rank 1 re-written without its piece of unet.norm.bias (the
                           // index still lists it).
                           auto f = io::load_safetensors(dir + "/" + rank1);
                           f.tensors.erase("unet.norm.bias");
                           io::save_safetensors(dir + "/" + rank1, f.tensors, f.metadata);
                         },
                         {rank1, "tensor 'unet.norm.bias' is missing from this shard file",
                          "resume from an earlier checkpoint"});
  expect_damage_reported("wrong_dtype",
                         [&](const std::string& dir) {
                           auto f = io::load_safetensors(dir + "/" + rank0);
                           f.tensors["unet.conv_in.weight"] =
                               f.tensors["unet.conv_in.weight"].to(torch::kFloat64);
                           io::save_safetensors(dir + "/" + rank0, f.tensors, f.metadata);
                         },
                         {rank0, "tensor 'unet.conv_in.weight' is F64 here but F32 in the index"});
  expect_damage_reported(
      "wrong_count",
      [&](const std::string& dir) {
        auto f = io::load_safetensors(dir + "/" + rank0);
        f.tensors["unet.conv_in.weight"] = f.tensors["unet.conv_in.weight"].slice(0, 0, 69);
        io::save_safetensors(dir + "/" + rank0, f.tensors, f.metadata);
      },
      {rank0, "tensor 'unet.conv_in.weight' has 69 elements here but its piece [0, 70) has 70"});
  expect_damage_reported("bad_shape",
                         [&](const std::string& dir) {
                           edit_index(dir, [](auto& j) {
                             j["tensors"]["unet.small"]["shape"] = {1LL << 40, 1LL << 40};
                           });
                         },
                         {"model.index.json", "tensor 'unet.small'", "exceeds 2^56"});
  expect_damage_reported("bad_dtype",
                         [&](const std::string& dir) {
                           edit_index(dir,
                                      [](auto& j) { j["tensors"]["unet.small"]["dtype"] = "F8"; });
                         },
                         {"model.index.json", "tensor 'unet.small' has dtype \"F8\""});
  expect_damage_reported(
      "escaping_file",
      [&](const std::string& dir) {
        edit_index(dir, [](auto& j) {
          j["tensors"]["unet.small"]["pieces"][0]["file"] = "../x.safetensors";
        });
      },
      {"tensor 'unet.small'", "'../x.safetensors', which is not a file name inside the folder"});
  expect_damage_reported("no_index",
                         [&](const std::string& dir) { fs::remove(dir + "/model.index.json"); },
                         {"model.index.json: no such file"});
}

}  // namespace
