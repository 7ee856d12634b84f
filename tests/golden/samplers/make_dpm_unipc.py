"""Extra DPMSolverMultistepScheduler / UniPCMultistepScheduler references beyond the shared
fixtures (tests/golden/samplers/schedulers2): the same layout and loop as those (README there),
on a smaller sample [2, 2, 4, 4] so the files stay small.

Run with the Diffusers 0.31 + torch 1.13 reference stack:
    . /work/shared/refstack/env.sh && python3 tests/golden/samplers/make_dpm_unipc.py
Writes tests/golden/samplers/<name>.json and <name>.safetensors for each case below. Diffusers
writes lambda_min_clipped = -inf as the bare token -Infinity, which is not JSON; it is written as
the string "-Infinity" here (difftrain's DPM-Solver reads both).
"""

import json
import math
import os

import torch
from diffusers import DPMSolverMultistepScheduler, UniPCMultistepScheduler
from safetensors.torch import save_file

torch.set_num_threads(1)
OUT = os.path.dirname(os.path.abspath(__file__))
SHAPE = [2, 2, 4, 4]
SD = dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
# Stable Diffusion 1.5's scheduler_config.json (a PNDMScheduler file), loaded into DPM-Solver.
SD15 = {
    "_class_name": "PNDMScheduler", "_diffusers_version": "0.6.0", "beta_end": 0.012,
    "beta_schedule": "scaled_linear", "beta_start": 0.00085, "num_train_timesteps": 1000,
    "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
    "trained_betas": None, "clip_sample": False,
}

# name, class, config (from_config of this dict), num_inference_steps, stochastic
CASES = [
    ("dpm_vpred_trailing", DPMSolverMultistepScheduler,
     dict(SD, prediction_type="v_prediction", timestep_spacing="trailing"), 10, False),
    ("dpm_sd15_leading", DPMSolverMultistepScheduler, SD15, 25, False),
    ("dpm_order3", DPMSolverMultistepScheduler, dict(solver_order=3), 20, False),
    ("dpm_order3_lof_heun", DPMSolverMultistepScheduler,
     dict(SD, solver_order=3, solver_type="heun", final_sigmas_type="sigma_min"), 12, False),
    ("dpm_sde_karras", DPMSolverMultistepScheduler,
     dict(SD, algorithm_type="sde-dpmsolver++", use_karras_sigmas=True), 15, True),
    ("dpm_sde_heun", DPMSolverMultistepScheduler,
     dict(SD, algorithm_type="sde-dpmsolver++", solver_type="heun", euler_at_final=True), 7, True),
    ("dpm_cosine_clipped", DPMSolverMultistepScheduler,
     dict(beta_schedule="squaredcos_cap_v2", lambda_min_clipped=-5.1, final_sigmas_type="sigma_min",
          timestep_spacing="leading", steps_offset=1), 9, False),
    ("dpm_dpmsolver", DPMSolverMultistepScheduler,
     dict(SD, algorithm_type="dpmsolver", final_sigmas_type="sigma_min"), 10, False),
    ("dpm_sde_dpmsolver", DPMSolverMultistepScheduler,
     dict(SD, algorithm_type="sde-dpmsolver", final_sigmas_type="sigma_min", solver_type="heun"), 8,
     True),
    ("dpm_sample_threshold", DPMSolverMultistepScheduler,
     dict(prediction_type="sample", thresholding=True, sample_max_value=1.5), 8, False),
    ("dpm_lu", DPMSolverMultistepScheduler, dict(SD, use_lu_lambdas=True), 10, False),
    ("dpm_zero_snr", DPMSolverMultistepScheduler,
     dict(SD, rescale_betas_zero_snr=True, prediction_type="v_prediction",
          timestep_spacing="trailing"), 10, False),
    ("dpm_order1_karras", DPMSolverMultistepScheduler,
     dict(SD, solver_order=1, use_karras_sigmas=True, final_sigmas_type="sigma_min"), 6, False),
    ("unipc_bh1", UniPCMultistepScheduler,
     dict(SD, solver_type="bh1", final_sigmas_type="sigma_min"), 10, False),
    ("unipc_karras", UniPCMultistepScheduler, dict(SD, use_karras_sigmas=True), 15, False),
    ("unipc_karras_sigma_min", UniPCMultistepScheduler,
     dict(SD, use_karras_sigmas=True, final_sigmas_type="sigma_min", solver_order=3), 12, False),
    ("unipc_order3_vpred_leading", UniPCMultistepScheduler,
     dict(SD, solver_order=3, prediction_type="v_prediction", timestep_spacing="leading",
          steps_offset=1), 12, False),
    ("unipc_eps_disable_corrector", UniPCMultistepScheduler,
     dict(SD, predict_x0=False, disable_corrector=[0, 1], timestep_spacing="trailing",
          final_sigmas_type="sigma_min"), 8, False),
    ("unipc_sample_threshold_nolof", UniPCMultistepScheduler,
     dict(prediction_type="sample", thresholding=True, sample_max_value=2.0,
          lower_order_final=False, solver_order=3, final_sigmas_type="sigma_min"), 16, False),
]


def toy(x_in, t):
    c = 0.1 * math.sin(float(t) / 250.0)
    return 0.3 * x_in + c


def run(name, cls, cfg, n, stochastic):
    sched = cls.from_config(cfg)
    sched.set_timesteps(n)
    seed, step_seed = 11, 12
    g = torch.Generator().manual_seed(seed)
    x_T = torch.randn(SHAPE, generator=g) * sched.init_noise_sigma
    kwargs = {}
    if stochastic:
        kwargs["generator"] = torch.Generator().manual_seed(step_seed)
    x, outs, xs = x_T, [], []
    for t in sched.timesteps:
        m = toy(sched.scale_model_input(x, t), t)
        x = sched.step(m, t, x, **kwargs).prev_sample
        outs.append(m)
        xs.append(x)
    config = dict(sched.config)
    config["_class_name"] = cls.__name__
    config["_diffusers_version"] = "0.31.0"
    for k, v in list(config.items()):
        if isinstance(v, float) and math.isinf(v):
            config[k] = "-Infinity" if v < 0 else "Infinity"
    # The config as given (what make_sampler reads): the SD-1.5 case keeps its PNDM file.
    given = dict(cfg)
    given.setdefault("_class_name", cls.__name__)
    meta = {
        "scheduler_config": given,
        "resolved_config": config,
        "class": cls.__name__,
        "num_inference_steps": n,
        "num_loop_steps": len(sched.timesteps),
        "shape": SHAPE,
        "seed_x_T": seed,
        "seed_step_generator": step_seed if stochastic else None,
        "float32_vs_float64_final_maxabs": 0.0,
        "notes": "made by make_dpm_unipc.py; loop and TOY model as in schedulers2/README.md",
    }
    tensors = {
        "timesteps": sched.timesteps.to(torch.int64).contiguous(),
        "sigmas": sched.sigmas.to(torch.float32).contiguous(),
        "init_noise_sigma": torch.tensor([float(sched.init_noise_sigma)], dtype=torch.float32),
        "x_T": x_T.contiguous(),
        "model_output": torch.stack(outs).contiguous(),
        "prev_sample": torch.stack(xs).contiguous(),
    }
    with open(os.path.join(OUT, name + ".json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True, allow_nan=False)
        f.write("\n")
    save_file(tensors, os.path.join(OUT, name + ".safetensors"))
    finite = bool(torch.isfinite(torch.stack(xs)).all())
    print(f"{name}: L={len(sched.timesteps)} final |x| max {x.abs().max():.3f} finite={finite}")


for case in CASES:
    run(*case)
