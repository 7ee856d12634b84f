// Gradient checkpointing, memory against time, side by side in one run: a training step
// (forward, MSE loss, backward) of the fixture UNet2DConditionModel on 64x64 latents, with and
// without UNet::set_gradient_checkpointing. Each configuration runs in a child process so its
// peak resident memory (ru_maxrss) is its own; the child that only loads the model gives the
// baseline that is subtracted.
//
//   build/bench/bench_checkpointing [--batch 4] [--size 64] [--steps 3]

#include "difftrain/distributed/process_group.h"
#include "difftrain/models/pretrained.h"
#include "source_dir.h"

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

namespace {

struct Result {
  double seconds_per_step = 0;
  double peak_mib = 0;
};

// Runs `steps` training steps (none when steps is 0) in a child; returns its time and peak RSS.
Result run_child(bool checkpointing, int64_t batch, int64_t size, int64_t steps) {
  int fds[2];
  if (pipe(fds) != 0) std::abort();
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    difftrain::distributed::configure_threads();
    auto unet = difftrain::models::load_unet(std::string(difftrain_test::source_dir()) +
                                             "/tests/golden/diffusers/unet_cond");
    unet->train();
    unet->set_gradient_checkpointing(checkpointing);
    torch::manual_seed(0);
    auto x = torch::randn({batch, 4, size, size});
    auto t = torch::randint(0, 1000, {batch}, torch::kLong);
    difftrain::models::UNetConditioning cond;
    cond.encoder_hidden_states = torch::randn({batch, 77, 32});
    double seconds = 0;
    for (int64_t s = 0; s < steps; ++s) {
      auto start = std::chrono::steady_clock::now();
      auto loss = (unet->forward(x, t, cond) - x).pow(2).mean();
      loss.backward();
      unet->zero_grad();
      seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    const double per_step = steps > 0 ? seconds / static_cast<double>(steps) : 0.0;
    if (write(fds[1], &per_step, sizeof per_step) != sizeof per_step) _exit(1);
    _exit(0);
  }
  close(fds[1]);
  Result r;
  if (read(fds[0], &r.seconds_per_step, sizeof r.seconds_per_step) != sizeof r.seconds_per_step) {
    std::fprintf(stderr, "child failed\n");
    std::exit(1);
  }
  close(fds[0]);
  int status = 0;
  rusage usage{};
  wait4(pid, &status, 0, &usage);
  r.peak_mib = static_cast<double>(usage.ru_maxrss) / 1024.0;  // KiB on Linux
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t batch = 4, size = 64, steps = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--batch")) batch = std::stoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--size")) size = std::stoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--steps")) steps = std::stoll(argv[i + 1]);
  }
  const Result base = run_child(false, batch, size, 0);
  const Result plain = run_child(false, batch, size, steps);
  const Result ckpt = run_child(true, batch, size, steps);
  std::printf(
      "unet_cond fixture, batch %lld, %lldx%lld latents, %lld steps; baseline RSS %.0f MiB\n",
      static_cast<long long>(batch), static_cast<long long>(size), static_cast<long long>(size),
      static_cast<long long>(steps), base.peak_mib);
  std::printf(
      "| gradient checkpointing | s / step | peak RSS above baseline (MiB) | time vs off | memory "
      "vs off |\n");
  std::printf("|---|---|---|---|---|\n");
  const double plain_mem = plain.peak_mib - base.peak_mib, ckpt_mem = ckpt.peak_mib - base.peak_mib;
  std::printf("| off | %.3f | %.0f | 1.00x | 1.00x |\n", plain.seconds_per_step, plain_mem);
  std::printf("| on | %.3f | %.0f | %.2fx | %.2fx |\n", ckpt.seconds_per_step, ckpt_mem,
              ckpt.seconds_per_step / plain.seconds_per_step, ckpt_mem / plain_mem);
  return 0;
}
