"""The four evaluation modes: which model prefills the prompt and which model decodes (docs/design.md,
"Modes").

| mode           | prefill (the prompt's KV cache)  | decode             | role               |
|----------------|----------------------------------|--------------------|--------------------|
| ``base``       | the base model, its own          | the base model     | starting point     |
| ``full-ft``    | the Full-FT decoder, its own     | the Full-FT decoder| accuracy reference |
| ``naive``      | the base model (``C_base``)      | the Full-FT decoder| failure reference  |
| ``prefillshare``| the base model (``C_base``)     | the CCFT decoder   | the method         |

Every path that runs a mode (reference generation, teacher-forced scoring, the engine-backed eval
runner, the lm-eval model) asks this module; nothing else spells the table out. PrefillShare is
arXiv 2602.12029, §3 (cache-conditioned fine-tuning).
"""

from __future__ import annotations

from dataclasses import dataclass

from ccft.core.errors import ConfigError

MODES = ("base", "full-ft", "naive", "prefillshare")
REFERENCE_MODE = "full-ft"


@dataclass(frozen=True)
class Mode:
    """One row of the table above.

    Attributes:
        name: the mode's name.
        shared_prefill: the decoder reads ``C_base`` (the base prefilled the prompt) instead of its own
            prefill.
        decoder_method: the training method the decoder must have (``None``: no decoder, the base decodes).
        note: one line for reports.
    """

    name: str
    shared_prefill: bool
    decoder_method: str | None
    note: str

    @property
    def needs_decoder(self) -> bool:
        return self.decoder_method is not None


_TABLE = {
    "base": Mode("base", False, None, "frozen base, own prefill"),
    "full-ft": Mode("full-ft", False, "full-ft", "Full-FT decoder, own prefill (reference)"),
    "naive": Mode("naive", True, "full-ft", "Full-FT decoder on the base's prefill (C_base)"),
    "prefillshare": Mode("prefillshare", True, "ccft", "CCFT decoder on the base's prefill (C_base)"),
}


def get_mode(name: str) -> Mode:
    """The ``Mode`` called ``name``. Raises ConfigError naming the valid modes."""
    try:
        return _TABLE[name]
    except KeyError:
        raise ConfigError(f"mode={name!r}; use one of {', '.join(MODES)}") from None


def check_mode(mode: str, decoder) -> Mode:
    """The ``Mode`` for ``mode`` after checking that ``decoder`` (a ``ccft.Decoder`` or None) fits it.

    Raises:
        ConfigError: unknown mode, a missing decoder, or a decoder trained with the other method
            (a CCFT decoder is run as ``prefillshare``; a Full-FT decoder as ``full-ft`` or ``naive``).
    """
    m = get_mode(mode)
    if not m.needs_decoder:
        return m
    if decoder is None:
        raise ConfigError(f"mode={mode!r} needs a decoder (--decoder PATH)")
    method = getattr(decoder, "method", None)
    if method is not None and method != m.decoder_method:
        raise ConfigError(
            f"mode={mode!r} needs a decoder trained with method={m.decoder_method!r}, but this "
            f"decoder was trained with method={method!r}; use mode="
            f"{'prefillshare' if method == 'ccft' else 'full-ft or naive'}"
        )
    return m


def decoder_for_mode(mode: str, decoders: dict):
    """Pick the decoder a mode runs from ``{"ccft": Decoder, "full-ft": Decoder}`` (None for ``base``).

    Raises ConfigError when the needed decoder is missing."""
    m = get_mode(mode)
    if not m.needs_decoder:
        return None
    if decoders.get(m.decoder_method) is None:
        raise ConfigError(f"mode={mode!r} needs a {m.decoder_method} decoder")
    return decoders[m.decoder_method]
