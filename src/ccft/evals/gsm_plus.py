"""GSM-Plus testmini: GSM8K under 8 perturbation types, scored per type (docs/design.md K7).

Data: ``ccft/evals/data/gsm_plus/gsmplus_testmini.jsonl`` (2,400 rows = 300 GSM8K test questions x 8
perturbations; CC-BY-SA-4.0 per its data card, see ``LICENSE-NOTE.txt``). Prompt: the question as
one user turn of the chat template, like ``gsm8k``. NLL reference text: the row's ``solution``
(chain of thought ending ``#### answer``).

Answer formats in the data (all strings): integers and decimals (``"3.2"``), seven fractions
(``"1/4"``, ``"5/8"``), and ``"None"`` for all 300 *critical thinking* rows, whose question lacks a
needed fact. Extraction reuses the GSM8K extractors (``ccft.evals.extract``: thousands separators,
``$``, signs, trailing punctuation) and adds:

* fractions: ``#### 1/4`` or a final ``1/4`` is the number 1/4 (compared exactly, so ``0.25``
  also matches); a fraction with a zero denominator is not a number;
* ``None`` references — *abstention*: the generation says the question cannot be answered. The
  phrases are GSM-Plus's own (``scripts/utils/extract_ans.py``: "not enough information", "cannot
  determine", ... and the word "none", matched as a whole word here). ``exact_match_flexible``
  counts any abstention as correct (the GSM-Plus rule); ``exact_match_strict`` also requires that
  no ``#### <number>`` is given. Unlike GSM-Plus, a generation without ``####`` is *not* read as
  an abstention.

Metrics per item: ``exact_match_strict``, ``exact_match_flexible`` and the same keys suffixed
``[<perturbation type>]`` and ``[no critical thinking]``, so ``aggregate`` reports the accuracy of
each type and of the 7 numeric types together.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction

from ccft.core.errors import DataError
from ccft.evals.extract import FLEX_NUMBER, normalize_number
from ccft.evals.task_base import Item, Task, data_rows

__all__ = [
    "ABSTAIN",
    "PERTURBATION_TYPES",
    "GSMPlusTask",
    "abstains",
    "extract_plus_flexible",
    "extract_plus_strict",
    "parse_answer",
    "tasks",
]

PERTURBATION_TYPES = (
    "numerical substitution",
    "digit expansion",
    "integer-decimal-fraction conversion",
    "adding operation",
    "reversing operation",
    "problem understanding",
    "distraction insertion",
    "critical thinking",
)


class _Abstain:
    """The answer "None": the question cannot be answered (singleton ``ABSTAIN``)."""

    def __repr__(self) -> str:
        return "ABSTAIN"


ABSTAIN = _Abstain()

# GSM-Plus's abstention phrases (scripts/utils/extract_ans.py, extract_pred_ans_none), lower case.
_ABSTAIN_PHRASES = (
    "does not provide enough information",
    "does not specify",
    "does not provide",
    "can't provide",
    "can not provide",
    "don't know",
    "do not know",
    "doesn't specify",
    "not specify",
    "not mention",
    "doesn't mention",
    "don't have enough information",
    "do not have enough",
    "not provide",
    "doesn't provide",
    "cannot calculate",
    "can't calculate",
    "can't determine",
    "cannot determine",
    "missing necessary information",
)
_NONE_WORD = re.compile(r"\bnone\b")
_FRACTION = "[-\u2212]?\\$?[0-9]+/[0-9]+(?![0-9/])"
_STRICT_PLUS = re.compile(
    "#### \\$?(none\\b|[-\u2212]?[0-9]+/[0-9]+(?![0-9/])|[-\u2212]?[0-9.,]+)", re.IGNORECASE
)
_FLEX_PLUS = re.compile(f"(?P<frac>{_FRACTION})|(?P<num>{FLEX_NUMBER.pattern})")


def _number(text: str) -> Fraction | None:
    """A fraction ``a/b`` or a GSM8K number (``8,000``, ``$1.5``) as an exact Fraction; None otherwise."""
    t = text.strip().replace("\u2212", "-").replace("$", "")
    if "/" in t:
        num, _, den = t.partition("/")
        try:
            n, d = int(num), int(den)
        except ValueError:
            return None
        return None if d == 0 else Fraction(n, d)
    norm = normalize_number(t)
    return None if norm is None else Fraction(Decimal(norm))


def parse_answer(answer: str) -> Fraction | _Abstain:
    """A GSM-Plus ``answer`` field -> exact number or ``ABSTAIN`` (for ``"None"``); DataError otherwise."""
    if answer.strip() == "None":
        return ABSTAIN
    value = _number(answer)
    if value is None:
        raise DataError(f"GSM-Plus answer {answer!r} is neither a number, a fraction nor 'None'")
    return value


def abstains(text: str) -> bool:
    """Does the generation say the question cannot be answered (GSM-Plus phrases, or the word none)?"""
    low = text.lower().replace("\u2019", "'")
    return any(p in low for p in _ABSTAIN_PHRASES) or bool(_NONE_WORD.search(low))


def extract_plus_strict(text: str) -> Fraction | _Abstain | None:
    """First ``#### X``: a number, a fraction, or ``None`` (-> ABSTAIN); None when absent or malformed."""
    m = _STRICT_PLUS.search(text)
    if m is None:
        return None
    if m.group(1).lower() == "none":
        return ABSTAIN
    return _number(m.group(1))


def extract_plus_flexible(text: str) -> Fraction | None:
    """The last well-formed number or fraction in the generation (GSM8K flexible-extract + fractions)."""
    for m in reversed(list(_FLEX_PLUS.finditer(text))):
        value = _number(m.group(0))
        if value is not None:
            return value
    return None


def score_generation(text: str, reference: Fraction | _Abstain) -> dict[str, float]:
    """``exact_match_strict`` / ``exact_match_flexible`` of one (already truncated) generation, and
    ``answer_format``: the strict ``#### N`` form (a number or an explicit "none") is present, right or
    wrong."""
    strict = extract_plus_strict(text)
    form = {"answer_format": float(strict is not None)}
    if reference is ABSTAIN:
        says_none = abstains(text) or strict is ABSTAIN
        committed = isinstance(strict, Fraction)
        return {
            "exact_match_strict": float(says_none and not committed),
            "exact_match_flexible": float(says_none),
        } | form
    flexible = extract_plus_flexible(text)
    return {
        "exact_match_strict": float(isinstance(strict, Fraction) and strict == reference),
        "exact_match_flexible": float(flexible is not None and flexible == reference),
    } | form


@dataclass
class GSMPlusTask(Task):
    name: str = "gsm-plus"
    prompt_style: str = "chat"
    max_new_tokens: int = 256
    default_limit: int | None = 80
    metrics: tuple[str, ...] = ("exact_match_flexible", "exact_match_strict", "answer_format")
    primary_metric: str = "exact_match_flexible"  # the last number: the model is not taught the ``####`` form
    secondary_metric: str | None = "answer_format"
    license: str = "CC-BY-SA-4.0 (qtli/GSM-Plus data card); derived from GSM8K (MIT)"
    data: str = "ccft/evals/data/gsm_plus/gsmplus_testmini.jsonl (2,400 rows)"

    def _load_all(self) -> list[Item]:
        items = []
        for i, r in enumerate(data_rows("gsm_plus/gsmplus_testmini.jsonl")):
            ptype = r["perturbation_type"]
            if ptype not in PERTURBATION_TYPES:
                raise DataError(f"GSM-Plus row {i}: unknown perturbation type {ptype!r}")
            items.append(
                Item(
                    id=f"gsm-plus/{i}",
                    prompt=r["question"],
                    reference=r["solution"],
                    metadata={
                        "answer": r["answer"],
                        "perturbation_type": ptype,
                        "seed_answer": r["seed_answer"],
                    },
                )
            )
        # Interleave types so that a limit covers every type evenly (row i of each type in turn).
        by_type = {
            t: [it for it in items if it.metadata["perturbation_type"] == t] for t in PERTURBATION_TYPES
        }
        width = max(len(v) for v in by_type.values())
        return [by_type[t][j] for j in range(width) for t in PERTURBATION_TYPES if j < len(by_type[t])]

    def score(self, item: Item, generation: str) -> dict[str, float]:
        text = self.postprocess(item, generation)
        base = score_generation(text, parse_answer(item.metadata["answer"]))
        ptype = item.metadata["perturbation_type"]
        out = dict(base)
        for k, v in base.items():
            if k == "answer_format":
                continue
            out[f"{k}[{ptype}]"] = v
            if ptype != "critical thinking":
                out[f"{k}[no critical thinking]"] = v
        return out


def tasks() -> list[Task]:
    return [GSMPlusTask()]
