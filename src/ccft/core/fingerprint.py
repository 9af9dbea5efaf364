"""Base fingerprint and base/decoder compatibility checks (docs/design.md, "Terms" and K5).

The fingerprint is a SHA-256 over three parts, each hashed separately:
  * the model config, minus bookkeeping keys (dtype, transformers version, name, quantisation marker);
  * the tokenizer: vocabulary, special tokens and chat template;
  * the stored weights: the bytes of the weight files in the folder, so the fingerprint does not
    depend on the dtype the model is loaded in (bf16 or fp32 loads of one folder agree).
Models with no local folder (hub ids, models built in memory) hash their parameters as loaded, in
fp32 — documented, since a bf16 load of fp32 weights then fingerprints differently.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ccft.core.errors import IncompatibleModelError

_VOLATILE_CONFIG_KEYS = {
    "dtype",
    "torch_dtype",
    "transformers_version",
    "_name_or_path",
    "name_or_path",
    "quantization_config",
    "use_cache",
    "architectures",
    "_attn_implementation",
    "_attn_implementation_autoset",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "_commit_hash",
    "pad_token_id",
}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def config_digest(config) -> str:
    """SHA-256 of a config (object or dict) without dtype and bookkeeping keys."""
    d = config if isinstance(config, dict) else config.to_dict()
    d = {k: v for k, v in d.items() if k not in _VOLATILE_CONFIG_KEYS}
    return _sha(json.dumps(d, sort_keys=True, default=str).encode())


def tokenizer_digest(tokenizer) -> str:
    """SHA-256 of a tokenizer's vocabulary, special tokens and chat template."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    blob = json.dumps(
        {"vocab": vocab, "special": special, "chat_template": getattr(tokenizer, "chat_template", None)},
        sort_keys=True,
        default=str,
    )
    return _sha(blob.encode())


def weights_digest_files(folder: str | Path) -> str | None:
    """SHA-256 over the weight files of ``folder`` (name + bytes, sorted by name); None if it has none."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    if not files:
        return None
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def weights_digest_module(model: torch.nn.Module) -> str:
    """SHA-256 over a module's parameters and buffers cast to fp32 (for models with no folder)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def _combine(config: str, tokenizer: str, weights: str) -> str:
    return "ccft1-" + _sha(f"{config}:{tokenizer}:{weights}".encode())[:32]


def fingerprint_folder(path: str | Path, tokenizer, model: torch.nn.Module | None = None) -> str:
    """Fingerprint of the base stored at ``path`` (local folder) — or of ``model`` when no folder is at
    hand."""
    from transformers import AutoConfig

    folder = Path(path)
    config = (
        AutoConfig.from_pretrained(str(path))
        if (folder / "config.json").is_file() or model is None
        else model.config
    )
    weights = weights_digest_files(folder)
    if weights is None:
        if model is None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(path))
        weights = weights_digest_module(model)
    return _combine(config_digest(config), tokenizer_digest(tokenizer), weights)


def fingerprint_model(model: torch.nn.Module, tokenizer) -> str:
    """Fingerprint of an in-memory model: its folder's files when ``name_or_path`` is a saved folder, else its
    weights."""
    folder = Path(getattr(model.config, "_name_or_path", "") or "")
    if str(folder) and weights_digest_files(folder) is not None:
        return fingerprint_folder(folder, tokenizer)
    return _combine(config_digest(model.config), tokenizer_digest(tokenizer), weights_digest_module(model))


def _head_dim(cfg) -> int:
    hd = getattr(cfg, "head_dim", None)
    return int(hd) if hd else cfg.hidden_size // cfg.num_attention_heads


def _rope(cfg) -> str:
    rope = getattr(cfg, "rope_parameters", None) or {
        "rope_theta": getattr(cfg, "rope_theta", None),
        "rope_scaling": getattr(cfg, "rope_scaling", None),
    }
    return json.dumps(rope, sort_keys=True, default=str)


def check_compatible(base_config, decoder_config, base_tokenizer=None, decoder_tokenizer=None) -> None:
    """Raise IncompatibleModelError unless a decoder can read the base's KV cache.

    Checked before any compute: layer count, KV heads, head dim, RoPE settings, and (when both are
    given) the tokenizer. The message names every mismatching field and both values.
    """
    problems = []
    for label, get in (
        ("num_hidden_layers", lambda c: c.num_hidden_layers),
        ("num_key_value_heads", lambda c: getattr(c, "num_key_value_heads", None) or c.num_attention_heads),
        ("head_dim", _head_dim),
        ("rope", _rope),
    ):
        b, d = get(base_config), get(decoder_config)
        if b != d:
            problems.append(f"{label}: base={b} decoder={d}")
    if base_tokenizer is not None and decoder_tokenizer is not None:
        if tokenizer_digest(base_tokenizer) != tokenizer_digest(decoder_tokenizer):
            problems.append("tokenizer: vocabulary, special tokens or chat template differ")
    if problems:
        raise IncompatibleModelError(
            "the decoder cannot decode on this base's KV cache (" + "; ".join(problems) + "). "
            "Initialise the decoder from this base model, or pass the base it was trained on."
        )
