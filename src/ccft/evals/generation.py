"""Generation for the eval runner: one (or n sampled) completions per item under a mode, scored by the task.

The decode path is ``ccft.core.generation.generate`` (the reference; every mode) or, with
``EvalSettings.engine``, ``ccft.inference.SharedPrefillEngine`` for the shared-prefill modes
(``Mode.shared_prefill``: ``naive``, ``prefillshare``); both are tested to give the same texts.
Items with different stop strings are generated in separate groups; sample ``s`` of every item
uses seed ``settings.seed + s`` in every mode. The texts are scored by the task only
(``ccft.evals.protocol.score_texts``): one scoring rule for ``ccft eval`` and ``ccft demo``.
"""

from __future__ import annotations

from typing import Sequence

from ccft.core.cache import BaseCache
from ccft.core.errors import ConfigError
from ccft.core.generation import Generation, generate
from ccft.core.modes import get_mode
from ccft.core.sampling import SamplingParams
from ccft.evals.protocol import normalize_scores, score_extras, score_texts, task_stop
from ccft.evals.scoring import Prepared
from ccft.evals.settings import EvalSettings, ModeSpec

__all__ = ["engine_generate", "generate_samples", "make_engine", "merge_samples"]


def make_engine(base, modes: Sequence[ModeSpec], max_batch: int = 16):
    """A ``SharedPrefillEngine`` holding the decoders of the shared-prefill modes, keyed by mode name.

    Raises:
        ConfigError: ``ccft.inference`` cannot be imported in this installation.
    """
    try:
        from ccft.inference import SharedPrefillEngine
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise ConfigError(f"--engine needs ccft.inference.SharedPrefillEngine ({e})") from e
    decs = {s.mode: s.decoder for s in modes if get_mode(s.mode).shared_prefill}
    return SharedPrefillEngine(base, decoders=decs, max_batch=max_batch)


def engine_generate(engine, mode: str, prompts: Sequence[Sequence[int]], *, handoff_tokens: int, max_new_tokens: int,
                    stop: Sequence[str], do_sample: bool, temperature: float, top_p: float,
                    seed: int) -> list[Generation]:
    """Prefill ``prompts`` with the engine's base and decode them with the decoder registered as ``mode``."""
    sampling = SamplingParams(do_sample=do_sample, temperature=temperature, top_p=top_p, seed=seed)
    with engine.prefill(prompts, handoff_tokens=handoff_tokens) as handle:
        return engine.generate(handle, decoder=mode, max_new_tokens=max_new_tokens, stop=stop, sampling=sampling)


def generate_samples(task, spec: ModeSpec, base, prep: Prepared, rows: Sequence[int], settings: EvalSettings, *,
                     cache: BaseCache | None = None, engine=None) -> list[list[dict]]:
    """Generate and score items ``rows`` (indices into ``prep``) under ``spec.mode``.

    Args:
        cache: ``C_base`` of exactly ``rows``' prompts (shared-prefill modes; computed when None).
        engine: a ``make_engine`` engine (shared-prefill modes decode through it when given).
    Returns:
        per row, one sample dict per sample: ``text``, ``finish_reason`` (``eos`` | ``stop`` | ``length``),
        ``new_tokens``, ``scores`` (``{metric: float}``) and ``score_details`` when the task returns any.
    """
    mode = get_mode(spec.mode)
    k = settings.handoff_tokens
    prompts = [prep.prompts[i] for i in rows]
    max_new = settings.resolved_max_new_tokens(task)
    n_samples = settings.resolved_samples(task)
    sampling = settings.sampling(task)
    groups: dict[tuple, list[int]] = {}
    for j, i in enumerate(rows):
        groups.setdefault(tuple(task_stop(task, prep.items[i])), []).append(j)
    samples: list[list[dict]] = [[] for _ in rows]
    for stop, js in groups.items():
        c = cache.select(js) if cache is not None and len(js) < len(rows) else cache
        for s in range(n_samples):
            if engine is not None and mode.shared_prefill:
                gens = engine_generate(engine, spec.mode, [prompts[j] for j in js], handoff_tokens=k,
                                       max_new_tokens=max_new, stop=list(stop), seed=settings.seed + s, **sampling)
            else:
                gens = generate([prompts[j] for j in js], mode=spec.mode, base=base, decoder=spec.decoder, cache=c,
                                handoff_tokens=k, max_new_tokens=max_new, stop=list(stop), seed=settings.seed + s,
                                batch_size=len(js), **sampling)
            raws = score_texts(task, [(prep.items[rows[j]], g.text) for j, g in zip(js, gens, strict=True)])
            for j, g, raw in zip(js, gens, raws, strict=True):
                sample = {"text": g.text, "finish_reason": g.finish_reason, "new_tokens": len(g.token_ids),
                          "scores": normalize_scores(raw)}
                extra = score_extras(raw)
                if extra:
                    sample["score_details"] = extra
                samples[j].append(sample)
    return samples


def merge_samples(record: dict, samples: Sequence[dict]) -> dict:
    """Put an item's samples into its record: the first sample's fields; with n > 1 samples, each metric's mean
    over the samples that report it as ``scores`` and the samples themselves as ``samples``."""
    record.update(samples[0])
    if len(samples) > 1:
        keys = sorted({k for x in samples for k in x["scores"]})
        record["scores"] = {k: sum(x["scores"][k] for x in samples if k in x["scores"])
                            / max(1, sum(k in x["scores"] for x in samples)) for k in keys}
        record["samples"] = list(samples)
    return record
