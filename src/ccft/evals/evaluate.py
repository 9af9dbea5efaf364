"""The demo's evaluation (``ccft demo``): the four modes on held-out items, through the eval runner.

``evaluate_decoders`` is ``ccft eval`` with the demo's settings (a recipe's ``eval:`` section,
``ccft.train.config.EvalConfig``): the task ``ecfg.task`` from the task registry
(``ccft.evals.tasks``; GSM8K for the demo), the response NLL per token on its first ``nll_rows``
items, greedy generations scored by the task on the first ``em_rows`` of them, every mode of
``ecfg.modes`` on the same prompt ids. Which decoder runs a mode is ``ccft.core.modes``'s rule,
the prompts are rendered the way the decoders were trained (``ccft.evals.prompting``), and the
generations are scored by the task (a copy of the question at the start of a generation is dropped
before scoring, K7 in docs/design.md, "Fault classes"); the same functions serve ``ccft eval``.
The results are a runner task folder (``OUT/TASK/``: ``meta.json``, ``items.MODE.jsonl``,
``summary.json``), resumable, and read by ``ccft report``.

(This module was the demo's own evaluation stack in ccft 0.1; ``hardware`` now lives in
``ccft.evals.results`` and is re-exported here.)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ccft.core.decoder import Decoder
from ccft.core.deprecation import moved_name_getattr
from ccft.evals.prompting import resolve_prompt_format
from ccft.evals.protocol import get_task
from ccft.evals.results import hardware
from ccft.evals.runner import TaskResult, run_task
from ccft.evals.settings import EvalSettings, mode_specs, shared_handoff

__all__ = ["demo_settings", "evaluate_decoders", "hardware"]


def demo_settings(ecfg, decoders: Mapping[str, Decoder], *, prompt_format: str = "decoder") -> EvalSettings:
    """``EvalSettings`` for a recipe's ``eval:`` section and the decoders it evaluates.

    Args:
        ecfg: ``ccft.train.config.EvalConfig`` (``nll_rows``, ``em_rows``, ``max_new_tokens``, ``seed``,
            ``engine``).
        decoders: ``{method: Decoder}``; their ``handoff_tokens`` and recorded recipe set the handoff and
            prompts.
        prompt_format: ``"decoder"`` (the decoders' training format) or ``"task"``.
    Raises:
        ConfigError: decoders with different ``handoff_tokens`` or prompt formats.
    """
    return EvalSettings(
        limit=ecfg.nll_rows,
        generate_limit=ecfg.em_rows,
        max_new_tokens=ecfg.max_new_tokens,
        seed=ecfg.seed,
        handoff_tokens=shared_handoff(decoders.values()),
        prompt_format=resolve_prompt_format(prompt_format, decoders.values()),
        engine=ecfg.engine,
    )


def evaluate_decoders(
    base,
    decoders: Mapping[str, Decoder],
    ecfg,
    out_dir: str | Path,
    *,
    decoder_paths: Mapping[str, str] | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> TaskResult:
    """Run ``ecfg.modes`` of ``ecfg.task`` into ``out_dir/TASK/`` (see the module docstring); resumes a
    folder.

    Args:
        base: the frozen ``ccft.Base``; decoders: ``{"ccft": Decoder, "full-ft": Decoder}`` (the modes in
            ``ecfg.modes`` need theirs); decoder_paths: ``{method: folder}`` recorded in ``meta.json``.
        ecfg: ``ccft.train.config.EvalConfig``; ``batch_size`` and ``bootstrap`` are used as given.
    Returns:
        the runner's ``TaskResult`` (summary in the runner's format, item records per mode).
    Raises:
        ConfigError: an unknown task or mode, a missing decoder, or a folder holding another run.
    """
    task = get_task(ecfg.task)
    specs = mode_specs(ecfg.modes, decoders, decoder_paths)
    return run_task(
        task,
        base,
        specs,
        out_dir,
        settings=demo_settings(ecfg, decoders),
        batch_size=ecfg.batch_size,
        progress=progress,
        overwrite=overwrite,
        n_resamples=ecfg.bootstrap,
    )


__getattr__ = moved_name_getattr(__name__)  # 0.1 names: ccft.core.deprecation.MOVED_NAMES
