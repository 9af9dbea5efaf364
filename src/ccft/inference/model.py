"""The engine's own decoder forward over ``LaneWeights``: prefill, extend, and ``decode_one_token``.

Same arithmetic as ``transformers``' forward of each supported family (RMSNorm in fp32, RoPE from the
model's rotary module, gated MLP, PEFT's ``W x + B (A x) * scaling``; the family's switches,
``architectures.Architecture``, are read in ``_embed``, ``_qkv``, ``_attn_out``, ``_mlp`` and ``logits_of``),
but with the KV written into static buffers at explicit positions and the decode attention split at the
shared prefix (``attention.py``).

* ``prefill``: the base (no adapter) over a left-padded batch of prefixes, K/V written straight
  into the handle's arena region (pad slots zeroed).
* ``extend``: a few tokens of one row (the first k-1 handoff tokens), written into its tail slot.
* ``prefill_chunk``: the rest of one prompt after K/V already in its region (prefix-store hits).
* ``decode_step_eager``: one token for every active row of a lane; host-side prefix grouping.
* ``decode_step_static``: the same step with static shapes and no host sync (padded batch bucket,
  tail / prefix width buckets, per-adapter row masks): the function a CUDA graph captures.

Shape notation: B rows, t tokens, D hidden, H / h query / KV heads, d head dim, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ccft.inference.attention import (
    CompactMeta,
    PrefixGroup,
    PrefixMeta,
    cascade_attention_rowwise,
    key_bias,
    merge,
    prefix_attention_gathered,
    prefix_attention_gathered_int8,
    prefix_attention_grouped,
    tail_attention,
)
from ccft.inference.blocks import decode_step_layers, fused_mlp, lora_table
from ccft.inference.weights import Adapter, LaneWeights, Linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fp32_product: bool = False) -> torch.Tensor:
    """RMSNorm, statistics in fp32: llama's ``weight * (x̂).to(dtype)``, or with ``fp32_product`` gemma's
    ``(x̂ · weight).to(dtype)`` (``weight`` there is gemma's ``1 + w`` in fp32, ``weights._norm_scale``)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.rms_norm(x, weight.shape, weight, eps)  # same arithmetic, fewer Python layers
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if fp32_product:
        return (h * weight).to(dtype)
    return weight * h.to(dtype)


def _norm(lw: LaneWeights, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, weight, lw.eps, lw.arch.family.norm_offset != 0.0)


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) * sin == roll(x, d/2) * sin_signed``
    (``sin_signed``: sin with its first half negated); bit-identical to transformers' RoPE. Where ``cos``
    spans fewer dimensions than ``x`` (partial RoPE, phi3), the leading ones are rotated and the rest pass."""
    rd = cos.shape[-1]
    if rd != x.shape[-1]:
        rot = x[..., :rd]
        return torch.cat([rot * cos + torch.roll(rot, rd // 2, dims=-1) * sin_signed, x[..., rd:]], dim=-1)
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


def _embed(lw: LaneWeights, ids: torch.Tensor) -> torch.Tensor:
    """Token embeddings ``(..., D)``; gemma's are multiplied by ``sqrt(D)`` in the model dtype."""
    x = F.embedding(ids, lw.embed)
    scale = lw.embed_scale
    if scale is not None:
        x = x * torch.tensor(scale, dtype=x.dtype, device=x.device)
    return x


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``allowed`` (bool, True = attend) as the additive mask ``scaled_dot_product_attention`` makes of a bool
    mask (0 where allowed, -inf elsewhere, in the queries' ``dtype``): built once per forward instead of once
    per layer; the attention's result is the same bit for bit."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, float("-inf"))


@dataclass
class LoraPlan:
    """Which adapter applies to which rows of a batch.

    ``entries``: ``(adapter, selector)`` with selector None (every row), a long index tensor of rows
    (eager) or a ``(B, 1)`` 0/1 mask in the model dtype (static shapes).
    """

    entries: list[tuple[Adapter, torch.Tensor | None]] = field(default_factory=list)


NO_LORA = LoraPlan()


def project(x: torch.Tensor, lin: Linear, name: str, layer: int, lora: LoraPlan) -> torch.Tensor:
    """``x @ W.T (+ bias)`` plus, for each adapter in ``lora`` adapting this projection, its delta on its
    rows."""
    y = lin(x)
    for adapter, sel in lora.entries:
        lw = adapter.layers[layer].get(name)
        if lw is None:
            continue
        if sel is None:
            y = y + F.linear(F.linear(x, lw.a), lw.b) * lw.scaling
        elif sel.dtype == torch.long:
            # index_put_ (rows are distinct): ~50x faster on CPU than index_add on a strided output
            y.index_put_(
                (sel,), F.linear(F.linear(x.index_select(0, sel), lw.a), lw.b) * lw.scaling, accumulate=True
            )
        else:
            y = y + (F.linear(F.linear(x, lw.a), lw.b) * lw.scaling) * sel
    return y


def _lora_into(y: torch.Tensor, x: torch.Tensor, name: str, layer: int, lora: LoraPlan, col: int) -> None:
    """Add the LoRA deltas of projection ``name`` into columns ``col:`` of a packed output ``y`` (in
    place)."""
    for adapter, sel in lora.entries:
        lw = adapter.layers[layer].get(name)
        if lw is None:
            continue
        out = y[..., col : col + lw.b.shape[0]]
        if sel is None:
            out.add_(F.linear(F.linear(x, lw.a), lw.b) * lw.scaling)
        elif sel.dtype == torch.long:
            out.index_put_(
                (sel,), F.linear(F.linear(x.index_select(0, sel), lw.a), lw.b) * lw.scaling, accumulate=True
            )
        else:
            out.add_((F.linear(F.linear(x, lw.a), lw.b) * lw.scaling) * sel)


def _adapts(lora: LoraPlan, layer: int, names: tuple[str, ...]) -> bool:
    return any(n in a.layers[layer] for a, _ in lora.entries for n in names)


def _act(lw: LaneWeights, x: torch.Tensor) -> torch.Tensor:
    if lw.arch.activation == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    return F.silu(x)


def _mlp(x: torch.Tensor, lw: LaneWeights, i: int, lora: LoraPlan) -> torch.Tensor:
    """``x + down(act(gate(h)) * up(h))``, h = RMSNorm(x) (gemma: ``x + norm(down(...))``); fused oneDNN calls
    (or one block-kernel call, when gate and up are block weights) where no adapter intervenes and the
    activation is SiLU."""
    layer = lw.layers[i]
    h = _norm(lw, x, layer.mlp_norm)
    p = layer.proj
    g, u = p["gate_proj"], p["up_proj"]
    if lw.arch.activation != "silu":
        if layer.gate_up is not None:
            gu = layer.gate_up(h)
            inter = gu.shape[-1] // 2
            _lora_into(gu, h, "gate_proj", i, lora, 0)
            _lora_into(gu, h, "up_proj", i, lora, inter)
            act = _act(lw, gu[..., :inter]) * gu[..., inter:]
        else:
            act = _act(lw, project(h, g, "gate_proj", i, lora)) * project(h, u, "up_proj", i, lora)
    elif (
        g.blocks is not None
        and u.blocks is not None
        and g.bias is None
        and u.bias is None
        and not _adapts(lora, i, ("gate_proj", "up_proj"))
    ):
        act = fused_mlp(g.blocks, u.blocks, h)
    elif layer.gate_up is not None:
        gu = layer.gate_up(h)
        inter = gu.shape[-1] // 2
        _lora_into(gu, h, "gate_proj", i, lora, 0)
        _lora_into(gu, h, "up_proj", i, lora, inter)
        act = F.silu(gu[..., :inter]) * gu[..., inter:]
    elif not _adapts(lora, i, ("gate_proj", "up_proj")):
        act = p["up_proj"].mul(h, p["gate_proj"].silu(h))
    else:
        act = F.silu(project(h, p["gate_proj"], "gate_proj", i, lora)) * project(
            h, p["up_proj"], "up_proj", i, lora
        )
    if layer.post_mlp_norm is not None:
        return x + _norm(lw, project(act, p["down_proj"], "down_proj", i, lora), layer.post_mlp_norm)
    return _residual(x, act, p["down_proj"], "down_proj", i, lora)


def _attn_out(x: torch.Tensor, o: torch.Tensor, lw: LaneWeights, i: int, lora: LoraPlan) -> torch.Tensor:
    """``x + o_proj(o)`` (gemma: ``x + norm(o_proj(o))``), the adapters' deltas of o_proj included; ``o``:
    the attention's output ``(..., H d)``."""
    layer = lw.layers[i]
    lin = layer.proj["o_proj"]
    if layer.post_attn_norm is not None:
        return x + _norm(lw, project(o, lin, "o_proj", i, lora), layer.post_attn_norm)
    return _residual(x, o, lin, "o_proj", i, lora)


def _residual(
    x: torch.Tensor, inp: torch.Tensor, lin: Linear, name: str, layer: int, lora: LoraPlan
) -> torch.Tensor:
    """``x + lin(inp)`` plus the adapters' deltas of ``name`` on their rows."""
    y = lin.add(inp, x)
    if _adapts(lora, layer, (name,)):
        _lora_into(y, inp, name, layer, lora, 0)
    return y


def _qkv(x: torch.Tensor, lw: LaneWeights, i: int, lora: LoraPlan, rope_tables):
    """Normed input -> q ``(..., H, d)``, k, v ``(..., h, d)`` with RoPE applied to q and k (qwen3 / gemma3:
    after their per-head norms). ``rope_tables``: ``_cos_sin``'s, one (cos, sin) per RoPE of the model."""
    layer = lw.layers[i]
    cos, sin = rope_tables[lw.arch.rope_index(i)] if len(rope_tables) > 1 else rope_tables[0]
    h = _norm(lw, x, layer.attn_norm)
    lead = x.shape[:-1]
    if layer.qkv is not None:
        nq, nk = lw.heads * lw.head_dim, lw.kv_heads * lw.head_dim
        y = layer.qkv(h)
        _lora_into(y, h, "q_proj", i, lora, 0)
        _lora_into(y, h, "k_proj", i, lora, nq)
        _lora_into(y, h, "v_proj", i, lora, nq + nk)
        v = y[..., nq + nk :].view(*lead, lw.kv_heads, lw.head_dim)
        if layer.q_norm is None:
            qk = rope(y[..., : nq + nk].view(*lead, lw.heads + lw.kv_heads, lw.head_dim), cos, sin)
            return qk[..., : lw.heads, :], qk[..., lw.heads :, :], v
        q = y[..., :nq].view(*lead, lw.heads, lw.head_dim)
        k = y[..., nq : nq + nk].view(*lead, lw.kv_heads, lw.head_dim)
    else:
        p = layer.proj
        q = project(h, p["q_proj"], "q_proj", i, lora).view(*lead, lw.heads, lw.head_dim)
        k = project(h, p["k_proj"], "k_proj", i, lora).view(*lead, lw.kv_heads, lw.head_dim)
        v = project(h, p["v_proj"], "v_proj", i, lora).view(*lead, lw.kv_heads, lw.head_dim)
    if layer.q_norm is not None:
        q, k = _norm(lw, q, layer.q_norm), _norm(lw, k, layer.k_norm)
    return rope(q, cos, sin), rope(k, cos, sin), v


def _cos_sin(
    lw: LaneWeights, x: torch.Tensor, positions: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per RoPE of the model (``Architecture.rope_types``; one but for gemma3), cos and signed sin (see
    ``rope``) of ``positions (...)``, shaped ``(..., 1, r)`` (broadcast over heads; r the rotary dims)."""
    flat = positions.reshape(1, -1)
    out = []
    for layer_type in lw.arch.rope_types:
        cos, sin = lw.rotary(x, flat) if layer_type is None else lw.rotary(x, flat, layer_type)
        rd = cos.shape[-1]
        shape = (*positions.shape, 1, rd)
        half = rd // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        out.append((cos.reshape(shape), sin.reshape(shape)))
    return out


def logits_of(x: torch.Tensor, lw: LaneWeights) -> torch.Tensor:
    """LM-head logits ``(..., V)`` of the last layer's output (gemma2: soft-capped, ``c · tanh(z / c)``)."""
    z = lw.lm_head(_norm(lw, x, lw.norm))
    cap = lw.arch.final_softcap
    if cap is not None:
        z = torch.tanh(z / cap) * cap
    return z


@torch.no_grad()
def prefill(
    lw: LaneWeights,
    ids: torch.Tensor,
    mask: torch.Tensor,
    write_k,
    write_v,
    lora: LoraPlan = NO_LORA,
    layers: int | None = None,
) -> None:
    """Run the lane (the base; with ``lora``, a LoRA decoder on it) over left-padded prefixes and write their
    K/V.

    Args:
        ids, mask: ``(b, p)`` left-padded prefix ids and their attention mask.
        write_k, write_v: ``layer -> (b, h, p, d)`` destination views (the handle's arena region).
        lora: adapters applied (default none: the base). The no-share baseline prefills with a LoRA
            decoder's own weights (``LoraPlan([(adapter, None)])``).
        layers: run only the first ``layers`` layers (a partial prefill: a decoder's own K/V below its
            sharing depth m, ``ccft.core.depth.partial_prefill``); default all L.
    """
    n_layers = lw.num_layers if layers is None else int(layers)
    b, p = ids.shape
    real = mask.bool()
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    causal = torch.ones(p, p, dtype=torch.bool, device=ids.device).tril()
    # A left-pad query sees only itself (finite values; never read: pad keys are masked for real queries
    # and their K/V slots are zeroed below).
    allowed = (causal[None] & real[:, None, :]) | torch.eye(p, dtype=torch.bool, device=ids.device)[None]
    x = _embed(lw, ids)
    rt = _cos_sin(lw, x, positions)
    allowed = additive_mask(allowed[:, None], x.dtype)
    pad = ~real[:, None, :, None]
    for i in range(n_layers):
        q, k, v = _qkv(x, lw, i, lora, rt)  # (b, p, H|h, d)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        write_k(i).copy_(k.masked_fill(pad, 0.0))
        write_v(i).copy_(v.masked_fill(pad, 0.0))
        if i == n_layers - 1:
            break  # only the K/V are kept: the last layer's attention and MLP outputs are never read
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=lw.scale, enable_gqa=lw.heads != lw.kv_heads
        )
        x = _attn_out(x, o.transpose(1, 2).reshape(b, p, -1), lw, i, lora)
        x = _mlp(x, lw, i, lora)


def _padded_tails(starts: torch.Tensor, prefix_real: torch.Tensor, t: int):
    """``(positions (b, t), allowed (b, 1, t, p + t))`` for right-padded tails of ``t`` tokens that follow
    their own rows' prefixes: a tail token sees its row's real prefix slots and its tail causally."""
    b = starts.shape[0]
    positions = starts[:, None] + torch.arange(t, device=starts.device)[None, :]
    causal = torch.ones(t, t, dtype=torch.bool, device=starts.device).tril()
    allowed = torch.cat(
        [prefix_real[:, None, :].expand(b, t, prefix_real.shape[1]), causal[None].expand(b, t, t)], dim=-1
    )[:, None]
    return positions, allowed


def _tail_layers(
    lw: LaneWeights,
    tail_ids: torch.Tensor,
    positions: torch.Tensor,
    prefix_k,
    prefix_v,
    allowed: torch.Tensor,
    lora: LoraPlan,
    on_kv=None,
) -> torch.Tensor | None:
    """The layer stack over tails ``(b, t)`` that follow K/V prefixes (``tail_forward``, ``extend_rows``): the
    tokens sit at RoPE ``positions (b, t)``, and ``allowed (b, 1, t, p + t)`` says which of the prefix's ``p``
    slots and of the tail's own ``t`` positions each one attends to (``_padded_tails``: right-padded rows;
    ``extend_rows``: several rows packed into one). Returns the last layer's output ``(b, t, D)``; with
    ``on_kv(i, k, v)`` (each layer's new K/V, ``(b, t, h, d)``), only the K/V: the last layer's attention and
    MLP are skipped and None is returned."""
    b, t = tail_ids.shape
    x = _embed(lw, tail_ids)
    rt = _cos_sin(lw, x, positions)
    allowed = additive_mask(allowed, x.dtype)
    for i in range(lw.num_layers):
        q, k, v = _qkv(x, lw, i, lora, rt)  # (b, t, H|h, d)
        if on_kv is not None:
            on_kv(i, k, v)
            if i == lw.num_layers - 1:
                return None
        keys = torch.cat([prefix_k(i), k.transpose(1, 2)], dim=2)
        vals = torch.cat([prefix_v(i), v.transpose(1, 2)], dim=2)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys,
            vals,
            attn_mask=allowed,
            scale=lw.scale,
            enable_gqa=lw.heads != lw.kv_heads,
        )
        x = _attn_out(x, o.transpose(1, 2).reshape(b, t, -1), lw, i, lora)
        x = _mlp(x, lw, i, lora)
    return x


@torch.no_grad()
def tail_forward(
    lw: LaneWeights,
    tail_ids: torch.Tensor,
    tail_mask: torch.Tensor,
    starts: torch.Tensor,
    prefix_k,
    prefix_v,
    prefix_real: torch.Tensor,
    lora: LoraPlan = NO_LORA,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits ``(b, t, V)`` of the lane over right-padded tails that follow prefixes already in K/V form
    (teacher forcing; the decoder-side forward of ``ccft.core.decoder.decoder_forward``, batched); with
    ``keep`` (``(b, t)`` bool), only the logits of the kept positions, ``(n_kept, V)`` in row-major order
    (the LM head and what reads its output, e.g. a cross-entropy over a 49k vocabulary, skip the rest).

    Args:
        tail_ids, tail_mask: ``(b, t)`` right-padded tail ids and mask.  starts: ``(b,)`` RoPE position of
            each row's first tail token (its real prefix length).
        prefix_k, prefix_v: ``layer -> (b, h, p, d)`` the rows' left-padded prefixes.
        prefix_real: ``(b, p)`` bool, the real prefix slots.
        lora: adapters applied (default none: the base).
    A tail token attends to its row's real prefix slots and causally to the tail up to itself; padded
    tail positions give logits that are not meant to be read.
    """
    positions, allowed = _padded_tails(starts, prefix_real, tail_ids.shape[1])
    x = _tail_layers(lw, tail_ids, positions, prefix_k, prefix_v, allowed, lora)
    if keep is not None:
        return logits_of(x[keep][None], lw)[0]
    return logits_of(x, lw)


@torch.no_grad()
def extend(
    lw: LaneWeights,
    tokens: torch.Tensor,
    start_position: int,
    prefix_k,
    prefix_v,
    key_start: int,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    tail_start: int,
    lora: LoraPlan,
    *,
    logits: bool = True,
    layers: int | None = None,
) -> torch.Tensor | None:
    """Process ``t`` tokens of one row (attending to its prefix and its tail so far); returns logits
    ``(t, V)``.

    Args:
        tokens: ``(t,)``.  start_position: RoPE position of the first token.
        prefix_k, prefix_v: ``layer -> (h, p, d)`` the row's prefix; keys ≥ ``key_start`` are real.
        tail_k, tail_v: ``(L, h, capacity, d)`` the row's tail slot; the tokens are written at
            ``tail_start .. tail_start+t-1``.
        logits: False: only write the K/V (the last layer's attention and MLP are skipped); returns None.
        layers: with ``logits=False``, run (and write) only the first ``layers`` layers (default all L).
    """
    n_layers = lw.num_layers if layers is None or logits else int(layers)
    t = tokens.shape[0]
    positions = start_position + torch.arange(t, device=tokens.device)
    x = _embed(lw, tokens)
    rt = _cos_sin(lw, x, positions)
    end = tail_start + t
    allowed = None
    for i in range(n_layers):
        q, k, v = _qkv(x, lw, i, lora, rt)  # (t, H|h, d)
        tail_k[i, :, tail_start:end] = k.transpose(0, 1)
        tail_v[i, :, tail_start:end] = v.transpose(0, 1)
        if not logits and i == n_layers - 1:
            return None
        pk, pv = prefix_k(i)[:, key_start:], prefix_v(i)[:, key_start:]
        if pk.shape[1]:
            keys = torch.cat([pk, tail_k[i, :, :end]], dim=1)[None]
            vals = torch.cat([pv, tail_v[i, :, :end]], dim=1)[None]
        else:  # no prefix (``prefill_chunk``: the region is the tail): read it in place, no copy
            keys, vals = tail_k[i, :, :end][None], tail_v[i, :, :end][None]
        if allowed is None:  # the same for every layer: built once
            n_pre = keys.shape[2] - end
            seen = torch.ones(t, keys.shape[2], dtype=torch.bool, device=tokens.device)
            seen[:, n_pre:] = (
                torch.arange(end, device=tokens.device)[None, :]
                <= (tail_start + torch.arange(t, device=tokens.device))[:, None]
            )
            allowed = additive_mask(seen[None, None], x.dtype)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys,
            vals,
            attn_mask=allowed,
            scale=lw.scale,
            enable_gqa=lw.heads != lw.kv_heads,
        )
        x = _attn_out(x, o[0].transpose(0, 1).reshape(t, -1), lw, i, lora)
        x = _mlp(x, lw, i, lora)
    return logits_of(x, lw)


#: ``extend_rows`` packs rows on one prefix while the packed attention (``T (p + T)`` scores) is at most this
#: many times the right-padded batch's (``b t (p + t)``)
PACK_MAX_WORK = 1.5


def _packs(lengths: list[int], t: int, p: int, lora: LoraPlan) -> bool:
    """Whether ``extend_rows`` packs ``len(lengths)`` rows on one prefix of ``p`` slots (docstring there)."""
    if any(sel is not None for _, sel in lora.entries):
        return False
    n = sum(lengths)
    return n * (p + n) <= PACK_MAX_WORK * len(lengths) * t * (p + t)


@torch.no_grad()
def extend_rows(
    lw: LaneWeights,
    tokens: torch.Tensor,
    lengths: list[int],
    starts: torch.Tensor,
    prefix_k,
    prefix_v,
    prefix_real: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    slots: list[int],
    lora: LoraPlan,
) -> None:
    """``extend`` of several rows in one batched forward, K/V only (``logits=False``): row r's first
    ``lengths[r]`` tokens attend to its prefix and causally to each other, and their K/V are written into tail
    slot ``slots[r]`` of the pool from index 0 (the requests admitted together by ``add_request``, each
    with its own suffix after a shared or separate prompt row).

    Rows that all read ONE prefix (agents admitted on one context row: ``prefix_real`` has one row) are packed
    into one sequence of ``sum(lengths)`` tokens, each row's tokens at its own positions, under a
    block-diagonal causal mask (a token sees the prefix's real slots and the earlier tokens of its own row):
    each layer joins the prefix with the packed tokens' K/V once, instead of gathering and joining a copy per
    row, and no padding is computed (docs/inference.md, "Step-level API"). They are not packed (a right-padded
    batch over a broadcast view of the prefix) where ``lora`` selects rows (the packed batch has one row) or
    where packing would cost more than ``PACK_MAX_WORK`` times the padded batch's attention (``T (p + T)``
    against ``b t (p + t)`` scores, T = ``sum(lengths)``: many long suffixes on a short prefix).

    Args:
        tokens: ``(b, t)`` right-padded token ids.  lengths: each row's real token count (≥ 1).
        starts: ``(b,)`` long RoPE position of each row's first token (its real prefix length).
        prefix_k, prefix_v: ``layer -> (b, h, p, d)`` each row's left-padded prefix, or ``(1, h, p, d)``
            the one prefix every row reads.
        prefix_real: ``(b, p)`` (or ``(1, p)``: one prefix) bool, the real prefix slots (as ``tail_forward``).
        pool_k, pool_v: ``(L, slots, h, capacity, d)`` the lane's tail pool.
        lora: the adapters applied (the producer's; None rows: every row).
    Equal within fp32 rounding to ``extend(..., logits=False)`` row by row (tested); padded positions are
    computed and never written or attended to by a real token.
    """
    b, t = tokens.shape
    if prefix_real.shape[0] == 1 and b > 1 and _packs(lengths, t, prefix_real.shape[1], lora):
        device = tokens.device
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        real = torch.arange(t, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
        row = torch.arange(b, device=device)[:, None].expand(b, t)[real]  # (T,)
        j = torch.arange(t, device=device)[None, :].expand(b, t)[real]
        positions = (starts[:, None] + torch.arange(t, device=device)[None, :])[real][None]
        own = (row[:, None] == row[None, :]) & (j[None, :] <= j[:, None])  # (T, T) block-diagonal causal
        seen = torch.cat([prefix_real.expand(own.shape[0], -1), own], dim=-1)[None, None]

        def write_packed(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
            for r, slot in enumerate(slots):
                a, e = offsets[r], offsets[r + 1]
                pool_k[i, slot, :, : e - a] = k[0, a:e].transpose(0, 1)
                pool_v[i, slot, :, : e - a] = v[0, a:e].transpose(0, 1)

        _tail_layers(lw, tokens[real][None], positions, prefix_k, prefix_v, seen, lora, on_kv=write_packed)
        return

    if prefix_real.shape[0] == 1 and b > 1:  # one prefix, not packed: every row reads a broadcast view of it
        one_k, one_v = prefix_k, prefix_v
        prefix_k = lambda i: one_k(i).expand(b, -1, -1, -1)  # noqa: E731
        prefix_v = lambda i: one_v(i).expand(b, -1, -1, -1)  # noqa: E731
        prefix_real = prefix_real.expand(b, -1)

    def write(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for r, (slot, n) in enumerate(zip(slots, lengths, strict=True)):
            pool_k[i, slot, :, :n] = k[r, :n].transpose(0, 1)
            pool_v[i, slot, :, :n] = v[r, :n].transpose(0, 1)

    positions, allowed = _padded_tails(starts, prefix_real, t)
    _tail_layers(lw, tokens, positions, prefix_k, prefix_v, allowed, lora, on_kv=write)


@torch.no_grad()
def prefill_chunk(
    lw: LaneWeights,
    tokens: torch.Tensor,
    start: int,
    region_k: torch.Tensor,
    region_v: torch.Tensor,
    lora: LoraPlan = NO_LORA,
) -> None:
    """Chunked prefill of one unpadded prompt: tokens at positions ``start .. start+t-1`` attend to the
    K/V already in the row's region at ``0 .. start-1`` (e.g. copied from a prefix store, or an
    earlier chunk) and causally to each other; their K/V are written at ``start .. start+t-1``.

    ``extend`` with an empty prefix and the region as the "tail"; ``start=0`` over the whole prompt
    is ``prefill`` of a batch of one (same shapes, same arithmetic).

    Args:
        tokens: ``(t,)`` token ids.  start: position (and region index) of the first one.
        region_k, region_v: ``(L, h, P, d)`` the row's region, ``P ≥ start + t``.
        lora: adapters applied (default none: the base).
    """
    extend(
        lw,
        tokens,
        start,
        lambda i: region_k[i, :, :0],
        lambda i: region_v[i, :, :0],
        0,
        region_k,
        region_v,
        start,
        lora,
        logits=False,
    )


def _group_reads(g: PrefixGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """``(batch rows, prefix rows)``: two ``(n,)`` long tensors, the batch rows of group ``g`` and the prefix
    row (of its handle) each one reads."""
    if g.rows is None:
        prefix = torch.arange(g.key_start.shape[0], device=g.key_start.device)
        return prefix + g.offset, prefix
    table = g.rows  # (span rows, m): the batch rows reading each prefix row of the span, -1 padded
    if g.used is None:
        index = torch.arange(table.shape[0], device=table.device)
    elif isinstance(g.used, slice):
        index = torch.arange(g.used.start, g.used.start + table.shape[0], device=table.device)
    else:
        index = g.used
    readers = table >= 0
    return table[readers], index[:, None].expand_as(table)[readers]


def _prefix_rows(groups: list[PrefixGroup], b: int) -> torch.Tensor | None:
    """``(B,)`` long: the prefix row each batch row reads, when one group (one handle, one own K/V) covers the
    batch through its table of readers (e.g. several agents on one context row); None for several groups."""
    if len(groups) != 1 or groups[0].rows is None:
        return None
    batch, prefix = _group_reads(groups[0])
    out = torch.empty(b, dtype=torch.long, device=batch.device)
    out[batch] = prefix
    return out


def _row_views(groups: list[PrefixGroup], b: int):
    """Per batch row, ``(L, h, p, d)`` views of the keys and values of the prefix row it reads, and ``(B,)``
    its first real key, for a batch over several groups (handles) whose every layer is one arena region
    (``PrefixHandle.every_layer``); None when a group's is not (a compact C_base, a depth-m reader's own
    K/V). What ``blocks.decode_step_layers(row_views=...)`` reads: sessions of several contexts in one
    fused step."""
    views: list = [None] * b
    key_start = torch.empty(b, dtype=torch.long)
    for g in groups:
        every = g.every_layer() if g.every_layer is not None else None
        if every is None:
            return None
        keys, values = every  # (L, P, h, p, d) each
        batch, prefix = _group_reads(g)
        key_start[batch] = g.key_start.index_select(0, prefix)
        for r, pr in zip(batch.tolist(), prefix.tolist(), strict=True):
            views[r] = (keys[:, pr], values[:, pr])
    if any(v is None for v in views):
        return None
    return views, key_start


def _fused_in_parts(step, x, cos_sin, several, pool_k, pool_v, write_pos, tail_len, lora_entries):
    """``blocks.decode_step_layers(row_views=...)`` over rows ``0..B-1`` in consecutive parts of
    ``step.max_rows`` rows (each part its rows' slots of the tail pool, its LoRA rows re-indexed); the
    updated ``x (B, D)``, or None when an adapter cannot be read in place (``blocks.lora_table``; checked
    before any part runs, so nothing is written then)."""
    if any(lora_table(adapter, step.dims) is None for adapter, _ in lora_entries):
        return None
    views, key_start = several
    b, part = x.shape[0], step.max_rows
    cos, sin = cos_sin
    outs = []
    for r0 in range(0, b, part):
        r1 = min(b, r0 + part)
        entries = []
        for adapter, sel in lora_entries:
            if sel is None:
                entries.append((adapter, None))
                continue
            mine = sel[(sel >= r0) & (sel < r1)] - r0
            if mine.numel():
                entries.append((adapter, mine))
        out = decode_step_layers(
            step,
            x[r0:r1],
            cos[r0:r1],
            sin[r0:r1],
            None,
            None,
            key_start[r0:r1],
            pool_k[:, r0:r1],
            pool_v[:, r0:r1],
            write_pos[r0:r1],
            tail_len[r0:r1],
            entries,
            row_views=views[r0:r1],
        )
        if out is None:  # not after the check above: a part refused after others ran cannot fall back
            raise RuntimeError("decode_step_layers refused a part of the step after the check")
        outs.append(out)
    return torch.cat(outs)


@torch.no_grad()
def decode_step_eager(
    lw: LaneWeights,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    write_pos: torch.Tensor,
    tail_len: torch.Tensor,
    tail_width: int,
    groups: list[PrefixGroup],
    lora: LoraPlan,
) -> torch.Tensor:
    """``decode_one_token`` for rows ``0..B-1`` of a lane's tail pool; returns logits ``(B, V)``.

    Args:
        tokens, positions: ``(B,)`` input token and its RoPE position per row.
        pool_k, pool_v: ``(L, slots, h, capacity, d)`` the lane's tail pool; row r is slot r.
        write_pos: ``(B,)`` tail index where this token's K/V is written; tail_len = write_pos + 1.
        tail_width: keys read per row (≥ max tail_len; only the first tail_len[r] are attended).
        groups: the prefix groups covering the rows (``attention.prefix_attention_grouped``).
    """
    b = tokens.shape[0]
    rows = torch.arange(b, device=tokens.device)
    x = _embed(lw, tokens)
    rt = _cos_sin(lw, x, positions)
    g = groups[0]
    rowwise = len(groups) == 1 and g.rows is None and g.offset == 0 and g.key_start.shape[0] == b
    step = lw.block_step
    if step is not None and (b <= step.max_rows or len(groups) > 1):  # every layer in kernel calls
        prefix_row = None if rowwise or b > step.max_rows else _prefix_rows(groups, b)
        if not (rowwise or prefix_row is not None):
            # rows of several handles (sessions): per row its region, in parts of max_rows rows (beyond
            # them the layer loop's grouped prefix attention is slower still; docs/serving.md, "Several
            # sessions in one decode step")
            several = _row_views(groups, b)
            out = None
            if several is not None:
                out = _fused_in_parts(
                    step, x, rt[0], several, pool_k, pool_v, write_pos, tail_len, lora.entries
                )
            if out is not None:
                return logits_of(out, lw)
        else:
            every = g.every_layer() if g.every_layer is not None else None  # one view each, not L
            prefix_k, prefix_v = every or (
                [g.k(i) for i in range(lw.num_layers)],
                [g.v(i) for i in range(lw.num_layers)],
            )
            out = decode_step_layers(
                step,
                x,
                rt[0][0],
                rt[0][1],
                prefix_k,
                prefix_v,
                g.key_start if rowwise else g.key_start.index_select(0, prefix_row),
                pool_k,
                pool_v,
                write_pos,
                tail_len,
                lora.entries,
                prefix_row=prefix_row,
            )
            if out is not None:
                return logits_of(out, lw)
    if rowwise:  # every row reads its own prefix row, in order: the masks are built once per step
        width = g.k(0).shape[2]
        bias = torch.cat(
            [
                key_bias(g.key_start, torch.full_like(g.key_start, width), width),
                key_bias(torch.zeros_like(tail_len), tail_len, tail_width),
            ],
            dim=-1,
        )
    for i in range(lw.num_layers):
        q, k, v = _qkv(x, lw, i, lora, rt)  # (B, H|h, d)
        pool_k[i, rows, :, write_pos] = k
        pool_v[i, rows, :, write_pos] = v
        kt, vt = pool_k[i, :b, :, :tail_width], pool_v[i, :b, :, :tail_width]
        if rowwise:
            o = cascade_attention_rowwise(q, g.k(i), g.v(i), kt, vt, bias, lw.scale)
            o = o.to(x.dtype).reshape(b, -1)
        else:
            o_t, lse_t = tail_attention(q, kt, vt, tail_len, lw.scale)
            o_p, lse_p = prefix_attention_grouped(q, groups, i, lw.scale)
            o = merge(o_p, lse_p, o_t, lse_t).to(x.dtype).reshape(b, -1)
        x = _attn_out(x, o, lw, i, lora)
        x = _mlp(x, lw, i, lora)
    return logits_of(x, lw)


@dataclass
class StaticInputs:
    """Fixed-shape inputs of one static decode step (batch bucket B); the CUDA graph's input buffers.

    tokens, positions, write_pos, tail_len: ``(B,)`` long.  lora_masks: ``(A, B, 1)`` in the model
    dtype, one 0/1 row mask per adapter of the lane (A may be 0).  meta: the prefix placement.
    own_meta, depth: None when no row reads its own prefix K/V; else the placement of each row's own K/V
    in the own-layer arena (rows without any point at a valid one, never selected) and ``(B,)`` long, the
    row's sharing depth m (0: C_base in every layer): row r reads its own K/V in layers ``i < depth[r]``.
    compact_meta, compact: None when no row reads the compact C_base; else the placement of each row's codes
    and scales (rows without point at another row's, never selected) and ``(B,)`` bool, the rows that read it
    (``handles.CompactHandle``) instead of the prefix arena.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    write_pos: torch.Tensor
    tail_len: torch.Tensor
    lora_masks: torch.Tensor
    meta: PrefixMeta
    own_meta: PrefixMeta | None = None
    depth: torch.Tensor | None = None
    compact_meta: CompactMeta | None = None
    compact: torch.Tensor | None = None
    #: every long tensor above, as views of this one buffer, when built by ``packed``: a step's inputs then
    #: reach a captured graph's buffers in one host-to-device copy (``copy_from``), plus the adapter masks
    #: and the compact rows' flags
    flat: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        own = [] if self.own_meta is None else [*self.own_meta.tensors(), self.depth]
        if self.compact_meta is not None:
            own += [*self.compact_meta.tensors(), self.compact]
        return [
            self.tokens,
            self.positions,
            self.write_pos,
            self.tail_len,
            self.lora_masks,
            *self.meta.tensors(),
            *own,
        ]

    def _with(self, ts: list[torch.Tensor], flat: torch.Tensor | None) -> StaticInputs:
        """The same structure over ``ts`` (in ``tensors()`` order)."""
        it = iter(ts)

        def take(n: int) -> list[torch.Tensor]:
            return [next(it) for _ in range(n)]

        n_meta = len(self.meta.tensors())
        tokens, positions, write_pos, tail_len, masks = take(5)
        meta = PrefixMeta(*take(n_meta), max_len=self.meta.max_len)
        own_meta = depth = compact_meta = compact = None
        if self.own_meta is not None:
            own_meta = PrefixMeta(*take(n_meta), max_len=self.own_meta.max_len)
            depth = next(it)
        if self.compact_meta is not None:
            codes = PrefixMeta(*take(n_meta), max_len=self.compact_meta.meta.max_len)
            compact_meta = CompactMeta(codes, *take(2))
            compact = next(it)
        return StaticInputs(
            tokens, positions, write_pos, tail_len, masks, meta, own_meta, depth, compact_meta, compact, flat
        )

    def packed(self) -> StaticInputs:
        """These inputs with every long tensor a view of one buffer (``flat``), their concatenation."""
        ts = self.tensors()
        longs = [t for t in ts if t.dtype == torch.long]
        flat = torch.cat(longs)
        views = iter(torch.split(flat, [t.numel() for t in longs]))
        return self._with([next(views) if t.dtype == torch.long else t for t in ts], flat)

    def to(self, device) -> StaticInputs:
        """A copy on ``device`` (one copy of ``flat``; the masks and flags apart); ``self`` when already
        there or not packed."""
        if self.flat is None or self.flat.device == torch.device(device):
            return self
        ts = self.tensors()
        flat = self.flat.to(device)
        views = iter(torch.split(flat, [t.numel() for t in ts if t.dtype == torch.long]))
        return self._with([next(views) if t.dtype == torch.long else t.to(device) for t in ts], flat)

    def copy_from(self, other: StaticInputs) -> None:
        """Overwrite these inputs (a captured graph's buffers) with ``other``'s values, same structure and
        shapes, from any device: one copy of ``flat`` and one per non-long tensor (masks, compact flags)."""
        pairs = list(zip(self.tensors(), other.tensors(), strict=True))
        whole = self.flat is not None and other.flat is not None
        if whole:
            self.flat.copy_(other.flat, non_blocking=True)
        for dst, src in pairs:
            if dst.numel() and not (whole and dst.dtype == torch.long):
                dst.copy_(src, non_blocking=True)


def decode_step_static(
    lw: LaneWeights,
    inp: StaticInputs,
    arena_k: torch.Tensor,
    arena_v: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    tail_width: int,
    prefix_width: int,
    prefix_impl: str = "gather",
    own_k: torch.Tensor | None = None,
    own_v: torch.Tensor | None = None,
    compact: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """``decode_one_token`` with static shapes and no host synchronisation; returns logits ``(B, V)``.

    Every shape depends only on (B, tail_width, prefix_width, number of adapters), so one capture
    per such key replays for any rows, positions, prefixes and adapter assignment.

    Args:
        arena_k, arena_v: ``(L, elements)`` the prefix arena.
        pool_k, pool_v: the lane's tail pool, ``slots ≥ B``; padded rows write into their own unused slots.
        tail_width: tail keys read per row (bucket ≥ max tail_len).
        prefix_width: gather width for ``prefix_impl="gather"`` (bucket ≥ longest real prefix).
        prefix_impl: ``"gather"`` (torch) or ``"triton"`` (the shared-prefix kernel).
        own_k, own_v: ``(L_own, elements)`` the own-layer arena, when ``inp.own_meta`` is set: in a layer
            i < L_own the prefix part is computed on it too and row r takes that result where
            ``i < inp.depth[r]`` (its own K/V below its sharing depth), C_base's elsewhere.
        compact: ``(key codes, value codes, value scales, key scales)`` of the compact C_base's arenas, each
            ``(L, elements)``, when ``inp.compact_meta`` is set: the rows in ``inp.compact`` take the prefix
            part computed on them (``attention.prefix_attention_gathered_int8``; always gathered, at
            ``prefix_width``) in every layer they read C_base in.
    """

    def prefix_part(q, ak, av, meta):
        if prefix_impl == "triton":
            from ccft.inference.triton_kernels import prefix_attention_triton

            return prefix_attention_triton(q, ak, av, meta, lw.kv_heads, lw.scale)
        return prefix_attention_gathered(q, ak, av, meta, lw.kv_heads, prefix_width, lw.scale)

    own_layers = 0 if inp.own_meta is None or own_k is None else own_k.shape[0]
    b = inp.tokens.shape[0]
    d = lw.head_dim
    rows = torch.arange(b, device=inp.tokens.device)
    lora = LoraPlan([(a, inp.lora_masks[j]) for j, a in enumerate(lw.adapters)])
    x = _embed(lw, inp.tokens)
    rt = _cos_sin(lw, x, inp.positions)
    for i in range(lw.num_layers):
        q, k, v = _qkv(x, lw, i, lora, rt)
        pool_k[i, rows, :, inp.write_pos] = k
        pool_v[i, rows, :, inp.write_pos] = v
        o_t, lse_t = tail_attention(
            q, pool_k[i, :b, :, :tail_width], pool_v[i, :b, :, :tail_width], inp.tail_len, lw.scale
        )
        o_p, lse_p = prefix_part(q, arena_k[i].view(-1, d), arena_v[i].view(-1, d), inp.meta)
        if compact is not None and inp.compact_meta is not None:
            ck, cv, vs, ks = (t[i] for t in compact)
            o_c, lse_c = prefix_attention_gathered_int8(
                q,
                ck.view(-1, d),
                cv.view(-1, d),
                vs.view(-1, 1),
                ks.view(-1, d),
                inp.compact_meta,
                lw.kv_heads,
                prefix_width,
                lw.scale,
                lw.dtype,
            )
            sel = inp.compact[:, None]
            o_p, lse_p = torch.where(sel[..., None], o_c, o_p), torch.where(sel, lse_c, lse_p)
        if i < own_layers:  # rows below their sharing depth read their own K/V instead
            o_o, lse_o = prefix_part(q, own_k[i].view(-1, d), own_v[i].view(-1, d), inp.own_meta)
            sel = (inp.depth > i)[:, None]
            o_p, lse_p = torch.where(sel[..., None], o_o, o_p), torch.where(sel, lse_o, lse_p)
        o = merge(o_p, lse_p, o_t, lse_t).to(x.dtype).reshape(b, -1)
        x = _attn_out(x, o, lw, i, lora)
        x = _mlp(x, lw, i, lora)
    return logits_of(x, lw)


__all__ = [
    "rms_norm",
    "rope",
    "additive_mask",
    "PACK_MAX_WORK",
    "LoraPlan",
    "project",
    "prefill",
    "extend",
    "extend_rows",
    "prefill_chunk",
    "decode_step_eager",
    "StaticInputs",
    "decode_step_static",
]
