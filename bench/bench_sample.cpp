// Sampling speed of the fixture UNet2DModel (tests/golden/diffusers/unet2d_uncond, DDIM, 10
// steps) side by side in one run: images/s for several batch sizes and intra-op thread counts,
// reported as ratios to one image at a time on one thread. This is the loop `difftrain sample`
// runs (families::unet::sample_images).
//
//   build/bench/bench_sample [--model DIR] [--steps 10] [--rounds 3] [--batches 1,4,16]
//                            [--threads 1,2]

#include "difftrain/distributed/process_group.h"
#include "difftrain/families/unet/pipeline.h"
#include "difftrain/models/pretrained.h"
#include "source_dir.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::vector<int64_t> parse_list(const char* text) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::stoll(item));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model =
      std::string(difftrain_test::source_dir()) + "/tests/golden/diffusers/unet2d_uncond";
  int64_t steps = 10, rounds = 3;
  std::vector<int64_t> batches = {1, 4, 16}, threads = {1, 2};
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--model")) model = argv[i + 1];
    if (!std::strcmp(argv[i], "--steps")) steps = std::stoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--rounds")) rounds = std::stoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--batches")) batches = parse_list(argv[i + 1]);
    if (!std::strcmp(argv[i], "--threads")) threads = parse_list(argv[i + 1]);
  }
  // Side by side: glibc's allocator defaults first (what a plain LibTorch program gets), then
  // the tuning configure_threads() applies (distributed::configure_allocator).
  auto folder = difftrain::families::unet::resolve_pipeline_folder(model);
  auto unet = difftrain::models::load_unet(folder.unet_dir);
  auto scheduler = difftrain::diffusion::load_sampler(folder.scheduler_config, "ddim");
  std::printf("model %s, DDIM %lld steps, median of %lld rounds\n", model.c_str(),
              static_cast<long long>(steps), static_cast<long long>(rounds));
  std::printf(
      "| allocator | threads | images per batch | s / batch | images/s | vs glibc default, 1 "
      "thread, batch 1 |\n");
  std::printf("|---|---|---|---|---|---|\n");
  double base = 0;
  for (const char* tuning : {"0", "1"}) {
    setenv("DIFFTRAIN_MALLOC_TUNING", tuning, 1);
    for (int64_t t : threads) {
      setenv("DIFFTRAIN_NUM_THREADS", std::to_string(t).c_str(), 1);
      difftrain::distributed::configure_threads();
      for (int64_t b : batches) {
        difftrain::families::unet::SampleOptions o;
        o.num_images = b;
        o.num_inference_steps = steps;
        difftrain::families::unet::sample_images(*unet, *scheduler, o);  // warm-up
        std::vector<double> secs;
        for (int64_t r = 0; r < rounds; ++r) {
          o.seed = static_cast<uint64_t>(r);
          auto start = std::chrono::steady_clock::now();
          difftrain::families::unet::sample_images(*unet, *scheduler, o);
          secs.push_back(
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
        }
        std::sort(secs.begin(), secs.end());
        const double s = secs[secs.size() / 2];
        const double ips = b / s;
        if (base == 0) base = ips;
        std::printf("| %s | %lld | %lld | %.3f | %.1f | %.2fx |\n",
                    *tuning == '1' ? "tuned" : "glibc default", static_cast<long long>(t),
                    static_cast<long long>(b), s, ips, ips / base);
      }
    }
  }
  return 0;
}
