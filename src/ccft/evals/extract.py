"""GSM8K answer extraction: reference parsing, lm-eval's two filters, and numeric exact match.

GSM8K format (openai/grade-school-math): every reference answer is a chain of thought whose last
line is ``#### N`` with N an integer, sometimes with thousands separators (``#### 1,450,000``).

lm-eval's ``gsm8k`` task scores a generation with two filters (``lm_eval/tasks/gsm8k/gsm8k.yaml``):

* ``strict-match``: regex ``#### (\\-?[0-9\\.\\,]+)``, first match;
* ``flexible-extract``: regex ``(-?[$0-9.,]{2,})|(-?[0-9]+)`` with ``group_select: -1`` (last match);

then ``exact_match`` on strings after deleting ``,``, ``$``, ``(?s).*#### `` and ``\\.$``. Here both
filters return a *normalised number* (``normalize_number``) and ``exact_match`` compares numbers, so
``5`` == ``5.0`` == ``5.00`` and ``$1,325`` == ``1325``. Deliberate differences from lm-eval, each
a docs/design.md K7 fault:

* strict-match also accepts a ``$`` right after ``#### `` (``#### $1,325``), which lm-eval's regex
  rejects;
* flexible-extract only ever returns a number: lm-eval's regex also matches runs that are not
  numbers (``...``, ``,,``, ``$.``) and a list written without spaces (``5,6,7``) is one run; here the
  last *well-formed* number wins (``...`` is skipped, ``5,6,7`` gives ``7``, ``8,000`` gives ``8000``);
* both read a Unicode minus (U+2212) as ``-``.

On realistic text (every GSM8K test question and reference chain of thought) flexible-extract
returns the same number as lm-eval's regex followed by its ``exact_match`` clean-up.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

from ccft.core.errors import DataError

__all__ = [
    "EXTRACTORS",
    "FLEX_NUMBER",
    "exact_match",
    "extract_flexible",
    "extract_reference",
    "extract_strict",
    "normalize_number",
]

# The digits of a number: 1-3 digits then comma-separated groups of exactly 3 (``1,450,000``), or a
# plain digit run (``1450000``); an optional fraction; or a bare fraction (``.5``).
_BODY = r"(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]*)?|\.[0-9]+"
_NUMBER = re.compile(rf"(?P<s1>[+-]?)\$?(?P<s2>[+-]?)(?P<body>{_BODY})")

# lm-eval strict-match: ``#### (\-?[0-9\.\,]+)``; a ``$`` after the marker and a Unicode minus
# (U+2212) are tolerated here.
_STRICT = re.compile("#### \\$?([-\u2212]?[0-9.,]+)")

# Flexible candidates (public: GSM-Plus extends it with fractions): like lm-eval's
# ``(-?[$0-9.,]{2,})|(-?[0-9]+)`` (optional minus, optional $, digits, separators, decimals; the minus may be
# U+2212) but each match is one well-formed number. The ``(?![0-9])`` stops ``1,0000`` from being read as
# ``1,000`` followed by ``0``.
FLEX_NUMBER = re.compile(
    "[-\u2212]?\\$?(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\\.[0-9]+)?|[-\u2212]?\\$?\\.[0-9]+"
)

_UNICODE_MINUS = "\u2212"


def normalize_number(s: str) -> str | None:
    """Return the canonical string of the number written in ``s``, or None if ``s`` is not a number.

    Accepts what GSM8K references and model generations write: a leading ``+``/``-`` (also the
    Unicode minus), a ``$`` before or after the sign, ``,`` thousands separators in groups of three,
    a decimal part, and a trailing ``%``, ``.`` or ``,`` (sentence punctuation), plus surrounding
    whitespace. The result has no separators, no ``$``, no ``+``, no trailing zeros in the fraction,
    no ``.0`` on integers and no ``-0``::

        "8,000" -> "8000"   "$1,325" -> "1325"   "-5" -> "-5"   "12.50" -> "12.5"
        "3.0" -> "3"        "25%" -> "25"        "42." -> "42"  "+7" -> "7"   ".5" -> "0.5"

    Commas in any other place (``12,50``, ``5,6,7``) make it not a number (None): a comma is only
    read as a thousands separator, never as a decimal point. Source: GSM8K answer format and the
    ``regexes_to_ignore`` of lm-eval's gsm8k ``exact_match`` (``,``, ``$``, final ``.``).

    Raises TypeError if ``s`` is not a str.
    """
    if not isinstance(s, str):
        raise TypeError(f"normalize_number expects a str, got {type(s).__name__}: {s!r}")
    t = s.strip().replace(_UNICODE_MINUS, "-").rstrip(" \t\r\n.,%")
    m = _NUMBER.fullmatch(t)
    if m is None or (m["s1"] and m["s2"]):
        return None
    try:
        value = Decimal(m["body"].replace(",", ""))
    except InvalidOperation:  # pragma: no cover - _BODY only admits valid decimals
        return None
    if "-" in (m["s1"], m["s2"]):
        value = -value
    if value == 0:
        return "0"
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_reference(answer: str) -> str:
    """Return the normalised number after ``####`` in a GSM8K reference answer.

    Source: GSM8K format, where the reference ends with a line ``#### N`` (the text after the last
    ``####`` is the whole answer). ``"...\\n#### 1,450,000"`` -> ``"1450000"``.

    Raises DataError (a ValueError) if there is no ``####`` marker or the text after it is not a
    number; TypeError if ``answer`` is not a str.
    """
    if not isinstance(answer, str):
        raise TypeError(f"extract_reference expects a str, got {type(answer).__name__}")
    if "####" not in answer:
        raise DataError(
            f"GSM8K reference answer has no '####' marker (expected a last line '#### N'): "
            f"...{answer[-120:]!r}"
        )
    tail = answer.rsplit("####", 1)[1].strip()
    number = normalize_number(tail)
    if number is None:
        raise DataError(f"GSM8K reference answer: the text after '####' is not a number: {tail!r}")
    return number


def extract_strict(text: str) -> str | None:
    """Return the normalised number of the first ``#### N`` in a generation, or None.

    Source: lm-eval gsm8k ``strict-match`` filter, regex ``#### (\\-?[0-9\\.\\,]+)`` then
    ``take_first``: the marker must be ``####`` followed by exactly one space and the number (a ``$``
    in between is tolerated here, lm-eval rejects it). The first such match wins, so a model that
    goes on to write a second problem's ``#### 5`` is scored on its first answer; a ``####`` not
    followed by a number is skipped, as in lm-eval's ``findall``. The captured run is normalised
    (``#### 1,325.`` -> ``"1325"``); if it is not a well-formed number (``#### 5,6``, ``#### ...``)
    the result is None, as no number was written.

    Returns None when there is no match; never raises for str input (TypeError otherwise).
    """
    if not isinstance(text, str):
        raise TypeError(f"extract_strict expects a str, got {type(text).__name__}")
    m = _STRICT.search(text)
    if m is None:
        return None
    return normalize_number(m.group(1))


def extract_flexible(text: str) -> str | None:
    """Return the normalised last number in a generation, or None if it contains no number.

    Source: lm-eval gsm8k ``flexible-extract`` filter, regex ``(-?[$0-9.,]{2,})|(-?[0-9]+)`` with
    ``group_select: -1``. Each candidate here is a well-formed number (optional ``-`` and ``$``,
    digits with ``,`` thousands groups, optional decimals), so ``8,000`` is ``8000`` (not ``000``),
    ``$1,325.50`` is ``1325.5``, ``42.`` at a sentence end is ``42``, ``1,000,000`` is ``1000000``
    and ``-3`` keeps its sign. As in lm-eval, a ``-`` right before digits is a sign even after
    another number (``10-3`` ends with ``-3``), units and ``%`` are ignored (``5kg`` -> ``5``), and
    text after the answer counts (the last number wins; cut generations at the stop strings first).

    Returns None when there is no number; TypeError if ``text`` is not a str.
    """
    if not isinstance(text, str):
        raise TypeError(f"extract_flexible expects a str, got {type(text).__name__}")
    for candidate in reversed(FLEX_NUMBER.findall(text)):
        number = normalize_number(candidate)
        if number is not None:
            return number
    return None


#: lm-eval filter name -> extractor; the names match lm-eval's ``exact_match,<filter>`` metric keys.
EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "strict-match": extract_strict,
    "flexible-extract": extract_flexible,
}


def exact_match(pred: str | None, ref: str) -> bool:
    """Return True if ``pred`` and ``ref`` are the same number (``5`` == ``5.0`` == ``$5``).

    Source: lm-eval gsm8k ``exact_match`` (string equality after removing ``,``, ``$`` and a final
    ``.``), made numeric: both sides go through ``normalize_number`` and are compared as Decimals.
    ``pred`` None (nothing extracted) or not a number is a miss (False).

    Raises ValueError if ``ref`` is not a number (a broken reference must not score as a miss).
    """
    r = normalize_number(ref)
    if r is None:
        raise ValueError(f"exact_match: reference {ref!r} is not a number")
    if pred is None:
        return False
    p = normalize_number(pred)
    if p is None:
        return False
    return Decimal(p) == Decimal(r)
