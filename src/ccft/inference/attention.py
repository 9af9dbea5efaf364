"""Decode attention split at the shared prefix (the cascade / Hydragen decomposition), torch reference.

For one decode step every row r attends to its prompt prefix (C_base, shared by every row and
every decoder decoding on the same prompt) and to its own tail (handoff + generated tokens)::

    softmax([q·K_prefix, q·K_tail]) @ [V_prefix; V_tail]
      = w_p · softmax(q·K_prefix) @ V_prefix + w_t · softmax(q·K_tail) @ V_tail,
    w_x = exp(lse_x - logaddexp(lse_p, lse_t)),   lse_x = logsumexp of that part's scores.

Part (a) stacks the queries of all rows that share one prefix row (all their heads of one KV
head: GQA) into one matrix, so that prefix's K/V is read once for all of them; part (b) is per
row. Three implementations of part (a), all equal to ``plain_attention`` (tests):

* ``prefix_attention_grouped`` (eager): host-side grouping; one batched matmul per handle over
  views of the arena (no copy when every prefix row of a handle is used by the same number of rows).
* ``prefix_attention_gathered`` (static shapes, capturable): each row gathers its prefix from the
  arena by index, padded to a bucket; no host sync, but no sharing of reads.
* ``ccft.inference.triton_kernels.prefix_attention_triton`` (static, capturable): one program per
  (prefix row, KV head) streams that prefix once for all its rows' queries (online softmax).

Statistics (scores, lse, merge) are computed in fp32.

Shape notation: B decode rows, H query heads, h KV heads, g = H/h, d head dim, P prefix rows of a
handle, p prefix length, M rows per prefix row, T tail length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ccft.core.compact import dequantize

NEG_INF = float("-inf")


def plain_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """The reference: softmax attention of ``q (B, H, t, d)`` over ``k, v (B, h, S, d)`` where
    ``valid (B, t, S)``.

    Returns ``(B, H, t, d)`` in fp32. GQA by repeating KV heads.
    """
    rep = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(rep, dim=1)
    v = v.float().repeat_interleave(rep, dim=1)
    s = torch.matmul(q.float(), k.transpose(-1, -2)) * scale
    s = s.masked_fill(~valid[:, None], NEG_INF)
    return torch.matmul(torch.softmax(s, dim=-1), v)


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q kᵀ · scale + bias) v`` and its log-sum-exp, one attention part.

    Args:
        q: ``(N, h, m, d)`` — the m queries of each KV head (GQA heads, or rows sharing a prefix).
        k, v: ``(N, h, S, d)`` (views with any row stride).  bias: ``(N, 1, 1|m, S)`` fp32, 0 or -inf.
    Returns:
        out ``(N, h, m, d)`` fp32, lse ``(N, h, m)`` fp32 (a query with no valid key: out 0, lse -inf).
    On CPU this is one fused kernel (PyTorch's flash attention for CPU, which also returns the
    log-sum-exp); elsewhere, and as the fallback, matmul + softmax.
    """
    if q.device.type == "cpu" and _FLASH_CPU is not None and q.dtype in (torch.float32, torch.bfloat16):
        out, lse = _FLASH_CPU(q, k, v, 0.0, False, attn_mask=bias.to(q.dtype), scale=scale)
        return out.float(), lse
    s = torch.add(bias, torch.matmul(q, k.transpose(-1, -2)).float(), alpha=scale)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    out = torch.matmul(torch.exp(s - safe).to(v.dtype), v).float()
    return out, lse.squeeze(-1)


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Merge two partial attentions ``out (..., d)`` with their ``lse (...)`` (log-sum-exp weights). fp32.

    The weight of part a is ``exp(lse_a) / (exp(lse_a) + exp(lse_b)) = sigmoid(lse_a - lse_b)``, so the
    merge is one ``lerp``; a part with no valid key (lse -inf) gets weight 0.
    """
    w = torch.sigmoid(lse_a - lse_b).unsqueeze(-1)
    return torch.lerp(out_b, out_a, w)


def tail_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Part (b): each row's query over its own tail.

    Args:
        q: ``(B, H, d)``.  k, v: ``(B, h, T, d)`` (a view of the tail pool; slots ≥ length are ignored).
        length: ``(B,)`` valid tail positions per row (≥ 1: the row's current token is written first).
    Returns:
        out ``(B, H, d)`` fp32, lse ``(B, H)`` fp32.
    """
    b, heads, d = q.shape
    h = k.shape[1]
    bias = key_bias(torch.zeros_like(length), length, k.shape[2])
    out, lse = attend(q.view(b, h, heads // h, d), k, v, bias, scale)
    return out.reshape(b, heads, d), lse.reshape(b, heads)


def key_bias(start: torch.Tensor, end: torch.Tensor, width: int) -> torch.Tensor:
    """``(B, 1, 1, width)`` fp32 additive mask: 0 on keys ``start[r] <= j < end[r]``, -inf elsewhere."""
    j = torch.arange(width, device=start.device)[None, :]
    ok = (j >= start[:, None]) & (j < end[:, None])
    return torch.zeros(ok.shape, dtype=torch.float32, device=start.device).masked_fill_(~ok, NEG_INF)[
        :, None, None
    ]


def cascade_attention_rowwise(
    q: torch.Tensor,
    kp: torch.Tensor,
    vp: torch.Tensor,
    kt: torch.Tensor,
    vt: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention when batch row r reads prefix row r (each prefix row used by one row, in order).

    The prefix and the tail are still read by separate matmuls over their own buffers (no K/V
    concatenation); their score blocks are joined under one softmax, which is the log-sum-exp merge
    of the two parts done in one step (fewer, larger kernels than two attentions and a merge).

    Args:
        q: ``(B, H, d)``.  kp, vp: ``(B, h, p, d)`` arena view.  kt, vt: ``(B, h, T, d)`` tail-pool view.
        bias: ``(B, 1, 1, p + T)``: ``key_bias`` of the prefix keys, then of the tail keys.
    Returns:
        ``(B, H, d)`` fp32.
    """
    b, heads, d = q.shape
    h, p = kp.shape[1], kp.shape[2]
    qg = q.view(b, h, heads // h, d)
    s = torch.cat([torch.matmul(qg, kp.transpose(-1, -2)), torch.matmul(qg, kt.transpose(-1, -2))], dim=-1)
    prob = torch.softmax(torch.add(bias, s.float(), alpha=scale), dim=-1)
    prob = prob.to(vp.dtype)
    out = torch.matmul(prob[..., :p], vp) + torch.matmul(prob[..., p:], vt)
    return out.float().reshape(b, heads, d)


@dataclass
class PrefixGroup:
    """The rows of one decode batch that read one handle's prefix region (eager path).

    Attributes:
        k, v: per-layer callables ``layer -> (P, h, p, d)`` views of the arena region.
        key_start: ``(P,)`` first real (non-pad) prefix position of each prefix row (left padding).
        rows: ``(P, M)`` long: batch row of the m-th query row of prefix row i, ``-1`` for none; or
            None when batch rows ``offset .. offset+P-1`` map one-to-one onto prefix rows 0..P-1.
        offset: first batch row of this group when ``rows`` is None.
        used: when not every prefix row is read: a slice of them (read in place; ``rows`` has a line per
            row of the slice) or ``(U,)`` the prefix rows read (their K/V are index-selected).
        every_layer: a callable giving ``(L, P, h, p, d)`` views of the keys and values in every layer at
            once, or None (``PrefixHandle.every_layer``: what the fused decode step reads, one view each
            instead of one per layer); None when the layers are not one arena region.
    """

    k: object
    v: object
    key_start: torch.Tensor
    rows: torch.Tensor | None = None
    offset: int = 0
    used: torch.Tensor | slice | None = None
    every_layer: object = None


def _grouped_part(
    q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, key_start: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q (P, h, m, d)`` against ``kp, vp (P, h, p, d)`` with keys ≥ key_start valid -> out, lse (fp32)."""
    width = kp.shape[2]
    return attend(q, kp, vp, key_bias(key_start, torch.full_like(key_start, width), width), scale)


def prefix_attention_grouped(
    q: torch.Tensor, groups: list[PrefixGroup], layer: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Part (a), eager: every prefix row read once for all the rows (and heads) that share it.

    Args:
        q: ``(B, H, d)``.  groups: one ``PrefixGroup`` per handle present in the batch; together
            they cover every batch row exactly once.
    Returns:
        out ``(B, H, d)`` fp32, lse ``(B, H)`` fp32.
    """
    b, heads, d = q.shape
    out = lse = None
    if len(groups) != 1 or groups[0].rows is not None or groups[0].offset != 0:
        out = q.new_zeros((b, heads, d), dtype=torch.float32)
        lse = q.new_full((b, heads), NEG_INF, dtype=torch.float32)
    for g in groups:
        kp, vp = g.k(layer), g.v(layer)
        key_start = g.key_start
        if isinstance(g.used, slice):  # a span of prefix rows: views, no copy
            kp, vp, key_start = kp[g.used], vp[g.used], key_start[g.used]
        elif g.used is not None:
            kp, vp, key_start = (
                kp.index_select(0, g.used),
                vp.index_select(0, g.used),
                key_start.index_select(0, g.used),
            )
        n_pref, h = kp.shape[0], kp.shape[1]
        rep = heads // h
        if g.rows is None:  # batch rows offset..offset+P-1 <-> prefix rows 0..P-1
            qg = q[g.offset : g.offset + n_pref].view(n_pref, h, rep, d)
            o, s = _grouped_part(qg, kp, vp, key_start, scale)
            o, s = o.reshape(n_pref, heads, d), s.reshape(n_pref, heads)
            if out is None:
                return o, s
            out[g.offset : g.offset + n_pref] = o
            lse[g.offset : g.offset + n_pref] = s
            continue
        m = g.rows.shape[1]
        flat = g.rows.reshape(-1)
        present = flat >= 0
        qx = torch.cat([q, q.new_zeros((1, heads, d))])  # row B: zeros for empty places
        qg = qx.index_select(0, torch.where(present, flat, b)).view(n_pref, m, h, rep, d)
        qg = qg.permute(0, 2, 1, 3, 4).reshape(n_pref, h, m * rep, d)
        o, s = _grouped_part(qg, kp, vp, key_start, scale)
        o = o.reshape(n_pref, h, m, rep, d).permute(0, 2, 1, 3, 4).reshape(n_pref * m, heads, d)
        s = s.reshape(n_pref, h, m, rep).permute(0, 2, 1, 3).reshape(n_pref * m, heads)
        idx = flat[present]
        out.index_copy_(0, idx, o[present])
        lse.index_copy_(0, idx, s[present])
    return out, lse


@dataclass
class PrefixMeta:
    """Static-shape description of where each batch row's prefix lives in the arena.

    Per batch row (padded rows point at any valid prefix row and are discarded):
        vec0 ``(B,)``: index of (head 0, position 0) of its prefix row in the arena viewed as
            ``(vectors, d)``; head_stride ``(B,)``: p of its region; start / end ``(B,)``: real keys are
            positions ``start .. end-1``.
    Per group of rows that share one prefix row (for the Triton kernel; G ≤ B groups, unused groups
    have no rows):
        g_vec0, g_head_stride, g_start, g_end ``(B,)``; row_ptr ``(B+1,)``; row_idx ``(B,)`` (CSR: rows
        of group i are ``row_idx[row_ptr[i]:row_ptr[i+1]]``).
    All long tensors on the model's device.
    """

    vec0: torch.Tensor
    head_stride: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    g_vec0: torch.Tensor
    g_head_stride: torch.Tensor
    g_start: torch.Tensor
    g_end: torch.Tensor
    row_ptr: torch.Tensor
    row_idx: torch.Tensor
    max_len: int  # longest real prefix among the rows (host int, used to pick the gather bucket)

    def tensors(self) -> list[torch.Tensor]:
        return [
            self.vec0,
            self.head_stride,
            self.start,
            self.end,
            self.g_vec0,
            self.g_head_stride,
            self.g_start,
            self.g_end,
            self.row_ptr,
            self.row_idx,
        ]


def build_prefix_meta(rows: list[tuple[int, int, int, int]], batch: int, kv_heads: int, device) -> PrefixMeta:
    """``PrefixMeta`` for ``rows`` = per real batch row ``(region start token, prefix row, p, real length)``.

    Rows sharing one (region, prefix row) form one group. ``batch`` ≥ len(rows) is the padded batch.
    """
    n = len(rows)
    assert 0 < n <= batch
    vec0, hs, st, en = [], [], [], []
    groups: dict[tuple[int, int], list[int]] = {}
    for r, (region, prow, p, length) in enumerate(rows):
        vec0.append((region + prow * p) * kv_heads)
        hs.append(p)
        st.append(p - length)
        en.append(p)
        groups.setdefault((region, prow), []).append(r)
    pad = batch - n
    vec0 += [vec0[0]] * pad
    hs += [hs[0]] * pad
    st += [st[0]] * pad
    en += [en[0]] * pad
    g_vec0, g_hs, g_st, g_en, ptr, idx = [], [], [], [], [0], []
    for members in groups.values():
        r0 = members[0]
        g_vec0.append(vec0[r0])
        g_hs.append(hs[r0])
        g_st.append(st[r0])
        g_en.append(en[r0])
        idx += members
        ptr.append(len(idx))
    gpad = batch - len(groups)
    g_vec0 += [0] * gpad
    g_hs += [1] * gpad
    g_st += [0] * gpad
    g_en += [0] * gpad
    ptr += [ptr[-1]] * gpad
    idx += [0] * (batch - len(idx))
    t = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    return PrefixMeta(
        t(vec0),
        t(hs),
        t(st),
        t(en),
        t(g_vec0),
        t(g_hs),
        t(g_st),
        t(g_en),
        t(ptr),
        t(idx),
        max(length for *_, length in rows),
    )


def prefix_attention_gathered(
    q: torch.Tensor,
    arena_k: torch.Tensor,
    arena_v: torch.Tensor,
    meta: PrefixMeta,
    kv_heads: int,
    width: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Part (a) with static shapes: each row gathers its prefix (≤ ``width`` keys) from the arena.

    Args:
        q: ``(B, H, d)``.  arena_k, arena_v: one layer of the arena viewed as ``(vectors, d)``.
        kv_heads: h.
        width: gather width, ≥ every row's real prefix length (a bucket, so shapes stay static).
    Returns:
        out ``(B, H, d)`` fp32, lse ``(B, H)`` fp32.
    """
    b, heads, d = q.shape
    h = kv_heads
    idx, valid = _gather_index(meta, meta.vec0, h, width)
    kp = arena_k.index_select(0, idx.reshape(-1)).view(b, h, width, d)
    vp = arena_v.index_select(0, idx.reshape(-1)).view(b, h, width, d)
    return _gathered_part(q, kp, vp, valid, h, scale)


def _gather_index(
    meta: PrefixMeta, vec0: torch.Tensor, h: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, h, W)`` vector indices of each row's prefix keys from ``vec0`` (head stride and real positions of
    ``meta``), and ``(B, W)`` which of them are real (ignored slots point at the first real one)."""
    j = torch.arange(width, device=vec0.device)
    pos = meta.start[:, None] + j[None, :]  # (B, W)
    valid = pos < meta.end[:, None]
    pos = torch.where(valid, pos, meta.start[:, None])  # in-bounds index for ignored slots
    idx = (
        vec0[:, None, None]
        + torch.arange(h, device=vec0.device)[None, :, None] * meta.head_stride[:, None, None]
        + pos[:, None, :]
    )
    return idx, valid


def _gathered_part(q, kp, vp, valid, h: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    b, heads, d = q.shape
    bias = torch.zeros(valid.shape, dtype=torch.float32, device=q.device).masked_fill_(~valid, NEG_INF)
    out, lse = attend(q.view(b, h, heads // h, d), kp, vp, bias[:, None, None, :], scale)
    return out.reshape(b, heads, d), lse.reshape(b, heads)


@dataclass
class CompactMeta:
    """Static-shape placement of each batch row's compact C_base (``handles.CompactHandle``).

    meta: the rows' int8 codes in the code arena (as ``PrefixMeta`` places a prefix in the arena).
    vscale_vec0 ``(B,)``: index of (head 0, position 0) of the row's value scales in the value-scale arena
    viewed as ``(scales, 1)`` (head stride and positions as ``meta``); kscale_vec0 ``(B,)``: index of head 0's
    key scales in the key-scale arena viewed as ``(vectors, d)`` (one vector per head).
    """

    meta: PrefixMeta
    vscale_vec0: torch.Tensor
    kscale_vec0: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [*self.meta.tensors(), self.vscale_vec0, self.kscale_vec0]


def prefix_attention_gathered_int8(
    q: torch.Tensor,
    codes_k: torch.Tensor,
    codes_v: torch.Tensor,
    vscales: torch.Tensor,
    kscales: torch.Tensor,
    cmeta: CompactMeta,
    kv_heads: int,
    width: int,
    scale: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Part (a) with static shapes on the compact C_base: each row gathers its prefix's int8 codes and their
    scales and dequantises them (``ccft.core.compact.dequantize``: codes × scale in fp32, cast to ``dtype``,
    the values ``read_cache`` gives) before ``prefix_attention_gathered``'s attention.

    Args:
        q: ``(B, H, d)``.  codes_k, codes_v: one layer of the code arena viewed as ``(vectors, d)`` int8.
        vscales: one layer of the value-scale arena viewed as ``(scales, 1)``; kscales: one layer of the
            key-scale arena viewed as ``(vectors, d)``; bfloat16.
        cmeta: the placement.  width: gather width (a bucket ≥ every row's real prefix length).
    Returns:
        out ``(B, H, d)`` fp32, lse ``(B, H)`` fp32.
    """
    b, heads, d = q.shape
    h, meta = kv_heads, cmeta.meta
    idx, valid = _gather_index(meta, meta.vec0, h, width)
    vidx, _ = _gather_index(meta, cmeta.vscale_vec0, h, width)
    kidx = cmeta.kscale_vec0[:, None] + torch.arange(h, device=q.device)[None, :]  # (B, h)
    kc = codes_k.index_select(0, idx.reshape(-1)).view(b, h, width, d)
    vc = codes_v.index_select(0, idx.reshape(-1)).view(b, h, width, d)
    ks = kscales.index_select(0, kidx.reshape(-1)).view(b, h, 1, d)
    vs = vscales.index_select(0, vidx.reshape(-1)).view(b, h, width, 1)
    return _gathered_part(q, dequantize(kc, ks, dtype), dequantize(vc, vs, dtype), valid, h, scale)


__all__ = [
    "plain_attention",
    "merge",
    "tail_attention",
    "key_bias",
    "cascade_attention_rowwise",
    "PrefixGroup",
    "prefix_attention_grouped",
    "PrefixMeta",
    "build_prefix_meta",
    "prefix_attention_gathered",
    "CompactMeta",
    "prefix_attention_gathered_int8",
]
