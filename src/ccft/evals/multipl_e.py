"""MultiPL-E HumanEval translations (evaluation only), one task per language: ``multipl-e-<lang>``.

Data: ``ccft/evals/data/multipl_e_humaneval/humaneval-<lang>.jsonl`` (the ``reworded`` MultiPL-E rows
via DeepSeek-Coder; licence BSD-3-Clause **plus a clause forbidding use as ML training data** —
``LICENSE.MultiPL-E``: evaluation only, never in a recipe). Languages: cpp, java, js, ts, go, rs,
php, rb, pl, lua, r, sh (154-161 problems each).

Protocol (MultiPL-E's): completion prompting on the raw prompt; the row's ``stop_tokens`` cut the
generation *before* the stop string, and the program is ``prompt + completion + "\\n" + tests``.
Generation stops at them too, as MultiPL-E's own harness does (every row of a language has the same
``stop_tokens``; they are the task's ``stop``): the text up to the first stop string is the same as
when decoding on to ``max_new_tokens`` and cutting afterwards, so the scores are too, for fewer
decoded tokens (about half on the study's records, docs/study.md "Time").
For brace languages the tests begin with the closing brace the stop string cut (``\\n}`` for
cpp/rs/sh, ``\\n    }\\n`` for java), so the brace appears exactly once — the stop string is never
appended back (docs/design.md K8). Verdict: exit status 0 (Perl: and no ``ERROR``; Go: ``go test`` without
``FAIL``), in the sandbox of ``ccft.evals.execution``.

Availability (K8): a language is scored only if :func:`ccft.evals.execution.check_language` finds
its toolchain *and* test libraries; otherwise its task reports ``available: false`` with the reason
and ``score`` returns ``{"available": 0.0}`` — never a pass@1 of 0. ``check_environment`` also runs
the hand-written fixtures below (a correct and a wrong completion of ``HumanEval_53_add``, and a raw
generation that still contains the stop string and trailing text) and, where MBXP ships canonical
solutions for the language (java, js, php, rb), the first MBXP problems: all must behave as expected.
The bundled MultiPL-E rows have no reference solutions, so ``reference_text`` is None (no NLL).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ccft.core.errors import DataError
from ccft.evals.code import CodeTask
from ccft.evals.execution import check_language, language, run_programs
from ccft.evals.task_base import EnvironmentCheckError, Item, data_rows

__all__ = [
    "FIXTURES",
    "MBXP_FILES",
    "MULTIPL_E_LANGUAGES",
    "MultiPLETask",
    "language_stop",
    "mbxp_canonical_jobs",
    "tasks",
]

MULTIPL_E_LANGUAGES = ("cpp", "java", "js", "ts", "go", "rs", "php", "rb", "pl", "lua", "r", "sh")

#: Hand-written completions of HumanEval_53_add (``add(x, y)``): (passing, failing, raw generation
#: that includes the stop string and more text, which must pass after truncation).
FIXTURES: dict[str, tuple[str, str, str]] = {
    "cpp": (
        "\n    return x + y;",
        "\n    return x - y;",
        "\n    return x + y;\n}\n\nlong unused() {\n    return 0;\n}\n",
    ),
    "java": (
        "\n        return x + y;",
        "\n        return x - y;",
        "\n        return x + y;\n    }\n    public static long unused() { return 0l; }\n}\n",
    ),
    "js": (
        "\n  return x + y;\n}\n",
        "\n  return x - y;\n}\n",
        "\n  return x + y;\n}\n\nfunction unused() {}\n",
    ),
    "ts": (
        "\n  return x + y;\n}\n",
        "\n  return x - y;\n}\n",
        "\n  return x + y;\n}\n\nfunction unused() {}\n",
    ),
    "go": (
        "\n    return x + y\n}\n",
        "\n    return x - y\n}\n",
        "\n    return x + y\n}\n\nfunc unused() {}\n",
    ),
    "rs": ("\n    x + y", "\n    x - y", "\n    x + y\n}\n\nfn unused() {}\n"),
    "php": (
        "\n    return $x + $y;\n}\n",
        "\n    return $x - $y;\n}\n",
        "\n    return $x + $y;\n}\n\nfunction unused() {}\n",
    ),
    "rb": ("\n  x + y\nend\n", "\n  x - y\nend\n", "\n  x + y\nend\n\ndef unused\nend\n"),
    "pl": (
        "\n    return $x + $y;\n}\n",
        "\n    return $x - $y;\n}\n",
        "\n    return $x + $y;\n}\n\nsub unused { }\n",
    ),
    "lua": (
        "\n    return x + y\nend\n",
        "\n    return x - y\nend\n",
        "\n    return x + y\nend\n\nlocal function unused() end\n",
    ),
    "r": ("\n    x + y\n}\n", "\n    x - y\n}\n", "\n    x + y\n}\n# trailing comment\nunused <- 1\n"),
    "sh": (
        "\n    echo $(( $1 + $2 ))",
        "\n    echo $(( $1 - $2 ))",
        "\n    echo $(( $1 + $2 ))\n}\n\nunused() {\n    :\n}\n",
    ),
}
FIXTURE_PROBLEM = "HumanEval_53_add"

#: MBXP files with canonical solutions, per language (CC-BY-4.0, ccft/evals/data/mbxp).
MBXP_FILES = {
    "java": "mbjp_release_v1.2.jsonl",
    "js": "mbjsp_release_v1.2.jsonl",
    "php": "mbphp_release_v1.2.jsonl",
    "rb": "mbrbp_release_v1.2.jsonl",
}


#: MBXP canonical solutions that fail in any environment (checked here on the first 40 problems of
#: js/php/rb and 25 of java): they use a parameter name that differs from the signature's
#: (``testTup1`` vs ``testtup1``) — upstream data bugs, skipped and listed, not environment faults.
MBXP_KNOWN_BROKEN = frozenset(
    {"MBJSP/2", "MBJSP/18", "MBJSP/26", "MBJSP/29", "MBJSP/37", "MBPHP/26", "MBPHP/37"}
)


@lru_cache(maxsize=None)
def _rows(lang: str) -> tuple[dict, ...]:
    return tuple(data_rows(f"multipl_e_humaneval/humaneval-{lang}.jsonl"))


def language_stop(lang: str) -> tuple[str, ...]:
    """The ``stop_tokens`` every bundled MultiPL-E row of ``lang`` carries (``("\\n}",)`` for cpp).

    Raises:
        DataError: the rows of ``lang`` do not all carry the same stop tokens (then no single
            task-wide stop exists; the bundled data has one per language).
    """
    found = {tuple(r["stop_tokens"]) for r in _rows(lang)}
    if len(found) != 1:
        raise DataError(
            f"multipl-e-{lang}: the rows' stop_tokens differ ({sorted(found)}); expected one set "
            f"per language as in MultiPL-E's data"
        )
    return found.pop()


def mbxp_canonical_jobs(lang: str, limit: int | None = 10) -> list[tuple[str, dict]]:
    """(task_id, run_program kwargs) for the first ``limit`` MBXP problems of ``lang`` that have a
    canonical solution (not in :data:`MBXP_KNOWN_BROKEN`): ``prompt + canonical_solution + "\\n" +
    test`` (mxeval's assembly)."""
    if lang not in MBXP_FILES:
        return []
    jobs = []
    for r in data_rows(f"mbxp/{MBXP_FILES[lang]}"):
        if not r.get("canonical_solution") or r["task_id"] in MBXP_KNOWN_BROKEN:
            continue
        src = r["prompt"] + r["canonical_solution"] + "\n" + r["test"]
        kw = {"lang_name": lang, "source": src, "timeout_s": 20.0}
        if lang == "java":
            kw["main_class"] = "Main"
        jobs.append((r["task_id"], kw))
        if limit is not None and len(jobs) >= limit:
            break
    return jobs


@dataclass
class MultiPLETask(CodeTask):
    language: str = "cpp"
    prompt_style: str = "completion"
    max_new_tokens: int = 384
    default_limit: int | None = 20
    timeout_s: float = 15.0
    license: str = "MultiPL-E: BSD-3-Clause + no-ML-training clause (evaluation only)"

    def __post_init__(self) -> None:
        # generation stops where scoring cuts (MultiPL-E's harness does the same); an explicit ``stop`` is
        # kept
        if not self.stop:
            self.stop = language_stop(self.language)

    def _load_all(self) -> list[Item]:
        return [
            Item(
                id=r["name"],
                prompt=r["prompt"],
                reference=None,
                metadata={"tests": r["tests"], "stop": tuple(r["stop_tokens"]), "language": self.language},
            )
            for r in _rows(self.language)
        ]

    def build_program(self, item: Item, completion: str) -> tuple[str, dict]:
        return item.prompt + completion + "\n" + item.metadata["tests"], {}

    def reference_text(self, item: Item) -> str | None:
        return None

    def availability(self) -> dict:
        return check_language(self.language).to_dict()

    def describe(self) -> dict:
        d = super().describe()
        d["availability"] = self.availability()
        return d

    def check_environment(self, limit: int | None = 10) -> dict:
        """K8 for one language: available? fixtures pass/fail as written? MBXP canonical solutions pass?

        ``limit``: MBXP canonical problems to run (None = all of them). An unavailable language is
        *reported* (``available: false``, no exception): it is left out of scoring, never zeroed.
        Raises EnvironmentCheckError if the language is available but a check fails.
        """
        av = check_language(self.language)
        report = {
            "task": self.name,
            "language": self.language,
            "available": av.available,
            "version": av.version,
            "reason": av.reason,
            "isolation": av.isolation,
        }
        if not av.available:
            report["ok"] = True
            return report
        items = {it.id: it for it in self.load()}
        item = items[FIXTURE_PROBLEM]
        good, bad, raw = FIXTURES[self.language]
        fixture_scores = self.score_many([(item, good), (item, bad), (item, raw)])
        fixtures_ok = [s["passed"] for s in fixture_scores] == [1.0, 0.0, 1.0]
        mbxp = mbxp_canonical_jobs(self.language, limit)
        mbxp_results = run_programs([kw for _, kw in mbxp]) if mbxp else []
        mbxp_failed = [tid for (tid, _), r in zip(mbxp, mbxp_results, strict=True) if not r.passed]
        report.update(
            fixtures={
                "pass": fixture_scores[0]["passed"],
                "fail": fixture_scores[1]["passed"],
                "raw_generation": fixture_scores[2]["passed"],
            },
            mbxp_canonical_passed=len(mbxp) - len(mbxp_failed),
            mbxp_canonical_total=len(mbxp),
            mbxp_canonical_failed=mbxp_failed,
            ok=fixtures_ok and not mbxp_failed,
        )
        if not report["ok"]:
            details = [r.detail[-300:] for r in (self.last_results + mbxp_results) if not r.passed][:2]
            raise EnvironmentCheckError(
                f"{self.name}: execution environment check failed: {report}; e.g. {details}"
            )
        return report


def tasks() -> list[MultiPLETask]:
    out = []
    for lang in MULTIPL_E_LANGUAGES:
        language(lang)  # every task language has a toolchain spec
        out.append(
            MultiPLETask(
                name=f"multipl-e-{lang}",
                language=lang,
                data=f"ccft/evals/data/multipl_e_humaneval/humaneval-{lang}.jsonl",
            )
        )
    return out
