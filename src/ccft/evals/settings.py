"""What every mode of an evaluation shares (``EvalSettings``) and what differs (``ModeSpec``: the decoder).

Modes differ only in who prefills and who decodes (``ccft.core.modes``; docs/design.md, "Modes"):
items, prompt ids, stop strings, ``max_new_tokens`` and sampling settings are the same for all of
them, and ``EvalSettings.as_dict`` is the resume key of a result folder (a rerun with other settings
is refused).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ccft.core.compact import check_cache_format
from ccft.core.decoder import Decoder, resolve_handoff
from ccft.core.errors import ConfigError
from ccft.core.modes import MODES, check_mode, decoder_for_mode, get_mode
from ccft.evals.prompting import PromptFormat
from ccft.evals.protocol import stop_setting, task_name

__all__ = ["EvalSettings", "ModeSpec", "default_modes", "mode_specs", "shared_handoff"]


@dataclass
class EvalSettings:
    """Decoding and data settings shared by every mode of a run (they are the resume key).

    Attributes:
        limit: items (the first ``limit`` of the task's order); None = all.
        generate_limit: generate and score only the first ``generate_limit`` of those items (the others
            get the reference NLL only); None = all.
        max_new_tokens: generation budget (None: the task's, else 256).
        generate: False = reference NLL only.
        samples / temperature / top_p: default to the task's (``samples`` 1 = greedy); with n > 1 samples per
            item the runner samples (temperature 0.8, top-p 0.95 unless the task says otherwise) with seeds
            ``seed .. seed+n-1``, identical across modes.
        seed: sampling seed and bootstrap seed.
        handoff_tokens: k, the prompt tokens the decoder recomputes on ``C_base`` (docs/design.md, "Terms").
        engine: generations (every mode) through ``ccft.inference.SharedPrefillEngine`` (else the
            reference ``ccft.core.generation.generate`` it is tested against).
        prompt_format: the decoders' training format (``ccft.evals.prompting``); None = each task's own.
        cache_format: the format the modes that read C_base (``naive``, ``prefillshare``) read it in
            (issue 35; ``ccft.core.compact``): ``int8`` serves every such decoder on the compact C_base (one
            trained on the native cache too), ``native`` on C_base as computed; None = each decoder's own
            (``Decoder.cache_format``). With ``engine`` the engine reads it too (``make_engine``).
        block_weights: the engine's base weights (``SharedPrefillEngine(block_weights=...)``): ``"off"`` its
            fp32 weights, ``"auto"`` / ``"on"`` the linear layers computed from the GGUF's own Q4_1 / Q8_0
            blocks (docs/inference.md, "Block weights"; the same weights, other fp32 rounding). None
            (default): ``$CCFT_BLOCK_WEIGHTS``, else ``"off"``, read when the settings are made. Used with
            ``engine`` only; part of the resume key whenever it is not ``"off"``, so one folder never mixes
            records of the two paths.
    """

    limit: int | None = None
    max_new_tokens: int | None = None
    generate: bool = True
    samples: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int = 0
    handoff_tokens: int = 1
    engine: bool = False
    generate_limit: int | None = None
    prompt_format: PromptFormat | None = None
    cache_format: str | None = None
    block_weights: str | None = None

    def __post_init__(self):
        if self.cache_format is not None:
            check_cache_format(self.cache_format, where="eval cache_format")
        if self.engine:  # the engine's module only when an engine runs (as make_engine imports it)
            from ccft.inference.blocks import SETTINGS, default_setting

            if self.block_weights is None:
                self.block_weights = default_setting()  # $CCFT_BLOCK_WEIGHTS (a bad value raises here)
            elif self.block_weights not in SETTINGS:
                raise ConfigError(
                    f"eval block_weights={self.block_weights!r}: use one of {', '.join(SETTINGS)} "
                    "(or leave it unset for $CCFT_BLOCK_WEIGHTS)"
                )

    def resolved_samples(self, task) -> int:
        return int(self.samples or getattr(task, "samples", 1) or 1)

    def resolved_max_new_tokens(self, task) -> int:
        return int(self.max_new_tokens or getattr(task, "max_new_tokens", None) or 256)

    def sampling(self, task) -> dict:
        """``do_sample``/``temperature``/``top_p`` for ``ccft.core.generation.generate``."""
        if self.resolved_samples(task) == 1 and not self.temperature:
            return {"do_sample": False, "temperature": 1.0, "top_p": 1.0}
        return {
            "do_sample": True,
            "temperature": float(self.temperature or getattr(task, "temperature", None) or 0.8),
            "top_p": float(self.top_p or getattr(task, "top_p", None) or 0.95),
        }

    def generates(self, index: int) -> bool:
        """Is item ``index`` (its position in the task's order) generated and scored?"""
        return self.generate and (self.generate_limit is None or index < self.generate_limit)

    def prompting(self, task) -> str | None:
        """How the prompts were rendered, in words (recorded in ``meta.json`` and shown by reports)."""
        if self.prompt_format is not None and self.prompt_format.applies_to(task):
            return self.prompt_format.describe()
        described = task.describe() if hasattr(task, "describe") else {}
        return getattr(task, "prompting", None) or described.get("prompt_style")

    def as_dict(self, task) -> dict:
        """The settings as stored in ``meta.json`` (the resume key)."""
        described = task.describe() if hasattr(task, "describe") else {}
        out = {
            "task": task_name(task),
            "limit": self.limit,
            "max_new_tokens": self.resolved_max_new_tokens(task),
            "generate": self.generate,
            "samples": self.resolved_samples(task),
            **self.sampling(task),
            "seed": self.seed,
            "handoff_tokens": self.handoff_tokens,
            "stop": stop_setting(task),
            "decode_path": "SharedPrefillEngine (every mode)" if self.engine else "reference (ccft.generate)",
            "prompting": self.prompting(task),
            "task_settings": described or None,
        }
        if self.generate_limit is not None:  # only when set: folders written before the field still resume
            out["generate_limit"] = self.generate_limit
        if self.cache_format is not None:  # likewise
            out["cache_format"] = self.cache_format
        if self.engine and self.block_weights not in (None, "off"):  # likewise (folders without it used fp32)
            out["block_weights"] = self.block_weights
        return out


@dataclass
class ModeSpec:
    """One mode to run: its name and the decoder it needs (None for ``base``)."""

    mode: str
    decoder: Decoder | None = None
    decoder_path: str | None = None

    def cache_format(self, override: str | None = None) -> str:
        """The format this mode reads C_base in: ``native`` for the own-prefill modes; else ``override`` (an
        ``EvalSettings.cache_format``) or the decoder's own."""
        if not get_mode(self.mode).shared_prefill:
            return "native"
        return override or getattr(self.decoder, "cache_format", "native") or "native"

    def describe(self) -> dict:
        d = self.decoder
        depth = getattr(d, "share_from_layer", 0) if d is not None else 0
        fmt = getattr(d, "cache_format", "native") if d is not None else "native"
        return {
            "mode": self.mode,
            "decoder": self.decoder_path,
            "method": None if d is None else d.method,
            "kind": None if d is None else d.kind,
            "decoder_fingerprint": None if d is None else d.meta.get("base_fingerprint"),
            # the sharing depth (issue 35), only when set: records written before it still resume
            **({"share_from_layer": depth} if depth else {}),
            # the C_base format it was trained on (issue 35), likewise only when not native
            **({"cache_format": fmt} if fmt != "native" else {}),
        }


def mode_specs(
    modes: Sequence[str], decoders: Mapping[str, Decoder], paths: Mapping[str, str] | None = None
) -> list[ModeSpec]:
    """``ModeSpec`` per mode, each with the decoder ``ccft.core.modes.decoder_for_mode`` picks.

    Args:
        decoders: ``{method: Decoder}`` (``"ccft"`` and/or ``"full-ft"``); paths: ``{method: folder}``.
    Raises:
        ConfigError: an unknown mode, a mode whose decoder is missing or was trained with the other method.
    """
    specs = []
    for mode in modes:
        m = get_mode(mode)
        dec = decoder_for_mode(mode, decoders)
        check_mode(mode, dec)
        specs.append(ModeSpec(mode, dec, (paths or {}).get(m.decoder_method) if m.needs_decoder else None))
    return specs


def default_modes(methods: Iterable[str]) -> list[str]:
    """Every mode (in ``MODES`` order) whose decoder method is among ``methods`` (``base`` always)."""
    have = set(methods)
    return [m for m in MODES if not get_mode(m).needs_decoder or get_mode(m).decoder_method in have]


def shared_handoff(decoders: Iterable[Decoder]) -> int:
    """The ``handoff_tokens`` all ``decoders`` were trained with (1 without decoders).

    Raises:
        ConfigError: the decoders disagree (their modes cannot share one ``C_base``).
    """
    return resolve_handoff((d.handoff_tokens for d in decoders if d is not None), what="the decoders")
