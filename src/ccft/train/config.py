"""Training configuration and YAML recipes.

``TrainConfig`` extends ``transformers.TrainingArguments`` (TRL style), so every Trainer option
(optimizer, schedule, logging, ``report_to=wandb``, checkpointing, DeepSpeed) is available by name.
A recipe is a flat YAML mapping of ``TrainConfig`` fields, plus an optional ``eval:`` mapping of
``EvalConfig`` fields used by ``ccft demo``/``ccft eval``; ``key=value`` overrides are parsed as YAML
scalars. Each value is then converted by ``transformers.HfArgumentParser`` as it converts ``--key=value``
on a command line (so ``1e-4`` is a float and ``save_strategy: no`` a strategy), lists element by element,
and the dataclasses are built with ``HfArgumentParser.parse_dict``. Unknown keys ("did you mean"), wrong
types and invalid values raise ``ConfigError`` naming the key and the file, before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser, TrainingArguments

from ccft.core.compact import check_cache_format
from ccft.core.errors import ConfigError
from ccft.core.models import DEFAULT_BASE, DTYPES
from ccft.core.modes import MODES

METHODS = ("ccft", "full-ft")
DECODER_KINDS = ("lora", "full")
RESOURCES = Path(__file__).resolve().parents[1] / "resources"

#: Built-in datasets: name -> split files and the column mapping to {prompt, response}.
BUILTIN_DATASETS: dict[str, dict[str, Any]] = {
    "gsm8k": {
        "train": RESOURCES / "gsm8k" / "train.jsonl",
        "test": RESOURCES / "gsm8k" / "test.jsonl",
        "columns": {"prompt": "question", "response": "answer"},
    },
    # Code: MBPP train split (task ids 601-974) in HumanEval's completion format; train with
    # chat_template=false so rows look like HumanEval / MultiPL-E prompts (resources/mbpp/README.md).
    "mbpp": {"train": RESOURCES / "mbpp" / "train.jsonl", "columns": None},
    # Code, five languages: MBXP canonical solutions of the same train ids (resources/mbxp/README.md).
    "mbxp": {"train": RESOURCES / "mbxp" / "train.jsonl", "columns": None},
    # Function calling: the 300 bundled glaive conversations as {messages, tools} rows, one per
    # assistant turn; tool calls written as <tool_call>{...}</tool_call> (ccft.evals.tool_calls).
    "glaive-tools": {"train": RESOURCES / "glaive_tools" / "train.jsonl", "columns": None},
}


def resolve_data(spec: str, columns: dict | None = None) -> tuple[str, dict | None]:
    """``"gsm8k:train"`` -> (bundled file, its column mapping); any other string is a path used as is."""
    name, _, split = str(spec).partition(":")
    if name in BUILTIN_DATASETS:
        ds = BUILTIN_DATASETS[name]
        split = split or "train"
        if split not in ds:
            raise ConfigError(
                f"dataset {spec!r}: unknown split {split!r}; use one of {[k for k in ds if k != 'columns']}"
            )
        return str(ds[split]), columns if columns is not None else ds["columns"]
    if Path(spec).is_dir():
        raise ConfigError(
            f"data {spec!r} is a directory; give a .jsonl/.json file or a built-in dataset "
            f"({', '.join(BUILTIN_DATASETS)}; e.g. gsm8k:train)"
        )
    if not Path(spec).is_file():
        raise ConfigError(
            f"data {spec!r} is neither a built-in dataset ({', '.join(BUILTIN_DATASETS)}"
            "; e.g. gsm8k:train) nor an existing .jsonl/.json file"
        )
    return str(spec), columns


@dataclass
class TrainConfig(TrainingArguments):
    """Configuration of a CCFT or Full-FT run (a ``TrainingArguments`` with ccft's fields).

    Method:
        method: ``ccft`` (decoder trained on C_base, the base's prefix KV) or ``full-ft`` (ordinary SFT).
        base: base model: embedded name (``smollm2-135m-instruct``), local folder or HF id.
        decoder_kind: ``lora`` (adapter on the base's weights) or ``full`` (a second, trainable weight copy).
        handoff_tokens: k ≥ 1, prompt tokens the decoder recomputes on C_base.
        share_from_layer: the sharing depth m (issue 35; ``ccft.core.depth``): the decoder computes its own
            prompt K/V in layers ``0..m−1`` (a partial prefill, with gradient) and reads C_base in
            ``m..L−1``; 0 (default) is PrefillShare, L the decoder's own prefill. ``method=ccft`` only;
            checked against the base's layer count before its weights load.
        cache_format: the format of C_base the decoder trains on (issue 35; ``ccft.core.compact``):
            ``native`` (default: C_base as the base computed it, today's run bit for bit) or ``int8`` (the
            compact C_base, keys per channel and values per token in 8 bits, dequantised before the
            attention), so the decoder learns the cache it will be served. ``method=ccft`` and train_path
            two-pass only; combines with ``share_from_layer`` (only C_base's layers ``m..L−1`` are compact).
    LoRA:
        lora_r, lora_alpha, lora_dropout, lora_target_modules (default: every attention and MLP
        projection; on a base with fused projections, phi3, the same list means ``qkv_proj``, ``o_proj``,
        ``gate_up_proj``, ``down_proj``: ``ccft.core.decoder.default_lora_targets``).
    Data:
        train_data / eval_data: ``gsm8k:train`` style built-ins or .jsonl/.json paths.
        train_rows / eval_rows: keep the first N rows (after ``data_offset``).
        columns: mapping ccft field -> source column.
        max_length: rows longer than this (prompt + response + EOS tokens) are dropped and counted.
        chat_template: ``auto`` | true | false; system_prompt: optional system turn.
    Numerics:
        dtype: ``float32`` (CPU) | ``bfloat16`` | ``float16`` for base and decoder weights.
    Speed:
        train_path: ``auto`` | ``two-pass`` | ``one-pass`` (CCFT with LoRA; see ``ccft.train.fastpath``).
        base_cache_store: folder of precomputed C_base (``ccft precompute``), used when it matches.
        loss_chunk_tokens: supervised tokens the LM head and cross-entropy process at a time, without
            full-vocabulary logits (``ccft.train.loss``); 0: the full-logits loss.
        freeze_embeddings: full-weight decoders: keep the input embedding (and with tied embeddings the LM
            head, the same matrix) frozen; false trains it (a dense ``(v, h)`` gradient every step).
        padding_free: Full-FT: a batch's rows run as one packed sequence of their real tokens (positions
            restart per row, block-diagonal attention; ``ccft.core.decoder.full_forward(packed=True)``), the
            same loss up to fp32 rounding without computing the pads; false: the padded layout.
        activation_checkpointing_min_tokens: with ``activation_checkpointing``, checkpoint only the batches
            whose decoder forward runs at least this many token positions with gradient (rows × padded length:
            the tail for two-pass CCFT, prompt + tail otherwise); shorter batches keep their activations,
            which saves the recompute and gives the same numbers. Peak memory is then that of an
            uncheckpointed batch of this many tokens (docs/training.md, "Training memory"). 0: every batch is
            checkpointed.
    """

    output_dir: str = field(
        default="runs/ccft",
        metadata={"help": "Run folder: the final decoder (with ccft.json) and its checkpoint-N/ folders."},
    )
    method: str = field(default="ccft", metadata={"help": "ccft | full-ft"})
    base: str = field(default=DEFAULT_BASE, metadata={"help": "Base model: embedded name, folder or HF id."})
    decoder_kind: str = field(default="lora", metadata={"help": "lora | full"})
    handoff_tokens: int = field(default=1, metadata={"help": "Prompt tokens the decoder recomputes (k ≥ 1)."})
    share_from_layer: int = field(
        default=0,
        metadata={
            "help": "Sharing depth m (method=ccft): the decoder's own prompt KV in layers 0..m-1, C_base in "
            "m..L-1; 0: PrefillShare (every layer reads C_base)."
        },
    )
    cache_format: str = field(
        default="native",
        metadata={
            "help": "native | int8 (method=ccft): the format of C_base the decoder trains on; int8: the "
            "compact C_base (keys per channel, values per token in 8 bits)."
        },
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        metadata={
            "help": "Modules that get LoRA adapters (the default: every attention and MLP projection, by "
            "the family's names: phi3's fused qkv_proj, gate_up_proj)."
        },
    )
    train_data: str = field(
        default="gsm8k:train", metadata={"help": "Built-in name:split or .jsonl/.json path."}
    )
    eval_data: str | None = field(
        default=None, metadata={"help": "Held-out data for eval NLL during training."}
    )
    train_rows: int | None = field(default=None, metadata={"help": "Use the first N training rows."})
    eval_rows: int | None = field(default=None, metadata={"help": "Use the first N eval rows."})
    data_offset: int = field(default=0, metadata={"help": "Skip this many rows before train_rows."})
    columns: dict[str, str] | None = field(default=None, metadata={"help": "ccft field -> source column."})
    max_length: int = field(default=512, metadata={"help": "Drop rows longer than this many tokens."})
    chat_template: str = field(
        default="auto", metadata={"help": "auto | true | false (a YAML boolean works too)."}
    )
    system_prompt: str | None = field(default=None, metadata={"help": "Optional system turn."})
    dtype: str = field(default="float32", metadata={"help": "float32 | bfloat16 | float16."})
    train_path: str = field(
        default="auto",
        metadata={
            "help": "auto | two-pass | one-pass: how CCFT computes C_base for LoRA "
            "decoders (auto: the faster)."
        },
    )
    base_cache_store: str | None = field(
        default=None,
        metadata={
            "help": "Folder of precomputed C_base (`ccft precompute`); stale or corrupt "
            "shards are recomputed."
        },
    )
    loss_chunk_tokens: int = field(
        default=1024,
        metadata={
            "help": "Supervised tokens per LM-head + cross-entropy chunk (no full-vocabulary "
            "logits); 0: full logits."
        },
    )
    freeze_embeddings: bool = field(
        default=True,
        metadata={
            "help": "decoder_kind=full: freeze the input embedding (with tied embeddings also the LM head)."
        },
    )
    padding_free: bool = field(
        default=True,
        metadata={
            "help": "method=full-ft: run a batch's rows as one sequence without pads (as TRL's "
            "padding_free); false: the padded layout."
        },
    )
    activation_checkpointing_min_tokens: int = field(
        default=0,
        metadata={
            "help": "With activation_checkpointing: checkpoint only batches of at least this many token "
            "positions with gradient (rows x padded length); shorter ones keep their "
            "activations. 0: every batch."
        },
    )

    def __post_init__(self):
        if self.method not in METHODS:
            raise ConfigError(f"method={self.method!r}; use one of {', '.join(METHODS)}")
        if self.decoder_kind not in DECODER_KINDS:
            raise ConfigError(f"decoder_kind={self.decoder_kind!r}; use one of {', '.join(DECODER_KINDS)}")
        if self.handoff_tokens < 1:
            raise ConfigError(f"handoff_tokens={self.handoff_tokens}; it must be ≥ 1")
        if self.share_from_layer < 0:
            raise ConfigError(
                f"share_from_layer={self.share_from_layer}; it must be ≥ 0 (0: PrefillShare, every layer "
                "reads C_base; m: the decoder's own prompt KV in layers 0..m-1)"
            )
        if self.share_from_layer and self.method != "ccft":
            raise ConfigError(
                f"share_from_layer={self.share_from_layer} applies to method=ccft only (method={self.method} "
                "prefills the whole prompt itself); remove the key or set share_from_layer: 0"
            )
        if self.share_from_layer and self.train_path == "one-pass":
            raise ConfigError(
                f"share_from_layer={self.share_from_layer} needs train_path two-pass (one-pass gates LoRA "
                "off on the whole prompt, so it cannot give the decoder its own K/V below layer m); "
                "use train_path=auto or two-pass"
            )
        check_cache_format(self.cache_format)
        if self.cache_format != "native" and self.method != "ccft":
            raise ConfigError(
                f"cache_format={self.cache_format} applies to method=ccft only (method={self.method} reads "
                "no C_base in training); remove the key or set cache_format: native"
            )
        if self.cache_format != "native" and self.train_path == "one-pass":
            raise ConfigError(
                f"cache_format={self.cache_format} needs train_path two-pass (one-pass never materialises "
                "C_base: the prompt's K/V stay inside its forward, so they cannot be quantised); use "
                "train_path=auto or two-pass"
            )
        if str(self.dtype).lower() not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}; use one of float32, bfloat16, float16")
        if str(self.chat_template).lower() not in ("auto", "true", "false"):
            raise ConfigError(f"chat_template={self.chat_template!r}; use auto, true or false")
        self.chat_template = str(self.chat_template).lower()
        if self.train_path not in ("auto", "two-pass", "one-pass"):
            raise ConfigError(f"train_path={self.train_path!r}; use auto, two-pass or one-pass")
        if self.train_path == "one-pass" and (self.decoder_kind != "lora" or self.method != "ccft"):
            raise ConfigError(
                "train_path=one-pass applies to method=ccft with decoder_kind=lora only; use train_path=auto"
            )
        for name, low in (
            ("per_device_train_batch_size", 1),
            ("per_device_eval_batch_size", 1),
            ("gradient_accumulation_steps", 1),
            ("lora_r", 1),
            ("data_offset", 0),
            ("loss_chunk_tokens", 0),
            ("activation_checkpointing_min_tokens", 0),
        ):
            if getattr(self, name) < low:
                raise ConfigError(f"{name}={getattr(self, name)}; it must be ≥ {low}")
        for name in ("train_rows", "eval_rows"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(
                    f"{name}={getattr(self, name)}; give a positive row count or leave it unset (all rows)"
                )
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"lora_dropout={self.lora_dropout}; it must be in [0, 1)")
        if not self.lora_target_modules and self.decoder_kind == "lora":
            raise ConfigError(
                "lora_target_modules is empty; name the modules that get adapters (e.g. [q_proj, v_proj])"
            )
        if self.max_length < 2:
            raise ConfigError(f"max_length={self.max_length}; it must be ≥ 2")
        if self.gradient_checkpointing and not self.gradient_checkpointing_kwargs:
            self.gradient_checkpointing_kwargs = {"use_reentrant": False}
        super().__post_init__()
        if self.activation_checkpointing_min_tokens and not self.activation_checkpointing:
            raise ConfigError(
                f"activation_checkpointing_min_tokens={self.activation_checkpointing_min_tokens} "
                "needs activation_checkpointing: true (it picks which batches are checkpointed); "
                "set activation_checkpointing: true or remove the key"
            )

    @property
    def chat_template_flag(self) -> bool | str:
        """``chat_template`` as ``ccft.core.tokens.use_chat_template`` takes it: ``"auto"``, True or False."""
        return chat_template_flag(self.chat_template)


def chat_template_flag(value: bool | str) -> bool | str:
    """A recipe's ``chat_template`` value (``"auto"``/``"true"``/``"false"``, or a bool as ccft 0.1 recorded
    it in ``ccft.json``) as ``ccft.core.tokens.use_chat_template`` takes it: ``"auto"``, True or False."""
    if isinstance(value, bool):
        return value
    value = str(value).strip().lower()
    return "auto" if value == "auto" else value == "true"


@dataclass
class EvalConfig:
    """What ``ccft eval`` / ``ccft demo`` measure (the ``eval:`` section of a recipe).

    Attributes:
        task: ``gsm8k`` (the only task of the first evaluation).
        nll_rows: held-out rows (test split) for response NLL per token.
        em_rows: problems for exact match (the first ``em_rows`` of the NLL rows).
        max_new_tokens: generation budget; rows that hit it are counted as truncated.
        batch_size: generation and scoring batch size.
        modes: which of base, full-ft, naive, prefillshare to run.
        bootstrap: resamples for confidence intervals.
        engine: True (default): every mode through ``ccft.inference.SharedPrefillEngine``, each producer
            prefilling a group of items once for every mode that reads it (generations and reference NLL);
            False: the reference path (``ccft.core.generation.generate`` and one NLL forward per mode), which
            the engine path is tested equal to (docs/evaluation.md, "Decode path").
    """

    task: str = "gsm8k"
    nll_rows: int = 100
    em_rows: int = 50
    max_new_tokens: int = 256
    batch_size: int = 16
    modes: list[str] = field(default_factory=lambda: list(MODES))
    bootstrap: int = 2000
    seed: int = 0
    engine: bool = True


# ------------------------------------------------------------------ parsing


class _RecipeParser(HfArgumentParser):
    """``HfArgumentParser`` that raises ``ValueError`` instead of printing its usage and exiting."""

    def error(self, message):
        raise ValueError(message)


@functools.lru_cache(maxsize=None)
def _parser(cls) -> tuple[HfArgumentParser, dict[str, Any]]:
    """The ``HfArgumentParser`` of ``cls`` (built once) and the type hints of its fields."""
    return _RecipeParser(cls, allow_abbrev=False, add_help=False), typing.get_type_hints(cls)


def _union(tp: Any) -> tuple:
    """The members of a union type hint (``int | None`` -> ``(int, NoneType)``); ``(tp,)`` for any other."""
    return typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)


def _parse_value(cls, key: str, value: Any, where: str) -> Any:
    """One recipe value, converted the way ``HfArgumentParser`` converts ``--key=value`` for ``cls``.

    A scalar is parsed as the command-line text ``--key=value`` (a YAML boolean as ``true``/``false``, or
    as ``no`` where that is the choice: YAML 1.1 reads ``save_strategy: no`` as false); a list element by
    element, where the field takes a list; ``null`` and mappings as they are, where the field takes them.
    Enum choices come back as their string value. Raises ConfigError naming ``where``, the key and its type.
    """
    parser, hints = _parser(cls)
    tp = hints[key]
    members = tuple(typing.get_origin(a) or a for a in _union(tp))

    def bad(reason: str = "") -> ConfigError:
        name = " | ".join(
            "None"
            if a is type(None)
            else a.__name__
            if isinstance(a, type)
            else str(a).replace("typing.", "")
            for a in _union(tp)
        )
        return ConfigError(
            f"{where}: key {key!r} expects {name}, got {value!r} ({type(value).__name__})"
            f"{' (' + reason + ')' if reason else ''}; fix the value there"
        )

    def parse(text: str) -> Any:
        try:
            parsed = getattr(parser.parse_args([f"--{key}={text}"]), key)
        except ValueError as e:  # argparse: "argument --KEY: invalid int value: 'abc'"
            raise bad(str(e).split(": ", 1)[-1]) from None
        return parsed.value if isinstance(parsed, enum.Enum) else parsed

    def one(item: Any) -> Any:
        if item is None or isinstance(item, (dict, list, tuple)):
            raise bad()
        if not isinstance(item, bool):
            return parse(str(item))
        try:
            return parse(str(item).lower())
        except ConfigError:
            if item is not False:
                raise
            return parse("no")

    if value is None or isinstance(value, dict):
        if type(value) not in members:
            raise bad()
        return value
    if isinstance(value, (list, tuple)):
        if list not in members:
            raise bad()
        out: list = []
        for item in value:  # a list field parses one element per item; others give a list of values
            parsed = one(item)
            out.extend(parsed if isinstance(parsed, list) else [parsed])
        return out
    return one(value)


def _validate(
    raw: dict,
    cls,
    where: str,
    lines: dict[str, int] | None = None,
    overridden: set | None = None,
    prefix: str = "",
) -> dict:
    """Check every key of ``raw`` against ``cls``'s fields and convert its value (``_parse_value``).

    ``lines``: the recipe line of each key (``FILE:LINE`` in the messages); ``overridden``: the keys a
    command-line override set (named as such, ``prefix`` + key, instead of blaming the recipe file)."""
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    out = {}
    for key, value in raw.items():
        if overridden and key in overridden:
            at = f"command-line override {prefix}{key}={value}"
        else:
            at = f"{where}:{lines[key]}" if lines and key in lines else where
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"{at}: unknown key {key!r}{hint} (see `ccft train --help-config` for the fields)"
            )
        out[key] = _parse_value(cls, key, value, at)
    return out


def _key_lines(text: str) -> tuple[dict[str, int], dict[str, int]]:
    """The 1-based line of each top-level key of a YAML mapping, and of each key of its ``eval`` section."""
    top: dict[str, int] = {}
    sub: dict[str, int] = {}
    node = yaml.compose(text)
    if not isinstance(node, yaml.MappingNode):
        return top, sub
    for k, v in node.value:
        if isinstance(k, yaml.ScalarNode):
            top[str(k.value)] = k.start_mark.line + 1
            if k.value == "eval" and isinstance(v, yaml.MappingNode):
                sub.update(
                    {
                        str(kk.value): kk.start_mark.line + 1
                        for kk, _ in v.value
                        if isinstance(kk, yaml.ScalarNode)
                    }
                )
    return top, sub


def check_paths(cfg: "TrainConfig", where: str = "config") -> None:
    """Refuse (``ConfigError``, before any model loads) output and store paths that cannot be written.

    ``output_dir`` and ``base_cache_store`` must be folders or not exist yet, under a writable
    folder (no existing file anywhere on the way); ``resume_from_checkpoint`` must be an existing folder; a
    local ``base`` path must be a model folder.
    """
    resume = getattr(cfg, "resume_from_checkpoint", None)
    if isinstance(resume, str) and resume and not Path(resume).is_dir():
        raise ConfigError(
            f"{where}: resume_from_checkpoint {resume!r} is not a checkpoint folder "
            f"({'a file' if Path(resume).exists() else 'it does not exist'})"
        )
    from ccft.core.io import check_output_folder

    for key in ("output_dir", "base_cache_store"):
        value = getattr(cfg, key, None)
        if value:
            check_output_folder(value, key, where)
    base = Path(str(cfg.base))
    if base.exists() and not base.is_dir():
        raise ConfigError(
            f"{where}: base {str(base)!r} is a file; give a model folder (config.json, weights, "
            "tokenizer), an embedded model name or a hub id"
        )
    if base.is_dir() and not (base / "config.json").is_file():
        raise ConfigError(
            f"{where}: base folder {str(base)!r} has no config.json; give a Hugging Face model folder"
        )


def parse_override(item: str, example: str = "max_steps=10") -> tuple[str, Any]:
    """One ``key=value`` override -> ``(key, value)``: the rule ``ccft train``, ``ccft demo``, ``ccft eval``
    and ``ccft study`` share. The value is YAML (``10`` an int, ``0.5`` a float, ``true``, ``null``, flow
    collections ``[a, b]`` / ``{k: v}``, quoted strings); unquoted text stays as typed (YAML would read
    ``Answer: briefly`` as a mapping and cut ``after #### N`` at the comment sign); an empty value is None.

    Raises:
        ConfigError: not ``key=value`` (the message shows ``example``), or a value that is not valid YAML.
    """
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} is not key=value (e.g. {example})")
    key = key.strip()
    text = value.strip()
    try:
        parsed = yaml.safe_load(value) if text else None
    except yaml.YAMLError as e:
        raise ConfigError(
            f"override {key}={value!r} is not a valid YAML value "
            f"({getattr(e, 'problem', None) or e}); fix the brackets or quotes"
        ) from None
    if isinstance(parsed, (str, dict, list)) and not text.startswith(("{", "[", "'", '"')):
        parsed = text
    return key, parsed


def parse_overrides(overrides: list[str] | None) -> dict:
    """``["key=value", ...]`` -> dict (``parse_override`` per item; ``eval.KEY`` into the ``eval``
    section)."""
    out: dict[str, Any] = {}
    for item in overrides or []:
        key, parsed = parse_override(item)
        if key.startswith("eval."):
            out.setdefault("eval", {})[key[5:]] = parsed
        else:
            out[key] = parsed
    return out


def read_yaml_mapping(p: Path, kind: str, expected: str) -> tuple[dict[str, Any], str]:
    """(mapping, text) of the YAML file ``p``: a recipe, a study config or an evaluation suite (``kind`` names
    it in the messages, ``expected`` says what to give instead). An empty file is an empty mapping.

    Raises:
        ConfigError: ``p`` is a folder, missing, unreadable, not UTF-8, not YAML (``FILE:LINE:COL``) or not a
            mapping.
    """
    if p.is_dir():
        raise ConfigError(f"{kind} {p} is a directory; give {expected}")
    if not p.is_file():
        raise ConfigError(f"{kind} {p} does not exist; give {expected}")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{p}: not UTF-8 text (byte {e.start}: {e.reason}); save the {kind} as UTF-8"
        ) from None
    except OSError as e:
        raise ConfigError(f"{kind} {p} cannot be read: {e.strerror}") from None
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{at}: not valid YAML: {problem}") from None
    if not isinstance(raw, dict):
        article = "an" if kind[:1] in "aeiou" else "a"
        raise ConfigError(f"{p}:1: {article} {kind} is a mapping of keys to values, got {type(raw).__name__}")
    return raw, text


def load_eval_config(path: str | Path) -> EvalConfig:
    """The ``EvalConfig`` an evaluation suite file declares (``evals/demo.yaml``: ``task``, ``nll_rows``,
    ``em_rows``, ``modes``, ...; docs/evaluation.md, "Suites"), validated like a recipe's ``eval:`` section.

    Raises:
        ConfigError: unreadable file, unknown key (``FILE:LINE``), wrong type, unknown mode.
    """
    p = Path(path)
    raw, text = read_yaml_mapping(p, "evaluation suite", "an evals/*.yaml file")
    kw = _validate(raw, EvalConfig, str(p), _key_lines(text)[0])
    return _eval_config(kw, str(p))


def _eval_config(kw: dict, where: str) -> EvalConfig:
    (ecfg,) = _parser(EvalConfig)[0].parse_dict(kw)
    bad = [m for m in ecfg.modes if m not in MODES]
    if bad:
        raise ConfigError(f"{where}: eval.modes has unknown mode(s) {bad}; use {', '.join(MODES)}")
    return ecfg


def load_recipe(
    path: str | Path | None, overrides: list[str] | None = None, *, with_eval: bool = True, **extra: Any
) -> tuple[TrainConfig, EvalConfig, dict]:
    """Parse and validate a recipe YAML plus ``key=value`` overrides (``eval.KEY=value`` for the eval
    section).

    ``eval:`` is a mapping or the evaluation suite it names (``ccft.train.recipes.resolve_named``: a packaged
    suite's name, or a path relative to the recipe's folder, then to the working directory). With
    ``with_eval=False`` (``ccft train``, ``ccft precompute``: training does not read it) the eval section and
    ``eval.KEY`` overrides are neither read nor validated, the ``EvalConfig`` returned is the default one and
    the merged dict has no ``eval``.

    Returns (TrainConfig, EvalConfig, the merged raw dict recorded in ``ccft.json``). Raises
    ConfigError for an unreadable file, unknown key, wrong type or invalid value — before any
    model is loaded.
    """
    raw: dict[str, Any] = {}
    where = "config"
    lines: dict[str, int] = {}
    eval_lines: dict[str, int] = {}
    eval_where = "config (eval section)"
    if path is not None:
        p = Path(path)
        raw, text = read_yaml_mapping(p, "recipe", "a recipe .yaml file (see recipes/ for examples)")
        where = str(p)
        lines, eval_lines = _key_lines(text)
        eval_where = where if eval_lines else f"{where} (eval section)"
        suite = raw.get("eval")
        if not with_eval:
            raw.pop("eval", None)
        elif isinstance(suite, str):  # an evaluation suite (evals/*.yaml; docs/evaluation.md, "Suites")
            from ccft.train.recipes import resolve_named

            sp = resolve_named(suite, p, "eval", f"{p}:{lines.get('eval', 1)}")
            raw["eval"], suite_text = read_yaml_mapping(sp, "evaluation suite", "an evals/*.yaml file")
            eval_lines, eval_where = _key_lines(suite_text)[0], str(sp)
        elif "eval" in raw and raw["eval"] is not None and not isinstance(raw["eval"], dict):
            raise ConfigError(
                f"{p}:{lines.get('eval', 1)}: `eval` is a mapping of eval keys to values, or the path of "
                "an evaluation suite (evals/*.yaml)"
            )
    ov = parse_overrides(overrides)
    for key in ov:
        lines.pop(key, None)
    eval_raw = dict(raw.pop("eval", None) or {})
    eval_ov = ov.pop("eval", {})
    for key in eval_ov:
        eval_lines.pop(key, None)
    eval_raw.update(eval_ov)
    raw.update(ov)
    raw.update(extra)
    train_kw = _validate(raw, TrainConfig, where, lines, set(ov))
    eval_kw = (
        _validate(eval_raw, EvalConfig, eval_where, eval_lines, set(eval_ov), "eval.") if with_eval else {}
    )
    train_kw.setdefault("report_to", "none")
    try:
        (cfg,) = _parser(TrainConfig)[0].parse_dict(train_kw)
    except (ConfigError, ValueError, TypeError) as e:  # __post_init__ of TrainConfig / TrainingArguments
        raise ConfigError(f"{where}: {e}") from None
    ecfg = _eval_config(eval_kw, eval_where) if with_eval else EvalConfig()
    for key in ("train_data", "eval_data"):
        if getattr(cfg, key):
            try:
                resolve_data(getattr(cfg, key), cfg.columns)
            except ConfigError as e:
                at = f"{where}:{lines[key]}" if key in lines else where
                raise ConfigError(f"{at}: {key}: {e}") from None
    check_paths(cfg, where)
    merged = dict(train_kw, eval=eval_kw) if with_eval else dict(train_kw)
    return cfg, ecfg, merged
