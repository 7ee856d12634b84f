// UniPCMultistepScheduler of Diffusers 0.31 as a Sampler: the UniP predictor and UniC corrector
// with B(h) = h (bh1) or e^h - 1 (bh2), any order, on x0 (predict_x0) or epsilon. The sigmas and
// coefficients are 0-dim float32 tensors and every formula keeps Diffusers' operation order, so a
// step runs the same torch kernels on the same values as Diffusers does.

#include "difftrain/core/error.h"
#include "multistep_common.h"
#include "sampler_classes.h"
#include "sigma_schedule.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace difftrain::diffusion::detail {

namespace {

constexpr const char* kClass = "UniPCMultistepScheduler";

class UniPcSampler final : public MultistepSampler {
 public:
  UniPcSampler(const nlohmann::json& json, const std::string& source)
      : MultistepSampler(json, source, kClass) {
    const ConfigReader& r = reader_;
    predict_x0_ = r.get_bool("predict_x0", true);
    const std::string solver =
        r.get_choice("solver_type", "bh2", {"bh1", "bh2", "midpoint", "heun", "logrho"});
    // Diffusers registers DPM-Solver's solver types as bh2.
    solver_type_ = (solver == "bh1" || solver == "bh2") ? solver : "bh2";
    disable_corrector_ = r.get_int_list("disable_corrector");

    const std::string where = r.where();
    if (solver_order_ < 1) {
      throw Error(where + "solver_order is " + std::to_string(solver_order_) +
                  "; it must be >= 1 (2 for guided sampling, 3 for unconditional)");
    }
    if (use_exponential_sigmas_ || use_beta_sigmas_) {
      // Diffusers 0.31's UniPC fails on these itself (log_sigmas is undefined there).
      throw Error(where + (use_beta_sigmas_ ? "use_beta_sigmas" : "use_exponential_sigmas") +
                  " is not supported by " + kClass +
                  " (it fails in Diffusers 0.31 too); use "
                  "use_karras_sigmas");
    }
    if (use_flow_sigmas_ && !predict_x0_) {
      throw Error(where +
                  "flow_prediction needs predict_x0 true (Diffusers' UniPC has no noise-prediction "
                  "form of it)");
    }
    const auto solver_p = r.json().find("solver_p");
    if (solver_p != r.json().end() && !solver_p->is_null()) {
      throw Error(where +
                  "solver_p (another scheduler as the predictor) is not supported; set "
                  "it to null");
    }
  }

  nlohmann::json config() const override {
    nlohmann::json c = shared_config();
    c["predict_x0"] = predict_x0_;
    c["solver_type"] = solver_type_;
    c["disable_corrector"] = disable_corrector_;
    c["solver_p"] = nullptr;
    return c;
  }

  void set_timesteps(int64_t n) override {
    if (use_flow_sigmas_) {
      set_flow_timesteps(n);
      return;
    }
    std::vector<int64_t> ts = spaced_timesteps(n, betas_.num_train_timesteps);
    std::vector<double> sigmas;
    multistep_sigmas(use_karras_sigmas_ ? SigmaSpacing::kKarras : SigmaSpacing::kInterp, n,
                     train_sigmas_, ts, sigmas);
    double sigma_last = 0.0;
    if (final_sigmas_type_ == "sigma_min") {
      // Karras: the last Karras sigma; otherwise the training sigma of timestep 0.
      sigma_last = use_karras_sigmas_ ? sigmas.back() : static_cast<double>(train_sigmas_.front());
    }
    sigmas.push_back(sigma_last);
    set_tables(ts, sigmas);
    this_order_ = 0;
    last_sample_ = torch::Tensor();
  }

  torch::Tensor step(const torch::Tensor& model_output, double timestep,
                     const torch::Tensor& sample_in, std::optional<at::Generator>) override {
    const int64_t i = begin_step(timestep);
    const int64_t L = timesteps_.size(0);
    if (model_output.sizes() != sample_in.sizes()) {
      throw Error(std::string(kClass) + ": model_output and sample shapes differ");
    }
    const bool disabled = std::find(disable_corrector_.begin(), disable_corrector_.end(), i - 1) !=
                          disable_corrector_.end();
    const bool use_corrector = i > 0 && !disabled && last_sample_.defined();
    const torch::Tensor converted = convert_model_output(model_output, sample_in, i);
    torch::Tensor sample = sample_in;
    if (use_corrector)
      sample = corrector_update(converted, last_sample_, sample_in, this_order_, i);

    push_model_output(converted);

    const int64_t order = lower_order_final_ ? std::min(solver_order_, L - i) : solver_order_;
    this_order_ = std::min(order, lower_order_nums_ + 1);  // warm-up of the multistep history
    last_sample_ = sample;
    const torch::Tensor prev = predictor_update(sample, this_order_, i);
    end_step(i);
    return prev;
  }

 private:
  // use_flow_sigmas: linspace(1, 1 / T, n + 1)[:-1] shifted by flow_shift in float64, the first
  // nudged below 1 (so that log(alpha) stays finite), timesteps = int64(sigma * T) (truncated, as
  // Diffusers' astype), then the final sigma (0 or the last).
  void set_flow_timesteps(int64_t n) {
    if (n < 1) {
      throw Error(std::string(kClass) + ": num_inference_steps is " + std::to_string(n) +
                  "; it must be >= 1");
    }
    const auto T = static_cast<double>(betas_.num_train_timesteps);
    std::vector<double> sigmas;
    const double stop = 1.0 / T;
    for (int64_t k = 0; k < n; ++k) {
      // numpy linspace over n + 1 points: start + k * step, the last point dropped.
      const double step = (stop - 1.0) / static_cast<double>(n);
      const double s = 1.0 + static_cast<double>(k) * step;
      sigmas.push_back(flow_shift_ * s / (1 + (flow_shift_ - 1) * s));
    }
    if (std::fabs(sigmas[0] - 1) < 1e-6) sigmas[0] -= 1e-6;
    std::vector<int64_t> ts;
    for (double s : sigmas) ts.push_back(static_cast<int64_t>(s * T));
    sigmas.push_back(final_sigmas_type_ == "sigma_min" ? sigmas.back() : 0.0);
    set_tables(ts, sigmas);
    this_order_ = 0;
    last_sample_ = torch::Tensor();
  }

  // Diffusers' convert_model_output: x0 (predict_x0) or epsilon.
  torch::Tensor convert_model_output(const torch::Tensor& model_output, const torch::Tensor& sample,
                                     int64_t i) const {
    const auto [alpha_t, sigma_t] = alpha_sigma(sigmas_[i]);
    if (predict_x0_) return predicted_x0(model_output, sample, alpha_t, sigma_t);
    return predicted_epsilon(model_output, sample, alpha_t, sigma_t);
  }

  // The B(h) coefficients shared by UniP and UniC: h_phi_1 = expm1(hh), B_h, and the
  // right-hand side b [order] of the rho system; rks [order] ends with 1.
  struct Coefficients {
    torch::Tensor hh, h_phi_1, B_h, R, b;
  };
  Coefficients coefficients(const torch::Tensor& h, const std::vector<torch::Tensor>& rks_in,
                            int64_t order, const torch::Device& device) const {
    Coefficients c;
    std::vector<torch::Tensor> rks = rks_in;
    rks.push_back(torch::scalar_tensor(1.0, torch::kFloat32));
    const torch::Tensor rk = torch::stack(rks).to(device);
    c.hh = predict_x0_ ? -h : h;
    c.h_phi_1 = torch::expm1(c.hh);  // h * phi_1(h) = e^h - 1
    torch::Tensor h_phi_k = c.h_phi_1 / c.hh - 1;
    int64_t factorial_i = 1;
    c.B_h = solver_type_ == "bh1" ? c.hh : torch::expm1(c.hh);
    std::vector<torch::Tensor> R, b;
    for (int64_t k = 1; k <= order; ++k) {
      R.push_back(torch::pow(rk, k - 1));
      b.push_back(h_phi_k * factorial_i / c.B_h);
      factorial_i *= k + 1;
      h_phi_k = h_phi_k / c.hh - 1.0 / static_cast<double>(factorial_i);
    }
    c.R = torch::stack(R);
    c.b = torch::stack(b).to(device);
    return c;
  }

  // x_t_ of both updates: the first-order part.
  torch::Tensor base_update(const torch::Tensor& x, const torch::Tensor& m0, const Coefficients& c,
                            const torch::Tensor& alpha_t, const torch::Tensor& sigma_t,
                            const torch::Tensor& alpha_s0, const torch::Tensor& sigma_s0) const {
    if (predict_x0_) return sigma_t / sigma_s0 * x - alpha_t * c.h_phi_1 * m0;
    return alpha_t / alpha_s0 * x - sigma_t * c.h_phi_1 * m0;
  }

  // UniP-`order` (B(h) version) from sample at sigmas[i] to sigmas[i + 1].
  torch::Tensor predictor_update(const torch::Tensor& x, int64_t order, int64_t i) const {
    const torch::Tensor& m0 = model_outputs_.back();
    const auto [alpha_t, sigma_t] = alpha_sigma(sigmas_[i + 1]);
    const auto [alpha_s0, sigma_s0] = alpha_sigma(sigmas_[i]);
    const torch::Tensor lambda_s0 = lambda_of(alpha_s0, sigma_s0);
    const torch::Tensor h = lambda_of(alpha_t, sigma_t) - lambda_s0;
    std::vector<torch::Tensor> rks, D1s;
    for (int64_t k = 1; k < order; ++k) {
      const torch::Tensor& mi = model_outputs_[model_outputs_.size() - 1 - k];
      const auto [alpha_si, sigma_si] = alpha_sigma(sigmas_[i - k]);
      const torch::Tensor rk = (lambda_of(alpha_si, sigma_si) - lambda_s0) / h;
      rks.push_back(rk);
      D1s.push_back((mi - m0) / rk);
    }
    const Coefficients c = coefficients(h, rks, order, x.device());
    const torch::Tensor x_t_ = base_update(x, m0, c, alpha_t, sigma_t, alpha_s0, sigma_s0);
    const torch::Tensor scale = predict_x0_ ? alpha_t * c.B_h : sigma_t * c.B_h;
    torch::Tensor x_t;
    if (D1s.empty()) {
      // Diffusers: pred_res = 0 (a Python int), so the term is (scale * 0), NaN when B_h = -inf.
      x_t = x_t_ - scale * 0;
    } else {
      const torch::Tensor D = torch::stack(D1s, 1);  // [B, K, C, ...]
      torch::Tensor rhos_p;
      if (order == 2) {
        rhos_p =
            torch::tensor({0.5}, torch::TensorOptions().dtype(x.scalar_type()).device(x.device()));
      } else {
        const int64_t k = c.R.size(0) - 1;
        rhos_p = at::linalg_solve(c.R.slice(0, 0, k).slice(1, 0, k), c.b.slice(0, 0, k))
                     .to(x.device())
                     .to(x.scalar_type());
      }
      const torch::Tensor pred_res = torch::einsum("k,bkc...->bc...", {rhos_p, D});
      x_t = x_t_ - scale * pred_res;
    }
    return x_t.to(x.scalar_type());
  }

  // UniC-`order`: corrects this_sample (at sigmas[i]) from last_sample (at sigmas[i - 1]) with
  // the model output at this_sample.
  torch::Tensor corrector_update(const torch::Tensor& model_t, const torch::Tensor& x,
                                 const torch::Tensor& this_sample, int64_t order, int64_t i) const {
    const torch::Tensor& m0 = model_outputs_.back();
    const auto [alpha_t, sigma_t] = alpha_sigma(sigmas_[i]);
    const auto [alpha_s0, sigma_s0] = alpha_sigma(sigmas_[i - 1]);
    const torch::Tensor lambda_s0 = lambda_of(alpha_s0, sigma_s0);
    const torch::Tensor h = lambda_of(alpha_t, sigma_t) - lambda_s0;
    std::vector<torch::Tensor> rks, D1s;
    for (int64_t k = 1; k < order; ++k) {
      const torch::Tensor& mi = model_outputs_[model_outputs_.size() - 1 - k];
      const auto [alpha_si, sigma_si] = alpha_sigma(sigmas_[i - (k + 1)]);
      const torch::Tensor rk = (lambda_of(alpha_si, sigma_si) - lambda_s0) / h;
      rks.push_back(rk);
      D1s.push_back((mi - m0) / rk);
    }
    const torch::Device device = this_sample.device();
    const Coefficients c = coefficients(h, rks, order, device);
    torch::Tensor rhos_c;
    if (order == 1) {
      rhos_c = torch::tensor({0.5}, torch::TensorOptions().dtype(x.scalar_type()).device(device));
    } else {
      rhos_c = at::linalg_solve(c.R, c.b).to(device).to(x.scalar_type());
    }
    const torch::Tensor x_t_ = base_update(x, m0, c, alpha_t, sigma_t, alpha_s0, sigma_s0);
    const torch::Tensor D1_t = model_t - m0;
    const torch::Tensor last_rho = rhos_c[rhos_c.size(0) - 1];
    torch::Tensor inner;
    if (D1s.empty()) {
      inner = 0 + last_rho * D1_t;
    } else {
      const torch::Tensor D = torch::stack(D1s, 1);
      const torch::Tensor corr_res =
          torch::einsum("k,bkc...->bc...", {rhos_c.slice(0, 0, rhos_c.size(0) - 1), D});
      inner = corr_res + last_rho * D1_t;
    }
    const torch::Tensor scale = predict_x0_ ? alpha_t * c.B_h : sigma_t * c.B_h;
    return (x_t_ - scale * inner).to(x.scalar_type());
  }

  std::string solver_type_;
  bool predict_x0_ = true;
  std::vector<int64_t> disable_corrector_;
  int64_t this_order_ = 0;
  torch::Tensor last_sample_;  // the sample the last predictor started from
};

}  // namespace

std::unique_ptr<Sampler> make_unipc_sampler(const nlohmann::json& config,
                                            const std::string& source) {
  return std::make_unique<UniPcSampler>(config, source);
}

}  // namespace difftrain::diffusion::detail
