// Training-step time of every 3x3 stride-1 convolution shape of the built-in Fashion-MNIST UNet
// (batch 16, 32x32), side by side in one run: models::Conv2d's forward + backward with LibTorch's
// convolution (oneDNN's direct algorithm) and with difftrain's Winograd path
// (models/winograd_conv.h). Rounds alternate between the two so machine noise hits them alike;
// per shape the median of each is printed, then the sum weighted by how often the UNet runs the
// shape in one step, and the ratio.
//
//   build/bench/bench_conv [--batch 16] [--rounds 5] [--steps 10]

#include "difftrain/distributed/process_group.h"
#include "difftrain/models/kernels/winograd_conv.h"
#include "difftrain/models/linear.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

namespace {

struct Layer {
  int64_t in, out, size, count;  // count: how many such layers one UNet step runs
};

// The default UNet (block_out_channels 32/64/64, one layer per block, attention at 8x8): its
// ResnetBlock2D convolutions, the upsamplers' convolutions, and the 1-channel conv_in / conv_out
// (which keep the direct algorithm: not a multiple of 16 channels).
const std::vector<Layer> kLayers = {{1, 32, 32, 1},   {32, 32, 32, 4}, {32, 64, 16, 1},
                                    {64, 64, 16, 4},  {64, 64, 8, 8},  {128, 64, 8, 2},
                                    {128, 64, 16, 1}, {96, 64, 16, 1}, {64, 64, 32, 1},
                                    {96, 32, 32, 1},  {64, 32, 32, 1}, {32, 1, 32, 1}};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// ms per forward + backward of `conv` on x (input gradient too, as inside a UNet)
double time_step(difftrain::models::Conv2d& conv, const torch::Tensor& x, int64_t steps) {
  auto once = [&] {
    auto xi = x.detach().requires_grad_(x.size(1) > 1);
    conv->forward(xi).sum().backward();
  };
  once();
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < steps; ++i) once();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
             .count() /
         static_cast<double>(steps);
}

}  // namespace

int main(int argc, char** argv) {
  // Threads and glibc's allocator as every difftrain program sets them (OMP_NUM_THREADS).
  difftrain::distributed::configure_threads();
  int64_t batch = 16, rounds = 5, steps = 10;
  for (int i = 1; i + 1 < argc; i += 2) {
    const int64_t v = std::stoll(argv[i + 1]);
    if (std::strcmp(argv[i], "--batch") == 0) batch = v;
    if (std::strcmp(argv[i], "--rounds") == 0) rounds = v;
    if (std::strcmp(argv[i], "--steps") == 0) steps = v;
  }
  fmt::print("{}; {} thread(s); batch {}, {} rounds x {} steps\n",
             difftrain::models::winograd_conv_status(), torch::get_num_threads(), batch, rounds,
             steps);
  fmt::print("{:>12} {:>6} | {:>10} {:>10} {:>7}\n", "layer", "count", "direct ms", "winograd",
             "ratio");
  double total_direct = 0, total_wino = 0;
  for (const auto& l : kLayers) {
    torch::manual_seed(0);
    difftrain::models::Conv2d conv(torch::nn::Conv2dOptions(l.in, l.out, 3).padding(1));
    auto x = torch::randn({batch, l.in, l.size, l.size});
    std::vector<double> direct, wino;
    for (int64_t r = 0; r < rounds; ++r) {
      difftrain::models::set_winograd_conv_enabled(false);
      direct.push_back(time_step(conv, x, steps));
      difftrain::models::set_winograd_conv_enabled(true);
      wino.push_back(time_step(conv, x, steps));
    }
    const double d = median(direct), w = median(wino);
    total_direct += d * static_cast<double>(l.count);
    total_wino += w * static_cast<double>(l.count);
    fmt::print("{:>12} {:>6} | {:>10.2f} {:>10.2f} {:>6.2f}x\n",
               fmt::format("{}->{} {}px", l.in, l.out, l.size), l.count, d, w, d / w);
  }
  fmt::print("{:>12} {:>6} | {:>10.2f} {:>10.2f} {:>6.2f}x\n", "one step", "", total_direct,
             total_wino, total_direct / total_wino);
  return 0;
}
