// Optimizer step time on a UNet-sized parameter set, side by side in one run:
//   torch::optim::AdamW    LibTorch's AdamW (about eight tensor ops per parameter)
//   difftrain AdamW        the fused flat-buffer pass
//   difftrain AdamW8bit    8-bit block-wise state
// The parameter shapes are those of a DDPM CIFAR-10 UNet2DModel (block_out_channels
// 128/256/256/256, two layers per block, attention at 16x16): ~36M parameters in ~280 tensors,
// as in Diffusers' train_unconditional.py. Rounds alternate between the optimizers so that
// machine noise hits them alike; the median step time of each is reported, with the ratios.
//
//   build/bench/bench_optim [--threads 1,2] [--rounds 7] [--steps 5]

#include "difftrain/optim/adamw.h"
#include "difftrain/optim/adamw8bit.h"

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

using Shape = std::vector<int64_t>;

void resnet(std::vector<Shape>& s, int64_t in, int64_t out, int64_t temb) {
  s.insert(s.end(), {{in},
                     {in},
                     {out, in, 3, 3},
                     {out},
                     {out, temb},
                     {out},
                     {out},
                     {out},
                     {out, out, 3, 3},
                     {out}});
  if (in != out) s.insert(s.end(), {{out, in, 1, 1}, {out}});
}

void attention(std::vector<Shape>& s, int64_t c) {
  s.insert(s.end(), {{c}, {c}});
  for (int i = 0; i < 4; ++i) s.insert(s.end(), {{c, c}, {c}});
}

std::vector<Shape> unet_shapes() {
  const std::vector<int64_t> ch = {128, 256, 256, 256};
  const std::vector<bool> attn = {false, true, false, false};
  const int64_t temb = 512;
  std::vector<Shape> s = {{128, 3, 3, 3}, {128}, {temb, 128}, {temb}, {temb, temb}, {temb}};
  std::vector<int64_t> skips = {128};
  int64_t c = 128;
  for (size_t l = 0; l < ch.size(); ++l) {
    for (int r = 0; r < 2; ++r) {
      resnet(s, c, ch[l], temb);
      c = ch[l];
      if (attn[l]) attention(s, c);
      skips.push_back(c);
    }
    if (l + 1 < ch.size()) {
      s.insert(s.end(), {{c, c, 3, 3}, {c}});
      skips.push_back(c);
    }
  }
  resnet(s, c, c, temb);
  attention(s, c);
  resnet(s, c, c, temb);
  for (int l = static_cast<int>(ch.size()) - 1; l >= 0; --l) {
    for (int r = 0; r < 3; ++r) {
      const int64_t skip = skips.back();
      skips.pop_back();
      resnet(s, c + skip, ch[l], temb);
      c = ch[l];
      if (attn[l]) attention(s, c);
    }
    if (l > 0) s.insert(s.end(), {{c, c, 3, 3}, {c}});
  }
  s.insert(s.end(), {{c}, {c}, {3, c, 3, 3}, {3}});
  return s;
}

std::vector<torch::Tensor> make_params(const std::vector<Shape>& shapes) {
  std::vector<torch::Tensor> out;
  for (const auto& shape : shapes) {
    auto p = torch::randn(shape).mul_(0.02).requires_grad_(true);
    p.mutable_grad() = torch::randn(shape).mul_(1e-3);
    out.push_back(p);
  }
  return out;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::vector<int> parse_list(const std::string& text) {
  std::vector<int> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::stoi(item));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> threads = {1, 2};
  int rounds = 7, steps = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--threads"))
      threads = parse_list(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--rounds"))
      rounds = std::stoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--steps"))
      steps = std::stoi(argv[i + 1]);
  }
  torch::manual_seed(0);
  const auto shapes = unet_shapes();
  int64_t numel = 0;
  for (const auto& s : shapes) numel += c10::multiply_integers(s);
  std::printf("parameter set: %zu tensors, %.2fM parameters (DDPM CIFAR-10 UNet2DModel shapes)\n",
              shapes.size(), numel / 1e6);

  auto p_torch = make_params(shapes), p_fused = make_params(shapes), p_8bit = make_params(shapes);
  torch::optim::AdamW torch_adamw(p_torch, torch::optim::AdamWOptions(1e-4));
  difftrain::optim::AdamW fused(p_fused, torch::optim::AdamWOptions(1e-4));
  difftrain::optim::AdamW8bit eight(p_8bit, torch::optim::AdamWOptions(1e-4));
  std::vector<std::pair<const char*, torch::optim::Optimizer*>> opts = {
      {"torch::optim::AdamW", &torch_adamw},
      {"difftrain AdamW", &fused},
      {"difftrain AdamW8bit", &eight}};

  std::printf(
      "\n| threads | optimizer | ms / step (median of %d rounds x %d steps) | vs "
      "torch::optim::AdamW |\n",
      rounds, steps);
  std::printf("|---|---|---|---|\n");
  for (int t : threads) {
    at::set_num_threads(t);
    std::vector<std::vector<double>> ms(opts.size());
    for (auto& [name, opt] : opts) opt->step();  // warm-up; allocates state
    for (int r = 0; r < rounds; ++r) {
      for (size_t k = 0; k < opts.size(); ++k) {
        auto start = std::chrono::steady_clock::now();
        for (int s = 0; s < steps; ++s) opts[k].second->step();
        ms[k].push_back(
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                .count() /
            steps);
      }
    }
    const double base = median(ms[0]);
    for (size_t k = 0; k < opts.size(); ++k) {
      const double m = median(ms[k]);
      std::printf("| %d | %s | %.1f | %.2fx faster |\n", t, opts[k].first, m, base / m);
    }
  }
  const int64_t fp32_state = fused.state_bytes(), q8_state = eight.state_bytes();
  std::printf("\noptimizer state: AdamW %lld bytes, AdamW8bit %lld bytes (%.2f%% of fp32)\n",
              static_cast<long long>(fp32_state), static_cast<long long>(q8_state),
              100.0 * q8_state / fp32_state);
  return 0;
}
