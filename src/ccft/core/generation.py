"""Reference batched generation for the four modes (docs/design.md, "Modes"; ``ccft.core.modes``).

  * ``base``:         the base model prefills its own prompt and decodes.
  * ``full-ft``:      a Full-FT decoder prefills its own prompt and decodes (the accuracy reference).
  * ``naive``:        a Full-FT decoder decodes on ``C_base`` (the failure reference).
  * ``prefillshare``: a CCFT decoder decodes on ``C_base`` (the method).

Every mode uses the same layout: a prefix cache over ``prompt[:n-k]`` (its own or the base's), then
the decoder recomputes the k handoff tokens and generates. This is the slow, obviously-correct path
that the inference engine is tested against: a ``DynamicCache`` per call, one token per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from tqdm.auto import tqdm

from ccft.core import errors  # the module: ConfigError stays a moved name here (MOVED_NAMES)
from ccft.core.cache import BaseCache, cache_kwarg, compute_base_cache, prefill
from ccft.core.compact import check_cache_format
from ccft.core.decoder import (
    Decoder,
    check_base_reader,
    check_cache_reader,
    check_share_from_layer,
    num_layers,
)
from ccft.core.deprecation import moved_name_getattr
from ccft.core.depth import decoder_prefix, prompt_prefixes
from ccft.core.modes import MODES, check_mode  # noqa: F401 - MODES re-exported
from ccft.core.sampling import SamplingParams, select_tokens
from ccft.core.text import StopMatcher
from ccft.core.tokens import eos_token_ids, pad_token_id


@dataclass
class Generation:
    """One generated completion. ``finish_reason``: ``eos``, ``stop`` (a stop string) or ``length``
    (truncated)."""

    text: str
    token_ids: list[int]
    finish_reason: str

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@torch.no_grad()
def decode_on_cache(
    model,
    tokenizer,
    cache: BaseCache,
    *,
    max_new_tokens: int = 256,
    stop: Sequence[str] | str | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    fingerprint: str | None = None,
    allow_self: bool = True,
) -> list[Generation]:
    """Decode up to ``max_new_tokens`` per row with ``model`` on a prefix cache (one token per step).

    Stop strings and EOS are handled per row; the text is cut before the first stop string.

    Args:
        model: a bare module or a ``Decoder`` (its adapter is activated, its base fingerprint checked).
        cache: the prefix cache ``(b, h, p, d)`` per layer with ``tail_ids (b, k)``.
        fingerprint: the reader's base fingerprint for a bare module (checked when given).
        allow_self: accept a cache a model wrote over its own prompt (the ``base`` / ``full-ft`` modes do).
    Raises:
        FingerprintMismatchError, CacheMutatedError: before any compute
            (``ccft.core.decoder.check_cache_reader``).
    """
    check_cache_reader(model, cache, fingerprint=fingerprint, allow_self=allow_self)
    if isinstance(model, Decoder):
        model = model.activate()
    stop = StopMatcher(stop)
    params = SamplingParams(do_sample, temperature, top_p, seed)
    device = next(model.parameters()).device
    b, k = cache.tail_ids.shape
    eos = eos_token_ids(tokenizer, model)
    pad = pad_token_id(tokenizer)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    kv = cache.as_dynamic_cache()
    name = cache_kwarg(model)
    lengths = cache.lengths.to(device)
    mask = torch.cat([cache.attention_mask.to(device), torch.ones(b, k, dtype=torch.long, device=device)], 1)
    step_ids = cache.tail_ids.to(device)
    positions = lengths[:, None] + torch.arange(k, device=device)[None, :]
    out_ids: list[list[int]] = [[] for _ in range(b)]
    reason: list[str | None] = [None] * b
    texts: list[str | None] = [None] * b
    for step in range(max_new_tokens):
        logits = model(
            input_ids=step_ids, attention_mask=mask, position_ids=positions, use_cache=True, **{name: kv}
        ).logits[:, -1]
        nxt = select_tokens(logits, params, gen).cpu()
        for i in range(b):
            if reason[i] is not None:
                continue
            tok = int(nxt[i])
            if tok in eos:
                reason[i] = "eos"
                continue
            out_ids[i].append(tok)
            if stop:
                text = tokenizer.decode(out_ids[i], skip_special_tokens=True)  # reference: full decode
                cut = stop.find(text)
                if cut >= 0:
                    reason[i], texts[i] = "stop", text[:cut]
        if all(r is not None for r in reason):
            break
        fed = torch.tensor([int(nxt[i]) if reason[i] is None else pad for i in range(b)], device=device)
        step_ids = fed[:, None]
        positions = (lengths + k + step)[:, None]
        mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.long, device=device)], 1)
    cache.check_unmodified()
    result = []
    for i in range(b):
        text = texts[i] if texts[i] is not None else tokenizer.decode(out_ids[i], skip_special_tokens=True)
        result.append(Generation(text=text, token_ids=out_ids[i], finish_reason=reason[i] or "length"))
    return result


def generate(
    prompts: Sequence[Sequence[int]],
    *,
    mode: str,
    base=None,
    decoder: Decoder | None = None,
    cache: BaseCache | None = None,
    handoff_tokens: int | None = None,
    max_new_tokens: int = 256,
    stop: Sequence[str] | str | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    batch_size: int = 16,
    progress: bool = False,
    share_from_layer: int | None = None,
    cache_format: str | None = None,
) -> list[Generation]:
    """Batched greedy or sampled generation in one of the four modes.

    Args:
        prompts: lists of prompt token ids (``ccft.data.tokenize_prompt``).
        mode: ``base`` | ``full-ft`` | ``naive`` | ``prefillshare`` (checked against ``decoder.method``).
        base: the ``ccft.Base`` (default: ``decoder.base``).
        cache: a precomputed C_base for exactly these prompts (naive / prefillshare); computed if None.
        handoff_tokens: k (default: the decoder's, else 1).
        stop: stop strings; EOS always stops a row.
        share_from_layer: the sharing depth m of ``naive`` / ``prefillshare`` (issue 35; ``ccft.core.depth``):
            the decoder prefills ``prompt[:n−k]`` itself in its first m layers (a partial prefill) and reads
            C_base in layers m..L−1. Default: the decoder's own ``share_from_layer`` (0 for decoders trained
            before it existed: PrefillShare); the own-prefill modes take only 0 or None.
        cache_format: the format ``naive`` / ``prefillshare`` read C_base in (issue 35;
            ``ccft.core.compact``): ``native`` (C_base as computed) or ``int8`` (the compact C_base,
            dequantised before the attention). Default: the decoder's own ``cache_format`` (``native`` for
            decoders trained before it existed); pass ``int8`` to serve a decoder trained on the native cache
            on the compact one. The own-prefill modes take only ``native`` or None.
    Returns:
        one ``Generation`` per prompt, in order; ``finish_reason == "length"`` marks a truncated row.
    Raises:
        ConfigError: unknown mode or a mode that does not match the decoder's method; ``share_from_layer``
            outside ``0..L`` or given to an own-prefill mode; a ``cache`` of other prompts at depth m > 0; an
            unknown ``cache_format``, or ``int8`` given to an own-prefill mode.
        FingerprintMismatchError: ``cache`` comes from another base or dtype or was written by a decoder, or
            ``base`` is not the decoder's base (fingerprint or dtype); raised before any compute (K5).
        CacheMutatedError: ``cache`` was written in place.
    """
    spec = check_mode(mode, decoder)
    base = base if base is not None else decoder.base
    depth, fmt = 0, "native"
    if spec.shared_prefill:
        depth = decoder.share_from_layer if share_from_layer is None else share_from_layer
        depth = check_share_from_layer(depth, num_layers(decoder))
        fmt = check_cache_format(decoder.cache_format if cache_format is None else cache_format)
    elif cache_format is not None and check_cache_format(cache_format) != "native":
        raise errors.ConfigError(
            f"cache_format={cache_format!r} applies to the modes that read C_base (naive, prefillshare); "
            f"mode {mode!r} prefills the whole prompt itself: leave cache_format unset"
        )
    elif share_from_layer:
        raise errors.ConfigError(
            f"share_from_layer={share_from_layer} applies to the modes that read C_base (naive, "
            f"prefillshare); mode {mode!r} prefills the whole prompt itself: leave share_from_layer unset"
        )
    if spec.shared_prefill:
        if cache is not None:  # (the module: a depth-m decoder reads C_base here through depth_cache below)
            check_cache_reader(decoder.model, cache, fingerprint=decoder.fingerprint)
        else:
            check_base_reader(base, decoder)
    k = handoff_tokens or (decoder.handoff_tokens if decoder is not None else 1)
    tok = base.tokenizer
    pad = pad_token_id(tok)
    results: list[Generation | None] = [None] * len(prompts)
    # Similar lengths together: less padding, and results do not depend on it (tests check batch 1 == batch
    # 8).
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    kw = dict(
        max_new_tokens=max_new_tokens,
        stop=stop,
        do_sample=do_sample,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
    )
    for chunk in tqdm(chunks, desc=f"generate [{mode}]", disable=not progress, leave=False):
        batch = [prompts[i] for i in chunk]
        if spec.shared_prefill:
            if cache is not None:
                c = cache.select(chunk)
            else:
                c = compute_base_cache(base, batch, handoff_tokens=k)
            c.check_reader(decoder.fingerprint, decoder.dtype)
            if decoder.kind == "lora":
                decoder.model.set_adapter(decoder.meta.get("adapter_name", "default"))
            # C_base in its format, then the decoder's own K/V below layer m (ccft.core.depth.decoder_prefix)
            ids, mask = prompt_prefixes(batch, k, pad, c.device) if depth else (None, None)
            with torch.no_grad():
                c = decoder_prefix(decoder, c, ids, mask, share_from_layer=depth, cache_format=fmt)
            outs = decode_on_cache(decoder.model, tok, c, **kw)
        elif not spec.needs_decoder:
            with base.base_weights() as model:
                c = prefill(model, batch, handoff_tokens=k, pad_token_id=pad, producer="self")
                outs = decode_on_cache(model, tok, c, **kw)
        else:  # full-ft: the decoder prefills its own prompt
            if decoder.kind == "lora":
                decoder.model.set_adapter(decoder.meta.get("adapter_name", "default"))
            c = prefill(decoder.model, batch, handoff_tokens=k, pad_token_id=pad, producer="self")
            outs = decode_on_cache(decoder.model, tok, c, **kw)
        for i, g in zip(chunk, outs):
            results[i] = g
    return results  # type: ignore[return-value]


__getattr__ = moved_name_getattr(__name__)  # 0.1 names: ccft.core.deprecation.MOVED_NAMES
