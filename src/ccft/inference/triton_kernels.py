"""Triton kernel for part (a) of the cascade decode attention: shared-prefix attention.

One program per (prefix row, KV head): it loads the queries of every decode row that reads this
prefix row (all g = H/h query heads of that KV head, stacked as the M dimension of one matrix),
streams the prefix's keys and values once in blocks of ``BLOCK_N`` with an online softmax, and
writes each query's partial output and log-sum-exp; ``attention.merge`` combines them with the
tail part. Statically shaped (grid = (B, h), groups beyond the real ones have no rows), so a CUDA
graph can capture it. fp32 inputs use IEEE fp32 dot products (no TF32), so the kernel matches the
torch reference within fp32 rounding.

CI runs the kernel on CPU through Triton's interpreter (``TRITON_INTERPRET=1`` in the environment
before Python starts: triton reads it at import, and ``peft`` imports triton early).
"""

from __future__ import annotations

import math
import os

import torch

try:  # triton is optional: CUDA machines have it with torch; CPU CI installs it for the interpreter
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the machine
    triton = None
    tl = None


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (TRITON_INTERPRET=1 before triton was imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_available(device: torch.device | str | None = None) -> bool:
    """True when the kernel can run on ``device``: CUDA with triton, or any device under the interpreter."""
    if triton is None:
        return False
    return interpreting() or torch.device(device or "cpu").type == "cuda"


if triton is not None:

    @triton.jit
    def _prefix_attention_kernel(
        Q,
        K,
        V,
        Out,
        LSE,
        g_vec0,
        g_hs,
        g_start,
        g_end,
        row_ptr,
        row_idx,
        stride_qb,
        stride_qh,
        stride_ob,
        stride_oh,
        stride_lb,
        scale,
        REP: tl.constexpr,
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        g = tl.program_id(0)
        kvh = tl.program_id(1)
        r0 = tl.load(row_ptr + g)
        r1 = tl.load(row_ptr + g + 1)
        n_q = (r1 - r0) * REP
        vec0 = tl.load(g_vec0 + g)
        hs = tl.load(g_hs + g)
        s0 = tl.load(g_start + g)
        s1 = tl.load(g_end + g)
        kbase = (vec0 + kvh * hs) * D
        offs_d = tl.arange(0, D)
        for m0 in range(0, n_q, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_ok = offs_m < n_q
            row = tl.load(row_idx + r0 + offs_m // REP, mask=m_ok, other=0)
            head = kvh * REP + offs_m % REP
            q = tl.load(
                Q + row[:, None] * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=m_ok[:, None],
                other=0.0,
            )
            m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
            l_i = tl.zeros((BLOCK_M,), tl.float32)
            acc = tl.zeros((BLOCK_M, D), tl.float32)
            for n0 in range(s0, s1, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                n_ok = offs_n < s1
                kv_off = kbase + offs_n[:, None] * D + offs_d[None, :]
                k = tl.load(K + kv_off, mask=n_ok[:, None], other=0.0)
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                # fp32 whatever type the launcher gave ``scale`` (torch.compile passes Python floats as fp64)
                s = tl.where(n_ok[None, :], (s * scale).to(tl.float32), float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                p = tl.exp(s - m_new[:, None])
                alpha = tl.exp(m_i - m_new)
                v = tl.load(V + kv_off, mask=n_ok[:, None], other=0.0)
                l_i = l_i * alpha + tl.sum(p, 1)
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            has = l_i > 0
            out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
            lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
            tl.store(
                Out + row[:, None] * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
                out,
                mask=m_ok[:, None],
            )
            tl.store(LSE + row * stride_lb + head, lse, mask=m_ok)


def kernel_supports(head_dim: int) -> bool:
    """The kernel needs a power-of-two head dim ≥ 16 (tl.dot / tl.arange constraints)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def prefix_attention_triton(
    q: torch.Tensor,
    arena_k: torch.Tensor,
    arena_v: torch.Tensor,
    meta,
    kv_heads: int,
    scale: float,
    *,
    block_m: int = 16,
    block_n: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Part (a) by the Triton kernel; same contract as ``attention.prefix_attention_gathered``.

    Args:
        q: ``(B, H, d)``.  arena_k, arena_v: one layer of the arena as ``(vectors, d)``.
        meta: ``attention.PrefixMeta`` (its per-group CSR fields are used).
    Returns:
        out ``(B, H, d)`` fp32, lse ``(B, H)`` fp32 (rows in no group: 0 and -inf).
    """
    if triton is None:
        raise RuntimeError(
            "the shared-prefix Triton kernel needs `triton` (pip install triton); "
            "use attention='gather' instead"
        )
    b, heads, d = q.shape
    if not kernel_supports(d):
        raise ValueError(f"head_dim={d}: the Triton kernel needs a power of two ≥ 16; use attention='gather'")
    q = q.contiguous()
    out = torch.zeros((b, heads, d), dtype=torch.float32, device=q.device)
    lse = torch.full((b, heads), -math.inf, dtype=torch.float32, device=q.device)
    if q.device.type != "cuda" and not interpreting():
        raise RuntimeError(
            "the Triton kernel runs on CPU only in Triton's interpreter: set TRITON_INTERPRET=1 "
            "before Python starts (triton reads it when it is imported)"
        )
    _prefix_attention_kernel[(b, kv_heads)](
        q,
        arena_k,
        arena_v,
        out,
        lse,
        meta.g_vec0,
        meta.g_head_stride,
        meta.g_start,
        meta.g_end,
        meta.row_ptr,
        meta.row_idx,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        float(scale),
        REP=heads // kv_heads,
        D=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32,
    )
    return out, lse


__all__ = ["triton_available", "kernel_supports", "prefix_attention_triton"]
