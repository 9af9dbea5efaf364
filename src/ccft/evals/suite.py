"""Evaluation suites: which tasks, how many items, which modes, declared in a YAML file (``evals/*.yaml`` at
the top of the repository, beside ``recipes/``), read by ``ccft eval --suite``, ``ccft demo`` (a recipe's
``eval: evals/demo.yaml``) and ``ccft study`` (``suite: evals/study.yaml``); docs/evaluation.md, "Suites".

A suite has one of two forms:

- **one task** (``evals/demo.yaml``): the keys of ``ccft.train.config.EvalConfig`` — ``task``, ``nll_rows``
  (items scored by reference NLL), ``em_rows`` (the first of them also generated and scored),
  ``max_new_tokens``, ``batch_size``, ``modes``, ``bootstrap``, ``seed``, ``engine``;
- **per specialist** (``evals/study.yaml``): ``modes``, ``batch_size``, ``bootstrap``, ``seed``, the sweep's
  ``sweep_limit`` / ``sweep_rhos``, and ``specialists: {NAME: {tasks: {TASK: {limit, max_new_tokens}},
  multipl_e, multipl_e_limit, multipl_e_max_new_tokens}}``; each specialist's decoders are evaluated on its
  tasks.

The task data ships in the wheel (``ccft.evals.data``); a suite only names tasks of the registry
(``ccft eval --task list``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ccft.core.errors import ConfigError
from ccft.core.modes import MODES

__all__ = ["EvalSuite", "SuiteTask", "load_suite"]


@dataclass(frozen=True)
class SuiteTask:
    """One task of a suite: the first ``limit`` items of the task's order (None: the task's default), of which
    the first ``generate_limit`` are generated and scored (None: all), with ``max_new_tokens`` (None: the
    task's)."""

    task: str
    limit: int | None = None
    generate_limit: int | None = None
    max_new_tokens: int | None = None


@dataclass(frozen=True)
class EvalSuite:
    """A suite resolved for one group of decoders (the whole suite, or one specialist's part of it).

    ``engine``: the decode path a one-task suite declares (``EvalConfig.engine``); None = not declared."""

    source: str
    tasks: tuple[SuiteTask, ...]
    modes: tuple[str, ...] = tuple(MODES)
    batch_size: int | None = None
    bootstrap: int | None = None
    seed: int | None = None
    specialist: str | None = None
    specialists: tuple[str, ...] = field(default=())
    engine: bool | None = None


def load_suite(path: str | os.PathLike, specialist: str | None = None) -> EvalSuite:
    """Read and validate the suite at ``path`` (before any model loads).

    Args:
        path: a suite YAML (``evals/demo.yaml``, ``evals/study.yaml``) or a packaged suite's name (``demo``).
        specialist: for a per-specialist suite, whose tasks (may be omitted when the suite has one
            specialist).
    Returns:
        the ``EvalSuite``; MultiPL-E ``all`` is resolved to the languages whose toolchain is present here.
    Raises:
        ConfigError: an unreadable file, an unknown key or task (naming the file and key), a missing or
            unknown ``specialist``.
    """
    from ccft.evals.study.config import SUITE_KEYS, SUITE_SPEC_KEYS, SpecialistConfig, parse_tasks
    from ccft.train.config import load_eval_config, read_yaml_mapping
    from ccft.train.recipes import recipe_argument

    p = Path(recipe_argument(str(path), "suite"))  # a packaged suite by name: demo, study
    raw, _ = read_yaml_mapping(
        p, "evaluation suite", "an evals/*.yaml file or a packaged suite's name (`ccft recipes list`)"
    )
    if not raw:
        raise ConfigError(f"{p}: an empty evaluation suite; declare at least `task:` (see evals/demo.yaml)")
    if "specialists" not in raw:
        if specialist is not None:
            raise ConfigError(f"{p} has no specialists (one task for any decoders); drop --specialist")
        e = load_eval_config(p)
        from ccft.evals.protocol import task_names

        if e.task not in task_names():
            raise ConfigError(f"{p}: task: unknown task {e.task!r}; known tasks: {', '.join(task_names())}")
        return EvalSuite(
            source=str(p),
            tasks=(SuiteTask(e.task, e.nll_rows, e.em_rows, e.max_new_tokens),),
            modes=tuple(e.modes),
            batch_size=e.batch_size,
            bootstrap=e.bootstrap,
            seed=e.seed,
            engine=e.engine,
        )
    bad = sorted(set(raw) - SUITE_KEYS)
    if bad:
        raise ConfigError(f"{p}: unknown key(s) {bad}; a per-specialist suite takes {sorted(SUITE_KEYS)}")
    groups = raw["specialists"]
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{p}: `specialists` must map each specialist's name to its tasks")
    names = tuple(str(n) for n in groups)
    if specialist is None:
        if len(names) > 1:
            raise ConfigError(f"{p} declares specialists {list(names)}; choose one with --specialist NAME")
        specialist = names[0]
    if specialist not in groups:
        raise ConfigError(f"{p} has no specialist {specialist!r}; it declares {list(names)}")
    g = groups[specialist] or {}
    bad = sorted(set(g) - SUITE_SPEC_KEYS) if isinstance(g, dict) else ["(not a mapping)"]
    if bad:
        raise ConfigError(
            f"{p}: specialists.{specialist}: unknown key(s) {bad}; use {sorted(SUITE_SPEC_KEYS)}"
        )
    spec = SpecialistConfig(
        name=specialist,
        recipe="",
        tasks=parse_tasks(f"{p}: specialists.{specialist}", g.get("tasks")),
        multipl_e=g.get("multipl_e") or [],
        multipl_e_limit=int(g.get("multipl_e_limit", 20)),
        multipl_e_max_new_tokens=g.get("multipl_e_max_new_tokens", 256),
    )
    modes = tuple(raw.get("modes") or MODES)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ConfigError(f"{p}: modes {unknown} are not modes; use {', '.join(MODES)}")
    tasks = tuple(SuiteTask(t, limit, None, mnt) for t, limit, mnt in spec.task_list())
    if not tasks:
        raise ConfigError(f"{p}: specialists.{specialist} has no tasks")
    return EvalSuite(
        source=str(p),
        tasks=tasks,
        modes=modes,
        batch_size=raw.get("batch_size"),
        bootstrap=raw.get("bootstrap"),
        seed=raw.get("seed"),
        specialist=specialist,
        specialists=names,
    )
