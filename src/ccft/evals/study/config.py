"""The study's configuration: ``recipes/study.yaml`` plus ``KEY=value`` overrides, validated before any model loads
(docs/study.md, "Config"), and the metrics each task declares."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ccft.core.errors import ConfigError
from ccft.core.modes import MODES

__all__ = [
    "SpecialistConfig",
    "StudyConfig",
    "TaskSettings",
    "load_study_config",
    "metrics_of",
    "recipe_overrides",
]


def metrics_of(task: str) -> tuple[str, str | None]:
    """(primary, secondary) metric keys of ``task`` as the task declares them (``primary_metric_of``,
    ``secondary_metric_of``: the same headline ``ccft report`` reads); keys of ``items.MODE.jsonl`` scores.

    Raises:
        ConfigError: no task of that name.
    """
    from ccft.evals.protocol import get_task, primary_metric_of, secondary_metric_of

    t = get_task(task)
    primary = primary_metric_of(t)
    if primary is None:
        raise ConfigError(f"task {task!r} declares no metrics; give it a primary_metric")
    return primary, secondary_metric_of(t)


@dataclass
class TaskSettings:
    """One task of a specialist: items (the first ``limit`` of the task's order) and the generation budget."""

    limit: int = 100
    max_new_tokens: int | None = None


@dataclass
class SpecialistConfig:
    """A specialist: its training recipe (+ ``train`` overrides, ``key: value`` as on the ``ccft train`` command
    line) and its tasks. ``multipl_e`` lists MultiPL-E languages (``all``: every language whose toolchain is
    present on this machine), each evaluated on ``multipl_e_limit`` items."""

    name: str
    recipe: str
    train: dict[str, Any] = field(default_factory=dict)
    tasks: dict[str, TaskSettings] = field(default_factory=dict)
    multipl_e: list[str] | str = field(default_factory=list)
    multipl_e_limit: int = 20
    multipl_e_max_new_tokens: int | None = 256


@dataclass
class StudyConfig:
    """The whole study (``recipes/study.yaml``)."""

    specialists: dict[str, SpecialistConfig]
    runs: str = "runs/study"
    out: str = "reports/study"
    modes: list[str] = field(default_factory=lambda: list(MODES))
    batch_size: int = 16
    bootstrap: int = 2000
    seed: int = 0
    sweep_limit: int = 40
    sweep_rhos: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])
    serving: dict[str, Any] = field(default_factory=dict)
    #: torch CPU threads (None: torch's default). On a CPU shared with other jobs, 1 thread avoids the
    #: thread-synchronisation stalls that make a 2-thread matmul many times slower under oversubscription.
    threads: int | None = None
    #: where the base and decoders are evaluated: ``auto`` (CUDA when available), ``cpu``, ``cuda``, ``cuda:N``
    device: str = "auto"
    source: str = ""


_TOP_KEYS = {
    "specialists",
    "runs",
    "out",
    "modes",
    "batch_size",
    "bootstrap",
    "seed",
    "sweep_limit",
    "sweep_rhos",
    "serving",
    "threads",
    "device",
}
_SPEC_KEYS = {"recipe", "train", "tasks", "multipl_e", "multipl_e_limit", "multipl_e_max_new_tokens"}


def _set_dotted(raw: dict, key: str, value: Any, where: str) -> None:
    parts = key.split(".")
    node = raw
    for i, p in enumerate(parts[:-1]):
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"{where}: override {key}: {'.'.join(parts[: i + 1])} is not a section")
        node = nxt
    node[parts[-1]] = value


def load_study_config(path: str | os.PathLike, overrides: list[str] | None = None) -> StudyConfig:
    """Parse and validate a study YAML plus ``KEY=value`` overrides (dotted keys reach into sections:
    ``specialists.tools.train.max_steps=20``, ``specialists.math.tasks.gsm8k.limit=10``, ``batch_size=8``).

    Every specialist's recipe is parsed with its overrides (``ccft.train.config.load_recipe``), so a bad
    training key fails here, before any model is loaded. Raises ConfigError naming the file and key.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"study config {p} does not exist; see recipes/study.yaml")
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: not valid YAML ({e}); see recipes/study.yaml") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the study config must be a mapping of keys; see recipes/study.yaml")
    from ccft.train.config import parse_override

    for ov in overrides or []:
        k, v = parse_override(
            ov, example="specialists.tools.train.max_steps=20; dotted keys reach into sections"
        )
        _set_dotted(raw, k, v, str(p))
    unknown = sorted(set(raw) - _TOP_KEYS)
    if unknown:
        raise ConfigError(f"{p}: unknown key(s) {unknown}; the study config takes {sorted(_TOP_KEYS)}")
    specs_raw = raw.get("specialists")
    if not isinstance(specs_raw, dict) or not specs_raw:
        raise ConfigError(f"{p}: `specialists` must map each specialist's name to its recipe and tasks")
    specialists = {}
    for name, s in specs_raw.items():
        if not isinstance(s, dict) or "recipe" not in s:
            raise ConfigError(f"{p}: specialists.{name} needs `recipe:` (a training recipe YAML)")
        bad = sorted(set(s) - _SPEC_KEYS)
        if bad:
            raise ConfigError(f"{p}: specialists.{name}: unknown key(s) {bad}; use {sorted(_SPEC_KEYS)}")
        tasks = {}
        for t, ts in (s.get("tasks") or {}).items():
            try:
                metrics_of(t)
            except ConfigError as e:
                raise ConfigError(f"{p}: specialists.{name}.tasks.{t}: {e}") from None
            ts = ts or {}
            bad = sorted(set(ts) - {"limit", "max_new_tokens"})
            if bad:
                raise ConfigError(
                    f"{p}: specialists.{name}.tasks.{t}: unknown key(s) {bad}; use limit, max_new_tokens"
                )
            tasks[t] = TaskSettings(**ts)
        spec = SpecialistConfig(
            name=name,
            recipe=str(s["recipe"]),
            train=dict(s.get("train") or {}),
            tasks=tasks,
            multipl_e=s.get("multipl_e") or [],
            multipl_e_limit=int(s.get("multipl_e_limit", 20)),
            multipl_e_max_new_tokens=s.get("multipl_e_max_new_tokens", 256),
        )
        if not spec.tasks and not spec.multipl_e:
            raise ConfigError(f"{p}: specialists.{name} has no tasks")
        try:
            recipe_overrides(spec)  # validates the training keys now
        except (
            ConfigError
        ) as e:  # the recipe parser names the recipe; the key may come from this file's train:
            named = sorted(k for k in spec.train if f"{k}=" in str(e))
            if not named:
                raise
            raise ConfigError(
                f"{p}: specialists.{name}.train sets {', '.join(named)} (applied to {e})"
            ) from None
        specialists[name] = spec
    modes = list(raw.get("modes") or MODES)
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ConfigError(f"{p}: modes {bad} are not modes; use {', '.join(MODES)}")
    cfg = StudyConfig(
        specialists=specialists,
        source=str(p),
        modes=modes,
        **{
            k: raw[k]
            for k in (
                "runs",
                "out",
                "batch_size",
                "bootstrap",
                "seed",
                "sweep_limit",
                "sweep_rhos",
                "serving",
                "threads",
                "device",
            )
            if k in raw
        },
    )
    return cfg


def recipe_overrides(spec: SpecialistConfig):
    """(TrainConfig, EvalConfig, raw recipe) of ``spec``'s recipe with its ``train`` overrides applied."""
    from ccft.train.config import load_recipe

    overrides = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in spec.train.items()]
    return load_recipe(spec.recipe, overrides)
