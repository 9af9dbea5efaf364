"""Evaluation runner: any task, the four modes, the same items and decoding settings, resumable per item.

For every mode (``base``, ``full-ft``, ``naive``, ``prefillshare``) and every item of a task, the runner
computes the response NLL per token on the task's reference answer (teacher-forced; naive and
prefillshare read ``C_base`` computed by the frozen base for the very same prompt ids) and, unless
``generate=False``, one greedy generation scored by the task. Modes differ only in who prefills and
who decodes: items, prompt ids, stop strings, ``max_new_tokens`` and sampling settings are shared.

Output folder of one task (``OUT/TASK/``):

  ``meta.json``          task, model (with its quantisation / dtype), data, hardware, decoders and the
                         settings every mode ran with; a rerun with other settings is refused
  ``items.MODE.jsonl``   one JSON line per finished item (id, prompt hash, NLL, text, finish reason,
                         scores), appended and flushed after each batch
  ``summary.json``       per mode: n, mean NLL/token and each metric with 95% bootstrap CIs, the task's
                         own aggregate, paired deltas against ``full-ft`` on the same items

An interrupted run (Ctrl-C, kill, crash) resumes: items already in ``items.MODE.jsonl`` are read back
and never recomputed; a torn last line is dropped. Batch size does not enter the settings: results do
not depend on it (greedy decoding, per-row positions; tested at batch 1 vs 8).

Task interface (``ccft.evals.tasks``; duck-typed here): ``name``, ``load(limit) -> items`` (each with a
stable ``id``), ``prompt_ids(tokenizer, item)``, ``stop``, ``max_new_tokens``, ``score(item, text) ->
{metric: float}``, ``reference_text(item) -> str | None``; optional ``samples`` (n per item; n > 1
samples with ``temperature``/``top_p`` and lets the task report pass@k), ``metrics`` (primary first),
``aggregate({item_id: [score dict per sample]})``, ``check_environment(limit)`` (K8 gate, run before
any model is scored), ``describe()``, ``data``/``license``, ``default_limit``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from tqdm.auto import tqdm

from ccft.core.cache import compute_base_cache
from ccft.core.decoder import Decoder, decoder_forward, full_forward
from ccft.core.errors import ConfigError
from ccft.core.generation import check_mode, generate
from ccft.core.tokens import tokenize_response
from ccft.evals.sharing import row_nlls
from ccft.evals.stats import mean_ci, paired_bootstrap_delta
from ccft.train.data import Collator, Example

MODE_ORDER = ("base", "full-ft", "naive", "prefillshare")
REFERENCE_MODE = "full-ft"


# ------------------------------------------------------------------------------------------------ tasks


class GSM8KTask:
    """GSM8K test (bundled, MIT): zero-shot chat prompt, greedy, strict and flexible exact match.

    The runner's fallback when ``ccft.evals.tasks`` has no ``gsm8k``; same prompt and scoring as
    ``ccft eval`` has always used (``ccft.evaluate``).
    """

    name = "gsm8k"
    stop: list[str] = []
    max_new_tokens = 256
    default_limit = 50
    primary_metric = "exact_match_flexible"
    prompting = "zero-shot, the tokenizer's chat template (one user turn), no system prompt"
    data = "GSM8K test (openai/grade-school-math, MIT), bundled in ccft/resources/gsm8k"

    def load(self, limit: int | None = None) -> list[dict]:
        from ccft.train.config import BUILTIN_DATASETS
        from ccft.train.data import load_rows

        spec = BUILTIN_DATASETS["gsm8k"]
        rows = load_rows(str(spec["test"]), limit=limit)
        return [{"id": f"gsm8k/test/{i}", "question": r["question"], "answer": r["answer"]} for i, r in enumerate(rows)]

    def prompt_ids(self, tokenizer, item) -> list[int]:
        from ccft.core.tokens import tokenize_prompt

        return tokenize_prompt(tokenizer, item["question"])

    def reference_text(self, item) -> str:
        return item["answer"]

    def score(self, item, text: str) -> dict:
        from ccft.evals.extract import exact_match, extract_flexible, extract_reference, extract_strict

        ref = extract_reference(item["answer"])
        return {"exact_match_strict": exact_match(extract_strict(text), ref),
                "exact_match_flexible": exact_match(extract_flexible(text), ref)}


_FALLBACK_TASKS: dict[str, Callable[[], Any]] = {"gsm8k": GSM8KTask}


def get_task(name: str, **overrides):
    """A task by name: ``ccft.evals.tasks.get_task`` when it knows it, else the runner's built-ins (gsm8k)."""
    err: Exception | None = None
    try:
        from ccft.evals import tasks as registry
    except ImportError as e:  # pragma: no cover - depends on the checkout
        registry, err = None, e
    if registry is not None and hasattr(registry, "get_task"):
        try:
            return registry.get_task(name, **overrides) if overrides else registry.get_task(name)
        except (KeyError, ConfigError) as e:
            err = e
        except ImportError as e:  # a task module of the registry failed to import
            err = e
            print(f"[ccft] warning: the task registry failed to load ({e})", file=sys.stderr)
    if name in _FALLBACK_TASKS and not overrides:
        return _FALLBACK_TASKS[name]()
    known = sorted(set(_FALLBACK_TASKS) | set(task_names()))
    raise ConfigError(f"unknown task {name!r}; known tasks: {', '.join(known)}" + (f" ({err})" if err else ""))


def task_names() -> list[str]:
    """Every task name the registry (``ccft.evals.tasks.TASKS``) and the runner's built-ins know."""
    names = set(_FALLBACK_TASKS)
    try:
        from ccft.evals import tasks as registry

        names |= set(getattr(registry, "TASKS", {}))
    except Exception:  # noqa: BLE001 - listing names must not fail because one task module is broken
        pass
    return sorted(names)


def item_id(task, item, index: int) -> str:
    """A stable id for an item: ``task.item_id(item)``, else the item's ``id``/``task_id``, else its index."""
    if hasattr(task, "item_id"):
        return str(task.item_id(item))
    if isinstance(item, dict):
        for key in ("id", "task_id", "item_id", "question_id", "idx"):
            if key in item:
                return str(item[key])
    for key in ("id", "task_id", "item_id"):
        if hasattr(item, key):
            return str(getattr(item, key))
    return str(index)


def task_stop(task, item) -> list[str]:
    stop = getattr(task, "stop", None)
    if callable(stop):
        stop = stop(item)
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else [s for s in stop if s]


def normalize_scores(scores) -> dict[str, float]:
    """``task.score`` output -> ``{metric: float}`` (a bare number or bool is ``{"score": x}``)."""
    if scores is None:
        return {}
    if isinstance(scores, (bool, int, float)):
        return {"score": float(scores)}
    if hasattr(scores, "items"):
        out = {}
        for k, v in scores.items():
            if isinstance(v, bool) or isinstance(v, (int, float)):
                out[str(k)] = float(v)
        return out
    raise TypeError(f"task.score returned {type(scores).__name__}; return a dict of numbers, a number or a bool")


def score_extras(scores) -> dict:
    """The non-numeric parts of ``task.score`` output (kept in the item record, e.g. an error message)."""
    if hasattr(scores, "items"):
        return {str(k): v for k, v in scores.items() if not isinstance(v, (bool, int, float))}
    return {}


def primary_metric_of(task) -> str | None:
    """``task.primary_metric``, else the first of ``task.metrics``."""
    p = getattr(task, "primary_metric", None)
    if p:
        return str(p)
    metrics = getattr(task, "metrics", None)
    return str(metrics[0]) if metrics else None


def _accepts_arg(fn) -> bool:
    import inspect

    try:
        return len(inspect.signature(fn).parameters) >= 1
    except (TypeError, ValueError):  # pragma: no cover
        return False


def task_description(task) -> str:
    """What the items are, with their licence (for every number in a report)."""
    desc = str(getattr(task, "data", None) or getattr(task, "description", None) or task_name(task))
    lic = getattr(task, "license", None)
    return f"{desc}; licence: {lic}" if lic and str(lic) not in desc else desc


def task_name(task) -> str:
    return str(getattr(task, "name", type(task).__name__))


# ------------------------------------------------------------------------------------------------ settings


@dataclass
class EvalSettings:
    """Decoding and data settings shared by every mode of a run (they are the resume key).

    ``samples``/``temperature``/``top_p`` default to the task's (``samples`` 1 = greedy); with n > 1
    samples per item the runner samples (temperature 0.8, top-p 0.95 unless the task says otherwise)
    with seeds ``seed .. seed+n-1``, identical across modes.
    """

    limit: int | None = None
    max_new_tokens: int | None = None  # None: the task's
    generate: bool = True
    samples: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int = 0
    handoff_tokens: int = 1
    engine: bool = False  # naive / prefillshare generations through ccft.SharedPrefillEngine (else the reference)

    def resolved_samples(self, task) -> int:
        return int(self.samples or getattr(task, "samples", 1) or 1)

    def resolved_max_new_tokens(self, task) -> int:
        return int(self.max_new_tokens or getattr(task, "max_new_tokens", None) or 256)

    def sampling(self, task) -> dict:
        """``do_sample``/``temperature``/``top_p`` for ``ccft.generate``."""
        if self.resolved_samples(task) == 1 and not self.temperature:
            return {"do_sample": False, "temperature": 1.0, "top_p": 1.0}
        return {"do_sample": True,
                "temperature": float(self.temperature or getattr(task, "temperature", None) or 0.8),
                "top_p": float(self.top_p or getattr(task, "top_p", None) or 0.95)}

    def as_dict(self, task) -> dict:
        described = task.describe() if hasattr(task, "describe") else {}
        return {"task": task_name(task), "limit": self.limit, "max_new_tokens": self.resolved_max_new_tokens(task),
                "generate": self.generate, "samples": self.resolved_samples(task), **self.sampling(task),
                "seed": self.seed, "handoff_tokens": self.handoff_tokens, "stop": _stop_setting(task),
                "decode_path": "SharedPrefillEngine" if self.engine else "reference (ccft.generate)",
                "prompting": getattr(task, "prompting", None) or described.get("prompt_style"),
                "task_settings": described or None}


def _stop_setting(task):
    stop = getattr(task, "stop", None)
    if callable(stop):
        return "per item"
    return [stop] if isinstance(stop, str) else list(stop or [])


@dataclass
class ModeSpec:
    """One mode to run: its name and the decoder it needs (None for ``base``)."""

    mode: str
    decoder: Decoder | None = None
    decoder_path: str | None = None

    def describe(self) -> dict:
        d = self.decoder
        return {"mode": self.mode, "decoder": self.decoder_path,
                "method": None if d is None else d.method, "kind": None if d is None else d.kind,
                "decoder_fingerprint": None if d is None else d.meta.get("base_fingerprint")}


# ------------------------------------------------------------------------------------------------ I/O


def read_jsonl(path: Path) -> list[dict]:
    """The complete records of a JSONL file; a torn last line (interrupted write) is dropped and cut off."""
    if not path.is_file():
        return []
    raw = path.read_bytes()
    records, good = [], 0
    for line in raw.split(b"\n"):
        if not line.strip():
            good += len(line) + 1
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
        good += len(line) + 1
    if good < len(raw):  # cut the torn tail so appends start on a fresh line
        with open(path, "r+b") as f:
            f.truncate(min(good, len(raw)))
    return records


def append_jsonl(path: Path, records: Sequence[dict]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _prompt_hash(ids: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


def _write_json(path: Path, obj) -> None:
    from ccft.core.checkpoint import atomic_write_text

    atomic_write_text(path, json.dumps(obj, indent=2, default=str))


# ------------------------------------------------------------------------------------------------ scoring


@dataclass
class Prepared:
    """Items of a task tokenised once: the same prompt ids and references for every mode."""

    items: list
    ids: list[str]
    prompts: list[list[int]]
    references: list[list[int] | None]

    @property
    def n(self) -> int:
        return len(self.items)


def prepare(task, tokenizer, limit: int | None, handoff_tokens: int = 1) -> Prepared:
    """Load and tokenise the task's items (prompt ids and reference response ids + EOS)."""
    items = list(task.load(limit))
    if limit is not None:
        items = items[:limit]
    ids, prompts, refs = [], [], []
    for i, item in enumerate(items):
        ids.append(item_id(task, item, i))
        p = list(task.prompt_ids(tokenizer, item))
        if len(p) < handoff_tokens + 1:
            raise ConfigError(f"task {task_name(task)} item {ids[-1]}: the prompt has {len(p)} tokens; "
                              f"handoff_tokens={handoff_tokens} needs at least {handoff_tokens + 1}")
        prompts.append(p)
        ref = task.reference_text(item) if hasattr(task, "reference_text") else None
        refs.append(tokenize_response(tokenizer, ref) if ref else None)
    if len(set(ids)) != len(ids):
        dup = sorted({x for x in ids if ids.count(x) > 1})[:5]
        raise ConfigError(f"task {task_name(task)}: item ids are not unique ({dup}); resuming needs unique ids")
    return Prepared(items, ids, prompts, refs)


@torch.no_grad()
def batch_nll(mode: str, base, decoder: Decoder | None, prompts: Sequence[Sequence[int]],
              responses: Sequence[Sequence[int]], *, handoff_tokens: int = 1, cache=None) -> list[tuple[float, int]]:
    """(summed NLL, token count) of each response (+ EOS) under ``mode``, one forward for the batch."""
    tok = base.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    k = handoff_tokens
    batch = Collator(pad, k)([Example(tuple(p), tuple(r)) for p, r in zip(prompts, responses, strict=True)])
    batch = {key: v.to(base.device) for key, v in batch.items()}
    if mode == "base":
        with base.base_weights() as model:
            logits = full_forward(model, batch["prefix_ids"], batch["prefix_mask"], batch["tail_ids"], batch["tail_mask"])
    elif mode == "full-ft":
        logits = full_forward(decoder, batch["prefix_ids"], batch["prefix_mask"], batch["tail_ids"], batch["tail_mask"])
    else:
        if cache is None:
            cache = compute_base_cache(base, prompts, handoff_tokens=k)
        cache.check_reader(decoder.fingerprint, decoder.dtype)
        logits = decoder_forward(decoder, cache, batch["tail_ids"], batch["tail_mask"])
    return row_nlls(logits, batch["labels"])


def score_texts(task, pairs: Sequence[tuple[Any, str]]) -> list:
    """``task.score_many(pairs)`` when the task has it (code tasks run the programs in parallel), else ``score``."""
    if hasattr(task, "score_many"):
        out = list(task.score_many(list(pairs)))
        if len(out) != len(pairs):
            raise RuntimeError(f"task {task_name(task)}: score_many returned {len(out)} scores for {len(pairs)} texts")
        return out
    return [task.score(item, text) for item, text in pairs]


def make_engine(base, modes: Sequence[ModeSpec], max_batch: int = 16):
    """A ``SharedPrefillEngine`` holding the decoders of the C_base modes (``naive``, ``prefillshare``)."""
    try:
        from ccft.inference import SharedPrefillEngine
    except ImportError as e:  # pragma: no cover - depends on the checkout
        raise ConfigError(f"--engine needs ccft.inference.SharedPrefillEngine ({e})") from e
    decs = {s.mode: s.decoder for s in modes if s.mode in ("naive", "prefillshare")}
    return SharedPrefillEngine(base, decoders=decs, max_batch=max_batch)


def _engine_generate(engine, mode: str, prompts, *, handoff_tokens: int, max_new_tokens: int, stop, do_sample: bool,
                     temperature: float, top_p: float, seed: int):
    from ccft.inference import SamplingParams

    sampling = SamplingParams(do_sample=do_sample, temperature=temperature, top_p=top_p, seed=seed)
    with engine.prefill(prompts, handoff_tokens=handoff_tokens) as handle:
        return engine.generate(handle, decoder=mode, max_new_tokens=max_new_tokens, stop=stop, sampling=sampling)


def run_mode_batch(task, spec: ModeSpec, base, prep: Prepared, rows: Sequence[int], settings: EvalSettings, *,
                   score: bool = True, engine=None) -> list[dict]:
    """Score items ``rows`` (indices into ``prep``) under one mode; returns one record per item.

    ``score=False`` (a task whose toolchain is unavailable): reference NLL only, no generation to score.
    """
    mode, dec = spec.mode, spec.decoder
    k = settings.handoff_tokens
    prompts = [prep.prompts[i] for i in rows]
    cache = None
    if mode in ("naive", "prefillshare"):
        cache = compute_base_cache(base, prompts, handoff_tokens=k)  # one C_base for NLL and generation
    records = [{"id": prep.ids[i], "index": i, "prompt_sha": _prompt_hash(prep.prompts[i]),
                "prompt_tokens": len(prep.prompts[i])} for i in rows]
    with_ref = [j for j, i in enumerate(rows) if prep.references[i] is not None]
    if with_ref:
        sub_cache = cache.select(with_ref) if cache is not None and len(with_ref) < len(rows) else cache
        nlls = batch_nll(mode, base, dec, [prompts[j] for j in with_ref], [prep.references[rows[j]] for j in with_ref],
                         handoff_tokens=k, cache=sub_cache)
        for j, (s, n) in zip(with_ref, nlls, strict=True):
            records[j].update(nll=s / max(n, 1), nll_sum=s, nll_tokens=n)
    if settings.generate and score:
        max_new = settings.resolved_max_new_tokens(task)
        n_samples = settings.resolved_samples(task)
        sampling = settings.sampling(task)
        groups: dict[tuple, list[int]] = {}
        for j, i in enumerate(rows):
            groups.setdefault(tuple(task_stop(task, prep.items[i])), []).append(j)
        samples: list[list[dict]] = [[] for _ in rows]
        for stop, js in groups.items():
            c = cache.select(js) if cache is not None and len(js) < len(rows) else cache
            for s in range(n_samples):
                if engine is not None and mode in ("naive", "prefillshare"):
                    gens = _engine_generate(engine, mode, [prompts[j] for j in js], handoff_tokens=k,
                                            max_new_tokens=max_new, stop=list(stop), seed=settings.seed + s, **sampling)
                else:
                    gens = generate([prompts[j] for j in js], mode=mode, base=base, decoder=dec, cache=c,
                                    handoff_tokens=k, max_new_tokens=max_new, stop=list(stop),
                                    seed=settings.seed + s, batch_size=len(js), **sampling)
                raws = score_texts(task, [(prep.items[rows[j]], g.text) for j, g in zip(js, gens, strict=True)])
                for j, g, raw in zip(js, gens, raws, strict=True):
                    sample = {"text": g.text, "finish_reason": g.finish_reason, "new_tokens": len(g.token_ids),
                              "scores": normalize_scores(raw)}
                    extra = score_extras(raw)
                    if extra:
                        sample["score_details"] = extra
                    samples[j].append(sample)
        for rec, smp in zip(records, samples, strict=True):
            rec.update(smp[0])  # text / finish_reason / scores of the first (or only) sample
            if n_samples > 1:
                keys = sorted({k for x in smp for k in x["scores"]})
                rec["scores"] = {k: sum(x["scores"].get(k, 0.0) for x in smp if k in x["scores"])
                                 / max(1, sum(k in x["scores"] for x in smp)) for k in keys}
                rec["samples"] = smp
    return records


# ------------------------------------------------------------------------------------------------ summaries


def summarize_records(records: Sequence[dict], task=None, *, n_resamples: int = 2000, seed: int = 0) -> dict:
    """Per-mode block: n, mean NLL/token and every metric with 95% percentile-bootstrap CIs over items."""
    out: dict[str, Any] = {"n": len(records)}
    nll = [r["nll"] for r in records if r.get("nll") is not None]
    if nll:
        m = mean_ci(nll, n_resamples=n_resamples, seed=seed)
        out.update(nll=m["mean"], nll_ci=list(m["ci"]), nll_n=len(nll))
        weighted = [r for r in records if r.get("nll") is not None and "nll_sum" in r]
        if len(weighted) == len(nll):  # NLL over all response tokens pooled (rows weighted by length)
            out["nll_token_weighted"] = sum(r["nll_sum"] for r in weighted) / max(1, sum(r["nll_tokens"] for r in weighted))
    scored = [r for r in records if "scores" in r]
    if scored:
        metrics: dict[str, dict] = {}
        keys = sorted({k for r in scored for k in r["scores"]})
        for k in keys:
            vals = [r["scores"][k] for r in scored if k in r["scores"]]
            m = mean_ci(vals, n_resamples=n_resamples, seed=seed)
            metrics[k] = {"mean": m["mean"], "ci": list(m["ci"]), "n": len(vals)}
        out["metrics"] = metrics
        out["scored_n"] = len(scored)
        out["truncated"] = sum(r.get("finish_reason") == "length" for r in scored)
        if task is not None and hasattr(task, "aggregate"):
            try:
                per_item = {r["id"]: [x["scores"] for x in r["samples"]] if "samples" in r else [r["scores"]]
                            for r in scored}
                agg = task.aggregate(per_item)
                out["task_aggregate"] = agg if isinstance(agg, dict) else {"value": agg}
            except Exception as e:  # a task's own aggregate must not lose the run's numbers
                out["task_aggregate_error"] = f"{type(e).__name__}: {e}"
    return out


def paired_deltas_by_id(per_mode: dict[str, Sequence[dict]], reference: str = REFERENCE_MODE, *,
                        n_resamples: int = 2000, seed: int = 0) -> dict:
    """Paired-bootstrap deltas (mode − reference) of NLL and every metric, on the items both modes finished."""
    if reference not in per_mode:
        return {}
    ref = {r["id"]: r for r in per_mode[reference]}
    out = {}
    for mode, recs in per_mode.items():
        if mode == reference:
            continue
        d: dict[str, Any] = {}
        pairs = [(r, ref[r["id"]]) for r in recs if r["id"] in ref]
        nll = [(a["nll"], b["nll"]) for a, b in pairs if a.get("nll") is not None and b.get("nll") is not None]
        if nll:
            p = paired_bootstrap_delta([x for x, _ in nll], [y for _, y in nll], n_resamples=n_resamples, seed=seed)
            d["nll"] = {"delta": p["delta"], "ci": list(p["ci"]), "n": p["n"]}
        keys = sorted({k for a, b in pairs for k in a.get("scores", {}) if k in b.get("scores", {})})
        for k in keys:
            xy = [(a["scores"][k], b["scores"][k]) for a, b in pairs
                  if k in a.get("scores", {}) and k in b.get("scores", {})]
            p = paired_bootstrap_delta([x for x, _ in xy], [y for _, y in xy], n_resamples=n_resamples, seed=seed)
            d[k] = {"delta": p["delta"], "ci": list(p["ci"]), "n": p["n"]}
        out[mode] = d
    return out


# ------------------------------------------------------------------------------------------------ the run


@dataclass
class TaskResult:
    """What ``run_task`` returns (and writes as ``summary.json``)."""

    summary: dict
    records: dict[str, list[dict]] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)  # items computed in this call, per mode


def describe_base(base) -> str:
    from ccft.core.models import describe_model

    desc = describe_model(base.name)
    dtype = str(base.dtype).replace("torch.", "")
    return desc if dtype in desc else f"{desc} ({dtype} weights)"


def run_task(task, base, modes: Sequence[ModeSpec], out_dir: str | Path, *, settings: EvalSettings | None = None,
             batch_size: int = 8, progress: bool = True, overwrite: bool = False, n_resamples: int = 2000,
             on_item: Callable[[str, dict], None] | None = None) -> TaskResult:
    """Evaluate ``task`` under every mode in ``modes`` into ``out_dir/TASK/``, resuming what is there.

    Args:
        task: a task object (see the module docstring); ``get_task(name)`` gives one.
        base: the frozen ``ccft.Base``; modes: ``ModeSpec`` per mode (decoders already loaded on ``base``).
        settings: ``EvalSettings`` (identical for all modes; stored and checked on resume).
        batch_size: items per forward / generation batch (does not change results).
        overwrite: discard earlier results in the folder instead of resuming.
        on_item: called as ``on_item(mode, record)`` after each item is written (progress hooks, tests).
    Returns:
        TaskResult with the summary (also in ``summary.json``) and every item record per mode.
    Raises:
        ConfigError: a mode without its decoder, or a folder holding a run with other settings / items.
    """
    settings = settings or EvalSettings()
    for spec in modes:
        check_mode(spec.mode, spec.decoder)
    name = task_name(task)
    folder = Path(out_dir) / name
    if overwrite and folder.exists():
        for f in folder.glob("items.*.jsonl"):
            f.unlink()
        (folder / "meta.json").unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    prep = prepare(task, base.tokenizer, settings.limit, settings.handoff_tokens)
    from ccft.evals.evaluate import hardware

    want = settings.as_dict(task)
    environment = None
    if settings.generate and hasattr(task, "check_environment"):
        # K8: the execution environment is validated before any model is scored (raises if broken)
        environment = task.check_environment(settings.limit) if _accepts_arg(task.check_environment) \
            else task.check_environment()
    meta_path = folder / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else None
    if meta is not None:
        if meta.get("settings") != want:
            diff = {k: (meta.get("settings", {}).get(k), v) for k, v in want.items()
                    if meta.get("settings", {}).get(k) != v}
            raise ConfigError(f"{folder} holds a run with other settings {diff} (was, now); pass --overwrite or "
                              "use another --out folder")
        if meta.get("base_fingerprint") != base.fingerprint:
            raise ConfigError(f"{folder} was evaluated with base {meta.get('base_fingerprint')}, not "
                              f"{base.fingerprint}; pass --overwrite or use another --out folder")
        for spec in modes:
            old = meta.get("modes", {}).get(spec.mode)
            if old and old.get("decoder_fingerprint") != spec.describe()["decoder_fingerprint"]:
                raise ConfigError(f"{folder}: mode {spec.mode} was evaluated with another decoder "
                                  f"({old.get('decoder')}); pass --overwrite or use another --out folder")
    else:
        meta = {"task": name, "settings": want, "modes": {}, "created": time.strftime("%Y-%m-%d %H:%M:%S")}
    meta.update(model=describe_base(base), base=base.name, base_fingerprint=base.fingerprint,
                data=task_description(task), n_items=prep.n, hardware=hardware(),
                primary_metric=primary_metric_of(task), licence=getattr(task, "license", None),
                torch=torch.__version__)
    meta["environment"] = environment
    unavailable = isinstance(environment, dict) and environment.get("available") is False
    if unavailable:  # reported as unavailable, never scored as 0 (K8); NLL on the references still runs
        meta["unavailable"] = environment.get("reason") or "the task's toolchain is not installed"
    else:
        meta.pop("unavailable", None)
    for spec in modes:
        meta["modes"][spec.mode] = spec.describe()
    _write_json(meta_path, meta)

    engine = None
    if settings.engine and settings.generate and any(s.mode in ("naive", "prefillshare") for s in modes):
        engine = make_engine(base, modes, max_batch=batch_size)
    records: dict[str, list[dict]] = {}
    computed: dict[str, int] = {}
    index_of = {x: i for i, x in enumerate(prep.ids)}
    for spec in sorted(modes, key=lambda s: MODE_ORDER.index(s.mode) if s.mode in MODE_ORDER else 99):
        path = folder / f"items.{spec.mode}.jsonl"
        done = {}
        for r in read_jsonl(path):
            i = index_of.get(r["id"])
            if i is None:
                continue  # an item outside the current limit: kept in the file, not in this summary
            if r.get("prompt_sha") != _prompt_hash(prep.prompts[i]):
                raise ConfigError(f"{path}: item {r['id']} was evaluated on another prompt (the task's data or "
                                  "prompting changed); pass --overwrite or use another --out folder")
            done[r["id"]] = r
        pending = [i for i in range(prep.n) if prep.ids[i] not in done]
        pending.sort(key=lambda i: len(prep.prompts[i]))  # less padding; results do not depend on batching
        computed[spec.mode] = 0
        bar = tqdm(total=prep.n, initial=len(done), desc=f"{name} [{spec.mode}]", unit="item", disable=not progress,
                   dynamic_ncols=True, file=sys.stderr)
        try:
            for start in range(0, len(pending), batch_size):
                rows = pending[start:start + batch_size]
                recs = run_mode_batch(task, spec, base, prep, rows, settings, score=not unavailable, engine=engine)
                for r in recs:
                    append_jsonl(path, [r])
                    done[r["id"]] = r
                    computed[spec.mode] += 1
                    bar.update(1)
                    if on_item is not None:
                        on_item(spec.mode, r)
        finally:
            bar.close()
        records[spec.mode] = sorted(done.values(), key=lambda r: index_of[r["id"]])
    # every mode present in the folder goes into the summary (also modes run by an earlier command)
    for f in sorted(folder.glob("items.*.jsonl")):
        mode = f.name[len("items."):-len(".jsonl")]
        if mode not in records:
            recs = [r for r in read_jsonl(f) if r["id"] in index_of]
            if recs:
                records[mode] = sorted(recs, key=lambda r: index_of[r["id"]])
    summary = summarize_task(meta, records, task, n_resamples=n_resamples, seed=settings.seed)
    _write_json(folder / "summary.json", summary)
    return TaskResult(summary, records, computed)


def summarize_task(meta: dict, records: dict[str, list[dict]], task=None, *, n_resamples: int = 2000,
                   seed: int = 0) -> dict:
    """``summary.json``: meta + per-mode summaries + paired deltas vs Full-FT."""
    modes = {m: summarize_records(r, task, n_resamples=n_resamples, seed=seed) for m, r in records.items()}
    for _m, s in modes.items():
        s.update(model=meta.get("model"), data=meta.get("data"), hardware=meta.get("hardware"),
                 complete=s["n"] == meta.get("n_items"))
    return {"kind": "ccft-eval", "task": meta.get("task"), "meta": meta, "modes": modes,
            "deltas_vs_full_ft": paired_deltas_by_id(records, n_resamples=n_resamples, seed=seed)}


def load_task_folder(folder: str | Path) -> dict:
    """Re-read a task folder (meta + every ``items.MODE.jsonl``) into a fresh summary with per-item records."""
    folder = Path(folder)
    meta = json.loads((folder / "meta.json").read_text())
    records = {}
    for f in sorted(folder.glob("items.*.jsonl")):
        recs = read_jsonl(f)
        if recs:
            records[f.name[len("items."):-len(".jsonl")]] = sorted(recs, key=lambda r: r.get("index", 0))
    summary = summarize_task(meta, records, None)
    saved = folder / "summary.json"
    if saved.is_file():  # the task's own aggregates (pass@k, per-category) were computed with the task object
        old = json.loads(saved.read_text()).get("modes", {})
        for mode, s in summary["modes"].items():
            if old.get(mode, {}).get("n") == s["n"] and "task_aggregate" in old.get(mode, {}):
                s["task_aggregate"] = old[mode]["task_aggregate"]
    summary["records"] = records
    summary["folder"] = str(folder)
    return summary


__all__ = ["EvalSettings", "GSM8KTask", "ModeSpec", "TaskResult", "get_task", "load_task_folder", "paired_deltas_by_id",
           "prepare", "read_jsonl", "run_task", "summarize_records", "task_names"]
