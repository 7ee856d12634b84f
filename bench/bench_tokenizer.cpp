// CLIP tokenizer throughput, side by side in one run, on a realistic prompt mix: 256 generated
// SD-style prompts (subject, setting, 3-6 style and quality tags, as in captions and prompt
// datasets, where words repeat a lot) plus the 25 fixture prompts (case folding, digits,
// punctuation runs, "café", a 92-token prompt).
//   warm          the per-word BPE cache already holds every word (a data loader after the
//                 first epoch, or a pipeline encoding the same prompts again)
//   cold          the cache emptied before each pass over the mix (the first epoch: words still
//                 repeat within the pass)
//   uncached      the cache emptied before every prompt (every word merged from scratch)
//   warm/threads  the warm mix on 2 threads sharing one tokenizer (the sharded cache's locks),
//                 and on 2 threads with a tokenizer each (what 2 threads give without sharing)
// and the time from_folder takes to read the 49408-entry vocabulary. The ratios are printed at
// the end (docs/PERFORMANCE.md quotes them).
//
//   build/bench/bench_tokenizer [--benchmark_repetitions=3]

#include "difftrain/models/tokenizers/clip_tokenizer.h"
#include "source_dir.h"

#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>
#include <map>
#include <random>

namespace difftrain::models {
// The private hook of clip_tokenizer.h that empties the word cache.
struct ClipTokenizerTestPeer {
  static void clear_cache(const ClipTokenizer& t) { t.clear_word_cache(); }
};
}  // namespace difftrain::models

namespace {

using difftrain::models::ClipTokenizer;
using difftrain::models::ClipTokenizerTestPeer;

const std::string kFixture =
    std::string(difftrain_test::source_dir()) + "/tests/golden/sd/tiny_sd/";

std::vector<std::string> prompt_mix() {
  const std::vector<std::string> subjects = {
      "a photo of a cat",          "a portrait of an old fisherman",
      "a red sports car",          "an astronaut riding a horse",
      "a cozy cabin in the woods", "a bowl of ramen",
      "a medieval castle",         "a golden retriever puppy",
      "a futuristic city skyline", "a steampunk airship",
      "a bouquet of sunflowers",   "a samurai warrior",
      "a lighthouse on a cliff",   "a cup of coffee",
      "a dragon made of glass",    "a robot reading a book",
      "a mountain lake at dawn",   "a vintage typewriter",
      "a fox in the snow",         "a wizard casting a spell"};
  const std::vector<std::string> settings = {
      "at sunset",         "in the rain",           "on mars",  "under the sea", "in a neon city",
      "in a misty forest", "on a white background", "at night", "in the desert", "in a busy market",
      "during a storm",    "in a library"};
  const std::vector<std::string> tags = {"highly detailed",
                                         "8k",
                                         "octane render",
                                         "trending on artstation",
                                         "digital painting",
                                         "oil painting",
                                         "watercolor",
                                         "cinematic lighting",
                                         "volumetric light",
                                         "sharp focus",
                                         "bokeh",
                                         "studio lighting",
                                         "concept art",
                                         "unreal engine",
                                         "photorealistic",
                                         "award winning",
                                         "intricate",
                                         "by greg rutkowski",
                                         "by alphonse mucha",
                                         "masterpiece",
                                         "best quality",
                                         "(masterpiece:1.2)",
                                         "[low quality]",
                                         "4k uhd",
                                         "golden hour",
                                         "wide angle",
                                         "35mm film",
                                         "matte painting",
                                         "soft pastel colors",
                                         "dramatic shadows",
                                         "hyperrealistic",
                                         "ultra-detailed"};
  std::mt19937 rng(0);
  const auto pick = [&](const std::vector<std::string>& v) { return v[rng() % v.size()]; };
  std::vector<std::string> prompts;
  for (int i = 0; i < 256; ++i) {
    std::string p = pick(subjects) + " " + pick(settings);
    const int n = 3 + static_cast<int>(rng() % 4);
    for (int k = 0; k < n; ++k) p += ", " + pick(tags);
    prompts.push_back(p);
  }
  std::ifstream in(kFixture + "tokenizer_cases.json");
  const auto cases = nlohmann::json::parse(in);
  for (const auto& c : cases.at("cases")) prompts.push_back(c.at("prompt"));
  return prompts;
}

const ClipTokenizer& tokenizer() {
  static const ClipTokenizer t = ClipTokenizer::from_folder(kFixture + "tokenizer");
  return t;
}
const std::vector<std::string>& prompts() {
  static const auto p = prompt_mix();
  return p;
}

int64_t encode_all(const ClipTokenizer& t) {
  int64_t tokens = 0;
  for (const auto& p : prompts()) {
    const auto e = t.encode(p);
    tokens += e.num_tokens;
    benchmark::DoNotOptimize(e.input_ids.data());
  }
  return tokens;
}

void set_rates(benchmark::State& state, int64_t tokens_per_pass) {
  const auto passes = static_cast<double>(state.iterations());
  state.counters["prompts/s"] = benchmark::Counter(passes * static_cast<double>(prompts().size()),
                                                   benchmark::Counter::kIsRate);
  state.counters["tokens/s"] = benchmark::Counter(passes * static_cast<double>(tokens_per_pass),
                                                  benchmark::Counter::kIsRate);
}

void BM_Warm(benchmark::State& state) {
  const auto& t = tokenizer();
  const int64_t tokens = encode_all(t);  // fills the cache
  for (auto _ : state) encode_all(t);
  set_rates(state, tokens);
}

void BM_Cold(benchmark::State& state) {
  const auto& t = tokenizer();
  int64_t tokens = 0;
  for (auto _ : state) {
    state.PauseTiming();
    ClipTokenizerTestPeer::clear_cache(t);
    state.ResumeTiming();
    tokens = encode_all(t);
  }
  set_rates(state, tokens);
}

void BM_Uncached(benchmark::State& state) {
  const auto& t = tokenizer();
  int64_t tokens = 0;
  for (auto _ : state) {
    tokens = 0;
    for (const auto& p : prompts()) {
      state.PauseTiming();
      ClipTokenizerTestPeer::clear_cache(t);
      state.ResumeTiming();
      tokens += t.encode(p).num_tokens;
    }
  }
  set_rates(state, tokens);
}

void BM_WarmThreads(benchmark::State& state) {
  const auto& t = tokenizer();
  const int64_t tokens = encode_all(t);
  for (auto _ : state) encode_all(t);
  set_rates(state, tokens);
}

// The same on 2 threads, each with its own tokenizer and cache: what the machine gives without
// sharing.
void BM_WarmThreadsSeparate(benchmark::State& state) {
  static const ClipTokenizer second = ClipTokenizer::from_folder(kFixture + "tokenizer");
  const auto& t = state.thread_index() == 0 ? tokenizer() : second;
  const int64_t tokens = encode_all(t);
  for (auto _ : state) encode_all(t);
  set_rates(state, tokens);
}

void BM_FromFolder(benchmark::State& state) {
  for (auto _ : state) {
    benchmark::DoNotOptimize(ClipTokenizer::from_folder(kFixture + "tokenizer").vocab_size());
  }
}

// Keeps each run's prompts/s (the mean when repeated) for the summary.
class Recorder : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const auto& run : runs) {
      if (run.run_type == Run::RT_Aggregate && run.aggregate_name != "mean") continue;
      const auto it = run.counters.find("prompts/s");
      if (it != run.counters.end()) rates[run.run_name.function_name] = it->second.value;
    }
    ConsoleReporter::ReportRuns(runs);
  }
  std::map<std::string, double> rates;
};

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  prompts();
  tokenizer();
  benchmark::RegisterBenchmark("encode/warm", BM_Warm)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("encode/cold", BM_Cold)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("encode/uncached", BM_Uncached)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("encode/warm/threads", BM_WarmThreads)
      ->Threads(2)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("encode/warm/threads/separate", BM_WarmThreadsSeparate)
      ->Threads(2)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("from_folder", BM_FromFolder)->Unit(benchmark::kMillisecond);
  Recorder recorder;
  benchmark::RunSpecifiedBenchmarks(&recorder);
  const double warm = recorder.rates["encode/warm"];
  const auto row = [&](const char* name, const std::string& note) {
    std::cout << fmt::format("{:<20} {:>9.0f} prompts/s  {}\n", name, recorder.rates[name], note);
  };
  std::cout << fmt::format("\n{} prompts per pass\n", prompts().size());
  row("encode/warm", "");
  for (const char* name : {"encode/cold", "encode/uncached"}) {
    const double r = recorder.rates[name];
    row(name, r > 0 ? fmt::format("warm is {:.2f}x faster", warm / r) : "");
  }
  for (const char* name : {"encode/warm/threads", "encode/warm/threads/separate"}) {
    const double r = recorder.rates[name];
    row(name, warm > 0 ? fmt::format("{:.2f}x warm on 1 thread", r / warm) : "");
  }
  benchmark::Shutdown();
  return 0;
}
