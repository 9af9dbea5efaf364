"""Export a ccft decoder folder for engines that know nothing of ccft: a PEFT aLoRA adapter, or a merged
model.

``ccft export DECODER --to peft-alora OUT`` (:func:`export_alora`)
    A CCFT LoRA decoder is off on the base-prefilled prompt ``prompt[:n-k]`` (the base computes
    ``C_base``) and on from the handoff tokens ``prompt[n-k:]`` onward (docs/design.md, "Terms",
    "handoff"). PEFT's activated LoRA (``LoraConfig(alora_invocation_tokens=[...])``, PEFT >= 0.17;
    ``peft.tuners.lora.variants.ALoraLinearVariant``) is off before the *start* of the last
    occurrence of the invocation sequence in the input and on from its first token onward. With the
    invocation sequence = the decoder's k handoff ids, the two are the same computation: the exported
    adapter run by stock PEFT over ``prompt + response`` gives ccft's ``prefillshare`` logits.
    That needs the handoff ids to be one fixed sequence at the end of every prompt: for a decoder
    trained on chat prompts, the last k ids of the chat template's generation prompt (checked on
    several probe prompts rendered as training rendered them). Refused, with the fix named:
    full-weight decoders, ``full-ft`` decoders (trained on their own prefill: the adapter must be on
    for the whole prompt), plain-text prompts (their last token is whatever ends the prompt) unless
    the caller names the fixed suffix, a handoff that reaches into the message text, adapters
    PEFT cannot run as aLoRA (``modules_to_save``, DoRA, trainable tokens, LoRA on non-linear layers), and
    decoders trained at sharing depth ``share_from_layer`` m > 0 (issue 35: aLoRA is off on the prompt in
    every layer, so the decoder's own prompt K/V below layer m cannot be expressed) or on the compact C_base
    (``cache_format`` ``int8``: an aLoRA server prefills in its own precision).

    The trap (warned, recorded in the result and the model card): PEFT activates at the *last*
    occurrence. A sequence without a control token (e.g. the single newline ending SmolLM2's
    generation prompt, ``handoff_tokens=1``) can occur inside a response; a forward over ``prompt +
    response`` containing it (teacher-forced scoring; an engine re-prefilling a preempted request)
    turns the adapter off for the response tokens before that occurrence. Generation from the prompt
    alone is exact (PEFT fixes the offset on the prompt; each new token is on). A handoff covering the
    generation prompt from a control token on (``<|im_start|>assistant\\n``: ``handoff_tokens=4`` for
    SmolLM2) cannot recur in a response (responses never hold control tokens; docs/design.md, K9).

``ccft export DECODER --to merged OUT`` (:func:`export_merged`)
    A plain transformers folder (``AutoModelForCausalLM.from_pretrained``): a full-weight decoder as
    it is, or a LoRA decoder merged into a private copy of its base (``merge_and_unload``). Its
    ``ccft.json`` keeps the method, base fingerprint and ``handoff_tokens`` (``decoder_kind: full``,
    ``exported_from``), so ``ccft.load_decoder`` loads it as a decoder. A merged CCFT decoder is exact
    only on ``C_base`` (ccft's prefillshare mode, or an engine doing disaggregated prefill with the base);
    running its own prefill is a different model (docs/design.md, "Modes"). A decoder trained at sharing depth
    m > 0 keeps ``share_from_layer`` in its ``ccft.json``: ccft's reference path runs it at that depth (and a
    decoder trained on the compact C_base keeps ``cache_format``).

Every export writes a ``README.md`` model card (``ccft.train.card``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ccft.core.errors import ConfigError

__all__ = [
    "EXPORT_META_FILE",
    "EXPORT_TARGETS",
    "ExportResult",
    "InvocationSequence",
    "check_alora_kind",
    "export_alora",
    "export_decoder",
    "export_merged",
    "invocation_sequence",
]

EXPORT_TARGETS = ("peft-alora", "merged")

#: Provenance of an aLoRA export (it has no ``ccft.json``: it is a PEFT folder, not a ccft decoder).
EXPORT_META_FILE = "ccft_export.json"

#: Probe prompts rendered like training rows to find the fixed end of every prompt (varied lengths, a
#: trailing newline, a multi-turn conversation).
_PROBES: tuple = (
    "Hi",
    "What is 17 + 25?\n",
    "Write a function that reverses a list.\n\n    def f(xs):",
    [
        {"role": "user", "content": "One."},
        {"role": "assistant", "content": "Two.\nThree"},
        {"role": "user", "content": "Four?"},
    ],
)


@dataclass(frozen=True)
class InvocationSequence:
    """The aLoRA invocation sequence of a decoder: its handoff ids, fixed at the end of every prompt.

    Attributes:
        ids: the k token ids (k = ``handoff_tokens``).
        text: their decoded text (for messages and the model card).
        has_control_token: True when a control token is among them (then no response can hold them).
        safe_handoff_tokens: the smallest k whose fixed prompt suffix holds a control token (the handoff a
            recipe needs for an export without the recurrence trap); None when unknown.
        safe_text: the text of that suffix.
    """

    ids: list[int]
    text: str
    has_control_token: bool
    safe_handoff_tokens: int | None = None
    safe_text: str | None = None

    def recurrence_warning(self) -> str | None:
        """The trap, in words, when the sequence can occur inside a response (else None)."""
        if self.has_control_token:
            return None
        fix = (
            f"train the decoder with handoff_tokens={self.safe_handoff_tokens} (the generation prompt "
            f"{self.safe_text!r}, which holds a control token no response contains)"
            if self.safe_handoff_tokens
            else "train with a handoff that holds a control token"
        )
        return (
            f"the aLoRA invocation sequence {self.text!r} (ids {self.ids}) holds no control token, so a "
            "response can contain it; PEFT activates the adapter at the LAST occurrence in its input, so a "
            "forward over prompt + such a response (teacher-forced scoring, an engine re-prefilling a "
            "preempted request) has the adapter off for the response tokens before it. Generation from "
            f"the prompt is exact. For an export without this trap, {fix}"
        )


@dataclass
class ExportResult:
    """What :func:`export_decoder` wrote.

    Attributes:
        out: the folder written.
        target: ``"peft-alora"`` or ``"merged"``.
        invocation: the aLoRA invocation sequence (peft-alora only).
        warnings: sentences for the user (also in the model card).
    """

    out: Path
    target: str
    invocation: InvocationSequence | None = None
    warnings: list[str] = field(default_factory=list)


def _prompt_format(meta: dict) -> tuple[bool | str, str | None]:
    """(chat_template flag, system_prompt) of the recipe recorded in ``ccft.json`` (TrainConfig defaults when
    absent)."""
    from ccft.train.config import TrainConfig, chat_template_flag

    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    recipe = meta.get("recipe") if isinstance(meta.get("recipe"), dict) else {}
    return (
        chat_template_flag(recipe.get("chat_template", defaults["chat_template"])),
        recipe.get("system_prompt", defaults["system_prompt"]),
    )


def invocation_sequence(meta: dict, tokenizer, *, invocation_text: str | None = None) -> InvocationSequence:
    """The aLoRA invocation sequence of the decoder described by ``meta`` (its ``ccft.json``).

    Args:
        meta: the decoder's ``ccft.json`` (``handoff_tokens``, ``recipe`` with ``chat_template`` and
            ``system_prompt``; a decoder without a recipe is taken to use the tokenizer's chat template
            when it has one, as ``TrainConfig``'s ``chat_template: auto`` does).
        tokenizer: the base's tokenizer.
        invocation_text: for plain-text (completion) prompts: the fixed text every prompt you will serve
            ends with; its tokens must be exactly ``handoff_tokens`` long. Refused for chat prompts.
    Returns:
        :class:`InvocationSequence`.
    Raises:
        ConfigError: the handoff is not one fixed token sequence at the end of every prompt (plain-text
            prompts without ``invocation_text``; a handoff that reaches into the message text), or
            ``invocation_text`` does not tokenize to ``handoff_tokens`` ids or is given for chat prompts.
    """
    from ccft.core.tokens import as_ids, control_tokens, tokenize_prompt, use_chat_template

    k = int(meta.get("handoff_tokens", 1))
    controls = set(control_tokens(tokenizer).values())
    flag, system_prompt = _prompt_format(meta)
    if not use_chat_template(tokenizer, flag):
        if invocation_text is None:
            raise ConfigError(
                f"the decoder was trained on plain-text prompts (chat_template={flag}): its handoff (the "
                f"last {k} prompt token(s)) is whatever ends each prompt, not a fixed sequence, so no aLoRA "
                "invocation sequence can express it. Fix: pass --invocation-text TEXT if every prompt you "
                "will serve ends with TEXT (tokenizing to exactly handoff_tokens ids), export with --to "
                "merged, or retrain with chat_template: true"
            )
        ids = as_ids(tokenizer(invocation_text, add_special_tokens=False))
        if len(ids) != k:
            raise ConfigError(
                f"--invocation-text {invocation_text!r} is {len(ids)} token(s) {ids} but the decoder's "
                f"handoff_tokens is {k}; pass the text of exactly the last {k} prompt token(s)"
            )
        return InvocationSequence(ids=ids, text=invocation_text, has_control_token=bool(controls & set(ids)))
    if invocation_text is not None:
        raise ConfigError(
            "--invocation-text is for decoders trained on plain-text prompts; this one was trained on "
            "chat prompts, whose invocation sequence ccft reads from the chat template: drop the option"
        )
    prompts = [
        tokenize_prompt(tokenizer, p, chat_template=flag, system_prompt=system_prompt) for p in _PROBES
    ]
    common = 0  # length of the suffix every probe prompt shares
    while all(len(p) > common for p in prompts) and len({p[-common - 1] for p in prompts}) == 1:
        common += 1
    if k >= min(len(p) for p in prompts) or k > common:
        raise ConfigError(
            f"handoff_tokens={k} reaches past the fixed end of the chat prompts (the {common} token(s) "
            f"{tokenizer.decode(prompts[0][-common:]) if common else ''!r} every prompt ends with) into the "
            "message text, so it is not one invocation sequence. Fix: retrain with handoff_tokens <= "
            f"{common}, or export with --to merged"
        )
    suffix = prompts[0][-common:]
    safe = next((j for j in range(1, common + 1) if controls & set(suffix[-j:])), None)
    ids = prompts[0][-k:]
    return InvocationSequence(
        ids=ids,
        text=tokenizer.decode(ids),
        has_control_token=bool(controls & set(ids)),
        safe_handoff_tokens=safe,
        safe_text=tokenizer.decode(suffix[-safe:]) if safe else None,
    )


def check_alora_kind(
    kind: str,
    method: str | None,
    what: str,
    share_from_layer: int | None = 0,
    cache_format: str | None = "native",
) -> None:
    """Refuse full-weight and non-CCFT decoders for ``peft-alora``, decoders trained at sharing depth
    m > 0 (issue 35: an aLoRA adapter is off on the whole prompt in every layer, so it cannot give the
    decoder its own prompt K/V below layer m) and decoders trained on the compact C_base (``cache_format``
    ``int8``, issue 35: an aLoRA server prefills the prompt in its own precision, so the cache the decoder
    learned cannot be expressed) (ConfigError naming the fix)."""
    fmt = cache_format or "native"
    if fmt != "native":
        raise ConfigError(
            f"{what} was trained on cache_format={fmt} (the compact C_base, quantised K/V): an aLoRA "
            "server prefills the prompt with the base in its own precision, so neither peft-alora nor "
            "gguf-alora can represent the cache it learned. Fix: export with --to merged (its ccft.json "
            "keeps cache_format; run it with ccft's reference path), or train with cache_format: native"
        )
    m = int(share_from_layer or 0)
    if m:
        raise ConfigError(
            f"{what} was trained at share_from_layer={m} (its own prompt KV in layers 0..{m - 1}, C_base "
            "above): an aLoRA adapter is off on the whole prompt in every layer, so neither peft-alora nor "
            "gguf-alora can represent it. Fix: export with --to merged (its ccft.json keeps "
            "share_from_layer; run it with ccft's reference path), or train with share_from_layer: 0"
        )
    if kind != "lora":
        raise ConfigError(
            f"{what} is a full-weight decoder; an aLoRA adapter holds LoRA weights only. Fix: "
            "export it with --to merged (a plain transformers folder)"
        )
    if method != "ccft":
        raise ConfigError(
            f"{what} was trained with method={method!r}, on its own prefill: its adapter is on for the "
            "whole prompt, which an aLoRA adapter (off before the invocation tokens) is not. Fix: serve "
            "its PEFT folder as a plain LoRA, or export with --to merged"
        )


def _check_alora_adapter(decoder, path) -> None:
    """Refuse a LoRA decoder PEFT cannot run as aLoRA (ConfigError naming the field and the fix)."""
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.tuners.lora.layer import LoraLayer

    name = decoder.meta.get("adapter_name", "default")
    cfg = decoder.model.peft_config[name]
    bad = [
        (f, getattr(cfg, f, None))
        for f in ("modules_to_save", "trainable_token_indices")
        if getattr(cfg, f, None)
    ]
    bad += [(f, True) for f in ("use_dora", "lora_bias") if getattr(cfg, f, False)]
    if bad:
        raise ConfigError(
            f"decoder {path}: {', '.join(f'{f}={v!r}' for f, v in bad)} in its LoRA config; PEFT's aLoRA "
            "applies the adapter selectively only to LoRA weights of linear layers. Fix: export with "
            "--to merged, or retrain without these options"
        )
    other = sorted(
        {
            type(m).__name__
            for _, m in decoder.model.named_modules()
            if isinstance(m, LoraLayer) and name in getattr(m, "lora_A", {}) and not isinstance(m, LoraLinear)
        }
    )
    if other:
        raise ConfigError(
            f"decoder {path}: LoRA on {', '.join(other)} layers; PEFT's aLoRA supports linear layers only. "
            "Fix: export with --to merged, or retrain with target_modules on linear projections"
        )


def check_export_folder(out: str | os.PathLike) -> Path:
    """Refuse an export folder that is not new or empty (an export never mixes with other files), before any
    model loads.

    Returns:
        ``Path(out)``.
    Raises:
        ConfigError: ``out`` is a file, lies under a file, is not writable, or is a folder that is not empty.
    """
    from ccft.core.io import check_output_folder

    out = check_output_folder(out, "out")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"output folder {out} exists and is not empty; choose a new folder or remove it")
    return out


def _stage(out: Path) -> Path:
    """A temporary sibling of ``out`` to write into (renamed into place by :func:`_publish`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))


def _publish(tmp: Path, out: Path) -> None:
    """Move the staged folder to ``out`` (which must not exist or be empty)."""
    if out.exists():
        if any(out.iterdir()):
            raise ConfigError(
                f"output folder {out} exists and is not empty; choose a new folder or remove it"
            )
        out.rmdir()
    os.replace(tmp, out)


def export_alora(
    decoder, out: str | os.PathLike, *, invocation_text: str | None = None, source: str | None = None
) -> ExportResult:
    """Write a CCFT LoRA ``decoder`` as a stock PEFT aLoRA adapter folder ``out``.

    The folder holds ``adapter_config.json`` (the decoder's LoRA config plus ``alora_invocation_tokens``
    = its handoff ids), ``adapter_model.safetensors``, the tokenizer, ``ccft_export.json`` (provenance:
    base fingerprint, handoff, invocation ids) and a ``README.md`` model card. Load it with
    ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), out)``: no ccft code.

    Args:
        decoder: a ``ccft.Decoder`` of kind ``lora`` trained with method ``ccft``.
        out: a new (or empty) folder.
        invocation_text: see :func:`invocation_sequence` (plain-text prompts only).
        source: the decoder folder's path, for messages and provenance.
    Returns:
        :class:`ExportResult` (``warnings`` holds the recurrence trap when it applies).
    Raises:
        ConfigError: a full-weight or ``full-ft`` decoder, a handoff that is no fixed invocation sequence, an
            adapter aLoRA cannot run, or a non-empty ``out`` — all before anything is written.
    """
    what = source or "the decoder"
    check_alora_kind(decoder.kind, decoder.method, what, decoder.share_from_layer, decoder.cache_format)
    _check_alora_adapter(decoder, what)
    inv = invocation_sequence(decoder.meta, decoder.base.tokenizer, invocation_text=invocation_text)
    out = check_export_folder(out)
    result = ExportResult(out=out, target="peft-alora", invocation=inv)
    warning = inv.recurrence_warning()
    if warning:
        result.warnings.append(warning)
        warnings.warn(warning, stacklevel=2)
    tmp = _stage(out)
    try:
        name = decoder.meta.get("adapter_name", "default")
        decoder.model.save_pretrained(str(tmp), selected_adapters=[name])
        if name != "default" and (tmp / name).is_dir():  # PEFT nests non-default adapters
            for p in (tmp / name).iterdir():
                os.replace(p, tmp / p.name)
            (tmp / name).rmdir()
        cfg_file = tmp / "adapter_config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg["alora_invocation_tokens"] = list(inv.ids)
        cfg["inference_mode"] = True
        cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True))
        from peft import LoraConfig

        if LoraConfig.from_pretrained(str(tmp)).alora_invocation_tokens != list(
            inv.ids
        ):  # PEFT reads it back
            raise ConfigError(f"peft did not read alora_invocation_tokens back from {cfg_file}")
        decoder.base.tokenizer.save_pretrained(str(tmp))
        meta = {
            "exported_from": source,
            "target": "peft-alora",
            "method": decoder.method,
            "base": decoder.meta.get("base"),
            "base_fingerprint": decoder.fingerprint,
            "handoff_tokens": decoder.handoff_tokens,
            "alora_invocation_tokens": list(inv.ids),
            "invocation_text": inv.text,
            "warnings": result.warnings,
            "source_meta": {k: v for k, v in decoder.meta.items() if k != "adapter_name"},
        }
        (tmp / EXPORT_META_FILE).write_text(json.dumps(meta, indent=2, default=str))
        from ccft.train.card import write_model_card

        write_model_card(tmp, decoder.meta, export=meta)
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def export_merged(decoder, out: str | os.PathLike, *, source: str | None = None) -> ExportResult:
    """Write ``decoder`` as a plain transformers folder ``out`` (+ ``ccft.json`` and a model card).

    A LoRA decoder is merged with ``merge_and_unload``, which rewrites the weights of the model it is
    attached to: pass a decoder loaded on a base of its own (:func:`export_decoder` does); the base is
    not usable afterwards.

    Raises:
        ConfigError: a non-empty ``out``.
    """
    from ccft.core.checkpoint import META_FILE, decoder_meta

    out = check_export_folder(out)
    tmp = _stage(out)
    try:
        if decoder.kind == "lora":
            name = decoder.meta.get("adapter_name", "default")
            host = decoder.model
            for other in [a for a in host.peft_config if a != name]:
                host.delete_adapter(other)
            host.set_adapter(name)
            model = host.merge_and_unload()
        else:
            model = decoder.model
        model.save_pretrained(str(tmp))
        decoder.base.tokenizer.save_pretrained(str(tmp))
        meta = decoder_meta(
            decoder,
            decoder_kind="full",
            exported_from={"path": source, "decoder_kind": decoder.kind, "target": "merged"},
        )
        meta.pop("adapter_name", None)
        from ccft.train.card import write_model_card

        write_model_card(tmp, meta, export={"target": "merged", "exported_from": source})
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, default=str))
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportResult(out=out, target="merged")


def export_decoder(
    decoder_path: str | os.PathLike,
    to: str,
    out: str | os.PathLike,
    *,
    invocation_text: str | None = None,
    base=None,
) -> ExportResult:
    """Load the decoder folder ``decoder_path`` and export it (``to``: ``peft-alora`` or ``merged``).

    Args:
        base: the decoder's ``ccft.Base`` (default: the one named in ``ccft.json``). A LoRA decoder exported
            ``merged`` always gets a private copy of the base (merging rewrites its weights).
        invocation_text: see :func:`invocation_sequence`.
    Returns:
        :class:`ExportResult`.
    Raises:
        ConfigError: unknown ``to``, not a decoder folder, ``out`` not new or empty, or what
            :func:`export_alora` refuses; checked before the model is loaded where the folder's ``ccft.json``
            already tells.
        FingerprintMismatchError: ``base`` is not the decoder's base.
    """
    from ccft.core.checkpoint import load_decoder, read_meta

    if to not in EXPORT_TARGETS:
        raise ConfigError(f"--to {to!r}; use one of {', '.join(EXPORT_TARGETS)}")
    meta = read_meta(decoder_path)
    kind = meta.get("decoder_kind") or (
        "lora" if (Path(decoder_path) / "adapter_config.json").is_file() else "full"
    )
    if to == "peft-alora":  # before loading any model
        check_alora_kind(
            kind,
            meta.get("method"),
            str(decoder_path),
            meta.get("share_from_layer", 0),
            meta.get("cache_format"),
        )
    check_export_folder(out)  # before the model loads
    if to == "merged" and kind == "lora":
        base = None  # merging rewrites the host's weights: never the caller's base
    decoder = load_decoder(decoder_path, base=base, adapter_name="default" if base is None else None)
    source = str(decoder_path)
    if to == "peft-alora":
        return export_alora(decoder, out, invocation_text=invocation_text, source=source)
    return export_merged(decoder, out, source=source)
