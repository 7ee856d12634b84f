// Checkpoint I/O and what its checksums cost. A model of --mb MiB of fp32 parameters with AdamW
// state (so a checkpoint of about 3 x --mb MiB) is saved with Accelerator::save_state and loaded
// with load_state, and the manifest's two parts are timed alone: writing checksums.json (a CRC32
// pass over every file) and verifying it. The variants run interleaved for --rounds rounds and
// the medians are printed, with the ratios that matter:
//   manifest / save          the share of a save spent on checksums (save includes it);
//   load verified / load     what verification adds to a resume.
// Files stay in the page cache between steps, so reads are the best case; saves fsync each file.
//
//   bench_checkpoint_io [--mb 256] [--rounds 5] [--dir /tmp]

#include "difftrain/accel/accelerator.h"
#include "difftrain/accel/checkpoint_manifest.h"
#include "difftrain/optim/adamw.h"

#include <torch/torch.h>

#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace {

double seconds(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> args;
  for (int i = 1; i + 1 < argc; i += 2) args[std::string(argv[i]).substr(2)] = argv[i + 1];
  const int64_t mb = args.count("mb") ? std::stoll(args["mb"]) : 256;
  const int rounds = args.count("rounds") ? std::stoi(args["rounds"]) : 5;
  const std::string root = args.count("dir") ? args["dir"] : "/tmp";
  const std::string dir = root + "/bench_checkpoint_io_" + std::to_string(::getpid());

  difftrain::accel::Accelerator acc;
  // Square layers of 1024 x 1024 fp32 (4 MiB each).
  torch::nn::Sequential net;
  for (int64_t i = 0; i < std::max<int64_t>(1, mb / 4); ++i)
    net->push_back(torch::nn::Linear(1024, 1024));
  auto opt = std::make_shared<difftrain::optim::AdamW>(net->parameters());
  auto [model, optimizer] = acc.prepare(net, opt);
  // One step, so the optimizer has its moments to save.
  model->forward(torch::randn({2, 1024})).sum().backward();
  optimizer->step();

  std::map<std::string, std::vector<double>> t;
  for (int r = 0; r < rounds; ++r) {
    t["save"].push_back(seconds([&] { acc.save_state(dir); }));
    t["manifest"].push_back(seconds([&] { difftrain::accel::write_checkpoint_manifest(dir); }));
    t["verify"].push_back(seconds([&] { difftrain::accel::verify_checkpoint(dir); }));
    t["load"].push_back(seconds([&] { acc.load_state(dir, false); }));
    t["load_verified"].push_back(seconds([&] { acc.load_state(dir, true); }));
  }
  uintmax_t bytes = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) bytes += e.file_size();
  }
  std::filesystem::remove_all(dir);

  const double mib = static_cast<double>(bytes) / (1 << 20);
  std::printf("checkpoint of %.0f MiB, %d rounds, medians:\n", mib, rounds);
  for (const char* k : {"save", "manifest", "verify", "load", "load_verified"}) {
    std::printf("  %-14s %8.3f s  %8.0f MiB/s\n", k, median(t[k]), mib / median(t[k]));
  }
  std::printf("manifest / save          %.3f\n", median(t["manifest"]) / median(t["save"]));
  std::printf("load verified / load     %.3f\n", median(t["load_verified"]) / median(t["load"]));
  return 0;
}
