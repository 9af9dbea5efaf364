"""Prefix-aware routing vs session affinity (issue 36, item 2; docs/serving.md, "Routing"): the prefix hit
ratio of W workers, each with its own prefix store, when a router places a multi-agent trace's requests.

W schedulers in this process stand for replicas (each its own engine and ``PrefixKVStore``, no pool; one
base model object). A ReAct trace (the long-context shape of docs/serving.md by default: 4 sessions, 3
turns, 4 agents with random LoRA decoders, 1024 shared tokens + 128 appended per turn, 32 own tokens per
agent, blocks of 16) is replayed turn by turn: every request of turn t of every session is placed by the
router, in trace order, on the loads the workers have then (their queued requests: a turn's requests are
placed before any of them runs), then every worker runs until idle, then turn t+1. Each router runs twice:
the requests carrying their ``session_id``, and carrying none (an OpenAI client that sends no session);
without a session id the ``session`` router's requests go to the least-loaded worker, as ``ccft serve
--replicas`` does. Every request decodes ``--max-new-tokens`` tokens, EOS ignored.

    python benchmarks/prefix_routing.py --out benchmarks/results/prefix_routing_cpu.json

Reported per (router, session ids or not), from the schedulers' counters summed over workers: a worker
prefills a turn's shared context once for the requests it holds of that turn (the other requests join the
live context: ``context_reuse_tokens``), copying what its store holds (``prefix_hit_tokens``) and computing
the rest (``prefill_tokens``); ``hit_ratio`` = hit ÷ (hit + computed) over those context prefills;
``tail_tokens``: every request's own tokens (computed wherever it runs). Also requests per worker, the
router's counters, the blocks each store holds, the wall time of the replay (on a shared machine:
indicative only), and whether every request's greedy tokens equal those of the first run (placement must
not change an answer).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

import ccft
from ccft.bench.serve import agent_names, random_agent_decoder
from ccft.serving import PrefixKVStore
from ccft.serving.router import LeastLoadedRouter, PrefixRouter, WorkerState, make_router
from ccft.serving.scheduler import Scheduler, ServeRequest
from ccft.serving.workloads import add_trace_options, generate_from_options, trace_options


def replay(args, base, decoders, trace, router_name: str, with_sessions: bool) -> dict:
    """One replay of ``trace`` over ``args.workers`` fresh workers placed by ``router_name``; its figures."""
    options = {"block_tokens": args.block_tokens} if router_name == "prefix" else {}
    router = make_router(router_name, **options)
    spread = LeastLoadedRouter()
    workers = [
        Scheduler(
            ccft.SharedPrefillEngine(base, decoders=decoders),
            share=True,
            store=PrefixKVStore(args.block_tokens),
        )
        for _ in range(args.workers)
    ]
    turns: dict[int, list] = {}
    for r in trace.requests:
        turns.setdefault(r.turn, []).append(r)
    placed = [0] * args.workers
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    for t in sorted(turns):
        tickets = []
        for r in turns[t]:
            sid = str(r.session) if with_sessions else None
            state = [WorkerState(queued=w.queue_depth, active=w.active) for w in workers]
            use = spread if sid is None and not isinstance(router, PrefixRouter) else router
            w = use.place(sid, r.prompt_ids, state)
            placed[w] += 1
            ticket = workers[w].submit(
                ServeRequest(
                    r.agent,
                    r.prompt_ids,
                    shared_len=r.shared_len,
                    max_new_tokens=r.max_new_tokens,
                    ignore_eos=True,
                    session_id=sid,
                )
            )
            tickets.append((r.request_id, ticket))
        for w in workers:
            w.run_until_idle()
        for rid, ticket in tickets:
            if ticket.state != "done":
                raise RuntimeError(f"{rid} ended as {ticket.state}: {ticket.error}")
            tokens[rid] = list(ticket.tokens)
    wall = time.perf_counter() - start
    hit = sum(w.counters["prefix_hit_tokens"] for w in workers)
    computed = sum(w.counters["prefill_tokens"] for w in workers)
    return {
        "router": router_name,
        "session_ids": with_sessions,
        "hit_ratio": hit / (hit + computed) if hit + computed else 0.0,
        "prefix_hit_tokens": hit,
        "prefill_tokens": computed,
        "context_reuse_tokens": sum(w.counters["context_reuse_tokens"] for w in workers),
        "tail_tokens": sum(w.counters["tail_tokens"] for w in workers),
        "requests_per_worker": placed,
        "router_stats": router.stats() if router.stats() else spread.stats(),
        "store_blocks_per_worker": [len(w.store) for w in workers],
        "wall_s": round(wall, 2),
        "tokens": tokens,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--routers", default="session,prefix", help="comma-separated ccft.serving.router names")
    add_trace_options(ap)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    base = ccft.load_base(args.model)
    agents = agent_names(args.agents)
    decoders = {n: random_agent_decoder(base, n, 100 + i) for i, n in enumerate(agents)}
    trace = generate_from_options(args, sessions=args.sessions, agents=agents, tokenizer=base.tokenizer)
    runs = []
    for with_sessions in (True, False):
        for name in args.routers.split(","):
            runs.append(replay(args, base, decoders, trace, name, with_sessions))
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "tokens"}), file=sys.stderr)
    reference = runs[0]["tokens"]
    for run in runs:
        run["outputs_equal_first_run"] = run.pop("tokens") == reference
    result = {
        "model": args.model,
        "dtype": "float32",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {args.threads} torch threads",
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/prefix_routing.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "workers": args.workers,
        "trace": trace_options(args),
        "requests": len(trace.requests),
        "runs": runs,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
