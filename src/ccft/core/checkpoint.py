"""Decoder folders: an HF (full weights) or PEFT (LoRA adapter) folder plus ``ccft.json``.

``ccft.json`` records what a reader needs to trust the folder: the training ``method``, the decoder
``kind``, the base (name, path, fingerprint), ``handoff_tokens``, the sharing depth ``share_from_layer``
(issue 35; absent in older folders: 0), the C_base format ``cache_format`` it was trained on (issue 35;
``ccft.core.compact``; absent in older folders: ``native``), the data and the recipe. Folders
are written atomically: into a temporary sibling, then renamed into place, so a crash never leaves a
half-written decoder where a complete one was.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from ccft.core.compact import check_cache_format
from ccft.core.decoder import Decoder, check_second_adapter, check_share_from_layer, num_layers
from ccft.core.errors import ConfigError, FingerprintMismatchError
from ccft.core.fingerprint import check_compatible
from ccft.core.io import atomic_write_dir, atomic_write_text  # noqa: F401 - atomic_write_text re-exported
from ccft.core.models import Base, load_base
from ccft.core.version import __version__

META_FILE = "ccft.json"
#: the recipe a run folder's checkpoints are being trained with (``ccft.train.run`` writes it when training
#: starts)
RECIPE_STAMP = "ccft-recipe.json"


def decoder_meta(decoder: Decoder, **extra: Any) -> dict:
    """The ``ccft.json`` dict for a decoder."""
    meta = {
        "ccft_version": __version__,
        "method": decoder.method,
        "decoder_kind": decoder.kind,
        "base": {
            "name": decoder.base.name,
            "path": decoder.base.path,
            "fingerprint": decoder.base.fingerprint,
        },
        "base_fingerprint": decoder.base.fingerprint,
        "handoff_tokens": decoder.handoff_tokens,
        "share_from_layer": decoder.share_from_layer,
        "cache_format": decoder.cache_format,
        "dtype": str(decoder.dtype).replace("torch.", ""),
    }
    meta.update({k: v for k, v in decoder.meta.items() if k not in meta})
    meta.update(extra)
    return meta


def save_decoder(
    decoder: Decoder, path: str | Path, *, state_dict: dict | None = None, **extra_meta: Any
) -> Path:
    """Write ``decoder`` into folder ``path``: weights (HF) or adapter (PEFT), tokenizer, then ``ccft.json``.

    Files are staged in a temporary sub-folder and moved in one by one; ``ccft.json`` is removed
    first and written last, so a folder with ``ccft.json`` is always complete (``load_decoder``
    refuses one without it). Other contents of ``path`` (e.g. ``checkpoint-N/``) are kept.
    """
    meta = decoder_meta(decoder, **extra_meta)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".save-", dir=path))
    try:
        if decoder.kind == "lora":
            name = decoder.meta.get("adapter_name", "default")
            decoder.model.save_pretrained(
                str(tmp),
                selected_adapters=[name],
                **({"state_dict": state_dict} if state_dict is not None else {}),
            )
            if name != "default" and (tmp / name).is_dir():  # PEFT nests non-default adapters
                for p in (tmp / name).iterdir():
                    os.replace(p, tmp / p.name)
                (tmp / name).rmdir()
        else:
            # state_dict: the gathered weights of a partitioned (DeepSpeed ZeRO-3) decoder.
            decoder.model.save_pretrained(
                str(tmp), **({"state_dict": state_dict} if state_dict is not None else {})
            )
        decoder.base.tokenizer.save_pretrained(str(tmp))
        (path / META_FILE).unlink(missing_ok=True)
        for p in sorted(tmp.iterdir()):
            if p.is_file():
                os.replace(p, path / p.name)
        atomic_write_text(path / META_FILE, json.dumps(meta, indent=2, default=str))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def read_meta(path: str | Path) -> dict:
    """``ccft.json`` of a decoder folder.

    Raises:
        ConfigError: ``path`` is a file or has no ``ccft.json``, or ``ccft.json`` is not a UTF-8 JSON object
            (``FILE:LINE:COL`` in the message).
    """
    if Path(path).is_file():
        raise ConfigError(f"{path} is a file; a decoder is a folder (HF or PEFT files plus {META_FILE})")
    f = Path(path) / META_FILE
    if not f.is_file():
        raise ConfigError(
            f"{path} is not a ccft decoder folder ({META_FILE} missing); "
            "train one with `ccft train` or save one with ccft.save_decoder"
        )
    try:
        meta = json.loads(f.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{f}: not UTF-8 text (byte {e.start}); the decoder folder is damaged") from None
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{f}:{e.lineno}:{e.colno}: not valid JSON ({e.msg}); the decoder folder is damaged, "
            "save it again"
        ) from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{f}:1: {META_FILE} holds a JSON object, got {type(meta).__name__}")
    return meta


def load_decoder(
    path: str | Path,
    base: Base | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    adapter_name: str | None = None,
) -> Decoder:
    """Load a decoder folder (HF or PEFT + ``ccft.json``) onto its base.

    Args:
        base: the ``ccft.Base`` to attach to; default: load the base named in ``ccft.json``.
        dtype: load dtype (default: the one recorded, else float32).
        adapter_name: name for a LoRA adapter (default: the folder name), so several decoders share one base.
    Raises:
        ConfigError: not a decoder folder (or its ``ccft.json`` names no base, when ``base`` is None); a LoRA
            decoder whose ``modules_to_save`` holds the tied embedding, onto a base that already carries
            adapters (PEFT would untie its ``lm_head``; load it onto a base of its own).
        FingerprintMismatchError: ``base`` is not the base the decoder was trained on.
        IncompatibleModelError: a full-weight decoder whose shape cannot read the base's KV.
    """
    path = Path(path)
    meta = read_meta(path)
    dtype = dtype or meta.get("dtype") or "float32"
    if base is None:
        b = meta.get("base") if isinstance(meta.get("base"), dict) else {}
        if not (b.get("path") or b.get("name")):
            raise ConfigError(
                f"{path / META_FILE}: no `base` (the base model's name or path): the decoder folder is "
                "damaged; save it again, or pass the base it was trained on (base=)"
            )
        base = load_base(b.get("path") or b.get("name"), dtype=dtype)
    want = meta.get("base_fingerprint")
    if want and want != base.fingerprint:
        raise FingerprintMismatchError(
            f"decoder {path} was trained on base {want} ({meta.get('base', {}).get('name')}) but the base "
            f"given is {base.fingerprint} ({base.name}); load the decoder with the base it was trained on"
        )
    try:
        depth = check_share_from_layer(meta.get("share_from_layer", 0), num_layers(base.model))
        cache_format = check_cache_format(meta.get("cache_format", "native"))
    except ConfigError as e:
        raise ConfigError(f"{path / META_FILE}: {e}; the decoder folder is damaged, save it again") from None
    kind = meta.get("decoder_kind") or ("lora" if (path / "adapter_config.json").is_file() else "full")
    if kind == "lora":
        from peft import PeftModel

        name = adapter_name or path.name.replace(".", "_") or "default"
        try:
            saved = json.loads((path / "adapter_config.json").read_text()).get("modules_to_save")
        except (OSError, ValueError):
            saved = None
        check_second_adapter(base, saved, f"decoder {path}")
        if base.adapter_hosts:
            host = base.adapter_hosts[0]
            if name in host.peft_config:  # loading would silently overwrite another decoder's adapter (K1)
                if adapter_name:
                    raise ConfigError(
                        f"adapter_name={adapter_name!r} is already used by another decoder on this "
                        "base; pass a different adapter_name"
                    )
                name = next(f"{name}_{i}" for i in range(2, 10**6) if f"{name}_{i}" not in host.peft_config)
            host.load_adapter(str(path), adapter_name=name, is_trainable=False)
            model = host
        else:
            model = PeftModel.from_pretrained(base.model, str(path), adapter_name=name, is_trainable=False)
            base.adapter_hosts.append(model)
        model.set_adapter(name)
        model.eval()
        meta = dict(meta, adapter_name=name)
    else:
        from transformers import AutoModelForCausalLM

        from ccft.core.models import parse_dtype

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=parse_dtype(dtype)).to(base.device)
        model.eval()
        model.requires_grad_(False)
    check_compatible(base.config, model.config)
    return Decoder(
        model=model,
        base=base,
        kind=kind,
        method=meta.get("method"),
        handoff_tokens=int(meta.get("handoff_tokens", 1)),
        meta=meta,
        share_from_layer=depth,
        cache_format=cache_format,
    )
