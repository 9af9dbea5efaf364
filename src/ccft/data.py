"""Rows -> token ids, labels and batches for CCFT and Full-FT (DESIGN.md §2.5, CASES.md K6).

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
from typing import Any, Iterable, Sequence

import torch

from .errors import DataError

IGNORE_INDEX = -100


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

def load_rows(source: Any, columns: dict[str, str] | None = None, limit: int | None = None) -> list[dict]:
    """Rows from a list of dicts, a ``.jsonl``/``.json`` path, or a ``datasets.Dataset``.

    Args:
        columns: rename mapping ``{"prompt": "question", "response": "answer"}`` (ccft name -> source column).
        limit: keep the first ``limit`` rows.
    Raises:
        DataError: unreadable file, unknown source type, or a mapped column that is missing.
    """
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise DataError(f"data file {path} does not exist; give a .jsonl/.json path or a list of rows")
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json":
            rows = json.loads(text)
        else:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    elif isinstance(source, list):
        rows = source
    elif hasattr(source, "to_list") and hasattr(source, "column_names"):  # datasets.Dataset
        rows = source.to_list()
    else:
        raise DataError(f"unsupported data source of type {type(source).__name__}; "
                        "pass a list of dicts, a .jsonl/.json path or a datasets.Dataset")
    if limit is not None:
        rows = rows[:limit]
    if columns:
        out = []
        for i, row in enumerate(rows):
            new = dict(row)
            for ours, theirs in columns.items():
                if theirs not in row:
                    raise DataError(f"row {i}: column {theirs!r} (mapped to {ours!r}) is missing; "
                                    f"row has {sorted(row)}; fix the `columns` mapping")
                new[ours] = row[theirs]
            out.append(new)
        rows = out
    return rows


# ---------------------------------------------------------------- tokenising

def _use_template(tokenizer, chat_template: bool | str) -> bool:
    has = bool(getattr(tokenizer, "chat_template", None))
    if chat_template == "auto":
        return has
    if chat_template and not has:
        raise DataError("chat_template=True but the tokenizer has no chat template; set chat_template=false")
    return bool(chat_template)


def _as_ids(out) -> list[int]:
    if hasattr(out, "keys") and "input_ids" in out:  # transformers 5 returns a mapping
        out = out["input_ids"]
    return list(out)


_TOOL_PROBE = "ccft_probe_function_4f2a"

#: System text for templates without tool support (Hermes convention; see ccft.evals.tool_calls).
TOOLS_SYSTEM_TEXT = ("You may call one or more functions to assist with the user query. The functions "
                     "are described as JSON schemas within <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
                     "To call a function, reply with a JSON object of its name and arguments within "
                     "<tool_call></tool_call> tags:\n<tool_call>\n{{\"name\": <function-name>, "
                     "\"arguments\": <args-json-object>}}\n</tool_call>")


def _template_renders_tools(tokenizer) -> bool:
    """Does the chat template show a ``tools=`` list in the prompt? (Many, e.g. SmolLM2's, ignore it.)"""
    cached = getattr(tokenizer, "_ccft_renders_tools", None)
    if cached is None:
        tool = {"type": "function", "function": {"name": _TOOL_PROBE, "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[tool],
                                                 tokenize=False, add_generation_prompt=True)
            cached = _TOOL_PROBE in text
        except Exception:  # noqa: BLE001 - a template that fails on tools does not support them
            cached = False
        try:
            tokenizer._ccft_renders_tools = cached
        except AttributeError:  # pragma: no cover - slotted tokenizer
            pass
    return cached


def _tools_in_system_turn(messages: list[dict], tools: list) -> list[dict]:
    """Put the tool schemas into the system turn (appended to an existing one)."""
    text = TOOLS_SYSTEM_TEXT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}] + list(messages[1:])
    return [{"role": "system", "content": text}] + list(messages)


def tokenize_prompt(tokenizer, prompt: str | list[dict], *, chat_template: bool | str = "auto",
                    system_prompt: str | None = None, tools: list | None = None) -> list[int]:
    """Token ids of a prompt exactly as training and inference see it.

    ``prompt`` is a string (one user turn when a chat template is used) or a list of chat messages
    (ending before the assistant turn to generate). Exactly one BOS at most.
    """
    if _use_template(tokenizer, chat_template):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system_prompt and not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": system_prompt}] + messages
        if tools and not _template_renders_tools(tokenizer):
            messages = _tools_in_system_turn(messages, tools)  # never drop the tools silently
            tools = None
        kwargs = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        ids = _as_ids(tokenizer(text, add_special_tokens=False))
    else:
        if not isinstance(prompt, str):
            raise DataError("chat messages need a chat template; set chat_template=auto or true")
        text = (system_prompt + "\n\n" + prompt) if system_prompt else prompt
        ids = _as_ids(tokenizer(text, add_special_tokens=True))
    bos = tokenizer.bos_token_id
    while bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]  # a template that writes BOS plus a tokenizer that adds one: keep one
    return ids


def tokenize_response(tokenizer, response: str) -> list[int]:
    """Response ids followed by the tokenizer's EOS id (the supervised tokens)."""
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos_token; set tokenizer.eos_token before building data")
    return _as_ids(tokenizer(response, add_special_tokens=False)) + [tokenizer.eos_token_id]


def split_row(row: dict, index: int = -1) -> tuple[str | list[dict], str, list | None]:
    """(prompt or prompt messages, response text, tools) of a row in any accepted format; DataError otherwise."""
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
                raise DataError(f"{where}: messages[{j}] ({m.get('role')}) needs a string `content`, "
                                f"got {type(content).__name__}")
        last = msgs[-1]
        if last.get("role") != "assistant":
            raise DataError(f"{where}: the chat has no final assistant turn to supervise "
                            f"(last role is {last.get('role')!r}); end each conversation with an assistant message")
        if len(msgs) < 2:
            raise DataError(f"{where}: the chat has an assistant turn but no prompt before it")
        response = last.get("content")
        prompt: str | list[dict] = msgs[:-1]
        tools = row.get("tools")
        if isinstance(tools, str):
            tools = json.loads(tools)
    else:
        if "prompt" not in row:
            raise DataError(f"{where}: no `prompt` (or `messages`) field; row has {sorted(row)}; "
                            "map your columns with columns={'prompt': ..., 'response': ...}")
        prompt = row["prompt"]
        response = row.get("response", row.get("completion"))
        tools = None
        if response is None:
            raise DataError(f"{where}: no `response` (or `completion`) field; row has {sorted(row)}")
    if not isinstance(response, str) or not response.strip():
        raise DataError(f"{where}: the response is empty; every row needs at least one supervised token")
    if isinstance(prompt, str) and not prompt.strip():
        raise DataError(f"{where}: the prompt is empty")
    return prompt, response, tools


def tokenize_row(tokenizer, row: dict, *, index: int = -1, chat_template: bool | str = "auto",
                 system_prompt: str | None = None) -> Example:
    """One row -> Example (prompt ids; response ids + EOS). Raises DataError on a malformed row."""
    prompt, response, tools = split_row(row, index)
    p = tokenize_prompt(tokenizer, prompt, chat_template=chat_template, system_prompt=system_prompt, tools=tools)
    r = tokenize_response(tokenizer, response)
    return Example(tuple(p), tuple(r), index)


def build_dataset(rows: Iterable[dict] | Any, tokenizer, *, max_length: int = 512, handoff_tokens: int = 1,
                  chat_template: bool | str = "auto", system_prompt: str | None = None,
                  columns: dict[str, str] | None = None, limit: int | None = None) -> TokenizedDataset:
    """Tokenise rows for training or evaluation.

    Rows with ``len(prompt)+len(response)+1 > max_length`` are dropped and counted in
    ``dropped_too_long``. Raises DataError for a malformed row (naming its index), a prompt shorter
    than ``handoff_tokens + 1`` tokens, or when nothing is left.
    """
    if handoff_tokens < 1:
        raise DataError(f"handoff_tokens={handoff_tokens}; it must be ≥ 1 (the decoder recomputes ≥ 1 prompt token)")
    rows = load_rows(rows, columns=columns, limit=limit)
    examples, dropped = [], 0
    for i, row in enumerate(rows):
        ex = tokenize_row(tokenizer, row, index=i, chat_template=chat_template, system_prompt=system_prompt)
        if len(ex.prompt_ids) < handoff_tokens + 1:
            raise DataError(f"row {i}: the prompt has {len(ex.prompt_ids)} tokens; with handoff_tokens="
                            f"{handoff_tokens} it needs at least {handoff_tokens + 1}")
        if len(ex.input_ids) > max_length:
            dropped += 1
            continue
        examples.append(ex)
    if not examples:
        raise DataError(f"no rows left: {dropped} of {len(rows)} rows are longer than max_length={max_length}; "
                        "raise max_length")
    return TokenizedDataset(examples, dropped_too_long=dropped, max_length=max_length,
                            stats={"rows": len(rows), "kept": len(examples)})


# ---------------------------------------------------------------- batching

def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad id lists -> ``ids (b, s)``, ``mask (b, s)`` (1 = real token)."""
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids, mask


def right_pad(seqs: Sequence[Sequence[int]], pad_id: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad id lists -> ``ids (b, s)``, ``mask (b, s)``."""
    width = width or max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


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
    """

    pad_token_id: int
    handoff_tokens: int = 1

    def __call__(self, examples: Sequence[Example]) -> dict[str, torch.Tensor]:
        k = self.handoff_tokens
        prefixes = [list(e.prompt_ids[:-k]) for e in examples]
        tails = [list(e.prompt_ids[-k:]) + list(e.response_ids) for e in examples]
        prefix_ids, prefix_mask = left_pad(prefixes, self.pad_token_id)
        tail_ids, tail_mask = right_pad(tails, self.pad_token_id)
        labels = tail_ids.clone()
        labels[tail_mask == 0] = IGNORE_INDEX
        labels[:, :k] = IGNORE_INDEX
        return {"prefix_ids": prefix_ids, "prefix_mask": prefix_mask, "tail_ids": tail_ids,
                "tail_mask": tail_mask, "labels": labels,
                "num_supervised": (labels[:, 1:] != IGNORE_INDEX).sum()}
