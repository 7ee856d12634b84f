// Fuzzes io::ShardedTensorReader: each input is the <stem>.index.json of a scratch checkpoint
// folder that holds two real shards of tensors "w" [2, 3] and "b" [4] (written once); every
// tensor the index lists is then read through it.
#include "difftrain/io/sharded_tensors.h"
#include "fuzz_files.h"
#include "fuzz_util.h"

#include <torch/torch.h>

namespace {
std::string dir;
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  difftrain::fuzz::init_torch();
  using difftrain::io::TensorPiece;
  dir = difftrain::fuzz::scratch_dir() + "/ckpt";
  const auto w = torch::arange(6, torch::kFloat32), b = torch::arange(4, torch::kFloat32);
  difftrain::io::write_tensor_shard(
      dir, "model", 0, 2, {TensorPiece{"w", 0, 4, w.slice(0, 0, 4)}, TensorPiece{"b", 0, 4, b}});
  difftrain::io::write_tensor_shard(dir, "model", 1, 2, {TensorPiece{"w", 4, 6, w.slice(0, 4, 6)}});
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return difftrain::fuzz::run_one(data, size, [](std::string_view bytes) {
    difftrain::fuzz::write_scratch("ckpt/model.index.json", bytes);
    difftrain::io::ShardedTensorReader reader(dir, "model");
    for (const auto& name : reader.names()) {
      (void)reader.read(name).sum();
      (void)reader.read_range(name, 0, 1);
    }
  });
}
