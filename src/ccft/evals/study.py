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

import hashlib
import json
import math
import os
import string
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ccft.core.errors import ConfigError
from ccft.core.io import atomic_write_text
from ccft.core.modes import MODES, REFERENCE_MODE

__all__ = ["DECODERS_STAMP", "SpecialistConfig", "StudyConfig", "StudyPhases",
           "build_study_report", "full_ft_beats_base", "load_study_config", "metrics_of", "run_digest", "stamp_matches",
           "study_reading", "study_readme", "task_entry", "write_stamp"]

#: what each secondary metric means, for reports
SECONDARY_MEANING = {
    "answer_format": "share of answers in GSM8K's `#### N` form (right or wrong)",
    "compiles": "share of programs (prompt + completion) that parse as Python and define the entry point",
    "offered_call": "share of outputs that parse as a call to one of the item's offered functions",
}
PRIMARY_MEANING = {
    "exact_match_flexible": "exact match (flexible extraction: last number)",
    "passed": "pass@1 (greedy, tests run in the sandbox)",
    "accuracy": "BFCL AST accuracy (bfcl-eval's checker)",
}

def metrics_of(task: str) -> tuple[str, str | None]:
    """(primary, secondary) metric keys of ``task`` as the task declares them (``primary_metric_of``,
    ``secondary_metric_of``: the same headline ``ccft report`` reads); keys of ``items.MODE.jsonl`` scores.

    Raises:
        ConfigError: no task of that name.
    """
    from ccft.evals.protocol import get_task, primary_metric_of, secondary_metric_of

    t = get_task(task)
    primary = primary_metric_of(t)
    if primary is None:
        raise ConfigError(f"task {task!r} declares no metrics; give it a primary_metric")
    return primary, secondary_metric_of(t)


def __getattr__(name: str):
    if name == "TASK_METRICS":  # deprecated: each task declares its metrics (``Task.primary_metric``)
        import warnings

        from ccft.evals.protocol import task_names

        warnings.warn("ccft.evals.study.TASK_METRICS is deprecated; read metrics_of(task) or the task's "
                      "primary_metric / secondary_metric", DeprecationWarning, stacklevel=2)
        return {t: metrics_of(t) for t in task_names()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class TaskSettings:
    """One task of a specialist: items (the first ``limit`` of the task's order) and the generation budget."""

    limit: int = 100
    max_new_tokens: int | None = None


@dataclass
class SpecialistConfig:
    """A specialist: its training recipe (+ ``train`` overrides, ``key: value`` as on the ``ccft train`` command
    line) and its tasks. ``multipl_e`` lists MultiPL-E languages (``all``: every language whose toolchain is
    present on this machine), each evaluated on ``multipl_e_limit`` items."""

    name: str
    recipe: str
    train: dict[str, Any] = field(default_factory=dict)
    tasks: dict[str, TaskSettings] = field(default_factory=dict)
    multipl_e: list[str] | str = field(default_factory=list)
    multipl_e_limit: int = 20
    multipl_e_max_new_tokens: int | None = 256


@dataclass
class StudyConfig:
    """The whole study (``recipes/study.yaml``)."""

    specialists: dict[str, SpecialistConfig]
    runs: str = "runs/study"
    out: str = "reports/study"
    modes: list[str] = field(default_factory=lambda: list(MODES))
    batch_size: int = 16
    bootstrap: int = 2000
    seed: int = 0
    sweep_limit: int = 40
    sweep_rhos: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])
    serving: dict[str, Any] = field(default_factory=dict)
    #: torch CPU threads (None: torch's default). On a CPU shared with other jobs, 1 thread avoids the
    #: thread-synchronisation stalls that make a 2-thread matmul many times slower under oversubscription.
    threads: int | None = None
    #: where the base and decoders are evaluated: ``auto`` (CUDA when available), ``cpu``, ``cuda``, ``cuda:N``
    device: str = "auto"
    source: str = ""


_TOP_KEYS = {"specialists", "runs", "out", "modes", "batch_size", "bootstrap", "seed", "sweep_limit", "sweep_rhos",
             "serving", "threads", "device"}
_SPEC_KEYS = {"recipe", "train", "tasks", "multipl_e", "multipl_e_limit", "multipl_e_max_new_tokens"}


def _set_dotted(raw: dict, key: str, value: Any, where: str) -> None:
    parts = key.split(".")
    node = raw
    for i, p in enumerate(parts[:-1]):
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"{where}: override {key}: {'.'.join(parts[:i + 1])} is not a section")
        node = nxt
    node[parts[-1]] = value


def load_study_config(path: str | os.PathLike, overrides: list[str] | None = None) -> StudyConfig:
    """Parse and validate a study YAML plus ``KEY=value`` overrides (dotted keys reach into sections:
    ``specialists.tools.train.max_steps=20``, ``specialists.math.tasks.gsm8k.limit=10``, ``batch_size=8``).

    Every specialist's recipe is parsed with its overrides (``ccft.train.config.load_recipe``), so a bad
    training key fails here, before any model is loaded. Raises ConfigError naming the file and key.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"study config {p} does not exist; see recipes/study.yaml")
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: not valid YAML ({e}); see recipes/study.yaml") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the study config must be a mapping of keys; see recipes/study.yaml")
    from ccft.train.config import parse_override

    for ov in overrides or []:
        k, v = parse_override(ov, example="specialists.tools.train.max_steps=20; dotted keys reach into sections")
        _set_dotted(raw, k, v, str(p))
    unknown = sorted(set(raw) - _TOP_KEYS)
    if unknown:
        raise ConfigError(f"{p}: unknown key(s) {unknown}; the study config takes {sorted(_TOP_KEYS)}")
    specs_raw = raw.get("specialists")
    if not isinstance(specs_raw, dict) or not specs_raw:
        raise ConfigError(f"{p}: `specialists` must map each specialist's name to its recipe and tasks")
    specialists = {}
    for name, s in specs_raw.items():
        if not isinstance(s, dict) or "recipe" not in s:
            raise ConfigError(f"{p}: specialists.{name} needs `recipe:` (a training recipe YAML)")
        bad = sorted(set(s) - _SPEC_KEYS)
        if bad:
            raise ConfigError(f"{p}: specialists.{name}: unknown key(s) {bad}; use {sorted(_SPEC_KEYS)}")
        tasks = {}
        for t, ts in (s.get("tasks") or {}).items():
            try:
                metrics_of(t)
            except ConfigError as e:
                raise ConfigError(f"{p}: specialists.{name}.tasks.{t}: {e}") from None
            ts = ts or {}
            bad = sorted(set(ts) - {"limit", "max_new_tokens"})
            if bad:
                raise ConfigError(f"{p}: specialists.{name}.tasks.{t}: unknown key(s) {bad}; use limit, max_new_tokens")
            tasks[t] = TaskSettings(**ts)
        spec = SpecialistConfig(name=name, recipe=str(s["recipe"]), train=dict(s.get("train") or {}), tasks=tasks,
                                multipl_e=s.get("multipl_e") or [],
                                multipl_e_limit=int(s.get("multipl_e_limit", 20)),
                                multipl_e_max_new_tokens=s.get("multipl_e_max_new_tokens", 256))
        if not spec.tasks and not spec.multipl_e:
            raise ConfigError(f"{p}: specialists.{name} has no tasks")
        try:
            recipe_overrides(spec)  # validates the training keys now
        except ConfigError as e:  # the recipe parser names the recipe; the key may come from this file's train:
            named = sorted(k for k in spec.train if f"{k}=" in str(e))
            if not named:
                raise
            raise ConfigError(f"{p}: specialists.{name}.train sets {', '.join(named)} (applied to {e})") from None
        specialists[name] = spec
    modes = list(raw.get("modes") or MODES)
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ConfigError(f"{p}: modes {bad} are not modes; use {', '.join(MODES)}")
    cfg = StudyConfig(specialists=specialists, source=str(p), modes=modes,
                      **{k: raw[k] for k in ("runs", "out", "batch_size", "bootstrap", "seed", "sweep_limit",
                                             "sweep_rhos", "serving", "threads", "device") if k in raw})
    return cfg


def recipe_overrides(spec: SpecialistConfig):
    """(TrainConfig, EvalConfig, raw recipe) of ``spec``'s recipe with its ``train`` overrides applied."""
    from ccft.train.config import load_recipe

    overrides = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in spec.train.items()]
    return load_recipe(spec.recipe, overrides)


class StudyPhases:
    """Wall time per phase, added up over sittings (``OUT/phases.json``), with the load average at the end of
    each sitting's phase (so a report can say when other work shared the CPU)."""

    def __init__(self, out: Path):
        self.path = out / "phases.json"
        self.data = json.loads(self.path.read_text()) if self.path.is_file() else {"phase_seconds": {}, "sittings": 0,
                                                                                     "load_average": {}}
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


#: the ``ccft.json`` fields that shape a decoder's outputs (what ``ccft.load_decoder`` reads); the rest records
#: how it was trained (recipe, data counts, training path), which the weights already reflect
DECODER_FIELDS = ("method", "decoder_kind", "base_fingerprint", "handoff_tokens", "dtype")
#: the run folder's files that define the decoder besides ``ccft.json``: weights, model/adapter configs, tokenizer
DECODER_FILE_SUFFIXES = (".safetensors", ".json", ".jinja", ".model", ".txt")
#: top-level files that only record the training (``ccft.json`` enters through ``DECODER_FIELDS``; the recipe stamp
#: ``ccft.core.checkpoint.RECIPE_STAMP`` is left out too)
NOT_DECODER_FILES = ("ccft.json", "log_history.json", "trainer_state.json")


def run_digest(folder: str | os.PathLike) -> str:
    """sha256 (hex) of a training run's decoder: the ``DECODER_FIELDS`` of its ``ccft.json`` and the files at the
    run folder's top level that define it (weights ``*.safetensors``, adapter/model configs, tokenizer and chat
    template; JSON files by content, keys and PEFT's ``target_modules`` sorted), by name. Two runs with equal
    digests hold the same decoder bit for bit, whatever their recipes say about how they got there (a recipe
    change that changes the weights changes the digest through them; one that does not, such as activation
    checkpointing, leaves it).

    Raises:
        ConfigError: the folder holds no ``ccft.json`` (not a finished training run).
    """
    root = Path(folder)
    if not (root / "ccft.json").is_file():
        raise ConfigError(f"{root}: no ccft.json (not a finished training run)")
    from ccft.core.checkpoint import RECIPE_STAMP  # (torch: imported only when a digest is taken)

    meta = json.loads((root / "ccft.json").read_text())
    h = hashlib.sha256(json.dumps({k: meta.get(k) for k in DECODER_FIELDS}, sort_keys=True).encode())
    files = [f for f in root.iterdir() if f.is_file() and f.name.endswith(DECODER_FILE_SUFFIXES)
             and f.name not in (*NOT_DECODER_FILES, RECIPE_STAMP)]
    for f in sorted(files):
        h.update(b"\0" + f.name.encode() + b"\0")
        if f.suffix == ".json":  # by content: PEFT writes target_modules (a set) in a different order every run
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
    """Whether ``folder/decoders.json`` records ``digests``; None when the folder has no stamp (results written
    before stamps existed, or nothing written yet)."""
    path = Path(folder) / DECODERS_STAMP
    if not path.is_file():
        return None
    return json.loads(path.read_text()) == dict(digests)


def write_stamp(folder: str | os.PathLike, digests: Mapping[str, str]) -> None:
    Path(folder).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(folder) / DECODERS_STAMP, json.dumps(dict(digests), indent=2, sort_keys=True))


# ------------------------------------------------------------------ report


def _metric(mode_block: dict, key: str | None) -> tuple[float | None, list | None]:
    if key is None:
        return None, None
    m = (mode_block.get("metrics") or {}).get(key)
    return (m["mean"], m["ci"]) if m else (None, None)


def _delta(deltas: dict, key: str | None) -> tuple[float | None, list | None]:
    if key is None or key not in deltas:
        return None, None
    return deltas[key]["delta"], deltas[key]["ci"]


def task_entry(summary: dict, specialist: str) -> dict:
    """One task of ``report.json`` from the runner's ``summary.json`` (see the module docstring)."""
    task = summary["task"]
    primary, secondary = metrics_of(task)
    modes = {}
    for mode, block in summary["modes"].items():
        score, score_ci = _metric(block, primary)
        sec, sec_ci = _metric(block, secondary)
        modes[mode] = {"score": score, "score_ci": score_ci, "secondary": sec, "secondary_ci": sec_ci,
                       "nll": block.get("nll"), "nll_ci": block.get("nll_ci"), "n": block.get("n"),
                       "scored_n": block.get("scored_n"), "truncated": block.get("truncated")}
    paired = {}
    for mode, d in (summary.get("deltas_vs_full_ft") or {}).items():
        score, score_ci = _delta(d, primary)
        sec, sec_ci = _delta(d, secondary)
        nll, nll_ci = _delta(d, "nll")
        paired[mode] = {"score": score, "score_ci": score_ci, "secondary": sec, "secondary_ci": sec_ci,
                        "nll": nll, "nll_ci": nll_ci}
    ref = modes.get(REFERENCE_MODE, {})
    retention = {}
    for mode in ("prefillshare", "naive"):
        if mode in modes:
            retention[mode] = {k: (modes[mode][k] / ref[k] if ref.get(k) and modes[mode][k] is not None else None)
                               for k in ("score", "secondary")}
    n = max((b["n"] or 0) for b in modes.values()) if modes else 0
    meta = summary.get("meta") or {}
    return {"task": task, "specialist": specialist, "primary_metric": primary, "secondary_metric": secondary,
            "n": n, "settings": {k: (meta.get("settings") or {}).get(k) for k in ("limit", "max_new_tokens", "prompting",
                                                                                 "decode_path")},
            "data": meta.get("data"), "modes": modes, "paired_vs_full_ft": paired, "retention": retention}


def _excludes_zero(ci, sign: int) -> bool:
    """CI (of base − full-ft) entirely on the side ``sign`` (−1: below zero, +1: above)."""
    if not ci or ci[0] is None:
        return False
    return ci[1] < 0 if sign < 0 else ci[0] > 0


def full_ft_beats_base(entry: dict) -> dict:
    """Does Full-FT beat base on this task with a paired 95% CI that excludes 0? Per metric (primary, secondary:
    higher is better; NLL: lower is better)."""
    d = entry["paired_vs_full_ft"].get("base") or {}
    return {"score": _excludes_zero(d.get("score_ci"), -1), "secondary": _excludes_zero(d.get("secondary_ci"), -1),
            "nll": _excludes_zero(d.get("nll_ci"), +1)}


def build_study_report(cfg: StudyConfig, summaries: Mapping[str, list[dict]], *, specialists_meta: dict,
                       sweeps: Mapping[str, dict], serving: dict | None, phases: dict, hardware: str,
                       model: str) -> dict:
    """``report.json`` (see the module docstring and docs/study.md)."""
    tasks = [task_entry(s, spec) for spec, ss in summaries.items() for s in ss]
    resolved = {}
    for spec in summaries:
        entries = [t for t in tasks if t["specialist"] == spec]
        resolved[spec] = {t["task"]: full_ft_beats_base(t) for t in entries}
    return {"kind": "ccft-study", "config": cfg.source, "model": model, "hardware": hardware,
            "modes": cfg.modes, "phase_seconds": phases.get("phase_seconds", {}), "sittings": phases.get("sittings"),
            "load_average": phases.get("load_average", {}), "specialists": specialists_meta, "tasks": tasks,
            "full_ft_beats_base": resolved, "sweeps": {k: ({kk: vv for kk, vv in v.items() if kk != "per_item"} if v else v) for k, v in sweeps.items()},
            "serving": serving,
            "metrics": {"primary": PRIMARY_MEANING, "secondary": SECONDARY_MEANING}}


def _pct(x) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def _ci_pct(ci) -> str:
    return "" if not ci or ci[0] is None else f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"


def _pp(x, ci) -> str:
    if x is None:
        return "–"
    return f"{100 * x:+.1f}pp" + ("" if not ci else f" [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]")


def _nll(x, ci=None) -> str:
    if x is None:
        return "–"
    return f"{x:.3f}" + ("" if not ci else f" [{ci[0]:.3f}, {ci[1]:.3f}]")


def _dnll(x, ci) -> str:
    if x is None:
        return "–"
    return f"{x:+.4f}" + ("" if not ci else f" [{ci[0]:+.4f}, {ci[1]:+.4f}]")


def _table(report: dict, value: str, fmt_abs, fmt_delta) -> list[str]:
    modes = report["modes"]
    lines = ["| specialist | task | n | " + " | ".join(modes) + " |", "|---|---|---|" + "---|" * len(modes)]
    for t in report["tasks"]:
        key = {"score": "primary_metric", "secondary": "secondary_metric", "nll": None}[value]
        if key and t[key] is None:
            continue
        cells = []
        for m in modes:
            b = t["modes"].get(m)
            if b is None:
                cells.append("–")
                continue
            cell = fmt_abs(b[value], b[f"{value}_ci"])
            d = t["paired_vs_full_ft"].get(m)
            if d is not None and d.get(value) is not None:
                cell += f"<br>Δ {fmt_delta(d[value], d[f'{value}_ci'])}"
            cells.append(cell)
        name = t["task"] + (f" ({t[key]})" if key else "")
        lines.append(f"| {t['specialist']} | {name} | {t['n']} | " + " | ".join(cells) + " |")
    return lines


def _resolved_word(ci, sign_good: int) -> str:
    if not ci or ci[0] is None:
        return "not measured"
    if ci[0] > 0:
        return "CI above 0" if sign_good > 0 else "CI above 0 (worse)"
    if ci[1] < 0:
        return "CI below 0 (worse)" if sign_good > 0 else "CI below 0"
    return "CI includes 0"


def study_reading(report: dict) -> str:
    """The per-specialist reading of the tables, generated from the numbers (no hand-written claims)."""
    out = []
    for spec in report["specialists"]:
        entries = [t for t in report["tasks"] if t["specialist"] == spec and t["modes"].get("full-ft")]
        if not entries:
            continue
        lines = [f"**{spec}**"]
        for t in entries:
            d = t["paired_vs_full_ft"]
            parts = []
            for label, key, pct in (("primary", "score", True), ("secondary", "secondary", True), ("NLL/token", "nll", False)):
                if t["modes"]["full-ft"].get(key) is None:
                    continue
                bits = []
                for mode in ("base", "naive", "prefillshare"):
                    x = (d.get(mode) or {}).get(key)
                    ci = (d.get(mode) or {}).get(f"{key}_ci")
                    if x is None:
                        continue
                    val = _pp(x, ci) if pct else _dnll(x, ci)
                    bits.append(f"{mode} {val} ({_resolved_word(ci, +1 if pct else -1)})")
                parts.append(f"{label}: " + "; ".join(bits))
            nd, pd = (d.get("naive") or {}).get("nll"), (d.get("prefillshare") or {}).get("nll")
            rec = ""
            if nd and pd is not None and nd > 0:
                rec = f" CCFT recovers {100 * (1 - pd / nd):.0f}% of the naive-sharing NLL gap."
            lines.append(f"- {t['task']} (n={t['n']}), Δ vs full-ft — " + " | ".join(parts) + "." + rec)
        out.append("\n".join(lines))
    return "\n\n".join(out)


def _ratio(retention: dict, mode: str, key: str) -> str:
    v = (retention.get(mode) or {}).get(key)
    return "–" if v is None else f"{v:.2f}"


def _sweep_row(pts: dict, rhos: list, label: str) -> str:
    return " | ".join(_nll(pts[(label, r)].get("nll")) if (label, r) in pts else "–" for r in rhos)


def study_readme(report: dict, command: str, sittings_notes: str | None = None) -> str:
    """``README.md`` of ``reports/study/``: setup, the headline tables, retention, sweeps, serving, reading,
    rendered from the template ``ccft/evals/templates/study_README.md`` (``string.Template`` fields).

    Args:
        sittings_notes: the text of ``OUT/SITTINGS.md`` when present: what the person who ran the study wrote
            about each sitting (pauses, other jobs on the CPU, thread counts). Quoted verbatim under its own
            heading, marked as written by hand, so a regenerated README never loses it.
    """
    ps = report["phase_seconds"]
    total = sum(ps.values())
    specs = []
    for name, s in report["specialists"].items():
        tr = s.get("training", {})
        specs.append(f"- **{name}**: recipe `{s['recipe']}` with {s.get('overrides') or 'no overrides'}; "
                     f"{tr.get('train_rows')} rows ({tr.get('train_data')}), {tr.get('steps')} steps, "
                     f"final train loss ccft {tr.get('final_loss', {}).get('ccft', float('nan')):.3f}, "
                     f"full-ft {tr.get('final_loss', {}).get('full-ft', float('nan')):.3f}; runs "
                     f"`{s['runs']['ccft']}`, `{s['runs']['full-ft']}`")
    retention = ["| specialist | task | prefillshare ÷ full-ft (primary) | naive ÷ full-ft (primary) | "
                 "prefillshare ÷ full-ft (secondary) | naive ÷ full-ft (secondary) |", "|---|---|---|---|---|---|"]
    for t in report["tasks"]:
        cells = [_ratio(t["retention"], mode, k) for k in ("score", "secondary") for mode in ("prefillshare", "naive")]
        retention.append(f"| {t['specialist']} | {t['task']} | " + " | ".join(cells) + " |")
    resolved = []
    for spec, per_task in report["full_ft_beats_base"].items():
        parts = []
        for task, r in per_task.items():
            which = [k for k in ("score", "secondary", "nll") if r[k]]
            parts.append(f"{task}: {', '.join(which) if which else 'none'}")
        resolved.append(f"- {spec}: " + "; ".join(parts))
    sweeps = []
    for spec, sw in report["sweeps"].items():
        if not sw:
            continue
        pts = {(p["label"], p["rho"]): p for p in sw.get("points", []) if p.get("over") == "positions"}
        rhos = sorted({r for _, r in pts})
        sweeps.append(f"**{spec}** ({sw['meta']['task']}, n={sw['meta']['n_items']}; NLL/token over ρ = "
                      f"{', '.join(str(r) for r in rhos)} of prompt positions shared):\n\n"
                      "| curve | " + " | ".join(f"ρ={r}" for r in rhos) + " |\n|---|" + "---|" * len(rhos) + "\n"
                      + "\n".join(f"| {label} | {_sweep_row(pts, rhos, label)} |" for label in ("naive", "prefillshare"))
                      + "\n")
    serving = report.get("serving") or {}
    serving_md = serving.get("markdown") or "Not run in this report."
    done = sorted({t["specialist"] for t in report["tasks"]})
    partial = "" if report.get("complete", True) else (
        f"> **Partial report**: finished specialists: {', '.join(done) or 'none'}. The study resumes where it "
        f"stopped; rerun `{command}` to continue.\n\n")
    fields = {
        "partial": partial, "command": command, "sittings": report["sittings"], "model": report["model"],
        "hardware": report["hardware"], "phase_seconds": ", ".join(f"{k} {v:.0f}" for k, v in ps.items()),
        "total_s": f"{total:.0f}", "total_min": f"{total / 60:.0f}",
        "load_average": ", ".join(f"{k} {v}" for k, v in report["load_average"].items()),
        "sittings_block": _sittings_block(sittings_notes), "specialists": "\n".join(specs),
        "primary_meaning": "; ".join(f"`{k}` = {v}" for k, v in report["metrics"]["primary"].items()),
        "primary_table": "\n".join(_table(report, "score", lambda x, ci: _pct(x) + _ci_pct(ci), _pp)),
        "secondary_meaning": "; ".join(f"`{k}` = {v}" for k, v in report["metrics"]["secondary"].items()),
        "secondary_table": "\n".join(_table(report, "secondary", lambda x, ci: _pct(x) + _ci_pct(ci), _pp)),
        "nll_table": "\n".join(_table(report, "nll", _nll, _dnll)), "retention": "\n".join(retention),
        "resolved": "\n".join(resolved), "sweeps": "\n".join(sweeps) if sweeps else "Not run.",
        "serving": serving_md, "reading": study_reading(report),
    }
    template = (resources.files("ccft.evals") / "templates" / "study_README.md").read_text(encoding="utf-8")
    return string.Template(template).substitute(fields)


def _sittings_block(notes: str | None) -> str:
    if not notes or not notes.strip():
        return ""
    quoted = "\n".join(f"> {line}".rstrip() for line in notes.strip().splitlines())
    return ("## Sittings (notes written by hand in `SITTINGS.md`, not generated)\n\n"
            "The phase times above are wall time; these notes say what else shared the machine.\n\n"
            f"{quoted}\n\n")

