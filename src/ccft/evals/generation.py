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

from dataclasses import dataclass
from typing import Callable, Sequence

from ccft.core.cache import BaseCache
from ccft.core.errors import ConfigError
from ccft.core.generation import Generation, generate
from ccft.core.modes import get_mode
from ccft.core.sampling import DecodeParams, SamplingParams
from ccft.evals.protocol import normalize_scores, score_extras, score_texts, task_stop
from ccft.evals.scoring import Prepared, handle_nll
from ccft.evals.settings import EvalSettings, ModeSpec

__all__ = [
    "EvalMemo",
    "GroupPrefill",
    "JointGroup",
    "decode_group_jointly",
    "decode_groups_jointly",
    "decode_jointly",
    "engine_generate",
    "generate_samples",
    "make_engine",
    "merge_samples",
    "producer_of",
]


def make_engine(
    base,
    modes: Sequence[ModeSpec],
    max_batch: int = 16,
    cache_format: str | None = None,
    block_weights: str | None = "off",
):
    """A ``SharedPrefillEngine`` on ``base`` holding every decoder the ``modes`` use, each once (named after
    the first mode that uses it). A decoder reads C_base as the reference path would: at its sharing
    depth (``Decoder.share_from_layer``) and in the format ``ModeSpec.cache_format(cache_format)``
    (``cache_format``: the eval's ``EvalSettings.cache_format``, else the decoder's own; issue 35).
    ``block_weights``: the base lane's weights (``EvalSettings.block_weights``; ``"off"``: fp32).

    Raises:
        ConfigError: ``ccft.inference`` cannot be imported in this installation; ``block_weights="on"`` where
            the block kernel or the GGUF's blocks cannot be used.
    """
    try:
        from ccft.inference import SharedPrefillEngine
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise ConfigError(f"--engine needs ccft.inference.SharedPrefillEngine ({e})") from e
    engine = SharedPrefillEngine(base, max_batch=max_batch, block_weights=block_weights)
    for spec in modes:
        if get_mode(spec.mode).needs_decoder and _registered_name(engine, spec.decoder) is None:
            fmt = spec.cache_format(cache_format) if get_mode(spec.mode).shared_prefill else None
            engine.add_decoder(spec.mode, spec.decoder, cache_format=fmt)
    return engine


def _registered_name(engine, decoder) -> str | None:
    for name, entry in engine.decoders.items():
        if entry.decoder is decoder:
            return name
    return None


def _decoder_name(engine, spec: ModeSpec) -> str:
    """The engine's name of the model that decodes ``spec.mode`` (``"base"`` for mode base)."""
    from ccft.inference import BASE

    if not get_mode(spec.mode).needs_decoder:
        return BASE
    name = _registered_name(engine, spec.decoder)
    if name is None:
        raise ConfigError(
            f"mode {spec.mode!r}: its decoder is not registered in this engine; build the engine "
            "with make_engine(base, modes) over the same ModeSpecs"
        )
    return name


def producer_of(engine, spec: ModeSpec) -> str | None:
    """Who prefills under ``spec.mode`` in ``engine`` (the table in ``ccft.core.modes``): None (the base,
    writing C_base) for ``base`` / ``naive`` / ``prefillshare``; the decoder's engine name for ``full-ft``
    (its own prefill).

    Raises:
        ConfigError: ``spec.decoder`` is not registered in ``engine``.
    """
    mode = get_mode(spec.mode)
    return None if mode.shared_prefill or not mode.needs_decoder else _decoder_name(engine, spec)


def engine_generate(
    engine,
    spec: ModeSpec,
    prompts: Sequence[Sequence[int]] | None,
    *,
    handoff_tokens: int,
    max_new_tokens: int,
    stop: Sequence[str],
    do_sample: bool,
    temperature: float,
    top_p: float,
    seed: int,
    handle=None,
    rows: Sequence[int] | None = None,
) -> list[Generation]:
    """Generate ``prompts`` under ``spec.mode`` with a ``make_engine`` engine (the table in
    ``ccft.core.modes``): the base prefills (C_base) for ``base`` / ``naive`` / ``prefillshare``, the decoder
    itself for ``full-ft``; the base decodes for ``base``, ``spec.decoder`` otherwise.

    With ``handle`` (a prefix the mode's producer already wrote, e.g. ``GroupPrefill.handle``) nothing is
    prefilled: ``rows`` of it are decoded (``prompts`` unused). Row r samples with seed ``seed + r``.

    Raises:
        ConfigError: ``spec.decoder`` is not registered in ``engine`` (build it with ``make_engine``), or
            ``handle`` was written by another producer than the mode's.
    """
    name = _decoder_name(engine, spec)
    producer = producer_of(engine, spec)
    params = DecodeParams(
        max_new_tokens=max_new_tokens,
        stop=stop,
        sampling=SamplingParams(do_sample=do_sample, temperature=temperature, top_p=top_p, seed=seed),
    )
    if handle is not None:
        if handle.producer != (producer or "base"):
            raise ConfigError(
                f"mode {spec.mode!r} decodes on the prefill of {producer or 'base'!r}, but this handle "
                f"was written by {handle.producer!r}"
            )
        return engine.generate(handle, decoder=name, params=params, rows=rows)
    with engine.prefill(prompts, handoff_tokens=handoff_tokens, producer=producer) as handle:
        return engine.generate(handle, decoder=name, params=params)


class GroupPrefill:
    """One group of eval items prefilled once per producer on a ``make_engine`` engine, read by every mode.

    The base's prefill of the group (C_base) serves ``base``, ``naive`` and ``prefillshare``, for their
    generations (decoded on the engine handle) and their reference NLL (``nll``: a teacher-forced engine
    forward over the references on the handle); the Full-FT decoder's own prefill serves ``full-ft`` the
    same way. Per item that is two prompt passes where separate per-mode paths make eight (a forward over
    prompt + reference and a prefill, in four modes). Prefills run lazily, on first use.

    Args:
        engine: a ``make_engine`` engine; prompts: index -> prompt ids of the group's items (keys: the
            runner's item indices); handoff_tokens: k.
    Use as a context manager (or call ``close``): the engine's prefix memory is released on exit.
    """

    def __init__(self, engine, prompts: dict[int, Sequence[int]], handoff_tokens: int):
        self.engine, self.k = engine, int(handoff_tokens)
        self.items = list(prompts)
        self._prompts = [list(prompts[i]) for i in self.items]
        self._row = {i: r for r, i in enumerate(self.items)}
        self._handles: dict[str | None, object] = {}
        #: prefills run so far (one per producer; tests count them)
        self.prefills = 0

    def reserve(self, specs: Sequence[ModeSpec]) -> None:
        """Size the engine's prefix arena once for the prefills ``specs`` will read (one per producer), so
        they do not grow it one by one (``SharedPrefillEngine.reserve_prefix``; memory only, same results)."""
        producers = {producer_of(self.engine, spec) for spec in specs}
        self.engine.reserve_prefix(self._prompts, handoff_tokens=self.k, prefills=len(producers))

    def rows(self, items: Sequence[int]) -> list[int]:
        """The handle rows of ``items`` (runner indices in this group)."""
        return [self._row[i] for i in items]

    def handle(self, spec: ModeSpec):
        """The engine ``PrefixHandle`` the mode's producer wrote over every prompt of the group."""
        producer = producer_of(self.engine, spec)
        if producer not in self._handles:
            self._handles[producer] = self.engine.prefill(
                self._prompts, handoff_tokens=self.k, producer=producer
            )
            self.prefills += 1
        return self._handles[producer]

    def nll(
        self, spec: ModeSpec, items: Sequence[int], references: Sequence[Sequence[int]]
    ) -> list[tuple[float, int]]:
        """(summed NLL, tokens) of each reference after its item's prompt under ``spec.mode``, read from the
        mode's prefill of the group (``ccft.evals.scoring.handle_nll``)."""
        return handle_nll(
            self.engine,
            self.handle(spec),
            self.rows(items),
            _decoder_name(self.engine, spec),
            [self._prompts[self._row[i]] for i in items],
            references,
            handoff_tokens=self.k,
        )

    def release(self, spec: ModeSpec) -> None:
        """Free the prefill ``spec.mode`` reads (when no later mode of the group needs it)."""
        producer = producer_of(self.engine, spec)
        handle = self._handles.pop(producer, None)
        if handle is not None:
            handle.release()

    def close(self) -> None:
        while self._handles:
            self._handles.popitem()[1].release()

    def __enter__(self) -> "GroupPrefill":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def decode_jointly(
    engine,
    jobs: Sequence[tuple[object, str, Sequence[int], Sequence[str]]],
    *,
    max_new_tokens: int | Sequence[int],
    on_row: Callable[[], None] | None = None,
) -> list[list[Generation]]:
    """Greedy-decode several ``(handle, decoder name, rows, stop strings)`` jobs of a ``make_engine`` engine
    in the same engine steps (rows of different decoders and prefills side by side; each row is admitted as
    soon as its lane has a free slot). Per job, one ``Generation`` per row, equal to ``engine.generate`` of
    that job alone (greedy, per-row positions; the engine's step is tested against the reference path).

    Args:
        max_new_tokens: one limit for every job, or one per job.
        on_row: called once per finished row (progress bars).
    Raises:
        whatever a row's step raises (the call's other rows are aborted first).
    """
    limits = (
        [int(max_new_tokens)] * len(jobs)
        if isinstance(max_new_tokens, int)
        else [int(m) for m in max_new_tokens]
    )
    if len(limits) != len(jobs):
        raise ValueError(f"decode_jointly: {len(limits)} max_new_tokens for {len(jobs)} jobs")
    pending = [(j, r) for j, (_, _, rows, _) in enumerate(jobs) for r in rows]
    mine: dict[int, tuple[int, int]] = {}
    results: dict[tuple[int, int], Generation] = {}
    try:
        while pending or mine:
            waiting = []
            for j, r in pending:
                handle, name, _, stop = jobs[j]
                if engine.free_slots(name) > 0:
                    mine[
                        engine.add_request(handle, r, decoder=name, max_new_tokens=limits[j], stop=list(stop))
                    ] = (j, r)
                else:
                    waiting.append((j, r))
            pending = waiting
            if not mine:
                raise ConfigError(
                    f"decode_jointly: no free slot for any of {len(pending)} rows (max_batch="
                    f"{engine.max_batch} rows are active from other requests)"
                )
            for out in engine.step():
                if out.finished and out.request_id in mine:
                    results[mine.pop(out.request_id)] = out.generation
                    if on_row is not None:
                        on_row()
    finally:
        for rid in mine:
            engine.abort(rid)
    return [[results[(j, r)] for r in rows] for j, (_, _, rows, _) in enumerate(jobs)]


@dataclass
class JointGroup:
    """One group's share of a joint decode (``decode_groups_jointly``): the ``task``, its ``specs`` (modes),
    its ``prep``ared items, the items each mode still needs (``rows_by_mode``: mode -> indices into ``prep``,
    all in ``group``), its ``settings`` and the ``GroupPrefill`` holding those items."""

    task: object
    specs: Sequence[ModeSpec]
    prep: Prepared
    rows_by_mode: dict[str, Sequence[int]]
    settings: EvalSettings
    group: "GroupPrefill"


def decode_groups_jointly(
    groups: Sequence[JointGroup], engine, memo: "EvalMemo", *, on_row: Callable[[], None] | None = None
) -> int:
    """Greedy generations of every group's modes' rows decoded in the same engine steps (``decode_jointly``)
    and put in ``memo`` (``ahead=True``), where ``generate_samples`` then finds them. One group's modes share
    the steps (a group of 10 items does not run four short, mostly empty batches), and several groups' too
    (the twelve MultiPL-E languages of 10 items each fill the engine's rows together instead of one language
    at a time). Generations already in ``memo`` are skipped. ``on_row`` is called per decoded row. Returns the
    number of generations decoded.

    Raises:
        ConfigError: a group's settings sample (only greedy generations are kept in a memo).
    """
    jobs, keys, limits = [], [], []
    for g in groups:
        task, settings = g.task, g.settings
        if settings.sampling(task)["do_sample"] or settings.resolved_samples(task) != 1:
            raise ConfigError("decode_groups_jointly: greedy single-sample settings only")
        k = settings.handoff_tokens
        max_new = settings.resolved_max_new_tokens(task)
        for spec in g.specs:
            by_stop: dict[tuple, list[int]] = {}
            for i in g.rows_by_mode.get(spec.mode, ()):
                stop = tuple(task_stop(task, g.prep.items[i]))
                if not memo.has(spec, g.prep.prompts[i], stop, max_new, k):
                    by_stop.setdefault(stop, []).append(i)
            for stop, items in by_stop.items():
                jobs.append((g.group.handle(spec), _decoder_name(engine, spec), g.group.rows(items), stop))
                keys.append((g, spec, items, stop, max_new, k))
                limits.append(max_new)
    if not jobs:
        return 0
    gens = decode_jointly(engine, jobs, max_new_tokens=limits, on_row=on_row)
    for (g, spec, items, stop, max_new, k), out in zip(keys, gens, strict=True):
        for i, gen in zip(items, out, strict=True):
            memo.put(spec, g.prep.prompts[i], stop, max_new, k, gen, ahead=True)
    return sum(map(len, gens))


def decode_group_jointly(
    task,
    specs: Sequence[ModeSpec],
    prep: Prepared,
    rows_by_mode: dict[str, Sequence[int]],
    settings: EvalSettings,
    engine,
    group: "GroupPrefill",
    memo: "EvalMemo",
) -> int:
    """``decode_groups_jointly`` of one group: every mode's ``rows_by_mode[mode]`` (indices into ``prep``, all
    in ``group``) decoded in the same engine steps and put in ``memo``. Returns the number of generations
    decoded.

    Raises:
        ConfigError: the settings sample (only greedy generations are kept in a memo).
    """
    return decode_groups_jointly([JointGroup(task, specs, prep, rows_by_mode, settings, group)], engine, memo)


class EvalMemo:
    """Greedy generations and reference NLLs kept across the tasks of one process, so a task whose items equal
    an earlier task's is scored on the same texts and NLLs instead of computing them again (HumanEval+ has
    HumanEval's prompts and canonical solutions and only adds tests).

    Generations are keyed by mode, decoder object, prompt ids, stop strings, ``max_new_tokens`` and k (greedy
    only: a sampled row's seed depends on its batch); NLLs by mode, decoder object, prompt ids, reference ids
    and k. Pass one to ``run_task(..., memo=...)`` for every task that may share items.
    """

    def __init__(self):
        self._texts: dict[tuple, tuple[str, str, int]] = {}
        self._nlls: dict[tuple, tuple[float, int]] = {}
        self._ahead: set[tuple] = set()
        self._decoders: dict[int, object] = {}  # keeps every keyed decoder alive, so its id() is never reused
        #: generations and NLLs served from the memo
        self.hits = 0
        self.nll_hits = 0

    def _key(self, spec: ModeSpec, prompt: Sequence[int], stop: tuple, max_new: int, k: int) -> tuple:
        self._decoders[id(spec.decoder)] = spec.decoder
        return (spec.mode, id(spec.decoder), tuple(prompt), stop, int(max_new), int(k))

    def get(self, spec, prompt, stop, max_new, k):
        """``(text, finish_reason, new_tokens)`` of an earlier identical generation, or None. A generation put
        with ``ahead=True`` is taken once without counting as a hit (it was decoded for this very item)."""
        key = self._key(spec, prompt, stop, max_new, k)
        hit = self._texts.get(key)
        if key in self._ahead:
            self._ahead.discard(key)
        else:
            self.hits += hit is not None
        return hit

    def has(self, spec, prompt, stop, max_new, k) -> bool:
        """Whether an identical generation is kept (not counted as a hit)."""
        return self._key(spec, prompt, stop, max_new, k) in self._texts

    def put(self, spec, prompt, stop, max_new, k, gen: Generation, *, ahead: bool = False) -> None:
        """Keep ``gen``; ``ahead``: decoded ahead of its own item's ``get`` (``decode_group_jointly``)."""
        key = self._key(spec, prompt, stop, max_new, k)
        self._texts[key] = (gen.text, gen.finish_reason, len(gen.token_ids))
        if ahead:
            self._ahead.add(key)

    def _nll_key(self, spec: ModeSpec, prompt: Sequence[int], reference: Sequence[int], k: int) -> tuple:
        self._decoders[id(spec.decoder)] = spec.decoder
        return ("nll", spec.mode, id(spec.decoder), tuple(prompt), tuple(reference), int(k))

    def get_nll(self, spec, prompt, reference, k) -> tuple[float, int] | None:
        """``(summed NLL, tokens)`` of ``reference`` after ``prompt`` computed earlier under the same mode, or
        None (one put with ``ahead=True`` is taken once without counting as a hit)."""
        key = self._nll_key(spec, prompt, reference, k)
        hit = self._nlls.get(key)
        if key in self._ahead:
            self._ahead.discard(key)
        else:
            self.nll_hits += hit is not None
        return hit

    def has_nll(self, spec, prompt, reference, k) -> bool:
        """Whether an NLL of ``reference`` after ``prompt`` under the same mode is kept (not counted as a
        hit)."""
        return self._nll_key(spec, prompt, reference, k) in self._nlls

    def put_nll(self, spec, prompt, reference, k, nll: tuple[float, int], *, ahead: bool = False) -> None:
        """Keep ``nll``; ``ahead``: computed ahead of its own item's ``get_nll``
        (``ccft.evals.runner.decode_ahead``)."""
        key = self._nll_key(spec, prompt, reference, k)
        self._nlls[key] = (float(nll[0]), int(nll[1]))
        if ahead:
            self._ahead.add(key)


def generate_samples(
    task,
    spec: ModeSpec,
    base,
    prep: Prepared,
    rows: Sequence[int],
    settings: EvalSettings,
    *,
    cache: BaseCache | None = None,
    engine=None,
    memo: EvalMemo | None = None,
    group: GroupPrefill | None = None,
) -> list[list[dict]]:
    """Generate and score items ``rows`` (indices into ``prep``) under ``spec.mode``.

    Args:
        cache: ``C_base`` of exactly ``rows``' prompts (shared-prefill modes; computed when None).
        engine: a ``make_engine`` engine (every mode decodes through it when given).
        memo: greedy texts of earlier identical generations, reused instead of decoding (``EvalMemo``).
        group: with ``engine``, a ``GroupPrefill`` holding ``rows``: decode on its prefill instead of
            prefilling.
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
                on = (
                    {}
                    if group is None
                    else {"handle": group.handle(spec), "rows": group.rows([rows[j] for j in todo])}
                )
                gens = engine_generate(
                    engine,
                    spec,
                    [prompts[j] for j in todo],
                    handoff_tokens=k,
                    max_new_tokens=max_new,
                    stop=list(stop),
                    seed=settings.seed + s,
                    **sampling,
                    **on,
                )
            elif todo:
                c = cache.select(todo) if cache is not None and len(todo) < len(rows) else cache
                gens = generate(
                    [prompts[j] for j in todo],
                    mode=spec.mode,
                    base=base,
                    decoder=spec.decoder,
                    cache=c,
                    handoff_tokens=k,
                    max_new_tokens=max_new,
                    stop=list(stop),
                    seed=settings.seed + s,
                    batch_size=len(todo),
                    cache_format=spec.cache_format(settings.cache_format),
                    **sampling,
                )
            for j, g in zip(todo, gens if todo else [], strict=True):
                outs[j] = (g.text, g.finish_reason, len(g.token_ids))
                if memo is not None:
                    memo.put(spec, prompts[j], stop, max_new, k, g)
            raws = score_texts(task, [(prep.items[rows[j]], outs[j][0]) for j in js])
            for j, raw in zip(js, raws, strict=True):
                text, finish, n_new = outs[j]
                sample = {
                    "text": text,
                    "finish_reason": finish,
                    "new_tokens": n_new,
                    "scores": normalize_scores(raw),
                }
                extra = score_extras(raw)
                if extra:
                    sample["score_details"] = extra
                samples[j].append(sample)
    return samples


def merge_samples(record: dict, samples: Sequence[dict]) -> dict:
    """Put an item's samples into its record: the first sample's fields; with n > 1 samples, each metric's
    mean over the samples that report it as ``scores`` and the samples themselves as ``samples``."""
    record.update(samples[0])
    if len(samples) > 1:
        keys = sorted({k for x in samples for k in x["scores"]})
        record["scores"] = {
            k: sum(x["scores"][k] for x in samples if k in x["scores"])
            / max(1, sum(k in x["scores"] for x in samples))
            for k in keys
        }
        record["samples"] = list(samples)
    return record
