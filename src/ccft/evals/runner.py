"""Evaluation runner: any task, the four modes, the same items and decoding settings, resumable per item.

The one evaluation stack of ccft: ``ccft eval``, ``ccft demo`` (``ccft.evals.evaluate``) and the
sharing sweep all score through it. For every mode (``ccft.core.modes``; docs/design.md, "Modes") and
every item of a task, the runner computes the response NLL per token on the task's reference answer
(teacher-forced, ``ccft.evals.scoring``; naive and prefillshare read ``C_base`` computed by the
frozen base for the very same prompt ids) and, unless ``generate=False``, one greedy generation (or
n samples) scored by the task (``ccft.evals.generation``). Modes differ only in who prefills and
who decodes: items, prompt ids (``ccft.evals.prompting``), stop strings, ``max_new_tokens`` and
sampling settings are shared (``ccft.evals.settings``).

Output: ``OUT/TASK/`` with ``meta.json``, ``items.MODE.jsonl`` and ``summary.json``
(``ccft.evals.results``; the record and summary format is ``ccft.evals.records``). An interrupted
run (Ctrl-C, kill, crash) resumes: items already in ``items.MODE.jsonl`` are read back and never
recomputed; a torn last line is dropped. Batch size does not enter the settings: results do not
depend on it (greedy decoding, per-row positions; tested at batch 1 vs 8, K7 in docs/design.md,
"Fault classes").

The task interface is ``ccft.evals.protocol``'s.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from ccft.core.cache import compute_base_cache
from ccft.core.modes import MODES, REFERENCE_MODE, check_mode, get_mode
from ccft.evals.generation import (
    EvalMemo,
    GroupPrefill,
    JointGroup,
    decode_group_jointly,
    decode_groups_jointly,
    generate_samples,
    make_engine,
    merge_samples,
    producer_of,
)
from ccft.evals.protocol import (
    accepts_arg,
    get_task,
    primary_metric_of,
    task_description,
    task_name,
    task_names,
)
from ccft.evals.records import paired_deltas_by_id, summarize_records, summarize_task
from ccft.evals.results import (
    FolderConflictError,
    append_jsonl,
    check_resumable,
    clear_task_folder,
    describe_base,
    folder_records,
    hardware,
    load_task_folder,
    read_jsonl,
    write_json,
)
from ccft.evals.scoring import NLL_TOKENS, Prepared, batch_nll, length_chunks, prepare, prompt_hash
from ccft.evals.settings import EvalSettings, ModeSpec

__all__ = [
    "EvalMemo",
    "MODES",
    "decode_ahead",
    "REFERENCE_MODE",
    "EvalSettings",
    "ModeSpec",
    "TaskResult",
    "batch_nll",
    "get_task",
    "load_task_folder",
    "paired_deltas_by_id",
    "prepare",
    "read_jsonl",
    "run_mode_batch",
    "run_task",
    "summarize_records",
    "summarize_task",
    "task_names",
]


@dataclass
class TaskResult:
    """What ``run_task`` returns (and writes as ``summary.json``)."""

    summary: dict
    records: dict[str, list[dict]] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)  # items computed in this call, per mode


#: with the engine, items per generation call = this × batch_size (continuous batching over them)
ENGINE_BATCHES_PER_CALL = 4


def run_mode_batch(
    task,
    spec: ModeSpec,
    base,
    prep: Prepared,
    rows: Sequence[int],
    settings: EvalSettings,
    *,
    score: bool = True,
    engine=None,
    nll_batch_size: int | None = None,
    memo: EvalMemo | None = None,
    group: GroupPrefill | None = None,
) -> list[dict]:
    """Score items ``rows`` (indices into ``prep``) under one mode; returns one record per item.

    The reference NLL runs in forwards of ``nll_batch_size`` rows (default: all of ``rows``); the
    shared-prefill modes compute ``C_base`` once per such forward, and the reference generation path
    reuses it when ``rows`` is one forward. With ``engine`` every row not already in ``memo`` (``run_task``
    puts a group's greedy generations there first, ``decode_group_jointly``) is generated in one engine call
    (its rows are refilled as others finish: continuous batching). With ``group`` (a ``GroupPrefill``
    holding ``rows``; needs ``engine``) nothing is prefilled here: the NLL reads the group's prefill of
    the mode's producer (rows of similar reference length in one forward of at most ``NLL_TOKENS``
    tokens, unless one row is longer: little padding) and the engine decodes on it. Items past
    ``settings.generate_limit`` and every item when ``score=False`` (a task whose toolchain is unavailable)
    get the reference NLL only. ``memo`` (``EvalMemo``): NLLs and greedy generations an earlier task computed
    for the same mode, decoder, prompt and reference / settings are taken from it, and the new ones put in it.
    """
    if group is not None and engine is None:
        raise ValueError("run_mode_batch: group needs the engine it was prefilled on")
    k = settings.handoff_tokens
    prompts = [prep.prompts[i] for i in rows]
    shared = get_mode(spec.mode).shared_prefill
    step = max(1, int(nll_batch_size or len(rows)))
    records = [
        {
            "id": prep.ids[i],
            "index": i,
            "prompt_sha": prompt_hash(prep.prompts[i]),
            "prompt_tokens": len(prep.prompts[i]),
        }
        for i in rows
    ]
    refs = [prep.references[i] for i in rows]
    todo = set()  # rows whose reference NLL is computed here (the others come from the memo)
    for j, ref in enumerate(refs):
        hit = memo.get_nll(spec, prompts[j], ref, k) if memo is not None and ref is not None else None
        if hit is not None:
            records[j].update(nll=hit[0] / max(hit[1], 1), nll_sum=hit[0], nll_tokens=hit[1])
        elif ref is not None:
            todo.add(j)

    def nll_of(js: list[int], source) -> None:  # source: the rows' C_base (or None), or the GroupPrefill
        if isinstance(source, GroupPrefill):
            nlls = source.nll(spec, [rows[j] for j in js], [refs[j] for j in js])
        else:
            nlls = batch_nll(
                spec.mode,
                base,
                spec.decoder,
                [prompts[j] for j in js],
                [refs[j] for j in js],
                handoff_tokens=k,
                cache=source,
                cache_format=spec.cache_format(settings.cache_format),
            )
        for j, (s, n) in zip(js, nlls, strict=True):
            records[j].update(nll=s / max(n, 1), nll_sum=s, nll_tokens=n)
            if memo is not None:
                memo.put_nll(spec, prompts[j], refs[j], k, (s, n))

    cache = None
    if (
        group is not None
    ):  # the group's prefill is every row's prefix: forwards of rows of similar reference length
        for part in length_chunks({j: len(refs[j]) + k for j in todo}, step, NLL_TOKENS):
            nll_of(part, group)
    else:
        for c0 in range(0, len(rows), step):
            part = list(range(c0, min(c0 + step, len(rows))))
            with_ref = [j for j in part if j in todo]
            cache = (
                compute_base_cache(base, [prompts[j] for j in part], handoff_tokens=k)
                if shared and with_ref
                else None
            )
            if with_ref:
                sub = (
                    cache.select([j - c0 for j in with_ref])
                    if cache is not None and len(with_ref) < len(part)
                    else cache
                )
                nll_of(with_ref, sub)
    gen = [j for j, i in enumerate(rows) if score and settings.generates(i)]
    if gen:
        sub = None  # one C_base for NLL and the reference generation when the rows were one forward
        if cache is not None and engine is None and step >= len(rows):
            sub = cache.select(gen) if len(gen) < len(rows) else cache
        samples = generate_samples(
            task,
            spec,
            base,
            prep,
            [rows[j] for j in gen],
            settings,
            cache=sub,
            engine=engine,
            memo=memo,
            group=group,
        )
        for j, smp in zip(gen, samples, strict=True):
            merge_samples(records[j], smp)
    return records


def _check_environment(task, settings: EvalSettings):
    """K8 (docs/design.md, "Fault classes"): the task's execution environment, checked before any model is
    scored."""
    if not (settings.generate and hasattr(task, "check_environment")):
        return None
    fn = task.check_environment
    return fn(settings.limit) if accepts_arg(fn) else fn()


def _done_records(folder: Path, prep: Prepared, specs: Sequence[ModeSpec]) -> dict[str, dict[str, dict]]:
    """mode -> item id -> record already in ``folder/items.MODE.jsonl`` for the items of ``prep`` (the resume
    rule).

    Raises:
        FolderConflictError: a record was computed on another prompt than the item's now.
    """
    index_of = {x: i for i, x in enumerate(prep.ids)}
    done: dict[str, dict[str, dict]] = {}
    for spec in specs:
        path = folder / f"items.{spec.mode}.jsonl"
        done[spec.mode] = {}
        for r in read_jsonl(path):
            i = index_of.get(r["id"])
            if i is None:
                continue  # an item outside the current limit: kept in the file, not in this summary
            if r.get("prompt_sha") != prompt_hash(prep.prompts[i]):
                raise FolderConflictError(
                    f"{path}: item {r['id']} was evaluated on another prompt (the task's data or "
                    "prompting changed); pass --overwrite or use another --out folder"
                )
            done[spec.mode][r["id"]] = r
    return done


def decode_ahead(
    tasks: Sequence[tuple[object, EvalSettings]],
    base,
    modes: Sequence[ModeSpec],
    out_dir: str | Path,
    *,
    memo: EvalMemo,
    batch_size: int = 8,
    overwrite: bool = False,
    progress: bool = True,
) -> int:
    """Greedy generations and reference NLLs of several small tasks' pending items, every mode, computed in
    one engine decode and put in ``memo``, so that ``run_task(task, ..., memo=memo)`` for each of them then
    only scores and writes (same records as without it: greedy results do not depend on batching, K7 in
    docs/design.md, "Fault classes").

    For tasks too small to fill the engine's rows alone (MultiPL-E: 10 items per language): every task's items
    are one ``GroupPrefill`` (one prefill per producer, as for one task: a step's attention reads two
    prefixes, not two per task), and every task's modes' rows decode in the same engine steps
    (``decode_groups_jointly``), so the engine stays full across tasks instead of draining at the end of each
    task. Items already in ``out_dir/TASK/items.MODE.jsonl`` are skipped (``overwrite``: none are, as
    ``run_task(overwrite=True)`` discards them); sampled settings and ``settings.engine=False`` tasks are left
    to ``run_task``. Every task's prompts stay prefilled until the decode ends: pass small tasks.

    Args:
        tasks: ``(task, EvalSettings)`` pairs, the settings ``run_task`` will get for each.
        base, modes, batch_size: as for ``run_task`` (the engine decodes ``batch_size`` rows at a time).
    Returns:
        the number of generations decoded.
    Raises:
        ConfigError: a mode without its decoder; FolderConflictError: as ``run_task``.
    """
    for spec in modes:
        check_mode(spec.mode, spec.decoder)
    wanted = [
        (task, st)
        for task, st in tasks
        if st.engine and st.generate and not st.sampling(task)["do_sample"] and st.resolved_samples(task) == 1
    ]
    # one engine reads C_base in one format per decoder: tasks asking for different ones are not prefetched
    formats = {(st.cache_format, st.block_weights) for _, st in wanted}
    if not wanted or len(formats) > 1:
        return 0
    cache_format, block_weights = formats.pop()
    engine = make_engine(
        base, modes, max_batch=batch_size, cache_format=cache_format, block_weights=block_weights
    )
    specs = sorted(modes, key=_mode_order)
    joint: list[JointGroup] = []
    prefills: dict[int, GroupPrefill] = {}
    try:
        # every task's items in one prefill per producer (per k): a step then reads two prefills, as in one
        # task, instead of two per task (each prefill's rows are attended to separately in every layer)
        prompts: dict[int, dict[tuple[int, int], Sequence[int]]] = {}
        entries = []
        for t, (task, st) in enumerate(wanted):
            prep = prepare(task, base.tokenizer, st.limit, st.handoff_tokens, st.prompt_format)
            folder = Path(out_dir) / task_name(task)
            done = {s.mode: {} for s in specs} if overwrite else _done_records(folder, prep, specs)
            rows = {
                s.mode: [i for i in range(prep.n) if prep.ids[i] not in done[s.mode] and st.generates(i)]
                for s in specs
            }
            items = sorted(set().union(*rows.values()))
            if items:
                prompts.setdefault(st.handoff_tokens, {}).update({(t, i): prep.prompts[i] for i in items})
                entries.append((t, task, st, prep, rows))
        prefills = {k: GroupPrefill(engine, ps, k) for k, ps in prompts.items()}
        for group in prefills.values():  # one arena growth for every producer's prefill of the group
            group.reserve(specs)
        joint = [
            JointGroup(task, specs, prep, rows, st, _TaskRows(prefills[st.handoff_tokens], t))
            for t, task, st, prep, rows in entries
        ]
        total = sum(len(v) for g in joint for v in g.rows_by_mode.values())
        with tqdm(
            total=total,
            desc=f"decode ahead ({len(joint)} tasks)",
            unit="item",
            disable=not progress,
            dynamic_ncols=True,
            file=sys.stderr,
        ) as bar:
            n = decode_groups_jointly(joint, engine, memo, on_row=lambda: bar.update(1))
        for (
            g
        ) in joint:  # the reference NLLs on the same prefills, rows of similar reference length per forward
            k = g.settings.handoff_tokens
            for spec in g.specs:
                refs = {
                    i: g.prep.references[i]
                    for i in g.rows_by_mode[spec.mode]
                    if g.prep.references[i] is not None
                    and not memo.has_nll(spec, g.prep.prompts[i], g.prep.references[i], k)
                }
                for part in length_chunks({i: len(r) + k for i, r in refs.items()}, batch_size, NLL_TOKENS):
                    for i, nll in zip(part, g.group.nll(spec, part, [refs[i] for i in part]), strict=True):
                        memo.put_nll(spec, g.prep.prompts[i], refs[i], k, nll, ahead=True)
    finally:
        for group in prefills.values():
            group.close()
    return n


class _TaskRows:
    """One task's items in a ``GroupPrefill`` shared by several tasks (keyed ``(task number, item index)``):
    the ``GroupPrefill`` calls ``decode_groups_jointly`` and the NLL make, with the task's own item
    indices."""

    def __init__(self, group: GroupPrefill, task: int):
        self.group, self.task = group, task

    def handle(self, spec: ModeSpec):
        return self.group.handle(spec)

    def rows(self, items: Sequence[int]) -> list[int]:
        return self.group.rows([(self.task, i) for i in items])

    def nll(
        self, spec: ModeSpec, items: Sequence[int], references: Sequence[Sequence[int]]
    ) -> list[tuple[float, int]]:
        return self.group.nll(spec, [(self.task, i) for i in items], references)


def _mode_order(spec: ModeSpec) -> int:
    return MODES.index(spec.mode) if spec.mode in MODES else len(MODES)


def run_task(
    task,
    base,
    modes: Sequence[ModeSpec],
    out_dir: str | Path,
    *,
    settings: EvalSettings | None = None,
    batch_size: int = 8,
    progress: bool = True,
    overwrite: bool = False,
    n_resamples: int = 2000,
    on_item: Callable[[str, dict], None] | None = None,
    memo: EvalMemo | None = None,
) -> TaskResult:
    """Evaluate ``task`` under every mode in ``modes`` into ``out_dir/TASK/``, resuming what is there.

    Args:
        task: a task object (``ccft.evals.protocol``); ``get_task(name)`` gives one.
        base: the frozen ``ccft.Base``; modes: ``ModeSpec`` per mode (decoders already loaded on ``base``).
        settings: ``EvalSettings`` (identical for all modes; stored and checked on resume).
        batch_size: items per forward / generation batch (does not change greedy results); with
            ``settings.engine`` also the engine's rows decoded at once, refilled over
            ``ENGINE_BATCHES_PER_CALL`` batches per generation call.
        overwrite: discard earlier results in the folder instead of resuming.
        n_resamples: bootstrap resamples for the CIs of the summary.
        on_item: called as ``on_item(mode, record)`` after each item is written (progress hooks, tests).
        memo: an ``EvalMemo`` shared with other tasks: reference NLLs and greedy texts of identical items
            (same mode, decoder, prompt and reference, or stop strings and settings) are reused instead of
            computed again.
    Returns:
        TaskResult with the summary (also in ``summary.json``) and every item record per mode.
    Raises:
        ConfigError: a mode without its decoder (``ccft.core.modes.check_mode``).
        FolderConflictError: (a ConfigError) the folder holds a run with other settings, another base, another
            decoder or other prompts.
        EnvironmentCheckError: the task's K8 environment check failed.
    """
    settings = settings or EvalSettings()
    for spec in modes:
        check_mode(spec.mode, spec.decoder)
    name = task_name(task)
    folder = Path(out_dir) / name
    specs = sorted(modes, key=_mode_order)
    # the engine before the folder is touched: one it cannot build (e.g. block_weights="on" without the GGUF's
    # blocks) leaves the folder as it was
    engine = (
        make_engine(
            base,
            specs,
            max_batch=batch_size,
            cache_format=settings.cache_format,
            block_weights=settings.block_weights,
        )
        if settings.engine
        else None
    )
    prep, meta, unavailable = _open_task_folder(task, base, modes, folder, settings, overwrite)
    index_of = {x: i for i, x in enumerate(prep.ids)}
    done = _done_records(folder, prep, specs)
    computed, specs = _run_groups(
        task,
        base,
        engine,
        specs,
        prep,
        folder,
        done,
        settings,
        batch_size=batch_size,
        progress=progress,
        unavailable=unavailable,
        on_item=on_item,
        memo=memo,
    )
    records: dict[str, list[dict]] = {}
    for spec in specs:
        records[spec.mode] = sorted(done[spec.mode].values(), key=lambda r: index_of[r["id"]])
    # every mode present in the folder goes into the summary (also modes run by an earlier command)
    for mode, recs in folder_records(folder, index_of).items():
        records.setdefault(mode, recs)
    summary = summarize_task(meta, records, task, n_resamples=n_resamples, seed=settings.seed)
    write_json(folder / "summary.json", summary)
    return TaskResult(summary, records, computed)


def _open_task_folder(
    task, base, modes: Sequence[ModeSpec], folder: Path, settings: EvalSettings, overwrite: bool
) -> tuple:
    """The folder and resume part of ``run_task``: clear it (``overwrite``) or check that its earlier run may
    be resumed, run the task's environment check, and write ``meta.json``. Returns (prepared items, meta,
    whether the task's toolchain is unavailable)."""
    name = task_name(task)
    # the items and the task's environment first: a task that cannot run leaves the folder as it was
    prep = prepare(task, base.tokenizer, settings.limit, settings.handoff_tokens, settings.prompt_format)
    want = settings.as_dict(task)
    environment = _check_environment(task, settings)
    if overwrite and folder.exists():
        clear_task_folder(folder)
    folder.mkdir(parents=True, exist_ok=True)
    meta_path = folder / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else None
    if meta is not None:
        check_resumable(folder, meta, want, base.fingerprint, {s.mode: s.describe() for s in modes})
    else:
        meta = {"task": name, "settings": want, "modes": {}, "created": time.strftime("%Y-%m-%d %H:%M:%S")}
    meta.update(
        model=describe_base(base),
        base=base.name,
        base_fingerprint=base.fingerprint,
        data=task_description(task),
        n_items=prep.n,
        hardware=hardware(),
        primary_metric=primary_metric_of(task),
        licence=getattr(task, "license", None),
        torch=torch.__version__,
    )
    meta["environment"] = environment
    unavailable = isinstance(environment, dict) and environment.get("available") is False
    if unavailable:  # reported as unavailable, never scored as 0 (K8); NLL on the references still runs
        meta["unavailable"] = environment.get("reason") or "the task's toolchain is not installed"
    else:
        meta.pop("unavailable", None)
    for spec in modes:
        meta["modes"][spec.mode] = spec.describe()
    write_json(meta_path, meta)
    return prep, meta, unavailable


def _run_groups(
    task,
    base,
    engine,
    specs: list[ModeSpec],
    prep,
    folder: Path,
    done: dict,
    settings: EvalSettings,
    *,
    batch_size: int,
    progress: bool,
    unavailable: bool,
    on_item,
    memo: EvalMemo | None,
) -> tuple[dict[str, int], list[ModeSpec]]:
    """The group loop of ``run_task``: the items not in ``done`` in groups, every mode per group (each
    producer prefills a group once with the engine), records appended to ``items.MODE.jsonl`` and added to
    ``done``. ``engine``: run_task's (None: the reference path). Returns the items computed per mode and the
    modes in the order they ran."""
    name = task_name(task)
    # the engine decodes batch_size rows at a time and refills a row's slot as soon as it finishes, so it gets
    # several batches per call (records are written per call)
    group = batch_size * (ENGINE_BATCHES_PER_CALL if engine is not None else 1)
    computed: dict[str, int] = {}
    specs = list(specs)
    pending = {spec.mode: {i for i in range(prep.n) if prep.ids[i] not in done[spec.mode]} for spec in specs}
    computed.update({spec.mode: 0 for spec in specs})
    # items in groups, every mode per group (with the engine each producer prefills a group once:
    # GroupPrefill); shortest prompts first: less padding, and results do not depend on batching
    todo = sorted(set().union(*pending.values()), key=lambda i: (len(prep.prompts[i]), i))
    if (
        engine is not None
    ):  # the modes reading C_base first, so it is freed before the Full-FT decoder's prefill
        specs.sort(key=lambda spec: (producer_of(engine, spec) is not None, _mode_order(spec)))
    last_use = {producer_of(engine, spec): n for n, spec in enumerate(specs)} if engine is not None else {}
    # greedy: every mode's rows of a group decode in the same engine steps, mode after mode (a mode's rows
    # take the slots the previous mode's last rows free; a group smaller than the engine's rows fills them
    # with every mode at once), through a memo that run_mode_batch reads
    joint = (
        engine is not None
        and not unavailable
        and not settings.sampling(task)["do_sample"]
        and settings.resolved_samples(task) == 1
    )
    if joint and memo is None:
        memo = EvalMemo()
    bar = tqdm(
        total=prep.n * len(specs),
        initial=sum(map(len, done.values())),
        desc=name,
        unit="item",
        disable=not progress,
        dynamic_ncols=True,
        file=sys.stderr,
    )
    try:
        for start in range(0, len(todo), group):
            rows = todo[start : start + group]
            prefills = (
                GroupPrefill(engine, {i: prep.prompts[i] for i in rows}, settings.handoff_tokens)
                if engine is not None
                else None
            )
            if prefills is not None:  # one arena growth for the prefills of the modes with work in this group
                prefills.reserve([s for s in specs if any(i in pending[s.mode] for i in rows)])
            try:
                if joint:
                    decode_group_jointly(
                        task,
                        specs,
                        prep,
                        {
                            s.mode: [i for i in rows if i in pending[s.mode] and settings.generates(i)]
                            for s in specs
                        },
                        settings,
                        engine,
                        prefills,
                        memo,
                    )
                for n, spec in enumerate(specs):
                    mine = [i for i in rows if i in pending[spec.mode]]
                    if mine:
                        bar.set_postfix_str(spec.mode)
                        recs = run_mode_batch(
                            task,
                            spec,
                            base,
                            prep,
                            mine,
                            settings,
                            score=not unavailable,
                            engine=engine,
                            nll_batch_size=batch_size,
                            memo=memo,
                            group=prefills,
                        )
                        path = folder / f"items.{spec.mode}.jsonl"
                        for r in recs:
                            append_jsonl(path, [r])
                            done[spec.mode][r["id"]] = r
                            computed[spec.mode] += 1
                            bar.update(1)
                            if on_item is not None:
                                on_item(spec.mode, r)
                    if prefills is not None and last_use[producer_of(engine, spec)] == n:
                        prefills.release(spec)  # no later mode of the group reads this prefill
            finally:
                if prefills is not None:
                    prefills.close()
    finally:
        bar.close()
    return computed, specs
