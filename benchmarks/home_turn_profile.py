"""Where a session's turn spends its time when every shared block is already local (issue 36; docs/serving.md,
"Measured: a moved session"): the "at home" turn of ``benchmarks/prefix_pool.py``, timed engine call by engine
call.

One scheduler with its own prefix store and no pool, the long-context ReAct trace of that benchmark (4 agents
with random LoRA decoders, 1024 shared tokens + 128 appended per turn, 32 own tokens per agent, 16 generated,
blocks of 16). Turns 1..T-1 of a session run first (the store then holds the context), then turn T, whose
calls into the engine are timed: ``prefill_cached`` (the shared prompt's tokens no block holds, over the
cached prefix), ``add_request`` (per agent: its own tokens prefilled by the base into the request's tail and
the decoder's handoff), ``step`` (decode steps, the first of which ends the TTFT). The first session's turn
warms the paths; the summary is the median over the sessions after it.

    python benchmarks/home_turn_profile.py --out benchmarks/results/home_turn_profile_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import ccft
from ccft.serving import PrefixKVStore
from ccft.serving.scheduler import Scheduler, ServeRequest
from ccft.serving.workloads import add_trace_options, trace_options

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefix_pool import run_turn, trace_world  # noqa: E402  (the pool benchmark's trace and turn driver)

CALLS = ("prefill_cached", "add_request", "step")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    add_trace_options(ap)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    base, agents, decoders, turns, last = trace_world(args)
    engine = ccft.SharedPrefillEngine(base, decoders=decoders)
    log: list[tuple[str, float, float]] = []

    def timed(name):
        fn = getattr(engine, name)

        def call(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            log.append((name, t, time.perf_counter() - t))
            return out

        setattr(engine, name, call)

    for name in CALLS:
        timed(name)
    sched = Scheduler(engine, share=True, store=PrefixKVStore(args.block_tokens))
    warm = ServeRequest(agents[0], list(range(1000, 1040)), max_new_tokens=2, ignore_eos=True)
    sched.submit(warm)
    sched.run_until_idle()
    sessions = []
    for s in range(args.sessions):
        for t in range(last):
            run_turn(sched, turns[(s, t)])
        h0, m0 = sched.counters["prefix_hit_tokens"], sched.counters["prefill_tokens"]
        log.clear()
        t0 = time.perf_counter()
        tickets = run_turn(sched, turns[(s, last)])
        wall = time.perf_counter() - t0
        ttft = min(x.ttft for x in tickets)
        first_step = next(i for i, (name, _, _) in enumerate(log) if name == "step")
        before = log[: first_step + 1]  # the calls up to and including the first decode step
        per_call = {name: [1e3 * d for n, _, d in before if n == name] for name in CALLS}
        sessions.append(
            {
                "ttft_s": ttft,
                "turn_wall_s": wall,
                "to_first_token_ms": {name: sum(v) for name, v in per_call.items()},
                "calls_to_first_token": {name: len(v) for name, v in per_call.items()},
                "add_request_ms_each": per_call["add_request"],
                "later_steps_ms_median": statistics.median(
                    1e3 * d for n, _, d in log[first_step + 1 :] if n == "step"
                ),
                "hit_tokens": sched.counters["prefix_hit_tokens"] - h0,
                "computed_tokens": sched.counters["prefill_tokens"] - m0,
            }
        )
        print(json.dumps(sessions[-1]), flush=True)
    measured = sessions[1:] if len(sessions) > 1 else sessions  # the first session's turn warms the paths
    summary = {
        "ttft_s": statistics.median(x["ttft_s"] for x in measured),
        **{f"{name}_ms": statistics.median(x["to_first_token_ms"][name] for x in measured) for name in CALLS},
        "later_steps_ms": statistics.median(x["later_steps_ms_median"] for x in measured),
    }
    print(json.dumps(summary))
    result = {
        "benchmark": "benchmarks/home_turn_profile.py",
        "model": args.model,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {args.threads} torch threads",
        "torch": torch.__version__,
        "trace": trace_options(args),
        "prompt_tokens_last_turn": [len(r.prompt_ids) for r in turns[(0, last)]],
        "shared_len_last_turn": [r.shared_len for r in turns[(0, last)]],
        "sessions": sessions,
        "summary_after_first_session": summary,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
