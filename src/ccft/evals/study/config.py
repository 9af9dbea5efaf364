"""The study's configuration: ``recipes/study.yaml`` with the evaluation suite it names (``evals/study.yaml``)
plus ``KEY=value`` overrides, validated before any model loads (docs/study.md, "What runs";
docs/evaluation.md), and the metrics each task declares."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ccft.core.errors import ConfigError
from ccft.core.modes import MODES

__all__ = [
    "SUITE_KEYS",
    "SUITE_SPEC_KEYS",
    "SpecialistConfig",
    "StudyConfig",
    "TaskSettings",
    "load_study_config",
    "metrics_of",
    "parse_tasks",
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
    """A specialist: its training recipe (+ ``train`` overrides, ``key: value`` as on the ``ccft train``
    command line) and its tasks. ``multipl_e`` lists MultiPL-E languages (``all``: every language whose
    toolchain is present on this machine), each evaluated on ``multipl_e_limit`` items."""

    name: str
    recipe: str
    train: dict[str, Any] = field(default_factory=dict)
    tasks: dict[str, TaskSettings] = field(default_factory=dict)
    multipl_e: list[str] | str = field(default_factory=list)
    multipl_e_limit: int = 20
    multipl_e_max_new_tokens: int | None = 256
    #: the file ``recipe`` names (``ccft.train.recipes.resolve_named``: beside the study config first); "":
    #: ``recipe`` as given
    recipe_file: str = ""

    def task_list(self) -> list[tuple[str, int, int | None]]:
        """``(task, limit, max_new_tokens)`` in evaluation order: ``tasks``, then one ``multipl-e-LANG`` per
        language of ``multipl_e`` (``all``: the languages whose toolchain ``check_language`` finds here)."""
        from ccft.evals.execution import check_language
        from ccft.evals.protocol import task_names

        out = [(t, ts.limit, ts.max_new_tokens) for t, ts in self.tasks.items()]
        if self.multipl_e == "all":
            names = [n for n in task_names() if n.startswith("multipl-e-")]
            langs = [n.removeprefix("multipl-e-") for n in names if check_language(n[10:]).available]
        else:
            langs = list(self.multipl_e)
        return out + [
            (f"multipl-e-{lang}", self.multipl_e_limit, self.multipl_e_max_new_tokens) for lang in langs
        ]


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
    #: where the base and decoders are evaluated: ``auto`` (CUDA when available), ``cpu``, ``cuda``,
    #: ``cuda:N``
    device: str = "auto"
    source: str = ""
    #: the evaluation suite the config named (``suite:``; its keys are merged under the config's own)
    suite: str = ""
    #: ``frontier:``: CCFT decoders trained at sharing depths m and evaluated beside the study's modes
    #: (``ccft.evals.study.frontier``); None: no frontier
    frontier: Any = None


_TOP_KEYS = {
    "suite",
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
    "frontier",
}
_SPEC_KEYS = {"recipe", "train", "tasks", "multipl_e", "multipl_e_limit", "multipl_e_max_new_tokens"}


#: what an evaluation suite (evals/*.yaml) may declare for the study: the evaluation, not training or serving
SUITE_KEYS = {"modes", "batch_size", "bootstrap", "seed", "sweep_limit", "sweep_rhos", "specialists"}
SUITE_SPEC_KEYS = {"tasks", "multipl_e", "multipl_e_limit", "multipl_e_max_new_tokens"}


def _with_suite(raw: dict, suite: Any, p: Path) -> dict:
    """``raw`` with the evaluation suite it names merged under it (the config's own keys win, section by
    section): the suite declares tasks, n, modes and the sweep; the config, the recipes and training.

    Raises:
        ConfigError: the suite is missing or not YAML, declares a key that is not evaluation, or a specialist
            the config has no recipe for.
    """
    from ccft.train.config import read_yaml_mapping
    from ccft.train.recipes import resolve_named

    if not isinstance(suite, str):
        raise ConfigError(
            f"{p}: suite: {suite!r} is not a suite; give a path relative to {p.name}'s folder or a packaged "
            "suite's name (`ccft recipes list`)"
        )
    sp = resolve_named(suite, p, "suite", str(p))
    sraw, _ = read_yaml_mapping(sp, "evaluation suite", "an evals/*.yaml file")
    bad = sorted(set(sraw) - SUITE_KEYS)
    if bad:
        raise ConfigError(
            f"{sp}: key(s) {bad} are not evaluation settings; a suite takes {sorted(SUITE_KEYS)}"
        )
    merged = {k: v for k, v in sraw.items() if k != "specialists"} | {
        k: v for k, v in raw.items() if k != "specialists"
    }
    own = raw.get("specialists") or {}
    if not isinstance(own, dict):
        raise ConfigError(f"{p}: `specialists` must map each specialist's name to its recipe")
    specs = {name: dict(s) if isinstance(s, dict) else s for name, s in own.items()}
    for name, s in (sraw.get("specialists") or {}).items():
        if name not in specs:
            raise ConfigError(
                f"{sp}: specialists.{name} has tasks but {p} has no recipe for it; add "
                f"specialists.{name}.recipe"
            )
        if not isinstance(s, dict) or set(s) - SUITE_SPEC_KEYS:
            raise ConfigError(
                f"{sp}: specialists.{name} takes {sorted(SUITE_SPEC_KEYS)} in a suite (its recipe and train: "
                f"keys go in {p})"
            )
        if isinstance(specs[name], dict):
            specs[name] = s | specs[name]
    merged["specialists"] = specs
    return merged


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


def parse_tasks(where: str, raw: Any) -> dict[str, TaskSettings]:
    """``{task: TaskSettings}`` of a ``tasks:`` mapping (``{gsm8k: {limit: 100, max_new_tokens: 256}}``);
    ``where`` prefixes the messages (``FILE: specialists.NAME``).

    Raises:
        ConfigError: not a mapping, a task that is not registered or declares no metrics, an unknown key.
    """
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}.tasks must map task names to {{limit, max_new_tokens}}")
    tasks = {}
    for t, ts in raw.items():
        try:
            metrics_of(t)
        except ConfigError as e:
            raise ConfigError(f"{where}.tasks.{t}: {e}") from None
        ts = ts or {}
        bad = sorted(set(ts) - {"limit", "max_new_tokens"}) if isinstance(ts, dict) else ["(not a mapping)"]
        if bad:
            raise ConfigError(f"{where}.tasks.{t}: unknown key(s) {bad}; use limit, max_new_tokens")
        tasks[t] = TaskSettings(**ts)
    return tasks


def load_study_config(path: str | os.PathLike, overrides: list[str] | None = None) -> StudyConfig:
    """Parse and validate a study YAML plus ``KEY=value`` overrides (dotted keys reach into sections:
    ``specialists.tools.train.max_steps=20``, ``specialists.math.tasks.gsm8k.limit=10``, ``batch_size=8``).

    Every specialist's recipe is parsed with its overrides (``ccft.train.config.load_recipe``), so a bad
    training key fails here, before any model is loaded. Raises ConfigError naming the file and key.
    """
    from ccft.train.config import read_yaml_mapping

    p = Path(path)
    raw, _ = read_yaml_mapping(p, "study config", "a study .yaml file (see recipes/study.yaml)")
    suite_path = raw.pop("suite", None)
    if suite_path is not None:
        raw = _with_suite(raw, suite_path, p)
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
        tasks = parse_tasks(f"{p}: specialists.{name}", s.get("tasks"))
        from ccft.train.recipes import resolve_named

        spec = SpecialistConfig(
            name=name,
            recipe=str(s["recipe"]),
            recipe_file=str(
                resolve_named(str(s["recipe"]), p, f"specialists.{name}.recipe", str(p), kind="recipe")
            ),
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
    from ccft.evals.study.frontier import parse_frontier

    cfg = StudyConfig(
        specialists=specialists,
        frontier=parse_frontier(raw.get("frontier"), str(p), list(specialists)),
        source=str(p),
        suite=str(suite_path or ""),
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
    return load_recipe(spec.recipe_file or spec.recipe, overrides)
