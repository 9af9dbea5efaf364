"""HumanEval and HumanEval+ (EvalPlus extended tests), executed in the sandbox.

Data: ``ccft/evals/data/humaneval/HumanEval.jsonl.gz`` (MIT) and
``ccft/evals/data/humanevalplus/HumanEvalPlus.jsonl.gz`` (Apache-2.0, EvalPlus v0.1.10 data), 164
problems each.

Prompting (``prompt_style``):
  * ``completion`` (default, the Codex / bigcode-harness protocol): the model continues the raw
    prompt (signature + docstring). Stop strings (bigcode harness): ``\\nclass``, ``\\ndef``,
    ``\\n#``, ``\\n@``, ``\\nprint``, ``\\nif``, ``\\n```\\```. Only a stop string at column 0
    cuts, so the body's indentation is kept (K7); the continuation is used as is (no strip).
  * ``chat``: one user turn asking for the completed function in a fenced block; the first
    ```` ```python ```` block is the solution (prompt imports prepended; if it does not define the
    entry point, it is read as a body continuing the prompt).

Program = prompt + completion + tests, prompt exactly once (a continuation that repeats the
prompt is cut back, K7). It passes only if it exits 0 *and* prints a per-run random marker after
the last check, so a completion that calls ``exit(0)`` early does not pass.

* ``humaneval``: the original ``check(candidate)`` tests.
* ``humaneval-plus``: EvalPlus's rule — the outputs on ``base_input`` + ``plus_input`` must equal
  the canonical solution's outputs (floats: ``allclose`` with ``rtol=1e-7`` and the task's
  ``atol``, or ``1e-6`` when ``atol`` is 0; ``find_zero``: ``|poly(x)| <= atol``). The expected
  outputs are computed once by running the canonical solutions in the same sandbox and cached
  under ``$CCFT_HOME/evals``; each candidate's time limit is ``max(timeout_s, 4 x canonical time
  + 1 s)``.

K8 gate: ``check_environment()`` runs every canonical solution through the very program assembly
and sandbox used for model outputs and requires 100 % to pass (and known-bad completions to fail).
"""

from __future__ import annotations

import ast
import hashlib
import pickle
import re
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ccft.core.io import atomic_write_file
from ccft.evals.code import CodeTask
from ccft.evals.execution import check_language, run_programs
from ccft.evals.sandbox import Limits, Sandbox
from ccft.evals.task_base import EnvironmentCheckError, Item, data_dir, data_rows

__all__ = [
    "HUMANEVAL_STOP",
    "HumanEvalPlusTask",
    "HumanEvalTask",
    "defines_entry_point",
    "extract_code_block",
    "tasks",
]

HUMANEVAL_STOP = ("\nclass", "\ndef", "\n#", "\n@", "\nprint", "\nif", "\n```")
_PASS_MARK = "CCFT-PASS-"
_CHAT_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function (signature "
    "included) in one ```python code block.\n\n```python\n{prompt}```"
)
_FENCE = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL)


def extract_code_block(text: str) -> str:
    """The first fenced code block of a chat reply (an unterminated block runs to the end), else the text."""
    m = _FENCE.search(text)
    return m.group(1) if m else text


def defines_entry_point(code: str, entry_point: str) -> bool:
    """True if ``code`` compiles as Python (``compile``: syntax and compile-time errors such as a ``return``
    outside a function; nothing is executed) and defines a module-level function named ``entry_point``.
    A completion that breaks the prompt's function body, or stops inside it, fails."""
    try:
        compile(code, "<completion>", "exec", dont_inherit=True)
        tree = ast.parse(code)
    except (SyntaxError, ValueError, MemoryError, RecursionError):  # ValueError: NUL bytes in the source
        return False
    return any(
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == entry_point
        for node in tree.body
    )


@dataclass
class HumanEvalTask(CodeTask):
    name: str = "humaneval"
    stop: tuple[str, ...] = HUMANEVAL_STOP
    max_new_tokens: int = 384
    default_limit: int | None = 40
    #: ``compiles``: prompt + completion parse as Python and define the entry point at module level
    #: (``defines_entry_point``; nothing is run); the study's secondary metric for code.
    metrics: tuple[str, ...] = ("pass@1", "compiles")
    secondary_metric: str | None = "compiles"
    license: str = "MIT (openai/human-eval)"
    data: str = "ccft/evals/data/humaneval/HumanEval.jsonl.gz (164 problems)"
    file: str = "humaneval/HumanEval.jsonl.gz"

    def __post_init__(self):
        if self.prompt_style == "chat":
            self.stop = ()

    def _rows(self) -> list[dict]:
        return data_rows(self.file)

    def _load_all(self) -> list[Item]:
        return [
            Item(
                id=r["task_id"],
                prompt=r["prompt"],
                reference=r["canonical_solution"],
                metadata={"entry_point": r["entry_point"], "test": r["test"]},
            )
            for r in self._rows()
        ]

    def prompt_text(self, item: Item):
        if self.prompt_style == "chat":
            return _CHAT_INSTRUCTION.format(prompt=item.prompt)
        return item.prompt

    def completion_code(self, item: Item, completion: str) -> str:
        """Prompt + completion as one module (prompt exactly once)."""
        if self.prompt_style != "chat":
            return item.prompt + completion
        code = extract_code_block(completion)
        if re.search(rf"^def {re.escape(item.metadata['entry_point'])}\s*\(", code, re.MULTILINE):
            imports = "".join(
                line + "\n" for line in item.prompt.splitlines() if line.startswith(("import ", "from "))
            )
            return imports + code
        return item.prompt + code

    def build_program(self, item: Item, completion: str) -> tuple[str, dict]:
        nonce = secrets.token_hex(8)
        src = (
            self.completion_code(item, completion) + "\n\n" + item.metadata["test"] + "\n\n"
            f"check({item.metadata['entry_point']})\nprint({_PASS_MARK + nonce!r})\n"
        )
        return src, {"nonce": nonce}

    def score_many(self, pairs, workers=None):
        """Scores of (item, generation) pairs; a pass needs exit 0 and this run's marker printed last."""
        if not check_language(self.language).available:
            return super().score_many(pairs, workers)
        jobs, nonces = [], []
        for item, gen in pairs:
            src, kw = self.build_program(item, self.postprocess(item, gen))
            nonces.append(kw.pop("nonce"))
            kw.update(lang_name=self.language, source=src)
            kw.setdefault("timeout_s", self.item_timeout(item))
            jobs.append(kw)
        results = run_programs(jobs, workers=workers or self.workers or None)
        self.last_results = results
        compiles = [
            defines_entry_point(
                self.completion_code(item, self.postprocess(item, gen)), item.metadata["entry_point"]
            )
            for item, gen in pairs
        ]
        return [
            {"passed": float(r.passed and r.stdout.rstrip().endswith(_PASS_MARK + n)), "compiles": float(c)}
            for r, n, c in zip(results, nonces, compiles, strict=True)
        ]

    def item_timeout(self, item: Item) -> float:
        return self.timeout_s

    def check_environment(self, limit: int | None = None) -> dict:
        """K8: every canonical solution passes here (100 %); a known-bad completion fails."""
        av = check_language("python")
        if not av.available:
            raise EnvironmentCheckError(f"{self.name}: Python is not runnable in the sandbox: {av.reason}")
        items = self.load(limit)
        canon = self._canonical_pairs(items)
        scores = self.score_many(canon)
        canon_results = list(self.last_results)  # the known-bad run below replaces last_results
        failed = [it.id for it, s in zip(items, scores, strict=True) if s["passed"] != 1.0]
        bad = self.score_many([(it, "    raise NotImplementedError\n") for it in items[:5]])
        passing_bad = [it.id for it, s in zip(items[:5], bad, strict=True) if s["passed"] != 0.0]
        report = {
            "task": self.name,
            "language": "python",
            "version": av.version,
            "isolation": av.isolation,
            "canonical_passed": len(items) - len(failed),
            "canonical_total": len(items),
            "canonical_failed": failed,
            "known_bad_passed": passing_bad,
            "ok": not failed and not passing_bad,
        }
        if not report["ok"]:
            details = [
                r.detail[-300:] for r, s in zip(canon_results, scores, strict=True) if s.get("passed") != 1.0
            ][:3]
            raise EnvironmentCheckError(
                f"{self.name}: canonical solutions failed in this environment: {failed[:10]} "
                f"known-bad passing: {passing_bad}; e.g. {details}"
            )
        return report

    def _canonical_pairs(self, items: list[Item]) -> list[tuple[Item, str]]:
        if self.prompt_style == "chat":
            return [(it, "```python\n" + it.prompt + it.reference + "```") for it in items]
        return [(it, it.reference) for it in items]


# ------------------------------------------------------------------ HumanEval+

_PLUS_DRIVER = r"""

import pickle as _ccft_pickle, copy as _ccft_copy, math as _ccft_math

def _ccft_flat(x):
    if isinstance(x, (list, tuple)):
        out = []
        for v in x:
            out.extend(_ccft_flat(v))
        return out
    return [x]

def _ccft_is_floats(x):
    if isinstance(x, float):
        return True
    if isinstance(x, (list, tuple)) and x:
        return all(isinstance(i, float) for i in x)
    return False

def _ccft_allclose(out, exp, atol):
    a, b = _ccft_flat(out), _ccft_flat(exp)
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, bool) or isinstance(y, bool) or not isinstance(x, (int, float)) or not isinstance(y, (int, float)):
            if x != y:
                return False
        elif _ccft_math.isnan(x) or _ccft_math.isnan(y):
            return False
        elif abs(x - y) > atol + 1e-07 * abs(y):
            return False
    return True

def _ccft_poly(xs, x):
    return sum(coeff * _ccft_math.pow(x, i) for i, coeff in enumerate(xs))

def _ccft_check(fn, entry_point, atol):
    with open("inputs.pkl", "rb") as f:
        inputs, expected = _ccft_pickle.load(f)
    for i, (inp, exp) in enumerate(zip(inputs, expected)):
        out = fn(*_ccft_copy.deepcopy(inp))
        if entry_point == "find_zero":
            assert abs(_ccft_poly(*inp, out)) <= atol, ("find_zero", i)
            continue
        tol = atol
        if tol == 0 and _ccft_is_floats(exp):
            tol = 1e-6
        if out == exp:
            continue
        assert tol != 0, ("mismatch", i)
        assert type(out) == type(exp), ("type", i)
        if isinstance(exp, (list, tuple)):
            assert len(out) == len(exp), ("length", i)
        assert _ccft_allclose(out, exp, tol), ("allclose", i)
"""  # noqa: E501 (driver program text, kept byte for byte)

_GT_DRIVER = r"""

import pickle as _ccft_pickle, copy as _ccft_copy, time as _ccft_time
with open("inputs.pkl", "rb") as _f:
    _ccft_inputs = _ccft_pickle.load(_f)
_ccft_t0 = _ccft_time.perf_counter()
_ccft_out = [{entry_point}(*_ccft_copy.deepcopy(inp)) for inp in _ccft_inputs]
_ccft_dt = _ccft_time.perf_counter() - _ccft_t0
with open("expected.pkl", "wb") as _f:
    _ccft_pickle.dump((_ccft_out, _ccft_dt), _f)
"""


@dataclass
class HumanEvalPlusTask(HumanEvalTask):
    name: str = "humaneval-plus"
    license: str = "Apache-2.0 (evalplus/humanevalplus_release); prompts from HumanEval (MIT)"
    data: str = "ccft/evals/data/humanevalplus/HumanEvalPlus.jsonl.gz (164 problems, EvalPlus v0.1.10)"
    file: str = "humanevalplus/HumanEvalPlus.jsonl.gz"
    timeout_s: float = 20.0
    _expected: dict = field(default_factory=dict, repr=False, compare=False)

    def _load_all(self) -> list[Item]:
        return [
            Item(
                id=r["task_id"],
                prompt=r["prompt"],
                reference=r["canonical_solution"],
                metadata={
                    "entry_point": r["entry_point"],
                    "test": r["test"],
                    "atol": r["atol"] or 0,
                    "inputs": r["base_input"] + r["plus_input"],
                    "n_base": len(r["base_input"]),
                },
            )
            for r in self._rows()
        ]

    # -- expected outputs (ground truth), computed once in the sandbox and cached on disk
    def _cache_path(self) -> Path:
        from ccft.core.models import ccft_home

        digest = hashlib.sha256((data_dir() / self.file).read_bytes()).hexdigest()[:16]
        tag = f"py{sys.version_info.major}{sys.version_info.minor}"
        return ccft_home() / "evals" / f"humanevalplus-expected-{digest}-{tag}.pkl"

    def expected(self, items: list[Item]) -> dict[str, tuple[list, float]]:
        """task_id -> (expected outputs, canonical run time in s) for ``items``."""
        missing = [it for it in items if it.id not in self._expected]
        if missing:
            path = self._cache_path()
            if path.is_file():
                self._expected.update(pickle.loads(path.read_bytes()))
                missing = [it for it in items if it.id not in self._expected]
        if missing:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=self.workers or None) as ex:
                for it, res in zip(missing, ex.map(self._ground_truth, missing), strict=True):
                    self._expected[it.id] = res
            path = self._cache_path()
            old = pickle.loads(path.read_bytes()) if path.is_file() else {}
            old.update(self._expected)
            blob = pickle.dumps(old)
            atomic_write_file(path, lambda tmp: Path(tmp).write_bytes(blob))
        return {it.id: self._expected[it.id] for it in items}

    def _ground_truth(self, item: Item) -> tuple[list, float]:
        src = item.prompt + item.reference + _GT_DRIVER.replace("{entry_point}", item.metadata["entry_point"])
        with Sandbox() as sb:
            sb.write("main.py", src)
            sb.write("inputs.pkl", pickle.dumps(item.metadata["inputs"]))
            res = sb.run([sys.executable, "main.py"], limits=Limits(timeout_s=120, memory_mb=4096))
            if not res.ok:
                raise EnvironmentCheckError(
                    f"{item.id}: the canonical solution failed on the EvalPlus inputs "
                    f"({res.status}): {res.tail(400)}"
                )
            out, dt = pickle.loads((sb.path / "expected.pkl").read_bytes())
        return out, dt

    def item_timeout(self, item: Item) -> float:
        _, dt = self.expected([item])[item.id]
        return max(self.timeout_s, 4.0 * dt + 1.0)

    def build_program(self, item: Item, completion: str) -> tuple[str, dict]:
        nonce = secrets.token_hex(8)
        out, _ = self.expected([item])[item.id]
        src = (
            self.completion_code(item, completion)
            + "\n"
            + _PLUS_DRIVER
            + f"\n_ccft_check({item.metadata['entry_point']}, {item.metadata['entry_point']!r}, "
            f"{float(item.metadata['atol'])!r})\nprint({_PASS_MARK + nonce!r})\n"
        )
        blob = pickle.dumps((item.metadata["inputs"], out))
        return src, {"nonce": nonce, "extra_files": {"inputs.pkl": blob}}


def tasks() -> list:
    return [HumanEvalTask(), HumanEvalPlusTask()]
