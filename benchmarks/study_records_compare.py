"""Two ``ccft study`` report folders side by side, record by record (issue 32: the study's evaluations on the
base's fp32 weights and on the GGUF's Q4_1 / Q8_0 blocks, ``CCFT_BLOCK_WEIGHTS``).

For every task folder of the first report (``<specialist>/<task>/items.<mode>.jsonl``) and every mode: the
items both hold, how many generated texts are identical, the largest per-item |ΔNLL/token| and the task's
|ΔNLL/token| (sum of NLLs ÷ tokens), and whether the task's scored metrics (``summary.json``: means, CIs) are
equal.

    python benchmarks/study_records_compare.py reports/study runs/study-blocks
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ccft.evals.results import folder_records

MAIN_TASKS = ("gsm8k", "gsm-plus", "humaneval", "humaneval-plus", "bfcl-multiple")


def records(folder: Path) -> dict[str, dict[str, dict]]:
    """mode -> item id -> record of a task folder (``ccft.evals.results.folder_records``)."""
    return {mode: {r["id"]: r for r in recs} for mode, recs in folder_records(folder).items()}


def metrics(folder: Path) -> dict:
    """mode -> the task's scored metrics (means, CIs, n) from ``summary.json`` (not its NLLs)."""
    p = folder / "summary.json"
    if not p.is_file():
        return {}
    return {mode: row.get("metrics") for mode, row in json.loads(p.read_text()).get("modes", {}).items()}


def compare(a: Path, b: Path) -> list[dict]:
    rows = []
    for spec in sorted(p for p in a.iterdir() if p.is_dir()):
        for tdir in sorted(p for p in spec.iterdir() if (p / "meta.json").is_file()):
            other = b / spec.name / tdir.name
            ra, rb = records(tdir), records(other)
            ma, mb = metrics(tdir), metrics(other)
            for mode in sorted(ra):
                x, y = ra[mode], rb.get(mode, {})
                ids = sorted(set(x) & set(y))
                nll = [i for i in ids if x[i].get("nll") is not None and y[i].get("nll") is not None]
                sums = [i for i in nll if x[i].get("nll_sum") is not None and x[i].get("nll_tokens")]
                tokens = sum(x[i]["nll_tokens"] for i in sums)
                rows.append(
                    {
                        "specialist": spec.name,
                        "task": tdir.name,
                        "mode": mode,
                        "items": len(x),
                        "items_compared": len(ids),
                        "texts_equal": sum(x[i].get("text") == y[i].get("text") for i in ids),
                        "max_item_dnll": max((abs(x[i]["nll"] - y[i]["nll"]) for i in nll), default=None),
                        "task_dnll": abs(sum(x[i]["nll_sum"] - y[i]["nll_sum"] for i in sums)) / tokens
                        if tokens
                        else None,
                        "metrics_equal": ma.get(mode) == mb.get(mode) if ma or mb else None,
                    }
                )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("first", type=Path, help="a study report folder (the reference)")
    ap.add_argument("second", type=Path, help="the other one")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    rows = compare(args.first, args.second)

    def f(v):
        return "n/a" if v is None else f"{v:.1e}"

    print(
        "| specialist | task | mode | items | texts identical |",
        "max item dNLL/token | task dNLL/token | metrics equal |",
    )
    print("|---|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['specialist']} | {r['task']} | {r['mode']} | {r['items_compared']}/{r['items']} "
            f"| {r['texts_equal']} "
            f"| {f(r['max_item_dnll'])} | {f(r['task_dnll'])} | {r['metrics_equal']} |"
        )
    for name, sel in (
        ("all tasks", rows),
        ("the five main tasks", [r for r in rows if r["task"] in MAIN_TASKS]),
    ):
        n, eq = sum(r["items_compared"] for r in sel), sum(r["texts_equal"] for r in sel)
        d = [r["max_item_dnll"] for r in sel if r["max_item_dnll"] is not None]
        print(f"{name}: texts identical {eq}/{n}; largest item dNLL/token {f(max(d) if d else None)}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
