"""Result folders of the eval runner: files, resume guards, and the provenance every number carries.

One task's folder (``OUT/TASK/``):

  ``meta.json``          task, model (with its quantisation / dtype), data, hardware, decoders and the
                         settings every mode ran with (``EvalSettings.as_dict``)
  ``items.MODE.jsonl``   one JSON line per finished item (``ccft.evals.records``), appended and fsynced
                         after each item; a torn last line (a killed writer) is dropped on read
  ``summary.json``       ``ccft.evals.records.summarize_task`` of the above

``meta.json`` and ``summary.json`` are written atomically (``ccft.core.io``; docs/design.md, "Atomic
writes"); the item files are append-only, so a killed run loses at most the item being written.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Sequence

import torch

from ccft.core.errors import ConfigError
from ccft.core.io import atomic_write_json
from ccft.evals.records import summarize_task

__all__ = [
    "FolderConflictError",
    "append_jsonl",
    "check_resumable",
    "clear_task_folder",
    "describe_base",
    "folder_records",
    "hardware",
    "settings_diff",
    "stale_settings",
    "item_files",
    "load_task_folder",
    "read_jsonl",
    "write_json",
]


# ------------------------------------------------------------------------------------------------ files


def read_jsonl(path: Path) -> list[dict]:
    """The complete records of a JSONL file; a torn last line (interrupted write) is dropped and cut off."""
    path = Path(path)
    if not path.is_file():
        return []
    raw = path.read_bytes()
    records, good = [], 0
    for line in raw.split(b"\n"):
        if not line.strip():
            good += len(line) + 1
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
        good += len(line) + 1
    if good < len(raw):  # cut the torn tail so appends start on a fresh line
        with open(path, "r+b") as f:
            f.truncate(min(good, len(raw)))
    return records


def append_jsonl(path: Path, records: Sequence[dict]) -> None:
    """Append one JSON line per record, then flush and fsync (the records survive a kill right after)."""
    with open(path, "a", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def write_json(path: Path, obj) -> None:
    """``obj`` as indented JSON, written atomically (``ccft.core.io.atomic_write_json``; other objects as
    ``str``)."""
    atomic_write_json(path, obj, default=str)


def item_files(folder: Path) -> dict[str, Path]:
    """``{mode: items.MODE.jsonl}`` of a task folder, sorted by mode name."""
    return {f.name[len("items.") : -len(".jsonl")]: f for f in sorted(Path(folder).glob("items.*.jsonl"))}


def clear_task_folder(folder: Path) -> None:
    """Remove the item files and ``meta.json`` of a task folder (``--overwrite``)."""
    for f in item_files(folder).values():
        f.unlink()
    (Path(folder) / "meta.json").unlink(missing_ok=True)


def folder_records(folder: Path, index_of: dict[str, int] | None = None) -> dict[str, list[dict]]:
    """Every mode's records in a task folder, in item order; with ``index_of`` only the items it names."""
    out = {}
    for mode, f in item_files(folder).items():
        recs = read_jsonl(f)
        if index_of is not None:
            recs = sorted((r for r in recs if r["id"] in index_of), key=lambda r: index_of[r["id"]])
        else:
            recs = sorted(recs, key=lambda r: r.get("index", 0))
        if recs:
            out[mode] = recs
    return out


# ---------------------------------------------------------------------------------------------- resume guards


class FolderConflictError(ConfigError):
    """A result folder holds a run that this one cannot continue (other settings, base, decoder or
    prompts)."""


def settings_diff(old: dict, new: dict) -> dict:
    """``{key: (was, now)}`` for every setting that differs between a folder's ``meta.json`` settings ``old``
    and ``new`` (a key only in ``old`` is ``(was, None)``); empty when a run with ``new`` may continue the
    folder."""
    diff = {k: (old.get(k), v) for k, v in new.items() if old.get(k) != v}
    diff.update({k: (v, None) for k, v in old.items() if k not in new})
    return diff


def stale_settings(folder: Path, settings: dict) -> dict:
    """:func:`settings_diff` of the run in ``folder`` (its ``meta.json``) against ``settings``; empty when the
    folder holds no run yet."""
    meta_path = Path(folder) / "meta.json"
    if not meta_path.is_file():
        return {}
    return settings_diff(json.loads(meta_path.read_text()).get("settings") or {}, settings)


def check_resumable(
    folder: Path, meta: dict, settings: dict, base_fingerprint: str, modes: dict[str, dict]
) -> None:
    """Refuse to add to a folder holding a run with other settings, another base or another decoder per mode.

    Args:
        meta: the folder's ``meta.json``; settings: ``EvalSettings.as_dict`` of this run;
        modes: ``{mode: ModeSpec.describe()}`` of this run.
    Raises:
        FolderConflictError: naming what differs and the way out (``--overwrite`` or another ``--out``).
    """
    diff = settings_diff(meta.get("settings") or {}, settings)
    if diff:
        raise FolderConflictError(
            f"{folder} holds a run with other settings {diff} (was, now); pass --overwrite or "
            "use another --out folder"
        )
    if meta.get("base_fingerprint") != base_fingerprint:
        raise FolderConflictError(
            f"{folder} was evaluated with base {meta.get('base_fingerprint')}, not "
            f"{base_fingerprint}; pass --overwrite or use another --out folder"
        )
    for mode, desc in modes.items():
        was = (meta.get("modes") or {}).get(mode)
        if was and was.get("decoder_fingerprint") != desc.get("decoder_fingerprint"):
            raise FolderConflictError(
                f"{folder}: mode {mode} was evaluated with another decoder ({was.get('decoder')}); "
                "pass --overwrite or use another --out folder"
            )


# ------------------------------------------------------------------------------------------------ provenance


def hardware() -> str:
    """One line naming the CPU/GPU, the CPU vector instructions torch's kernels use and the thread count the
    numbers were measured on (two CPUs with the same model name can differ: an AVX2-only one ran the study's
    training ~1.7x slower than one whose line did not say; docs/study.md, "Time")."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    dev = f"CUDA {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no GPU"
    isa = torch.backends.cpu.get_cpu_capability()  # e.g. AVX2, AVX512: the kernels torch dispatches to
    return (
        f"{cpu} ({isa}), {os.cpu_count()} logical cores, torch {torch.__version__} using "
        f"{torch.get_num_threads()} threads, {dev}"
    )


def describe_base(base) -> str:
    """The base model as reports name it: its description (quantisation of embedded models) and load dtype."""
    from ccft.core.models import describe_model

    desc = describe_model(base.name)
    dtype = str(base.dtype).replace("torch.", "")
    return desc if dtype in desc else f"{desc} ({dtype} weights)"


# ----------------------------------------------------------------------------------------------- reading back


def load_task_folder(folder: str | Path) -> dict:
    """Re-read a task folder (meta + every ``items.MODE.jsonl``) into a fresh summary with per-item records.

    The task's own aggregates (pass@k, per-category) need the task object; they are taken from the saved
    ``summary.json`` when it covers the same number of items. Adds ``records`` and ``folder``.
    """
    folder = Path(folder)
    meta = json.loads((folder / "meta.json").read_text())
    records = folder_records(folder)
    summary = summarize_task(meta, records, None)
    saved = folder / "summary.json"
    if saved.is_file():
        old = json.loads(saved.read_text()).get("modes", {})
        for mode, s in summary["modes"].items():
            if old.get(mode, {}).get("n") == s["n"] and "task_aggregate" in old.get(mode, {}):
                s["task_aggregate"] = old[mode]["task_aggregate"]
    summary["records"] = records
    summary["folder"] = str(folder)
    return summary
