"""Decode modules θ_i and the reference forward on C_base (docs/design.md, "Terms" and "Invariants").

A decoder is a full-weight copy of the base or a LoRA adapter (PEFT) on the base's single weight
copy. ``decoder_forward`` is the two-pass reference every fast path is tested against: the base's
K/V for ``prompt[:n-k]`` (``C_base``) is fed as a read-only cache, and the decoder processes the k
handoff tokens and the response at positions that continue each row's real prompt length.

Shape notation: b batch, p prefix length, t tail length (k handoff tokens + response), v vocab.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ccft.core.cache import BaseCache, allow_readonly_cache_under_checkpointing, cache_kwarg
from ccft.core.compact import check_cache_format
from ccft.core.deprecation import moved_name_getattr
from ccft.core.errors import ConfigError, FingerprintMismatchError
from ccft.core.fingerprint import check_compatible


def resolve_handoff(handoffs, requested: int | None = None, *, what: str = "the decoders") -> int:
    """The handoff ``k`` one prefill uses when the decoders trained with ``handoffs`` read it (docs/design.md,
    "Terms": the decoder recomputes the last k prompt tokens). The one rule every path asks — the engine,
    the scheduler, the eval runner, the sweep, reference generation.

    Args:
        handoffs: each reading decoder's ``handoff_tokens`` (ints; None entries, e.g. the base, are skipped).
        requested: an explicit k; it must equal every decoder's k.
        what: names the decoders in errors (e.g. ``"decoders ['math', 'code']"``).

    Returns:
        ``requested``, else the k every decoder shares, else 1 (no decoder: the base's default).

    Raises:
        ConfigError: the decoders disagree (one ``C_base`` cannot serve both: the fix is one prefill per k,
            i.e. separate runs, or decoders trained with one k), ``requested`` differs from theirs, or k < 1.
    """
    ks = sorted({int(k) for k in handoffs if k is not None})
    if len(ks) > 1:
        raise ConfigError(
            f"{what} were trained with different handoff_tokens {ks}: one prefill cannot serve them; "
            "use decoders trained with one handoff_tokens, or separate runs / prefills per value"
        )
    if requested is not None and ks and int(requested) != ks[0]:
        raise ConfigError(
            f"handoff_tokens={requested} was asked for, but {what} were trained with {ks[0]}; "
            f"prefill with handoff_tokens={ks[0]}"
        )
    k = int(requested) if requested is not None else (ks[0] if ks else 1)
    if k < 1:
        raise ConfigError(f"handoff_tokens={k}; it must be ≥ 1")
    return k


def num_layers(model) -> int:
    """L, the transformer layers of ``model`` (a ``Decoder``, ``ccft.Base``, any wrapper or a config)."""
    if isinstance(model, Decoder):
        model = model.model
    config = model if hasattr(model, "num_hidden_layers") else getattr(model, "config", None)
    if config is None:
        config = unwrap_pretrained(model).config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    return int(config.num_hidden_layers)


def check_share_from_layer(m, layers: int, *, where: str = "share_from_layer") -> int:
    """``m`` as an int after checking ``0 ≤ m ≤ layers`` (docs/training.md, ``share_from_layer``).

    Raises:
        ConfigError: naming ``where`` (the recipe key by default), the range and what the ends mean.
    """
    if isinstance(m, bool) or not isinstance(m, int):
        raise ConfigError(f"{where}={m!r}: give an integer layer index 0..{layers} (0: PrefillShare)")
    if not 0 <= m <= layers:
        raise ConfigError(
            f"{where}={m}: it must be in 0..{layers} for this {layers}-layer base (0: every layer reads "
            f"C_base, PrefillShare; {layers}: the decoder's own prefill in every layer); set {where} to a "
            "value in that range"
        )
    return m


def reader_dtype(model) -> torch.dtype:
    """The dtype ``model`` computes in: the autocast dtype when autocast is on for its device, else the
    dtype of its first parameter (``Decoder.dtype``'s rule; for LoRA the base's, not the adapters')."""
    if isinstance(model, Decoder):
        model = model.model
    param = next(model.parameters())
    if torch.is_autocast_enabled(param.device.type):
        return torch.get_autocast_dtype(param.device.type)
    return param.dtype


def check_cache_reader(
    model, cache: BaseCache, *, fingerprint: str | None = None, allow_self: bool = False
) -> None:
    """Refuse, before any compute, a prefix cache ``model`` must not read (docs/design.md, "C_base" and K5).

    Args:
        model: a ``Decoder`` (its base fingerprint is checked) or a plain module (the fingerprint only when
            ``fingerprint`` is given: a bare module does not know its base).
        cache: the prefix cache it is about to read.
        fingerprint: the reader's base fingerprint; default: ``model.fingerprint`` for a ``Decoder``.
        allow_self: accept a cache a model wrote over its own prompt (``producer != "base"``); default: C_base
            only.
    Raises:
        CacheMutatedError: a tensor of ``cache`` was written in place since it was made.
        ConfigError: a ``Decoder`` trained at sharing depth m > 0 handed plain C_base (producer
            ``"base"``): it would silently run at depth 0 (``ccft.core.depth``).
        FingerprintMismatchError: ``cache`` was computed by another base, in another dtype than the reader
            computes in (``reader_dtype``), or written by a decoder (unless ``allow_self``).
    """
    cache.check_unmodified()
    if isinstance(model, Decoder) and model.share_from_layer and cache.producer == "base":
        m = model.share_from_layer
        raise ConfigError(
            f"this decoder was trained at share_from_layer={m}: it reads its own prompt K/V in layers "
            f"0..{m - 1} and C_base only above; plain C_base would run it at depth 0. Build its prefix with "
            "ccft.core.depth.depth_cache (ccft.generate does), or pass share_from_layer=0 to ccft.generate"
        )
    if fingerprint is None and isinstance(model, Decoder):
        fingerprint = model.fingerprint
    cache.check_reader(
        cache.fingerprint if fingerprint is None else fingerprint, reader_dtype(model), allow_self=allow_self
    )


def check_base_reader(base, decoder: Decoder) -> None:
    """Refuse, before any compute, a decoder that would read C_base computed by ``base`` (K5).

    Raises:
        FingerprintMismatchError: ``decoder`` was conditioned on another base, or computes in another dtype.
    """
    if decoder.fingerprint != base.fingerprint:
        raise FingerprintMismatchError(
            f"the decoder was conditioned on base {decoder.fingerprint} but C_base would be computed by base "
            f"{base.fingerprint}; pass the decoder's base model"
        )
    if reader_dtype(decoder) != base.dtype:
        raise FingerprintMismatchError(
            f"C_base would be computed in {base.dtype} but the decoder computes in {reader_dtype(decoder)}; "
            "load the base and the decoder in one dtype"
        )


def decoder_forward(
    model,
    cache: BaseCache,
    tail_ids: torch.Tensor,
    tail_mask: torch.Tensor | None = None,
    *,
    check: bool = True,
    fingerprint: str | None = None,
    allow_self: bool = False,
    logits_to_keep: int | torch.Tensor = 0,
) -> torch.Tensor:
    """Logits of a decoder over the handoff tokens + response, conditioned on a prefix cache.

    The CCFT forward (PrefillShare, arXiv 2602.12029, §3): the decoder reads ``C_base(prompt[:n-k])`` and
    computes ``prompt[n-k:] + response``. The cache is checked before any compute (``check_cache_reader``).

    Args:
        model: the decoder (``PreTrainedModel`` or ``PeftModel``), or ``Decoder``.
        cache: ``C_base`` for the same rows (``ccft.compute_base_cache``).
        tail_ids: ``(b, t)`` = ``prompt[n-k:] + response (+ EOS)``, right-padded.
        tail_mask: ``(b, t)``, 1 on real tokens (default: all ones).
        check: also re-check after the forward that nothing wrote into the cache.
        fingerprint: the reader's base fingerprint when ``model`` is a bare module (a ``Decoder`` knows its
            own).
        allow_self: read a cache a model wrote over its own prompt (studies of sharing ratios; not C_base).
        logits_to_keep: the tail positions the LM head projects, as transformers takes it (0: all; an empty
            index tensor: none, for a loss computed from the final hidden states, ``ccft.train.loss``).
    Returns:
        logits ``(b, t, v)`` (t: the kept positions): position j predicts tail token j+1. Positions continue
        each row's real prompt length: row i's first tail token is at position ``cache.lengths[i]``.
    Raises:
        FingerprintMismatchError: the cache comes from another base, another dtype, or a decoder (K5).
        CacheMutatedError: C_base was written in place (before or during the forward; docs/design.md, K1).
    """
    check_cache_reader(model, cache, fingerprint=fingerprint, allow_self=allow_self)
    if isinstance(model, Decoder):
        model = model.activate()
    device = tail_ids.device
    if tail_mask is None:
        tail_mask = torch.ones_like(tail_ids)
    t = tail_ids.shape[1]
    positions = cache.lengths.to(device)[:, None] + torch.arange(t, device=device)[None, :]
    mask = torch.cat([cache.attention_mask.to(device), tail_mask], dim=1)
    allow_readonly_cache_under_checkpointing(model)
    kwargs = {cache_kwarg(model): cache.as_prefix_cache()}
    if not isinstance(logits_to_keep, int) or logits_to_keep != 0:
        kwargs["logits_to_keep"] = logits_to_keep
    out = model(input_ids=tail_ids, attention_mask=mask, position_ids=positions, use_cache=False, **kwargs)
    if check:
        cache.check_unmodified()
    return out.logits


def full_forward(
    model,
    prefix_ids: torch.Tensor,
    prefix_mask: torch.Tensor,
    tail_ids: torch.Tensor,
    tail_mask: torch.Tensor | None = None,
    *,
    logits_to_keep: int | torch.Tensor | None = None,
    packed: bool = False,
) -> torch.Tensor:
    """Logits of a model prefilling its own prompt (Full-FT, base): one forward over prefix + tail.

    Same layout and positions as ``decoder_forward``; returns only the tail's logits ``(b, t, v)``.
    ``logits_to_keep``: default the t tail positions; an empty index tensor projects none (``(b, 0, v)``).
    ``packed``: run the rows' real tokens as one sequence ``(1, Σ n_r)`` with each row's positions restarting
    at 0 (the padding-free layout of TRL's ``padding_free``; transformers builds the block-diagonal causal
    mask from the positions), then put the body's output back in the padded ``(b, p + t, h)`` layout (zeros at
    pads) before the LM head, so callers (and ``ccft.train.loss.capture_final_hidden``) see the same shapes.
    The same function as the padded forward, without computing the pads: equal up to fp32 rounding
    (``tests/train/test_trainer.py``), faster when rows differ in length (docs/training.md, "Full-FT without
    padding"). Check ``padding_free_unsupported(model)`` first: packing relies on the model building its mask
    from the positions.
    """
    if isinstance(model, Decoder):
        model = model.activate()
    if tail_mask is None:
        tail_mask = torch.ones_like(tail_ids)
    ids = torch.cat([prefix_ids, tail_ids], dim=1)
    mask = torch.cat([prefix_mask, tail_mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    # Tail pads (right padding) get positions past the row; they are masked and never supervised.
    positions[:, prefix_ids.shape[1] :] = prefix_mask.sum(-1, keepdim=True) + torch.arange(
        tail_ids.shape[1], device=ids.device
    )
    t = tail_ids.shape[1]
    # Only the tail's logits are needed: skip the vocabulary projection over the prompt.
    keep = t if logits_to_keep is None else logits_to_keep
    if not packed:
        out = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, logits_to_keep=keep
        )
        return out.logits[:, -t:]
    real = mask.bool()
    body = unwrap_pretrained(model).get_decoder()

    def unpack(module, args, output):  # (1, N, h) -> (b, p + t, h), before any other hook sees it
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        full = hidden.new_zeros((*real.shape, hidden.shape[-1])).index_put((real,), hidden[0])
        if hasattr(output, "last_hidden_state"):
            output.last_hidden_state = full
            return output
        return (full, *output[1:])

    handle = body.register_forward_hook(unpack, prepend=True)
    try:
        out = model(
            input_ids=ids[real][None],
            position_ids=positions[real][None],
            use_cache=False,
            logits_to_keep=keep,
        )
    finally:
        handle.remove()
    return out.logits[:, -t:]


#: Model types whose attention masks transformers builds with ``masking_utils.create_causal_mask`` (and
#: ``create_sliding_window_causal_mask`` for sliding-window layers: mistral, phi3, gemma's local layers),
#: which turn positions that restart inside one row into a block-diagonal mask when no 2-D attention mask is
#: given; the RoPE of every family here reads the per-token positions (gemma3: both of its RoPEs).
PADDING_FREE_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "smollm3", "phi3", "gemma2", "gemma3_text"}
)


def padding_free_unsupported(model) -> str | None:
    """Why ``full_forward(packed=True)`` would not equal the padded forward for ``model`` (any wrapper), or
    None.

    Packed rows are kept apart only by their positions, so the model type must build its causal mask from them
    (``PADDING_FREE_MODEL_TYPES``); any other model would let a row attend to the rows packed before it."""
    inner = unwrap_pretrained(model)
    model_type = getattr(getattr(inner, "config", None), "model_type", None)
    if model_type not in PADDING_FREE_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {sorted(PADDING_FREE_MODEL_TYPES)}"
    if not hasattr(inner, "get_decoder"):
        return f"{type(inner).__name__} has no get_decoder() whose output can be unpacked"
    return None


def unwrap_distributed(model) -> torch.nn.Module:
    """The module under accelerate/DDP/DeepSpeed wrappers (a ``PeftModel`` stays one)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):  # DDP, DeepSpeed engine
        model = model.module
    return model


def unwrap_pretrained(model) -> torch.nn.Module:
    """The ``PreTrainedModel`` under accelerate/DDP/DeepSpeed and PEFT wrappers."""
    model = unwrap_distributed(model)
    if hasattr(model, "get_base_model"):  # PeftModel
        model = model.get_base_model()
    return model


@dataclass(eq=False)
class Decoder:
    """A decode module θ_i attached to a base.

    Attributes:
        model: ``PeftModel`` (kind ``lora``) or a full-weight ``PreTrainedModel`` (kind ``full``).
        base: the ``ccft.Base`` it is conditioned on.
        kind: ``"lora"`` or ``"full"``.
        method: ``"ccft"`` (trained on C_base), ``"full-ft"`` (trained on its own prefill) or None
            (untrained).
        handoff_tokens: k used in training; inference uses the same.
        meta: the ``ccft.json`` metadata it was loaded with or will be saved with.
        share_from_layer: the sharing depth m it was trained at (issue 35; docs/design.md, "Terms"): it
            reads its own prompt K/V in layers ``0..m−1`` and C_base in ``m..L−1`` (``ccft.core.depth``);
            0 (default) is PrefillShare, every layer from C_base.
        cache_format: the format of C_base it was trained on (issue 35; ``ccft.core.compact``): ``native``
            (default; C_base as the base computed it) or ``int8`` (the compact C_base). Readers that build its
            prefix (``ccft.generate``, teacher-forced NLL) read C_base in this format unless told otherwise.
    """

    model: torch.nn.Module
    base: Any
    kind: str
    method: str | None = None
    handoff_tokens: int = 1
    meta: dict = field(default_factory=dict)
    share_from_layer: int = 0
    cache_format: str = "native"

    @property
    def fingerprint(self) -> str:
        return self.meta.get("base_fingerprint", self.base.fingerprint)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def parameters(self):
        return self.model.parameters()

    def activate(self) -> torch.nn.Module:
        """Make this decoder's LoRA adapter the active one on the shared host (several decoders share
        one PeftModel); returns the module to call."""
        if self.kind == "lora":
            name = self.meta.get("adapter_name", "default")
            if self.model.active_adapter != name:
                self.model.set_adapter(name)
        return self.model

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)


def tied_modules_to_save(base, modules_to_save) -> list[str]:
    """The entries of a LoRA ``modules_to_save`` that name the base's tied input/output embedding (else
    ``[]``).

    Such an adapter carries its own copy of the shared embedding matrix, which PEFT ties back to ``lm_head``
    only when the adapter is the first one injected into the model (``PeftModel.from_pretrained``)."""
    if not modules_to_save or not getattr(base.model.config, "tie_word_embeddings", False):
        return []
    model = base.model
    embeddings = {
        id(m) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None
    }
    names = [n for n, m in model.named_modules() if id(m) in embeddings]
    return [t for t in modules_to_save if any(n == t or n.endswith("." + t) for n in names)]


def check_second_adapter(base, modules_to_save, what: str) -> None:
    """Refuse a LoRA adapter that saves the tied embedding when ``base`` already hosts adapters.

    PEFT injects a second adapter into the existing host without re-tying ``lm_head`` to the adapter's
    embedding copy: the decoder would come back with an untied ``lm_head`` (logits off by tens, no
    warning). Loaded as the first adapter of a base, the same folder is exact.

    Raises:
        ConfigError: naming the modules and the fix (a base of its own: ``ccft.load_base`` again).
    """
    tied = tied_modules_to_save(base, modules_to_save)
    if tied and base.adapter_hosts:
        raise ConfigError(
            f"{what} saves the tied embedding ({', '.join(tied)} in modules_to_save) and base {base.name} "
            "already carries LoRA adapters: PEFT would load it with an untied lm_head (wrong logits). Load "
            "it onto a base of its own (ccft.load_decoder(path, base=ccft.load_base(...)), a fresh base per "
            "such decoder), or train without modules_to_save on the embedding"
        )


#: ccft's default LoRA targets: every attention and MLP projection (llama, mistral, qwen2/3, gemma names)
DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: fused projections (phi3) -> the separate projections of :data:`DEFAULT_LORA_TARGETS` each one holds
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def default_lora_targets(model) -> list[str]:
    """ccft's default LoRA targets for ``model`` (any wrapper): every attention and MLP projection, by the
    names the model uses. :data:`DEFAULT_LORA_TARGETS`, with the projections a fused module holds replaced
    by it where the model has the fused module and not the separate ones (phi3: ``qkv_proj``, ``o_proj``,
    ``gate_up_proj``, ``down_proj``; the same weights adapted)."""
    leaves = {n.rsplit(".", 1)[-1] for n, _ in unwrap_pretrained(model).named_modules() if n}
    targets = list(DEFAULT_LORA_TARGETS)
    for fused, parts in FUSED_PROJECTIONS.items():
        if fused in leaves and not leaves & set(parts):
            at = targets.index(parts[0])
            targets = [t for t in targets if t not in parts]
            targets.insert(at, fused)
    return targets


def resolve_lora_targets(model, targets=DEFAULT_LORA_TARGETS):
    """The ``target_modules`` a LoRA decoder of ``model`` gets: ``targets`` as given, except that ccft's
    default list (:data:`DEFAULT_LORA_TARGETS`, also ``TrainConfig.lora_target_modules``' default) means
    :func:`default_lora_targets`, the same projections by this model family's names."""
    if isinstance(targets, (list, tuple)) and list(targets) == DEFAULT_LORA_TARGETS:
        return default_lora_targets(model)
    return targets


def make_decoder(
    base,
    kind: str = "lora",
    *,
    lora: dict | None = None,
    method: str | None = None,
    handoff_tokens: int = 1,
    adapter_name: str = "default",
    share_from_layer: int = 0,
    cache_format: str = "native",
) -> Decoder:
    """A new decoder initialised from ``base``.

    Args:
        kind: ``"lora"`` (PEFT adapter on the base's weights; one weight copy) or ``"full"`` (a trainable
            copy of θ_base in its own memory: loaded again from ``base.path`` when that is a stored folder,
            else a deep copy of ``base.model``).
        lora: ``peft.LoraConfig`` fields (``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``,
            ``init_lora_weights``...). Default: r=16, alpha=32, every attention and MLP projection by the
            family's names (``default_lora_targets``: phi3's fused ``qkv_proj`` / ``gate_up_proj``).
        share_from_layer: the sharing depth m, ``0 ≤ m ≤ L`` (``Decoder.share_from_layer``; issue 35).
        cache_format: ``native`` or ``int8`` (``Decoder.cache_format``; ``ccft.core.compact``).
    Raises:
        ConfigError: unknown kind, ``share_from_layer`` outside ``0..L``, an unknown ``cache_format``, or a
            LoRA config whose
            ``modules_to_save`` holds the tied embedding on a
            base that already carries adapters (``check_second_adapter``).
    """
    check_share_from_layer(share_from_layer, num_layers(base.model))
    check_cache_format(cache_format)
    if kind == "full":
        from transformers.integrations import is_deepspeed_zero3_enabled

        zero3 = is_deepspeed_zero3_enabled()
        stored = bool(base.path) and (Path(base.path) / "config.json").is_file()
        if zero3 or stored:
            # Load the stored weights θ_base again (the ones base.fingerprint names) rather than deep-copying
            # base.model: under ZeRO-3 the base is partitioned (zero.Init) and a copy would share its empty
            # shards; otherwise a copy reads every memory-mapped page of the base, which a Full-FT run never
            # touches again (docs/training.md, "Peak memory"), and would carry any adapters PEFT injected into
            # it.
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(base.path, dtype=base.dtype)
            if not zero3:  # ZeRO-3 places its partitions itself
                model = model.to(base.device)
        else:  # a base built in memory (no stored folder)
            model = copy.deepcopy(base.model)
        model.requires_grad_(True)
        model.train()
    elif kind == "lora":
        from peft import LoraConfig, get_peft_model

        cfg = {
            "r": 16,
            "lora_alpha": 32,
            "lora_dropout": 0.0,
            "task_type": "CAUSAL_LM",
        }
        cfg.update(lora or {})
        cfg["target_modules"] = resolve_lora_targets(
            base.model, cfg.get("target_modules", DEFAULT_LORA_TARGETS)
        )
        check_second_adapter(base, cfg.get("modules_to_save"), f"LoRA decoder {adapter_name!r}")
        if base.adapter_hosts:
            host = base.adapter_hosts[0]
            host.add_adapter(adapter_name, LoraConfig(**cfg))
            host.set_adapter(adapter_name)
            model = host
        else:
            model = get_peft_model(base.model, LoraConfig(**cfg), adapter_name=adapter_name)
            base.adapter_hosts.append(model)
    else:
        raise ConfigError(f"decoder kind={kind!r}; use 'lora' or 'full'")
    check_compatible(base.config, model.config)
    meta = {"base_fingerprint": base.fingerprint}
    if kind == "lora":
        meta["adapter_name"] = (
            adapter_name  # generate/save/decoder_forward select this adapter on the shared host
        )
    return Decoder(
        model=model,
        base=base,
        kind=kind,
        method=method,
        handoff_tokens=handoff_tokens,
        meta=meta,
        share_from_layer=share_from_layer,
        cache_format=cache_format,
    )


__getattr__ = moved_name_getattr(__name__)  # 0.1 names: ccft.core.deprecation.MOVED_NAMES
