"""What lets the study resume over sittings: the wall time per phase added up in ``OUT/phases.json`` and the
decoder digests stamped beside each result folder (a result is reused only with the decoders it was computed
with)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ccft.core.errors import ConfigError
from ccft.core.io import atomic_write_text

__all__ = ["DECODERS_STAMP", "StudyPhases", "run_digest", "stamp_matches", "write_stamp"]


class StudyPhases:
    """Wall time per phase, added up over sittings (``OUT/phases.json``), with the load average at the end of
    each sitting's phase (so a report can say when other work shared the CPU)."""

    def __init__(self, out: Path):
        self.path = out / "phases.json"
        self.data = (
            json.loads(self.path.read_text())
            if self.path.is_file()
            else {"phase_seconds": {}, "sittings": 0, "load_average": {}}
        )
        self.data["sittings"] += 1
        self._save()

    def _save(self):
        atomic_write_text(self.path, json.dumps(self.data, indent=2))

    def __call__(self, name: str):
        phases = self

        class _Phase:
            def __enter__(self):
                print(f"[ccft study] == {name} ==", flush=True)
                self.t = time.time()

            def __exit__(self, *exc):
                dt = time.time() - self.t
                ps = phases.data["phase_seconds"]
                ps[name] = round(ps.get(name, 0.0) + dt, 1)
                if hasattr(os, "getloadavg"):
                    phases.data["load_average"].setdefault(name, []).append(round(os.getloadavg()[0], 2))
                phases._save()
                print(f"[ccft study] {name}: {dt:.0f}s", flush=True)

        return _Phase()


#: the ``ccft.json`` fields that shape a decoder's outputs (what ``ccft.load_decoder`` reads); the rest
#: records how it was trained (recipe, data counts, training path), which the weights already reflect
DECODER_FIELDS = ("method", "decoder_kind", "base_fingerprint", "handoff_tokens", "dtype")
#: the run folder's files that define the decoder besides ``ccft.json``: weights, model/adapter configs,
#: tokenizer
DECODER_FILE_SUFFIXES = (".safetensors", ".json", ".jinja", ".model", ".txt")
#: top-level files that only record the training (``ccft.json`` enters through ``DECODER_FIELDS``; the recipe
#: stamp ``ccft.core.checkpoint.RECIPE_STAMP`` is left out too)
NOT_DECODER_FILES = ("ccft.json", "log_history.json", "trainer_state.json")


def run_digest(folder: str | os.PathLike) -> str:
    """sha256 (hex) of a training run's decoder: the ``DECODER_FIELDS`` of its ``ccft.json`` and the files at
    the run folder's top level that define it (weights ``*.safetensors``, adapter/model configs, tokenizer and
    chat template; JSON files by content, keys and PEFT's ``target_modules`` sorted), by name. Two runs with
    equal digests hold the same decoder bit for bit, whatever their recipes say about how they got there (a
    recipe change that changes the weights changes the digest through them; one that does not, such as
    activation checkpointing, leaves it).

    Raises:
        ConfigError: the folder holds no ``ccft.json`` (not a finished training run).
    """
    root = Path(folder)
    if not (root / "ccft.json").is_file():
        raise ConfigError(f"{root}: no ccft.json (not a finished training run)")
    from ccft.core.checkpoint import RECIPE_STAMP  # (torch: imported only when a digest is taken)

    meta = json.loads((root / "ccft.json").read_text())
    h = hashlib.sha256(json.dumps({k: meta.get(k) for k in DECODER_FIELDS}, sort_keys=True).encode())
    files = [
        f
        for f in root.iterdir()
        if f.is_file()
        and f.name.endswith(DECODER_FILE_SUFFIXES)
        and f.name not in (*NOT_DECODER_FILES, RECIPE_STAMP)
    ]
    for f in sorted(files):
        h.update(b"\0" + f.name.encode() + b"\0")
        if (
            f.suffix == ".json"
        ):  # by content: PEFT writes target_modules (a set) in a different order every run
            h.update(_canonical_json(json.loads(f.read_text())).encode())
            continue
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _canonical_json(obj: Any) -> str:
    """``obj`` as JSON with sorted keys and ``target_modules`` (a set in PEFT's ``LoraConfig``) sorted."""
    if isinstance(obj, dict) and isinstance(obj.get("target_modules"), list):
        obj = {**obj, "target_modules": sorted(obj["target_modules"], key=str)}
    return json.dumps(obj, sort_keys=True)


#: the decoders a folder's results were computed with (method or agent -> ``run_digest``), next to the results
DECODERS_STAMP = "decoders.json"


def stamp_matches(folder: str | os.PathLike, digests: Mapping[str, str]) -> bool | None:
    """Whether ``folder/decoders.json`` records ``digests``; None when the folder has no stamp (results
    written before stamps existed, or nothing written yet)."""
    path = Path(folder) / DECODERS_STAMP
    if not path.is_file():
        return None
    return json.loads(path.read_text()) == dict(digests)


def write_stamp(folder: str | os.PathLike, digests: Mapping[str, str]) -> None:
    Path(folder).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(folder) / DECODERS_STAMP, json.dumps(dict(digests), indent=2, sort_keys=True))
