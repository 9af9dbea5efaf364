"""The fused CPU decode step (``blocks.decode_step_layers``: every layer of a step in one kernel call) on the
families beside Llama that it runs: Qwen2 (biases on q/k/v, the packed [q; k; v]'s bias) and Qwen3 (per-head
RMSNorm of q and k after the projection, before RoPE), against the eager layer loop (``model._qkv``, the
reference of the engine's arithmetic) and greedy generation against ``ccft.generate``.

Tiny random bases from ``tests/families.py`` (2 layers, GQA 4 / 2, head dim 16; biases and norm weights
perturbed away from their initial values, so a bias or a norm the kernel skipped changes the logits and the
K/V); the LM head sharpened (``scale``) so that greedy tokens have clear margins. Each comparison first checks
that the fused step ran (``decode_step_plan`` is not None, and the kernel's step returned the logits), so a
silent fallback to the layer loop fails instead of passing.
"""

from __future__ import annotations

import pytest
import torch

from ccft.inference import SharedPrefillEngine
from ccft.inference import blocks as B
from conftest import make_lora
from families import make_family_folder

FAMILIES = ["qwen2", "qwen3"]
N_NEW = 6
#: fused vs loop logits (|z| ~ 5-7 with lm_head × SCALE): fp32 in another summation order. Seen: ~2e-6 on
#: the base's rows, up to ~6e-5 on a LoRA row a few steps in on qwen3 (its q / k norms amplify rounding),
#: where two PyTorch layer loops (oneDNN's packed products and plain F.linear) differ by ~4e-5 too; the 1e-4
#: of the log-probability bound of tests/inference/test_block_weights.py. A skipped bias or norm moves them
#: by ~1.
LOGITS_TOL = {"rtol": 1e-5, "atol": 1e-4}
#: the tail pool's K/V: rtol as tests/inference/test_block_weights.py; atol 1e-4 as the logits', for the same
#: reason: qwen3's k norm divides by the RMS of the projected k, so a ~1e-7 rounding difference of the product
#: comes out ~3.6e-5 on a key of ~0.08 in layer 1 a few steps in (seen on CI's machine; 1e-5 passed on this
#: project's AVX2 and AVX-512 machines). The keys are O(1) after the norm: a skipped norm or bias moves them
#: by far more.
KV_TOL = {"rtol": 1e-4, "atol": 1e-4}
SCALE = 8.0


@pytest.fixture(scope="module")
def kernel():
    k = B.load_kernel()
    if k is None:
        pytest.skip("no C++ compiler: the fused step is not built")
    return k


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp(f"fused_{request.param}")
    return request.param, make_family_folder(folder, tokenizer, request.param, seed=1, scale=SCALE)


def _prompts(tokenizer, gsm8k_rows, n):
    from ccft.core.tokens import tokenize_prompt

    return [
        tokenize_prompt(tokenizer, r["prompt"], chat_template=False)[: 12 + 5 * i]
        for i, r in enumerate(gsm8k_rows[:n])
    ]


def _engines(base, loras, monkeypatch):
    """Two fp32 engines on ``base``: the fused step and the layer loop (``block_step = None``); and the list
    of the fused step's results (one per kernel step; False: it fell back)."""
    from ccft.inference import model as M

    fused = SharedPrefillEngine(base, loras, decode="eager", block_weights="off")
    loop = SharedPrefillEngine(base, loras, decode="eager", block_weights="off")
    assert fused.lanes["base"].weights.block_step is not None
    loop.lanes["base"].weights.block_step = None
    results = []
    real = M.decode_step_layers

    def spy(*a, **k):
        out = real(*a, **k)
        results.append(out is not None)
        return out

    monkeypatch.setattr(M, "decode_step_layers", spy)
    return fused, loop, results


def _logits_of_reads(engine, prompts, reads, new=N_NEW):
    """Per step, the logits ``(V,)`` of each request ``(prompt row, decoder, suffix ids)`` on one handle
    (several may read one prompt row), greedy; and the tail pool's K/V of the requests' rows at the end."""
    return _logits_of_handles(engine, [prompts], [(0, row, d, suffix) for row, d, suffix in reads], new)


def _assert_fused_equals_loop(fused, loop, results, prompts, reads):
    before = len(results)
    a, kv_a = _logits_of_reads(fused, prompts, reads)
    assert len(results) > before and all(results[before:]), reads  # the fused step ran every step
    b, kv_b = _logits_of_reads(loop, prompts, reads)
    assert [[t for t, _ in s] for s in a] == [[t for t, _ in s] for s in b], reads  # greedy tokens
    for sa, sb in zip(a, b, strict=True):
        for (_, la), (_, lb) in zip(sa, sb, strict=True):
            torch.testing.assert_close(la, lb, **LOGITS_TOL)
    for lane in kv_a:
        torch.testing.assert_close(kv_a[lane], kv_b[lane], **KV_TOL)


def _cases(tokenizer, gsm8k_rows):
    """(prompts, reads): rows with their own prefix row (the base, one adapter on every row, the base and two
    adapters mixed), several rows reading one prefix row (one with its own suffix), and readers of rows 2
    and 0 of three."""
    suffix = tokenizer.encode(" Answer briefly.", add_special_tokens=False)
    own = [
        ["base"],
        ["math", "math", "math"],
        ["code", "base", "math"],
    ]
    out = [(_prompts(tokenizer, gsm8k_rows, len(d)), [(i, n, None) for i, n in enumerate(d)]) for d in own]
    out.append(
        (
            _prompts(tokenizer, gsm8k_rows, 1),
            [(0, "base", None), (0, "math", None), (0, "code", suffix), (0, "math", None)],
        )
    )
    out.append(
        (_prompts(tokenizer, gsm8k_rows, 3), [(2, "math", None), (0, "base", None), (2, "code", None)])
    )
    return out


def test_decode_step_plan_runs_qwen2_and_qwen3(family_dir, kernel):
    """``decode_step_plan`` gives the fused step for a Qwen2 lane (its [q; k; v] bias in the plan) and a Qwen3
    lane (its q / k norms in the plan), and still None for a bias on another projection or a q norm without
    its k norm."""
    import ccft

    family, path = family_dir
    lw = SharedPrefillEngine(ccft.load_base(str(path)), decode="eager").lanes["base"].weights
    plan = B.decode_step_plan(lw)
    assert plan is not None and lw.block_step is not None
    if family == "qwen2":
        assert all(layer.qkv.bias is not None for layer in lw.layers)
        assert plan.qkv_bias is not None and all(plan.qkv_bias) and plan.qk_norms is None
    else:
        assert all(layer.q_norm is not None and layer.k_norm is not None for layer in lw.layers)
        assert plan.qk_norms is not None and all(plan.qk_norms) and plan.qkv_bias is None
    o = lw.layers[1].proj["o_proj"]
    o.bias = torch.zeros(o.weight.shape[0])
    assert B.decode_step_plan(lw) is None
    o.bias = None
    assert B.decode_step_plan(lw) is not None
    if family == "qwen3":
        k_norm, lw.layers[0].k_norm = lw.layers[0].k_norm, None
        assert B.decode_step_plan(lw) is None
        lw.layers[0].k_norm = k_norm


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "phi3"])
def test_decode_step_plan_refuses_the_other_families(family, kernel, tokenizer, tmp_path):
    """The switches the kernel does not compute ((1 + w) and sandwich norms, embedding scale, GELU, two RoPEs,
    partial RoPE) keep the layer loop."""
    import ccft

    path = make_family_folder(tmp_path / family, tokenizer, family)
    lw = SharedPrefillEngine(ccft.load_base(str(path)), decode="eager").lanes["base"].weights
    assert lw.block_step is None and B.decode_step_plan(lw) is None


def test_fused_logits_equal_the_layer_loop(family_dir, kernel, tokenizer, gsm8k_rows, monkeypatch):
    """Per step, every row's logits and the tail pool's K/V of the fused step equal the eager layer loop's
    (fp32 rounding), with the same greedy tokens: rows with their own prefix row, one LoRA adapter on every
    row, the base and two adapters (ranks 4, 8) mixed, four rows reading one prefix row (one with a suffix),
    readers of rows 2 and 0 of three. Qwen3 then again with a random [q; k; v] bias given to its lane (both
    engines; the plan re-made): a bias and the q / k norms in one layer."""
    import ccft

    family, path = family_dir
    base = ccft.load_base(str(path))
    loras = {"math": make_lora(base, "math", seed=3, r=4), "code": make_lora(base, "code", seed=5, r=8)}
    fused, loop, results = _engines(base, loras, monkeypatch)
    for prompts, reads in _cases(tokenizer, gsm8k_rows):
        _assert_fused_equals_loop(fused, loop, results, prompts, reads)
    if family != "qwen3":
        return
    lw_f, lw_l = fused.lanes["base"].weights, loop.lanes["base"].weights
    g = torch.Generator().manual_seed(11)
    for lf, ll in zip(lw_f.layers, lw_l.layers, strict=True):
        bias = 0.3 * torch.randn(lf.qkv.weight.shape[0], generator=g)
        lf.qkv.bias, ll.qkv.bias = bias, bias.clone()
    lw_f.block_step = B.decode_step_plan(lw_f)
    assert lw_f.block_step.qkv_bias is not None and lw_f.block_step.qk_norms is not None
    for prompts, reads in _cases(tokenizer, gsm8k_rows):
        _assert_fused_equals_loop(fused, loop, results, prompts, reads)


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_step_threads(family_dir, threads, kernel, tokenizer, gsm8k_rows, monkeypatch):
    """With 1 and 2 threads (the kernel's task split: with 2, a task per query head at batch 1 and per KV head
    at 3 rows; with 1, per KV head) the fused step equals the layer loop on the rows of own prefix rows."""
    import ccft

    base = ccft.load_base(str(family_dir[1]))
    loras = {"math": make_lora(base, "math", seed=3, r=4), "code": make_lora(base, "code", seed=5, r=8)}
    fused, loop, results = _engines(base, loras, monkeypatch)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for prompts, reads in _cases(tokenizer, gsm8k_rows)[:3]:
            _assert_fused_equals_loop(fused, loop, results, prompts, reads)
    finally:
        torch.set_num_threads(before)


def test_engine_greedy_equals_reference(family_dir, kernel, tokenizer, gsm8k_rows, monkeypatch):
    """Greedy generation through ``SharedPrefillEngine`` (the fused step: fp32 lane, at most
    ``F32_FUSED_ROWS`` rows) equals ``ccft.generate``, the reference path (transformers' own forward), for
    the base and a LoRA decoder on ragged prompts."""
    import ccft
    from ccft.inference import model as M

    base = ccft.load_base(str(family_dir[1]))
    lora = make_lora(base, "math", seed=3, r=4)
    engine = SharedPrefillEngine(base, {"math": lora}, decode="eager")
    assert engine.lanes["base"].weights.block_step is not None
    results = []
    real = M.decode_step_layers
    monkeypatch.setattr(M, "decode_step_layers", lambda *a, **k: results.append(1) or real(*a, **k))
    prompts = _prompts(tokenizer, gsm8k_rows, 3)
    refs = {
        "base": ccft.generate(prompts, mode="base", base=base, max_new_tokens=N_NEW),
        "math": ccft.generate(prompts, mode="prefillshare", decoder=lora, max_new_tokens=N_NEW),
    }
    with engine.prefill(prompts) as h:
        for name, want in refs.items():
            got = engine.generate(h, decoder=name, max_new_tokens=N_NEW)
            assert [g.token_ids for g in got] == [g.token_ids for g in want], name
    assert results  # the fused step ran


def _logits_of_handles(engine, handles, reads, new=N_NEW):
    """Per step, the logits ``(V,)`` of each request, greedy, and the tail pool's K/V of the requests' rows at
    the end: ``handles`` the prompt batches (one prefill each: sessions with their own contexts and widths),
    ``reads`` ``(handle, row, decoder[, suffix ids])`` (several may read one prompt row)."""
    held = [engine.prefill(p) for p in handles]
    try:
        ids = [
            engine.add_request(
                held[r[0]],
                r[1],
                decoder=r[2],
                max_new_tokens=new,
                ignore_eos=True,
                suffix_ids=r[3] if len(r) > 3 else None,
            )
            for r in reads
        ]
        steps = []
        while engine.active:
            by_id = {o.request_id: o for o in engine.step(return_logits=True)}
            steps.append([(by_id[r].token_id, by_id[r].logits.clone()) for r in ids if r in by_id])
        n = len(reads)
        kv = {lane: (e.pool.k[:, :n].clone(), e.pool.v[:, :n].clone()) for lane, e in engine.lanes.items()}
    finally:
        for h in held:
            h.unref()
    return steps, kv


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_step_over_several_handles_equals_the_layer_loop(
    family, kernel, tokenizer, gsm8k_rows, tmp_path, monkeypatch
):
    """Rows of three handles (three sessions' contexts of different widths: 1, 2 and 1 prompt rows) in one
    decode step run the fused step once (per row its own prefix region: ``row_views``), not the layer loop,
    and every row's logits, greedy tokens and tail K/V equal the layer loop's: the base and two adapters
    mixed, two agents on one context row, a handle whose second row alone is read; and with more rows than
    the fused step takes (``max_rows`` 4 of 6), the fused step in two parts, equal too."""
    import ccft
    from ccft.inference import model as M

    path = make_family_folder(tmp_path / family, tokenizer, family, seed=1, scale=SCALE)
    base = ccft.load_base(str(path))
    loras = {"math": make_lora(base, "math", seed=3, r=4), "code": make_lora(base, "code", seed=5, r=8)}
    fused, loop, results = _engines(base, loras, monkeypatch)
    several = []
    spied = M.decode_step_layers

    def record(*a, **k):
        several.append(k.get("row_views") is not None)
        return spied(*a, **k)

    monkeypatch.setattr(M, "decode_step_layers", record)
    p = _prompts(tokenizer, gsm8k_rows, 4)
    handles = [[p[0]], [p[1], p[2]], [p[3][:9]]]
    reads = [(0, 0, "math"), (1, 0, "base"), (2, 0, "code"), (0, 0, "code"), (1, 1, "math"), (2, 0, "base")]
    a, kv_a = _logits_of_handles(fused, handles, reads)
    assert several and all(several) and all(results), (several, results)  # one fused call per step
    b, kv_b = _logits_of_handles(loop, handles, reads)
    assert [[t for t, _ in s] for s in a] == [[t for t, _ in s] for s in b]
    for sa, sb in zip(a, b, strict=True):
        for (_, la), (_, lb) in zip(sa, sb, strict=True):
            torch.testing.assert_close(la, lb, **LOGITS_TOL)
    for lane in kv_a:
        torch.testing.assert_close(kv_a[lane], kv_b[lane], **KV_TOL)
    # beyond the fused step's rows (here 4 of the 6): the fused step in parts (4 + 2 rows), not the loop
    import dataclasses

    lw = fused.lanes["base"].weights
    full, lw.block_step = lw.block_step, dataclasses.replace(lw.block_step, max_rows=4)
    several.clear()
    a, kv_a = _logits_of_handles(fused, handles, reads)
    lw.block_step = full
    assert len(several) == 2 * len(a) and all(several), several  # two kernel calls a step
    assert [[t for t, _ in s] for s in a] == [[t for t, _ in s] for s in b]
    for sa, sb in zip(a, b, strict=True):
        for (_, la), (_, lb) in zip(sa, sb, strict=True):
            torch.testing.assert_close(la, lb, **LOGITS_TOL)
    for lane in kv_a:
        torch.testing.assert_close(kv_a[lane], kv_b[lane], **KV_TOL)
    # (1, 1, ...) alone of its handle's two rows: the table path; no other row of handle 1 is read
    a, _ = _logits_of_handles(fused, handles, [(1, 1, "math"), (2, 0, "code")])
    b, _ = _logits_of_handles(loop, handles, [(1, 1, "math"), (2, 0, "code")])
    assert [[t for t, _ in s] for s in a] == [[t for t, _ in s] for s in b]
    for sa, sb in zip(a, b, strict=True):
        for (_, la), (_, lb) in zip(sa, sb, strict=True):
            torch.testing.assert_close(la, lb, **LOGITS_TOL)
