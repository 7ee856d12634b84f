// Collective throughput under `difftrain launch`, side by side in one run:
//   all_reduce                 Gloo's ring all-reduce
//   reduce_scatter/alltoall    difftrain's reduce_scatter on Gloo (alltoall + local sum)
//   reduce_scatter/naive       the obvious alternative: all_reduce everything, keep one chunk
// and the ratio of the last two, the figure docs/PERFORMANCE.md quotes. Every rank runs the same
// fixed iteration counts so the collectives stay in lockstep; only rank 0 reports.
//
//   build/bin/difftrain launch --num_processes 2 build/bench/bench_collectives

#include "difftrain/distributed/collectives.h"

#include <benchmark/benchmark.h>

#include <fmt/format.h>

#include <iostream>
#include <map>

namespace {

using difftrain::distributed::ReduceOp;

constexpr int kIterations = 30;
const std::vector<int64_t> kSizes = {1 << 12, 1 << 16, 1 << 20, 1 << 22};  // float32 elements

void set_bytes(benchmark::State& state, int64_t elements) {
  state.SetBytesProcessed(state.iterations() * elements * static_cast<int64_t>(sizeof(float)));
}

void BM_AllReduce(benchmark::State& state) {
  auto& g = difftrain::distributed::default_group();
  auto t = torch::ones({state.range(0)});
  for (auto _ : state) difftrain::distributed::all_reduce(t, ReduceOp::kSum, g);
  set_bytes(state, state.range(0));
}

void BM_ReduceScatterAlltoall(benchmark::State& state) {
  auto& g = difftrain::distributed::default_group();
  auto t = torch::ones({state.range(0)});
  for (auto _ : state)
    benchmark::DoNotOptimize(difftrain::distributed::reduce_scatter(t, ReduceOp::kSum, g));
  set_bytes(state, state.range(0));
}

void BM_ReduceScatterNaive(benchmark::State& state) {
  auto& g = difftrain::distributed::default_group();
  auto t = torch::ones({state.range(0)});
  const int64_t chunk = state.range(0) / g.size();
  for (auto _ : state) {
    auto copy = t.clone();
    difftrain::distributed::all_reduce(copy, ReduceOp::kSum, g);
    benchmark::DoNotOptimize(copy.slice(0, g.rank() * chunk, (g.rank() + 1) * chunk).clone());
  }
  set_bytes(state, state.range(0));
}

void register_all() {
  for (auto* b : {benchmark::RegisterBenchmark("all_reduce", BM_AllReduce),
                  benchmark::RegisterBenchmark("reduce_scatter/alltoall", BM_ReduceScatterAlltoall),
                  benchmark::RegisterBenchmark("reduce_scatter/naive", BM_ReduceScatterNaive)}) {
    for (int64_t n : kSizes) b->Arg(n);
    b->Iterations(kIterations)->Unit(benchmark::kMillisecond)->UseRealTime();
  }
}

// Keeps each run's real time so the ratios can be printed after the table.
class Recorder : public benchmark::ConsoleReporter {
 public:
  explicit Recorder(bool print) : ConsoleReporter(OO_Tabular), print_(print) {}
  bool ReportContext(const Context& context) override {
    return print_ ? ConsoleReporter::ReportContext(context) : true;
  }
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const auto& run : runs) times[run.benchmark_name()] = run.GetAdjustedRealTime();
    if (print_) ConsoleReporter::ReportRuns(runs);
  }
  std::map<std::string, double> times;

 private:
  bool print_;
};

}  // namespace

int main(int argc, char** argv) {
  auto& g = difftrain::distributed::init_process_group();
  // Plain text (the launcher relays lines), and connections warmed up before anything is timed.
  std::vector<char*> args(argv, argv + argc);
  char no_color[] = "--benchmark_color=false";
  args.insert(args.begin() + 1, no_color);
  int count = static_cast<int>(args.size());
  benchmark::Initialize(&count, args.data());
  for (int i = 0; i < 10; ++i) {
    auto warm = torch::ones({1 << 16});
    difftrain::distributed::all_reduce(warm, ReduceOp::kSum, g);
    benchmark::DoNotOptimize(difftrain::distributed::reduce_scatter(warm, ReduceOp::kSum, g));
  }
  register_all();
  Recorder recorder(g.rank() == 0);
  benchmark::RunSpecifiedBenchmarks(&recorder);
  if (g.rank() == 0) {
    std::cout << fmt::format("\n{} ranks, {} thread(s) each, backend {}\n", g.size(),
                             at::get_num_threads(), g.backend_name());
    std::cout
        << "elements   reduce_scatter naive / alltoall (time ratio; >1 = difftrain's is faster)\n";
    for (int64_t n : kSizes) {
      const double fast =
          recorder
              .times["reduce_scatter/alltoall/" + std::to_string(n) + "/iterations:30/real_time"];
      const double slow =
          recorder.times["reduce_scatter/naive/" + std::to_string(n) + "/iterations:30/real_time"];
      if (fast > 0) std::cout << fmt::format("{:>9}  {:.2f}x\n", n, slow / fast);
    }
  }
  benchmark::Shutdown();
  return 0;
}
