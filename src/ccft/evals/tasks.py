"""Evaluation tasks: a small declarative API shared by every benchmark (and the runner that calls it).

The task API
============

A task turns bundled data into items, items into prompt ids, and generations into scores. The
runner (modes, batching, resumability, reports) never needs to know which benchmark it runs::

    from ccft.evals.tasks import get_task, TASKS

    task = get_task("humaneval")                  # or TASKS["humaneval"]
    env = task.check_environment()                # K8: before any model is scored (raises if broken)
    items = task.load(limit=20)                   # list[Item], deterministic order
    for item in items:
        ids = task.prompt_ids(tokenizer, item)    # exactly what base prefill + decoder see
        text = generate(ids, stop=task.stop, max_new_tokens=task.max_new_tokens)  # continuation only
        scores = task.score(item, text)           # {"pass@1": 1.0, ...}: metric -> float
        ref = task.reference_text(item)           # reference answer for response NLL (None if none)
    summary = task.aggregate({item.id: [scores, ...] for ...})   # {"pass@1": 0.31, "n_items": 20, ...}

``Item``
    ``id`` (stable string, e.g. ``"HumanEval/0"``), ``prompt`` (a string, or chat messages
    ``[{"role", "content"}, ...]`` ending before the assistant turn), ``reference`` (the gold answer
    in the task's own form), ``metadata`` (e.g. ``perturbation_type``, ``language``, ``tools``).

``Task`` attributes (declared, not coded)
    ``name``; ``prompt_style`` — ``"chat"`` (the tokenizer's chat template, one user turn) or
    ``"completion"`` (raw text continued by the model, BOS added as the tokenizer does); ``stop``
    (stop strings: generation is cut *before* the first one; the runner passes them to the
    generator and ``score`` truncates again, so both paths agree); ``max_new_tokens``;
    ``default_limit`` (items in a default CPU-sized run; ``None`` = all); ``samples`` (n per item:
    1 = greedy; n > 1 turns on unbiased pass@k for code tasks); ``metrics`` (keys ``score``
    returns, the primary first); ``license`` and ``data`` (bundled files, for reports).

``Task`` methods
    ``load(limit)``; ``prompt_ids(tokenizer, item)``; ``score(item, generation)`` — ``generation``
    is the model's continuation only (never prompt + continuation; a continuation that starts by
    repeating the whole prompt is detected and the copy dropped, CASES.md K7); ``aggregate(per_item)``
    with ``per_item = {item_id: [score dict per sample]}`` — means over items (pass@k with the
    unbiased estimator when n > 1), plus ``n_items``/``n_samples``; ``per_item_scores(per_item)`` —
    one float per item for the primary metric, for paired bootstrap deltas between modes;
    ``reference_text(item)`` — the text whose NLL is reported as "NLL on reference answers";
    ``check_environment()`` — K8 gate (canonical solutions pass 100 % in this execution
    environment; per-language availability), returns a JSON-able dict, raises
    :class:`EnvironmentCheckError` if a check fails; ``describe()`` — the settings for reports.

Registry: ``TASKS`` maps names to ready-made task objects; ``get_task(name, **overrides)``
returns one (``overrides`` replace declared settings, e.g. ``samples=5`` or ``prompt_style``);
``register_task(task)`` adds one. Names: ``gsm8k``, ``gsm-plus``, ``humaneval``,
``humaneval-plus``, ``bfcl-multiple``, ``multipl-e-<lang>`` (``cpp``, ``java``, ``js``, ``ts``,
``go``, ``rs``, ``php``, ``rb``, ``pl``, ``lua``, ``r``, ``sh``). A MultiPL-E language whose
toolchain is missing stays registered; its ``check_environment`` reports it unavailable and
``score`` returns ``{"available": 0.0}`` with no pass@1 key — never a silent 0.

Bundled data lives in the repository's ``evals/data`` (licences next to each file; see
``evals/README.md``); ``CCFT_EVALS_DIR`` points elsewhere (e.g. for an installed package).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ccft.core.errors import DataError
from ccft.evals.stats import pass_at_k

__all__ = ["TASKS", "EnvironmentCheckError", "Item", "Task", "data_dir", "get_task", "register_task",
           "truncate_at_stop"]


class EnvironmentCheckError(RuntimeError):
    """The execution environment failed a K8 check (a canonical solution did not pass here)."""


@dataclass(frozen=True)
class Item:
    """One evaluation item. ``prompt`` is a string or chat messages (list of {role, content})."""

    id: str
    prompt: str | list[dict]
    reference: Any
    metadata: dict = field(default_factory=dict)


def data_dir() -> Path:
    """The bundled-data folder: ``$CCFT_EVALS_DIR`` or ``<repository>/evals/data``."""
    env = os.environ.get("CCFT_EVALS_DIR")
    path = Path(env) if env else Path(__file__).resolve().parents[3] / "evals" / "data"
    if not path.is_dir():
        raise DataError(f"evaluation data folder {path} does not exist; run from a ccft checkout or set "
                        "CCFT_EVALS_DIR to a copy of the repository's evals/data")
    return path


def truncate_at_stop(text: str, stop: Sequence[str]) -> str:
    """Cut ``text`` before the earliest occurrence of any stop string (whitespace kept as is).

    Idempotent, so a generator that already cut at the stop strings and this function agree.
    Indentation is never touched: ``"    return x\\ndef f"`` -> ``"    return x"``.
    """
    cut = len(text)
    for s in stop:
        if s:
            i = text.find(s)
            if i != -1 and i < cut:
                cut = i
    return text[:cut]


@dataclass
class Task:
    """Base class: declared settings plus the default behaviour of each method (see module docs)."""

    name: str = ""
    prompt_style: str = "chat"
    stop: tuple[str, ...] = ()
    max_new_tokens: int = 256
    default_limit: int | None = None
    samples: int = 1
    metrics: tuple[str, ...] = ()
    license: str = ""
    data: str = ""
    system_prompt: str | None = None

    # -- data
    def load(self, limit: int | None = None) -> list[Item]:
        items = self._load_all()
        return items if limit is None else items[:limit]

    def _load_all(self) -> list[Item]:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- prompting
    def prompt_text(self, item: Item) -> str | list[dict]:
        return item.prompt

    def prompt_ids(self, tokenizer, item: Item) -> list[int]:
        """Token ids of the prompt exactly as the decoder and the base prefill see them."""
        from ccft.core.tokens import as_ids, tokenize_prompt

        prompt = self.prompt_text(item)
        if self.prompt_style == "completion":
            if not isinstance(prompt, str):
                raise DataError(f"task {self.name}: completion prompts must be strings")
            ids = as_ids(tokenizer(prompt, add_special_tokens=True))
            bos = tokenizer.bos_token_id
            while bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
                ids = ids[1:]
            return ids
        return tokenize_prompt(tokenizer, prompt, chat_template=True, system_prompt=self.system_prompt,
                               tools=item.metadata.get("tools"))

    def strip_prompt_echo(self, item: Item, generation: str) -> str:
        """Drop a copy of the prompt at the start of ``generation`` (K7: no doubled prompt)."""
        if isinstance(item.prompt, str) and len(item.prompt) > 16 and generation.startswith(item.prompt):
            return generation[len(item.prompt):]
        return generation

    def postprocess(self, item: Item, generation: str) -> str:
        """The continuation as scored: prompt echo dropped, cut at the stop strings."""
        return truncate_at_stop(self.strip_prompt_echo(item, generation), self.stop)

    # -- scoring
    def score(self, item: Item, generation: str) -> dict[str, float]:  # pragma: no cover - abstract
        raise NotImplementedError

    def reference_text(self, item: Item) -> str | None:
        return item.reference if isinstance(item.reference, str) else None

    def aggregate(self, per_item: Mapping[str, Sequence[Mapping[str, float]]]) -> dict[str, float]:
        """Mean of each metric over items (each item's samples averaged first)."""
        out: dict[str, float] = {}
        keys = _metric_keys(per_item)
        for k in keys:
            vals = [sum(s[k] for s in samples if k in s) / max(1, sum(1 for s in samples if k in s))
                    for samples in per_item.values() if any(k in s for s in samples)]
            if vals:
                out[k] = sum(vals) / len(vals)
        out["n_items"] = float(len(per_item))
        out["n_samples"] = float(sum(len(v) for v in per_item.values()))
        return out

    def per_item_scores(self, per_item: Mapping[str, Sequence[Mapping[str, float]]],
                        metric: str | None = None) -> dict[str, float]:
        """One value per item for ``metric`` (default: the primary metric), for paired bootstraps."""
        metric = metric or self.metrics[0]
        out = {}
        for item_id, samples in per_item.items():
            vals = [s[metric] for s in samples if metric in s]
            if vals:
                out[item_id] = sum(vals) / len(vals)
        return out

    # -- environment
    def check_environment(self, limit: int | None = None) -> dict:
        """K8 gate; tasks without execution have nothing to check."""
        return {"task": self.name, "ok": True, "checks": []}

    def describe(self) -> dict:
        """Settings that name what was measured (for result files and reports)."""
        return {"task": self.name, "prompt_style": self.prompt_style, "stop": list(self.stop),
                "max_new_tokens": self.max_new_tokens, "default_limit": self.default_limit,
                "samples": self.samples, "metrics": list(self.metrics), "license": self.license,
                "data": self.data}


def _metric_keys(per_item: Mapping[str, Sequence[Mapping[str, float]]]) -> list[str]:
    keys: list[str] = []
    for samples in per_item.values():
        for s in samples:
            for k in s:
                if k not in keys:
                    keys.append(k)
    return keys


def pass_at_k_summary(per_item: Mapping[str, Sequence[Mapping[str, float]]], key: str = "passed",
                      ks: Sequence[int] = (1, 10, 100)) -> dict[str, float]:
    """Mean unbiased pass@k over items (Chen et al. 2021) for each k ≤ the smallest n.

    ``per_item[item_id]`` holds one score dict per sample with ``key`` in {0.0, 1.0}. Items with
    no sample are skipped; ``pass@k`` is reported only for k ≤ min n (undefined otherwise).
    """
    counts = [(len(v), int(round(sum(s[key] for s in v)))) for v in per_item.values() if v and key in v[0]]
    out: dict[str, float] = {}
    if not counts:
        return out
    n_min = min(n for n, _ in counts)
    for k in ks:
        if k <= n_min:
            out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)
    return out


# ------------------------------------------------------------------ registry

class _Registry(dict):
    """``dict`` of tasks that imports the built-in task modules on first use (no import cycles)."""

    _loaded = False

    def _load(self) -> None:
        if not _Registry._loaded:
            _Registry._loaded = True
            _register_builtin()

    def __getitem__(self, key):
        self._load()
        return super().__getitem__(key)

    def __contains__(self, key):
        self._load()
        return super().__contains__(key)

    def __iter__(self):
        self._load()
        return super().__iter__()

    def __len__(self):
        self._load()
        return super().__len__()

    def keys(self):
        self._load()
        return super().keys()

    def items(self):
        self._load()
        return super().items()

    def values(self):
        self._load()
        return super().values()

    def get(self, key, default=None):
        self._load()
        return super().get(key, default)


#: name -> task (built-ins load on first access).
TASKS: dict[str, Task] = _Registry()


def register_task(task: Task) -> Task:
    """Add ``task`` to ``TASKS`` under ``task.name`` (replacing one of the same name)."""
    if not task.name:
        raise ValueError("a task needs a name")
    dict.__setitem__(TASKS, task.name, task)
    return task


def get_task(name: str, **overrides: Any) -> Task:
    """The registered task ``name`` (a copy, with ``overrides`` applied to its declared settings)."""
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; available: {', '.join(sorted(TASKS))}")
    task = copy.copy(TASKS[name])
    if overrides:
        names = {f.name for f in dataclasses.fields(task)}
        bad = [k for k in overrides if k not in names]
        if bad:
            raise TypeError(f"task {name}: unknown setting(s) {bad}; settings: {sorted(names)}")
        task = dataclasses.replace(task, **overrides)
    return task


def _register_builtin() -> None:
    from ccft.evals import bfcl, gsm, gsm_plus, humaneval, multipl_e

    for module in (gsm, gsm_plus, humaneval, bfcl, multipl_e):
        for task in module.tasks():
            register_task(task)
