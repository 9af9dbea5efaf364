"""Serving benchmark: PrefillShare (one shared prefill) vs per-model serving (``--no-share``), one run.

    ccft bench serve --out serve.json      # or: python -m ccft.bench.serve --out serve.json

Both systems run the same multi-agent trace (``ccft.serving.workloads``: ReAct by default, 4 agents
planner / math / code / tools, a shared context that grows every turn) on the same engine, decoders,
offered load and **the same KV byte budget**, over a concurrency sweep (sessions in flight; all
sessions of a point start at t=0 and each turn starts when the previous one finished):

* shared: the base prefills each turn's shared context once (``Scheduler(share=True)``); every
  agent decodes on it, its own instruction computed into its tail; full context blocks are kept in
  a ``PrefixKVStore`` keyed by the base's fingerprint, so the next turn computes only new tokens;
* no-share: every agent's model prefills its whole prompt with its own weights into its own KV and
  its own store namespace (the per-model deployment the paper compares against).

Budget: by default the peak KV bytes (live + store) of the shared system at the sweep's top point (with
``--share-from-layer`` / ``--cache-format``: the larger of the variant's and its m = 0 native reference's),
measured in a calibration run without a budget (the no-share system is calibrated the same way to
measure its unconstrained peak). Under the budget, admission control queues requests (nothing is
dropped).

Reported per point and mode: p50/p95 request latency and TTFT, TPOT, throughput (generated tokens
/ s and sessions / min), prefix hit ratio (prompt tokens whose KV was reused from a live shared
context or the store ÷ all prompt tokens), peak KV bytes; and Eq. 9 of the paper for the trace.
Every agent call generates exactly ``max_new_tokens`` tokens (EOS ignored), so both systems do the
same decode work. The JSON's top level has ``p95_latency_ratio`` (no-share p95 ÷ shared p95) and
``throughput_ratio`` (shared ÷ no-share), both at the baseline's saturation point (the smallest
concurrency at which no-share reaches 95% of its best throughput over the sweep), ``hit_ratio_min``
(shared, over the sweep) and ``kv_bytes_vs_eq9`` (measured peak-KV ratio no-share ÷ shared in the
unbudgeted calibration runs, divided by Eq. 9's ratio with the generated tokens included).

What the theory allows: per point, ``work_ratio`` is the token-work ratio of the trace,
no-share work ÷ shared work, where a system's work is the prompt tokens it must compute plus the
generated tokens: no-share computes every request's whole prompt (``Σ prompt_len``), shared
computes each turn's shared context once and every request's own tokens (``Σ_turns shared_len +
Σ unique_len``); both generate ``Σ max_new_tokens``. ``work_ratio_with_reuse`` counts what each
must compute when every turn reuses the previous turn's context (a prefix store; block rounding
ignored): per session, the initial context and each turn's appended record, once (shared) or once
per agent (no-share). Beside it, ``throughput_ratio`` (shared ÷ no-share measured) and
``throughput_vs_work`` (their quotient: 1.0 is all the theory allows); TTFT and TPOT p95 of both
systems are in each point. Top level: ``work_ratio_at_saturation``, ``agents``.

Scheduler options (both systems, same values): ``--prefill-chunk-tokens`` (chunked prefill),
``--policy fcfs|mlfq|both`` (``both``: every point is run under each policy, the second's numbers
under ``point["policies"]``), ``--max-running`` (rows decoded per step); ``--agents N`` (8 =
planner, math, code, tools, critic, search, writer, verifier) and ``--new-tokens-spread`` (varied
output lengths, ``workloads.generate``).

Sharing depth m and the compact C_base (issue 35; ``--share-from-layer M``, ``--cache-format int8``): the
agents' random LoRA decoders are registered at depth M (each keeps its own K/V of a context in layers
``0..M−1``, C_base above) and/or reading the C_base stored as int8 codes and scales (the *variant*). The same
adapters are also registered at m = 0 on the native cache (``NAME_ref``, same seeds): the no-share system runs
those (it prefills every prompt itself, so depth and format do not apply), and every point runs the shared
system a second time with them (``point["shared_ref"]``), so the cost of the partial prefills and of the
quantisation is measured in the same run (``point["variant_cost"]``: throughput, p95 latency and prefill
seconds against that reference). ``kv`` at the top level compares the measured peak KV by part (the ledger's
kinds, ``ccft.serving.kv_ledger``: ``context`` = the C_base, native or int8; ``own:NAME`` = an agent's own K/V
below depth M; ``tail`` = the agents' own tokens and generation) of the unbudgeted calibration runs with
Eq. 9 generalised to depth m and the format (``eq9_depth``). ``--check-outputs`` checks the variant's tokens
against offline ``ccft.generate`` at the same depth and format.
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

AGENTS = ("planner", "math", "code", "tools")  #: the default four agents (``--agents 4``)


def agent_names(n: int) -> list[str]:
    """The first ``n`` of planner, math, code, tools, critic, search, writer, verifier (``--agents``).

    Raises:
        ConfigError: n outside 1..8.
    """
    from ccft.core.errors import ConfigError
    from ccft.serving.workloads import EIGHT_AGENTS

    if not 1 <= int(n) <= len(EIGHT_AGENTS):
        raise ConfigError(f"--agents {n}: use 1..{len(EIGHT_AGENTS)} ({', '.join(EIGHT_AGENTS)})")
    return list(EIGHT_AGENTS[: int(n)])


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="embedded model name or HF folder")
    p.add_argument(
        "--decoder",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a trained decoder folder per agent (default: random LoRA adapters r=8 per agent, "
        "init_lora_weights=False; serving cost does not depend on what they learned)",
    )
    p.add_argument("--workload", default="react", choices=["react", "reflexion"])
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8], help="concurrency sweep")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--shared-tokens", type=int, default=256)
    p.add_argument("--unique-tokens", type=int, default=32)
    p.add_argument("--growth-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--block-tokens", type=int, default=16, help="prefix store block size (tokens)")
    p.add_argument("--max-batch", type=int, default=64, help="engine rows per lane")
    p.add_argument(
        "--kv-budget-mb",
        type=float,
        default=None,
        help="KV byte budget for both systems (default: the shared system's peak at the top point)",
    )
    p.add_argument(
        "--agents",
        type=int,
        default=4,
        help="agents per session: 4 = planner, math, code, tools; 8 adds critic, search, writer, verifier",
    )
    p.add_argument(
        "--new-tokens-spread",
        type=float,
        default=0.0,
        help="vary each call's max_new_tokens log-normally by this sigma (0: all equal)",
    )
    p.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=None,
        help="chunked prefill: per-step token budget of decode rows + prefill pieces (default: off)",
    )
    p.add_argument(
        "--policy",
        default="fcfs",
        choices=["fcfs", "mlfq", "both"],
        help="scheduling policy of both systems (both: run every point under each)",
    )
    p.add_argument(
        "--max-running",
        type=int,
        default=None,
        help="rows decoded per step (mlfq: the best, others paused; fcfs: admitted cap); default all",
    )
    p.add_argument(
        "--share-from-layer",
        type=int,
        default=0,
        metavar="M",
        help="sharing depth m of the agents' random decoders: each keeps its own K/V of a context in layers "
        "0..M-1 and reads C_base above (0: PrefillShare; the m=0 decoders are run beside them as reference)",
    )
    p.add_argument(
        "--cache-format",
        default="native",
        choices=["native", "int8"],
        help="the C_base format the agents read: int8 = the compact C_base (int8 codes, bfloat16 scales)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--check-outputs",
        action="store_true",
        help="also replay one session under the shared scheduler and check every request's greedy "
        "tokens against offline ccft.generate (prefillshare) with the agent's decoder",
    )
    p.add_argument("--plots", default=None, help="folder for PNG plots (default: next to --out)")
    p.add_argument(
        "--from-json",
        default=None,
        metavar="F",
        help="measure nothing: re-derive the ratios of a saved result F (and print its table)",
    )
    p.add_argument("--out", default=None, help="write the JSON here")


def random_agent_decoder(
    base,
    name: str,
    seed: int,
    *,
    lora_alpha: int = 16,
    handoff_tokens: int = 1,
    share_from_layer: int = 0,
    cache_format: str = "native",
):
    """A benchmark agent's stand-in decoder: a CCFT LoRA decoder (r = 8, ``lora_alpha``) on ``base`` with
    random A and B drawn after ``torch.manual_seed(seed)`` (``init_lora_weights=False``: the adapter changes
    the outputs, so a decoder that is ignored shows), adapter ``name``, in eval mode, reading C_base at
    sharing depth ``share_from_layer`` in ``cache_format`` (``ccft.make_decoder``)."""
    import ccft

    torch.manual_seed(seed)
    d = ccft.make_decoder(
        base,
        "lora",
        lora={"r": 8, "lora_alpha": lora_alpha, "init_lora_weights": False},
        method="ccft",
        handoff_tokens=handoff_tokens,
        adapter_name=name,
        share_from_layer=share_from_layer,
        cache_format=cache_format,
    )
    d.model.eval()
    return d


#: the suffix of the reference decoders (m = 0, native) registered beside a depth-m or int8 variant
REF_SUFFIX = "_ref"


def variant_of(args) -> tuple[int, str]:
    """``(m, cache_format)`` of ``--share-from-layer`` / ``--cache-format`` after the checks that need no
    model; ``(0, "native")`` is plain PrefillShare (no variant).

    Raises:
        ConfigError: ``--share-from-layer`` negative or not an integer, an unknown ``--cache-format``, or
            either given with ``--decoder`` folders (a decoder folder is served at the depth and format it
            records).
    """
    from ccft.core.compact import check_cache_format
    from ccft.core.errors import ConfigError

    m = getattr(args, "share_from_layer", 0)
    fmt = check_cache_format(getattr(args, "cache_format", "native"), where="--cache-format")
    if isinstance(m, bool) or not isinstance(m, int) or m < 0:
        raise ConfigError(f"--share-from-layer {m!r}: give a layer index 0..L (0: PrefillShare)")
    if (m or fmt != "native") and getattr(args, "decoder", None):
        raise ConfigError(
            "--share-from-layer / --cache-format apply to the benchmark's random agents; a --decoder folder "
            "is served at the depth and format it was trained at: drop --decoder, or drop these options"
        )
    return int(m), fmt


def build(args):
    """The base, an engine with one decoder per agent, and a description. With a variant (``variant_of``) the
    agents' decoders read C_base at its depth and format, and the same adapters are registered again as
    ``NAME_ref`` at m = 0 on the native cache (the reference; module docstring).

    Raises:
        ConfigError: as ``variant_of``, and ``--share-from-layer`` above the model's layer count (checked from
            its config, before the weights load).
    """
    import ccft
    from ccft.core.decoder import check_share_from_layer
    from ccft.inference import SharedPrefillEngine

    depth, fmt = variant_of(args)
    if depth:
        from transformers import AutoConfig

        from ccft.core.models import resolve_model_path

        config = AutoConfig.from_pretrained(resolve_model_path(args.model))
        check_share_from_layer(depth, int(config.num_hidden_layers), where="--share-from-layer")
    base = ccft.load_base(args.model)
    decoders = {}
    given = dict(d.split("=", 1) for d in args.decoder)
    agents = agent_names(getattr(args, "agents", len(AGENTS)))
    variant = bool(depth) or fmt != "native"
    for i, name in enumerate(agents):
        if name in given:
            decoders[name] = given[name]
            continue
        decoders[name] = random_agent_decoder(base, name, 100 + i, share_from_layer=depth, cache_format=fmt)
        if variant:
            decoders[name + REF_SUFFIX] = random_agent_decoder(base, name + REF_SUFFIX, 100 + i)
    engine = SharedPrefillEngine(base, decoders=decoders, max_batch=args.max_batch)
    kind = "random LoRA r=8" + (f", m={depth}" if depth else "") + (f", {fmt}" if fmt != "native" else "")
    kinds = {n: ("folder " + given[n]) if n in given else kind for n in agents}
    from ccft.core.models import describe_model

    # the base lane's weight path: the GGUF's blocks ($CCFT_BLOCK_WEIGHTS; docs/inference.md) or fp32
    weights = "fp32" if engine.block_weights is None else f"blocks of {Path(engine.block_weights).name}"
    return base, engine, {"model": describe_model(args.model), "decoders": kinds, "weights": weights}


def reference_map(agents) -> dict[str, str]:
    """Agent name -> its reference decoder's name (``NAME_ref``: m = 0, native; ``build``)."""
    return {a: a + REF_SUFFIX for a in agents}


def replay(scheduler, trace, decoders: dict[str, str] | None = None) -> dict:
    """Replay ``trace`` on ``scheduler`` in this thread (arrivals and turn dependencies on the wall clock).
    ``decoders``: agent name -> the decoder that serves it (default: the decoder of the agent's name)."""
    from ccft.serving.scheduler import ServeRequest

    decoders = decoders or {}
    rep = trace.replay()
    finished: list = []
    tickets = {}
    t0 = time.perf_counter()
    while not rep.done:
        now = time.perf_counter() - t0
        for r in rep.ready(now):
            req = ServeRequest(
                decoders.get(r.agent, r.agent),
                r.prompt_ids,
                shared_len=r.shared_len,
                max_new_tokens=r.max_new_tokens,
                ignore_eos=True,
                session_id=str(r.session),
            )
            tickets[r.request_id] = scheduler.submit(
                req, on_done=lambda t, rid=r.request_id: finished.append(rid)
            )
        if scheduler.idle():
            nxt = rep.next_arrival()
            if nxt is None:
                if rep.done:
                    break
                raise RuntimeError("replay: nothing queued, running or arriving, but the trace is not done")
            time.sleep(max(0.0, nxt - now))
        else:
            scheduler.step()
        while finished:
            rid = finished.pop()
            t = tickets[rid]
            if t.state != "done":
                raise RuntimeError(f"request {rid} ended as {t.state}: {t.error}")
            rep.finish(rid, time.perf_counter() - t0)
    makespan = time.perf_counter() - t0
    return {"tickets": list(tickets.values()), "makespan_s": makespan}


def scheduler_options(args, policy: str | None = None) -> dict:
    """``Scheduler`` keywords from the benchmark's arguments (``policy`` overrides ``--policy``)."""
    pol = policy or getattr(args, "policy", "fcfs")
    return {
        "prefill_chunk_tokens": getattr(args, "prefill_chunk_tokens", None),
        "policy": "fcfs" if pol == "both" else pol,
        "max_running": getattr(args, "max_running", None),
    }


def work(trace) -> dict:
    """Token work of the trace for each system: prompt tokens it must compute + generated tokens.

    ``no_share``: every request's whole prompt; ``shared``: each turn's shared context once, plus every
    request's own tokens; ``*_with_reuse``: what each computes when every turn reuses the previous turn's
    context (per session the initial context and each appended record, once or once per agent; block
    rounding ignored). Ratios are no-share ÷ shared.
    """
    gen = sum(r.max_new_tokens for r in trace)
    no_share = sum(r.prompt_len for r in trace) + gen
    shared = sum(g[0].shared_len for g in trace.groups()) + sum(r.unique_len for r in trace) + gen
    ns_reuse = sh_reuse = gen + sum(r.unique_len for r in trace)
    for reqs in trace.sessions().values():
        prev = 0
        for t in sorted({r.turn for r in reqs}):
            callers = [r for r in reqs if r.turn == t]
            new = callers[0].shared_len - prev
            prev = callers[0].shared_len
            sh_reuse += new
            ns_reuse += new * len(callers)
    return {
        "generated_tokens": gen,
        "no_share_tokens": no_share,
        "shared_tokens": shared,
        "work_ratio": no_share / shared,
        "no_share_tokens_with_reuse": ns_reuse,
        "shared_tokens_with_reuse": sh_reuse,
        "work_ratio_with_reuse": ns_reuse / sh_reuse,
    }


def cost_work(into: dict) -> dict:
    """The throughput ratio the work saving allows once prompt and generated tokens are weighed by what they
    cost, measured at this point. A system's computed prompt tokens are its context prefill tokens
    (``prefill_tokens``, store hits excluded) plus every request's own tokens (``tail_tokens``: its unique
    suffix and handoff tokens, computed on top of the context); both are charged ``c_p`` = the shared
    system's prefill seconds per such token, and the generated tokens (the same in both) ``c_d`` = its decode
    seconds per generated token. ``cost_work_ratio`` = no-share cost ÷ shared cost; ``throughput_vs_cost`` =
    the measured throughput ratio ÷ it (1.0: the shared system reaches what the saving allows at its own
    per-token speeds). The token-work ratio counts a generated token like a prompt token; on a CPU a decode
    token costs several prompt tokens, so it overstates the reachable ratio. Results without ``tail_tokens``
    (written before it was counted) get no cost keys.
    """
    sh, ns = into["shared"], into["no_share"]
    if "tail_tokens" not in sh or "tail_tokens" not in ns or not sh.get("generated_tokens"):
        return {}
    prompt_sh = sh["prefill_tokens"] + sh["tail_tokens"]
    prompt_ns = ns["prefill_tokens"] + ns["tail_tokens"]
    if not prompt_sh:
        return {}
    c_p = sh["prefill_s"] / prompt_sh
    c_d = sh["decode_s"] / sh["generated_tokens"]
    cost_sh = prompt_sh * c_p + sh["generated_tokens"] * c_d
    cost_ns = prompt_ns * c_p + ns["generated_tokens"] * c_d
    ratio = cost_ns / cost_sh
    return {
        "prefill_s_per_token": c_p,
        "decode_s_per_token": c_d,
        "cost_work_ratio": ratio,
        "throughput_vs_cost": into["throughput_ratio"] / ratio,
    }


def derive(result: dict) -> dict:
    """Add the derived keys (``cost_work`` per point and policy; ``cost_work_ratio_at_saturation``,
    ``throughput_vs_cost_at_saturation``) to a result, from its measured fields only."""
    pols = result.get("scheduler", {}).get("policies", ["fcfs"])
    for p in result["points"]:
        for policy in pols:
            into = p if policy == pols[0] else p["policies"][policy]
            into.update(cost_work(into))
    sat = next(p for p in result["points"] if p["sessions"] == result["saturation_sessions"])
    if "cost_work_ratio" in sat:
        result["cost_work_ratio_at_saturation"] = sat["cost_work_ratio"]
        result["throughput_vs_cost_at_saturation"] = sat["throughput_vs_cost"]
    return result


def run_point(
    engine,
    trace,
    *,
    share: bool,
    budget: int | None,
    block_tokens: int,
    prefill_chunk_tokens=None,
    policy: str = "fcfs",
    max_running: int | None = None,
    decoders: dict[str, str] | None = None,
) -> dict:
    """Replay ``trace`` on a fresh ``Scheduler`` (``share``, ``budget`` bytes or None, a ``PrefixKVStore`` of
    ``block_tokens`` blocks, the scheduler options) with ``decoders`` (agent -> decoder name; ``replay``) and
    return its measurements: latencies and TTFT/TPOT in seconds, throughput in generated tokens/s, peak KV in
    bytes (``peak_live_kv_bytes``, ``peak_total_kv_bytes`` with the store, ``peak_kv_bytes_by_kind``: the
    ledger's kinds, ``ccft.serving.kv_ledger``), prefill and decode seconds and the scheduler's counters.

    Raises:
        RuntimeError: a request did not finish, or KV or requests were left over after the replay.
    """
    from ccft.serving.client import quantile
    from ccft.serving.prefix_store import PrefixKVStore
    from ccft.serving.scheduler import Scheduler

    store = PrefixKVStore(block_tokens=block_tokens)
    sched = Scheduler(
        engine,
        share=share,
        store=store,
        kv_budget_bytes=budget,
        prefill_chunk_tokens=prefill_chunk_tokens,
        policy=policy,
        max_running=max_running,
    )
    out = replay(sched, trace, decoders)
    ts = out["tickets"]
    lat = [t.latency for t in ts]
    ttft = [t.ttft for t in ts]
    tpot = [t.tpot for t in ts if t.tpot is not None]
    gen = sum(len(t.tokens) for t in ts)
    stats = sched.stats()
    if sched.live_bytes != 0 or engine.active != 0:
        raise RuntimeError("KV or requests left over after the replay")
    sessions = len(trace.sessions())
    return {
        "share": share,
        "requests": len(ts),
        "sessions": sessions,
        "makespan_s": out["makespan_s"],
        "latency_p50_s": quantile(lat, 0.50),
        "latency_p95_s": quantile(lat, 0.95),
        "ttft_p50_s": quantile(ttft, 0.50),
        "ttft_p95_s": quantile(ttft, 0.95),
        "tpot_median_s": statistics.median(tpot) if tpot else None,
        "tpot_p95_s": quantile(tpot, 0.95) if tpot else None,
        "policy": policy,
        "prefill_chunk_tokens": prefill_chunk_tokens,
        "max_running": max_running,
        "throughput_tok_s": gen / out["makespan_s"],
        "sessions_per_min": 60 * sessions / out["makespan_s"],
        "generated_tokens": gen,
        "prefix_hit_ratio": stats["prefix_hit_ratio"],
        "store_hit_ratio": store.stats()["hit_ratio"],
        "peak_live_kv_bytes": stats["peak_live_kv_bytes"],
        "peak_total_kv_bytes": stats["peak_total_kv_bytes"],
        "peak_kv_bytes_by_kind": stats["peak_kv_bytes_by_kind"],
        "kv_budget_bytes": budget,
        "prefills": stats.get("prefills", 0),
        "prefill_tokens": stats.get("prefill_tokens", 0),
        "tail_tokens": stats.get("tail_tokens", 0),
        "admission_waits": stats.get("admission_waits", 0),
        "prefill_s": stats["prefill_seconds"],
        "decode_s": stats["decode_seconds"],
        "decode_steps": stats.get("decode_steps", 0),
        "prefill_chunks": stats.get("prefill_chunks", 0),
    }


def offline_equality(engine, trace, *, block_tokens: int, **options) -> dict:
    """Greedy outputs under the shared scheduler against offline ``ccft.generate`` per request.

    Replays ``trace`` with ``Scheduler(share=True)`` (EOS ignored, as in the benchmark) and generates every
    request's prompt offline with its agent's decoder in mode ``prefillshare`` (the reference path,
    ``ccft.core.generation``; EOS honoured), at the sharing depth and C_base format the engine serves it at
    (``share_from_layer``, ``cache_format``). A request matches when the scheduler's tokens start with the
    offline tokens (the offline row may stop at EOS; the replay goes on to ``max_new_tokens``).

    ``options``: further ``Scheduler`` keywords (chunked prefill, policy).
    Returns ``{"requests", "equal", "mismatches": [first few {request, agent, scheduler, offline}]}``.
    """
    from ccft.core.generation import generate
    from ccft.serving.prefix_store import PrefixKVStore
    from ccft.serving.scheduler import Scheduler

    sched = Scheduler(engine, share=True, store=PrefixKVStore(block_tokens=block_tokens), **options)
    tickets = replay(sched, trace)["tickets"]
    equal, mismatches = 0, []
    for t in tickets:
        entry = engine.decoders[t.request.decoder]
        ref = generate(
            [list(t.request.prompt_ids)],
            mode="prefillshare",
            decoder=entry.decoder,
            max_new_tokens=t.request.max_new_tokens,
            share_from_layer=entry.depth,  # as the engine serves it (issue 35)
            cache_format=entry.cache_format,
        )[0]
        want = list(ref.token_ids)
        if list(t.tokens[: len(want)]) == want:
            equal += 1
        elif len(mismatches) < 5:
            mismatches.append(
                {"request": t.id, "agent": t.request.decoder, "scheduler": list(t.tokens), "offline": want}
            )
    return {"requests": len(tickets), "equal": equal, "mismatches": mismatches}


def eq9(trace, n_agents: int, gen_tokens: int) -> dict:
    """Eq. 9 for the trace's largest turn: prompt KV tokens (and with each agent's generation added)."""
    from ccft.serving.workloads import kv_tokens

    r = max(trace, key=lambda r: r.shared_len)
    kv = kv_tokens(n_agents, r.shared_len, r.unique_len)
    with_gen = kv_tokens(n_agents, r.shared_len, r.unique_len + gen_tokens)
    return {
        "shared_len": r.shared_len,
        "unique_len": r.unique_len,
        "agents": n_agents,
        "shared_tokens": kv.shared,
        "no_share_tokens": kv.no_share,
        "ratio": kv.ratio,
        "ratio_with_generation": with_gen.ratio,
    }


def eq9_depth(
    trace,
    *,
    n_agents: int,
    gen_tokens: int,
    layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    depth: int = 0,
    cache_format: str = "native",
) -> dict:
    """Eq. 9 generalised to sharing depth m and the C_base format, in bytes, for one session's largest turn.

    In words: N agents read one shared prompt of P tokens, each adds U tokens of its own and G generated
    ones. Per layer, the shared system holds the prompt once (C_base) and, in the m layers below the sharing
    depth, once more per agent (each agent's own K/V); every agent holds its own and generated tokens in all
    L layers:
    ``P·L·r + N·P·m + N·(U + G)·L`` layer-tokens, r = C_base's bytes in its format ÷ the native cache's
    (``ccft.core.compact.kv_nbytes``: int8 codes and bfloat16 scales against fp32/bf16 elements). m = 0 and
    r = 1 is the paper's Eq. 9 (with the generation), no sharing is ``N·(P + U + G)·L``. The engine keeps
    C_base in all L layers (the base prefills them all, and depth-0 readers and the prefix store use them);
    ``bytes_if_cbase_only_above_m`` is what holding only its layers m..L−1 would take,
    ``P·((L−m) + N·m)·r' + N·(U + G)·L`` (not implemented). An agent reading the int8 C_base takes its whole
    prompt as its context (a key channel's scale covers the whole prefix it quantises,
    ``ccft.serving.Scheduler``): agents whose prompts are equal share one int8 context of P + U tokens, and
    each distinct prompt is a context of its own (``int8_contexts``; with N distinct prompts N sessions of one
    agent, ``N·((P + U)·L·r + (P + U)·m + G·L)``).

    Args:
        trace: the workload (``ccft.serving.workloads.Trace``); its request with the longest shared context is
            the turn counted (P = its ``shared_len``, U = its ``unique_len``).
        n_agents: N.  gen_tokens: G.  layers: L.  kv_heads, head_dim, dtype: the KV geometry of the base.
        depth: m.  cache_format: the C_base format (``native``, ``int8``).
    Returns:
        ``{"shared_bytes", "cbase_bytes" (the C_base part), "own_bytes_per_agent" (the K/V below m),
        "no_share_bytes", "ratio_with_generation" (no-share ÷ shared), "bytes_if_cbase_only_above_m",
        "cbase_bytes_ratio" (r), "int8_contexts" (the int8 contexts of the turn; None on the native cache),
        and the counts P, U, G, N, L, m}``; bytes per
        session (float).
    Raises:
        ConfigError: m outside 0..L, or an unknown format.
    """
    from ccft.core.compact import kv_nbytes
    from ccft.evals.study.frontier import session_kv_bytes

    r = max(trace, key=lambda r: r.shared_len)
    P, U, G, N, L, m = r.shared_len, r.unique_len, int(gen_tokens), int(n_agents), int(layers), int(depth)
    geo = {"kv_heads": kv_heads, "head_dim": head_dim}
    per_layer_token = kv_nbytes("native", layers=1, tokens=1, dtype=dtype, **geo)  # 2 · h · d · bytes

    def cbase(tokens: int, n_layers: int = L) -> int:  # C_base's bytes in its format
        return kv_nbytes(cache_format, layers=n_layers, tokens=tokens, dtype=dtype, **geo)

    def ratio(tokens: int) -> float:
        return cbase(tokens) / kv_nbytes("native", layers=L, tokens=tokens, dtype=dtype, **geo)

    if cache_format == "native":  # one context of the shared P tokens; each agent's U + G in its tail
        ctx, own, groups = P, U + G, [N]
    else:  # one context per distinct whole prompt of the turn, read by the agents that send it
        turn = [q for q in trace if (q.session, q.turn) == (r.session, r.turn)]
        prompts: dict[tuple, int] = {}
        for q in turn:
            prompts[tuple(q.prompt_ids)] = prompts.get(tuple(q.prompt_ids), 0) + 1
        ctx, own, groups = P + U, G, list(prompts.values())
    shared = sum(
        session_kv_bytes(
            layers=L,
            depth=m,
            agents=n,
            prompt_tokens=ctx,
            own_tokens=own,
            bytes_per_layer_token=per_layer_token,
            cbase_ratio=ratio(ctx),
        )
        for n in groups
    )
    contexts = len(groups)
    no_share = session_kv_bytes(
        layers=L,
        depth=None,
        agents=N,
        prompt_tokens=P,
        own_tokens=U + G,
        bytes_per_layer_token=per_layer_token,
    )
    return {
        "shared_len": P,
        "unique_len": U,
        "generated_tokens": G,
        "agents": N,
        "layers": L,
        "depth": m,
        "cache_format": cache_format,
        "cbase_bytes_ratio": ratio(ctx),
        "int8_contexts": None if cache_format == "native" else contexts,
        "cbase_bytes": contexts * cbase(ctx),
        "own_bytes_per_agent": ctx * m * per_layer_token,
        "shared_bytes": shared,
        "no_share_bytes": no_share,
        "ratio_with_generation": no_share / shared,
        # the same without C_base's layers 0..m-1 (no reader of these agents needs them)
        "bytes_if_cbase_only_above_m": shared - contexts * (cbase(ctx) - cbase(ctx, L - m)),
    }


def kv_parts(point: dict, agents, sessions: int, predicted: dict) -> dict:
    """The measured peak KV of one (unbudgeted) run by part (``peak_kv_bytes_by_kind``) beside ``predicted``
    (``eq9_depth``) × ``sessions``: ``cbase`` (kind ``context``), ``own`` per agent (``own:NAME``), ``tail``,
    all bytes, and the measured ÷ predicted ratios of the C_base part and of the own parts' mean."""
    kinds = point["peak_kv_bytes_by_kind"]
    own = {a: kinds.get(f"own:{a}", 0) for a in agents}
    want_own = sessions * predicted["own_bytes_per_agent"]
    return {
        "cbase_bytes": kinds.get("context", 0),
        "own_bytes": own,
        "tail_bytes": kinds.get("tail", 0),
        "live_bytes": point["peak_live_kv_bytes"],
        "predicted_cbase_bytes": sessions * predicted["cbase_bytes"],
        "predicted_own_bytes_per_agent": want_own,
        "predicted_live_bytes": sessions * predicted["shared_bytes"],
        "cbase_vs_predicted": kinds.get("context", 0) / (sessions * predicted["cbase_bytes"]),
        "own_vs_predicted": (sum(own.values()) / len(own) / want_own) if want_own else None,
        "live_vs_predicted": point["peak_live_kv_bytes"] / (sessions * predicted["shared_bytes"]),
    }


def run(args) -> dict:
    from ccft.evals.results import hardware  # the CPU's vector instructions (docs/study.md, "Time")

    if getattr(
        args, "from_json", None
    ):  # nothing measured: the saved result with its derived keys recomputed
        return derive(json.loads(Path(args.from_json).read_text()))
    from ccft.serving import workloads

    torch.set_num_threads(args.threads)
    agents = agent_names(getattr(args, "agents", len(AGENTS)))
    depth, fmt = variant_of(args)  # before the model loads
    variant = bool(depth) or fmt != "native"
    ref = reference_map(agents) if variant else None  # m = 0, native: the no-share system and shared_ref
    modes = {"shared": None, "no_share": ref, **({"shared_ref": ref} if variant else {})}
    base, engine, desc = build(args)
    bpt = engine.kv_bytes_per_token
    opts = scheduler_options(args)
    policies = ["fcfs", "mlfq"] if getattr(args, "policy", "fcfs") == "both" else [opts["policy"]]

    def trace_for(n):
        return workloads.generate_from_options(args, sessions=n, agents=agents, tokenizer=base.tokenizer)

    top = max(args.sessions)
    # warm-up (first-call allocations), not reported
    for dec in (None, ref) if variant else (None,):
        run_point(
            engine,
            trace_for(1),
            share=True,
            budget=None,
            block_tokens=args.block_tokens,
            decoders=dec,
            **opts,
        )
    calib = {
        mode: run_point(
            engine,
            trace_for(top),
            share=mode != "no_share",
            budget=None,
            block_tokens=args.block_tokens,
            decoders=dec,
            **opts,
        )
        for mode, dec in modes.items()
    }
    # the shared system's peak; with a variant the larger of its and the reference's (a budget below what
    # the m = 0 native reference needs for one context and its store blocks would leave it waiting forever)
    budget = (
        int(args.kv_budget_mb * 2**20)
        if args.kv_budget_mb is not None
        else max(calib[m]["peak_total_kv_bytes"] for m in modes if m != "no_share")
    )
    points = []
    for n in sorted(args.sessions):
        tr = trace_for(n)
        row = {"sessions": n, **work(tr)}
        for policy in policies:
            into = row if policy == policies[0] else row.setdefault("policies", {}).setdefault(policy, {})
            for mode, dec in modes.items():  # same trace, same budget
                into[mode] = run_point(
                    engine,
                    tr,
                    share=mode != "no_share",
                    budget=budget,
                    block_tokens=args.block_tokens,
                    decoders=dec,
                    **{**opts, "policy": policy},
                )
                print(
                    f"sessions={n} {policy} {mode}: p95 {into[mode]['latency_p95_s']:.2f}s, "
                    f"{into[mode]['throughput_tok_s']:.1f} tok/s, hit {into[mode]['prefix_hit_ratio']:.2f}",
                    file=sys.stderr,
                )
            into["throughput_ratio"] = (
                into["shared"]["throughput_tok_s"] / into["no_share"]["throughput_tok_s"]
            )
            into["p95_latency_ratio"] = into["no_share"]["latency_p95_s"] / into["shared"]["latency_p95_s"]
            into["throughput_vs_work"] = into["throughput_ratio"] / row["work_ratio"]
            if variant:  # what the partial prefills / the quantisation cost, against m = 0 native
                v, r0 = into["shared"], into["shared_ref"]
                into["variant_cost"] = {
                    "throughput_vs_ref": v["throughput_tok_s"] / r0["throughput_tok_s"],
                    "latency_p95_vs_ref": v["latency_p95_s"] / r0["latency_p95_s"],
                    "prefill_s": v["prefill_s"],
                    "prefill_s_ref": r0["prefill_s"],
                }
        points.append(row)
    best = max(p["no_share"]["throughput_tok_s"] for p in points)
    sat = next(p for p in points if p["no_share"]["throughput_tok_s"] >= 0.95 * best)
    e9 = eq9(trace_for(top), len(agents), args.max_new_tokens)
    from ccft.train.cache_store import kv_shape

    layers, kv_heads, head_dim = kv_shape(base.model.config)
    geometry = {
        "n_agents": len(agents),
        "gen_tokens": args.max_new_tokens,
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "dtype": base.dtype,
    }
    e9d = eq9_depth(trace_for(top), depth=depth, cache_format=fmt, **geometry)
    kv = {"shared": kv_parts(calib["shared"], agents, top, e9d)}
    if variant:
        e9_ref = eq9_depth(trace_for(top), **geometry)
        kv["shared_ref"] = kv_parts(calib["shared_ref"], [ref[a] for a in agents], top, e9_ref)
        kv["cbase_ref_vs_variant"] = {  # how many times fewer C_base bytes the variant holds
            "measured": kv["shared_ref"]["cbase_bytes"] / kv["shared"]["cbase_bytes"],
            "predicted": e9_ref["cbase_bytes"] / e9d["cbase_bytes"],
        }
    measured_kv_ratio = calib["no_share"]["peak_live_kv_bytes"] / calib["shared"]["peak_live_kv_bytes"]
    result = {
        "benchmark": "serve",
        "model": desc["model"],
        "decoders": desc["decoders"],
        "weights": desc["weights"],
        "dtype": str(base.dtype),
        "device": f"{platform.processor() or platform.machine()} CPU"
        if base.device.type == "cpu"
        else torch.cuda.get_device_name(base.device),
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "hardware": hardware(),
        "agents": len(agents),
        "workload": {
            "kind": args.workload,
            "agents": agents,
            "turns": args.turns,
            "shared_tokens": args.shared_tokens,
            "unique_tokens": args.unique_tokens,
            "growth_tokens": args.growth_tokens,
            "max_new_tokens": args.max_new_tokens,
            "new_tokens_spread": getattr(args, "new_tokens_spread", 0.0),
            "seed": args.seed,
            "arrivals": "all sessions at t=0",
        },
        "scheduler": {**opts, "policies": policies},
        "kv_bytes_per_token": bpt,
        "kv_budget_bytes": budget,
        "block_tokens": args.block_tokens,
        "calibration": calib,
        "points": points,
        "saturation_sessions": sat["sessions"],
        "eq9": e9,
        "share_from_layer": depth,
        "cache_format": fmt,
        "eq9_depth": e9d,
        "kv": kv,
        "p95_latency_ratio": sat["no_share"]["latency_p95_s"] / sat["shared"]["latency_p95_s"],
        "throughput_ratio": sat["throughput_ratio"],
        "work_ratio_at_saturation": sat["work_ratio"],
        "work_ratio_with_reuse_at_saturation": sat["work_ratio_with_reuse"],
        "throughput_vs_work_at_saturation": sat["throughput_vs_work"],
        "hit_ratio_min": min(p["shared"]["prefix_hit_ratio"] for p in points),
        "kv_peak_ratio_measured": measured_kv_ratio,
    }
    result["kv_bytes_vs_eq9"] = measured_kv_ratio / eq9_ratio(result)
    if variant:
        result["variant_cost_at_saturation"] = sat["variant_cost"]
    if getattr(args, "check_outputs", False):
        checks = {
            policy: offline_equality(
                engine, trace_for(1), block_tokens=args.block_tokens, **{**opts, "policy": policy}
            )
            for policy in policies
        }
        result["outputs_vs_offline"] = dict(checks[policies[0]])
        if len(policies) > 1:
            result["outputs_vs_offline"]["by_policy"] = checks
    from ccft.core.io import display_path

    # named relative to the working directory: no machine path in a committed result
    result["plots"] = [
        display_path(f)
        for f in plots(result, args.plots or (str(Path(args.out).parent) if args.out else None))
    ]
    return derive(result)


def plots(result: dict, folder: str | None) -> list[str]:
    if not folder:
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    Path(folder).mkdir(parents=True, exist_ok=True)
    xs = [p["sessions"] for p in result["points"]]
    panels = [
        ("latency_p95_s", "p95 latency (s)"),
        ("throughput_tok_s", "throughput (generated tok/s)"),
        ("prefix_hit_ratio", "prefix hit ratio"),
        ("peak_total_kv_bytes", "peak KV bytes (live + store)"),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for mode, style in (("shared", "o-"), ("no_share", "s--")):
            ax.plot(xs, [p[mode][key] for p in result["points"]], style, label=mode.replace("_", "-"))
        ax.set_xlabel("concurrent sessions")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
    axes[0].legend()
    fig.suptitle(
        f"{result['model']}, {result['workload']['kind']} x{len(result['workload']['agents'])} agents, "
        f"{result['device']} ({result['threads']} threads), KV budget "
        f"{result['kv_budget_bytes'] / 2**20:.0f} MiB",
        fontsize=9,
    )
    fig.tight_layout()
    from ccft.core.io import save_figure

    path = str(Path(folder) / "serve_sweep.png")
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return [path]


def eq9_ratio(result: dict) -> float:
    """The Eq. 9 ratio (no-share ÷ shared, generation included) ``kv_bytes_vs_eq9`` divides by: the paper's
    (``eq9``), or at a sharing depth / compact format its generalisation (``eq9_depth``)."""
    if result.get("share_from_layer", 0) or result.get("cache_format", "native") != "native":
        return result["eq9_depth"]["ratio_with_generation"]
    return result["eq9"]["ratio_with_generation"]


def table(result: dict) -> str:
    lines = [
        f"serve benchmark: {result['model']} ({result['dtype']}, base weights "
        f"{result.get('weights', 'fp32')}) on {result['device']}, {result['threads']} "
        f"threads; {result['workload']['kind']}, {len(result['workload']['agents'])} agents, shared "
        f"{result['workload']['shared_tokens']}+{result['workload']['growth_tokens']}/turn, unique "
        f"{result['workload']['unique_tokens']}, {result['workload']['max_new_tokens']} new tokens; KV "
        f"budget {result['kv_budget_bytes'] / 2**20:.1f} MiB (both)",
        "| sessions | policy | mode | p50 s | p95 s | TTFT p95 s | TPOT p95 ms | tok/s | sessions/min | hit "
        "ratio | peak KV MiB | waits | work ratio | tput ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    pols = result.get("scheduler", {}).get("policies", ["fcfs"])
    for p in result["points"]:
        for policy in pols:
            into = p if policy == pols[0] else p["policies"][policy]
            for mode in ("shared", "no_share", "shared_ref"):
                if mode not in into:  # shared_ref: only with --share-from-layer / --cache-format
                    continue
                r = into[mode]
                tpot = "-" if r.get("tpot_p95_s") is None else f"{1000 * r['tpot_p95_s']:.1f}"
                ratios = " | "
                if mode == "shared" and "work_ratio" in p:  # older result files lack them
                    ratios = f"{p['work_ratio']:.2f} | {into['throughput_ratio']:.2f}"
                lines.append(
                    f"| {p['sessions']} | {policy} | {mode.replace('_', '-')} | {r['latency_p50_s']:.2f} | "
                    f"{r['latency_p95_s']:.2f} | {r['ttft_p95_s']:.2f} | {tpot} | "
                    f"{r['throughput_tok_s']:.1f} | {r['sessions_per_min']:.1f} | "
                    f"{r['prefix_hit_ratio']:.2f} | {r['peak_total_kv_bytes'] / 2**20:.1f} | "
                    f"{r['admission_waits']} | {ratios} |"
                )
    lines.append(
        f"at the baseline's saturation point ({result['saturation_sessions']} sessions): p95 latency "
        f"ratio {result['p95_latency_ratio']:.2f}x, throughput ratio {result['throughput_ratio']:.2f}x"
        + (
            f" of a token-work ratio {result['work_ratio_at_saturation']:.2f}x "
            f"({result['throughput_vs_work_at_saturation']:.0%})"
            if "work_ratio_at_saturation" in result
            else ""
        )
        + (
            f", a cost-weighted work ratio {result['cost_work_ratio_at_saturation']:.2f}x "
            f"({result['throughput_vs_cost_at_saturation']:.0%})"
            if "cost_work_ratio_at_saturation" in result
            else ""
        )
        + "; "
        f"shared hit ratio min {result['hit_ratio_min']:.2f}; peak KV no-share/shared "
        f"{result['kv_peak_ratio_measured']:.2f} vs Eq. 9 {eq9_ratio(result):.2f} "
        f"({result['kv_bytes_vs_eq9']:.2f})"
    )
    if "kv" in result:  # older result files lack the parts
        e9d = result["eq9_depth"]
        for mode, parts in result["kv"].items():
            if mode == "cbase_ref_vs_variant":
                continue
            own = sum(parts["own_bytes"].values())
            lines.append(
                f"peak KV by part, {mode.replace('_', '-')} (m={e9d['depth'] if mode == 'shared' else 0}, "
                f"{e9d['cache_format'] if mode == 'shared' else 'native'}): C_base "
                f"{parts['cbase_bytes'] / 2**20:.2f} MiB ({parts['cbase_vs_predicted']:.3f} of Eq. 9), own "
                f"{own / 2**20:.2f} MiB over {len(parts['own_bytes'])} agents, tails "
                f"{parts['tail_bytes'] / 2**20:.2f} MiB; live {parts['live_vs_predicted']:.3f} of Eq. 9"
            )
        if "cbase_ref_vs_variant" in result["kv"]:
            c = result["kv"]["cbase_ref_vs_variant"]
            cost = result["variant_cost_at_saturation"]
            lines.append(
                f"C_base bytes m=0 native / variant: measured {c['measured']:.3f}x, predicted "
                f"{c['predicted']:.3f}x; variant throughput {cost['throughput_vs_ref']:.2f}x and p95 latency "
                f"{cost['latency_p95_vs_ref']:.2f}x the reference's at saturation"
            )
    return "\n".join(lines)


def report(result: dict, out: str | None) -> int:
    print(table(result))
    print(
        json.dumps(
            {
                k: result.get(k)
                for k in (
                    "p95_latency_ratio",
                    "throughput_ratio",
                    "work_ratio_at_saturation",
                    "cost_work_ratio_at_saturation",
                    "agents",
                    "hit_ratio_min",
                    "kv_bytes_vs_eq9",
                )
            }
        )
    )
    if out:
        from ccft.core.io import atomic_write_text

        atomic_write_text(out, json.dumps(result, indent=2, default=str))
        print(f"wrote {out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ccft.bench.serve", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    from ccft.bench.provenance import recorded

    return report(recorded(run, args), args.out)


if __name__ == "__main__":
    sys.exit(main())
