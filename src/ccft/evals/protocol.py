"""The task protocol the eval runner speaks: task lookup and the duck-typed accessors of a task.

Tasks come from the registry ``ccft.evals.tasks`` (``get_task`` / ``task_names`` here turn its
errors into ``ConfigError``). The runner, the sweep and the demo never read a task's attributes
directly; they go through the helpers below, so a task may be a ``ccft.evals.tasks.Task`` or any
object with the same duck-typed interface:

``name``, ``load(limit) -> items`` (each with a stable ``id``), ``prompt_ids(tokenizer, item)``,
``stop`` (a list, or a callable ``stop(item)``), ``max_new_tokens``, ``score(item, text) ->
{metric: float}`` (optionally ``score_many(pairs)``), ``reference_text(item) -> str | None``;
optional ``samples``, ``temperature``/``top_p``, ``metrics`` (primary first) or ``primary_metric``,
``aggregate({item_id: [score dict per sample]})``, ``check_environment(limit)`` (the K8 gate of
docs/design.md, "Fault classes"), ``describe()``, ``data``/``license``, ``prompting``,
``prompt_style``/``prompt_text(item)`` (see ``ccft.evals.prompting``), ``default_limit``.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

from ccft.core.errors import ConfigError

__all__ = [
    "accepts_arg",
    "get_task",
    "item_id",
    "normalize_scores",
    "primary_metric_of",
    "score_extras",
    "secondary_metric_of",
    "score_texts",
    "stop_setting",
    "task_description",
    "task_name",
    "task_names",
    "task_stop",
]


def get_task(name: str, **overrides):
    """The task ``name`` from ``ccft.evals.tasks`` (a copy; ``overrides`` replace its declared settings).

    Raises:
        ConfigError: no task of that name (the message lists the known ones).
    """
    from ccft.evals import tasks as registry

    try:
        return registry.get_task(name, **overrides)
    except KeyError:
        raise ConfigError(f"unknown task {name!r}; known tasks: {', '.join(task_names())}") from None


def task_names() -> list[str]:
    """Every task name of the registry (``ccft.evals.tasks.TASKS``), sorted."""
    from ccft.evals import tasks as registry

    return sorted(registry.TASKS)


def task_name(task) -> str:
    """``task.name``, else the class name."""
    return str(getattr(task, "name", type(task).__name__))


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
    """The stop strings of ``item`` (``task.stop`` as a list, or ``task.stop(item)``); empty strings
    dropped."""
    stop = getattr(task, "stop", None)
    if callable(stop):
        stop = stop(item)
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else [s for s in stop if s]


def stop_setting(task) -> str | list[str]:
    """``task.stop`` as recorded in the run's settings (``"per item"`` for a callable)."""
    stop = getattr(task, "stop", None)
    if callable(stop):
        return "per item"
    return [stop] if isinstance(stop, str) else list(stop or [])


def normalize_scores(scores) -> dict[str, float]:
    """``task.score`` output -> ``{metric: float}`` (a bare number or bool is ``{"score": x}``).

    Raises:
        TypeError: the task returned something else than a dict, a number or a bool.
    """
    if scores is None:
        return {}
    if isinstance(scores, (bool, int, float)):
        return {"score": float(scores)}
    if hasattr(scores, "items"):
        return {str(k): float(v) for k, v in scores.items() if isinstance(v, (bool, int, float))}
    raise TypeError(
        f"task.score returned {type(scores).__name__}; return a dict of numbers, a number or a bool"
    )


def score_extras(scores) -> dict:
    """The non-numeric parts of ``task.score`` output (kept in the item record, e.g. an error message)."""
    if hasattr(scores, "items"):
        return {str(k): v for k, v in scores.items() if not isinstance(v, (bool, int, float))}
    return {}


def score_texts(task, pairs: Sequence[tuple[Any, str]]) -> list:
    """Raw scores of ``(item, generated text)`` pairs: ``task.score_many(pairs)`` when the task has it (code
    tasks run the programs in parallel), else ``task.score`` per pair.

    The task's ``score`` is the only scoring rule: it sees the continuation only and drops an echo of
    the prompt itself (``ccft.evals.tasks.Task.postprocess``; K7 in docs/design.md, "Fault classes").

    Raises:
        RuntimeError: ``score_many`` returned another number of scores than pairs.
    """
    if hasattr(task, "score_many"):
        out = list(task.score_many(list(pairs)))
        if len(out) != len(pairs):
            raise RuntimeError(
                f"task {task_name(task)}: score_many returned {len(out)} scores for {len(pairs)} texts"
            )
        return out
    return [task.score(item, text) for item, text in pairs]


def primary_metric_of(task) -> str | None:
    """``task.primary_metric``, else the first of ``task.metrics``: the headline metric of every report
    (``ccft report``, ``ccft study``, the demo), a key of the summaries' per-mode ``metrics``."""
    p = getattr(task, "primary_metric", None)
    if p:
        return str(p)
    metrics = getattr(task, "metrics", None)
    return str(metrics[0]) if metrics else None


def secondary_metric_of(task) -> str | None:
    """``task.secondary_metric`` (the study's second column), else None."""
    s = getattr(task, "secondary_metric", None)
    return str(s) if s else None


def accepts_arg(fn) -> bool:
    """Does ``fn`` take at least one positional argument (``check_environment(limit)`` vs
    ``check_environment()``)?"""
    try:
        return len(inspect.signature(fn).parameters) >= 1
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return False


def task_description(task) -> str:
    """What the items are, with their licence (named next to every number in a report)."""
    desc = str(getattr(task, "data", None) or getattr(task, "description", None) or task_name(task))
    lic = getattr(task, "license", None)
    return f"{desc}; licence: {lic}" if lic and str(lic) not in desc else desc
