// The Accelerator with ranks as threads over a real Gloo group: options from the environment,
// the accumulation schedule, scheduler stepping, collectives helpers and resumable state.

#include "difftrain/accel/accelerator.h"
#include "difftrain/core/error.h"
#include "difftrain/optim/adamw.h"
#include "thread_ranks.h"

#include <torch/torch.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>

namespace difftrain::accel {
namespace {

struct LinearNetImpl : torch::nn::Module {
  LinearNetImpl() { fc = register_module("fc", torch::nn::Linear(3, 2)); }
  torch::Tensor forward(const torch::Tensor& x) { return fc->forward(x); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(LinearNet);

std::shared_ptr<data::DataLoader> make_loader(int64_t samples, int64_t batch) {
  // A private generator: ranks are threads, and the global one would race.
  auto gen = at::detail::createCPUGenerator(3);
  auto ds = std::make_shared<data::TensorDataset>(data::Example{
      {"x", torch::randn({samples, 3}, gen)}, {"y", torch::randn({samples, 2}, gen)}});
  data::DataLoaderOptions o;
  o.batch_size = batch;
  return std::make_shared<data::DataLoader>(ds, o);
}

struct CountingScheduler {
  int64_t steps = 0;
  void step() { ++steps; }
};

AcceleratorOptions quiet_options() {
  AcceleratorOptions o;
  o.mixed_precision = "no";
  o.gradient_accumulation_steps = 1;
  return o;
}

TEST(AccelAccelerator, OptionsComeFromTheLauncherEnvironment) {
  setenv("DIFFTRAIN_MIXED_PRECISION", "bf16", 1);
  setenv("DIFFTRAIN_GRADIENT_ACCUMULATION_STEPS", "4", 1);
  distributed::on_ranks(1, [&](distributed::ProcessGroup& g) {
    Accelerator acc(AcceleratorOptions{}, g);
    EXPECT_EQ(acc.mixed_precision(), MixedPrecision::kBf16);
    EXPECT_EQ(acc.gradient_accumulation_steps(), 4);
    AcceleratorOptions explicit_options;
    explicit_options.mixed_precision = "no";
    explicit_options.gradient_accumulation_steps = 2;
    Accelerator acc2(explicit_options, g);  // explicit arguments win, as in Accelerate
    EXPECT_EQ(acc2.mixed_precision(), MixedPrecision::kNo);
    EXPECT_EQ(acc2.gradient_accumulation_steps(), 2);
    setenv("DIFFTRAIN_GRADIENT_ACCUMULATION_STEPS", "zero", 1);
    try {
      Accelerator bad(AcceleratorOptions{}, g);
      ADD_FAILURE() << "bad accumulation steps accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("DIFFTRAIN_GRADIENT_ACCUMULATION_STEPS='zero'"),
                std::string::npos)
          << e.what();
    }
  });
  unsetenv("DIFFTRAIN_MIXED_PRECISION");
  unsetenv("DIFFTRAIN_GRADIENT_ACCUMULATION_STEPS");
}

TEST(AccelAccelerator, AccumulationSyncsEveryKAndAtTheEndOfTheEpoch) {
  distributed::on_ranks(2, [&](distributed::ProcessGroup& g) {
    auto options = quiet_options();
    options.gradient_accumulation_steps = 3;
    Accelerator acc(options, g);
    LinearNet net;
    auto opt = std::make_shared<torch::optim::SGD>(net->parameters(), 0.1);
    auto sched = std::make_shared<CountingScheduler>();
    // 28 samples, 2 ranks x batch 2: 7 batches per rank per epoch.
    auto [m, o, dl, s] = acc.prepare(net, opt, make_loader(28, 2), sched);
    ASSERT_EQ(dl->size(), 7);
    std::vector<int> syncs;
    int micro = 0;
    for (const auto& b : *dl) {
      auto step = acc.accumulate(m);
      ++micro;
      acc.backward(torch::mse_loss(m->forward(b.at("x")), b.at("y")));
      if (acc.sync_gradients()) syncs.push_back(micro);
      o->step();
      s->step();
      o->zero_grad();
    }
    EXPECT_EQ(syncs, (std::vector<int>{3, 6, 7}));
    EXPECT_EQ(o->num_updates(), 3);
    // Once per real update, not once per micro-step nor num_processes times per update.
    EXPECT_EQ(sched->steps, 3);
    // The last window had one micro-step, so its loss was divided by 1, not 3.
    EXPECT_EQ(acc.state_dict()["window"].get<int64_t>(), 1);
  });
}

// Three AdamW steps on one batch, zero_grad(set_to_none) after each; the parameters after them.
std::vector<torch::Tensor> steps_with_zero_grad(distributed::ProcessGroup& g, bool set_to_none,
                                                std::vector<bool>* grads_dropped,
                                                std::vector<bool>* buffer_dropped) {
  Accelerator acc(quiet_options(), g);
  torch::manual_seed(5);
  LinearNet net;
  auto flat = std::make_shared<optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.1));
  acc.prepare_module(*net);
  auto o = acc.prepare_optimizer(flat);
  auto gen = at::detail::createCPUGenerator(7);
  const auto x = torch::randn({4, 3}, gen), y = torch::randn({4, 2}, gen);
  for (int i = 0; i < 3; ++i) {
    acc.backward(torch::mse_loss(net->forward(x), y));
    o->step();
    o->zero_grad(set_to_none);
    if (grads_dropped) grads_dropped->push_back(!net->fc->weight.grad().defined());
    if (buffer_dropped) buffer_dropped->push_back(!flat->buckets().at(0).grads.defined());
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

TEST(AccelAccelerator, ZeroGradSetToNoneFreesTheGradientsAndKeepsTheUpdates) {
  // One process: the gradients and the flat optimizer's gradient buffer are dropped, and the
  // next backward allocates new ones; the updates are those of zeroing in place, bit for bit.
  distributed::on_ranks(1, [&](distributed::ProcessGroup& g) {
    std::vector<bool> grads_dropped, buffer_dropped;
    const auto dropped = steps_with_zero_grad(g, true, &grads_dropped, &buffer_dropped);
    const auto zeroed = steps_with_zero_grad(g, false, nullptr, nullptr);
    EXPECT_EQ(grads_dropped, (std::vector<bool>{true, true, true}));
    EXPECT_EQ(buffer_dropped, (std::vector<bool>{true, true, true}));
    ASSERT_EQ(dropped.size(), zeroed.size());
    for (size_t i = 0; i < dropped.size(); ++i) EXPECT_TRUE(torch::equal(dropped[i], zeroed[i]));
  });
  // Two ranks: DDP's buckets own the gradients' storage, so they are zeroed in place.
  distributed::on_ranks(2, [&](distributed::ProcessGroup& g) {
    std::vector<bool> grads_dropped;
    steps_with_zero_grad(g, true, &grads_dropped, nullptr);
    EXPECT_EQ(grads_dropped, (std::vector<bool>{false, false, false}));
  });
}

TEST(AccelAccelerator, StateDictRoundTripsAndResumesTheLoader) {
  distributed::on_ranks(2, [&](distributed::ProcessGroup& g) {
    nlohmann::json saved;
    std::vector<torch::Tensor> rest_first;
    {
      Accelerator acc(quiet_options(), g);
      LinearNet net;
      auto opt = std::make_shared<torch::optim::SGD>(net->parameters(), 0.1);
      auto [m, o, dl] = acc.prepare(net, opt, make_loader(40, 2));
      int seen = 0;
      for (const auto& b : *dl) {
        auto step = acc.accumulate(m);
        acc.backward(torch::mse_loss(m->forward(b.at("x")), b.at("y")));
        o->step();
        o->zero_grad();
        if (++seen == 4) {
          saved = acc.state_dict();
          break;
        }
      }
      // What the loader would have yielded next.
      dl->load_state(data::LoaderState{saved["loaders"][0]["epoch"].get<int64_t>(),
                                       saved["loaders"][0]["batches_consumed"].get<int64_t>()});
      for (const auto& b : *dl) rest_first.push_back(b.at("x"));
    }
    Accelerator acc(quiet_options(), g);
    LinearNet net;
    auto opt = std::make_shared<torch::optim::SGD>(net->parameters(), 0.1);
    auto [m, o, dl] = acc.prepare(net, opt, make_loader(40, 2));
    acc.load_state_dict(saved);
    EXPECT_EQ(o->num_updates(), 4);
    std::vector<torch::Tensor> rest;
    for (const auto& b : *dl) rest.push_back(b.at("x"));
    ASSERT_EQ(rest.size(), 6u);  // 10 batches per rank, 4 consumed
    ASSERT_EQ(rest.size(), rest_first.size());
    for (size_t i = 0; i < rest.size(); ++i) {
      EXPECT_TRUE(torch::equal(rest[i], rest_first[i])) << i << "\n"
                                                        << rest[i] << "\n"
                                                        << rest_first[i] << saved.dump();
    }

    auto broken = saved;
    broken.erase("loaders");
    EXPECT_THROW(acc.load_state_dict(broken), Error);

    // A bad field late in the state leaves everything as it was (validated before applying):
    // before, the optimizer counters were already overwritten when the loader field failed.
    const nlohmann::json before = acc.state_dict();
    auto late = saved;
    late["optimizers"][0] = 99;
    late["micro_step"] = 7;
    late["loaders"][0]["batches_consumed"] = -1;
    std::string message;
    try {
      acc.load_state_dict(late);
    } catch (const Error& e) {
      message = e.what();
    }
    EXPECT_NE(message.find("loaders[0].batches_consumed"), std::string::npos) << message;
    EXPECT_EQ(acc.state_dict(), before);
    EXPECT_EQ(o->num_updates(), 4);
    late = saved;
    late["optimizers"][0] = 99;
    late["step_skipped"] = "no";
    EXPECT_THROW(acc.load_state_dict(late), Error);
    EXPECT_EQ(acc.state_dict(), before);
  });
}

// gather_for_metrics drops the even_batches padding of an epoch's last global batch, so every
// example is seen once (Accelerate's gather_for_metrics); gather_object concatenates lists of
// different lengths in rank order.
TEST(AccelAccelerator, GatherForMetricsDropsThePaddingAndGatherObjectConcatenates) {
  distributed::on_ranks(3, [&](distributed::ProcessGroup& g) {
    Accelerator acc(quiet_options(), g);
    const int r = acc.process_index();
    // 10 examples, batch 2 per rank, 3 ranks: global batches of 6, the second holds 4 real
    // examples and 2 repeated from the start of the epoch.
    auto ds = std::make_shared<data::TensorDataset>(
        data::Example{{"idx", torch::arange(10, torch::kLong)}});
    data::DataLoaderOptions lo;
    lo.batch_size = 2;
    auto dl = acc.prepare_data_loader(std::make_shared<data::DataLoader>(ds, lo));
    std::vector<int64_t> seen, seen_objects, plain;
    for (const auto& b : *dl) {
      const torch::Tensor idx = b.at("idx");
      const torch::Tensor all = acc.gather_for_metrics(idx);
      for (int64_t i = 0; i < all.size(0); ++i) seen.push_back(all[i].item<int64_t>());
      plain.push_back(acc.gather(idx).size(0));
      nlohmann::json mine = nlohmann::json::array();
      for (int64_t i = 0; i < idx.size(0); ++i) mine.push_back(idx[i].item<int64_t>());
      for (const auto& v : acc.gather_for_metrics(mine)) seen_objects.push_back(v.get<int64_t>());
    }
    std::vector<int64_t> want(10);
    for (int64_t i = 0; i < 10; ++i) want[static_cast<size_t>(i)] = i;
    EXPECT_EQ(plain, (std::vector<int64_t>{6, 6}));  // gather keeps the padding
    EXPECT_EQ(seen, want);
    EXPECT_EQ(seen_objects, want);

    // Rank r holds r + 1 items: 1 + 2 + 3 in rank order.
    nlohmann::json items = nlohmann::json::array();
    for (int i = 0; i <= r; ++i)
      items.push_back({{"rank", r}, {"i", i}, {"s", std::string(i, 'x')}});
    const nlohmann::json all = acc.gather_object(items);
    ASSERT_EQ(all.size(), 6u);
    EXPECT_EQ(all[0]["rank"], 0);
    EXPECT_EQ(all[1]["rank"], 1);
    EXPECT_EQ(all[2]["i"], 1);
    EXPECT_EQ(all[5]["s"], "xx");
    EXPECT_THROW(acc.gather_object(nlohmann::json{{"not", "a list"}}), Error);
  });
}

TEST(AccelAccelerator, ClipGradNormUnscalesAndReturnsTheNormOfTheAveragedGradients) {
  // Reference in float64: the mean over ranks of each rank's gradient of mean((x_r W^T)^2) for
  // a bias-free linear layer, by autograd on float64 copies.
  auto x_of = [](int rank) {
    auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(50 + rank));
    return torch::randn({4, 3}, gen);
  };
  auto weight0 = torch::full({2, 3}, 0.5);
  torch::Tensor mean_grad = torch::zeros({2, 3}, torch::kDouble);
  for (int r = 0; r < 2; ++r) {
    auto w = weight0.to(torch::kDouble).requires_grad_();
    torch::mm(x_of(r).to(torch::kDouble), w.t()).pow(2).mean().backward();
    mean_grad += w.grad() / 2;
  }
  const double want = mean_grad.norm().item<double>();
  std::vector<double> got(2, 0), after(2, 0);
  distributed::on_ranks(2, [&](distributed::ProcessGroup& g) {
    auto options = quiet_options();
    options.mixed_precision = "fp16";  // gradients are scaled by 65536 until clip unscales them
    Accelerator acc(options, g);
    auto fc = torch::nn::Linear(torch::nn::LinearOptions(3, 2).bias(false));
    {
      torch::NoGradGuard no_grad;
      fc->weight.copy_(weight0);
    }
    auto opt = std::make_shared<torch::optim::SGD>(fc->parameters(), 0.1);
    auto [m, o] = acc.prepare(fc, opt);
    acc.backward(m->forward(x_of(g.rank())).pow(2).mean());
    got[static_cast<size_t>(g.rank())] = acc.clip_grad_norm_(m->parameters(), 0.01);
    after[static_cast<size_t>(g.rank())] = m->weight.grad().norm().item<double>();
  });
  for (int r = 0; r < 2; ++r) {
    const double diff = std::abs(got[static_cast<size_t>(r)] - want);
    std::printf("rank %d: clip norm %.7f, float64 reference %.7f, diff %.3g (tolerance 1e-5)\n", r,
                got[static_cast<size_t>(r)], want, diff);
    EXPECT_LT(diff, 1e-5 * std::max(1.0, want));
    EXPECT_NEAR(after[static_cast<size_t>(r)], 0.01, 1e-4);  // clipped to max_norm
  }
}

TEST(AccelAccelerator, CollectiveHelpers) {
  distributed::on_ranks(3, [&](distributed::ProcessGroup& g) {
    Accelerator acc(quiet_options(), g);
    const int r = acc.process_index();
    auto gathered = acc.gather(torch::full({2}, static_cast<float>(r)));
    EXPECT_TRUE(torch::equal(gathered, torch::tensor({0.f, 0.f, 1.f, 1.f, 2.f, 2.f})));
    EXPECT_EQ(acc.reduce(torch::tensor({1.0 + r}), "sum").item<double>(), 6.0);
    EXPECT_EQ(acc.reduce(torch::tensor({1.0 + r}), "mean").item<double>(), 2.0);
    EXPECT_THROW(acc.reduce(torch::tensor({1.0}), "max"), Error);
    EXPECT_EQ(acc.broadcast(torch::tensor({10.0 * r}), 2).item<double>(), 20.0);
    // Rank r has r + 1 rows; padded to 3 rows of -1 at the end (or the start).
    auto padded = acc.pad_across_processes(torch::ones({r + 1, 2}), 0, -1);
    EXPECT_EQ(padded.size(0), 3);
    EXPECT_EQ(padded[2].sum().item<double>(), r == 2 ? 2.0 : -2.0);
    auto first = acc.pad_across_processes(torch::ones({r + 1}), 0, 0, /*pad_first=*/true);
    EXPECT_EQ(first[2].item<double>(), 1.0);
    // 7 items over 3 ranks: 3, 2, 2 (Accelerate's split_between_processes).
    const std::vector<int> items{0, 1, 2, 3, 4, 5, 6};
    const auto mine = acc.split_between_processes(items);
    const std::vector<std::vector<int>> want{{0, 1, 2}, {3, 4}, {5, 6}};
    EXPECT_EQ(mine, want[static_cast<size_t>(r)]);
    EXPECT_EQ(acc.split_between_processes(items, true).size(), 3u);
  });
}

TEST(AccelAccelerator, MainProcessFirstRunsRankZeroFirst) {
  std::atomic<int> order{0};
  std::vector<int> when(2, -1);
  distributed::on_ranks(2, [&](distributed::ProcessGroup& g) {
    Accelerator acc(quiet_options(), g);
    if (acc.process_index() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    {
      auto first = acc.main_process_first();
      when[static_cast<size_t>(acc.process_index())] = order++;
    }
  });
  EXPECT_EQ(when[0], 0);
  EXPECT_EQ(when[1], 1);
}

TEST(AccelAccelerator, PrepareBroadcastsRankZeroAndRefusesASecondPrepare) {
  distributed::on_ranks(2, [&](distributed::ProcessGroup& g) {
    Accelerator acc(quiet_options(), g);
    torch::manual_seed(100 + g.rank());  // different initial weights per rank
    LinearNet net;
    auto m = acc.prepare(net);
    auto all = acc.gather(m->fc->weight.detach().reshape({1, -1}));
    EXPECT_TRUE(torch::equal(all[0], all[1]));
    EXPECT_EQ(acc.unwrap_model(m).get(), net.get());
    EXPECT_THROW(acc.prepare(net), Error);
  });
}

}  // namespace
}  // namespace difftrain::accel
