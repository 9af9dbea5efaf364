"""The tool-call wire format shared by the tools specialist's training rows and the BFCL task.

A function call is written by the assistant as (Hermes / Qwen-2.5 convention)::

    <tool_call>
    {"name": "search_recipes", "arguments": {"ingredients": ["chicken"]}}
    </tool_call>

Training rows are ``{"messages": [...], "tools": [...]}`` (``ccft.train.data`` accepts them); ``tools``
is a list of OpenAI-style ``{"type": "function", "function": {name, description, parameters}}``
entries handed to the tokenizer's chat template (``apply_chat_template(tools=...)``). A template
that does not render tools gets them in a system turn instead (``ccft.core.tokens.tokenize_prompt``), so
the model always sees the functions it may call. Tool results are ``{"role": "tool"}`` turns.

* :func:`glaive_to_rows` converts glaive-function-calling rows in the LLaMA-Factory / ShareGPT
  layout (``conversations`` with ``human`` / ``gpt`` / ``function_call`` / ``observation`` turns and
  a JSON ``tools`` string) into one training row per assistant turn (each row supervises its final
  assistant turn, the earlier turns are context). The bundled 300 rows (Apache-2.0) ship converted
  as the built-in dataset ``glaive-tools:train``; a larger user copy (e.g. the full
  glaive-function-calling-v2 in the same layout) converts with
  ``python -m ccft.evals.tool_calls IN.json OUT.jsonl`` and trains with ``train_data=OUT.jsonl``.
* :func:`parse_tool_calls` reads a generation back into ``[{name: {arg: value}}]``, the form the
  BFCL AST checker takes.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

__all__ = ["format_tool_call", "glaive_to_rows", "openai_tool", "parse_tool_calls"]

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(
    re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.DOTALL
)


def format_tool_call(name: str, arguments: dict | str) -> str:
    """The assistant text of one call: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def openai_tool(function: dict) -> dict:
    """A bare function schema ({name, description, parameters}) -> ``{"type": "function", "function": ...}``.

    BFCL's schema types that JSON Schema lacks are mapped: ``dict`` -> ``object``, ``float`` ->
    ``number``, ``tuple`` -> ``array``, ``any`` -> no type. Already-wrapped tools pass through.
    """
    if function.get("type") == "function" and "function" in function:
        return function
    return {"type": "function", "function": _json_schema(function)}


_TYPE_MAP = {"dict": "object", "float": "number", "tuple": "array"}


def _json_schema(node: Any) -> Any:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "type" and isinstance(v, str):
                if v == "any":
                    continue
                out[k] = _TYPE_MAP.get(v, v)
            else:
                out[k] = _json_schema(v)
        return out
    if isinstance(node, list):
        return [_json_schema(v) for v in node]
    return node


def parse_tool_calls(text: str) -> list[dict[str, dict]]:
    """Every call in a generation as ``[{name: arguments}]`` (BFCL's decoded form); [] if none parse.

    Reads ``<tool_call>`` blocks (an unterminated last block runs to the end of the text); without
    any block, a bare JSON object (or list of objects) with ``name`` and ``arguments`` also counts.
    ``arguments`` given as a JSON string is decoded. Malformed blocks are skipped.
    """
    bodies = _BLOCK.findall(text) if TOOL_CALL_OPEN in text else [text.strip()]
    calls: list[dict[str, dict]] = []
    for body in bodies:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            continue
        for call in obj if isinstance(obj, list) else [obj]:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                continue
            args = call.get("arguments", call.get("parameters", {}))
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    continue
            if isinstance(args, dict):
                calls.append({call["name"]: args})
    return calls


def _tools_of(row: dict) -> list[dict]:
    tools = row.get("tools") or []
    if isinstance(tools, str):
        tools = json.loads(tools) if tools.strip() else []
    return [openai_tool(t) for t in tools]


_ROLE = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "observation": "tool",
    "tool": "tool",
    "system": "system",
}


def glaive_to_rows(rows: list[dict]) -> list[dict]:
    """LLaMA-Factory glaive rows -> ``{"messages", "tools"}`` rows, one per assistant turn.

    ``function_call`` turns become assistant turns written with :func:`format_tool_call`;
    ``observation`` turns become ``tool`` turns. Raises ValueError for an unknown turn type.
    """
    out = []
    for i, row in enumerate(rows):
        tools = _tools_of(row)
        messages: list[dict] = []
        for turn in row["conversations"]:
            kind = turn["from"]
            if kind == "function_call":
                call = json.loads(turn["value"])
                messages.append(
                    {
                        "role": "assistant",
                        "content": format_tool_call(call["name"], call.get("arguments", {})),
                    }
                )
            elif kind in _ROLE:
                messages.append({"role": _ROLE[kind], "content": turn["value"]})
            else:
                raise ValueError(f"glaive row {i}: unknown turn type {kind!r}")
            if messages[-1]["role"] == "assistant" and len(messages) >= 2:
                out.append({"messages": [dict(m) for m in messages], "tools": tools, "source_row": i})
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m ccft.evals.tool_calls IN.json OUT.jsonl``: convert a glaive file for training."""
    import argparse

    from ccft.core.io import atomic_write_text

    parser = argparse.ArgumentParser(
        prog="python -m ccft.evals.tool_calls",
        description="Convert glaive function-calling conversations to ccft training rows.",
    )
    parser.add_argument("src", metavar="IN", help="glaive conversations: a .json list or a .jsonl file")
    parser.add_argument(
        "dst", metavar="OUT", help="training rows to write (.jsonl, {messages, tools} per line)"
    )
    args = parser.parse_args(argv)
    src, dst = args.src, args.dst
    text = open(src, encoding="utf-8").read()
    rows = (
        json.loads(text) if src.endswith(".json") else [json.loads(x) for x in text.splitlines() if x.strip()]
    )
    converted = glaive_to_rows(rows)
    atomic_write_text(dst, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in converted))
    print(f"{len(rows)} conversations -> {len(converted)} training rows in {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
