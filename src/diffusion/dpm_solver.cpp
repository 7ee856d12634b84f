// DPMSolverMultistepScheduler of Diffusers 0.31 as a Sampler: DPM-Solver++ ("DPM++ 2M", with
// Karras or Lu sigmas), its SDE variant, and the original DPM-Solver, orders 1-3. The sigmas are
// 0-dim float32 tensors and every update keeps Diffusers' operation order, so a step runs the same
// torch kernels on the same values as Diffusers does.

#include "difftrain/core/error.h"
#include "multistep_common.h"
#include "sampler_classes.h"
#include "sigma_schedule.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace difftrain::diffusion::detail {

namespace {

constexpr const char* kClass = "DPMSolverMultistepScheduler";

// lambda_min_clipped is -inf by default and Diffusers writes it as the bare token -Infinity, which
// is not JSON; a config that went through a JSON parser may hold it as a string instead.
double read_lambda_min_clipped(const ConfigReader& reader) {
  const nlohmann::json& j = reader.json();
  const auto it = j.find("lambda_min_clipped");
  constexpr double kInf = std::numeric_limits<double>::infinity();
  if (it == j.end() || it->is_null()) return -kInf;
  if (it->is_string()) {
    const std::string s = it->get<std::string>();
    if (s == "-Infinity" || s == "-inf") return -kInf;
    if (s == "Infinity" || s == "inf") return kInf;
    throw Error(reader.where() + "lambda_min_clipped is \"" + s +
                "\"; expected a number (or -Infinity, the default)");
  }
  return reader.get_double("lambda_min_clipped", -kInf);
}

class DpmSolverMultistepSampler final : public MultistepSampler {
 public:
  DpmSolverMultistepSampler(const nlohmann::json& json, const std::string& source)
      : MultistepSampler(json, source, kClass) {
    const ConfigReader& r = reader_;
    if (use_flow_sigmas_) {
      throw Error(r.where() + "use_flow_sigmas is not supported by " + kClass +
                  " here; use UniPCMultistepScheduler (unipc), which takes flow sigmas");
    }
    const std::string algorithm =
        r.get_choice("algorithm_type", "dpmsolver++",
                     {"dpmsolver", "dpmsolver++", "sde-dpmsolver", "sde-dpmsolver++", "deis"});
    // Diffusers registers deis as dpmsolver++ and logrho/bh1/bh2 as midpoint.
    algorithm_type_ = algorithm == "deis" ? "dpmsolver++" : algorithm;
    const std::string solver =
        r.get_choice("solver_type", "midpoint", {"midpoint", "heun", "logrho", "bh1", "bh2"});
    solver_type_ = (solver == "midpoint" || solver == "heun") ? solver : "midpoint";
    euler_at_final_ = r.get_bool("euler_at_final", false);
    use_lu_lambdas_ = r.get_bool("use_lu_lambdas", false);
    lambda_min_clipped_ = read_lambda_min_clipped(r);
    variance_type_ = r.get_string("variance_type", "");

    const std::string where = r.where();
    if (solver_order_ < 1 || solver_order_ > 3) {
      throw Error(where + "solver_order is " + std::to_string(solver_order_) + "; " + kClass +
                  " supports 1, 2 or 3 (2 for guided sampling, 3 for unconditional)");
    }
    if (use_exponential_sigmas_ || use_beta_sigmas_) {
      throw Error(where + (use_beta_sigmas_ ? "use_beta_sigmas" : "use_exponential_sigmas") +
                  " is not supported by difftrain's " + kClass +
                  "; use use_karras_sigmas or use_lu_lambdas");
    }
    if (use_karras_sigmas_ && use_lu_lambdas_) {
      // Diffusers silently prefers Karras; say so instead of guessing.
      throw Error(where + "use_karras_sigmas and use_lu_lambdas are both true; set one of them");
    }
    // Diffusers checks the algorithm_type as given (so "deis" with zero sigmas raises too).
    if (algorithm != "dpmsolver++" && algorithm != "sde-dpmsolver++" &&
        final_sigmas_type_ == "zero") {
      throw Error(where + "final_sigmas_type 'zero' is not supported with algorithm_type '" +
                  algorithm + "'; set final_sigmas_type to 'sigma_min'");
    }

    const torch::Tensor alpha_t = torch::sqrt(alphas_cumprod_);
    const torch::Tensor sigma_t = torch::sqrt(1 - alphas_cumprod_);
    lambda_t_ = torch::log(alpha_t) - torch::log(sigma_t);
  }

  nlohmann::json config() const override {
    nlohmann::json c = shared_config();
    c["algorithm_type"] = algorithm_type_;
    c["solver_type"] = solver_type_;
    c["euler_at_final"] = euler_at_final_;
    c["use_lu_lambdas"] = use_lu_lambdas_;
    c["lambda_min_clipped"] = lambda_min_clipped_;
    c["variance_type"] = variance_type_.empty() ? nlohmann::json() : nlohmann::json(variance_type_);
    return c;
  }

  void set_timesteps(int64_t n) override {
    const int64_t T = betas_.num_train_timesteps;
    // Clipping the minimum of lambda(t) (critical for the cosine schedule): searchsorted of the
    // ascending lambdas, compared in float32 as torch does.
    const torch::Tensor clipped_idx =
        torch::searchsorted(torch::flip(lambda_t_, {0}), at::Scalar(lambda_min_clipped_));
    std::vector<int64_t> ts = spaced_timesteps(n, T - clipped_idx.item<int64_t>());
    const SigmaSpacing spacing = use_karras_sigmas_ ? SigmaSpacing::kKarras
                                 : use_lu_lambdas_  ? SigmaSpacing::kLu
                                                    : SigmaSpacing::kInterp;
    std::vector<double> sigmas;
    multistep_sigmas(spacing, n, train_sigmas_, ts, sigmas);
    // sigma_min: the float32 training sigma of timestep 0, whatever the spacing.
    sigmas.push_back(final_sigmas_type_ == "sigma_min" ? static_cast<double>(train_sigmas_.front())
                                                       : 0.0);
    set_tables(ts, sigmas);
  }

  torch::Tensor step(const torch::Tensor& model_output_in, double timestep,
                     const torch::Tensor& sample_in,
                     std::optional<at::Generator> generator) override {
    const int64_t i = begin_step(timestep);
    const int64_t L = timesteps_.size(0);
    if (model_output_in.sizes() != sample_in.sizes() && variance_type_.rfind("learned", 0) != 0) {
      throw Error(std::string(kClass) + ": model_output and sample shapes differ");
    }
    // Improve numerical stability for small numbers of steps.
    const bool lower_order_final =
        i == L - 1 &&
        (euler_at_final_ || (lower_order_final_ && L < 15) || final_sigmas_type_ == "zero");
    const bool lower_order_second = i == L - 2 && lower_order_final_ && L < 15;

    const torch::Tensor model_output = convert_model_output(model_output_in, sample_in, i);
    push_model_output(model_output);

    // Upcast to avoid precision issues when computing prev_sample.
    const torch::Tensor sample = sample_in.to(torch::kFloat32);
    torch::Tensor noise;
    if (is_sde()) noise = draw_step_noise(model_output.sizes(), model_output.device(), generator);

    torch::Tensor prev;
    if (solver_order_ == 1 || lower_order_nums_ < 1 || lower_order_final) {
      prev = first_order_update(model_output, sample, noise, i);
    } else if (solver_order_ == 2 || lower_order_nums_ < 2 || lower_order_second) {
      prev = second_order_update(sample, noise, i);
    } else {
      if (is_sde()) {
        // Diffusers 0.31 has no third-order SDE update (it fails with UnboundLocalError here;
        // runs short enough to stay at orders 1-2 work there and here).
        throw Error(std::string(kClass) + ": step " + std::to_string(i) +
                    " needs a third-order update, which algorithm_type '" + algorithm_type_ +
                    "' does not have (Diffusers fails here too); use solver_order 2");
      }
      prev = third_order_update(sample, i);
    }
    end_step(i);
    return prev.to(model_output.scalar_type());
  }

 private:
  bool is_sde() const {
    return algorithm_type_ == "sde-dpmsolver" || algorithm_type_ == "sde-dpmsolver++";
  }
  bool is_plus_plus() const {
    return algorithm_type_ == "dpmsolver++" || algorithm_type_ == "sde-dpmsolver++";
  }

  // Diffusers' convert_model_output: x0 for DPM-Solver++, epsilon for DPM-Solver.
  torch::Tensor convert_model_output(const torch::Tensor& model_output_in,
                                     const torch::Tensor& sample, int64_t i) const {
    const bool learned = variance_type_ == "learned" || variance_type_ == "learned_range";
    // Only the "mean" half of a learned-variance epsilon output (Diffusers keeps 3 channels).
    const torch::Tensor model_output =
        learned && prediction_type_ == "epsilon" ? model_output_in.slice(1, 0, 3) : model_output_in;
    const auto [alpha_t, sigma_t] = sigma_to_alpha_sigma_t(sigmas_[i]);
    if (is_plus_plus()) return predicted_x0(model_output, sample, alpha_t, sigma_t);
    torch::Tensor epsilon = predicted_epsilon(model_output, sample, alpha_t, sigma_t);
    if (thresholding_) {
      torch::Tensor x0 = (sample - sigma_t * epsilon) / alpha_t;
      x0 = threshold(x0);
      epsilon = (sample - alpha_t * x0) / sigma_t;
    }
    return epsilon;
  }

  // One DPM-Solver step of order 1 (DDIM's update).
  torch::Tensor first_order_update(const torch::Tensor& m, const torch::Tensor& sample,
                                   const torch::Tensor& noise, int64_t i) const {
    const auto [alpha_t, sigma_t] = sigma_to_alpha_sigma_t(sigmas_[i + 1]);
    const auto [alpha_s, sigma_s] = sigma_to_alpha_sigma_t(sigmas_[i]);
    const torch::Tensor h = lambda_of(alpha_t, sigma_t) - lambda_of(alpha_s, sigma_s);
    if (algorithm_type_ == "dpmsolver++") {
      return (sigma_t / sigma_s) * sample - (alpha_t * (torch::exp(-h) - 1.0)) * m;
    }
    if (algorithm_type_ == "dpmsolver") {
      return (alpha_t / alpha_s) * sample - (sigma_t * (torch::exp(h) - 1.0)) * m;
    }
    if (algorithm_type_ == "sde-dpmsolver++") {
      return (sigma_t / sigma_s * torch::exp(-h)) * sample +
             (alpha_t * (1 - torch::exp(-2.0 * h))) * m +
             sigma_t * torch::sqrt(1.0 - torch::exp(-2 * h)) * noise;
    }
    return (alpha_t / alpha_s) * sample - 2.0 * (sigma_t * (torch::exp(h) - 1.0)) * m +
           sigma_t * torch::sqrt(torch::exp(2 * h) - 1.0) * noise;
  }

  // The second-order multistep update from the last two converted outputs.
  torch::Tensor second_order_update(const torch::Tensor& sample, const torch::Tensor& noise,
                                    int64_t i) const {
    const auto [alpha_t, sigma_t] = sigma_to_alpha_sigma_t(sigmas_[i + 1]);
    const auto [alpha_s0, sigma_s0] = sigma_to_alpha_sigma_t(sigmas_[i]);
    const auto [alpha_s1, sigma_s1] = sigma_to_alpha_sigma_t(sigmas_[i - 1]);
    const torch::Tensor lambda_t = lambda_of(alpha_t, sigma_t);
    const torch::Tensor lambda_s0 = lambda_of(alpha_s0, sigma_s0);
    const torch::Tensor lambda_s1 = lambda_of(alpha_s1, sigma_s1);
    const torch::Tensor& m0 = model_outputs_[model_outputs_.size() - 1];
    const torch::Tensor& m1 = model_outputs_[model_outputs_.size() - 2];
    const torch::Tensor h = lambda_t - lambda_s0;
    const torch::Tensor h_0 = lambda_s0 - lambda_s1;
    const torch::Tensor r0 = h_0 / h;
    const torch::Tensor& D0 = m0;
    const torch::Tensor D1 = (torch::reciprocal(r0) * 1.0) * (m0 - m1);
    const bool midpoint = solver_type_ == "midpoint";
    if (algorithm_type_ == "dpmsolver++") {
      const torch::Tensor a = alpha_t * (torch::exp(-h) - 1.0);
      if (midpoint) return (sigma_t / sigma_s0) * sample - a * D0 - 0.5 * a * D1;
      return (sigma_t / sigma_s0) * sample - a * D0 +
             (alpha_t * ((torch::exp(-h) - 1.0) / h + 1.0)) * D1;
    }
    if (algorithm_type_ == "dpmsolver") {
      const torch::Tensor a = sigma_t * (torch::exp(h) - 1.0);
      if (midpoint) return (alpha_t / alpha_s0) * sample - a * D0 - 0.5 * a * D1;
      return (alpha_t / alpha_s0) * sample - a * D0 -
             (sigma_t * ((torch::exp(h) - 1.0) / h - 1.0)) * D1;
    }
    if (algorithm_type_ == "sde-dpmsolver++") {
      const torch::Tensor a = alpha_t * (1 - torch::exp(-2.0 * h));
      const torch::Tensor first = (sigma_t / sigma_s0 * torch::exp(-h)) * sample + a * D0;
      const torch::Tensor second =
          midpoint ? first + 0.5 * a * D1
                   : first + (alpha_t * ((1.0 - torch::exp(-2.0 * h)) / (-2.0 * h) + 1.0)) * D1;
      return second + sigma_t * torch::sqrt(1.0 - torch::exp(-2 * h)) * noise;
    }
    const torch::Tensor a = sigma_t * (torch::exp(h) - 1.0);
    const torch::Tensor first = (alpha_t / alpha_s0) * sample - 2.0 * a * D0;
    const torch::Tensor second =
        midpoint ? first - a * D1
                 : first - 2.0 * (sigma_t * ((torch::exp(h) - 1.0) / h - 1.0)) * D1;
    return second + sigma_t * torch::sqrt(torch::exp(2 * h) - 1.0) * noise;
  }

  // The third-order multistep update (ODE algorithms only; step() refuses it for SDE).
  torch::Tensor third_order_update(const torch::Tensor& sample, int64_t i) const {
    const auto [alpha_t, sigma_t] = sigma_to_alpha_sigma_t(sigmas_[i + 1]);
    const auto [alpha_s0, sigma_s0] = sigma_to_alpha_sigma_t(sigmas_[i]);
    const auto [alpha_s1, sigma_s1] = sigma_to_alpha_sigma_t(sigmas_[i - 1]);
    const auto [alpha_s2, sigma_s2] = sigma_to_alpha_sigma_t(sigmas_[i - 2]);
    const torch::Tensor lambda_t = lambda_of(alpha_t, sigma_t);
    const torch::Tensor lambda_s0 = lambda_of(alpha_s0, sigma_s0);
    const torch::Tensor lambda_s1 = lambda_of(alpha_s1, sigma_s1);
    const torch::Tensor lambda_s2 = lambda_of(alpha_s2, sigma_s2);
    const size_t n = model_outputs_.size();
    const torch::Tensor& m0 = model_outputs_[n - 1];
    const torch::Tensor& m1 = model_outputs_[n - 2];
    const torch::Tensor& m2 = model_outputs_[n - 3];
    const torch::Tensor h = lambda_t - lambda_s0;
    const torch::Tensor h_0 = lambda_s0 - lambda_s1;
    const torch::Tensor h_1 = lambda_s1 - lambda_s2;
    const torch::Tensor r0 = h_0 / h, r1 = h_1 / h;
    const torch::Tensor& D0 = m0;
    const torch::Tensor D1_0 = (torch::reciprocal(r0) * 1.0) * (m0 - m1);
    const torch::Tensor D1_1 = (torch::reciprocal(r1) * 1.0) * (m1 - m2);
    const torch::Tensor D1 = D1_0 + (r0 / (r0 + r1)) * (D1_0 - D1_1);
    const torch::Tensor D2 = (torch::reciprocal(r0 + r1) * 1.0) * (D1_0 - D1_1);
    if (algorithm_type_ == "dpmsolver++") {
      return (sigma_t / sigma_s0) * sample - (alpha_t * (torch::exp(-h) - 1.0)) * D0 +
             (alpha_t * ((torch::exp(-h) - 1.0) / h + 1.0)) * D1 -
             (alpha_t * ((torch::exp(-h) - 1.0 + h) / torch::pow(h, 2) - 0.5)) * D2;
    }
    return (alpha_t / alpha_s0) * sample - (sigma_t * (torch::exp(h) - 1.0)) * D0 -
           (sigma_t * ((torch::exp(h) - 1.0) / h - 1.0)) * D1 -
           (sigma_t * ((torch::exp(h) - 1.0 - h) / torch::pow(h, 2) - 0.5)) * D2;
  }

  std::string algorithm_type_, solver_type_, variance_type_;
  bool euler_at_final_ = false, use_lu_lambdas_ = false;
  double lambda_min_clipped_ = -std::numeric_limits<double>::infinity();
  torch::Tensor lambda_t_;  // float32 [T]
};

}  // namespace

std::unique_ptr<Sampler> make_dpm_solver_multistep_sampler(const nlohmann::json& config,
                                                           const std::string& source) {
  return std::make_unique<DpmSolverMultistepSampler>(config, source);
}

}  // namespace difftrain::diffusion::detail
