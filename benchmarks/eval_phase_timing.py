"""Helper of benchmarks/eval_phase_timing.sh (issue 33: the evaluation phases, old code vs current code).

Not part of the package; works with whichever ``ccft`` is first on ``sys.path`` (main's ``src`` or an old
worktree's via ``PYTHONPATH``).

  python benchmarks/eval_phase_timing.py probe OUT.json -- eval --task bfcl-multiple ...
      runs ``ccft <args>`` in this process (``ccft.cli.main.main``) with wall-clock timers around the
      functions the eval path goes through, and writes OUT.json: the process time, the time of ``run_task``
      (the scope of the study's ``eval_SPEC`` phase: everything after the models are loaded) split into
      sub-phases (exclusive time: a timed call inside another timed call is subtracted from its parent).
      Functions a code does not have are skipped (listed under "not_found").

  python benchmarks/eval_phase_timing.py compare OLD_DIR NEW_DIR [--task bfcl-multiple] [--nll-tol 1e-5]
      prints the phase table (old, new, new/old) from the probe files (--old-phases, --new-phases) and checks
      the per-item records of the two output folders: generations identical, NLL within the tolerance, other
      shared fields equal; lists the fields only one code writes. Exit status 1 when records disagree.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from pathlib import Path

# (bucket, module, attribute path) -- patched where the eval path looks the name up
PROBES = [
    ("load_models", "ccft.cli.eval", "load_models"),
    ("eval_total(run_task)", "ccft.evals.runner", "run_task"),
    ("env_check", "ccft.evals.runner", "_check_environment"),
    ("prefill", "ccft.inference.engine", "SharedPrefillEngine.prefill"),
    ("prefill", "ccft.inference.engine", "SharedPrefillEngine.reserve_prefix"),  # new code only
    ("prefill", "ccft.evals.runner", "compute_base_cache"),  # C_base for a mode's NLL forward (old code)
    ("nll", "ccft.evals.runner", "batch_nll"),  # reference NLL, a full forward or on a C_base (old code)
    ("nll", "ccft.evals.generation", "handle_nll"),  # reference NLL on a group's prefill (new code)
    ("decode", "ccft.inference.engine", "SharedPrefillEngine.add_request"),
    ("decode", "ccft.inference.engine", "SharedPrefillEngine.step"),
    ("score", "ccft.evals.generation", "score_texts"),  # the task's scoring (BFCL checker subprocess)
    ("summary", "ccft.evals.runner", "summarize_task"),  # bootstrap CIs, paired deltas
]

_totals: dict[str, float] = {}
_calls: dict[str, int] = {}
_stack: list[list] = []  # [bucket, start, child time]


def _timed(bucket, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _stack.append([bucket, time.perf_counter(), 0.0])
        try:
            return fn(*args, **kwargs)
        finally:
            b, t0, child = _stack.pop()
            dt = time.perf_counter() - t0
            _totals[b] = _totals.get(b, 0.0) + dt - child  # exclusive
            _calls[b] = _calls.get(b, 0) + 1
            if _stack:
                _stack[-1][2] += dt
            if b == "eval_total(run_task)":  # inclusive too: the study's eval phase scope
                _totals["eval_inclusive"] = _totals.get("eval_inclusive", 0.0) + dt

    wrapper.__wrapped_for_timing__ = True
    return wrapper


def install() -> tuple[list[str], list[str]]:
    import importlib

    found, missing = [], []
    for bucket, mod_name, attr in PROBES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            missing.append(f"{mod_name}.{attr}")
            continue
        owner, *rest = attr.split(".")
        obj = getattr(mod, owner, None) if rest else mod
        name = rest[0] if rest else owner
        fn = getattr(obj, name, None) if obj is not None else None
        if fn is None or getattr(fn, "__wrapped_for_timing__", False):
            missing.append(f"{mod_name}.{attr}")
            continue
        setattr(obj, name, _timed(bucket, fn))
        found.append(f"{mod_name}.{attr} -> {bucket}")
    return found, missing


def probe(out_json: str, argv: list[str]) -> int:
    t0 = time.perf_counter()
    import ccft
    from ccft.cli.main import main

    t_import = time.perf_counter() - t0
    found, missing = install()
    t1 = time.perf_counter()
    rc = main(argv)
    t_main = time.perf_counter() - t1
    run = _totals.get("eval_inclusive", 0.0)
    inner = sum(
        v for k, v in _totals.items() if k not in ("eval_inclusive", "load_models", "eval_total(run_task)")
    )
    phases = {k: v for k, v in _totals.items() if k != "eval_total(run_task)"}
    phases["eval_other"] = _totals.get("eval_total(run_task)", 0.0)  # run_task's own time, outside sub-phases
    report = {
        "ccft_file": ccft.__file__,
        "argv": argv,
        "rc": rc,
        "import_s": t_import,
        "main_s": t_main,
        "eval_s": run,  # == the study's eval_SPEC phase scope (run_task of each task)
        "sub_phases_in_eval_s": inner,
        "phases_s": phases,
        "calls": _calls,
        "probes": found,
        "not_found": missing,
    }
    Path(out_json).write_text(json.dumps(report, indent=2))
    print(f"[phase-timing] {ccft.__file__}: eval {run:.1f} s, main {t_main:.1f} s -> {out_json}", flush=True)
    return rc


def _records(folder: Path) -> dict[str, dict[str, dict]]:
    out = {}
    for p in sorted(folder.glob("items.*.jsonl")):
        mode = p.name[len("items.") : -len(".jsonl")]
        recs = {}
        for line in p.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line
            recs[r["id"]] = r
        out[mode] = recs
    return out


def _text(r: dict):
    for key in ("text", "generation", "completion", "output"):
        if key in r:
            return r[key]
    s = r.get("samples")
    if isinstance(s, list) and s:
        return [x.get("text") for x in s]
    return None


def compare(
    old_dir: str,
    new_dir: str,
    task: str,
    tol: float,
    old_ph: str | None,
    new_ph: str | None,
    label_old: str,
    label_new: str,
) -> int:
    # phase table
    ph = []
    for p in (old_ph, new_ph):
        ph.append(json.loads(Path(p).read_text()) if p and Path(p).is_file() else None)
    if all(ph):
        o, n = ph
        keys = ["load_models", "env_check", "prefill", "nll", "decode", "score", "summary", "eval_other"]
        keys += sorted((set(o["phases_s"]) | set(n["phases_s"])) - set(keys) - {"eval_inclusive"})
        print(f"{'phase':24s} {label_old:>10s} {label_new:>10s} {'new/old':>8s}")

        def row(name, a, b):
            r = f"{b / a:8.3f}" if a else "     n/a"
            print(f"{name:24s} {a:10.1f} {b:10.1f} {r}")

        for k in keys:
            row(k, o["phases_s"].get(k, 0.0), n["phases_s"].get(k, 0.0))
        row("EVAL (run_task, =study)", o["eval_s"], n["eval_s"])
        row("ccft main (in process)", o["main_s"], n["main_s"])
        print("calls old:", o["calls"])
        print("calls new:", n["calls"])
        if o["not_found"] or n["not_found"]:
            print("probes absent: old", o["not_found"], "new", n["not_found"])
        verdict = n["eval_s"] / o["eval_s"] if o["eval_s"] else float("nan")
        if (label_old, label_new) == ("old", "new"):  # the code comparison (not the weight-path one)
            print(
                f"issue 33 target: eval new/old = {verdict:.3f} (<= 0.45 wanted): "
                f"{'MET' if verdict <= 0.45 else 'NOT met'}"
            )
        else:
            print(f"eval {label_new}/{label_old} = {verdict:.3f}")
    else:
        print("(phase files missing: no phase table)", old_ph, new_ph)
    # records
    a, b = _records(Path(old_dir) / task), _records(Path(new_dir) / task)
    bad = 0
    print(f"\nrecords: modes old {sorted(a)}, new {sorted(b)}")
    only_old, only_new = set(), set()
    for mode in sorted(set(a) | set(b)):
        ra, rb = a.get(mode, {}), b.get(mode, {})
        if set(ra) != set(rb):
            print(
                f"  {mode}: item ids differ: only old {sorted(set(ra) - set(rb))[:5]}, "
                f"only new {sorted(set(rb) - set(ra))[:5]}"
            )
            bad += 1
        same_text = nll_ok = n = 0
        max_dnll = 0.0
        other = {}
        for i in sorted(set(ra) & set(rb)):
            x, y = ra[i], rb[i]
            n += 1
            only_old |= set(x) - set(y)
            only_new |= set(y) - set(x)
            tx, ty = _text(x), _text(y)
            if tx == ty:
                same_text += 1
            elif bad < 20:
                print(f"  {mode} {i}: generations differ:\n    old {tx!r:.200}\n    new {ty!r:.200}")
            if "nll" in x and "nll" in y:
                d = abs(x["nll"] - y["nll"])
                max_dnll = max(max_dnll, d if not math.isnan(d) else math.inf)
                nll_ok += d <= tol
            for k in set(x) & set(y):
                if k in ("nll", "nll_sum") or x[k] == y[k]:
                    continue
                if isinstance(x[k], float) and isinstance(y[k], float) and abs(x[k] - y[k]) <= tol:
                    continue
                other.setdefault(k, 0)
                other[k] += 1
        ok = same_text == n and nll_ok == n and not other
        bad += not ok
        print(
            f"  {mode:12s} items {n}: generations identical {same_text}/{n}, NLL within {tol:g} {nll_ok}/{n} "
            f"(max |dNLL| {max_dnll:.2e}); other shared fields differing: {other or 'none'}"
            f"{'' if ok else '  <-- DISAGREE'}"
        )
    print(
        f"  fields only in old records: {sorted(only_old) or 'none'}; "
        f"only in new: {sorted(only_new) or 'none'}"
    )
    # settings recorded in meta.json
    ma = json.loads((Path(old_dir) / task / "meta.json").read_text())
    mb = json.loads((Path(new_dir) / task / "meta.json").read_text())
    sa, sb = ma.get("settings", {}), mb.get("settings", {})
    diff = {k: (sa.get(k), sb.get(k)) for k in set(sa) | set(sb) if sa.get(k) != sb.get(k)}
    print(f"  meta.json settings differing (old, new): {diff or 'none'}")
    print("RECORDS AGREE" if not bad else f"RECORDS DISAGREE ({bad} mode(s))")
    return 0 if not bad else 1


def cli() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "probe":
        if len(sys.argv) < 4 or sys.argv[3] != "--":
            sys.exit("usage: eval_phase_timing.py probe OUT.json -- CCFT_ARGS...")
        return probe(sys.argv[2], sys.argv[4:])
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=["compare"])
    p.add_argument("old_dir")
    p.add_argument("new_dir")
    p.add_argument("--task", default="bfcl-multiple")
    p.add_argument("--nll-tol", type=float, default=1e-5)
    p.add_argument("--old-phases")
    p.add_argument("--new-phases")
    p.add_argument("--labels", default="old,new")
    a = p.parse_args()
    lo, ln = a.labels.split(",")
    return compare(a.old_dir, a.new_dir, a.task, a.nll_tol, a.old_phases, a.new_phases, lo, ln)


if __name__ == "__main__":
    sys.exit(cli())
