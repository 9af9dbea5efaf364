"""Training benchmark: ccft Full-FT, ccft CCFT (each path) and TRL ``SFTTrainer`` on the same rows.

    ccft bench train --out train.json        # or: python -m ccft.bench.train --out train.json

Cases: decoder kind (full weights, LoRA) × prompt:response ratio (1:1, 4:1). Every method of a case
trains on the SAME token ids (real GSM8K text cut to exactly P prompt and R response tokens, EOS
last), batch size, optimizer (AdamW), learning rate, dtype (fp32) and thread count, each in a fresh
process (``--in-process`` for quick checks), so peak memory is per method:

* ``ccft-full-ft``  ccft ``method=full-ft``: the decoder prefills its own prompt (one forward);
* ``ccft-two-pass`` ccft ``method=ccft``, no-grad base prefill, then the decoder on the tail;
* ``ccft-one-pass`` ccft ``method=ccft``, LoRA only: one forward, LoRA gated off on the prompt;
* ``trl-sft``       TRL ``SFTTrainer``, pre-tokenised prompt/completion rows, ``completion_only_loss=True``.

With ``--repeats N`` every method runs in N fresh processes (methods interleaved) and each number is the
median over them (every run's value under ``all``).

Reported per method: median wall and CPU seconds per optimizer step (after warm-up steps) and of its
optimizer update alone, tokens per CPU second (B·(P+R) per step), peak RSS (``getrusage`` of the worker
process, and the sampled peak during training), and peak RSS growth during training over the RSS after
setup. Ratios use process CPU seconds by default (``--clock cpu``; workers run with OMP_WAIT_POLICY=PASSIVE
so idle threads do not spin): on a shared machine wall time measures the neighbours, CPU time the
work. Ratios: CCFT speedup over ccft Full-FT against (a) the plain FLOP-count speedup
(``theory_speedup``: full weights (6P+6R)/(2P+6R), LoRA (4P+4R)/(2P+4R)) and (b) the reachable speedup
(``reachable_speedup``, docs/training.md §6: the LM head counted on the response for both methods, the
optimizer update a common per-step cost), and ccft Full-FT speed ÷ TRL's. The JSON's top level has
``fraction_of_theory`` and ``fraction_of_reachable`` (the lowest over the cases, for the default CCFT
path), ``fullft_vs_trl`` (the lowest over the cases), ``peak_rss_mb`` (per case and method) and
``fullft_peak_vs_trl`` (the highest over the cases of ccft Full-FT's peak ÷ TRL's), and the same for the
sampled peak of anonymous memory (``peak_anon_mb``, ``fullft_anon_peak_vs_trl``: without the file-backed pages
of memory-mapped weights that were only read, such as a frozen base's). Both trainers run in fp32 without
mixed precision and with the same activation checkpointing (``--activation-checkpointing``; off by default in
both), stated per run (TRL's own defaults are bf16 autocast and checkpointing on). ``--store`` adds the
C_base store's break-even: prefill vs read time per prefix token and the epochs after which precomputing pays.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

METHODS = ("ccft-full-ft", "ccft-two-pass", "ccft-one-pass", "trl-sft")


# ------------------------------------------------------------------ theory


def theory_speedup(kind: str, p: int, r: int) -> float:
    """FLOP-count speedup of CCFT over Full-FT: prompt tokens cost a no-grad forward (2) instead of a
    forward + backward (6 with weight gradients, 4 with LoRA's activation-only backward)."""
    if kind == "full":
        return (6 * p + 6 * r) / (2 * p + 6 * r)
    return (4 * p + 4 * r) / (2 * p + 4 * r)


def step_flops(kind: str, path: str, p: int, r: int, body: int, head: int, head_trains: bool) -> float:
    """Matrix FLOPs per row and optimizer step (docs/training.md §6): ``body`` parameters (all but the
    embedding and the LM head) cost 2 per token forward, 2 more for activation gradients and, when they
    train (full weights), 2 for weight gradients; the LM head (``head`` = vocab × hidden parameters) runs
    on the R response tokens only, in both methods: 2 forward + 2 activation gradient (+ 2 when it trains).
    ``path``: ``self-prefill`` / ``one-pass`` (the body's forward and backward over P + R tokens) or
    ``two-pass`` (a no-grad forward over the P prompt tokens, forward and backward over R).
    Attention's sequence-quadratic terms and the embedding lookup are left out."""
    train = 6 if kind == "full" else 4
    lm = (6 if head_trains else 4) * head * r
    if path == "two-pass":
        return 2 * body * p + train * body * r + lm
    return train * body * (p + r) + lm


def reachable_speedup(full_s: float, full_opt_s: float, ccft_opt_s: float, flop_ratio: float) -> float:
    """CCFT's reachable speedup over Full-FT: Full-FT's step time ``full_s`` minus its optimizer update
    ``full_opt_s`` scaled by ``flop_ratio`` (CCFT ÷ Full-FT ``step_flops``: the matrix work at Full-FT's FLOP
    rate), plus CCFT's own optimizer update ``ccft_opt_s`` (a per-step cost the prompt does not change)."""
    return full_s / ((full_s - full_opt_s) * flop_ratio + ccft_opt_s)


# ------------------------------------------------------------------ rows


def build_rows(tokenizer, n: int, p: int, r: int) -> list[tuple[list[int], list[int]]]:
    """n rows of exactly p prompt ids and r response ids (the last is EOS) from the bundled GSM8K train
    set."""
    from ccft.train.config import BUILTIN_DATASETS

    lines = Path(BUILTIN_DATASETS["gsm8k"]["train"]).read_text().splitlines()
    recs = [json.loads(line) for line in lines if line.strip()]
    rows, i = [], 0
    while len(rows) < n:
        q, a = [], []
        while len(q) < p:
            q += tokenizer(recs[i % len(recs)]["question"] + "\n", add_special_tokens=False)["input_ids"]
            i += 1
        while len(a) < r - 1:
            a += tokenizer(recs[i % len(recs)]["answer"] + "\n", add_special_tokens=False)["input_ids"]
            i += 1
        rows.append((q[:p], a[: r - 1] + [tokenizer.eos_token_id]))
    return rows


# ------------------------------------------------------------------ measurement helpers


class RSSPeak:
    """Samples this process's resident set size every few ms; ``peak`` in bytes, and ``peak_anon``: the peak
    of its anonymous part (``RssAnon`` in ``/proc/self/status``: tensors, optimizer state, the Python heap),
    which leaves out file-backed pages such as weights memory-mapped from a safetensors file that were read
    but never written (clean pages the kernel can drop and read again). ``peak_anon`` is 0 where the kernel
    does not report it."""

    def __init__(self, interval: float = 0.02):
        self.interval, self.peak, self.peak_anon, self._stop = interval, 0, 0, threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    @staticmethod
    def rss_anon() -> int:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        return int(line.split()[1]) * 1024  # kB
        except OSError:
            pass
        return 0

    def _sample(self):
        self.peak = max(self.peak, self.rss())
        self.peak_anon = max(self.peak_anon, self.rss_anon())

    def _run(self):
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval)

    def __enter__(self):
        self.peak, self.peak_anon = self.rss(), self.rss_anon()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self._sample()


def _step_timer():
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall and CPU seconds of each optimizer step, and of its optimizer update (``optimizer.step``)."""

        def __init__(self):
            self.times, self.cpu, self.opt, self.opt_cpu, self._t, self._o = [], [], [], [], None, None

        def on_step_begin(self, args, state, control, **kw):
            self._t = (time.perf_counter(), time.process_time())

        def on_pre_optimizer_step(self, args, state, control, **kw):
            self._o = (time.perf_counter(), time.process_time())

        def on_optimizer_step(self, args, state, control, **kw):
            self.opt.append(time.perf_counter() - self._o[0])
            self.opt_cpu.append(time.process_time() - self._o[1])

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self._t[0])
            self.cpu.append(time.process_time() - self._t[1])

    return StepTimer()


def parameter_split(model) -> dict:
    """``body`` (parameters outside the input embedding and LM head), ``head`` (LM head weight elements)
    and whether the LM head's weight trains; ``model`` may be a ``PeftModel``."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    emb, head = inner.get_input_embeddings().weight, inner.get_output_embeddings().weight
    body = sum(p.numel() for p in inner.parameters() if p is not emb and p is not head)
    body -= sum(p.numel() for n, p in inner.named_parameters() if "lora_" in n)  # adapters: negligible FLOPs
    return {"params_body": body, "params_head": head.numel(), "head_trains": bool(head.requires_grad)}


def _lora_kwargs(spec: dict) -> dict:
    return {
        "r": spec["lora_r"],
        "lora_alpha": 2 * spec["lora_r"],
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    }


def _train_args(spec: dict, out: str) -> dict:
    return dict(
        output_dir=out,
        per_device_train_batch_size=spec["batch"],
        max_steps=spec["warmup"] + spec["steps"],
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        logging_steps=10**6,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
        weight_decay=0.0,
        # stated for both trainers, because their defaults differ: TRL's SFTConfig turns activation
        # checkpointing and bf16 autocast on, ccft's TrainConfig (like transformers' TrainingArguments)
        # leaves both off. Left to each, a bf16 trainer that recomputes its activations would be compared
        # with an fp32 one that keeps them (the bench is fp32: "dtype" in its JSON)
        gradient_checkpointing=bool(spec.get("activation_checkpointing", False)),
        bf16=False,
        fp16=False,
    )


# ------------------------------------------------------------------ one method on one case


def run_case(spec: dict) -> dict:
    """Train ``spec["method"]`` for warmup + steps steps; returns its timings and memory."""
    import torch

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    from transformers import AutoTokenizer

    from ccft.core.models import resolve_model_path

    path = resolve_model_path(spec["model"])
    tok = AutoTokenizer.from_pretrained(path)
    n = spec["batch"] * (spec["warmup"] + spec["steps"])
    rows = build_rows(tok, n, spec["P"], spec["R"])
    meter = RSSPeak()
    timer = _step_timer()
    with tempfile.TemporaryDirectory() as out:
        if spec["method"] == "trl-sft":
            trainer = _trl_trainer(spec, path, tok, rows, out)
            extra = {"trl_version": __import__("trl").__version__, **parameter_split(trainer.model)}
        else:
            trainer, extra = _ccft_trainer(spec, rows, out)
        trainer.add_callback(timer)
        extra["activation_checkpointing"] = bool(trainer.args.gradient_checkpointing)
        extra["mixed_precision"] = "bf16" if trainer.args.bf16 else "fp16" if trainer.args.fp16 else "no"
        setup_rss, setup_anon = meter.rss(), meter.rss_anon()
        t0 = time.perf_counter()
        with meter:
            trainer.train()
        wall = time.perf_counter() - t0
    step = statistics.median(timer.times[spec["warmup"] :])
    cpu = statistics.median(timer.cpu[spec["warmup"] :])
    tokens = spec["batch"] * (spec["P"] + spec["R"])
    import resource

    rusage_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux; whole process
    return dict(
        extra,
        method=spec["method"],
        step_s=step,
        step_s_all=timer.times,
        cpu_s=cpu,
        cpu_s_all=timer.cpu,
        opt_s=statistics.median(timer.opt[spec["warmup"] :]),
        opt_cpu_s=statistics.median(timer.opt_cpu[spec["warmup"] :]),
        peak_rss_mb_rusage=rusage_mb,
        tokens_per_s=tokens / step,
        tokens_per_cpu_s=tokens / cpu,
        peak_rss_mb=meter.peak / 2**20,
        train_peak_over_setup_mb=(meter.peak - setup_rss) / 2**20,
        setup_rss_mb=setup_rss / 2**20,
        train_wall_s=wall,
        peak_anon_mb=meter.peak_anon / 2**20,
        setup_anon_mb=setup_anon / 2**20,
    )


def _ccft_trainer(spec, rows, out):
    from ccft import load_base, make_decoder
    from ccft.core.tokens import pad_token_id
    from ccft.train.config import TrainConfig
    from ccft.train.data import Collator, Example, TokenizedDataset
    from ccft.train.trainer import CacheConditionedTrainer

    method = "full-ft" if spec["method"] == "ccft-full-ft" else "ccft"
    train_path = {"ccft-two-pass": "two-pass", "ccft-one-pass": "one-pass"}.get(spec["method"], "auto")
    base = load_base(spec["model"])
    decoder = make_decoder(base, spec["kind"], lora=_lora_kwargs(spec), method=method, handoff_tokens=1)
    cfg = TrainConfig(
        method=method,
        decoder_kind=spec["kind"],
        train_path=train_path,
        base=spec["model"],
        handoff_tokens=1,
        loss_chunk_tokens=spec.get("loss_chunk_tokens", 1024),
        freeze_embeddings=spec.get("freeze_embeddings", True),
        **_train_args(spec, out),
    )
    ds = TokenizedDataset([Example(tuple(p), tuple(r), i) for i, (p, r) in enumerate(rows)])
    pad = pad_token_id(base.tokenizer)
    trainer = CacheConditionedTrainer(
        model=decoder.model, args=cfg, base=base, train_dataset=ds, data_collator=Collator(pad, 1)
    )
    return trainer, {
        "train_path": trainer.train_path,
        "loss_path": trainer.loss_path,
        **parameter_split(trainer.model),
    }


def _trl_trainer(spec, path, tok, rows, out):
    import datasets
    import torch
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if spec["kind"] == "full" and spec.get("freeze_embeddings", True):
        from ccft.train.trainer import freeze_input_embeddings

        freeze_input_embeddings(model)  # the same trainable parameters as ccft's full-weight decoder
    peft_config = None
    if spec["kind"] == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(task_type="CAUSAL_LM", **_lora_kwargs(spec))
    ds = datasets.Dataset.from_list(
        [{"input_ids": p + r, "completion_mask": [0] * len(p) + [1] * len(r)} for p, r in rows]
    )
    args = SFTConfig(
        completion_only_loss=True,
        max_length=None,
        packing=False,
        padding_free=False,
        dataset_num_proc=None,
        **_train_args(spec, out),
    )
    return SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, peft_config=peft_config)


def run_store_case(spec: dict) -> dict:
    """C_base store break-even: no-grad prefill vs store read per prefix token, and the write cost."""
    import torch

    torch.set_num_threads(spec["threads"])
    from ccft import load_base
    from ccft.core.tokens import pad_token_id
    from ccft.train.cache_store import CacheStore, bytes_per_token, precompute
    from ccft.train.data import Collator, Example

    base = load_base(spec["model"])
    rows = build_rows(base.tokenizer, spec["batch"] * spec["steps"], spec["P"], spec["R"])
    examples = [Example(tuple(p), tuple(r), i) for i, (p, r) in enumerate(rows)]
    collate = Collator(pad_token_id(base.tokenizer), 1)
    batches = [collate(examples[i : i + spec["batch"]]) for i in range(0, len(examples), spec["batch"])]
    from ccft.core.cache import prefill_tensors

    def prefill_all():
        for b in batches:
            with torch.no_grad(), base.base_weights() as m:
                prefill_tensors(
                    m,
                    b["prefix_ids"],
                    b["prefix_mask"],
                    b["tail_ids"][:, :1],
                    handoff_tokens=1,
                    fingerprint=base.fingerprint,
                )

    prefill_all()  # warm-up
    t0 = time.process_time()
    prefill_all()
    t_prefill = time.process_time() - t0
    with tempfile.TemporaryDirectory() as d:
        t0 = time.process_time()
        report = precompute(base, examples, d, handoff_tokens=1, batch_size=spec["batch"], log=lambda m: None)
        t_write = time.process_time() - t0
        store = CacheStore(d)
        t0 = time.process_time()
        for b in batches:
            assert (
                store.batch_cache(b["prefix_ids"], b["prefix_mask"], b["tail_ids"][:, :1], base=base)
                is not None
            )
        t_read = time.process_time() - t0
    tokens = sum(len(e.prompt_ids) - 1 for e in examples)
    per = {
        k: v / tokens * 1e6 for k, v in (("prefill", t_prefill), ("precompute", t_write), ("read", t_read))
    }
    # Without a store, E epochs cost E·prefill; with one, precompute (prefill + write) + E·read.
    gain = per["prefill"] - per["read"]
    breakeven = per["precompute"] / gain if gain > 0 else float("inf")
    return {
        "prefix_tokens": tokens,
        "bytes_per_token": bytes_per_token(base.config, base.dtype),
        "store_bytes": report.bytes_on_disk,
        "us_per_token": per,
        "breakeven_epochs": breakeven,
    }


# ------------------------------------------------------------------ orchestration


def _worker(spec: dict, in_process: bool) -> dict:
    if in_process:
        fn = run_store_case if spec.get("store") else run_case
        return fn(spec)
    cmd = [sys.executable, "-m", "ccft.bench.train", "--worker", json.dumps(spec)]
    # PASSIVE: idle OpenMP threads sleep instead of spinning, so CPU seconds count work, not waiting.
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(spec["threads"]),
        OMP_WAIT_POLICY="PASSIVE",
        TOKENIZERS_PARALLELISM="false",
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"benchmark worker {spec.get('method', 'store')} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def token_ratio(text: str) -> tuple[int, int]:
    """``"4:1"`` -> ``(4, 1)``: the ``--ratios`` value PROMPT:RESPONSE (two positive integers).

    Raises:
        argparse.ArgumentTypeError: anything else (argparse turns it into a usage error naming ``--ratios``).
    """
    parts = text.split(":")
    try:
        a, b = (int(x) for x in parts)
    except ValueError:
        a = b = 0
    if len(parts) != 2 or a <= 0 or b <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not PROMPT:RESPONSE with two positive integers (e.g. 4:1)"
        )
    return a, b


def median_runs(runs: list[dict]) -> dict:
    """One method's repeated worker results as one: the median of every numeric field, the first run's other
    fields, and with more than one run ``repeats`` and ``all`` (field -> every run's value, for the fields
    that vary: times and peaks). Peak RSS of one forward+backward varies by several hundred MiB between
    identical fresh processes (allocator and thread-pool timing), so a single peak per method cannot carry
    a comparison of two methods' memory."""
    if len(runs) == 1:
        return dict(runs[0])
    out = dict(runs[0])
    spread = {}
    for k, v in runs[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            vals = [r[k] for r in runs]
            out[k] = statistics.median(vals)
            if len(set(vals)) > 1:
                spread[k] = vals
    out["repeats"], out["all"] = len(runs), spread
    return out


def run(args) -> dict:
    # the CPU's vector instructions change these times (docs/study.md, "Time")
    from ccft.evals.results import hardware

    ratios = [r if isinstance(r, tuple) else token_ratio(r) for r in args.ratios]
    repeats = max(1, int(getattr(args, "repeats", 1) or 1))
    cases = []
    for kind in args.kinds:
        for a, b in ratios:
            total = args.row_tokens
            r = max(2, round(total * b / (a + b)))
            p = total - r
            methods = [m for m in METHODS if not (m == "ccft-one-pass" and kind != "lora")]
            if args.no_trl:
                methods = [m for m in methods if m != "trl-sft"]
            case = {
                "decoder": kind,
                "ratio": f"{a}:{b}",
                "prompt_tokens": p,
                "response_tokens": r,
                "runs": {},
            }
            every: dict[str, list[dict]] = {m: [] for m in methods}
            for rep in range(repeats):  # the methods interleaved, so a drift of the machine hits them alike
                for m in methods:
                    spec = {
                        "method": m,
                        "kind": kind,
                        "P": p,
                        "R": r,
                        "batch": args.batch_size,
                        "steps": args.steps,
                        "warmup": args.warmup,
                        "threads": args.threads,
                        "model": args.model,
                        "lora_r": args.lora_r,
                        "loss_chunk_tokens": args.loss_chunk_tokens,
                        "freeze_embeddings": not args.train_embeddings,
                        "activation_checkpointing": args.activation_checkpointing,
                    }
                    tag = f" #{rep + 1}" if repeats > 1 else ""
                    print(f"[bench] {kind:4s} {a}:{b} {m:14s}{tag} ...", end="", file=sys.stderr, flush=True)
                    res = _worker(spec, args.in_process)
                    print(
                        f" {res['step_s']:.3f} s/step, {res['cpu_s']:.3f} CPU s/step, "
                        f"peak {res['peak_rss_mb_rusage']:.0f} MiB",
                        file=sys.stderr,
                        flush=True,
                    )
                    every[m].append(res)
            case["runs"] = {m: median_runs(rs) for m, rs in every.items()}
            _ratios(case, args.clock)
            cases.append(case)
    out = {
        "benchmark": "train",
        "model": args.model,
        "dtype": "float32",
        "threads": args.threads,
        "clock": args.clock,
        "repeats": repeats,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "lora_r": args.lora_r,
        "row_tokens": args.row_tokens,
        "loss_chunk_tokens": args.loss_chunk_tokens,
        "freeze_embeddings": not args.train_embeddings,
        "activation_checkpointing": args.activation_checkpointing,
        "machine": {
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "hardware": hardware(),
        },
        "cases": cases,
    }
    fr = [c["fraction_of_theory"] for c in cases if c.get("fraction_of_theory") is not None]
    fre = [c["fraction_of_reachable"] for c in cases if c.get("fraction_of_reachable") is not None]
    fv = [c["fullft_vs_trl"] for c in cases if c.get("fullft_vs_trl") is not None]
    fm = [c["fullft_peak_vs_trl"] for c in cases if c.get("fullft_peak_vs_trl") is not None]
    out["fraction_of_theory"] = min(fr) if fr else None
    out["fraction_of_reachable"] = min(fre) if fre else None
    out["fullft_vs_trl"] = min(fv) if fv else None
    out["peak_rss_mb"] = {
        f"{c['decoder']} {c['ratio']}": {m: r["peak_rss_mb_rusage"] for m, r in c["runs"].items()}
        for c in cases
    }
    out["fullft_peak_vs_trl"] = max(fm) if fm else None
    fa = [c["fullft_anon_peak_vs_trl"] for c in cases if c.get("fullft_anon_peak_vs_trl") is not None]
    out["peak_anon_mb"] = {
        f"{c['decoder']} {c['ratio']}": {m: r.get("peak_anon_mb") for m, r in c["runs"].items()}
        for c in cases
    }
    out["fullft_anon_peak_vs_trl"] = max(fa) if fa else None
    lora_mem = [
        c["default_path_peak_le_other"] for c in cases if c.get("default_path_peak_le_other") is not None
    ]
    out["goals"] = {
        "fraction_of_theory>=0.9": bool(fr) and min(fr) >= 0.9,
        "fraction_of_reachable>=0.9": bool(fre) and min(fre) >= 0.9,
        "fullft_vs_trl>=1": bool(fv) and min(fv) >= 1.0,
        "fullft_peak_not_above_trl": (max(fm) <= 1.0) if fm else None,
        "lora_default_path_peak_memory_not_higher": all(lora_mem) if lora_mem else None,
    }
    if args.store:
        a, b = ratios[0]
        r = max(2, round(args.row_tokens * b / (a + b)))
        spec = {
            "store": True,
            "P": args.row_tokens - r,
            "R": r,
            "batch": args.batch_size,
            "steps": args.steps,
            "threads": args.threads,
            "model": args.model,
        }
        print("[bench] C_base store break-even ...", file=sys.stderr, flush=True)
        out["c_base_store"] = _worker(spec, args.in_process)
    return out


def _ratios(case: dict, clock: str) -> None:
    from ccft.train.fastpath import DEFAULT_LORA_PATH

    runs = case["runs"]
    key = "cpu_s" if clock == "cpu" else "step_s"
    opt_key = "opt_cpu_s" if clock == "cpu" else "opt_s"
    case["clock"] = clock
    full = runs.get("ccft-full-ft")
    p, r = case["prompt_tokens"], case["response_tokens"]
    theory = theory_speedup(case["decoder"], p, r)
    case["theory_speedup"] = theory
    case["ccft_speedup"], case["fraction_by_path"] = {}, {}
    case["flop_speedup"], case["reachable_speedup"], case["fraction_of_reachable_by_path"] = {}, {}, {}
    for path in ("two-pass", "one-pass"):
        run_ = runs.get(f"ccft-{path}")
        if full and run_:
            s = full[key] / run_[key]
            case["ccft_speedup"][path] = s
            case["fraction_by_path"][path] = s / theory
            split = (full["params_body"], full["params_head"], full["head_trains"])
            flop_ratio = step_flops(case["decoder"], path, p, r, *split) / step_flops(
                case["decoder"], "self-prefill", p, r, *split
            )
            case["flop_speedup"][path] = 1 / flop_ratio
            reach = reachable_speedup(full[key], full[opt_key], run_[opt_key], flop_ratio)
            case["reachable_speedup"][path] = reach
            case["fraction_of_reachable_by_path"][path] = s / reach
    default = DEFAULT_LORA_PATH if case["decoder"] == "lora" else "two-pass"
    case["default_path"] = default
    case["fraction_of_theory"] = case["fraction_by_path"].get(default)
    case["fraction_of_reachable"] = case["fraction_of_reachable_by_path"].get(default)
    if full and runs.get("trl-sft"):
        case["fullft_vs_trl"] = runs["trl-sft"][key] / full[key]
        case["fullft_peak_vs_trl"] = full["peak_rss_mb_rusage"] / runs["trl-sft"]["peak_rss_mb_rusage"]
        if full.get("peak_anon_mb") and runs["trl-sft"].get("peak_anon_mb"):
            case["fullft_anon_peak_vs_trl"] = full["peak_anon_mb"] / runs["trl-sft"]["peak_anon_mb"]
    if "ccft-one-pass" in runs and "ccft-two-pass" in runs:
        other = "one-pass" if default == "two-pass" else "two-pass"
        case["peak_rss_mb_by_path"] = {p: runs[f"ccft-{p}"]["peak_rss_mb"] for p in ("two-pass", "one-pass")}
        case["default_path_peak_le_other"] = (
            runs[f"ccft-{default}"]["peak_rss_mb"] <= runs[f"ccft-{other}"]["peak_rss_mb"]
        )


def table(result: dict) -> str:
    key = "cpu_s" if result.get("clock") == "cpu" else "step_s"
    lines = [
        "| decoder | P:R (tokens) | method | wall s/step | CPU s/step | optimizer CPU s | tokens/CPU-s | "
        "peak RSS MiB | peak anon MiB | train growth MiB | speed vs Full-FT |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in result["cases"]:
        full = c["runs"].get("ccft-full-ft")
        for m, r in c["runs"].items():
            rel = f"{full[key] / r[key]:.2f}×" if full else ""
            lines.append(
                f"| {c['decoder']} | {c['ratio']} ({c['prompt_tokens']}+{c['response_tokens']}) | {m} | "
                f"{r['step_s']:.3f} | {r['cpu_s']:.3f} | {r['opt_cpu_s']:.3f} | {r['tokens_per_cpu_s']:.1f} "
                f"| {r['peak_rss_mb_rusage']:.0f} | {r.get('peak_anon_mb') or 0:.0f} | "
                f"{r['train_peak_over_setup_mb']:.0f} | {rel} |"
            )
    lines.append("")
    lines.append(
        "| decoder | P:R | theory | reachable (default) | CCFT two-pass | CCFT one-pass | fraction of theory "
        "| fraction of reachable | Full-FT ÷ TRL (speed) | Full-FT ÷ TRL (peak) | Full-FT ÷ TRL (anon peak) |"
    )
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    fmt = lambda v, unit="": f"{v:.2f}{unit}" if v is not None else "—"  # noqa: E731
    for c in result["cases"]:
        sp = c["ccft_speedup"]
        lines.append(
            f"| {c['decoder']} | {c['ratio']} | {c['theory_speedup']:.2f}× | "
            f"{fmt(c['reachable_speedup'].get(c['default_path']), '×')} | {fmt(sp.get('two-pass'), '×')} | "
            f"{fmt(sp.get('one-pass'), '×')} | {fmt(c.get('fraction_of_theory'))} | "
            f"{fmt(c.get('fraction_of_reachable'))} | {fmt(c.get('fullft_vs_trl'))} | "
            f"{fmt(c.get('fullft_peak_vs_trl'))} | {fmt(c.get('fullft_anon_peak_vs_trl'))} |"
        )
    lines.append("")
    lines.append(
        f"fraction_of_theory = {result['fraction_of_theory']}, fraction_of_reachable = "
        f"{result['fraction_of_reachable']}, fullft_vs_trl = {result['fullft_vs_trl']}, fullft_peak_vs_trl = "
        f"{result['fullft_peak_vs_trl']}, fullft_anon_peak_vs_trl = {result.get('fullft_anon_peak_vs_trl')}, "
        f"goals = {result['goals']}"
    )
    if "c_base_store" in result:
        s = result["c_base_store"]
        us = s["us_per_token"]
        lines.append(
            f"C_base store: {s['bytes_per_token']} B/prefix token; prefill {us['prefill']:.0f} µs/token, "
            f"precompute {us['precompute']:.0f} µs/token, read {us['read']:.1f} µs/token -> "
            f"break-even after {s['breakeven_epochs']:.2f} epochs"
        )
    return "\n".join(lines)


def report(result: dict, out: str | None) -> int:
    print(table(result))
    if out:
        from ccft.core.io import atomic_write_json

        atomic_write_json(out, result)
        print(f"[bench] wrote {out}", file=sys.stderr)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``ccft bench train`` / ``python -m ccft.bench.train`` (no heavy imports)."""
    p.add_argument("--model", default="smollm2-135m-instruct", help="embedded model name or HF folder")
    p.add_argument("--kinds", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    p.add_argument(
        "--ratios",
        nargs="+",
        type=token_ratio,
        default=[(1, 1), (4, 1)],
        help="prompt:response token ratios, e.g. 1:1 4:1",
    )
    p.add_argument("--row-tokens", type=int, default=160, help="prompt + response tokens per row")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="timed optimizer steps (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="fresh worker processes per method (interleaved); times and peaks are their medians",
    )
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument(
        "--loss-chunk-tokens",
        type=int,
        default=1024,
        help="ccft's loss_chunk_tokens (supervised tokens per LM-head + CE chunk); 0: full logits",
    )
    p.add_argument(
        "--train-embeddings",
        action="store_true",
        help="full weights: train the (tied) embedding too, in ccft and TRL (default: frozen in both)",
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute activations in the backward, in ccft and TRL alike (default: off in both; TRL's "
        "own default is on)",
    )
    p.add_argument("--no-trl", action="store_true", help="skip the TRL SFTTrainer peer")
    p.add_argument("--store", action="store_true", help="also measure the C_base store break-even")
    p.add_argument(
        "--in-process", action="store_true", help="run every method in this process (quick checks)"
    )
    p.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="time the ratios use: process CPU seconds (robust on a shared machine; default) or wall",
    )
    p.add_argument("--out", default=None, help="write the JSON here")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ccft.bench.train", description=__doc__.splitlines()[0])
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    add_arguments(p)
    args = p.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        res = run_store_case(spec) if spec.get("store") else run_case(spec)
        print(json.dumps(res))
        return 0
    from ccft.bench.provenance import recorded

    return report(recorded(run, args), args.out)


if __name__ == "__main__":
    sys.exit(main())
