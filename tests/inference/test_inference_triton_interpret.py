"""The Triton shared-prefix kernel on CPU, in Triton's interpreter.

Runs only with TRITON_INTERPRET=1 set before Python starts (``test_inference_attention.py`` runs
this file in such a subprocess; ``TRITON_INTERPRET=1 pytest
tests/inference/test_inference_triton_interpret.py`` does too).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="run by test_triton_kernel_in_interpreter (needs TRITON_INTERPRET=1 at start)",
)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_kernel_equals_plain_attention(seed):
    pytest.importorskip("triton")
    from test_inference_attention import CASES, make_case, reference, static_meta

    from ccft.inference.attention import merge, tail_attention
    from ccft.inference.kv import bucket
    from ccft.inference.triton_kernels import prefix_attention_triton

    case = CASES[seed]
    arena, regions, rows, q, tk, tv, tail_len = make_case(*case)
    kv_heads, d = case[1], case[3]
    scale = d**-0.5
    ref = reference(arena, regions, rows, q, tk, tv, tail_len, scale)
    b = bucket(len(rows))
    qp = torch.cat([q, torch.randn(b - len(rows), *q.shape[1:])])
    meta = static_meta(regions, rows, b, kv_heads)
    out, lse = prefix_attention_triton(
        qp, arena.k[0].view(-1, d), arena.v[0].view(-1, d), meta, kv_heads, scale, block_m=16, block_n=16
    )
    ot, lt = tail_attention(q, tk, tv, tail_len, scale)
    torch.testing.assert_close(merge(out[: len(rows)], lse[: len(rows)], ot, lt), ref, atol=1e-6, rtol=0)
    assert (out[len(rows) :] == 0).all() and torch.isinf(lse[len(rows) :]).all()  # padded rows: no group


def test_engine_with_triton_attention_equals_reference(tmp_path, gsm8k_rows, tokenizer):
    """The static decode step with the kernel (what a CUDA graph captures) == ccft.generate, LoRA rows mixed
    in."""
    pytest.importorskip("triton")
    import ccft
    from ccft.core.tokens import tokenize_prompt
    from ccft.inference import SharedPrefillEngine
    from conftest import make_tiny_folder

    base = ccft.load_base(str(make_tiny_folder(tmp_path / "sharp", tokenizer, seed=3, scale=30.0)))
    torch.manual_seed(1)
    lora = ccft.make_decoder(
        base, "lora", lora={"r": 4, "init_lora_weights": False}, method="ccft", adapter_name="math"
    )
    prompts = [
        tokenize_prompt(tokenizer, r["prompt"], chat_template=False)[: 5 + 6 * i]
        for i, r in enumerate(gsm8k_rows[:3])
    ]
    eng = SharedPrefillEngine(
        base, decoders={"math": lora}, decode="static", attention="triton", fill=float("nan")
    )
    assert eng.attention == "triton"
    cache = ccft.compute_base_cache(base, prompts)
    with eng.prefill(prompts) as h:
        snap = h.snapshot()
        ids = [
            (n, i, eng.add_request(h, i, decoder=n, max_new_tokens=4))
            for n in ("base", "math")
            for i in range(3)
        ]
        got = {}
        while eng.active:
            for o in eng.step():
                if o.finished:
                    got[o.request_id] = o.generation.token_ids
        assert all(torch.equal(a, b) for a, b in zip(snap, h.snapshot(), strict=True))
    ref = {
        "base": ccft.generate(prompts, mode="base", base=base, max_new_tokens=4),
        "math": ccft.generate(prompts, mode="prefillshare", decoder=lora, cache=cache, max_new_tokens=4),
    }
    for n, i, rid in ids:
        assert got[rid] == ref[n][i].token_ids, (n, i)
