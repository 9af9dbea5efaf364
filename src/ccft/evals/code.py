"""Code-generation tasks: program assembly, sandboxed verdict per sample, unbiased pass@k.

A code task builds one program per (item, generation) — prompt + truncated completion + tests —
and runs it with :func:`ccft.evals.execution.run_program` (a fresh sandbox per program). ``score``
returns ``{"passed": 0.0 | 1.0}``; ``aggregate`` turns the per-item samples into ``pass@k`` for
every k ≤ n with the unbiased estimator (Chen et al. 2021; ``ccft.evals.stats.pass_at_k``), so
greedy (n = 1) gives ``pass@1`` = fraction solved.

Scoring many samples: ``score_many([(item, generation), ...], workers=...)`` runs the programs in
parallel and returns score dicts in order (``score`` is the one-sample form). ``last_results``
keeps the :class:`~ccft.evals.execution.ExecResult` of each program (status, output tail) for
result files.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ccft.evals.execution import ExecResult, check_language, run_programs
from ccft.evals.task_base import Item, Task, pass_at_k_summary, sample_counts

__all__ = ["CodeTask"]


@dataclass
class CodeTask(Task):
    """Base of HumanEval(+) and MultiPL-E; subclasses define ``language`` and ``build_program``."""

    prompt_style: str = "completion"
    language: str = "python"
    timeout_s: float = 10.0
    metrics: tuple[str, ...] = ("pass@1",)
    primary_metric: str = "passed"  # per item: the share of its samples that pass; its mean is pass@1 (n = 1)
    workers: int = 0  # 0 = os.cpu_count()
    last_results: list = field(default_factory=list, repr=False, compare=False)

    def build_program(self, item: Item, completion: str) -> tuple[str, dict]:  # pragma: no cover - abstract
        """(source, run_program keyword arguments) for ``completion`` (already post-processed)."""
        raise NotImplementedError

    def job(self, item: Item, generation: str) -> dict:
        source, kwargs = self.build_program(item, self.postprocess(item, generation))
        kwargs = dict(kwargs)
        kwargs.setdefault("timeout_s", self.timeout_s)
        return {"lang_name": self.language, "source": source, **kwargs}

    def verdict(self, item: Item, result: ExecResult) -> bool:
        return result.passed

    def score_many(
        self, pairs: Sequence[tuple[Item, str]], workers: int | None = None
    ) -> list[dict[str, float]]:
        """Scores of many (item, generation) pairs, programs run in parallel sandboxes."""
        av = check_language(self.language)
        if not av.available:
            self.last_results = [ExecResult(False, "unavailable", av.reason, self.language) for _ in pairs]
            return [{"available": 0.0} for _ in pairs]
        jobs = [self.job(item, gen) for item, gen in pairs]
        results = run_programs(jobs, workers=workers or self.workers or os.cpu_count() or 1)
        self.last_results = results
        return [{"passed": float(self.verdict(item, r))} for (item, _), r in zip(pairs, results, strict=True)]

    def score(self, item: Item, generation: str) -> dict[str, float]:
        return self.score_many([(item, generation)], workers=1)[0]

    def aggregate(self, per_item: Mapping[str, Sequence[Mapping[str, float]]]) -> dict[str, float]:
        out: dict[str, float] = {}
        scored = {k: v for k, v in per_item.items() if v and "passed" in v[0]}
        out.update(pass_at_k_summary(scored, key="passed"))
        if scored:
            out["passed"] = sum(s["passed"] for v in scored.values() for s in v) / sum(
                len(v) for v in scored.values()
            )
        unavailable = len(per_item) - len(scored)
        if unavailable:
            out["unavailable_items"] = float(unavailable)
        out.update(sample_counts(per_item))
        return out

    def per_item_scores(
        self, per_item: Mapping[str, Sequence[Mapping[str, float]]], metric: str | None = None
    ) -> dict[str, float]:
        """pass@1 per item (= fraction of its samples that passed), for paired bootstraps."""
        return {
            k: sum(s["passed"] for s in v) / len(v) for k, v in per_item.items() if v and "passed" in v[0]
        }

    def reference_text(self, item: Item) -> str | None:
        return item.reference if isinstance(item.reference, str) and item.reference else None

    def describe(self) -> dict:
        d = super().describe()
        d.update(language=self.language, timeout_s=self.timeout_s)
        return d
