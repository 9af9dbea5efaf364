"""The specialists study (``ccft study recipes/study.yaml``): each specialist trained from its own recipe with
both methods and evaluated on its own benchmarks in the four modes.

What runs (docs/study.md): for every specialist of the config (math, code, tools), a CCFT decoder and a
Full-FT decoder from the specialist's recipe with the same rows, steps, seed and adapter
(``ccft.train.run.method_config``); then every task of the specialist under ``base``, ``full-ft``,
``naive`` and ``prefillshare`` on the same items and settings (the eval runner, ``ccft.evals.runner``:
response NLL/token on the reference answer and greedy generations scored by the task; shared-prefill
modes decode through ``ccft.inference.SharedPrefillEngine``); then the sharing sweep over prompt positions
on the specialist's first task (``ccft.evals.sweep``). ``build_study_report`` turns the result folders into
``report.json`` and ``README.md`` (the paper's table: tasks × modes, primary metric with its 95% CI and the
paired Δ against Full-FT, the same for the secondary metric and NLL/token, and the retention of the shared
modes).

Every phase resumes: finished training runs are reused (``ccft.train.run.train_or_reuse``), an interrupted
one restarts from its newest checkpoint, an evaluation resumes item by item and a sweep point by point.
Wall time per phase is added up over sittings in ``OUT/phases.json``.

Metrics per task (``metrics_of``: what each task declares, ``Task.primary_metric`` / ``secondary_metric``,
the headline ``ccft report`` reads too): the primary metric is the task's accuracy (exact match, pass@1, BFCL
AST accuracy); the secondary metric is a coarser property that already moves at the scale of a 135M model
and a few dozen steps (``#### N`` answer form, code that parses and defines the entry point, a call to an
offered function). NLL/token on the reference answer is reported for every task.
"""

from __future__ import annotations

from ccft.evals.study.config import (
    SpecialistConfig,
    StudyConfig,
    TaskSettings,
    load_study_config,
    metrics_of,
    recipe_overrides,
)
from ccft.evals.study.report import (
    PRIMARY_MEANING,
    SECONDARY_MEANING,
    build_study_report,
    full_ft_beats_base,
    study_reading,
    study_readme,
    task_entry,
)
from ccft.evals.study.resume import DECODERS_STAMP, StudyPhases, run_digest, stamp_matches, write_stamp

__all__ = [
    "DECODERS_STAMP",
    "PRIMARY_MEANING",
    "SECONDARY_MEANING",
    "SpecialistConfig",
    "StudyConfig",
    "StudyPhases",
    "TaskSettings",
    "build_study_report",
    "full_ft_beats_base",
    "load_study_config",
    "metrics_of",
    "recipe_overrides",
    "run_digest",
    "stamp_matches",
    "study_reading",
    "study_readme",
    "task_entry",
    "write_stamp",
]


def __getattr__(name: str):
    if name == "TASK_METRICS":  # deprecated: each task declares its metrics (``Task.primary_metric``)
        import warnings

        from ccft.evals.protocol import task_names

        warnings.warn(
            "ccft.evals.study.TASK_METRICS is deprecated; read metrics_of(task) or the task's "
            "primary_metric / secondary_metric",
            DeprecationWarning,
            stacklevel=2,
        )
        return {t: metrics_of(t) for t in task_names()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
