"""Soak: ``ccft serve`` under a steady multi-agent load for a bounded time; memory, KV, latency stay flat.

    ccft bench soak --duration-s 1200 --out benchmarks/results/soak_cpu.json     # make soak (SOAK_S=1200)

Starts ``ccft serve`` in a child process on 127.0.0.1 (the base, default the embedded SmolLM2, and
three LoRA decoders ``math``, ``code``, ``tools``: ``--decoder NAME=PATH`` folders, or random LoRA r=8
adapters written to a temporary folder; ``--allow-reload`` unless ``--no-reload``) and drives it for
``--duration-s`` seconds with:

* ``--clients`` closed-loop streaming clients, each sending the next request of a ReAct trace
  (``ccft.serving.workloads``: shared context + the agent's instruction as token ids, the shared
  length as ``shared_prefix_tokens``, ``max_tokens`` decoded with ``ignore_eos``) as soon as its
  previous one ended; a request is *abandoned* with probability ``--abandon-fraction``: the client
  closes the connection after 1–3 streamed chunks (the server must cancel it and free its KV);
* one hostile client, every ``--hostile-every-s`` seconds one of: a malformed JSON body (expects
  400), an unknown model (404), a body over the server's ``--max-body-mb`` (413, answered before
  it is read), a prompt longer than the model's context (400 ``context_length_exceeded``);
* every ``--reload-every-s`` seconds, a hot reload of ``math`` (``POST /v1/models/math/reload``),
  alternating between its two weight sets, each followed by 4 greedy probe requests whose tokens
  must equal a cold start on the weights just loaded (a fresh engine on that folder, computed in
  this process before the server starts); the first round also sends a reload of a folder that
  does not exist (expects 400, and the probes then still equal the weights served before).

Before the clock starts (unless ``--no-warmup``) the clients send one request (``max_tokens`` 1) for each
distinct shared context of the trace, each session's turns in order: the prefix store then holds what the
load will keep in it (``--kv-budget-mb`` bounds store + live KV; the server evicts the store to admit live
requests), instead of filling during the first minutes of the measured load. The server runs with
``--max-prefix-tokens budget`` (``--max-prefix-tokens``): its prefix arena is allocated whole at start from
the same budget, so it never doubles mid-run. The JSON records the arena's bytes at start and end.

``--malloc POLICY`` starts the server with ``ccft serve --malloc POLICY`` (``ccft.serving.malloc``: ``trim``,
the default, ``mmap-64k`` or ``glibc``; ``--no-tune-malloc`` is ``glibc``), to compare RSS and speed across
allocator policies.

Every ``--sample-s`` seconds it records the server's RSS (``/proc/PID/status``) and its gauges from
``/metrics`` (live KV, prefix store, prefix arena, active, queued). After the load stops it waits
for the server to be idle and reads live KV once more.

Measured: requests completed / abandoned / lost (a normal request without a complete answer:
connection error, non-200 status, a stream that ends without ``[DONE]``), every status code, RSS,
live KV and the p95 of latency per output token (a completed request's submit→end seconds ÷ its
tokens) per window of ``--window-s`` seconds. First window: the second one (the first is warm-up);
last window: the run's last ``--window-s`` seconds.

Invariants (exit status 1 when one is violated): 0 lost, 0 status 5xx, every hostile request
answered with its expected status, live KV 0 after the last request, every reload probe equal to
its cold start. Goals (reported, not enforced: a shared machine makes them noisy): RSS growth from
the first to the last window ≤ 5%, p95 last / first ≤ 1.2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ccft.bench.process import free_port

AGENTS = ("math", "code", "tools")  #: the served decoders
RELOADED = "math"  #: the decoder the soak reloads
#: the 4 probe prompts sent after each reload (text, tokenized by the base's tokenizer)
PROBES = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "Write a function to find the shared elements from the given two lists.",
    "What is the weather like in Paris today? Use the get_weather tool.",
    "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total?",
)
PROBE_TOKENS = 8
RSS_GOAL_PCT, P95_GOAL_RATIO = 5.0, 1.2


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="embedded model name or HF folder")
    p.add_argument(
        "--decoder",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help=f"a LoRA decoder folder for {', '.join(AGENTS)} (default: random LoRA r=8 adapters)",
    )
    p.add_argument(
        "--reload-with",
        default=None,
        metavar="PATH",
        help=f"the second weight set of {RELOADED!r} (default: another random LoRA r=8 adapter)",
    )
    p.add_argument("--duration-s", type=float, default=1200.0, help="seconds of load")
    p.add_argument("--window-s", type=float, default=60.0, help="window of the first / last figures (s)")
    p.add_argument("--clients", type=int, default=4, help="closed-loop streaming clients")
    p.add_argument("--abandon-fraction", type=float, default=0.1, help="requests abandoned mid-stream")
    p.add_argument("--hostile-every-s", type=float, default=5.0, help="seconds between hostile requests")
    p.add_argument("--reload-every-s", type=float, default=120.0, help="seconds between reloads")
    p.add_argument("--no-reload", action="store_true", help="serve without --allow-reload; no reloads")
    p.add_argument("--sample-s", type=float, default=2.0, help="seconds between RSS / metrics samples")
    p.add_argument("--sessions", type=int, default=16, help="sessions of the trace the clients cycle over")
    p.add_argument("--turns", type=int, default=3, help="turns per session of the ReAct trace")
    p.add_argument(
        "--shared-tokens", type=int, default=256, help="tokens of the context every agent of a session shares"
    )
    p.add_argument("--unique-tokens", type=int, default=32, help="tokens of each agent's own instruction")
    p.add_argument("--growth-tokens", type=int, default=64, help="tokens the shared context grows per turn")
    p.add_argument(
        "--max-new-tokens", type=int, default=16, help="tokens generated per request (EOS ignored)"
    )
    p.add_argument("--kv-budget-mb", type=float, default=256.0, help="the server's --kv-budget-mb")
    p.add_argument(
        "--max-prefix-tokens",
        default="budget",
        metavar="N|budget",
        help="the server's --max-prefix-tokens: 'budget' (the default) allocates the prefix arena whole at "
        "start from --kv-budget-mb, so it never grows mid-run; N: N token slots; 0: the arena starts small "
        "and doubles when full",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the warm-up (one request per distinct shared context of the trace, before the clock "
        "starts, so the prefix store is at its budget-bounded size from the start of the load)",
    )
    p.add_argument("--threads", type=int, default=None, help="the server's --threads (default: all cores)")
    p.add_argument(
        "--malloc",
        default="trim",
        help="the server's --malloc policy (trim, mmap-64k or glibc; ccft.serving.malloc)",
    )
    p.add_argument(
        "--no-tune-malloc",
        dest="malloc",
        action="store_const",
        const="glibc",
        default=argparse.SUPPRESS,  # the default is --malloc's
        help="the same as --malloc glibc",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the trace, the abandons and the random decoders"
    )
    p.add_argument("--timeout-s", type=float, default=300.0, help="per-request HTTP timeout (s)")
    p.add_argument("--out", default=None, help="write the JSON here (atomically)")


# ------------------------------------------------------------------ weights and references


def make_decoders(model: str, folder: Path, given: dict[str, str], reload_with: str | None, seed: int):
    """``(served {name: folder}, {"a": folder, "b": folder} of the reloaded decoder)``: given folders,
    else random LoRA r=8 adapters (``init_lora_weights=False``) saved under ``folder``."""
    import ccft
    from ccft.bench.serve import random_agent_decoder

    served: dict[str, str] = {}
    base = None
    for i, name in enumerate(AGENTS):
        if name in given:
            served[name] = given[name]
            continue
        base = base or ccft.load_base(model)
        dec = random_agent_decoder(base, f"soak-{name}", 1000 * (seed + 1) + i)
        served[name] = str(ccft.save_decoder(dec, folder / name))
    second = reload_with
    if second is None:
        base = base or ccft.load_base(model)
        dec = random_agent_decoder(base, f"soak-{RELOADED}-b", 1000 * (seed + 1) + 99)
        second = str(ccft.save_decoder(dec, folder / f"{RELOADED}-b"))
    return served, {"a": served[RELOADED], "b": second}


def cold_start_tokens(model: str, folder: str, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens (``PROBE_TOKENS`` each, EOS ignored) of a fresh engine with only ``folder`` loaded."""
    import ccft
    from ccft.inference import SharedPrefillEngine

    engine = SharedPrefillEngine(ccft.load_base(model), decoders={RELOADED: folder})
    out = []
    for ids in prompts:
        with engine.prefill([ids]) as handle:
            gen = engine.generate(handle, decoder=RELOADED, max_new_tokens=PROBE_TOKENS, ignore_eos=True)
            out.append(list(gen[0].token_ids))
    engine.close()
    return out


# ------------------------------------------------------------------ the server


@contextlib.contextmanager
def serve(cmd: list[str], url: str, *, ready_timeout: float = 600.0):
    """Run ``cmd`` (``ccft serve``) in its own session; yield its ``Popen`` once ``/health`` answers 200
    (``ccft.bench.peers.server_process``)."""
    from ccft.bench.process import server_process

    with server_process(cmd, url, "/health", log=lambda _: None, ready_timeout=ready_timeout) as proc:
        yield proc


def rss_bytes(pid: int) -> int | None:
    """Resident set size of process ``pid`` (bytes; Linux ``/proc``; None elsewhere or when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def gauges(text: str) -> dict[str, float]:
    """The unlabelled samples of a Prometheus text page (``{name: value}``)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


# ------------------------------------------------------------------ the load


@dataclass
class Tally:
    """What the clients saw (shared by the client threads; ``lock`` guards it)."""

    t0: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    statuses: dict[str, int] = field(default_factory=dict)
    completed: list[tuple[float, float]] = field(default_factory=list)  # (end s from t0, s per token)
    abandoned: int = 0
    lost: list[str] = field(default_factory=list)
    hostile: list[dict] = field(default_factory=list)
    reloads: list[dict] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)

    def status(self, code: int | str) -> None:
        with self.lock:
            self.statuses[str(code)] = self.statuses.get(str(code), 0) + 1


def _stream_one(client, url: str, body: dict, abandon_after: int | None, tally: Tally) -> None:
    """One streaming request: completed, abandoned after ``abandon_after`` chunks, or lost."""
    import httpx

    t_start = time.perf_counter()
    chunks, tokens, done = 0, 0, False
    try:
        with client.stream("POST", url + "/v1/completions", json=body) as r:
            tally.status(r.status_code)
            if r.status_code != 200:
                r.read()
                with tally.lock:
                    tally.lost.append(f"status {r.status_code}: {r.text[:200]}")
                return
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                for choice in chunk.get("choices", []):
                    tokens += len(choice.get("token_ids") or [])
                chunks += 1
                if abandon_after is not None and chunks >= abandon_after:
                    break  # leaving the block closes the connection: the server must cancel the request
    except (httpx.HTTPError, ValueError) as e:
        with tally.lock:
            tally.lost.append(f"{type(e).__name__}: {e}")
        return
    end = time.perf_counter()
    with tally.lock:
        if abandon_after is not None and not done:
            tally.abandoned += 1
        elif done and tokens > 0:
            tally.completed.append((end - tally.t0, (end - t_start) / tokens))
        else:
            tally.lost.append(f"stream ended without [DONE] after {chunks} chunks, {tokens} tokens")


def client_loop(url: str, bodies: list[dict], start: int, stop: threading.Event, args, tally: Tally) -> None:
    """A closed-loop client: the trace's requests from ``start`` on, cycling, until ``stop``."""
    import httpx

    rng = random.Random(args.seed * 7919 + start)
    i = start
    with httpx.Client(timeout=args.timeout_s) as client:
        while not stop.is_set():
            body = bodies[i % len(bodies)]
            i += 1
            abandon = rng.randint(1, 3) if rng.random() < args.abandon_fraction else None
            _stream_one(client, url, body, abandon, tally)


def hostile_bodies(max_body_bytes: int, max_model_len: int) -> list[tuple[str, bytes, int]]:
    """``(kind, raw body, expected status)`` of the hostile requests, in the order they are sent."""
    return [
        ("malformed_json", b'{"model": "math", "prompt": [1, 2', 400),
        (
            "unknown_model",
            json.dumps({"model": "no-such-model", "prompt": "hi", "max_tokens": 2}).encode(),
            404,
        ),
        ("body_too_large", b'{"model": "math", "prompt": "' + b"x" * max_body_bytes + b'"}', 413),
        (
            "prompt_too_long",
            json.dumps({"model": "math", "prompt": [11] * (max_model_len + 1), "max_tokens": 1}).encode(),
            400,
        ),
    ]


def hostile_loop(url: str, cases, stop: threading.Event, every: float, timeout: float, tally: Tally) -> None:
    import httpx

    i = 0
    with httpx.Client(timeout=timeout) as client:
        while not stop.wait(every):
            kind, raw, want = cases[i % len(cases)]
            i += 1
            try:
                r = client.post(
                    url + "/v1/completions", content=raw, headers={"content-type": "application/json"}
                )
                got: int | str = r.status_code
            except httpx.HTTPError as e:
                got = type(e).__name__
            tally.status(got)
            with tally.lock:
                tally.hostile.append({"kind": kind, "expected": want, "status": got})


def probe(client, url: str, prompts: list[list[int]]) -> list[list[int]] | str:
    """The greedy tokens of ``RELOADED`` for each probe prompt (non-streamed), or the error."""
    import httpx

    out = []
    for ids in prompts:
        body = {
            "model": RELOADED,
            "prompt": ids,
            "max_tokens": PROBE_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        try:
            r = client.post(url + "/v1/completions", json=body)
        except httpx.HTTPError as e:
            return f"{type(e).__name__}: {e}"
        if r.status_code != 200:
            return f"status {r.status_code}: {r.text[:200]}"
        out.append(list(r.json()["choices"][0]["token_ids"]))
    return out


def reload_loop(
    url, folders, refs, prompts, stop: threading.Event, every: float, timeout: float, tally
) -> None:
    """Alternate ``RELOADED`` between weight sets b and a every ``every`` s; probe after each reload."""
    import httpx

    current, n = "a", 0
    with httpx.Client(timeout=timeout) as client:
        while not stop.wait(every):
            if n == 0:  # a refused reload changes nothing
                t = time.perf_counter()
                r = client.post(url + f"/v1/models/{RELOADED}/reload", json={"path": "/nonexistent/decoder"})
                tally.status(r.status_code)
                got = probe(client, url, prompts)
                with tally.lock:
                    tally.reloads.append(
                        {
                            "at_s": round(t - tally.t0, 1),
                            "to": "/nonexistent/decoder",
                            "status": r.status_code,
                            "expected": 400,
                            "message": r.json().get("error", {}).get("message", "")[:300],
                            "probes_equal": got == refs[current],
                        }
                    )
            target = "b" if current == "a" else "a"
            t = time.perf_counter()
            try:
                r = client.post(url + f"/v1/models/{RELOADED}/reload", json={"path": folders[target]})
                status: int | str = r.status_code
            except httpx.HTTPError as e:
                status = type(e).__name__
            took = time.perf_counter() - t
            tally.status(status)
            if status == 200:
                current = target
            got = probe(client, url, prompts)
            with tally.lock:
                tally.reloads.append(
                    {
                        "at_s": round(t - tally.t0, 1),
                        "to": target,
                        "status": status,
                        "expected": 200,
                        "seconds": round(took, 3),
                        "probes_equal": got == refs[current],
                        **({} if isinstance(got, list) else {"error": got}),
                    }
                )
            n += 1


def sampler_loop(url: str, pid: int, stop: threading.Event, every: float, tally: Tally) -> None:
    import httpx

    with httpx.Client(timeout=30) as client:
        while True:
            row: dict = {"t_s": round(time.perf_counter() - tally.t0, 2), "rss_bytes": rss_bytes(pid)}
            with contextlib.suppress(httpx.HTTPError):
                g = gauges(client.get(url + "/metrics").text)
                for name in (
                    "ccft_live_kv_bytes",
                    "ccft_prefix_store_bytes",
                    "ccft_prefix_arena_bytes",
                    "ccft_active_requests",
                    "ccft_queue_depth",
                ):
                    row[name.removeprefix("ccft_")] = g.get(name)
            with tally.lock:
                tally.samples.append(row)
            if stop.wait(every):
                return


def wait_idle(url: str, timeout: float) -> dict:
    """Poll ``/health`` until no request is queued or active and live KV is 0 (at most ``timeout`` s).

    Returns:
        the last ``/health`` body.
    """
    import httpx

    deadline, body = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            body = httpx.get(url + "/health", timeout=10).json()
            if (
                not body.get("queue_depth")
                and not body.get("active_requests")
                and not body.get("live_kv_bytes")
            ):
                return body
        time.sleep(0.5)
    return body


def warmup_sessions(bodies: list[dict]) -> list[list[dict]]:
    """The warm-up: for each distinct shared context of ``bodies`` (its first request), a copy with
    ``max_tokens`` 1, not streamed; one list per session, in the trace's order (turn after turn)."""
    seen: set[tuple] = set()
    sessions: dict[str, list[dict]] = {}
    for b in bodies:
        key = tuple(b["prompt"][: b.get("shared_prefix_tokens") or len(b["prompt"])])
        if key not in seen:
            seen.add(key)
            sessions.setdefault(str(b.get("session_id")), []).append({**b, "max_tokens": 1, "stream": False})
    return list(sessions.values())


def warmup(url: str, bodies: list[dict], clients: int, timeout: float, tally: Tally) -> dict:
    """Send the warm-up (``warmup_sessions``) from ``clients`` threads, each its share of the sessions; a
    request that is not answered 200 is lost (``tally.lost``, "warm-up: ...")."""
    import httpx

    sessions = warmup_sessions(bodies)
    clients = max(1, min(clients, len(sessions)))
    sent = [0] * clients

    def one_client(c: int) -> None:
        with httpx.Client(timeout=timeout) as client:
            for session in sessions[c::clients]:
                for body in session:
                    sent[c] += 1
                    try:
                        r = client.post(url + "/v1/completions", json=body)
                        got: int | str = r.status_code
                    except httpx.HTTPError as e:
                        got = type(e).__name__
                    tally.status(got)
                    if got != 200:
                        with tally.lock:
                            tally.lost.append(f"warm-up: status {got}")

    t = time.perf_counter()
    threads = [threading.Thread(target=one_client, args=(c,)) for c in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    took = time.perf_counter() - t
    g = gauges(httpx.get(url + "/metrics", timeout=30).text)
    return {
        "requests": sum(sent),
        "seconds": round(took, 1),
        "prefix_store_bytes": g.get("ccft_prefix_store_bytes"),
        "prefix_arena_bytes": g.get("ccft_prefix_arena_bytes"),
    }


# ------------------------------------------------------------------ the run


def _p95(values: list[float]) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=20, method="inclusive")[18]


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def windows(tally: Tally, duration: float, window: float) -> dict:
    """First (the second window: the first is warm-up) and last window figures, and one row per window."""
    window = min(window, duration / 3)
    first, last = (window, 2 * window), (duration - window, duration)

    def figures(lo: float, hi: float) -> dict:
        per_token = [s for t, s in tally.completed if lo <= t < hi]
        return {
            "from_s": round(lo, 1),
            "to_s": round(hi, 1),
            "completed": len(per_token),
            "p95_s_per_token": _p95(per_token),
            "rss_bytes": _mean([r["rss_bytes"] for r in tally.samples if lo <= r["t_s"] < hi]),
            # RSS less the K/V the server holds by design (prefix store blocks + prefix arena capacity)
            "rss_less_kv_bytes": _mean(
                [
                    r["rss_bytes"] - (r.get("prefix_store_bytes") or 0) - (r.get("prefix_arena_bytes") or 0)
                    for r in tally.samples
                    if lo <= r["t_s"] < hi and r["rss_bytes"] is not None
                ]
            ),
            "live_kv_bytes_max": max(
                (r.get("live_kv_bytes") or 0 for r in tally.samples if lo <= r["t_s"] < hi), default=None
            ),
            "prefix_store_bytes": _mean(
                [r.get("prefix_store_bytes") for r in tally.samples if lo <= r["t_s"] < hi]
            ),
            "prefix_arena_bytes": _mean(
                [r.get("prefix_arena_bytes") for r in tally.samples if lo <= r["t_s"] < hi]
            ),
        }

    rows = [figures(lo, min(lo + window, duration)) for lo in _frange(0.0, duration, window)]
    return {"window_s": window, "first": figures(*first), "last": figures(*last), "per_window": rows}


def _frange(lo: float, hi: float, step: float):
    while lo < hi - 1e-9:
        yield lo
        lo += step


def run(args) -> dict:
    """Run the soak (see the module docstring); the result dict (``report`` prints and writes it).

    Raises:
        ConfigError: a bad ``--decoder`` spec, or a server that does not start.
    """
    import httpx

    from ccft.core.errors import ConfigError
    from ccft.core.models import describe_model, resolve_model_path
    from ccft.core.tokens import tokenize_prompt
    from ccft.serving import workloads
    from ccft.serving.malloc import check_malloc_policy

    check_malloc_policy(args.malloc)  # before the server starts

    given = {}
    for spec in args.decoder:
        name, sep, path = spec.partition("=")
        if not sep or name not in AGENTS:
            raise ConfigError(f"--decoder {spec!r}: use NAME=PATH with NAME one of {', '.join(AGENTS)}")
        given[name] = path
    arena_value = str(args.max_prefix_tokens).strip()
    if arena_value != "budget" and not arena_value.isdigit():  # before the decoders and references are made
        raise ConfigError(
            f"--max-prefix-tokens {args.max_prefix_tokens!r}: use 'budget', a number of token slots N, or 0"
        )
    reload_on = not args.no_reload
    with tempfile.TemporaryDirectory(prefix="ccft-soak-") as tmp:
        served, folders = make_decoders(args.model, Path(tmp), given, args.reload_with, args.seed)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(resolve_model_path(args.model)))
        prompts = [tokenize_prompt(tok, t, chat_template=False) for t in PROBES]
        refs = {}
        if reload_on:
            refs = {v: cold_start_tokens(args.model, folders[v], prompts) for v in ("a", "b")}
        trace = workloads.generate(
            "react",
            sessions=args.sessions,
            turns=args.turns,
            agents=list(AGENTS),
            shared_tokens=args.shared_tokens,
            unique_tokens=args.unique_tokens,
            growth_tokens=args.growth_tokens,
            max_new_tokens=args.max_new_tokens,
            rate=None,
            seed=args.seed,
            tokenizer=tok,
        )
        bodies = [
            {
                "model": r.agent,
                "prompt": list(r.prompt_ids),
                "max_tokens": r.max_new_tokens,
                "shared_prefix_tokens": r.shared_len,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
                "session_id": str(r.session),
            }
            for r in trace.requests
        ]
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        max_body_mb = 1.0
        cmd = [
            sys.executable,
            "-m",
            "ccft.cli.main",
            "serve",
            "--model",
            str(args.model),
            "--port",
            str(port),
            "--kv-budget-mb",
            str(args.kv_budget_mb),
            "--max-prefix-tokens",
            str(args.max_prefix_tokens),
            "--max-body-mb",
            str(max_body_mb),
            "--log-level",
            "warning",
            *(["--threads", str(args.threads)] if args.threads else []),
            *[a for n, p in served.items() for a in ("--decoder", f"{n}={p}")],
            *(["--allow-reload"] if reload_on else []),
            "--malloc",
            args.malloc,
        ]
        with serve(cmd, url) as proc:
            card = httpx.get(url + f"/v1/models/{RELOADED}", timeout=30).json()
            max_model_len = int(card.get("max_model_len") or 2048)
            arena_start = gauges(httpx.get(url + "/metrics", timeout=30).text).get("ccft_prefix_arena_bytes")
            tally = Tally(t0=time.perf_counter())
            warm = None
            if not args.no_warmup:
                warm = warmup(url, bodies, args.clients, args.timeout_s, tally)
                tally.t0 = time.perf_counter()  # the load's clock starts after the warm-up
            stop, stop_sampler = threading.Event(), threading.Event()
            threads = [
                threading.Thread(
                    target=client_loop,
                    args=(url, bodies, c * len(bodies) // max(1, args.clients), stop, args, tally),
                )
                for c in range(args.clients)
            ]
            cases = hostile_bodies(int(max_body_mb * 2**20), max_model_len)
            threads.append(
                threading.Thread(
                    target=hostile_loop, args=(url, cases, stop, args.hostile_every_s, args.timeout_s, tally)
                )
            )
            if reload_on:
                threads.append(
                    threading.Thread(
                        target=reload_loop,
                        args=(url, folders, refs, prompts, stop, args.reload_every_s, args.timeout_s, tally),
                    )
                )
            sampler = threading.Thread(
                target=sampler_loop, args=(url, proc.pid, stop_sampler, args.sample_s, tally)
            )
            sampler.start()
            for t in threads:
                t.start()
            time.sleep(args.duration_s)
            stop.set()
            for t in threads:
                t.join()
            load_s = time.perf_counter() - tally.t0
            idle = wait_idle(url, timeout=120)
            stop_sampler.set()
            sampler.join()
            final = gauges(httpx.get(url + "/metrics", timeout=30).text)
    described = {  # given folders as given; the random ones lived in a temporary folder, gone now
        name: given.get(name, f"random LoRA r=8 (seed {args.seed})") for name in served
    }
    arena = {"start_bytes": arena_start, "end_bytes": final.get("ccft_prefix_arena_bytes")}
    return summarize(
        args, tally, load_s, idle, final, refs, describe_model(args.model), described, arena=arena, warm=warm
    )


def summarize(
    args,
    tally: Tally,
    load_s: float,
    idle: dict,
    final: dict,
    refs: dict,
    model,
    served,
    *,
    arena: dict | None = None,
    warm: dict | None = None,
) -> dict:
    """The result dict: counts, windows, invariants and goals (``arena``: the prefix arena's bytes at the
    server's start and at the end; ``warm``: the warm-up's figures, None without one)."""
    arena = dict(arena or {})
    if arena.get("start_bytes") is not None and arena.get("end_bytes") is not None:
        arena["grew"] = arena["end_bytes"] > arena["start_bytes"]
    w = windows(tally, min(float(args.duration_s), load_s), float(args.window_s))
    fivexx = sum(n for code, n in tally.statuses.items() if code.isdigit() and int(code) >= 500)
    first, last = w["first"], w["last"]
    rss_pct = None
    if first["rss_bytes"] and last["rss_bytes"]:
        rss_pct = 100.0 * (last["rss_bytes"] - first["rss_bytes"]) / first["rss_bytes"]
    rss_less_kv_pct = None
    if first["rss_less_kv_bytes"] and last["rss_less_kv_bytes"]:
        rss_less_kv_pct = (
            100.0 * (last["rss_less_kv_bytes"] - first["rss_less_kv_bytes"]) / first["rss_less_kv_bytes"]
        )
    p95_ratio = None
    if first["p95_s_per_token"] and last["p95_s_per_token"]:
        p95_ratio = last["p95_s_per_token"] / first["p95_s_per_token"]
    hostile_bad = [h for h in tally.hostile if h["status"] != h["expected"]]
    reload_bad = [r for r in tally.reloads if r["status"] != r["expected"] or not r["probes_equal"]]
    live_end = idle.get("live_kv_bytes")
    invariants = {
        "lost_is_0": not tally.lost,
        "status_5xx_is_0": fivexx == 0,
        "hostile_answered_as_expected": not hostile_bad,
        "live_kv_0_at_end": live_end == 0,
        "reload_probes_equal_cold_start": not reload_bad,
    }
    return {
        "benchmark": "soak",
        "model": model,
        "decoders": served,
        "reloaded": RELOADED if refs else None,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "settings": {
            k: getattr(args, k)
            for k in (
                "duration_s",
                "window_s",
                "clients",
                "abandon_fraction",
                "hostile_every_s",
                "reload_every_s",
                "no_reload",
                "sample_s",
                "sessions",
                "turns",
                "shared_tokens",
                "unique_tokens",
                "growth_tokens",
                "max_new_tokens",
                "kv_budget_mb",
                "max_prefix_tokens",
                "no_warmup",
                "threads",
                "malloc",
                "seed",
            )
        },
        "load_s": round(load_s, 1),
        "requests": {
            "completed": len(tally.completed),
            "abandoned": tally.abandoned,
            "lost": len(tally.lost),
        },
        "lost_examples": tally.lost[:10],
        "statuses": dict(sorted(tally.statuses.items())),
        "status_5xx": fivexx,
        "hostile": {
            "sent": len(tally.hostile),
            "by_kind": {
                kind: sorted({str(h["status"]) for h in tally.hostile if h["kind"] == kind})
                for kind in sorted({h["kind"] for h in tally.hostile})
            },
            "unexpected": hostile_bad[:10],
        },
        "reloads": tally.reloads,
        "reload_changes_outputs": (refs["a"] != refs["b"]) if refs else None,
        "live_kv_bytes_at_end": live_end,
        "warmup": warm,
        "prefix_arena": {"max_prefix_tokens": args.max_prefix_tokens, **arena},
        "idle_health": idle,
        "final_metrics": {
            k.removeprefix("ccft_"): final.get(k)
            for k in (
                "ccft_prefix_store_bytes",
                "ccft_prefix_arena_bytes",
                "ccft_scheduler_cancelled_total",
                "ccft_scheduler_done_total",
                "ccft_scheduler_reloads_total",
                "ccft_scheduler_arena_waits_total",
            )
        },
        "windows": w,
        "rss_first_bytes": first["rss_bytes"],
        "rss_last_bytes": last["rss_bytes"],
        "rss_growth_pct": rss_pct,
        "rss_less_kv_growth_pct": rss_less_kv_pct,
        "p95_s_per_token_first": first["p95_s_per_token"],
        "p95_s_per_token_last": last["p95_s_per_token"],
        "p95_last_over_first": p95_ratio,
        "samples": tally.samples,
        "invariants": invariants,
        "ok": all(invariants.values()),
        "goals": {
            f"rss_growth_le_{RSS_GOAL_PCT:g}pct": rss_pct is not None and rss_pct <= RSS_GOAL_PCT,
            f"p95_ratio_le_{P95_GOAL_RATIO:g}": p95_ratio is not None and p95_ratio <= P95_GOAL_RATIO,
        },
    }


def _mb(b) -> str:
    return "n/a" if b is None else f"{b / 2**20:.1f} MiB"


def _arena_line(result: dict) -> str:
    a = result.get("prefix_arena") or {}
    grew = {True: "grew", False: "did not grow", None: "n/a"}[a.get("grew")]
    return (
        f"prefix arena (--max-prefix-tokens {a.get('max_prefix_tokens')}): {_mb(a.get('start_bytes'))} at "
        f"start -> {_mb(a.get('end_bytes'))} at end ({grew})"
    )


def _warmup_line(w: dict | None) -> str:
    if not w:
        return "warm-up: none (--no-warmup)"
    return (
        f"warm-up: {w['requests']} requests (one per shared context) in {w['seconds']:.0f} s; prefix store "
        f"{_mb(w['prefix_store_bytes'])} after it"
    )


def table(result: dict) -> str:
    """The human summary of a result."""
    q = result["requests"]
    probes = [r["probes_equal"] for r in result["reloads"]]
    lines = [
        f"soak: {result['load_s']:.0f} s of load on {result['model']}",
        f"requests: {q['completed']} completed, {q['abandoned']} abandoned, {q['lost']} lost",
        f"status 5xx: {result['status_5xx']}; statuses {result['statuses']}",
        f"hostile: {result['hostile']['sent']} sent, {len(result['hostile']['unexpected'])} unexpected "
        f"({result['hostile']['by_kind']})",
        f"RSS: {_mb(result['rss_first_bytes'])} -> {_mb(result['rss_last_bytes'])} "
        + ("" if result["rss_growth_pct"] is None else f"({result['rss_growth_pct']:+.1f}%)")
        + (
            ""
            if result.get("rss_less_kv_growth_pct") is None
            else f"; less prefix store and arena {result['rss_less_kv_growth_pct']:+.1f}%"
        ),
        f"live KV at end: {result['live_kv_bytes_at_end']} bytes",
        _arena_line(result),
        _warmup_line(result.get("warmup")),
        "p95 s/token first -> last: "
        + (
            "n/a"
            if result["p95_last_over_first"] is None
            else f"{result['p95_s_per_token_first']:.4f} -> {result['p95_s_per_token_last']:.4f} "
            f"({result['p95_last_over_first']:.2f}x)"
        ),
        f"reloads: {len(probes)}, probes equal cold start: {sum(probes)}/{len(probes)}"
        + (" (no reload: the run was shorter than --reload-every-s)" if not probes else ""),
        f"windows: {result['windows']['window_s']:.0f} s each (a run shorter than 3 x --window-s uses a "
        "third of it; goals from short windows are indicative only)",
        "invariants: "
        + ", ".join(f"{k} {'ok' if v else 'VIOLATED'}" for k, v in result["invariants"].items()),
        "goals: " + ", ".join(f"{k} {'met' if v else 'not met'}" for k, v in result["goals"].items()),
    ]
    return "\n".join(lines)


def report(result: dict, out: str | None) -> int:
    """Print the summary, write the JSON (atomically) to ``out``; 0 when every invariant holds, else 1."""
    print(table(result))
    if out:
        from ccft.core.io import atomic_write_json

        atomic_write_json(out, result, default=str)
        print(f"wrote {out}", file=sys.stderr)
    return 0 if result["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ccft.bench.soak", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    from ccft.bench.provenance import recorded

    return report(recorded(run, args), args.out)


if __name__ == "__main__":
    sys.exit(main())
