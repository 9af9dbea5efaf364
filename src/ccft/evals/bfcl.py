"""BFCL "multiple" (Berkeley Function-Calling Leaderboard v4): pick and call one of 2-4 functions.

Data: ``ccft/evals/data/bfcl/BFCL_v4_multiple.json`` and its possible answers, copied from the PyPI
package ``bfcl-eval==2026.3.23`` (Apache-2.0; 200 items). Prompt: the user turn through the chat
template with the item's functions as ``tools`` (``ccft.evals.tool_calls.openai_tool``; a
template without tool support gets them in a system turn). The model answers with
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` — the format the ``tools-*`` recipes
train — which :func:`ccft.evals.tool_calls.parse_tool_calls` decodes to ``[{name: args}]``.

Scoring is BFCL's own AST checker (``bfcl_eval.eval_checker.ast_eval.ast_checker.ast_checker``,
category ``multiple``, language Python), run in a **separate virtual environment**: bfcl-eval pins
``numpy==1.26.4``, ``networkx==3.3`` and ``filelock==3.20.0``, which clash with ccft's pins
(numpy 2.4.6, networkx 3.6.1, filelock 4.3.1). ``python -m ccft.evals.bfcl setup`` creates it
(``<repo>/.venv-bfcl``; pins in :data:`CHECKER_PINS`); ``CCFT_BFCL_PYTHON`` may name another
interpreter that has bfcl-eval. One long-lived checker subprocess serves every call (its imports
take ~10-20 s once). Without the checker environment the task reports ``available: false`` and
``score`` returns ``{"available": 0.0}`` (never a silent 0); NLL on the reference calls still works.

Metric: ``accuracy`` (the checker's ``valid``), plus ``parsed`` (a call could be decoded at all).
NLL reference text: the first acceptable value of every parameter, written as a tool call.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ccft.core.io import display_path
from ccft.evals.task_base import EnvironmentCheckError, Item, Task, data_rows
from ccft.evals.tool_calls import format_tool_call, openai_tool, parse_tool_calls

__all__ = [
    "CHECKER_PINS",
    "BFCLMultipleTask",
    "calls_offered_function",
    "checker_python",
    "run_checker",
    "setup_checker_env",
    "tasks",
]

#: What ``setup`` installs into the checker environment (torch pinned to the CPU build ccft uses;
#: soundfile: qwen-agent, imported by bfcl-eval's model table, needs it but does not declare it).
CHECKER_PINS = ("bfcl-eval==2026.3.23", "soundfile==0.14.0")
CHECKER_CONSTRAINTS = ("torch==2.13.0",)
MODEL_NAME = "gorilla-openfunctions-v2"  # a BFCL model entry whose function names keep their dots

_REPO = Path(__file__).resolve().parents[3]

_CHECKER = r"""
import json, sys
from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
from bfcl_eval.constants.enums import Language
print("CCFT-BFCL-READY", flush=True)
for line in sys.stdin:
    out = []
    for job in json.loads(line):
        try:
            r = ast_checker(job["functions"], job["decoded"], job["possible_answer"], Language.PYTHON, "multiple",
                            job["model_name"])
            out.append({"valid": bool(r["valid"]), "error": [str(e) for e in r.get("error", [])],
                        "error_type": r.get("error_type", "")})
        except Exception as e:
            out.append({"valid": False, "error": [repr(e)], "error_type": "checker_exception"})
    print("CCFT-BFCL-RESULT " + json.dumps(out), flush=True)
"""  # noqa: E501 (checker program text, kept byte for byte)


class _CheckerProcess:
    # One long-lived checker subprocess per interpreter (its imports take 10-20 s), fed one JSON line
    # per batch. Closed at exit.

    def __init__(self, python: str):
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": tempfile.gettempdir(),
            "PYTHONDONTWRITEBYTECODE": "1",
            "BFCL_PROJECT_ROOT": tempfile.gettempdir(),
        }
        self.proc = subprocess.Popen(
            [python, "-u", "-c", _CHECKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        first = self.proc.stdout.readline()
        if not first.startswith("CCFT-BFCL-READY"):
            err = self.proc.stderr.read()[-800:] if self.proc.poll() is not None else ""
            self.close()
            raise EnvironmentCheckError(f"BFCL checker did not start with {python}: {first!r} {err}")

    def check(self, jobs: list[dict]) -> list[dict]:
        self.proc.stdin.write(json.dumps(jobs) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line.startswith("CCFT-BFCL-RESULT "):
            raise EnvironmentCheckError(f"BFCL checker failed: {line!r}")
        return json.loads(line[len("CCFT-BFCL-RESULT ") :])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_PROCS: dict[str, _CheckerProcess] = {}
_PROCS_LOCK = threading.Lock()


@atexit.register
def _close_checkers() -> None:
    for p in _PROCS.values():
        p.close()


def checker_python() -> str | None:
    """The interpreter with bfcl-eval: ``$CCFT_BFCL_PYTHON``, ``<repo>/.venv-bfcl``, or
    ``$CCFT_HOME/bfcl-venv``."""
    from ccft.core.models import ccft_home

    candidates = [
        os.environ.get("CCFT_BFCL_PYTHON", ""),
        str(_REPO / ".venv-bfcl" / "bin" / "python"),
        str(ccft_home() / "bfcl-venv" / "bin" / "python"),
    ]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def run_checker(jobs: list[dict], python: str | None = None) -> list[dict]:
    """Run BFCL's ast_checker on ``jobs`` ({functions, decoded, possible_answer}) in the checker env.

    Returns one ``{"valid", "error", "error_type"}`` per job. A long-lived checker process per
    interpreter serves every call. Raises EnvironmentCheckError when the environment is missing
    or the checker fails.
    """
    python = python or checker_python()
    if python is None:
        raise EnvironmentCheckError(
            "BFCL checker environment not found; create it with "
            "`python -m ccft.evals.bfcl setup` or set CCFT_BFCL_PYTHON"
        )
    with _PROCS_LOCK:
        proc = _PROCS.get(python)
        if proc is None or proc.proc.poll() is not None:
            proc = _PROCS[python] = _CheckerProcess(python)
        return proc.check([dict(j, model_name=MODEL_NAME) for j in jobs])


def setup_checker_env(venv: str | os.PathLike | None = None) -> str:
    """Create the checker virtual environment with :data:`CHECKER_PINS`; returns its python."""
    venv = Path(venv or _REPO / ".venv-bfcl")
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(CHECKER_CONSTRAINTS) + "\n")
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-c", f.name, *CHECKER_PINS], check=True
    )
    os.unlink(f.name)
    return str(venv / "bin" / "python")


def _first_choice(answer: dict) -> dict:
    """BFCL possible answer {param: [acceptable values]} -> one call's arguments.

    Takes the first acceptable value of each parameter ('' = optional, left out); nested
    dictionaries are possible-answer mappings themselves and resolve the same way.
    """

    def resolve(value):
        if isinstance(value, dict):
            return _first_choice(value)
        if isinstance(value, list):
            return [resolve(v) for v in value]
        return value

    return {k: resolve(v[0]) for k, v in answer.items() if v and v[0] != ""}


def calls_offered_function(decoded: list[dict[str, dict]], functions: list[dict]) -> bool:
    """True if any decoded call (``[{name: arguments}]``) names one of ``functions`` (BFCL function docs)."""
    offered = {f["name"] for f in functions}
    return any(name in offered for call in decoded for name in call)


@dataclass
class BFCLMultipleTask(Task):
    name: str = "bfcl-multiple"
    prompt_style: str = "chat"
    max_new_tokens: int = 160
    default_limit: int | None = 50
    #: ``parsed``: at least one call parses (``tool_calls.parse_tool_calls``); ``offered_call``: at least one
    #: parsed call names a function the item offers (right or wrong arguments): the study's secondary metric.
    metrics: tuple[str, ...] = ("accuracy", "offered_call", "parsed")
    primary_metric: str = "accuracy"
    secondary_metric: str | None = "offered_call"
    license: str = "Apache-2.0 (bfcl-eval 2026.3.23 / ShishirPatil/gorilla)"
    data: str = "ccft/evals/data/bfcl/BFCL_v4_multiple.json (200 items) + possible answers"
    last_results: list = field(default_factory=list, repr=False, compare=False)

    def _load_all(self) -> list[Item]:
        answers = {
            a["id"]: a["ground_truth"] for a in data_rows("bfcl/BFCL_v4_multiple.possible_answer.json")
        }
        items = []
        for r in data_rows("bfcl/BFCL_v4_multiple.json"):
            if len(r["question"]) != 1:
                raise EnvironmentCheckError(f"BFCL {r['id']}: expected one turn, got {len(r['question'])}")
            items.append(
                Item(
                    id=r["id"],
                    prompt=r["question"][0],
                    reference=answers[r["id"]],
                    metadata={"functions": r["function"], "tools": [openai_tool(f) for f in r["function"]]},
                )
            )
        return items

    def reference_text(self, item: Item) -> str | None:
        ((name, args),) = item.reference[0].items()
        return format_tool_call(name, _first_choice(args))

    def available(self) -> bool:
        return checker_python() is not None

    def score_many(self, pairs: list[tuple[Item, str]]) -> list[dict[str, float]]:
        if not self.available():
            return [{"available": 0.0} for _ in pairs]
        decoded = [parse_tool_calls(self.postprocess(item, gen)) for item, gen in pairs]
        jobs = [
            {"functions": item.metadata["functions"], "decoded": d, "possible_answer": item.reference}
            for (item, _), d in zip(pairs, decoded, strict=True)
        ]
        results = run_checker(jobs)
        self.last_results = results
        return [
            {
                "accuracy": float(r["valid"]),
                "parsed": float(bool(d)),
                "offered_call": float(calls_offered_function(d, item.metadata["functions"])),
            }
            for r, d, (item, _) in zip(results, decoded, pairs, strict=True)
        ]

    def score(self, item: Item, generation: str) -> dict[str, float]:
        return self.score_many([(item, generation)])[0]

    def check_environment(self, limit: int | None = None) -> dict:
        """The checker accepts every reference call (first acceptable values) and rejects a wrong function."""
        python = checker_python()
        report = {
            "task": self.name,
            "available": python is not None,
            "checker_python": display_path(python) if python else None,  # reports carry no machine path
            "checker_pins": list(CHECKER_PINS),
        }
        if python is None:
            report.update(ok=True, reason="no checker environment: run `python -m ccft.evals.bfcl setup`")
            return report
        items = self.load(limit)
        good = self.score_many([(it, self.reference_text(it)) for it in items])
        wrong = [(it, format_tool_call("not_a_function", {})) for it in items[:5]]
        bad = self.score_many(wrong)
        failed = [it.id for it, s in zip(items, good, strict=True) if s["accuracy"] != 1.0]
        accepted_bad = [it.id for (it, _), s in zip(wrong, bad, strict=True) if s["accuracy"] != 0.0]
        report.update(
            reference_passed=len(items) - len(failed),
            reference_total=len(items),
            reference_failed=failed,
            wrong_accepted=accepted_bad,
            ok=not failed and not accepted_bad,
        )
        if not report["ok"]:
            raise EnvironmentCheckError(f"{self.name}: checker environment check failed: {report}")
        return report


def tasks() -> list[Task]:
    return [BFCLMultipleTask()]


def main(argv: list[str] | None = None) -> int:
    """``python -m ccft.evals.bfcl setup [VENV_DIR]``: create the BFCL checker environment.

    Returns the exit status: 0 done (``--help`` included), 2 bad arguments or a ``VENV_DIR`` that is an
    existing file (one line on stderr).
    """
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m ccft.evals.bfcl", description="BFCL v3 'multiple' tool-calling checker environment."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    setup = sub.add_parser(
        "setup",
        help="create the checker virtual environment (bfcl-eval, pinned)",
        description="Create a virtual environment with the pinned BFCL checker "
        f"({', '.join(CHECKER_PINS)}) and print its python.",
    )
    setup.add_argument(
        "venv",
        nargs="?",
        default=None,
        help=f"folder of the virtual environment (default: {_REPO / '.venv-bfcl'})",
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.venv is not None and Path(args.venv).exists() and not Path(args.venv).is_dir():
        parser.exit(2, f"{parser.prog} setup: error: {args.venv} is an existing file, not a folder\n")
    print(setup_checker_env(args.venv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
