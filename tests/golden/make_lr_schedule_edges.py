# Writes lr_schedule_edges.json: Diffusers 0.31 get_scheduler multipliers at the step-count edges
# (warm-up longer than the run, equal to it, zero training steps) for steps 0..11; null where
# Diffusers raises. Run with the refstack: . ../shared/refstack/env.sh; python3 this > out.json
import json, torch
from diffusers.optimization import get_scheduler
out = {}
for name in ["linear","cosine","cosine_with_restarts","polynomial","constant","constant_with_warmup","piecewise_constant"]:
    for (W,T) in [(5,3),(3,3),(0,0),(2,0),(100,10)]:
        p = torch.nn.Parameter(torch.zeros(1)); opt = torch.optim.SGD([p], lr=1e-3)
        kw = dict(num_warmup_steps=W, num_training_steps=T)
        if name == "piecewise_constant": kw["step_rules"] = "1:2,0.5"
        if name == "cosine_with_restarts": kw["num_cycles"] = 2
        if name == "polynomial": kw["power"] = 2.0
        try:
            s = get_scheduler(name, opt, **kw)
        except Exception as e:
            out[f"{name} {W} {T}"] = "construct: " + type(e).__name__; continue
        vals = []
        for step in range(0, 12):
            try: vals.append(s.lr_lambdas[0](step))
            except Exception as e: vals.append(None)
        out[f"{name} {W} {T}"] = vals
print(json.dumps(out))
