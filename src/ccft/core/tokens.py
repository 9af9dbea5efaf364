"""Token-level rules shared by training, inference, serving and evaluation (docs/design.md, "Token boundary").

* ``tokenize_prompt``: the prompt ids behind ``C_base``, the same in training and inference (one BOS at most;
  a chat template rendered with its generation prompt).
* ``tokenize_response``: response ids + EOS (the supervised tokens).
* ``left_pad`` / ``right_pad``: id lists -> ``(b, s)`` id and mask tensors.
"""

from __future__ import annotations

import json
from typing import Sequence

import torch

from ccft.core.errors import DataError

IGNORE_INDEX = -100

# ---------------------------------------------------------------- tokenising

def use_chat_template(tokenizer, chat_template: bool | str) -> bool:
    has = bool(getattr(tokenizer, "chat_template", None))
    if chat_template == "auto":
        return has
    if chat_template and not has:
        raise DataError("chat_template=True but the tokenizer has no chat template; set chat_template=false")
    return bool(chat_template)


def as_ids(out) -> list[int]:
    """``input_ids`` of a tokenizer output (a mapping in transformers 5, or a list) as a list of ints."""
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
    if use_chat_template(tokenizer, chat_template):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system_prompt and not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": system_prompt}] + messages
        if tools and not _template_renders_tools(tokenizer):
            messages = _tools_in_system_turn(messages, tools)  # never drop the tools silently
            tools = None
        kwargs = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        ids = as_ids(tokenizer(text, add_special_tokens=False))
    else:
        if not isinstance(prompt, str):
            raise DataError("chat messages need a chat template; set chat_template=auto or true")
        text = (system_prompt + "\n\n" + prompt) if system_prompt else prompt
        ids = as_ids(tokenizer(text, add_special_tokens=True))
    return strip_duplicate_bos(ids, tokenizer.bos_token_id)


def tokenize_response(tokenizer, response: str) -> list[int]:
    """Response ids followed by the tokenizer's EOS id (the supervised tokens)."""
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos_token; set tokenizer.eos_token before building data")
    return as_ids(tokenizer(response, add_special_tokens=False)) + [tokenizer.eos_token_id]



# ---------------------------------------------------------------- padding

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


# ---------------------------------------------------------------- special ids

def pad_token_id(tokenizer) -> int:
    """The id used for padding: the tokenizer's pad id, else its EOS id, else 0.

    Padding is always masked out (attention masks, ``IGNORE_INDEX`` labels), so ``pad == eos`` is safe."""
    for tid in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if tid is not None:
            return int(tid)
    return 0


def eos_token_ids(tokenizer, model=None) -> set[int]:
    """Every id that ends a generation: the tokenizer's EOS plus the model's ``generation_config.eos_token_id``
    (an int or a list; chat models often add their end-of-turn token there)."""
    ids = {getattr(tokenizer, "eos_token_id", None)}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif gen_eos:
        ids.update(gen_eos)
    return {int(i) for i in ids if i is not None}


def strip_duplicate_bos(ids: list[int], bos_token_id: int | None) -> list[int]:
    """Drop leading BOS repeats (a template that writes BOS plus a tokenizer that adds one): keep one."""
    start = 0
    while bos_token_id is not None and len(ids) - start >= 2 and ids[start] == bos_token_id \
            and ids[start + 1] == bos_token_id:
        start += 1
    return ids[start:]
