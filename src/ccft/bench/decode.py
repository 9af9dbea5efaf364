"""Decode benchmark: ``SharedPrefillEngine`` against HF ``generate`` (and, with ``--llamacpp``, llama.cpp),
same model, prompts and greedy settings.

    ccft bench decode --out decode.json        # or: python -m ccft.bench.decode --out decode.json
    ccft bench decode --llamacpp --out decode.json   # + llama.cpp, built once (ccft.bench.llamacpp)

For each batch size: TTFT and decode tokens/s of both (one run, medians over ``--repeats``), their
ratio, and the roofline of the decode step on this machine, i.e. the physical limit of the step:

* bytes per step: every weight read once (an untied embedding only for the looked-up rows) plus
  every row's KV (a prefix shared by rows is counted once), at the mean context of the run;
* FLOPs per step: 2 · batch · (matmul parameters) + attention;
* measured memory bandwidth (the faster of a large reduction and a large matrix-vector product)
  and measured peak matmul throughput (:func:`peak_matmul`: a large square GEMM in the run's dtype,
  8192² on CUDA, 2048² on CPU), both measured once per run;
* roofline tokens/s = batch / max(bytes / bandwidth, FLOPs / peak) (the slower bound); the
  fraction is the engine's decode tokens/s over it (HF's is reported too), and the bandwidth
  fraction is the engine's bytes/s (bytes per step × steps/s) over the measured bandwidth;
* as a diagnostic only, the step's own matmuls timed at their real shapes (``step_matmul_s``: every
  layer's own weights with PyTorch's ``F.linear`` and the engine's packed weights; on CUDA as one
  CUDA graph), which can sit well below the peak at small batch.

With ``--llamacpp`` (CPU, float32, a model folder): the same weights as an F32 GGUF, llama.cpp's decode
and prefill tokens/s at every batch size (``llama-batched-bench``, fp32 KV; at batch 1 also
``llama-bench``, f16 KV, as users run it) with the same (mean) prompt length and new tokens, and
llama.cpp's greedy tokens on the largest batch's prompts compared with the engine's over the first
``--llamacpp-compare`` tokens (reported, not asserted: fp32 reductions differ in order). See
``ccft.bench.llamacpp``.

With ``--blocks``: a second engine whose base lane computes from the GGUF's own Q4_1 / Q8_0 blocks
(``SharedPrefillEngine(block_weights="on")``, ``ccft.inference.blocks``) runs beside the fp32 engine
(``block_weights="off"``, the ``engine`` of every row), interleaved; each row gets ``engine_blocks``
(decode tok/s, TTFT, greedy rows equal to the fp32 engine's, weight bytes read per step and their share of
the measured bandwidth) and the top level ``blocks_speedup_batch<B>`` (blocks ÷ fp32 decode tok/s),
``blocks_greedy_rows_equal_batch<B>``, ``blocks_bandwidth_fraction_batch<B>`` and ``engine_memory`` (bytes
the engines hold beside the model's own parameters, and the process's RSS growth as each engine was built).
With ``--llamacpp`` too, llama.cpp also runs the GGUF the blocks came from (the embedded model's Q4_1 file)
as it is: per row ``llamacpp_q4_1`` and the top-level ``llamacpp_q4_1_ratio_batch<B>`` (block engine ÷
llama.cpp on that file), beside ``llamacpp_ratio_batch<B>`` (fp32 engine ÷ llama.cpp on the F32 GGUF).

Every row runs exactly ``--new-tokens`` tokens on both sides (HF: ``min_new_tokens``; engine:
``ignore_eos``). ``--random-weights`` builds a random model in SmolLM2-135M's shape, so nothing is
downloaded or shipped (the GPU check uses it). The JSON's top level carries ``speedup_batch1``,
``speedup_batch16``, ``roofline_fraction_batch1`` / ``_batch16`` and ``bandwidth_fraction_batch1``
/ ``_batch16`` when those sizes ran; with ``--llamacpp`` also ``llamacpp_ratio_batch1`` / ``_batch16``
(engine decode tok/s ÷ llama.cpp decode tok/s) and the ``llamacpp`` block (version, build flags,
threads, commands, raw numbers, agreement).
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
import torch.nn.functional as F

#: SmolLM2-135M-Instruct's architecture (what ``--random-weights`` builds)
SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


class StubTokenizer:
    """Just enough of a tokenizer for random-weight runs (ids only, no text)."""

    def __init__(self, vocab: int, eos: int = 2, pad: int = 2):
        self.vocab, self.eos_token_id, self.pad_token_id, self.bos_token_id = vocab, eos, pad, 1
        self.chat_template = None
        self.special_tokens_map = {"eos_token": "<eos>"}

    def __len__(self) -> int:
        return self.vocab

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""

    def get_vocab(self) -> dict:
        return {f"<{i}>": i for i in range(self.vocab)}


def load(model: str, *, random_weights: bool, device: str, dtype: torch.dtype):
    """A ``ccft.Base`` (real embedded/folder model, or random weights in SmolLM2's shape)."""
    import ccft

    if not random_weights:
        base = ccft.load_base(model, dtype=dtype, device=device)
        from ccft.core.models import describe_model

        return base, describe_model(model)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**SMOLLM2_SHAPE)
    m = LlamaForCausalLM(cfg).to(dtype=dtype, device=device).eval()
    m.requires_grad_(False)
    base = ccft.Base(
        model=m,
        tokenizer=StubTokenizer(cfg.vocab_size),
        fingerprint="random-smollm2-shape",
        name="random",
        path="",
    )
    return base, "random weights in SmolLM2-135M's shape"


def make_prompts(base, batch: int, prompt_tokens: int | None, real: bool) -> list[list[int]]:
    """``batch`` prompts: GSM8K test questions (real tokenizer) or random ids of GSM8K-like lengths."""
    if real:
        from ccft.core.tokens import tokenize_prompt
        from ccft.train.config import RESOURCES

        path = RESOURCES / "gsm8k" / "test.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        out = []
        for r in rows[:batch]:
            ids = tokenize_prompt(base.tokenizer, r["question"])
            out.append(ids[:prompt_tokens] if prompt_tokens else ids)
        return out
    g = torch.Generator().manual_seed(batch)
    n = prompt_tokens or 120
    vocab = base.model.config.vocab_size
    return [torch.randint(3, vocab, (n - 10 + (7 * i) % 21,), generator=g).tolist() for i in range(batch)]


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class _Clock:
    """An HF streamer that records when each new token arrives (the first ``put`` is the prompt)."""

    def __init__(self):
        self.times = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@torch.no_grad()
def run_hf(base, prompts, new_tokens: int) -> dict:
    from ccft.core.tokens import left_pad

    model = base.model
    pad = base.tokenizer.pad_token_id
    ids, mask = left_pad(prompts, pad)
    ids, mask = ids.to(base.device), mask.to(base.device)
    clock = _Clock()
    _sync(base.device)
    t0 = time.perf_counter()
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=pad,
        streamer=clock,
        top_p=None,
        top_k=None,
        temperature=None,
    )
    _sync(base.device)
    t_end = time.perf_counter()
    first = clock.times[1]
    return {"ttft_s": first - t0, "decode_s": t_end - first, "tokens": out[:, ids.shape[1] :].tolist()}


@torch.no_grad()
def run_engine(engine, prompts, new_tokens: int) -> dict:
    _sync(engine.device)
    t0 = time.perf_counter()
    handle = engine.prefill(prompts)
    ids = [
        engine.add_request(handle, i, max_new_tokens=new_tokens, ignore_eos=True) for i in range(len(prompts))
    ]
    tokens = {r: [] for r in ids}
    first = None
    while engine.active:
        for o in engine.step():
            tokens[o.request_id].append(o.token_id)
        if first is None:
            first = time.perf_counter()  # step() returns host ints: already synchronised
    t_end = time.perf_counter()
    handle.release()
    return {"ttft_s": first - t0, "decode_s": t_end - first, "tokens": [tokens[r] for r in ids]}


#: op-name prefixes of each profile category (``profile_step``); the first match wins, the rest is "other ops"
PROFILE_GROUPS = (
    ("linear (oneDNN packed)", ("mkldnn::_linear_pointwise",)),
    ("linear (aten)", ("aten::addmm", "aten::mm", "aten::linear", "aten::matmul")),
    (
        "attention matmul",
        ("aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product", "aten::scaled_dot_product"),
    ),
    (
        "softmax / logsumexp / merge",
        (
            "aten::_softmax",
            "aten::softmax",
            "aten::logsumexp",
            "aten::exp",
            "aten::amax",
            "aten::max",
            "aten::sigmoid",
        ),
    ),
    (
        "KV writes / copies / indexing",
        (
            "aten::copy_",
            "aten::index",
            "aten::_index_put",
            "aten::cat",
            "aten::gather",
            "aten::embedding",
            "aten::clone",
            "aten::contiguous",
            "aten::fill_",
            "aten::zero_",
            "aten::to",
            "aten::_to_copy",
            "aten::masked_fill",
            "aten::where",
            "aten::full",
            "aten::empty",
            "aten::arange",
        ),
    ),
    (
        "views",
        (
            "aten::view",
            "aten::select",
            "aten::slice",
            "aten::as_strided",
            "aten::reshape",
            "aten::expand",
            "aten::transpose",
            "aten::unsqueeze",
            "aten::squeeze",
            "aten::permute",
            "aten::t",
            "aten::unbind",
            "aten::narrow",
            "aten::split",
            "aten::chunk",
            "aten::flatten",
            "aten::_unsafe_view",
            "aten::alias",
            "aten::detach",
            "aten::lift_fresh",
            "aten::item",
            "aten::_local_scalar_dense",
        ),
    ),
    ("sampling", ("aten::argmax", "aten::topk", "aten::sort", "aten::multinomial")),
)


def _profile_group(name: str) -> str:
    for group, prefixes in PROFILE_GROUPS:
        if any(name == p or name.startswith(p + ".") or name.startswith(p + "_") for p in prefixes):
            return group
    return "elementwise / norms / RoPE / other ops"


def profile_step(engine, prompts, steps: int = 16) -> dict:
    """Where the time of one engine decode step goes (CPU), by op category.

    Rows of ``prompts`` are decoded ``steps`` steps unprofiled (the step's wall time) and ``steps``
    steps under ``torch.profiler`` (CPU ops, self time). Each op's self time is put in a
    ``PROFILE_GROUPS`` category; ``host`` is the profiled step's wall time minus all ops' self time
    (Python, dispatch and the profiler's own cost per op). Per-step milliseconds; the profiler's
    overhead makes the profiled step longer than the plain one (both reported).
    """
    from torch.profiler import ProfilerActivity, profile

    handle = engine.prefill(prompts)
    for i in range(len(prompts)):
        engine.add_request(handle, i, max_new_tokens=3 + 2 * steps + 1, ignore_eos=True)
    try:
        for _ in range(3):
            engine.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        plain = (time.perf_counter() - t0) / steps
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            profiled = (time.perf_counter() - t0) / steps
    finally:
        engine.close()  # the benchmark's engine runs nothing else: abort these rows
        handle.release()
    groups: dict[str, float] = {}
    calls: dict[str, int] = {}
    top = []
    for ev in prof.key_averages():
        g = _profile_group(ev.key)
        groups[g] = groups.get(g, 0.0) + ev.self_cpu_time_total / 1e6 / steps
        calls[g] = calls.get(g, 0) + ev.count // steps
        top.append((ev.self_cpu_time_total / 1e6 / steps, ev.key, ev.count // steps))
    ops = sum(groups.values())
    ms = {g: 1e3 * v for g, v in sorted(groups.items(), key=lambda kv: -kv[1])}
    ms["host (outside ops)"] = 1e3 * max(0.0, profiled - ops)
    top.sort(reverse=True)
    return {
        "steps": steps,
        "batch": len(prompts),
        "step_ms": 1e3 * plain,
        "profiled_step_ms": 1e3 * profiled,
        "ms_per_step": ms,
        "ops_per_step": calls,
        "top_ops": [{"op": k, "ms_per_step": 1e3 * t, "calls_per_step": c} for t, k, c in top[:12]],
    }


def device_time_per_step(engine, prompts, steps: int = 6) -> dict:
    """GPU time of one decode step against its wall time (CUDA engines): where a step's time goes.

    ``steps`` steps of ``prompts``' rows are timed plainly (``wall_ms``, synchronised by ``step()``'s
    host tokens) and again under ``torch.profiler`` with CUDA activity; ``device_ms`` is the sum of the
    GPU kernels' and copies' durations per step (the kernels inside replayed CUDA graphs are traced one
    by one) and ``kernels`` their count per step. ``wall_ms - device_ms`` is time the GPU sat idle:
    host work (building inputs, bookkeeping, launching) that the step does not overlap. Milliseconds.
    The rows decode ``2·steps + 2`` tokens: 6 steps keep them in the tail bucket of 16 slots, so a
    compiled engine (decode="compile" / "compiled_graph") measured here compiles nothing new.
    """
    from torch.profiler import ProfilerActivity, profile

    handle = engine.prefill(prompts)
    for i in range(len(prompts)):
        engine.add_request(handle, i, max_new_tokens=2 * steps + 2, ignore_eos=True)
    for _ in range(2):  # the handoff step and a warm step are not timed
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - t0) / steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
    while engine.active:
        engine.step()
    handle.release()
    device_us, kernels = 0.0, 0
    for evt in prof.events():
        if str(getattr(evt, "device_type", "")).endswith("CUDA"):
            device_us += getattr(evt, "self_device_time_total", 0) or getattr(evt, "self_cuda_time_total", 0)
            kernels += 1
    return {
        "wall_ms": 1e3 * wall,
        "device_ms": device_us / 1e3 / steps,
        "kernels_per_step": kernels / steps,
        "steps": steps,
    }


def _timeit(fn, min_time: float = 0.3, device="cpu") -> float:
    fn()
    _sync(device)
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        _sync(device)
        dt = time.perf_counter() - t0
        if dt >= min_time and n >= 3:
            return dt / n


def memory_bandwidth(device, dtype, size_mb: int = 512) -> dict:
    """Read bandwidth in bytes/s: a large reduction and a large matrix-vector product (the faster wins)."""
    n = size_mb * 2**20 // torch.finfo(dtype).bits * 8
    cols = 576
    a = torch.randn(n // cols, cols, device=device).to(dtype)
    x = torch.randn(1, cols, device=device).to(dtype)
    nbytes = a.numel() * a.element_size()
    t_sum = _timeit(a.sum, device=device)
    t_mv = _timeit(lambda: F.linear(x, a), device=device)
    return {
        "reduction_Bps": nbytes / t_sum,
        "matvec_Bps": nbytes / t_mv,
        "bandwidth_Bps": nbytes / min(t_sum, t_mv),
    }


def peak_matmul(device, dtype, n: int | None = None) -> dict:
    """Peak matmul throughput in FLOP/s: a large square GEMM (``n`` × ``n`` by ``n`` × ``n``, default 8192
    on CUDA and 2048 on CPU) in ``dtype``, the fastest of 5 timed runs; ``{"n", "seconds",
    "flops_per_s"}``."""
    n = n or (8192 if torch.device(device).type == "cuda" else 2048)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    t = _min_time(lambda: torch.mm(a, b), device)  # the best of 5: a peak, so interference only lowers it
    return {"n": n, "seconds": t, "flops_per_s": 2 * n**3 / t}


def _min_time(fn, device, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


@torch.no_grad()
def matmul_seconds(base, engine, batch: int) -> dict:
    """Measured time of one decode step's matmuls at their real shapes (every layer's own weights, so
    nothing stays cache-resident that would not in a real step), with each kernel at hand: PyTorch's
    ``F.linear`` on the model's weights, and the engine's packed / oneDNN-prepacked weights."""
    dev = base.device
    cfg = base.model.config
    D, inter = cfg.hidden_size, cfg.intermediate_size
    x = torch.randn(batch, D, device=dev, dtype=base.dtype)
    xi = torch.randn(batch, inter, device=dev, dtype=base.dtype)
    xo = torch.randn(
        batch,
        engine.lanes["base"].weights.heads * engine.lanes["base"].weights.head_dim,
        device=dev,
        dtype=base.dtype,
    )
    lw = engine.lanes["base"].weights
    layers = base.model.model.layers

    def plain():
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            for lin in (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj):
                F.linear(x, lin.weight)
            F.linear(xo, a.o_proj.weight)
            F.linear(xi, m.down_proj.weight)
        F.linear(x, base.model.lm_head.weight)

    def engine_weights():
        for layer in lw.layers:
            p = layer.proj
            for lin in [layer.qkv] if layer.qkv is not None else [p["q_proj"], p["k_proj"], p["v_proj"]]:
                lin(x)
            for lin in [layer.gate_up] if layer.gate_up is not None else [p["gate_proj"], p["up_proj"]]:
                lin(x)
            p["o_proj"](xo)
            p["down_proj"](xi)
        lw.lm_head(x)

    if (
        torch.device(dev).type == "cuda"
    ):  # time the step's matmuls as one CUDA graph, as the engine replays them
        plain, engine_weights = _as_graph(plain), _as_graph(engine_weights)
    t_plain, t_engine = _min_time(plain, dev), _min_time(engine_weights, dev)
    return {"torch_linear_s": t_plain, "engine_kernels_s": t_engine, "best_s": min(t_plain, t_engine)}


def _as_graph(fn):
    """``fn`` captured into a CUDA graph (so kernel-launch overhead does not count as matmul time);
    ``fn`` itself if capture fails."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay
    except Exception as e:  # noqa: BLE001 - a measurement aid only
        print(f"matmul timing: CUDA graph capture failed ({e}); timing eagerly", file=sys.stderr)
        return fn


def roofline(base, engine, batch: int, prompts, new_tokens: int, bw: float, peak_flops: float) -> dict:
    """The decode step's physical limit at ``batch``: bytes / ``bw`` (bytes/s) against FLOPs /
    ``peak_flops`` (FLOP/s); see the module docstring. Also times the step's own matmuls (diagnostic)."""
    cfg = base.model.config
    L, D = cfg.num_hidden_layers, cfg.hidden_size
    H = cfg.num_attention_heads
    h = getattr(cfg, "num_key_value_heads", None) or H
    d = getattr(cfg, "head_dim", None) or D // H
    inter, V = cfg.intermediate_size, cfg.vocab_size
    elt = base.dtype.itemsize
    seen, weight_bytes = set(), 0
    for p in base.model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            weight_bytes += p.numel() * p.element_size()
    emb = base.model.get_input_embeddings().weight
    if emb.data_ptr() != base.model.get_output_embeddings().weight.data_ptr():
        weight_bytes -= emb.numel() * emb.element_size() - batch * D * elt  # only looked-up rows are read
    ctx = sum(len(p) for p in prompts) / len(prompts) + new_tokens / 2  # mean context over the decode
    kv_bytes = batch * L * 2 * h * d * elt * ctx
    bytes_step = weight_bytes + kv_bytes
    mm_params = L * (D * (H * d + 2 * h * d) + H * d * D + 3 * D * inter) + V * D
    attn_flops = batch * L * H * d * ctx * 4
    flops_step = 2 * batch * mm_params + attn_flops
    t_mem = bytes_step / bw
    t_compute = flops_step / peak_flops
    t_step = max(t_mem, t_compute)
    mm = matmul_seconds(base, engine, batch)  # diagnostic: the step's matmuls at their own shapes
    return {
        "bytes_per_step": bytes_step,
        "flops_per_step": flops_step,
        "memory_bound_s": t_mem,
        "matmul_bound_s": t_compute,
        "peak_GFLOPs_per_s": peak_flops / 1e9,
        "step_matmul_s": mm,
        "step_matmul_GFLOPs_per_s": 2 * batch * mm_params / mm["best_s"] / 1e9,
        "bound": "memory" if t_mem >= t_compute else "matmul",
        "roofline_tok_s": batch / t_step,
    }


def _loadavg() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def check_llamacpp_args(args) -> None:
    """``--llamacpp`` needs a CPU run in float32 on a model folder or embedded model (ConfigError naming the
    flag otherwise)."""
    from ccft.core.errors import ConfigError
    from ccft.core.models import EMBEDDED_MODELS

    if args.random_weights:
        raise ConfigError("--llamacpp converts the model folder to GGUF; drop --random-weights")
    if torch.device(args.device).type != "cpu":
        raise ConfigError(
            f"--llamacpp compares on the CPU (llama.cpp is built CPU-only); use --device cpu, "
            f"not {args.device!r}"
        )
    if args.dtype != "float32":
        raise ConfigError(
            f"--llamacpp runs the same weights as an F32 GGUF; use --dtype float32, not {args.dtype}"
        )
    if args.model not in EMBEDDED_MODELS and not (Path(args.model) / "config.json").is_file():
        raise ConfigError(
            f"--llamacpp converts a local HF folder to GGUF; --model {args.model!r} is neither an "
            f"embedded model ({', '.join(EMBEDDED_MODELS)}) nor a folder with config.json"
        )


def run(args) -> dict:
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    llamacpp = getattr(args, "llamacpp", False)
    build = None
    if llamacpp:  # bad flags and a missing toolchain fail before any model load or measurement
        from ccft.bench import llamacpp as lc

        check_llamacpp_args(args)
        build = lc.ensure_built(log=_log)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    from ccft.inference import SharedPrefillEngine

    base, description = load(args.model, random_weights=args.random_weights, device=args.device, dtype=dtype)
    gguf = None
    if llamacpp:
        from ccft.core.models import resolve_model_path

        gguf = lc.convert_to_gguf(build, resolve_model_path(args.model), base.fingerprint, log=_log)
    rss = [_rss_bytes()]
    engine = SharedPrefillEngine(
        base,
        max_batch=max(args.batch_sizes),
        decode=args.decode,
        max_tail_tokens=max(64, 2 * args.new_tokens),
        block_weights="off",
    )
    rss.append(_rss_bytes())
    also = getattr(args, "also_decode", None)
    also_engine = None
    if also:  # the same engine in a second decode mode, measured in the same interleaved runs
        also_engine = SharedPrefillEngine(
            base,
            max_batch=max(args.batch_sizes),
            decode=also,
            max_tail_tokens=max(64, 2 * args.new_tokens),
            block_weights="off",
            pack_weights={"auto": None, "on": True, "off": False}[getattr(args, "also_pack_weights", "auto")],
        )
    blocks_engine = None
    if getattr(args, "blocks", False):
        blocks_engine = SharedPrefillEngine(
            base,
            max_batch=max(args.batch_sizes),
            decode=args.decode,
            max_tail_tokens=max(64, 2 * args.new_tokens),
            block_weights="on",
        )
        rss.append(_rss_bytes())
    load_before = _loadavg()
    bw = memory_bandwidth(args.device, dtype)
    peak = peak_matmul(args.device, dtype)
    result = {
        "model": description,
        "device": _device_name(args.device),
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "decode_mode": engine.decode_mode,
        "also_decode_mode": also_engine.decode_mode if also_engine is not None else None,
        "pack_weights": engine.pack_weights,
        "also_pack_weights": also_engine.pack_weights if also_engine is not None else None,
        "attention": engine.attention,
        # the most rows of a step the fused CPU step runs (blocks.decode_step_layers); None: the layer loop
        "fused_step_max_rows": _fused_rows(engine),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "bandwidth_GBps": bw["bandwidth_Bps"] / 1e9,
        "bandwidth_detail_GBps": {k: v / 1e9 for k, v in bw.items()},
        "peak_matmul_GFLOPs_per_s": peak["flops_per_s"] / 1e9,
        "peak_matmul_detail": peak,
        "batches": {},
    }
    if blocks_engine is not None:
        result["block_weights"] = {
            "gguf": Path(blocks_engine.block_weights).name,
            "kernel": _kernel_isa(),
            "fused_step_max_rows": _fused_rows(blocks_engine),
        }
        result["engine_memory"] = {
            "fp32_engine_extra_bytes": engine_extra_bytes(engine),
            "blocks_engine_extra_bytes": engine_extra_bytes(blocks_engine),
            "fp32_engine_rss_growth_bytes": rss[1] - rss[0],
            "blocks_engine_rss_growth_bytes": rss[2] - rss[1],
            "model_parameter_bytes": sum(p.numel() * p.element_size() for p in base.model.parameters()),
            "fp32_linear_bytes_per_step": linear_bytes(engine, blocks=False),
            "blocks_linear_bytes_per_step": linear_bytes(blocks_engine),
        }
    prompts_of, engine_tokens, blocks_tokens = {}, {}, {}
    for batch in args.batch_sizes:
        prompts = make_prompts(base, batch, args.prompt_tokens, real=not args.random_weights)
        hf_runs, eng_runs, blk_runs = [], [], []
        run_hf(base, prompts, min(4, args.new_tokens))  # warm-up
        run_engine(engine, prompts, min(4, args.new_tokens))
        if blocks_engine is not None:
            run_engine(blocks_engine, prompts, min(4, args.new_tokens))
        also_runs = []
        if also_engine is not None:
            run_engine(also_engine, prompts, args.new_tokens)  # warm-up over every width it will use
        for _ in range(args.repeats):  # interleaved, so drift in machine load hits all alike
            hf_runs.append(run_hf(base, prompts, args.new_tokens))
            eng_runs.append(run_engine(engine, prompts, args.new_tokens))
            if also_engine is not None:
                also_runs.append(run_engine(also_engine, prompts, args.new_tokens))
            if blocks_engine is not None:
                blk_runs.append(run_engine(blocks_engine, prompts, args.new_tokens))
        steps = args.new_tokens - 1

        def summary(runs, batch=batch, steps=steps):
            ttft = statistics.median(r["ttft_s"] for r in runs)
            dec = statistics.median(r["decode_s"] for r in runs)
            return {"ttft_s": ttft, "decode_s": dec, "decode_tok_s": batch * steps / dec}

        hf, eng = summary(hf_runs), summary(eng_runs)
        prompts_of[batch], engine_tokens[batch] = prompts, eng_runs[0]["tokens"]
        agree = sum(a == b for a, b in zip(hf_runs[0]["tokens"], eng_runs[0]["tokens"], strict=True)) / batch
        roof = roofline(
            base, engine, batch, prompts, args.new_tokens, bw["bandwidth_Bps"], peak["flops_per_s"]
        )
        result["batches"][str(batch)] = {
            "prompt_tokens_mean": sum(map(len, prompts)) / batch,
            "hf": hf,
            "engine": eng,
            "speedup": eng["decode_tok_s"] / hf["decode_tok_s"],
            "ttft_ratio": hf["ttft_s"] / eng["ttft_s"],
            "roofline": roof,
            "roofline_fraction": eng["decode_tok_s"] / roof["roofline_tok_s"],
            "hf_roofline_fraction": hf["decode_tok_s"] / roof["roofline_tok_s"],
            "bandwidth_fraction": roof["bytes_per_step"] * eng["decode_tok_s"] / batch / bw["bandwidth_Bps"],
            "greedy_rows_identical": agree,
        }
        for key in ("speedup", "roofline_fraction", "bandwidth_fraction"):
            result[f"{key}_batch{batch}"] = result["batches"][str(batch)][key]
        if blocks_engine is not None:
            blk = summary(blk_runs)
            blocks_tokens[batch] = blk_runs[0]["tokens"]
            read = roof["bytes_per_step"] - linear_bytes(engine, blocks=False) + linear_bytes(blocks_engine)
            blk.update(
                speedup_vs_fp32=blk["decode_tok_s"] / eng["decode_tok_s"],
                greedy_rows_equal_fp32=sum(
                    a == b for a, b in zip(eng_runs[0]["tokens"], blk_runs[0]["tokens"], strict=True)
                )
                / batch,
                bytes_per_step=read,
                bandwidth_fraction=read * blk["decode_tok_s"] / batch / bw["bandwidth_Bps"],
            )
            result["batches"][str(batch)]["engine_blocks"] = blk
            result[f"blocks_speedup_batch{batch}"] = blk["speedup_vs_fp32"]
            result[f"blocks_greedy_rows_equal_batch{batch}"] = blk["greedy_rows_equal_fp32"]
            result[f"blocks_bandwidth_fraction_batch{batch}"] = blk["bandwidth_fraction"]
        if also_engine is not None:
            other = summary(also_runs)
            other.update(
                speedup_vs_engine=other["decode_tok_s"] / eng["decode_tok_s"],
                greedy_rows_equal_engine=sum(
                    a == b for a, b in zip(eng_runs[0]["tokens"], also_runs[0]["tokens"], strict=True)
                )
                / batch,
            )
            if args.device.startswith("cuda"):
                other["device_time"] = device_time_per_step(also_engine, prompts)
            result["batches"][str(batch)]["engine_also"] = other
            result[f"{also}_speedup_batch{batch}"] = other["speedup_vs_engine"]
        if args.device.startswith("cuda"):
            result["batches"][str(batch)]["engine"]["device_time"] = device_time_per_step(engine, prompts)
        if getattr(args, "profile", False):
            result["batches"][str(batch)]["profile"] = profile_step(engine, prompts)
    if llamacpp:
        result["llamacpp"] = run_llamacpp(build, gguf, args, prompts_of, engine_tokens, result)
        if blocks_engine is not None:
            q41 = Path(blocks_engine.block_weights)
            try:
                result["llamacpp_q4_1"] = run_llamacpp(
                    build,
                    q41,
                    args,
                    prompts_of,
                    blocks_tokens,
                    result,
                    engine_key="engine_blocks",
                    row_key="llamacpp_q4_1",
                )
            except lc.LlamaCppError as e:  # kept: the rest of the run is measured already
                _log(f"llama.cpp on {q41.name} failed; its rows are left out: {e}")
                for row in result["batches"].values():
                    row.pop("llamacpp_q4_1", None)
                for key in [k for k in result if k.startswith("llamacpp_q4_1_ratio_")]:
                    del result[key]
                error = lc.portable(str(e)).replace(f"{q41.parent}/", "")  # no machine path in a result
                result["llamacpp_q4_1_error"] = {"gguf": q41.name, "error": error}
    # 1-minute load average before and after: other processes on the machine show up as lower numbers
    result["load_average"] = {"before": load_before, "after": _loadavg(), "cpus": os.cpu_count()}
    return result


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_llamacpp(
    build,
    gguf,
    args,
    prompts_of: dict,
    engine_tokens: dict,
    result: dict,
    *,
    engine_key: str = "engine",
    row_key: str = "llamacpp",
) -> dict:
    """llama.cpp on the same GGUF weights: speed per batch size with ``llama-batched-bench`` (prompt length =
    the batch's mean, rounded; at batch 1 also ``llama-bench``) and greedy agreement with the engine on the
    largest batch's prompts. Adds ``row_key`` to each batch row of ``result`` and ``<row_key>_ratio_batch<B>``
    (the row's ``engine_key`` decode tok/s ÷ llama.cpp decode tok/s) to its top level; returns the block
    describing the run (kept under ``row_key`` at the top level)."""
    from ccft.bench import llamacpp as lc

    block = {**build.describe(), "gguf": str(gguf), "threads": args.threads, "kv_type": "f32", "batches": {}}
    for batch, prompts in prompts_of.items():
        p_len = round(sum(map(len, prompts)) / batch)
        r = lc.bench_batched(build, gguf, p_len, args.new_tokens, batch, args.threads, args.repeats, log=_log)
        r["prompt_tokens"] = p_len
        if batch == 1:  # as llama.cpp users measure it (f16 KV); beside the ratio, not in it
            r["llama_bench"] = lc.bench_llama_bench(
                build, gguf, p_len, args.new_tokens, args.threads, args.repeats, log=_log
            )
        block["batches"][str(batch)] = r
        row = result["batches"][str(batch)]
        row[row_key] = {
            "decode_tok_s": r["decode_tok_s"],
            "prefill_tok_s": r["prefill_tok_s"],
            "ratio": row[engine_key]["decode_tok_s"] / r["decode_tok_s"],
        }
        if "llama_bench" in r:
            row[row_key]["llama_bench_decode_tok_s"] = r["llama_bench"]["decode_tok_s"]
        result[f"{row_key}_ratio_batch{batch}"] = row[row_key]["ratio"]
    largest = max(prompts_of)
    n = min(args.llamacpp_compare, args.new_tokens)
    tokens = lc.greedy_tokens(build, gguf, prompts_of[largest], n, args.threads, log=_log)
    block["greedy"] = {
        "batch": largest,
        "tool": "llama-server /completion (temperature 0, top_k 1)",
        "vs_engine": lc.agreement(engine_tokens[largest], tokens, n),
        "tokens": tokens,
    }
    # no machine path in a committed result: the cache folder as $CCFT_CACHE; a GGUF outside it (the embedded
    # model's own Q4_1 file, in the installed package) by its name alone, in the commands too
    block = lc.portable(block)
    if not block["gguf"].startswith("$CCFT_CACHE"):
        block = _without_folder(block, f"{Path(gguf).absolute().parent}{os.sep}")
    return block


def _without_folder(obj, prefix: str):
    """``obj`` (str / list / dict, nested) with every occurrence of the folder ``prefix`` removed."""
    if isinstance(obj, str):
        return obj.replace(prefix, "")
    if isinstance(obj, list):
        return [_without_folder(x, prefix) for x in obj]
    if isinstance(obj, dict):
        return {k: _without_folder(v, prefix) for k, v in obj.items()}
    return obj


def _rss_bytes() -> int:
    """This process's resident set size in bytes (Linux ``/proc/self/statm``; 0 elsewhere)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _fused_rows(engine) -> int | None:
    step = engine.lanes["base"].weights.block_step
    return None if step is None else step.max_rows


def _kernel_isa() -> str:
    from ccft.inference.blocks import load_kernel

    k = load_kernel()
    return k.isa if k is not None else "none"


def _linears(engine) -> list:
    """The distinct ``weights.Linear`` objects the base lane's decode step calls (packed ones if packed)."""
    lw = engine.lanes["base"].weights
    out = []
    for layer in lw.layers:
        p = layer.proj
        out += [layer.qkv] if layer.qkv is not None else [p["q_proj"], p["k_proj"], p["v_proj"]]
        out += [layer.gate_up] if layer.gate_up is not None else [p["gate_proj"], p["up_proj"]]
        out += [p["o_proj"], p["down_proj"]]
    return [*out, lw.lm_head]


def linear_bytes(engine, *, blocks: bool = True) -> int:
    """Bytes of weights the base lane's linear layers read per decode step: the blocks of those computed
    from blocks (when ``blocks``), else their fp32 (or packed) weights."""
    total = 0
    for lin in _linears(engine):
        if blocks and lin.blocks is not None:
            total += lin.blocks.nbytes
        elif lin.weight is not None:
            total += lin.weight.numel() * lin.weight.element_size()
        else:  # a [q; k; v] kept only as blocks: its fp32 size
            total += 4 * lin.blocks.n * lin.blocks.k
    return total


def engine_extra_bytes(engine) -> int:
    """Bytes the engine's base lane holds beside the model's own parameters: oneDNN-packed / concatenated
    fp32 copies, or the blocks."""
    own = {p.data_ptr() for p in engine.base.model.parameters()}
    total = 0
    for lin in _linears(engine):
        if lin.blocks is not None:
            total += lin.blocks.nbytes
        elif lin.packed is not None:
            total += lin.packed.numel() * lin.packed.element_size()
        elif lin.weight.data_ptr() not in own:
            total += lin.weight.numel() * lin.weight.element_size()
    return total


def _device_name(device) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.processor() or platform.machine()} CPU"


def table(result: dict) -> str:
    lines = [
        f"decode benchmark: {result['model']} ({result['dtype']}) on {result['device']}, "
        f"{result['threads']} threads, engine decode={result['decode_mode']}, "
        f"{result['new_tokens']} new tokens, bandwidth {result['bandwidth_GBps']:.1f} GB/s, "
        f"peak matmul {result['peak_matmul_GFLOPs_per_s']:.0f} GFLOP/s, "
        f"load average {result['load_average']['before']} -> {result['load_average']['after']}"
    ]
    lc = "llamacpp" in result
    blk = "block_weights" in result
    q41 = "llamacpp_q4_1" in result
    cols = ["batch", "HF tok/s", "engine tok/s"]
    if blk:
        cols += ["engine blocks tok/s", "blocks / fp32", "blocks rows = fp32", "blocks / bandwidth"]
    if lc:
        cols += ["llama.cpp tok/s", "engine / llama.cpp", "llama.cpp prefill tok/s"]
    if q41:
        cols += ["llama.cpp Q4_1 tok/s", "blocks / llama.cpp Q4_1"]
    cols += [
        "speedup",
        "HF TTFT ms",
        "engine TTFT ms",
        "roofline tok/s (bound)",
        "engine / roofline",
        "HF / roofline",
        "engine / bandwidth",
    ]
    also = result.get("also_decode_mode")
    if also:
        main = result["decode_mode"]
        if result.get("also_pack_weights") != result.get("pack_weights"):  # one mode, packed against not
            packing = {True: "packed", False: "unpacked"}
            main = f"{main} {packing[result['pack_weights']]}"
            also = f"{also} {packing[result['also_pack_weights']]}"
        cols += [f"engine {also} tok/s", f"{also} / {main}", f"{also} rows = engine"]
    gpu = any("device_time" in r["engine"] for r in result["batches"].values())
    if gpu:
        cols += ["step ms (GPU busy ms)"] + ([f"{also} step ms (GPU busy ms)"] if also else [])
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for b, r in result["batches"].items():
        cells = [b, f"{r['hf']['decode_tok_s']:.1f}", f"{r['engine']['decode_tok_s']:.1f}"]
        if blk:
            e = r["engine_blocks"]
            cells += [
                f"{e['decode_tok_s']:.1f}",
                f"{e['speedup_vs_fp32']:.2f}x",
                f"{100 * e['greedy_rows_equal_fp32']:.0f}%",
                f"{100 * e['bandwidth_fraction']:.0f}%",
            ]
        if lc:
            cells += [
                f"{r['llamacpp']['decode_tok_s']:.1f}",
                f"{r['llamacpp']['ratio']:.2f}x",
                f"{r['llamacpp']['prefill_tok_s']:.1f}",
            ]
        if q41:
            cells += [f"{r['llamacpp_q4_1']['decode_tok_s']:.1f}", f"{r['llamacpp_q4_1']['ratio']:.2f}x"]
        cells += [
            f"{r['speedup']:.2f}x",
            f"{1e3 * r['hf']['ttft_s']:.0f}",
            f"{1e3 * r['engine']['ttft_s']:.0f}",
            f"{r['roofline']['roofline_tok_s']:.1f} ({r['roofline']['bound']})",
            f"{100 * r['roofline_fraction']:.0f}%",
            f"{100 * r['hf_roofline_fraction']:.0f}%",
            f"{100 * r['bandwidth_fraction']:.0f}%",
        ]
        if also:
            o = r["engine_also"]
            cells += [
                f"{o['decode_tok_s']:.1f}",
                f"{o['speedup_vs_engine']:.2f}x",
                f"{100 * o['greedy_rows_equal_engine']:.0f}%",
            ]
        if gpu:
            for e in [r["engine"]] + ([r["engine_also"]] if also else []):
                t = e.get("device_time")
                cells.append(f"{t['wall_ms']:.2f} ({t['device_ms']:.2f})" if t else "")
        lines.append("| " + " | ".join(cells) + " |")
    if lc:
        g = result["llamacpp"]["greedy"]
        a = g["vs_engine"]
        lines.append(
            f"llama.cpp {result['llamacpp']['version']} (llama-cpp-python sdist, ggml "
            f"{result['llamacpp'].get('ggml_version')}), {result['llamacpp']['threads']} threads; greedy "
            f"vs engine on batch {g['batch']}'s prompts, first {a['first_tokens']} tokens: "
            f"{100 * a['leading_share']:.0f}% leading tokens equal, {100 * a['rows_equal']:.0f}% rows equal"
        )
        if "llama_bench_decode_tok_s" in result["batches"].get("1", {}).get("llamacpp", {}):
            lines.append(
                "llama.cpp tok/s: llama-batched-bench, fp32 KV; batch 1 with llama-bench (f16 KV, its "
                "default): "
                f"{result['batches']['1']['llamacpp']['llama_bench_decode_tok_s']:.1f} tok/s"
            )
    if "llamacpp_q4_1_error" in result:
        lines.append(
            f"llama.cpp on {result['llamacpp_q4_1_error']['gguf']}: {result['llamacpp_q4_1_error']['error']}"
        )
    if q41:
        a = result["llamacpp_q4_1"]["greedy"]["vs_engine"]
        lines.append(
            f"llama.cpp on {Path(result['llamacpp_q4_1']['gguf']).name} vs the block engine, greedy on batch "
            f"{result['llamacpp_q4_1']['greedy']['batch']}'s prompts, first {a['first_tokens']} tokens: "
            f"{100 * a['leading_share']:.0f}% leading tokens equal, {100 * a['rows_equal']:.0f}% rows equal"
        )
    if blk:
        m = {k: v / 1e6 for k, v in result["engine_memory"].items()}
        w = result["block_weights"]
        lines.append(
            f"block weights from {w['gguf']} ({w['kernel']} kernel); engine memory beside the model's "
            f"{m['model_parameter_bytes']:.0f} MB of parameters: fp32 {m['fp32_engine_extra_bytes']:.0f} MB "
            f"(RSS +{m['fp32_engine_rss_growth_bytes']:.0f} MB), "
            f"blocks {m['blocks_engine_extra_bytes']:.0f} MB "
            f"(RSS +{m['blocks_engine_rss_growth_bytes']:.0f} MB); linear weights read per decode step: "
            f"fp32 {m['fp32_linear_bytes_per_step']:.0f} MB, "
            f"blocks {m['blocks_linear_bytes_per_step']:.0f} MB"
        )
    for b, r in result["batches"].items():
        if "profile" in r:
            pr = r["profile"]
            parts = ", ".join(f"{k} {v:.1f}" for k, v in pr["ms_per_step"].items())
            lines.append(
                f"profile, batch {b}: step {pr['step_ms']:.1f} ms ({pr['profiled_step_ms']:.1f} ms "
                f"profiled): {parts}"
            )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``ccft bench decode`` / ``python -m ccft.bench.decode``."""
    p.add_argument(
        "--model", default="smollm2-135m-instruct", help="embedded model name, HF folder or hub id"
    )
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="random weights in SmolLM2-135M's shape (nothing to download; GPU check)",
    )
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per row (EOS ignored)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="cut prompts to this many tokens")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per side (medians reported)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument(
        "--decode",
        default="auto",
        help="engine decode mode: auto, eager, static, cuda_graph, compile, compiled_graph",
    )
    p.add_argument(
        "--also-decode",
        default=None,
        help="also run the engine in this decode mode beside --decode's, in the same interleaved runs "
        "(e.g. --decode cuda_graph --also-decode compiled_graph: the fused step against the plain one)",
    )
    p.add_argument(
        "--also-pack-weights",
        default="auto",
        choices=["auto", "on", "off"],
        help="pack_weights of the --also-decode engine (auto: the engine's default for its device and mode; "
        "e.g. --decode compiled_graph --also-decode compiled_graph --also-pack-weights off: packing)",
    )
    p.add_argument(
        "--llamacpp",
        action="store_true",
        help="also run llama.cpp on the same weights (F32 GGUF; CPU, float32; built once if missing)",
    )
    p.add_argument(
        "--blocks",
        action="store_true",
        help="also run the engine on the GGUF's Q4_1/Q8_0 blocks (block_weights='on') beside the fp32 "
        "engine; with --llamacpp also llama.cpp on that GGUF",
    )
    p.add_argument(
        "--llamacpp-compare",
        type=int,
        default=16,
        help="greedy tokens compared between llama.cpp and the engine (first N per row)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile the engine's decode step per batch size (CPU op categories, ms per step)",
    )
    p.add_argument("--out", default=None, help="write the JSON here")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ccft.bench.decode", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    from ccft.bench.provenance import recorded

    return report(recorded(run, args), args.out)


def report(result: dict, out: str | None) -> int:
    print(table(result))
    print(
        json.dumps(
            {
                k: v
                for k, v in result.items()
                if k.startswith(
                    (
                        "speedup_",
                        "roofline_fraction_",
                        "bandwidth_fraction_",
                        "llamacpp_ratio_",
                        "llamacpp_q4_1_ratio_",
                        "blocks_",
                    )
                )
            }
        )
    )
    if out:
        from ccft.core.io import atomic_write_json

        atomic_write_json(out, result)
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
