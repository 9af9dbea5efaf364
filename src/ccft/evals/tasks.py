"""The task registry: every evaluation task by name (the task API itself is ``ccft.evals.task_base``).

``TASKS`` maps names to ready-made task objects; ``get_task(name, **overrides)`` returns one
(``overrides`` replace declared settings, e.g. ``samples=5`` or ``prompt_style``);
``register_task(task)`` adds one; ``task_names()`` lists them. Names: ``gsm8k``, ``gsm-plus``,
``humaneval``, ``humaneval-plus``, ``bfcl-multiple``, ``multipl-e-<lang>`` (``cpp``, ``java``,
``js``, ``ts``, ``go``, ``rs``, ``php``, ``rb``, ``pl``, ``lua``, ``r``, ``sh``). A MultiPL-E
language whose toolchain is missing stays registered; its ``check_environment`` reports it
unavailable and ``score`` returns ``{"available": 0.0}`` with no pass@1 key — never a silent 0
(docs/design.md K8).

The built-in task modules are imported on the first read of ``TASKS``, so importing this module
stays light. They import ``ccft.evals.task_base``, never this module (no import cycle,
docs/design.md "Layers"). The task API names (``Item``, ``Task``, ``data_dir``,
``EnvironmentCheckError``, ``truncate_at_stop``, ``pass_at_k_summary``, ...) are re-exported here.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from ccft.evals.task_base import (
    EnvironmentCheckError,
    Item,
    Task,
    data_dir,
    data_rows,
    pass_at_k_summary,
    read_jsonl,
    sample_counts,
    truncate_at_stop,
)

__all__ = [
    "TASKS",
    "EnvironmentCheckError",
    "Item",
    "Task",
    "data_dir",
    "data_rows",
    "get_task",
    "pass_at_k_summary",
    "read_jsonl",
    "register_task",
    "sample_counts",
    "task_names",
    "truncate_at_stop",
]


class _Registry(Mapping[str, Task]):
    """Read-only mapping name -> task; the built-in task modules are imported on the first read."""

    def __init__(self) -> None:
        self._tasks: dict[str, Task] = {}
        self._builtin_loaded = False

    def _all(self) -> dict[str, Task]:
        if not self._builtin_loaded:
            self._builtin_loaded = True
            _register_builtin()
        return self._tasks

    def __getitem__(self, name: str) -> Task:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())

    def add(self, task: Task) -> None:
        self._tasks[task.name] = task


_REGISTRY = _Registry()

#: name -> task (built-ins load on first access).
TASKS: Mapping[str, Task] = _REGISTRY


def register_task(task: Task) -> Task:
    """Add ``task`` to ``TASKS`` under ``task.name`` (replacing one of the same name); returns it.

    Raises:
        ValueError: the task has no name.
    """
    if not task.name:
        raise ValueError("a task needs a name")
    _REGISTRY.add(task)
    return task


def task_names() -> list[str]:
    """The registered task names, sorted."""
    return sorted(TASKS)


def get_task(name: str, **overrides: Any) -> Task:
    """The registered task ``name`` (a copy, with ``overrides`` applied to its declared settings).

    Raises:
        KeyError: no task of that name (the message lists the known ones).
        TypeError: an override that is not a declared setting of the task.
    """
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; available: {', '.join(task_names())}")
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
