#!/usr/bin/env python3
"""Sums a Chrome trace from LibTorch's autograd profiler per operator: self time (the operator's
own time, its nested operators' time taken out), calls, and the share of all self time.

  bench_unet_step --config cfg.json --steps 5 --profile /tmp/step.trace
  python3 bench/py/op_profile.py /tmp/step.trace [--steps 5] [--top 25]

With --steps, times are also given per step. Standard library only.
"""
import argparse
import collections
import json


def self_times(events):
    """Per-thread nesting: an event's self time is its duration minus its direct children's."""
    by_tid = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            by_tid[e.get("tid")].append(e)
    total = collections.Counter()
    calls = collections.Counter()
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []  # [end, name, child_time]
        def close(item):
            end, name, child = item
            return name, child
        for e in evs:
            start, dur = e["ts"], e["dur"]
            while stack and stack[-1][0] <= start:
                top = stack.pop()
                total[top[1]] += top[3] - top[2]
            if stack:
                stack[-1][2] += dur
            stack.append([start + dur, e["name"], 0.0, dur])
            calls[e["name"]] += 1
        while stack:
            top = stack.pop()
            total[top[1]] += top[3] - top[2]
    return total, calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    with open(a.trace) as f:
        events = json.load(f)
    total, calls = self_times(events)
    all_us = sum(total.values())
    print(f"{'operator':48s} {'ms/step':>9s} {'share':>7s} {'calls/step':>10s}")
    for name, us in total.most_common(a.top):
        print(f"{name[:48]:48s} {us / 1e3 / a.steps:9.2f} {100 * us / all_us:6.1f}% "
              f"{calls[name] / a.steps:10.1f}")
    print(f"{'all operators':48s} {all_us / 1e3 / a.steps:9.2f}")


if __name__ == "__main__":
    main()
