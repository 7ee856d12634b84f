#!/usr/bin/env python3
"""Makes Wan's sampling references:
  tiny_wan/scheduler/scheduler_config.json   UniPCMultistepScheduler as Wan2.1-T2V-*-Diffusers ships it
  tiny_wan/model_index.json                  WanPipeline (Wan 2.1 layout: transformer_2 null)
  tiny_wan_a14b/                             Wan 2.2 A14B-style two-expert pipeline folder: model_index
                                             (boundary_ratio 0.875), its own transformer_2/ (new seed),
                                             symlinks to ../tiny_wan/{transformer,vae,text_encoder,
                                             tokenizer,scheduler}
  unipc_flow.safetensors + unipc_flow.json   the scheduler alone, step by step, on fake model outputs
  tiny_wan/sample_e2e.safetensors + .json    WanPipeline.__call__ end to end (prompt strings in)
README.md ("## Sampling (make_pipeline.py)") documents every file.

Run with refstack2's Python (torch 2.6 CPU, Diffusers 0.40.0.dev0) from the project root:
    OMP_NUM_THREADS=1 ../shared/refstack2/run python3 tests/golden/wan/make_pipeline.py tests/golden/wan
Re-running writes byte-identical files (float32 / float64 on one CPU thread, fixed seeds,
safetensors with sorted keys and metadata {"format": "pt"}, JSON with sorted keys).

Everything Diffusers does is run unmodified: the scheduler's set_timesteps / set_begin_index /
step, and WanPipeline.from_pretrained(...) + __call__. The text side has no transformers here, so
the pipeline's `tokenizer` and `text_encoder` attributes are duck-typed stand-ins from
make_text_encoder.py (the plain-Python T5 tokenizer and the plain-torch UMT5 transcription of
tiny_wan/text_encoder), plugged in after from_pretrained(tiny_wan, text_encoder=None,
tokenizer=None). Hooks (forward pre-hooks / hooks on the transformers, a wrapper around
vae.decode) only observe.

Checks (the files do not depend on them): an independent float64 restatement of UniPC
(ref_unipc) against the scheduler; set_begin_index(0) vs the index lookup; a plain restatement of
the whole sampling loop (sample_restated: encode_prompt restated, torch.randn, the scheduler,
two transformer calls + CFG, the expert switch, de-normalisation, vae.decode, postprocess) against
the pipeline, bit for bit.
"""
import json
import math
import logging
import os
import sys

import numpy as np
import torch
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_text_encoder as mte  # noqa: E402  (imports no diffusers)

# make_transformer flips Diffusers' transformers-availability flag before diffusers.loaders is
# imported (refstack2's transformers is a stub; nothing of it runs), so import it first.
import make_transformer as mtr  # noqa: E402  (also: randomize, the weight scheme of transformer/)
import diffusers  # noqa: E402
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel  # noqa: E402
from diffusers.pipelines.wan import pipeline_wan  # noqa: E402
from diffusers.pipelines.wan.pipeline_wan import WanPipeline  # noqa: E402

# Wan-AI/Wan2.1-T2V-{1.3B,14B}-Diffusers scheduler/scheduler_config.json, as we believe it reads
# (written by Diffusers ~0.33: no use_dynamic_shifting / time_shift_type / sigma_min / sigma_max /
# shift_terminal keys; save_config below writes those too, with their defaults).
WAN_SCHEDULER = dict(
    beta_end=0.02, beta_schedule="linear", beta_start=0.0001, disable_corrector=[],
    dynamic_thresholding_ratio=0.995, final_sigmas_type="zero", flow_shift=3.0,
    lower_order_final=True, num_train_timesteps=1000, predict_x0=True,
    prediction_type="flow_prediction", rescale_betas_zero_snr=False, sample_max_value=1.0,
    solver_order=2, solver_p=None, solver_type="bh2", steps_offset=0, thresholding=False,
    timestep_spacing="linspace", trained_betas=None, use_beta_sigmas=False,
    use_exponential_sigmas=False, use_flow_sigmas=True, use_karras_sigmas=False)
SEED_TRANSFORMER_2 = 20270104
SEED_UNIPC = 20270121
UNIPC_SHAPE = (2, 4, 2, 3, 3)
BOUNDARY_RATIO = 0.875


def _finite_json(obj):
    """Non-finite floats as the strings "inf", "-inf", "nan": JSON has no literal for them
    (Python's json writes Infinity, which strict readers such as the C++ tests' refuse)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if obj != obj else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_json(v) for v in obj]
    return obj


def write_json(path, obj):
    obj = _finite_json(obj)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def save_st(path, tensors):
    save_file({k: tensors[k].detach().clone().contiguous() for k in sorted(tensors)}, path,
              metadata={"format": "pt"})


def maxdiff(a, b):
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


# ---- 1. folders ----------------------------------------------------------------------------------

def write_model_index(pipe, folder, text_side=True):
    """What save_pretrained writes as model_index.json (its save_config), with the text side named
    as Wan's repos name it (the stand-ins / None would be written as [null, null])."""
    if text_side:
        pipe.register_to_config(text_encoder=("transformers", "UMT5EncoderModel"),
                                tokenizer=("transformers", "T5TokenizerFast"))
    pipe.save_config(folder)


def relink(path, target):
    if os.path.islink(path):
        if os.readlink(path) == target:
            return
        os.remove(path)
    assert not os.path.exists(path), f"{path} exists and is not a symlink"
    os.symlink(target, path)


def make_folders(out):
    tiny = os.path.join(out, "tiny_wan")
    a14b = os.path.join(out, "tiny_wan_a14b")
    sched = UniPCMultistepScheduler(**WAN_SCHEDULER)
    sched.save_config(os.path.join(tiny, "scheduler"))
    vae = AutoencoderKLWan.from_pretrained(os.path.join(tiny, "vae"))
    tr = WanTransformer3DModel.from_pretrained(os.path.join(tiny, "transformer"))
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=sched, transformer=tr,
                       transformer_2=None, boundary_ratio=None, expand_timesteps=False)
    write_model_index(pipe, tiny)

    os.makedirs(a14b, exist_ok=True)
    for sub in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        relink(os.path.join(a14b, sub), f"../tiny_wan/{sub}")
    torch.manual_seed(0)  # Diffusers' scale_shift_table init draws from the global RNG
    tr2 = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(os.path.join(tiny, "transformer")))
    mtr.randomize(tr2, SEED_TRANSFORMER_2)
    tr2.save_pretrained(os.path.join(a14b, "transformer_2"))
    tr2 = WanTransformer3DModel.from_pretrained(os.path.join(a14b, "transformer_2"))
    pipe2 = WanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=sched, transformer=tr,
                        transformer_2=tr2, boundary_ratio=BOUNDARY_RATIO, expand_timesteps=False)
    write_model_index(pipe2, a14b)


# ---- 2. UniPC alone ------------------------------------------------------------------------------

def lam(s):
    """lambda = log(alpha) - log(sigma) with alpha = 1 - sigma (flow sigmas); float64 tensors."""
    return torch.log(1 - s) - torch.log(s)


def phi_terms(h, order):
    """hh = -h (predict_x0), h_phi_1 = expm1(hh), B_h = expm1(hh) (bh2), b_j (j = 1..order)."""
    hh = -h
    h_phi_1 = torch.expm1(hh)
    B_h = torch.expm1(hh)
    h_phi_k = h_phi_1 / hh - 1
    fact, b = 1, []
    for j in range(1, order + 1):
        b.append(h_phi_k * fact / B_h)
        fact *= j + 1
        h_phi_k = h_phi_k / hh - 1 / fact
    return h_phi_1, B_h, torch.stack(b)


def ref_unipc(sig, x, noise, order, lower_order_final, disable_corrector=()):
    """Independent float64 restatement of UniPCMultistepScheduler.step for predict_x0,
    flow_prediction, bh2, use_flow_sigmas (alpha = 1 - sigma), with model_output = 0.5 x + noise.
    Returns per step the x0 prediction, the (corrected) sample, the output and the coefficients."""
    sig = sig.double()
    N = len(sig) - 1
    x = x.double()
    ms, steps = [], []
    last_sample, last_order = None, None
    for i in range(N):
        v = 0.5 * x + noise[i].double()
        x0 = x - sig[i] * v
        info = {"step": i, "sigma_s0": float(sig[i]), "sigma_t": float(sig[i + 1])}
        use_c = i > 0 and (i - 1) not in disable_corrector and last_sample is not None
        if use_c:  # UniC: corrects x_i (predicted at step i-1 from last_sample) with x0(x_i)
            p = last_order
            st, ss = sig[i], sig[i - 1]
            h = lam(st) - lam(ss)
            m0 = ms[-1]
            rks, D1s = [], []
            for k in range(1, p):
                rk = (lam(sig[i - (k + 1)]) - lam(ss)) / h
                rks.append(rk)
                D1s.append((ms[-(k + 1)] - m0) / rk)
            rks = torch.stack(rks + [torch.ones((), dtype=torch.float64)])
            h_phi_1, B_h, b = phi_terms(h, p)
            R = torch.stack([rks ** j for j in range(p)])
            rhos_c = torch.tensor([0.5], dtype=torch.float64) if p == 1 else torch.linalg.solve(R, b)
            corr = sum(rhos_c[k] * D1s[k] for k in range(p - 1)) if p > 1 else 0
            x = (st / ss) * last_sample - (1 - st) * h_phi_1 * m0 - (1 - st) * B_h * (corr + rhos_c[-1] * (x0 - m0))
            info.update(corrector_order=p, corrector_h=float(h), corrector_rhos=[float(r) for r in rhos_c],
                        corrector_B_h=float(B_h), corrector_h_phi_1=float(h_phi_1))
        else:
            info.update(corrector_order=None)
        ms.append(x0)
        this_order = min(order, N - i) if lower_order_final else order
        this_order = min(this_order, min(i, order) + 1)
        last_sample = x
        corrected = x
        # UniP
        st, ss = sig[i + 1], sig[i]
        h = lam(st) - lam(ss)
        m0 = ms[-1]
        rks, D1s = [], []
        for k in range(1, this_order):
            rk = (lam(sig[i - k]) - lam(ss)) / h
            rks.append(rk)
            D1s.append((ms[-(k + 1)] - m0) / rk)
        rks = torch.stack(rks + [torch.ones((), dtype=torch.float64)])
        h_phi_1, B_h, b = phi_terms(h, this_order)
        R = torch.stack([rks ** j for j in range(this_order)])
        if this_order == 1:
            rhos_p, pred = [], 0
        else:
            rhos_p = (torch.tensor([0.5], dtype=torch.float64) if this_order == 2
                      else torch.linalg.solve(R[:-1, :-1], b[:-1]))
            pred = sum(rhos_p[k] * D1s[k] for k in range(this_order - 1))
        x = (st / ss) * x - (1 - st) * h_phi_1 * m0 - (1 - st) * B_h * pred
        last_order = this_order
        info.update(predictor_order=this_order, predictor_h=float(h), predictor_rhos=[float(r) for r in rhos_p],
                    predictor_B_h=float(B_h), predictor_h_phi_1=float(h_phi_1),
                    lambda_s0=float(lam(ss)), lambda_t=float(lam(st)))
        steps.append((x0, corrected, x, info))
    return steps


def flow_sigmas_f64(n, shift, T=1000):
    """set_timesteps' flow branch in float64 (numpy linspace, shift, the 1e-6 nudge)."""
    s = np.linspace(1, 1 / T, n + 1)[:-1]
    s = shift * s / (1 + (shift - 1) * s)
    if np.fabs(s[0] - 1) < 1e-6:
        s[0] -= 1e-6
    return s


def unipc_configs():
    cfgs = {}
    for shift in (3.0, 5.0):
        for order in (2, 1):
            for n in (1, 2, 5, 10):
                cfgs[f"shift{shift:g}_order{order}_n{n}"] = dict(flow_shift=shift, solver_order=order,
                                                                num_inference_steps=n)
    cfgs["shift3_order3_n5"] = dict(flow_shift=3.0, solver_order=3, num_inference_steps=5)
    cfgs["shift3_order3_n10"] = dict(flow_shift=3.0, solver_order=3, num_inference_steps=10)
    cfgs["shift3_order2_n5_lof_false"] = dict(flow_shift=3.0, solver_order=2, num_inference_steps=5,
                                              lower_order_final=False)
    cfgs["shift3_order2_n5_nocorr0"] = dict(flow_shift=3.0, solver_order=2, num_inference_steps=5,
                                            disable_corrector=[0])
    cfgs["shift3_order2_n50"] = dict(flow_shift=3.0, solver_order=2, num_inference_steps=50)
    return cfgs


def run_unipc(name, c, seed, tensors, checks):
    kw = dict(WAN_SCHEDULER)
    kw.update({k: v for k, v in c.items() if k != "num_inference_steps"})
    n = c["num_inference_steps"]
    g = torch.Generator().manual_seed(seed)
    x_init = torch.randn(UNIPC_SHAPE, generator=g)
    noise = torch.randn((n,) + UNIPC_SHAPE, generator=g)

    def loop(begin_index):
        s = UniPCMultistepScheduler(**kw)
        s.set_timesteps(n, device="cpu")
        if begin_index:
            s.set_begin_index(0)
        x, rec = x_init.clone(), {"mo": [], "x0": [], "corr": [], "out": [], "order": [], "corr_used": []}
        for i, t in enumerate(s.timesteps):
            mo = 0.5 * x + noise[i]
            corr_before = s.last_sample is not None and i > 0 and (i - 1) not in s.disable_corrector
            x = s.step(mo, t, x, return_dict=False)[0]
            rec["mo"].append(mo)
            rec["x0"].append(s.model_outputs[-1].clone())
            rec["corr"].append(s.last_sample.clone())
            rec["out"].append(x.clone())
            rec["order"].append(s.this_order)
            rec["corr_used"].append(bool(corr_before))
        return s, rec

    s, rec = loop(True)
    s_nb, rec_nb = loop(False)
    same = all(torch.equal(a, b) for a, b in zip(rec["out"], rec_nb["out"]))
    sig64 = flow_sigmas_f64(n, c["flow_shift"])
    assert torch.equal(s.sigmas, torch.from_numpy(np.concatenate([sig64, [0]]).astype(np.float32)))
    assert s.timesteps.tolist() == (sig64 * 1000).astype(np.int64).tolist()
    p = f"{name}."
    tensors[p + "timesteps"] = s.timesteps.clone()
    tensors[p + "sigmas"] = s.sigmas.clone()
    tensors[p + "sample_init"] = x_init
    tensors[p + "noise"] = noise
    tensors[p + "model_output"] = torch.stack(rec["mo"])
    tensors[p + "x0_pred"] = torch.stack(rec["x0"])
    tensors[p + "corrected_sample"] = torch.stack(rec["corr"])
    tensors[p + "prev_sample"] = torch.stack(rec["out"])
    ref = ref_unipc(s.sigmas, x_init, noise, c["solver_order"], c.get("lower_order_final", True),
                    tuple(c.get("disable_corrector", ())))
    finite = [bool(torch.isfinite(o).all()) for o in rec["out"]]
    d = {"x0_pred": 0.0, "corrected_sample": 0.0, "prev_sample": 0.0}
    for i, (x0, corr, out, info) in enumerate(ref):
        assert info["predictor_order"] == rec["order"][i], (name, i)
        assert (info["corrector_order"] is not None) == rec["corr_used"][i], (name, i)
        if not finite[i]:
            continue
        d["x0_pred"] = max(d["x0_pred"], maxdiff(rec["x0"][i], x0))
        d["corrected_sample"] = max(d["corrected_sample"], maxdiff(rec["corr"][i], corr))
        d["prev_sample"] = max(d["prev_sample"], maxdiff(rec["out"][i], out))
    checks[name] = {"float64_restatement_maxdiff": d, "begin_index_vs_lookup_equal": same}
    entry = {"config": {k: c[k] for k in sorted(c)}, "seed": seed, "shape": list(UNIPC_SHAPE),
             "timesteps": s.timesteps.tolist(), "sigmas_float32": [float(v) for v in s.sigmas],
             "sigmas_float64_before_cast": [float(v) for v in sig64] + [0.0],
             "steps": [r[3] for r in ref], "steps_finite": finite,
             "max_abs_prev_sample": [float(o.abs().max()) for o in rec["out"]]}
    return entry


# ---- 3. end to end ---------------------------------------------------------------------------------

PROMPT = "a red car drives in the city street"
E2E_CASES = {
    "t2v": dict(folder="tiny_wan", prompt=PROMPT, negative_prompt=None, guidance_scale=5.0, height=32,
                width=48, num_frames=5, num_inference_steps=3, seed=0, num_videos_per_prompt=1),
    "t2v_nocfg": dict(folder="tiny_wan", prompt=PROMPT, negative_prompt=None, guidance_scale=1.0, height=32,
                      width=48, num_frames=5, num_inference_steps=3, seed=0, num_videos_per_prompt=1),
    "t2v_frames_round": dict(folder="tiny_wan", prompt=PROMPT, negative_prompt=None, guidance_scale=5.0,
                             height=48, width=64, num_frames=7, num_inference_steps=3, seed=0,
                             num_videos_per_prompt=1),
    "t2v_two": dict(folder="tiny_wan", prompt=[PROMPT, "Two birds fly over the lake, golden hour"],
                    negative_prompt=None, guidance_scale=5.0, height=32, width=48, num_frames=5,
                    num_inference_steps=3, seed=3, num_videos_per_prompt=2),
    "a14b": dict(folder="tiny_wan_a14b", prompt=PROMPT, negative_prompt=None, guidance_scale=4.0,
                 guidance_scale_2=3.0, height=32, width=48, num_frames=5, num_inference_steps=4, seed=0,
                 num_videos_per_prompt=1),
}
# check_inputs raises before the flooring code can run (see README)
ERROR_CASES = {
    "t2v_size_40x56": dict(folder="tiny_wan", prompt=PROMPT, guidance_scale=5.0, height=40, width=56,
                           num_frames=7, num_inference_steps=3, seed=0),
}


class Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append({"level": record.levelname, "message": record.getMessage()})


def load_pipe(out, folder, tok, enc):
    pipe = WanPipeline.from_pretrained(os.path.join(out, folder), text_encoder=None, tokenizer=None)
    pipe.__dict__.update(tokenizer=tok, text_encoder=enc)  # bypass __setattr__: model_index untouched
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call_args(c):
    args = {k: v for k, v in c.items() if k not in ("folder", "seed")}
    return args


def run_pipe(pipe, c, output_type):
    """One unmodified __call__, observed: every transformer call, vae.decode's input, log lines."""
    calls, decode_in = [], []
    handles = []
    experts = {"transformer": pipe.transformer}
    if pipe.transformer_2 is not None:
        experts["transformer_2"] = pipe.transformer_2
    for ename, m in experts.items():
        def pre(mod, args, kwargs, ename=ename):
            calls.append({"expert": ename, "hidden_states": kwargs["hidden_states"].clone(),
                          "timestep": kwargs["timestep"].clone(),
                          "encoder_hidden_states": kwargs["encoder_hidden_states"].clone()})

        def post(mod, args, kwargs, output, ename=ename):
            calls[-1]["out"] = output[0].clone()
        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True))
    orig_decode = pipe.vae.decode

    def decode(z, *a, **k):
        decode_in.append(z.clone())
        res = orig_decode(z, *a, **k)
        decode_in.append(res[0].clone())
        return res
    pipe.vae.decode = decode
    cap = Capture()
    lg = logging.getLogger("diffusers.pipelines.wan.pipeline_wan")
    lg.addHandler(cap)
    try:
        gen = torch.Generator("cpu").manual_seed(c["seed"])
        res = pipe(**call_args(c), generator=gen, output_type=output_type, return_dict=True)
    finally:
        lg.removeHandler(cap)
        for h in handles:
            h.remove()
        del pipe.vae.decode
    return res.frames, calls, decode_in, cap.records, [int(t) for t in pipe.scheduler.timesteps]


@torch.no_grad()
def sample_restated(pipe, tok, enc, c):
    """The sampling loop restated from README (not calling __call__): returns final latents, frames."""
    prompt = c["prompt"]
    n = c["num_videos_per_prompt"]
    g_scale = c["guidance_scale"]
    cfg = g_scale > 1.0
    pe, ne, _, _ = mte.encode_prompt(tok, enc, prompt, c.get("negative_prompt"), cfg, n, 512)
    nf = c["num_frames"]
    if nf % 4 != 1:
        nf = nf // 4 * 4 + 1
    h, w = c["height"] // 16 * 16, c["width"] // 16 * 16
    B = (1 if isinstance(prompt, str) else len(prompt)) * n
    shape = (B, 16, (nf - 1) // 4 + 1, h // 8, w // 8)
    lat = torch.randn(shape, generator=torch.Generator().manual_seed(c["seed"]), dtype=torch.float32)
    s = UniPCMultistepScheduler.from_config(pipe.scheduler.config)
    s.set_timesteps(c["num_inference_steps"])
    s.set_begin_index(0)
    br = pipe.config.boundary_ratio
    for t in s.timesteps:
        if br is None or t >= br * 1000:
            m, gs = pipe.transformer, g_scale
        else:
            m, gs = pipe.transformer_2, c.get("guidance_scale_2", g_scale)
        tt = t.expand(B)
        v = m(hidden_states=lat, timestep=tt, encoder_hidden_states=pe, return_dict=False)[0]
        if cfg:
            vu = m(hidden_states=lat, timestep=tt, encoder_hidden_states=ne, return_dict=False)[0]
            v = vu + gs * (v - vu)
        lat = s.step(v, t, lat, return_dict=False)[0]
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, 16, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, 16, 1, 1, 1)
    video = pipe.vae.decode(lat / inv_std + mean, return_dict=False)[0]
    frames = (video / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).float().numpy()
    return lat, frames


def run_e2e(out, tok, enc, tensors, checks):
    pipes = {}
    cases = {}
    for name, c in E2E_CASES.items():
        if c["folder"] not in pipes:
            pipes[c["folder"]] = load_pipe(out, c["folder"], tok, enc)
        pipe = pipes[c["folder"]]
        frames, calls, dec, logs, ts = run_pipe(pipe, c, "np")
        lat_out, calls_l, dec_l, logs_l, ts_l = run_pipe(pipe, c, "latent")
        assert isinstance(frames, np.ndarray) and frames.dtype == np.float32
        assert not dec_l and ts == ts_l and logs == logs_l
        cfg = c["guidance_scale"] > 1.0
        per = 2 if cfg else 1
        assert len(calls) == per * c["num_inference_steps"] == len(calls_l)
        for a, b in zip(calls, calls_l):
            assert torch.equal(a["out"], b["out"])
        steps, lat_in, v_c, v_u, v_g, experts = [], [], [], [], [], []
        pe = calls[0]["encoder_hidden_states"]
        ne = calls[1]["encoder_hidden_states"] if cfg else None
        for i in range(c["num_inference_steps"]):
            cc = calls[per * i]
            assert torch.equal(cc["encoder_hidden_states"], pe)
            lat_in.append(cc["hidden_states"])
            v_c.append(cc["out"])
            experts.append(cc["expert"])
            gs = c["guidance_scale"]
            if cfg:
                cu = calls[per * i + 1]
                assert cu["expert"] == cc["expert"] and torch.equal(cu["hidden_states"], cc["hidden_states"])
                assert torch.equal(cu["encoder_hidden_states"], ne)
                if cc["expert"] == "transformer_2":
                    gs = c["guidance_scale_2"]
                v_u.append(cu["out"])
                v_g.append(cu["out"] + gs * (cc["out"] - cu["out"]))
            else:
                v_g.append(cc["out"])
            steps.append({"step": i, "timestep": int(cc["timestep"][0]), "expert": cc["expert"],
                          "guidance_scale": gs if cfg else None,
                          "transformer_timestep_dtype": str(cc["timestep"].dtype).replace("torch.", ""),
                          "transformer_timestep": cc["timestep"].tolist()})
        p = f"{name}."
        emb_keys = {}
        for kind, t in (("prompt_embeds", pe), ("negative_prompt_embeds", ne)):
            if t is None:
                emb_keys[kind] = None
                continue
            # identical embeddings are stored once (the file stays under 2 MB); the JSON names the key
            same = next((k for k, v in tensors.items() if k.endswith("prompt_embeds") and torch.equal(v, t)), None)
            emb_keys[kind] = same or p + kind
            if same is None:
                tensors[p + kind] = t
        if cfg:
            tensors[p + "noise_pred_uncond"] = torch.stack(v_u)
        tensors[p + "latents_init"] = lat_in[0]
        tensors[p + "latents_steps"] = torch.stack(lat_in + [lat_out])
        tensors[p + "noise_pred_cond"] = torch.stack(v_c)
        tensors[p + "noise_pred"] = torch.stack(v_g)
        tensors[p + "latents_final"] = lat_out
        mean = torch.tensor(pipe.vae.config.latents_mean).view(1, 16, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, 16, 1, 1, 1)
        den = lat_out / inv_std + mean
        assert torch.equal(dec[0], den)
        tensors[p + "latents_denormalized"] = den
        tensors[p + "frames"] = torch.from_numpy(frames.copy())
        # initial latents are torch.randn(shape, generator=Generator().manual_seed(seed))
        g = torch.Generator().manual_seed(c["seed"])
        assert torch.equal(lat_in[0], torch.randn(lat_in[0].shape, generator=g))
        # prompt embeds equal make_text_encoder's encode_prompt restatement
        rpe, rne, info, ninfo = mte.encode_prompt(tok, enc, c["prompt"], c["negative_prompt"], cfg,
                                                  c["num_videos_per_prompt"], 512)
        assert torch.equal(rpe, pe) and (not cfg or torch.equal(rne, ne))
        r_lat, r_frames = sample_restated(pipe, tok, enc, c)
        checks[name] = {"restated_loop_latents_maxdiff": maxdiff(r_lat, lat_out),
                        "restated_loop_frames_maxdiff": float(np.abs(r_frames - frames).max()),
                        "frames_vs_decoded_maxdiff": maxdiff(torch.from_numpy(frames).permute(0, 4, 1, 2, 3),
                                                             (dec[1] / 2 + 0.5).clamp(0, 1)),
                        "decoded_share_at_clamp": float((dec[1].abs() >= 1).float().mean())}
        args = {k: v for k, v in c.items() if k != "folder"}
        cases[name] = {
            "folder": c["folder"], "arguments": args,
            "prompt_embeds_key": emb_keys["prompt_embeds"],
            "negative_prompt_embeds_key": emb_keys["negative_prompt_embeds"],
            "prompt_embeds_shape": list(pe.shape),
            "negative_prompt_embeds_shape": list(ne.shape) if cfg else None,
            "call": ("WanPipeline.__call__(**arguments minus seed, generator=torch.Generator('cpu')"
                     ".manual_seed(seed), output_type='np' | 'latent')"),
            "defaults_in_effect": {"max_sequence_length": 512, "negative_prompt_used": "" if cfg else None,
                                   "do_classifier_free_guidance": cfg},
            "effective": {"num_frames": (lat_in[0].shape[2] - 1) * 4 + 1, "height": lat_in[0].shape[3] * 8,
                          "width": lat_in[0].shape[4] * 8, "batch": lat_in[0].shape[0]},
            "scheduler_timesteps": ts, "scheduler_sigmas": [float(v) for v in pipe.scheduler.sigmas],
            "boundary_ratio": pipe.config.boundary_ratio,
            "boundary_timestep": (pipe.config.boundary_ratio * 1000 if pipe.config.boundary_ratio else None),
            "steps": steps, "log_records": logs,
            "cleaned_prompts": info["cleaned"], "seq_lens": info["seq_lens"],
            "negative_seq_lens": ninfo["seq_lens"] if ninfo else None,
            "prompt_embeds_row_source": [b for b in range(len(info["seq_lens"]))
                                         for _ in range(c["num_videos_per_prompt"])],
            "shapes": {k[len(p):]: list(v.shape) for k, v in tensors.items() if k.startswith(p)},
            "frames_range": [float(frames.min()), float(frames.max())],
        }
    errors = {}
    for name, c in ERROR_CASES.items():
        pipe = pipes[c["folder"]]
        try:
            pipe(**{k: v for k, v in c.items() if k not in ("folder", "seed")},
                 generator=torch.Generator().manual_seed(c["seed"]), output_type="latent")
            raise AssertionError("expected a ValueError")
        except ValueError as e:
            errors[name] = {"arguments": {k: v for k, v in c.items() if k != "folder"},
                            "exception": "ValueError", "message": str(e)}
    return cases, errors


def main(out):
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    diffusers.utils.logging.set_verbosity_warning()
    make_folders(out)
    tiny = os.path.join(out, "tiny_wan")

    # UniPC alone
    tensors, checks, entries = {}, {}, {}
    for k, (name, c) in enumerate(unipc_configs().items()):
        entries[name] = run_unipc(name, c, SEED_UNIPC + k, tensors, checks)
    for name, ch in checks.items():
        assert ch["begin_index_vs_lookup_equal"], name
        assert max(ch["float64_restatement_maxdiff"].values()) < 1e-4, (name, ch)
    save_st(os.path.join(out, "unipc_flow.safetensors"), tensors)
    write_json(os.path.join(out, "unipc_flow.json"), {
        "scheduler": "UniPCMultistepScheduler", "diffusers_version": diffusers.__version__,
        "base_config": WAN_SCHEDULER, "fake_model_output": "model_output_i = 0.5 * sample_i + noise[i] (float32)",
        "loop": ("s = UniPCMultistepScheduler(**base_config | config); s.set_timesteps(n); s.set_begin_index(0); "
                 "x = sample_init; for i, t in enumerate(s.timesteps): x = s.step(0.5 * x + noise[i], t, x)[0]"),
        "keys": {"timesteps": "[n] int64", "sigmas": "[n + 1] float32 (last 0)", "sample_init": "shape",
                 "noise": "[n, *shape]", "model_output": "[n, *shape] what step() got",
                 "x0_pred": "[n, *shape] convert_model_output = sample - sigma_i * model_output",
                 "corrected_sample": "[n, *shape] the sample after UniC (= the input sample when no corrector ran)",
                 "prev_sample": "[n, *shape] step()'s output"},
        "configs": entries, "checks": checks})
    print("unipc:", len(entries), "configs")

    # end to end
    tok_dir = os.path.join(tiny, "tokenizer")
    with open(os.path.join(tok_dir, "spiece.model"), "rb") as f:
        model_bytes = f.read()
    with open(os.path.join(tok_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        tcfg = json.load(f)
    tok = mte.T5TokenizerSlow(model_bytes, tcfg)
    enc = mte.Encoder(load_file(os.path.join(tiny, "text_encoder", "model.safetensors")), torch.float32)
    e2e, e2e_checks = {}, {}
    cases, errors = run_e2e(out, tok, enc, e2e, e2e_checks)
    for name, ch in e2e_checks.items():
        assert ch["restated_loop_latents_maxdiff"] == 0.0 and ch["restated_loop_frames_maxdiff"] == 0.0, (name, ch)
    save_st(os.path.join(tiny, "sample_e2e.safetensors"), e2e)
    write_json(os.path.join(tiny, "sample_e2e.json"), {
        "pipeline": "WanPipeline", "diffusers_version": diffusers.__version__, "ftfy_available":
        pipeline_wan.is_ftfy_available(), "cases": cases, "error_cases": errors, "checks": e2e_checks,
        "text_side": ("tokenizer / text_encoder are make_text_encoder.py's T5TokenizerSlow and UMT5 "
                      "transcription (float32) over tiny_wan/tokenizer and tiny_wan/text_encoder"),
        "vae_latents_mean": pipes_cfg(tiny)["latents_mean"], "vae_latents_std": pipes_cfg(tiny)["latents_std"]})
    for name, ch in e2e_checks.items():
        print(name, ch)
    print("sizes:", os.path.getsize(os.path.join(tiny, "sample_e2e.safetensors")),
          os.path.getsize(os.path.join(out, "unipc_flow.safetensors")))


def pipes_cfg(tiny):
    with open(os.path.join(tiny, "vae", "config.json")) as f:
        return json.load(f)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_pipeline.py OUT_DIR  (tests/golden/wan)")
    main(sys.argv[1])
