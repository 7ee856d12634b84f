"""Extra PNDM / Euler / Euler ancestral / flow-matching Euler references beyond the shared fixtures
(tests/golden/samplers/schedulers2): the same layout, loop and TOY model as those (README there),
on a smaller sample [2, 2, 4, 4] so the files stay small.

Run with the Diffusers 0.31 + torch 1.13 reference stack:
    . /work/shared/refstack/env.sh && python3 tests/golden/samplers/make_samplers.py
Writes tests/golden/samplers/<name>.json and <name>.safetensors for each case below.
"scheduler_config" is the config as given to `cls.from_config` (what difftrain's make_sampler
reads, with "kind" = the class); "resolved_config" is Diffusers' resulting `scheduler.config`.
"""

import json
import math
import os

import torch
from diffusers import (EulerAncestralDiscreteScheduler, EulerDiscreteScheduler,
                       FlowMatchEulerDiscreteScheduler, PNDMScheduler)
from safetensors.torch import save_file

torch.set_num_threads(1)
OUT = os.path.dirname(os.path.abspath(__file__))
SHAPE = [2, 2, 4, 4]
SD = dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
# Stable Diffusion 1.5's scheduler_config.json (a PNDMScheduler file).
SD15 = {
    "_class_name": "PNDMScheduler", "_diffusers_version": "0.6.0", "beta_end": 0.012,
    "beta_schedule": "scaled_linear", "beta_start": 0.00085, "num_train_timesteps": 1000,
    "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
    "trained_betas": None, "clip_sample": False,
}

# name, class, config (from_config of this dict), num_inference_steps, stochastic
CASES = [
    ("euler_trailing", EulerDiscreteScheduler, dict(SD, timestep_spacing="trailing"), 7, False),
    ("euler_linspace_vpred", EulerDiscreteScheduler,
     dict(prediction_type="v_prediction", timestep_spacing="linspace"), 9, False),
    ("euler_karras", EulerDiscreteScheduler,
     dict(SD, use_karras_sigmas=True, timestep_spacing="leading", steps_offset=1), 10, False),
    ("euler_karras_sigma_min", EulerDiscreteScheduler,
     dict(SD, use_karras_sigmas=True, final_sigmas_type="sigma_min", sigma_min=0.05,
          sigma_max=10.0), 8, False),
    ("euler_exponential", EulerDiscreteScheduler,
     dict(SD, use_exponential_sigmas=True, timestep_spacing="trailing"), 9, False),
    ("euler_exponential_sigma_min", EulerDiscreteScheduler,
     dict(use_exponential_sigmas=True, sigma_min=0.1, final_sigmas_type="sigma_min"), 6, False),
    ("euler_log_linear", EulerDiscreteScheduler,
     dict(SD, interpolation_type="log_linear", timestep_spacing="trailing"), 8, False),
    ("euler_zero_snr", EulerDiscreteScheduler,
     dict(SD, rescale_betas_zero_snr=True, prediction_type="v_prediction",
          timestep_spacing="trailing"), 6, False),
    ("euler_sample_cosine", EulerDiscreteScheduler,
     dict(beta_schedule="squaredcos_cap_v2", prediction_type="sample"), 5, False),
    ("euler_continuous_v", EulerDiscreteScheduler,
     dict(SD, prediction_type="v_prediction", timestep_type="continuous"), 6, False),
    ("euler_from_sd15", EulerDiscreteScheduler, SD15, 12, False),
    ("pndm_linear_offset0", PNDMScheduler, dict(skip_prk_steps=True), 20, False),
    ("pndm_prk", PNDMScheduler, dict(SD, steps_offset=1), 8, False),
    ("pndm_vpred_linspace", PNDMScheduler,
     dict(SD, skip_prk_steps=True, prediction_type="v_prediction", timestep_spacing="linspace",
          set_alpha_to_one=True), 15, False),
    ("pndm_trailing_one_step", PNDMScheduler,
     dict(SD, skip_prk_steps=True, timestep_spacing="trailing"), 1, False),
    ("euler_ancestral_leading_vpred", EulerAncestralDiscreteScheduler,
     dict(SD, timestep_spacing="leading", steps_offset=1, prediction_type="v_prediction"), 8, True),
    ("euler_ancestral_trailing_zero_snr", EulerAncestralDiscreteScheduler,
     dict(SD, timestep_spacing="trailing", rescale_betas_zero_snr=True,
          prediction_type="v_prediction"), 5, True),
    ("flow_match_shift1", FlowMatchEulerDiscreteScheduler, dict(shift=1.0), 12, False),
    ("flow_match_shift3_t500", FlowMatchEulerDiscreteScheduler,
     dict(shift=3.0, num_train_timesteps=500), 7, False),
]


def toy(x_in, t):
    c = 0.1 * math.sin(float(t) / 250.0)
    return 0.3 * x_in + c


def run(name, cls, cfg, n, stochastic):
    sched = cls.from_config(cfg)
    sched.set_timesteps(n)
    seed, step_seed = 11, 12
    g = torch.Generator().manual_seed(seed)
    ins = getattr(sched, "init_noise_sigma", 1.0)
    x_T = torch.randn(SHAPE, generator=g) * ins
    kwargs = {}
    if stochastic:
        kwargs["generator"] = torch.Generator().manual_seed(step_seed)
    x, outs, xs = x_T, [], []
    for t in sched.timesteps:
        x_in = sched.scale_model_input(x, t) if hasattr(sched, "scale_model_input") else x
        m = toy(x_in, t)
        x = sched.step(m, t, x, **kwargs).prev_sample
        outs.append(m)
        xs.append(x)
    config = {k: v for k, v in dict(sched.config).items() if k != "_use_default_values"}
    config["_class_name"] = cls.__name__
    config["_diffusers_version"] = "0.31.0"
    given = dict(cfg)
    given.setdefault("_class_name", cls.__name__)
    meta = {
        "scheduler_config": given,
        "kind": cls.__name__,
        "resolved_config": config,
        "class": cls.__name__,
        "num_inference_steps": n,
        "num_loop_steps": len(sched.timesteps),
        "shape": SHAPE,
        "seed_x_T": seed,
        "seed_step_generator": step_seed if stochastic else None,
        "float32_vs_float64_final_maxabs": 0.0,
        "notes": "made by make_samplers.py; loop and TOY model as in schedulers2/README.md",
    }
    tensors = {
        "timesteps": sched.timesteps.contiguous(),
        "sigmas": sched.sigmas.to(torch.float32).contiguous() if hasattr(sched, "sigmas") else None,
        "init_noise_sigma": torch.tensor([float(ins)], dtype=torch.float32),
        "x_T": x_T.contiguous(),
        "model_output": torch.stack(outs).contiguous(),
        "prev_sample": torch.stack(xs).contiguous(),
    }
    tensors = {k: v for k, v in tensors.items() if v is not None}
    with open(os.path.join(OUT, name + ".json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True, allow_nan=False)
        f.write("\n")
    save_file(tensors, os.path.join(OUT, name + ".safetensors"))
    finite = bool(torch.isfinite(torch.stack(xs)).all())
    print(f"{name}: L={len(sched.timesteps)} ts {sched.timesteps.dtype} "
          f"final |x| max {x.abs().max():.3f} finite={finite}")


for case in CASES:
    run(*case)
