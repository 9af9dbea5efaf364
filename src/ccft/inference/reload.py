"""Hot reload of a LoRA decoder: new adapter weights from a decoder folder, swapped in place.

``SharedPrefillEngine.reload_decoder(name, path)`` is built on the two steps here:

1. ``stage_reload`` reads and validates the folder without touching the live decoder: ``ccft.json``
   (a LoRA decoder of this base, same ``handoff_tokens``), ``adapter_config.json`` (the fields that
   set the adapter's shapes and scaling equal the live adapter's), the tokenizer when the folder
   has one, and ``adapter_model.safetensors`` (every adapted projection of the live adapter, same
   shapes, finite values, nothing else). Any mismatch raises before a weight is written, with the
   field and the fix in the message.
2. ``apply_reload`` copies the staged tensors into the live ``lora_A`` / ``lora_B`` parameters in
   place (``Tensor.copy_``: same storage, so the engine's lanes, a static runner's captured step and
   the decoder's PEFT forward all read the new weights). The copy bumps the parameters' version
   counters, so the decoder's producer key changes (``lanes``): K/V it wrote with its old weights
   (no-share prefills, prefix-store blocks) is never read again.

A reload is meant to run between two engine steps (``ccft.serving.Scheduler.reload_decoder`` does
it at a step boundary). Requests of that decoder already decoding go on with the new weights from
the next step.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ccft.core.errors import ConfigError, FingerprintMismatchError, IncompatibleModelError
from ccft.core.fingerprint import tokenizer_digest
from ccft.inference.lanes import DecoderEntry

#: ``adapter_config.json`` fields that set the adapter's shapes and scaling; a reload keeps them
SHAPE_FIELDS = (
    "r",
    "lora_alpha",
    "use_rslora",
    "target_modules",
    "rank_pattern",
    "alpha_pattern",
    "use_dora",
    "lora_bias",
    "layers_to_transform",
    "modules_to_save",
    "bias",
    "alora_invocation_tokens",
)
#: the adapter file a reload reads (PEFT's default format)
ADAPTER_FILE = "adapter_model.safetensors"

_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


@dataclass
class StagedReload:
    """Validated new weights of one LoRA decoder, not yet applied.

    Attributes:
        name: the decoder.  path: the folder they were read from.
        tensors: ``(live parameter, new values)`` pairs, one per ``lora_A`` / ``lora_B`` of the adapter.
    """

    name: str
    path: Path
    tensors: list[tuple[torch.Tensor, torch.Tensor]]


def _refuse(name: str, path: Path, what: str, fix: str) -> ConfigError:
    return ConfigError(f"reload of decoder {name!r} from {path}: {what}; {fix}")


def _norm(value):
    """A config value comparable across JSON round trips (lists of modules as sorted lists)."""
    if isinstance(value, (set, tuple, list)):
        return sorted(str(v) for v in value)
    if isinstance(value, dict):
        return {str(k): _norm(v) for k, v in sorted(value.items())}
    return value


def stage_reload(entry: DecoderEntry, base, path: str | Path, tokenizer=None) -> StagedReload:
    """Read and check the decoder folder ``path`` as new weights for the LoRA decoder ``entry``.

    Args:
        entry: the live decoder (``SharedPrefillEngine.decoders[name]``).
        base: the engine's ``ccft.Base``.  tokenizer: the base tokenizer (compared with the folder's).
    Returns:
        the ``StagedReload`` (new tensors in memory, on the live parameters' device and dtype).
    Raises:
        ConfigError: ``entry`` is the base or a full-weight decoder; ``path`` is not a LoRA decoder
            folder; its ``handoff_tokens`` or a shape field of ``adapter_config.json`` differs from
            the live adapter's; its sharing depth ``share_from_layer`` differs from the served decoder's (the
            own prefix K/V the engine keeps for it are of that depth) or its ``cache_format`` from the served
            decoder's (it learned another cache); its adapter
            file is missing, unreadable, lacks or adds a tensor, has
            another shape or holds non-finite values. The message names the field and the fix.
        FingerprintMismatchError: the folder was trained on another base.
        IncompatibleModelError: the folder's tokenizer differs from the base's.
    """
    from ccft.core.checkpoint import read_meta

    name, path = entry.name, Path(path)
    if entry.decoder is None or entry.adapter_index is None:
        kind = "the base model" if entry.decoder is None else "a full-weight decoder"
        raise ConfigError(
            f"reload of {name!r}: it is {kind}; only LoRA decoders are reloaded in place "
            "(restart ccft serve with --decoder NAME=PATH to serve other weights)"
        )
    if not path.is_dir():
        raise _refuse(
            name, path, "no such folder", "pass the folder of a saved LoRA decoder (ccft.json inside)"
        )
    meta = read_meta(path)
    want = meta.get("base_fingerprint")
    if want and want != base.fingerprint:
        raise FingerprintMismatchError(
            f"reload of decoder {name!r} from {path}: 'base_fingerprint' is {want} but this engine's base is "
            f"{base.fingerprint} ({base.name}); reload a decoder trained on this base"
        )
    if (meta.get("decoder_kind") or "lora") != "lora" or not (path / "adapter_config.json").is_file():
        raise _refuse(
            name,
            path,
            f"'decoder_kind' is {meta.get('decoder_kind')!r} (no adapter_config.json)",
            "reload needs a LoRA decoder folder",
        )
    k_new, k_live = int(meta.get("handoff_tokens", 1)), entry.decoder.handoff_tokens
    if k_new != k_live:
        raise _refuse(
            name,
            path,
            f"'handoff_tokens' is {k_new} but the served decoder has {k_live}",
            "reload a decoder trained with the same handoff_tokens, or serve it under a new name",
        )
    m_new, m_live = int(meta.get("share_from_layer") or 0), entry.depth
    if m_new != m_live:
        raise _refuse(
            name,
            path,
            f"'share_from_layer' is {m_new} but the served decoder has {m_live}",
            "reload a decoder trained at the same sharing depth, or serve it under a new name",
        )
    f_new, f_live = meta.get("cache_format") or "native", entry.decoder.cache_format or "native"
    if f_new != f_live:
        raise _refuse(
            name,
            path,
            f"'cache_format' is {f_new} but the served decoder was trained on {f_live}",
            "reload a decoder trained on the same cache format, or serve it under a new name",
        )
    if tokenizer is not None and (path / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        if tokenizer_digest(AutoTokenizer.from_pretrained(str(path))) != tokenizer_digest(tokenizer):
            raise IncompatibleModelError(
                f"reload of decoder {name!r} from {path}: its tokenizer differs from the base's; "
                "a decoder must read the base's token ids"
            )
    try:
        new_cfg = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        raise _refuse(
            name, path, f"adapter_config.json is unreadable ({e})", "save the decoder again"
        ) from None
    adapter_name = entry.decoder.meta.get("adapter_name", "default")
    live_cfg = entry.decoder.model.peft_config[adapter_name].to_dict()
    for field in SHAPE_FIELDS:
        if _norm(new_cfg.get(field)) != _norm(live_cfg.get(field)):
            raise _refuse(
                name,
                path,
                f"adapter_config.json field {field!r} is {new_cfg.get(field)!r} but the served adapter has "
                f"{live_cfg.get(field)!r}",
                "a reload swaps weights of the same shape; serve this decoder under a new name instead",
            )
    new = _read_tensors(name, path)
    adapter = entry.lane.weights.adapters[entry.adapter_index]
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i, layer in enumerate(adapter.layers):
        for proj, lw in sorted(layer.items()):
            for which, live in (("A", lw.a), ("B", lw.b)):
                t = new.pop((i, proj, which), None)
                if t is None:
                    raise _refuse(
                        name,
                        path,
                        f"{ADAPTER_FILE} has no lora_{which} for layer {i} {proj}",
                        "save the complete adapter again",
                    )
                if tuple(t.shape) != tuple(live.shape):
                    raise _refuse(
                        name,
                        path,
                        f"lora_{which} of layer {i} {proj} has shape {tuple(t.shape)}, the served one "
                        f"{tuple(live.shape)}",
                        "a reload swaps weights of the same shape; serve it under a new name",
                    )
                t = t.to(device=live.device, dtype=live.dtype)
                if not bool(torch.isfinite(t).all()):
                    raise _refuse(
                        name,
                        path,
                        f"lora_{which} of layer {i} {proj} holds NaN or infinite values",
                        "the checkpoint is damaged; save it again",
                    )
                pairs.append((live, t))
    if new:
        (i, proj, which), *_ = sorted(new)
        raise _refuse(
            name,
            path,
            f"{ADAPTER_FILE} adapts layer {i} {proj} (lora_{which}), which the served adapter does not",
            "serve it under a new name",
        )
    return StagedReload(name, path, pairs)


def _read_tensors(name: str, path: Path) -> dict[tuple[int, str, str], torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    f = path / ADAPTER_FILE
    if not f.is_file():
        raise _refuse(name, path, f"{ADAPTER_FILE} missing", "save the decoder with ccft.save_decoder")
    try:
        raw = load_file(str(f))
    except (OSError, SafetensorError, ValueError) as e:
        raise _refuse(name, path, f"{ADAPTER_FILE} is unreadable ({e})", "save the decoder again") from None
    out: dict[tuple[int, str, str], torch.Tensor] = {}
    for key, t in raw.items():
        m = _KEY.search(key)
        if m is None:
            raise _refuse(
                name,
                path,
                f"{ADAPTER_FILE} holds {key!r}, which is not a LoRA A/B weight of a projection",
                "reload plain LoRA adapters only",
            )
        out[(int(m.group(1)), m.group(2), m.group(3))] = t
    return out


def apply_reload(staged: StagedReload) -> None:
    """Copy the staged tensors into the live adapter parameters in place (between engine steps)."""
    with torch.no_grad():
        for live, new in staged.tensors:
            live.copy_(new)


__all__ = ["StagedReload", "stage_reload", "apply_reload", "SHAPE_FIELDS", "ADAPTER_FILE"]
