"""``ccft report RUNS... -o DIR``: Markdown tables, plots and report.json from result folders.

RUNS are folders written by ``ccft eval --out`` or ``ccft demo --out`` (one sub-folder per task with
``meta.json`` and ``items.MODE.jsonl``: the eval runner's one result format), by ``ccft sweep --out``
(``sweep.json``), or ``results.json`` files of ccft 0.1 demos, searched recursively. DIR receives
``README.md`` (headline table, one section per task with each mode and its paired deltas against
Full-FT, the sharing sweep), one PNG per task, ``sweep.png`` and ``report.json`` with every number
and per-item record. Means and deltas are recomputed from the
per-item records, so a partially finished eval reports what it has, with its n.

Example::

    ccft report reports/eval reports/sweep -o reports/report
"""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser(
        "report", help="tables + plots (vs Full-FT and naive sharing) from eval / sweep folders"
    )
    p.add_argument("runs", nargs="+", help="result folders (ccft eval / ccft sweep / ccft demo outputs)")
    p.add_argument("-o", "--out", default="reports/report", help="report folder")
    p.add_argument("--title", default="ccft report")
    p.set_defaults(func=run)


def run(args) -> int:
    from ccft.evals.report import build_report

    report = build_report(args.runs, args.out, title=args.title)
    print(
        f"[ccft] report: {len(report['tasks'])} task(s), {len(report['sweeps'])} sweep(s) -> "
        f"{args.out}/README.md, {args.out}/report.json"
        + (f" ({report['plot_error']})" if report["plot_error"] else f", {len(report['plots'])} plot(s)")
    )
    return 0
