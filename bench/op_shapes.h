#pragma once

// A per-operator profile that keeps the input shapes and dtypes, which LibTorch's legacy profiler
// (RecordProfile, bench/py/op_profile.py) drops: every operator and autograd node is timed through
// a global RecordFunction callback, its self time (its nested operators' taken out) summed per
// (name, inputs). `--profile FILE.shapes` in the training benches writes it as tab-separated
// rows, the slowest first: self ms, calls, name, inputs.

#include <ATen/record_function.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace difftrain::bench {

class OpShapeProfile {
 public:
  explicit OpShapeProfile(std::string path) : path_(std::move(path)) {
    instance() = this;
    handle_ = at::addGlobalCallback(
        at::RecordFunctionCallback(&on_start, &on_end)
            .needsInputs(true)
            .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
  }
  OpShapeProfile(const OpShapeProfile&) = delete;
  OpShapeProfile& operator=(const OpShapeProfile&) = delete;

  ~OpShapeProfile() {
    at::removeCallback(handle_);
    instance() = nullptr;
    std::vector<std::pair<std::string, std::pair<double, long>>> rows(totals_.begin(),
                                                                      totals_.end());
    std::sort(rows.begin(), rows.end(),
              [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
    if (FILE* f = std::fopen(path_.c_str(), "w")) {
      for (const auto& [key, v] : rows)
        std::fprintf(f, "%.3f\t%ld\t%s\n", v.first, v.second, key.c_str());
      std::fclose(f);
    }
  }

 private:
  using Clock = std::chrono::steady_clock;
  struct Context : at::ObserverContext {
    Clock::time_point start;
    std::string key;
    double children_ms = 0;
    Context* parent = nullptr;
  };

  static OpShapeProfile*& instance() {
    static OpShapeProfile* p = nullptr;
    return p;
  }
  static Context*& top() {
    thread_local Context* t = nullptr;
    return t;
  }

  static std::string describe(const at::RecordFunction& fn) {
    std::ostringstream key;
    key << fn.name() << '\t';
    for (const auto& v : fn.inputs()) {
      if (v.isTensor()) {
        const auto& t = v.toTensor();
        if (!t.defined()) {
          key << "undef ";
          continue;
        }
        key << c10::toString(t.scalar_type()) << t.sizes() << (t.is_contiguous() ? "" : "nc")
            << ' ';
      } else if (v.isScalar()) {
        key << v.toScalar().toDouble() << ' ';
      }
    }
    return key.str();
  }

  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    auto ctx = std::make_unique<Context>();
    ctx->key = describe(fn);
    ctx->parent = top();
    top() = ctx.get();
    ctx->start = Clock::now();
    return ctx;
  }

  static void on_end(const at::RecordFunction&, at::ObserverContext* base) {
    auto* ctx = static_cast<Context*>(base);
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - ctx->start).count();
    if (ctx->parent != nullptr) ctx->parent->children_ms += ms;
    top() = ctx->parent;
    OpShapeProfile* self = instance();
    if (self == nullptr) return;
    std::lock_guard<std::mutex> lock(self->mutex_);
    auto& row = self->totals_[ctx->key];
    row.first += ms - ctx->children_ms;
    row.second += 1;
  }

  std::string path_;
  at::CallbackHandle handle_;
  std::mutex mutex_;
  std::map<std::string, std::pair<double, long>> totals_;
};

}  // namespace difftrain::bench
