"""Evaluation tasks: the declarative API every benchmark implements (the registry is ``ccft.evals.tasks``).

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
    1 = greedy; n > 1 turns on unbiased pass@k for code tasks); ``metrics`` (what ``aggregate``
    reports); ``primary_metric`` and ``secondary_metric`` (keys ``score`` returns, so every summary
    holds them per mode: the primary is the headline of ``ccft report``, ``ccft study`` and the demo,
    the one rule all of them read through ``ccft.evals.protocol.primary_metric_of``); ``license`` and
    ``data`` (bundled files, for reports).

``Task`` methods
    ``load(limit)``; ``prompt_ids(tokenizer, item)``; ``score(item, generation)`` — ``generation``
    is the model's continuation only (never prompt + continuation; a continuation that starts by
    repeating the whole prompt is detected and the copy dropped, docs/design.md K7);
    ``aggregate(per_item)`` with ``per_item = {item_id: [score dict per sample]}`` — means over
    items (pass@k with the unbiased estimator when n > 1), plus ``n_items``/``n_samples``;
    ``per_item_scores(per_item)`` — one float per item for the primary metric, for paired
    bootstrap deltas between modes; ``reference_text(item)`` — the text whose NLL is reported as
    "NLL on reference answers"; ``check_environment()`` — K8 gate (canonical solutions pass 100 %
    in this execution environment; per-language availability), returns a JSON-able dict, raises
    :class:`EnvironmentCheckError` if a check fails; ``describe()`` — the settings for reports.

Bundled data is package data: ``ccft/evals/data`` (licences next to each file; see
``ccft/evals/data/README.md``), shipped in the wheel and found with ``importlib.resources``;
``CCFT_EVAL_DATA`` points elsewhere (``CCFT_EVALS_DIR`` is its deprecated alias). :func:`data_dir`
is the one place that resolves the folder; task modules read it with :func:`data_rows` (JSON Lines,
``.gz`` or plain), the one loading rule.

This module imports no task module (they import it), so ``ccft.evals`` has no import cycle
(docs/design.md, "Layers").
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ccft.core.errors import DataError
from ccft.core.text import StopMatcher
from ccft.evals.stats import pass_at_k

__all__ = [
    "EnvironmentCheckError",
    "Item",
    "Task",
    "data_dir",
    "data_rows",
    "pass_at_k_summary",
    "read_jsonl",
    "sample_counts",
    "truncate_at_stop",
]


class EnvironmentCheckError(RuntimeError):
    """The execution environment failed a K8 check (a canonical solution did not pass here; docs/design.md
    K8)."""


@dataclass(frozen=True)
class Item:
    """One evaluation item. ``prompt`` is a string or chat messages (list of {role, content})."""

    id: str
    prompt: str | list[dict]
    reference: Any
    metadata: dict = field(default_factory=dict)


def data_dir() -> Path:
    """The bundled evaluation-data folder (the one rule every task uses to find its files).

    Order: ``$CCFT_EVAL_DATA``; else ``$CCFT_EVALS_DIR`` (deprecated alias, same meaning); else the
    package data ``importlib.resources.files("ccft.evals") / "data"`` (in a checkout
    ``src/ccft/evals/data``; in an installed wheel ``site-packages/ccft/evals/data``).

    Returns:
        The folder as a :class:`pathlib.Path`.

    Raises:
        DataError: the folder does not exist (names it and the variable that chose it), or the
            package is installed in a form that is not a plain folder (e.g. a zip).
    """
    for var in ("CCFT_EVAL_DATA", "CCFT_EVALS_DIR"):
        env = os.environ.get(var)
        if env:
            path = Path(env)
            if not path.is_dir():
                raise DataError(
                    f"evaluation data folder {path} (from ${var}) does not exist; point {var} at a "
                    "copy of ccft's evals/data folder, or unset it to use the data shipped in the package"
                )
            return path
    files = importlib.resources.files("ccft.evals") / "data"
    if not isinstance(files, Path):
        raise DataError(
            f"ccft's evaluation data ({files}) is not a folder on disk (zipped install?); install "
            "ccft as a plain wheel or set CCFT_EVAL_DATA to a folder holding a copy of it"
        )
    if not files.is_dir():
        raise DataError(
            f"evaluation data folder {files} does not exist: this ccft install lacks its package data; "
            "reinstall the wheel, or set CCFT_EVAL_DATA to a copy of ccft/evals/data"
        )
    return files


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The rows of a JSON Lines file in file order: one JSON value per line, blank lines skipped.

    A name ending in ``.gz`` is read through gzip. The suffix is not otherwise trusted (BFCL ships
    JSON Lines named ``.json``).

    Raises:
        DataError: the file does not exist, or a line is not valid JSON (names the file and line).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    if path.name.endswith(".gz"):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines = f.read().splitlines()
    else:
        lines = path.read_text(encoding="utf-8").splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not a JSON line ({e})") from e
    return rows


def data_rows(relpath: str) -> list[dict]:
    """The rows of the bundled JSON Lines file ``data_dir() / relpath`` (see :func:`read_jsonl`).

    Raises:
        DataError: no data folder, no such file, or a malformed line.
    """
    return read_jsonl(data_dir() / relpath)


def truncate_at_stop(text: str, stop: Sequence[str]) -> str:
    """Cut ``text`` before the earliest occurrence of any stop string (whitespace kept as is).

    The rule is ``ccft.core.text.StopMatcher`` (docs/design.md, "Stop strings and streaming"), the
    one reference generation, the engine and the server stop with, so a generator that already cut
    at the stop strings and this function agree; it is idempotent. Indentation is never touched:
    ``"    return x\\ndef f"`` -> ``"    return x"`` (K7).
    """
    cut = StopMatcher(stop).find(text)
    return text if cut < 0 else text[:cut]


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
    primary_metric: str = ""  # a key of ``score``'s dict; "" = the first of ``metrics``
    secondary_metric: str | None = None
    license: str = ""
    data: str = ""
    system_prompt: str | None = None

    # -- data
    def load(self, limit: int | None = None) -> list[Item]:
        """The first ``limit`` items (all for ``None``) in the task's fixed order."""
        items = self._load_all()
        return items if limit is None else items[:limit]

    def _load_all(self) -> list[Item]:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- prompting
    def prompt_text(self, item: Item) -> str | list[dict]:
        """The prompt as the model gets it (a string, or chat messages for ``prompt_style="chat"``)."""
        return item.prompt

    def prompt_ids(self, tokenizer, item: Item) -> list[int]:
        """Token ids of the prompt exactly as the decoder and the base prefill see them.

        ``completion`` style: the raw text with the tokenizer's special tokens, a repeated leading
        BOS kept once; ``chat`` style: ``ccft.core.tokens.tokenize_prompt`` with the task's system
        prompt and the item's ``tools`` (docs/design.md, "Token boundary"; K6).

        Raises:
            DataError: a completion-style task whose prompt is not a string.
        """
        from ccft.core.tokens import as_ids, strip_duplicate_bos, tokenize_prompt

        prompt = self.prompt_text(item)
        if self.prompt_style == "completion":
            if not isinstance(prompt, str):
                raise DataError(f"task {self.name}: completion prompts must be strings")
            return strip_duplicate_bos(
                as_ids(tokenizer(prompt, add_special_tokens=True)), tokenizer.bos_token_id
            )
        return tokenize_prompt(
            tokenizer,
            prompt,
            chat_template=True,
            system_prompt=self.system_prompt,
            tools=item.metadata.get("tools"),
        )

    def strip_prompt_echo(self, item: Item, generation: str) -> str:
        """Drop a copy of the prompt at the start of ``generation`` (K7: no doubled prompt)."""
        if isinstance(item.prompt, str) and len(item.prompt) > 16 and generation.startswith(item.prompt):
            return generation[len(item.prompt) :]
        return generation

    def postprocess(self, item: Item, generation: str) -> str:
        """The continuation as scored: prompt echo dropped, cut at the stop strings."""
        return truncate_at_stop(self.strip_prompt_echo(item, generation), self.stop)

    # -- scoring
    def score(self, item: Item, generation: str) -> dict[str, float]:  # pragma: no cover - abstract
        """``{metric: value}`` for one generation (the continuation only)."""
        raise NotImplementedError

    def reference_text(self, item: Item) -> str | None:
        """The text whose NLL is reported as "NLL on reference answers" (None: the task has none)."""
        return item.reference if isinstance(item.reference, str) else None

    def aggregate(self, per_item: Mapping[str, Sequence[Mapping[str, float]]]) -> dict[str, float]:
        """Mean of each metric over items (each item's samples averaged first), plus
        ``n_items`` and ``n_samples``."""
        out: dict[str, float] = {}
        for k in _metric_keys(per_item):
            vals = [
                sum(s[k] for s in samples if k in s) / max(1, sum(1 for s in samples if k in s))
                for samples in per_item.values()
                if any(k in s for s in samples)
            ]
            if vals:
                out[k] = sum(vals) / len(vals)
        out.update(sample_counts(per_item))
        return out

    def per_item_scores(
        self, per_item: Mapping[str, Sequence[Mapping[str, float]]], metric: str | None = None
    ) -> dict[str, float]:
        """One value per item for ``metric`` (default: the primary metric), for paired bootstraps."""
        metric = metric or self.primary_metric or self.metrics[0]
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
        return {
            "task": self.name,
            "prompt_style": self.prompt_style,
            "stop": list(self.stop),
            "max_new_tokens": self.max_new_tokens,
            "default_limit": self.default_limit,
            "samples": self.samples,
            "metrics": list(self.metrics),
            "primary_metric": self.primary_metric or None,
            "secondary_metric": self.secondary_metric,
            "license": self.license,
            "data": self.data,
        }


def _metric_keys(per_item: Mapping[str, Sequence[Mapping[str, float]]]) -> list[str]:
    keys: list[str] = []
    for samples in per_item.values():
        for s in samples:
            for k in s:
                if k not in keys:
                    keys.append(k)
    return keys


def sample_counts(per_item: Mapping[str, Sequence[Mapping[str, float]]]) -> dict[str, float]:
    """``{"n_items": items, "n_samples": score dicts over all items}`` (floats, for summaries)."""
    return {"n_items": float(len(per_item)), "n_samples": float(sum(len(v) for v in per_item.values()))}


def pass_at_k_summary(
    per_item: Mapping[str, Sequence[Mapping[str, float]]],
    key: str = "passed",
    ks: Sequence[int] = (1, 10, 100),
) -> dict[str, float]:
    """Mean unbiased pass@k over items (Chen et al. 2021, eq. 1) for each k ≤ the smallest n.

    ``per_item[item_id]`` holds one score dict per sample with ``key`` in {0.0, 1.0}. Items with
    no sample are skipped; ``pass@k`` is reported only for k ≤ min n (undefined otherwise; K8).
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
