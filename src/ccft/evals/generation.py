"""Generation for the eval runner: one (or n sampled) completions per item under a mode, scored by the task.

The decode path is ``ccft.core.generation.generate`` (the reference; every mode) or, with
``EvalSettings.engine``, ``ccft.inference.SharedPrefillEngine`` for every mode: ``naive`` and
``prefillshare`` decode on the base's prefill (C_base), ``base`` is the base decoding its own prefill,
and ``full-ft`` is the Full-FT decoder's own prefill (``prefill(producer=...)``, the no-share path)
decoded by it; both paths are tested to give the same texts. A decoder used by two modes (the
Full-FT decoder: ``full-ft`` and ``naive``) is registered once.
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

__all__ = ["GenerationMemo", "engine_generate", "generate_samples", "make_engine", "merge_samples"]


def make_engine(base, modes: Sequence[ModeSpec], max_batch: int = 16):
    """A ``SharedPrefillEngine`` on ``base`` holding every decoder the ``modes`` use, each once (named after
    the first mode that uses it).

    Raises:
        ConfigError: ``ccft.inference`` cannot be imported in this installation.
    """
    try:
        from ccft.inference import SharedPrefillEngine
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise ConfigError(f"--engine needs ccft.inference.SharedPrefillEngine ({e})") from e
    engine = SharedPrefillEngine(base, max_batch=max_batch)
    for spec in modes:
        if get_mode(spec.mode).needs_decoder and _registered_name(engine, spec.decoder) is None:
            engine.add_decoder(spec.mode, spec.decoder)
    return engine


def _registered_name(engine, decoder) -> str | None:
    for name, entry in engine.decoders.items():
        if entry.decoder is decoder:
            return name
    return None


def engine_generate(engine, spec: ModeSpec, prompts: Sequence[Sequence[int]], *, handoff_tokens: int,
                    max_new_tokens: int, stop: Sequence[str], do_sample: bool, temperature: float, top_p: float,
                    seed: int) -> list[Generation]:
    """Generate ``prompts`` under ``spec.mode`` with a ``make_engine`` engine (the table in ``ccft.core.modes``):
    the base prefills (C_base) for ``base`` / ``naive`` / ``prefillshare``, the decoder itself for ``full-ft``;
    the base decodes for ``base``, ``spec.decoder`` otherwise.

    Raises:
        ConfigError: ``spec.decoder`` is not registered in ``engine`` (build it with ``make_engine``).
    """
    from ccft.inference import BASE

    mode = get_mode(spec.mode)
    name = BASE
    if mode.needs_decoder:
        name = _registered_name(engine, spec.decoder)
        if name is None:
            raise ConfigError(f"mode {spec.mode!r}: its decoder is not registered in this engine; build the engine "
                              "with make_engine(base, modes) over the same ModeSpecs")
    producer = None if mode.shared_prefill or not mode.needs_decoder else name
    sampling = SamplingParams(do_sample=do_sample, temperature=temperature, top_p=top_p, seed=seed)
    with engine.prefill(prompts, handoff_tokens=handoff_tokens, producer=producer) as handle:
        return engine.generate(handle, decoder=name, max_new_tokens=max_new_tokens, stop=stop, sampling=sampling)


class GenerationMemo:
    """Greedy generations kept across the tasks of one process, so a task whose prompts, stop strings and
    settings equal an earlier task's is scored on the same texts instead of decoding them again
    (HumanEval+ has HumanEval's prompts and only adds tests). Keyed by mode, decoder object, prompt ids,
    stop strings, ``max_new_tokens`` and k; greedy only (a sampled row's seed depends on its batch).
    Pass one to ``run_task(..., memo=...)`` for every task that may share items.
    """

    def __init__(self):
        self._texts: dict[tuple, tuple[str, str, int]] = {}
        self._decoders: dict[int, object] = {}  # keeps every keyed decoder alive, so its id() is never reused
        self.hits = 0

    def _key(self, spec: ModeSpec, prompt: Sequence[int], stop: tuple, max_new: int, k: int) -> tuple:
        self._decoders[id(spec.decoder)] = spec.decoder
        return (spec.mode, id(spec.decoder), tuple(prompt), stop, int(max_new), int(k))

    def get(self, spec, prompt, stop, max_new, k):
        """``(text, finish_reason, new_tokens)`` of an earlier identical generation, or None."""
        hit = self._texts.get(self._key(spec, prompt, stop, max_new, k))
        self.hits += hit is not None
        return hit

    def put(self, spec, prompt, stop, max_new, k, gen: Generation) -> None:
        self._texts[self._key(spec, prompt, stop, max_new, k)] = (gen.text, gen.finish_reason, len(gen.token_ids))


def generate_samples(task, spec: ModeSpec, base, prep: Prepared, rows: Sequence[int], settings: EvalSettings, *,
                     cache: BaseCache | None = None, engine=None,
                     memo: GenerationMemo | None = None) -> list[list[dict]]:
    """Generate and score items ``rows`` (indices into ``prep``) under ``spec.mode``.

    Args:
        cache: ``C_base`` of exactly ``rows``' prompts (shared-prefill modes; computed when None).
        engine: a ``make_engine`` engine (every mode decodes through it when given).
        memo: greedy texts of earlier identical generations, reused instead of decoding (``GenerationMemo``).
    Returns:
        per row, one sample dict per sample: ``text``, ``finish_reason`` (``eos`` | ``stop`` | ``length``),
        ``new_tokens``, ``scores`` (``{metric: float}``) and ``score_details`` when the task returns any.
    """
    k = settings.handoff_tokens
    prompts = [prep.prompts[i] for i in rows]
    max_new = settings.resolved_max_new_tokens(task)
    n_samples = settings.resolved_samples(task)
    sampling = settings.sampling(task)
    groups: dict[tuple, list[int]] = {}
    for j, i in enumerate(rows):
        groups.setdefault(tuple(task_stop(task, prep.items[i])), []).append(j)
    samples: list[list[dict]] = [[] for _ in rows]
    if sampling["do_sample"]:
        memo = None
    for stop, js in groups.items():
        for s in range(n_samples):
            known = {j: memo.get(spec, prompts[j], stop, max_new, k) for j in js} if memo is not None else {}
            todo = [j for j in js if known.get(j) is None]
            outs = {j: known[j] for j in js if known.get(j) is not None}
            if todo and engine is not None:
                gens = engine_generate(engine, spec, [prompts[j] for j in todo], handoff_tokens=k,
                                       max_new_tokens=max_new, stop=list(stop), seed=settings.seed + s, **sampling)
            elif todo:
                c = cache.select(todo) if cache is not None and len(todo) < len(rows) else cache
                gens = generate([prompts[j] for j in todo], mode=spec.mode, base=base, decoder=spec.decoder, cache=c,
                                handoff_tokens=k, max_new_tokens=max_new, stop=list(stop), seed=settings.seed + s,
                                batch_size=len(todo), **sampling)
            for j, g in zip(todo, gens if todo else [], strict=True):
                outs[j] = (g.text, g.finish_reason, len(g.token_ids))
                if memo is not None:
                    memo.put(spec, prompts[j], stop, max_new, k, g)
            raws = score_texts(task, [(prep.items[rows[j]], outs[j][0]) for j in js])
            for j, raw in zip(js, raws, strict=True):
                text, finish, n_new = outs[j]
                sample = {"text": text, "finish_reason": finish, "new_tokens": n_new,
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
