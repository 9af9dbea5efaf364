"""Token-level rules shared by training, inference, serving and evaluation (docs/design.md, "Token boundary").

* ``tokenize_prompt``: the prompt ids behind ``C_base``, the same in training and inference (one BOS at most;
  a chat template rendered with its generation prompt). Text is text: in a chat, only the template's own
  markup yields control tokens; message contents are tokenized as plain text (docs/design.md, fault
  class K9: forged control tokens).
* ``tokenize_response``: response ids + EOS (the supervised tokens); the response is plain text too.
* ``control_tokens``: the tokenizer's control tokens (special added tokens) by text.
* ``left_pad`` / ``right_pad``: id lists -> ``(b, s)`` id and mask tensors.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any, Iterator, Sequence

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
TOOLS_SYSTEM_TEXT = (
    "You may call one or more functions to assist with the user query. The functions "
    "are described as JSON schemas within <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with a JSON object of its name and arguments within "
    '<tool_call></tool_call> tags:\n<tool_call>\n{{"name": <function-name>, '
    '"arguments": <args-json-object>}}\n</tool_call>'
)


def _template_renders_tools(tokenizer) -> bool:
    """Does the chat template show a ``tools=`` list in the prompt? (Many, e.g. SmolLM2's, ignore it.)"""
    cached = getattr(tokenizer, "_ccft_renders_tools", None)
    if cached is None:
        tool = {
            "type": "function",
            "function": {
                "name": _TOOL_PROBE,
                "description": "probe",
                "parameters": {"type": "object", "properties": {}},
            },
        }
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}], tools=[tool], tokenize=False, add_generation_prompt=True
            )
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


def control_tokens(tokenizer) -> dict[str, int]:
    """The tokenizer's control tokens, text -> id: every added token flagged ``special`` (``<|im_start|>``,
    ``<|im_end|>``, ...) and the named special tokens (``bos_token``, ``eos_token``, ...).

    These are the tokens a tokenizer makes out of their text unless told ``split_special_tokens=True``
    (docs/design.md, fault class K9). Non-special added tokens are ordinary vocabulary and not listed.
    """
    out: dict[str, int] = {}
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            out[str(getattr(tok, "content", tok))] = int(i)
    for text in getattr(tokenizer, "all_special_tokens", None) or []:
        i = tokenizer.convert_tokens_to_ids(text)
        if isinstance(i, int) and text:
            out.setdefault(text, i)
    return out


def _control_pattern(tokenizer) -> tuple[re.Pattern | None, dict[str, int]]:
    """(regex matching any control-token text leftmost-longest, as the tokenizer's trie does; text -> id)."""
    controls = control_tokens(tokenizer)
    key = tuple(sorted(controls.items()))
    cached = getattr(tokenizer, "_ccft_control_pattern", None)
    if cached is not None and cached[0] == key:
        return cached[1], controls
    pattern = (
        re.compile("|".join(re.escape(t) for t in sorted(controls, key=len, reverse=True)))
        if controls
        else None
    )
    try:
        tokenizer._ccft_control_pattern = (key, pattern)
    except AttributeError:  # pragma: no cover - slotted tokenizer
        pass
    return pattern, controls


def _string_leaves(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """(path, string) for every string in a JSON-like value, dict keys included."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str):
                yield f"{path}.{k}", k
            yield from _string_leaves(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for j, v in enumerate(value):
            yield from _string_leaves(v, f"{path}[{j}]")


def _control_text_error(field: str, found: str, why: str) -> DataError:
    """A ``DataError`` naming the offending ``field`` (also as ``.field``, for the HTTP server's
    ``param``)."""
    err = DataError(f"{field} holds control-token text {found!r}; {why}")
    err.field = field
    return err


def _refuse_control_text_outside_contents(
    messages: list[dict], tools: list | None, pattern: re.Pattern
) -> None:
    """Control-token text is allowed in string message contents only (tokenized there as plain text); in a
    role, another message field or a tool schema the template would render it into real control tokens."""
    leaves = [
        (f"messages[{i}].{k}", v)
        for i, m in enumerate(messages)
        for k, v in m.items()
        if not (k == "content" and isinstance(v, str))
    ]
    for path, value in leaves:
        for where, text in _string_leaves(value, path):
            found = pattern.search(text)
            if found:
                raise _control_text_error(
                    where, found.group(), "only message contents may hold it (as plain text); remove it"
                )
    for where, text in _string_leaves(tools or [], "tools"):
        found = pattern.search(text)
        if found:
            raise _control_text_error(
                where, found.group(), "tool schemas are rendered as they are; remove it"
            )


def _chat_ids_markup_controls_only(
    tokenizer, messages: list[dict], kwargs: dict, text: str, pattern: re.Pattern, controls: dict[str, int]
) -> list[int]:
    """Ids of the rendered chat ``text`` where only the template's markup yields control tokens.

    The template is rendered again with a unique marker in place of each message content; the markers
    locate the contents in ``text`` (contents as they are, or trimmed, as Llama-3-style templates do).
    ``text`` is then cut at the control tokens of the markup; each run of plain text between them
    (markup text and contents) is tokenized with ``split_special_tokens=True``. For a tokenizer that
    splits its input at control tokens before pre-tokenizing (byte-level BPE, e.g. SmolLM2, Llama 3, Qwen)
    this is exactly how it tokenizes the same text when the contents hold no control-token text.

    Raises:
        DataError: the template changes contents in another way, so they cannot be located.
    """
    nonce = secrets.token_hex(6)
    contents: dict[str, str] = {}
    marked = []
    for i, m in enumerate(messages):
        if isinstance(m.get("content"), str):
            marker = f"ccft{nonce}c{i}x"
            contents[marker] = m["content"]
            m = {**m, "content": marker}
        marked.append(m)
    skeleton = tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=True, **kwargs)
    find = re.compile("|".join(re.escape(k) for k in contents))
    for trim in (False, True):
        pieces: list[tuple[str, bool]] = []  # (text, is_content)
        pos = 0
        for mt in find.finditer(skeleton):
            content = contents[mt.group()]
            pieces += [(skeleton[pos : mt.start()], False), (content.strip() if trim else content, True)]
            pos = mt.end()
        pieces.append((skeleton[pos:], False))
        if "".join(p for p, _ in pieces) == text:
            break
    else:
        found = next(pattern.search(c).group() for c in contents.values() if pattern.search(c))
        raise DataError(
            f"a message content holds control-token text {found!r} and this chat template changes "
            "message contents, so ccft cannot keep it plain text; remove it from the message"
        )
    ids: list[int] = []
    plain: list[str] = []

    def flush() -> None:
        run = "".join(plain)
        plain.clear()
        if run:
            ids.extend(as_ids(tokenizer(run, add_special_tokens=False, split_special_tokens=True)))

    for piece, is_content in pieces:
        if is_content:
            plain.append(piece)
            continue
        pos = 0
        for mt in pattern.finditer(piece):
            plain.append(piece[pos : mt.start()])
            flush()
            ids.append(controls[mt.group()])
            pos = mt.end()
        plain.append(piece[pos:])
    flush()
    return ids


def tokenize_prompt(
    tokenizer,
    prompt: str | list[dict],
    *,
    chat_template: bool | str = "auto",
    system_prompt: str | None = None,
    tools: list | None = None,
) -> list[int]:
    """Token ids of a prompt exactly as training and inference see it (docs/design.md, "Token boundary").

    ``prompt`` is a string (one user turn when a chat template is used) or a list of chat messages
    (ending before the assistant turn to generate). Exactly one BOS at most.

    With a chat template, text is text (fault class K9): the rendered template is tokenized so that
    only its own markup yields control tokens (``control_tokens``); message contents (system, user,
    assistant, tool; ``system_prompt``; tools put into the system turn) are plain text, so a content
    holding ``<|im_end|>`` cannot add a turn boundary. Contents without control-token text give exactly
    ``tokenizer(rendered_text, add_special_tokens=False)``, as before.

    Without a chat template (a completion prompt) the text is tokenized as it is, control-token text
    included (``add_special_tokens=True``), as OpenAI-style completion servers do.

    Raises:
        DataError: chat messages without a chat template; control-token text in a role, another message
            field or a tool schema the template renders (``.field`` names it, e.g. ``messages[1].role``);
            control-token text in a content of a template that rewrites contents.
    """
    if use_chat_template(tokenizer, chat_template):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system_prompt and not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": system_prompt}] + messages
        if tools and not _template_renders_tools(tokenizer):
            messages = _tools_in_system_turn(messages, tools)  # never drop the tools silently
            tools = None
        kwargs = {"tools": tools} if tools else {}
        pattern, controls = _control_pattern(tokenizer)
        if pattern is not None:
            _refuse_control_text_outside_contents(messages, tools, pattern)
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        if pattern is not None and any(
            isinstance(m.get("content"), str) and pattern.search(m["content"]) for m in messages
        ):
            ids = _chat_ids_markup_controls_only(tokenizer, messages, kwargs, text, pattern, controls)
        else:  # every control token of the text is the template's: the tokenizer's own split is the rule
            ids = as_ids(tokenizer(text, add_special_tokens=False))
    else:
        if not isinstance(prompt, str):
            raise DataError("chat messages need a chat template; set chat_template=auto or true")
        text = (system_prompt + "\n\n" + prompt) if system_prompt else prompt
        ids = as_ids(tokenizer(text, add_special_tokens=True))
    return strip_duplicate_bos(ids, tokenizer.bos_token_id)


def tokenize_response(tokenizer, response: str) -> list[int]:
    """Response ids followed by the tokenizer's EOS id (the supervised tokens).

    The response is plain text (``split_special_tokens=True``; docs/design.md, fault class K9): a response
    holding the text ``<|im_end|>`` is supervised as those characters, and the only EOS is the final one.
    Text without control-token text gives exactly ``tokenizer(response, add_special_tokens=False)``.

    Raises:
        DataError: the tokenizer has no EOS token.
    """
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos_token; set tokenizer.eos_token before building data")
    return as_ids(tokenizer(response, add_special_tokens=False, split_special_tokens=True)) + [
        tokenizer.eos_token_id
    ]


# ---------------------------------------------------------------- padding


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad id lists -> ``ids (b, s)``, ``mask (b, s)`` (1 = real token)."""
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids, mask


def right_pad(
    seqs: Sequence[Sequence[int]], pad_id: int, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
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
    """Every id that ends a generation: the tokenizer's EOS plus the model's
    ``generation_config.eos_token_id`` (an int or a list; chat models often add their end-of-turn token
    there)."""
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
    while (
        bos_token_id is not None
        and len(ids) - start >= 2
        and ids[start] == bos_token_id
        and ids[start + 1] == bos_token_id
    ):
        start += 1
    return ids[start:]
