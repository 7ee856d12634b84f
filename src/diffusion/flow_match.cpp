// Diffusers' FlowMatchEulerDiscreteScheduler (0.31): Euler steps along a rectified-flow ODE
// (Stable Diffusion 3, Flux), sigma from 1 to 0 with the time shift
// sigma' = shift * sigma / (1 + (shift - 1) * sigma). The model predicts the velocity
// noise - x_0; timesteps are sigma * T as float32. No input scaling, initial noise sigma 1.

#include "difftrain/core/error.h"
#include "sampler_classes.h"
#include "sigma_schedule.h"

#include <torch/torch.h>

#include <cmath>

namespace difftrain::diffusion::detail {
namespace {

using nlohmann::json;

constexpr const char* kFlowMatchName = "FlowMatchEulerDiscreteScheduler";

class FlowMatchEulerSampler : public Sampler {
 public:
  FlowMatchEulerSampler(const json& config, const std::string& source) {
    const ConfigReader r(config, source);
    num_train_timesteps_ = r.get_int("num_train_timesteps", 1000);
    shift_ = r.get_double("shift", 1.0);
    use_dynamic_shifting_ = r.get_bool("use_dynamic_shifting", false);
    // Optional in Diffusers: a null in the file stays null (unused without dynamic shifting).
    const auto optional_or = [&](const char* key, double fallback) {
      return r.json().contains(key) ? r.get_optional_double(key) : std::optional<double>(fallback);
    };
    base_shift_ = optional_or("base_shift", 0.5);
    max_shift_ = optional_or("max_shift", 1.15);
    base_image_seq_len_ = r.get_int("base_image_seq_len", 256);
    max_image_seq_len_ = r.get_int("max_image_seq_len", 4096);
    // Qwen-Image (and LTX): the shifted schedule stretched so that its last sigma is this.
    if (r.json().contains("shift_terminal") && !r.json().at("shift_terminal").is_null()) {
      shift_terminal_ = r.get_double("shift_terminal", 0.0);
      if (*shift_terminal_ == 0.0) shift_terminal_.reset();  // falsy in Diffusers: no stretch
    }
    if (shift_terminal_ && !(*shift_terminal_ > 0 && *shift_terminal_ < 1)) {
      throw Error(r.where() + "shift_terminal is " + std::to_string(*shift_terminal_) +
                  "; it must lie in (0, 1) (Qwen-Image uses 0.02) or be null");
    }
    time_shift_type_ = r.json().value("time_shift_type", std::string("exponential"));
    if (time_shift_type_ != "exponential" && time_shift_type_ != "linear") {
      throw Error(r.where() + "time_shift_type is \"" + time_shift_type_ +
                  "\"; it must be \"exponential\" or \"linear\"");
    }
    for (const char* unsupported : {"invert_sigmas", "use_karras_sigmas", "use_exponential_sigmas",
                                    "use_beta_sigmas", "stochastic_sampling"}) {
      if (r.get_bool(unsupported, false)) {
        throw Error(r.where() + unsupported + " is true, which difftrain's " + kFlowMatchName +
                    " does not implement; set it to false");
      }
    }
    if (num_train_timesteps_ < 1) {
      throw Error(r.where() + "num_train_timesteps is " + std::to_string(num_train_timesteps_) +
                  "; it must be at least 1");
    }
    if (!(shift_ > 0) || !std::isfinite(shift_)) {
      throw Error(r.where() + "shift is " + std::to_string(shift_) +
                  "; it must be a finite number > 0 (1: no shift; SD3 uses 3.0)");
    }
    const int64_t T = num_train_timesteps_;
    // np.linspace(1, T, T, dtype=float32)[::-1] -> torch float32; / T; shift in float32.
    const std::vector<double> lin = linspace(1.0, static_cast<double>(T), T);
    std::vector<float> ts;
    for (auto it = lin.rbegin(); it != lin.rend(); ++it) ts.push_back(static_cast<float>(*it));
    torch::Tensor sigmas = torch::tensor(ts, torch::kFloat32) / T;
    // Under dynamic shifting the training tables stay unshifted (the shift comes with mu at
    // set_timesteps), as in Diffusers' __init__.
    if (!use_dynamic_shifting_) sigmas = shift_ * sigmas / (1 + (shift_ - 1) * sigmas);
    timesteps_ = sigmas * T;
    sigmas_ = sigmas;
    sigma_min_ = sigmas[-1].item<double>();
    sigma_max_ = sigmas[0].item<double>();
  }

  std::string class_name() const override { return kFlowMatchName; }

  json config() const override {
    json j = json::object();
    j["_class_name"] = class_name();
    j["num_train_timesteps"] = num_train_timesteps_;
    j["shift"] = shift_;
    j["use_dynamic_shifting"] = use_dynamic_shifting_;
    j["base_shift"] = base_shift_ ? json(*base_shift_) : json(nullptr);
    j["max_shift"] = max_shift_ ? json(*max_shift_) : json(nullptr);
    j["base_image_seq_len"] = base_image_seq_len_;
    j["max_image_seq_len"] = max_image_seq_len_;
    // Newer fields, written when they differ from the behaviour of configs without them.
    if (shift_terminal_) j["shift_terminal"] = *shift_terminal_;
    if (time_shift_type_ != "exponential") j["time_shift_type"] = time_shift_type_;
    return j;
  }

  void set_timesteps(int64_t n) override { set_timesteps_with(n, {}); }

  // Diffusers' set_timesteps(num_inference_steps, sigmas=None, mu=None): the sigmas (its own
  // linspace, or the caller's) go through the dynamic shift exp(mu) / (exp(mu) + 1/s - 1) or the
  // static one in float64, then become float32.
  void set_timesteps_with(int64_t n, const TimestepOptions& options) override {
    if (use_dynamic_shifting_ && !options.mu) {
      throw Error(std::string(kFlowMatchName) +
                  ": use_dynamic_shifting is true, so set_timesteps needs mu (a pipeline with "
                  "dynamic shifting computes it from the image size: diffusion::flow_match_mu)");
    }
    for (double v : options.sigmas) {
      if (!(v > 0 && v <= 1)) {
        throw Error(std::string(kFlowMatchName) + ": a custom sigma is " + std::to_string(v) +
                    "; flow-matching sigmas must lie in (0, 1]");
      }
    }
    std::vector<float> sig32;
    if (!options.sigmas.empty()) {
      // Custom sigmas become a float32 array first, so numpy does the shifts in float32 (the
      // Python scalars involved are cast to float32).
      const float e =
          use_dynamic_shifting_ ? static_cast<float>(dynamic_numerator(*options.mu)) : 0.0f;
      const auto shift = static_cast<float>(shift_);
      for (double v : options.sigmas) {
        const auto t = static_cast<float>(v);
        sig32.push_back(use_dynamic_shifting_ ? e / (e + (1.0f / t - 1.0f))
                                              : shift * t / (1.0f + (shift - 1.0f) * t));
      }
      if (shift_terminal_ && sig32.back() == 1.0f) {
        // Diffusers divides by zero here and samples NaN.
        throw Error(std::string(kFlowMatchName) +
                    ": shift_terminal stretches the schedule so that it ends at shift_terminal, "
                    "which a schedule whose last sigma is 1 (e.g. one step) cannot do; use 2 or "
                    "more steps");
      }
      if (shift_terminal_) {
        const float scale = (1.0f - sig32.back()) / static_cast<float>(1.0 - *shift_terminal_);
        for (float& t : sig32) t = 1.0f - (1.0f - t) / scale;
      }
    } else {
      if (n < 1) {
        throw Error(std::string(kFlowMatchName) + ": num_inference_steps is " + std::to_string(n) +
                    "; it must be at least 1");
      }
      const auto T = static_cast<double>(num_train_timesteps_);
      // numpy float64: linspace(sigma_max * T, sigma_min * T, n) / T, shifted in float64.
      std::vector<double> s;
      for (double t : linspace(sigma_max_ * T, sigma_min_ * T, n)) {
        const double v = t / T;
        s.push_back(use_dynamic_shifting_ ? dynamic_numerator(*options.mu) /
                                                (dynamic_numerator(*options.mu) + (1 / v - 1))
                                          : shift_ * v / (1 + (shift_ - 1) * v));
      }
      if (shift_terminal_) {
        const double scale = (1 - s.back()) / (1 - *shift_terminal_);
        for (double& t : s) t = 1 - (1 - t) / scale;
      }
      for (double v : s) sig32.push_back(static_cast<float>(v));
    }
    const torch::Tensor sigmas = torch::tensor(sig32, torch::kFloat32);
    timesteps_ = sigmas * num_train_timesteps_;
    sigmas_ = torch::cat({sigmas, torch::zeros({1}, torch::kFloat32)});
    step_index_.reset();
  }

  const torch::Tensor& timesteps() const override { return timesteps_; }
  torch::Tensor sigmas() const override { return sigmas_; }

  torch::Tensor step(const torch::Tensor& model_output, double timestep,
                     const torch::Tensor& sample_in, std::optional<at::Generator>) override {
    if (!step_index_) step_index_ = index_for_timestep(timesteps_, timestep, kFlowMatchName);
    const int64_t i = *step_index_;
    if (i + 1 >= sigmas_.size(0)) {
      throw Error(std::string(kFlowMatchName) + "::step: step " + std::to_string(i) +
                  " is past the last sigma; call set_timesteps() again before a new loop");
    }
    const torch::Tensor sample = sample_in.to(torch::kFloat32);
    const torch::Tensor sigma = sigmas_[i];
    const torch::Tensor sigma_next = sigmas_[i + 1];
    const torch::Tensor prev_sample = sample + (sigma_next - sigma) * model_output;
    step_index_ = i + 1;
    return prev_sample.to(model_output.scalar_type());
  }

 private:
  int64_t num_train_timesteps_ = 1000;
  double shift_ = 1.0;
  bool use_dynamic_shifting_ = false;
  std::optional<double> base_shift_, max_shift_;
  int64_t base_image_seq_len_ = 256, max_image_seq_len_ = 4096;
  std::optional<double> shift_terminal_;
  std::string time_shift_type_ = "exponential";

  // exp(mu) for the exponential time shift, mu itself for the linear one.
  double dynamic_numerator(double mu) const {
    return time_shift_type_ == "linear" ? mu : std::exp(mu);
  }
  double sigma_min_ = 0, sigma_max_ = 1;
  torch::Tensor timesteps_, sigmas_;
  std::optional<int64_t> step_index_;
};

}  // namespace

std::unique_ptr<Sampler> make_flow_match_euler_sampler(const json& config,
                                                       const std::string& source) {
  return std::make_unique<FlowMatchEulerSampler>(config, source);
}

}  // namespace difftrain::diffusion::detail
