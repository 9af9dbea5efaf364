"""Which prompt ids an evaluation feeds the models: the one rule shared by ``ccft demo`` and ``ccft eval``.

A decoder learns to continue prompts rendered one way: the recipe's ``chat_template`` and
``system_prompt`` (``ccft.train.data.tokenize_row`` -> ``ccft.core.tokens.tokenize_prompt``;
docs/design.md, "Token boundary"). Measuring it on prompts rendered another way measures something
else without saying so. The rule:

* **decoder format** (the default of ``ccft demo`` and ``ccft eval``): when the decoders record the
  recipe they were trained with (``ccft.json`` ``recipe``), a chat-style task's prompt text
  (``task.prompt_text(item)``) is rendered with that recipe's ``chat_template`` and ``system_prompt``
  through ``tokenize_prompt``, exactly as a training row with that prompt: the ids a decoder saw in
  training are the ids it is evaluated on. Every mode (base included) gets these same ids.
* **task format** (``ccft eval --prompt-format task``, decoders that record no recipe, and every
  completion-style task): the task's own ``prompt_ids``. A completion task (``prompt_style ==
  "completion"``, e.g. HumanEval) is continued as raw text whatever the recipe says: its scoring
  expects a continuation of the code, not a chat answer.

Decoders trained with different formats cannot share one set of prompt ids; resolving the format
for them is a ``ConfigError``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ccft.core.errors import ConfigError

__all__ = ["PROMPT_FORMAT_CHOICES", "PromptFormat", "prompt_ids", "resolve_prompt_format"]

#: ``ccft eval --prompt-format`` (this module is imported when the CLI parser is built: keep it light).
PROMPT_FORMAT_CHOICES = ("decoder", "task")


@dataclass(frozen=True)
class PromptFormat:
    """A recipe's prompt rendering: ``chat_template`` (``"auto"``, True or False) and ``system_prompt``."""

    chat_template: bool | str = "auto"
    system_prompt: str | None = None

    @classmethod
    def from_recipe(cls, recipe: Mapping) -> PromptFormat:
        """The format of a recipe dict (``ccft.json`` ``recipe``; missing keys take ``TrainConfig``'s
        defaults)."""
        from ccft.train.config import TrainConfig, chat_template_flag

        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
        flag = chat_template_flag(recipe.get("chat_template", defaults["chat_template"]))  # the one parser
        return cls(flag, recipe.get("system_prompt", defaults["system_prompt"]))

    def applies_to(self, task) -> bool:
        """True for chat-style tasks (``prompt_style == "chat"`` with a ``prompt_text``); completion tasks
        keep theirs."""
        return getattr(task, "prompt_style", None) == "chat" and hasattr(task, "prompt_text")

    def describe(self) -> str:
        """One line for result files and reports."""
        template = {
            "auto": "the tokenizer's chat template when it has one",
            True: "the tokenizer's chat template",
            False: "no chat template (plain text)",
        }[self.chat_template]
        system = f"system prompt {self.system_prompt!r}" if self.system_prompt else "no system prompt"
        return f"the decoders' training format: {template}, {system}"


def prompt_ids(task, tokenizer, item, prompt_format: PromptFormat | None = None) -> list[int]:
    """The prompt ids of ``item`` under ``prompt_format`` (None: the task's own ``prompt_ids``).

    With a format that applies to the task, the ids are ``tokenize_prompt(tokenizer, task.prompt_text(item),
    chat_template=..., system_prompt=..., tools=item.metadata["tools"])``: a training row's prompt ids.
    """
    if prompt_format is None or not prompt_format.applies_to(task):
        return list(task.prompt_ids(tokenizer, item))
    from ccft.core.tokens import tokenize_prompt

    tools = (getattr(item, "metadata", None) or {}).get("tools")
    return tokenize_prompt(
        tokenizer,
        task.prompt_text(item),
        chat_template=prompt_format.chat_template,
        system_prompt=prompt_format.system_prompt,
        tools=tools,
    )


def resolve_prompt_format(choice: str, decoders: Iterable) -> PromptFormat | None:
    """The prompt format of a run: ``"decoder"`` -> the decoders' recorded recipe format (None when no decoder
    records one), ``"task"`` -> None (each task's own).

    Args:
        choice: ``"decoder"`` or ``"task"``.
        decoders: ``ccft.Decoder`` objects (their ``meta["recipe"]`` is read).
    Raises:
        ConfigError: an unknown choice, or decoders trained with different prompt formats.
    """
    if choice not in PROMPT_FORMAT_CHOICES:
        raise ConfigError(f"prompt format {choice!r}; use one of {', '.join(PROMPT_FORMAT_CHOICES)}")
    if choice == "task":
        return None
    formats = {
        PromptFormat.from_recipe(d.meta["recipe"])
        for d in decoders
        if d is not None and isinstance(d.meta.get("recipe"), Mapping) and d.meta["recipe"]
    }
    if len(formats) > 1:
        raise ConfigError(
            f"the decoders were trained on prompts rendered differently ({sorted(map(str, formats))}); "
            "evaluate them in separate runs, or pass --prompt-format task"
        )
    return formats.pop() if formats else None
