"""Rows -> token ids, labels and batches for CCFT and Full-FT (docs/design.md, "Token boundary"; fault class
K6).

Accepted rows (any mix, after an optional ``columns`` rename mapping):
  * ``{"prompt": str, "response": str}``
  * TRL style ``{"prompt": str, "completion": str}``
  * chat ``{"messages": [{"role", "content"}, ...]}`` (optional ``"tools"``): the conversation up to
    the final assistant turn is the prompt; only that final assistant turn is supervised.
Sources: a Python list of dicts, a ``.jsonl`` / ``.json`` file, or a ``datasets.Dataset``.

Token-boundary rules: the prompt and the response are tokenised separately, so
``ids = prompt_ids + response_ids + [EOS]`` exactly, and the prompt ids behind ``C_base`` are the
ones inference tokenises (``tokenize_prompt``). With a chat template the prompt is the rendered
template (generation prompt included) tokenised without extra special tokens, so there is one BOS.
Supervised tokens are the response and the final EOS. Rows longer than ``max_length`` are dropped
and counted, never truncated into a response without EOS. Padding is by length, never by pad id,
so ``pad == eos`` tokenizers still learn to stop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterable, Mapping, Sequence

import torch

from ccft.core.errors import DataError
from ccft.core.tokens import (  # noqa: F401 - re-exported: the data API in one import
    IGNORE_INDEX,
    TOOLS_SYSTEM_TEXT,
    as_ids,
    left_pad,
    right_pad,
    tokenize_prompt,
    tokenize_response,
    use_chat_template,
)


@dataclass(frozen=True)
class Example:
    """One tokenised row. ``response_ids`` ends with the EOS id; ``prompt_ids`` has ≥ handoff+1 ids."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    index: int = -1  # position of the row in the source

    @property
    def input_ids(self) -> tuple[int, ...]:
        return self.prompt_ids + self.response_ids


@dataclass
class TokenizedDataset(torch.utils.data.Dataset):
    """Examples plus the counts of what was dropped (``dropped_too_long``) and why."""

    examples: list[Example]
    dropped_too_long: int = 0
    max_length: int = 512
    stats: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> Example:
        return self.examples[i]

    @property
    def supervised_tokens(self) -> int:
        return sum(len(e.response_ids) for e in self.examples)


# ---------------------------------------------------------------- loading rows


def read_data_file(path: str | Path) -> tuple[list[dict], list[int]]:
    """Rows of a ``.jsonl`` (one JSON object a line) or ``.json`` (a list of objects) file, and each row's
    line.

    Returns:
        (rows, lines): ``lines[i]`` is the 1-based line of row i (the line the object starts on for
        ``.json``).
    Raises:
        DataError: naming ``FILE:LINE`` for a missing file, a directory, bytes that are not UTF-8, a line that
            is not JSON, or a row that is not a JSON object.
    """
    path = Path(path)
    if path.is_dir():
        raise DataError(f"data file {path} is a directory; give a .jsonl/.json file")
    if not path.is_file():
        raise DataError(f"data file {path} does not exist; give a .jsonl/.json path or a list of rows")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataError(
            f"{path}:{line}: not UTF-8 text (byte {e.start}: {e.reason}); save the file as UTF-8"
        ) from None
    if path.suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from None
        if not isinstance(rows, list):
            raise DataError(
                f"{path}:1: a .json data file holds a list of row objects, got {type(rows).__name__}"
            )
        starts = _json_row_lines(text, len(rows))
    else:
        rows, starts = [], []
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}:{n}:{e.colno}: not valid JSON: {e.msg} (a .jsonl file holds one JSON "
                    "object a line)"
                ) from None
            starts.append(n)
    for row, n in zip(rows, starts, strict=True):
        if not isinstance(row, dict):
            raise DataError(f"{path}:{n}: a row must be a JSON object, got {type(row).__name__}")
    return rows, starts


def _json_row_lines(text: str, n: int) -> list[int]:
    # The line each top-level element of a JSON list starts on (raw_decode walks the list element by element).
    dec = json.JSONDecoder()
    lines, pos = [], text.index("[") + 1
    for _ in range(n):
        while text[pos] in " \t\r\n,":
            pos += 1
        lines.append(text.count("\n", 0, pos) + 1)
        _, pos = dec.raw_decode(text, pos)
    return lines


def load_rows(
    source: Any, columns: dict[str, str] | None = None, limit: int | None = None, offset: int = 0
) -> list[dict]:
    """Rows from a list of dicts, a ``.jsonl``/``.json`` path, or a ``datasets.Dataset``.

    Args:
        columns: rename mapping ``{"prompt": "question", "response": "answer"}`` (ccft name -> source column).
        limit: keep the first ``limit`` rows (after skipping ``offset`` rows).
    Raises:
        DataError: unreadable file (``FILE:LINE``, see ``read_data_file``), unknown source type, a row that is
            not a mapping, or a mapped column that is missing.
    """
    where = row_locations(source)
    if isinstance(source, (str, Path)):
        rows, _ = read_data_file(source)
    elif isinstance(source, list):
        rows = source
    elif hasattr(source, "to_list") and hasattr(source, "column_names"):  # datasets.Dataset
        rows = source.to_list()
    else:
        raise DataError(
            f"unsupported data source of type {type(source).__name__}; "
            "pass a list of dicts, a .jsonl/.json path or a datasets.Dataset"
        )
    rows = rows[offset : offset + limit if limit is not None else None]
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise DataError(f"{where(offset + i)}: a row must be a mapping, got {type(row).__name__}")
    if columns:
        out = []
        for i, row in enumerate(rows):
            new = dict(row)
            for ours, theirs in columns.items():
                if theirs not in row:
                    raise DataError(
                        f"{where(offset + i)}: column {theirs!r} (mapped to {ours!r}) is missing; "
                        f"row has {sorted(row)}; fix the `columns` mapping"
                    )
                new[ours] = row[theirs]
            out.append(new)
        rows = out
    return rows


def row_locations(source: Any):
    """``where(i)``: ``FILE:LINE`` of row i for a data file (line numbers read once, on first use), else
    ``row i``."""
    if not isinstance(source, (str, Path)):
        return lambda i: f"row {i}"
    lines: list[int] = []

    def where(i: int) -> str:
        if not lines:
            try:
                lines.extend(read_data_file(source)[1])
            except DataError:
                pass
        return f"{source}:{lines[i]}" if i < len(lines) else f"{source}: row {i}"

    return where


def split_row(row: dict, index: int = -1) -> tuple[str | list[dict], str, list | None]:
    """(prompt or prompt messages, response text, tools) of a row in any accepted format; DataError
    otherwise."""
    where = f"row {index}" if index >= 0 else "row"
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: `messages` must be a non-empty list of {{role, content}}")
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise DataError(f"{where}: messages[{j}] must be a mapping with a string `role`")
            content = m.get("content")
            if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
                raise DataError(
                    f"{where}: messages[{j}] ({m.get('role')}) needs a string `content`, "
                    f"got {type(content).__name__}"
                )
        last = msgs[-1]
        if last.get("role") != "assistant":
            raise DataError(
                f"{where}: the chat has no final assistant turn to supervise "
                f"(last role is {last.get('role')!r}); end each conversation with an assistant message"
            )
        if len(msgs) < 2:
            raise DataError(f"{where}: the chat has an assistant turn but no prompt before it")
        response = last.get("content")
        prompt: str | list[dict] = msgs[:-1]
        tools = row.get("tools")
        if isinstance(tools, str):
            tools = json.loads(tools)
    else:
        if "prompt" not in row:
            raise DataError(
                f"{where}: no `prompt` (or `messages`) field; row has {sorted(row)}; "
                "map your columns with columns={'prompt': ..., 'response': ...}"
            )
        prompt = row["prompt"]
        if not isinstance(prompt, (str, list)):
            raise DataError(
                f"{where}: `prompt` must be a string (or a list of chat messages), "
                f"got {type(prompt).__name__}"
            )
        response = row.get("response", row.get("completion"))
        tools = None
        if response is None:
            raise DataError(f"{where}: no `response` (or `completion`) field; row has {sorted(row)}")
    if not isinstance(response, str) or not response.strip():
        raise DataError(f"{where}: the response is empty; every row needs at least one supervised token")
    if isinstance(prompt, str) and not prompt.strip():
        raise DataError(f"{where}: the prompt is empty")
    return prompt, response, tools


def tokenize_row(
    tokenizer,
    row: dict,
    *,
    index: int = -1,
    chat_template: bool | str = "auto",
    system_prompt: str | None = None,
) -> Example:
    """One row -> Example (prompt ids; response ids + EOS). Raises DataError on a malformed row."""
    prompt, response, tools = split_row(row, index)
    p = tokenize_prompt(
        tokenizer, prompt, chat_template=chat_template, system_prompt=system_prompt, tools=tools
    )
    r = tokenize_response(tokenizer, response)
    return Example(tuple(p), tuple(r), index)


def build_dataset(
    rows: Iterable[dict] | Any,
    tokenizer,
    *,
    max_length: int = 512,
    handoff_tokens: int = 1,
    chat_template: bool | str = "auto",
    system_prompt: str | None = None,
    columns: dict[str, str] | None = None,
    limit: int | None = None,
    offset: int = 0,
) -> TokenizedDataset:
    """Tokenise rows for training or evaluation.

    Rows with ``len(prompt)+len(response)+1 > max_length`` are dropped and counted in
    ``dropped_too_long``. Raises DataError for a malformed row (naming its index), a prompt shorter
    than ``handoff_tokens + 1`` tokens, or when nothing is left.
    """
    if handoff_tokens < 1:
        raise DataError(
            f"handoff_tokens={handoff_tokens}; it must be ≥ 1 (the decoder recomputes ≥ 1 prompt token)"
        )
    source = rows
    where = row_locations(source)
    rows = load_rows(source, columns=columns, limit=limit, offset=offset)
    examples, dropped = [], 0
    for i, row in enumerate(rows):
        try:
            ex = tokenize_row(
                tokenizer, row, index=i, chat_template=chat_template, system_prompt=system_prompt
            )
        except DataError as e:
            if isinstance(source, (str, Path)):
                raise DataError(f"{where(offset + i)}: {e}") from None
            raise
        except (
            TypeError,
            ValueError,
            KeyError,
            UnicodeError,
        ) as e:  # content the template/tokenizer cannot take
            raise DataError(
                f"{where(offset + i)}: this row cannot be tokenised ({type(e).__name__}: {e})"
            ) from None
        if len(ex.prompt_ids) < handoff_tokens + 1:
            raise DataError(
                f"{where(offset + i)}: the prompt has {len(ex.prompt_ids)} tokens; with handoff_tokens="
                f"{handoff_tokens} it needs at least {handoff_tokens + 1}"
            )
        if len(ex.input_ids) > max_length:
            dropped += 1
            continue
        examples.append(ex)
    if not examples:
        raise DataError(
            f"no rows left: {dropped} of {len(rows)} rows are longer than max_length={max_length}; "
            "raise max_length"
        )
    return TokenizedDataset(
        examples,
        dropped_too_long=dropped,
        max_length=max_length,
        stats={"rows": len(rows), "kept": len(examples)},
    )


# ---------------------------------------------------------------- batching
@dataclass
class Collator:
    """Batch Examples for both methods, in one layout.

    Output (shape notation: b batch, p longest prefix ``n - k``, t longest tail ``k + len(response)``):
      * ``prefix_ids``, ``prefix_mask`` ``(b, p)``: ``prompt[:n-k]`` left-padded — what the base prefills.
      * ``tail_ids``, ``tail_mask`` ``(b, t)``: ``prompt[n-k:] + response + [EOS]`` right-padded —
        what the decoder processes on ``C_base``.
      * ``labels`` ``(b, t)``: ``tail_ids`` with ``-100`` on the handoff tokens and on padding.
        Standard causal convention: the logit at position j predicts ``labels[:, j+1]``.
      * ``num_supervised`` ``()``: supervised tokens in this batch.
    Full-FT concatenates prefix and tail into one sequence with the same positions.
    Rows are ``Example``s or mappings with the ``features`` fields (e.g. a ``datasets.Dataset`` of
    tokenised rows); ``CacheConditionedTrainer`` keeps exactly these fields when it removes unused columns.
    """

    pad_token_id: int
    handoff_tokens: int = 1
    #: The fields of a row the collator reads.
    features: ClassVar[tuple[str, ...]] = ("prompt_ids", "response_ids")

    def __call__(self, examples: Sequence[Example | Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        k = self.handoff_tokens
        rows = [
            (e["prompt_ids"], e["response_ids"]) if isinstance(e, Mapping) else (e.prompt_ids, e.response_ids)
            for e in examples
        ]
        prefixes = [list(p[:-k]) for p, _ in rows]
        tails = [list(p[-k:]) + list(r) for p, r in rows]
        prefix_ids, prefix_mask = left_pad(prefixes, self.pad_token_id)
        tail_ids, tail_mask = right_pad(tails, self.pad_token_id)
        labels = tail_ids.clone()
        labels[tail_mask == 0] = IGNORE_INDEX
        labels[:, :k] = IGNORE_INDEX
        return {
            "prefix_ids": prefix_ids,
            "prefix_mask": prefix_mask,
            "tail_ids": tail_ids,
            "tail_mask": tail_mask,
            "labels": labels,
            "num_supervised": (labels[:, 1:] != IGNORE_INDEX).sum(),
        }
