"""Block weights (``ccft.inference.blocks``): the base's linear layers computed from GGUF Q4_1 / Q8_0 blocks.

A tiny Llama is quantised into blocks and written as a GGUF plus the fp32 folder dequantised from it
(``conftest.make_block_folder``: no download), so the fp32 path is the exact reference. Skipped when no
C++ compiler can build the kernel.
"""

from __future__ import annotations

import logging

import pytest
import torch

from ccft.core.errors import ConfigError
from ccft.inference import SharedPrefillEngine
from ccft.inference import blocks as B
from conftest import make_block_folder, make_lora

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def kernel():
    k = B.load_kernel()
    if k is None:
        pytest.skip("no C++ compiler builds the block kernel here")
    return k


@pytest.fixture(scope="module")
def block_dir(tmp_path_factory, tokenizer):
    return make_block_folder(tmp_path_factory.mktemp("blocks"), tokenizer)


@pytest.fixture(scope="module", params=["Q4_1", "Q8_0"])
def proj_format_dir(request, tmp_path_factory, tokenizer):
    """Block folders whose projections are Q4_1 or Q8_0 (the LM head Q8_0)."""
    folder = tmp_path_factory.mktemp(f"blocks_{request.param}")
    return make_block_folder(folder, tokenizer, formats={"proj": request.param})


def _random_blocks(fmt: str, n: int, k: int, kernel, seed: int):
    """A random (n, k) matrix quantised to ``fmt`` -> (BlockMatrix, its fp32 dequantisation by gguf-py)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.1).numpy().astype(np.float32)
    qtype = GGMLQuantizationType[fmt]
    raw = quantize(w, qtype)
    ref = torch.from_numpy(dequantize(raw, qtype).reshape(n, k).copy())
    return B.BlockMatrix(fmt, torch.from_numpy(raw.copy()), n, k, kernel), ref


def test_source_gguf_found(block_dir):
    from ccft.core.models import source_gguf

    assert source_gguf(str(block_dir)) == block_dir.parent / "model.gguf"


def test_dequantised_blocks_equal_fp32_weights_bit_for_bit(block_dir, kernel):
    import ccft

    base = ccft.load_base(str(block_dir))
    blocks = B.read_gguf_blocks(block_dir.parent / "model.gguf", base.config, kernel)
    # 2 layers x 7 projections + the LM head; the F32 embedding and norms are left out
    assert sorted(blocks) == sorted([f"layers.{i}.{p}" for i in range(2) for p in B_PROJ] + ["lm_head"])
    assert {b.fmt for k, b in blocks.items() if k != "lm_head"} == {"Q4_1"} and blocks[
        "lm_head"
    ].fmt == "Q8_0"
    params = dict(base.model.named_parameters())
    for key, b in blocks.items():
        if key == "lm_head":
            w = params["lm_head.weight"]
        else:
            _, i, proj = key.split(".")
            group = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            w = params[f"model.layers.{i}.{group}.{proj}.weight"]
        assert torch.equal(b.dequantize(), w), key  # q / k rows put back in HF's order too


B_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("n,k", [(1, 32), (37, 96), (129, 576), (16, 1536)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 17, 64, 70])
def test_kernel_matmul_matches_torch(fmt, n, k, rows, kernel):
    bm, w = _random_blocks(fmt, n, k, kernel, seed=n * 1000 + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    y = bm.matmul(x)
    ref = (x.double() @ w.double().T).float()
    assert y.shape == (rows, n) and y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * k**0.5)
    # a strided input (a column slice: rows not contiguous) and a leading batch dimension
    wide = torch.randn(rows, k + 32, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(
        bm.matmul(wide[:, 16 : 16 + k]),
        (wide[:, 16 : 16 + k].double() @ w.double().T).float(),
        rtol=1e-5,
        atol=1e-4,
    )
    assert bm.matmul(x.view(1, rows, k)).shape == (1, rows, n)


@pytest.mark.parametrize("rows", [1, 2, 6, 80])
def test_fused_mlp_matches_torch(rows, kernel):
    gate, wg = _random_blocks("Q4_1", 45, 64, kernel, seed=1)
    up, wu = _random_blocks("Q8_0", 45, 64, kernel, seed=2)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(3))
    ref = torch.nn.functional.silu(x.double() @ wg.double().T) * (x.double() @ wu.double().T)
    torch.testing.assert_close(B.fused_mlp(gate, up, x), ref.float(), rtol=1e-5, atol=1e-5)


def test_concat_stacks_rows(kernel):
    a, wa = _random_blocks("Q4_1", 5, 64, kernel, seed=4)
    b, wb = _random_blocks("Q4_1", 3, 64, kernel, seed=5)
    c, _ = _random_blocks("Q8_0", 3, 64, kernel, seed=6)
    stacked = B.concat([a, b])
    assert (stacked.n, stacked.k) == (8, 64) and torch.equal(stacked.dequantize(), torch.cat([wa, wb]))
    assert B.concat([a, c]) is None  # formats differ: the caller keeps an fp32 copy


def _prompts(tokenizer, gsm8k_rows, n):
    from ccft.core.tokens import tokenize_prompt

    return [
        tokenize_prompt(tokenizer, r["prompt"], chat_template=False)[: 12 + 5 * i]
        for i, r in enumerate(gsm8k_rows[:n])
    ]


def _greedy(engine, prompts, decoder="base", new=12):
    with engine.prefill(prompts) as h:
        return [g.token_ids for g in engine.generate(h, decoder=decoder, max_new_tokens=new, ignore_eos=True)]


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_engine_greedy_equals_fp32_path(proj_format_dir, decode, kernel, tokenizer, gsm8k_rows):
    import ccft

    path = proj_format_dir
    base = ccft.load_base(str(path))
    lora = make_lora(base, "math", seed=3, r=4)
    blocks = SharedPrefillEngine(base, {"math": lora}, decode=decode, block_weights="auto")
    fp32 = SharedPrefillEngine(base, {"math": lora}, decode=decode, block_weights="off")
    assert blocks.block_weights == path.parent / "model.gguf" and fp32.block_weights is None
    lw = blocks.lanes["base"].weights
    assert lw.lm_head.blocks is not None and all(
        layer.proj["down_proj"].blocks is not None for layer in lw.layers
    )
    for n in (1, 3, 8):
        prompts = _prompts(tokenizer, gsm8k_rows, n)
        for dec in ("base", "math"):
            assert _greedy(blocks, prompts, dec) == _greedy(fp32, prompts, dec), (n, dec)


def test_compiled_step_calls_the_kernel_as_ops(proj_format_dir, kernel, tokenizer, gsm8k_rows, monkeypatch):
    """decode='compile' with block weights: the compiled step runs the kernel as the ``ccft::block_matmul`` /
    ``ccft::block_mlp`` ops (their implementations look the kernel up; eager code calls it directly) and its
    greedy tokens equal the eager fp32 engine's."""
    import ccft
    from ccft.inference import blocks as B

    torch._dynamo.reset()
    base = ccft.load_base(str(proj_format_dir))
    lora = make_lora(base, "math", seed=3, r=4)
    compiled = SharedPrefillEngine(base, {"math": lora}, decode="compile", block_weights="on")
    fp32 = SharedPrefillEngine(base, {"math": lora}, decode="eager", block_weights="off")
    looked_up = []
    monkeypatch.setattr(B, "load_kernel", lambda *, fresh=False: looked_up.append(1) or kernel)
    prompts = _prompts(tokenizer, gsm8k_rows, 3)
    for dec in ("base", "math"):
        assert _greedy(compiled, prompts, dec) == _greedy(fp32, prompts, dec), dec
    assert looked_up, "the compiled step never ran the kernel's ops"


def test_engine_logits_close_to_fp32(block_dir, kernel, tokenizer, gsm8k_rows):
    import ccft

    base = ccft.load_base(str(block_dir))
    prompts = _prompts(tokenizer, gsm8k_rows, 4)
    out = {}
    for setting in ("on", "off"):
        engine = SharedPrefillEngine(base, block_weights=setting)
        with engine.prefill(prompts) as h:
            ids = [engine.add_request(h, i, max_new_tokens=1, logprobs=5) for i in range(len(prompts))]
            out[setting] = {o.request_id: o.top_logprobs for o in engine.step()}
            out[setting] = [out[setting][r] for r in ids]
    for a, b in zip(out["on"], out["off"], strict=True):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert max(abs(x - y) for (_, x), (_, y) in zip(a, b, strict=True)) < 1e-4


def test_mismatched_weights_fall_back_or_raise(block_dir, kernel, caplog):
    import ccft

    base = ccft.load_base(str(block_dir))
    with torch.no_grad():
        base.model.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-3
    with caplog.at_level(logging.WARNING, logger="ccft.inference.blocks"):
        engine = SharedPrefillEngine(base, block_weights="auto")
    assert engine.block_weights is None
    assert engine.lanes["base"].weights.lm_head.blocks is None  # nothing attached when one check fails
    assert "layers.1.down_proj" in caplog.text and "fp32 weights kept" in caplog.text
    with pytest.raises(B.BlockMismatchError, match="layers.1.down_proj"):
        SharedPrefillEngine(base, block_weights="on")


def test_settings(tiny_base, block_dir, kernel, monkeypatch):
    import ccft

    # a plain fp32 checkpoint: auto keeps fp32, on names what is missing
    assert SharedPrefillEngine(tiny_base, block_weights="auto").block_weights is None
    with pytest.raises(ConfigError, match="not dequantised from a GGUF"):
        SharedPrefillEngine(tiny_base, block_weights="on")
    with pytest.raises(ConfigError, match="use auto, on, off"):
        SharedPrefillEngine(tiny_base, block_weights="maybe")
    # an explicit GGUF path turns them on; the default is off, CCFT_BLOCK_WEIGHTS=auto (or 1) turns it on
    base = ccft.load_base(str(block_dir))
    gguf = block_dir.parent / "model.gguf"
    assert SharedPrefillEngine(base, block_weights=str(gguf)).block_weights == gguf
    monkeypatch.delenv("CCFT_BLOCK_WEIGHTS", raising=False)
    assert SharedPrefillEngine(base).block_weights is None
    monkeypatch.setenv("CCFT_BLOCK_WEIGHTS", "auto")
    assert SharedPrefillEngine(base).block_weights == gguf
    monkeypatch.setenv("CCFT_BLOCK_WEIGHTS", "0")
    assert SharedPrefillEngine(base).block_weights is None
    monkeypatch.setenv("CCFT_BLOCK_WEIGHTS", "sometimes")
    with pytest.raises(ConfigError, match="CCFT_BLOCK_WEIGHTS"):
        SharedPrefillEngine(base)
    monkeypatch.delenv("CCFT_BLOCK_WEIGHTS")
    with pytest.raises(ConfigError, match="decode eager, static or compile"):
        SharedPrefillEngine(ccft.load_base(str(block_dir), dtype="bfloat16"), block_weights="on")


def test_compiler_failure_falls_back_to_fp32(block_dir, kernel, tmp_path, monkeypatch, caplog):
    import ccft

    monkeypatch.setenv("CCFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails
    try:
        with caplog.at_level(logging.WARNING, logger="ccft.inference.blocks"):
            assert B.load_kernel(fresh=True) is None
        assert caplog.text.count("block kernel unavailable (block weights, the fused decode step)") == 1
        assert "failed on blocks.cpp" in caplog.text
        assert not list((tmp_path / "cache").rglob("*.so"))  # no half-written kernel left behind
        base = ccft.load_base(str(block_dir))
        engine = SharedPrefillEngine(base, block_weights="auto")
        assert engine.block_weights is None  # auto: fp32
        assert engine.lanes["base"].weights.block_step is None  # and the layer loop of PyTorch ops
        with pytest.raises(ConfigError, match="could not be built"):
            SharedPrefillEngine(base, block_weights="on")
    finally:
        monkeypatch.undo()
        assert B.load_kernel(fresh=True) is not None


def test_kernel_file_is_built_once_and_reused(kernel, tmp_path, monkeypatch):
    import shutil

    monkeypatch.setenv("CCFT_CACHE", str(tmp_path))
    compiler = shutil.which("g++") or shutil.which("c++")
    first = B.build_kernel(compiler)
    assert first.parent == tmp_path / "kernels" and first.name.startswith("blocks-") and first.suffix == ".so"
    stat = first.stat()
    second = B.build_kernel(compiler)
    assert second == first and (second.stat().st_ino, second.stat().st_mtime_ns) == (
        stat.st_ino,
        stat.st_mtime_ns,
    )
    # no temporary left: the build and the record of the instruction sets it targets
    assert sorted(p.name for p in (tmp_path / "kernels").iterdir()) == sorted(
        [first.name, B.isa_record(first).name]
    )
    assert B.BlockKernel(second).lib.ccft_blocks_abi() == B.ABI


def test_a_build_for_an_isa_this_cpu_lacks_is_never_loaded(kernel, tmp_path, monkeypatch):
    """A cache shared by CPUs of different ISAs (a cluster's home folder): a build recorded as AVX-512 found
    where the CPU has no AVX-512 is not loaded (an illegal instruction would kill the process) but rebuilt
    for this CPU; the ISA is part of the cache key, so each ISA builds its own file."""
    import json
    import shutil

    monkeypatch.setenv("CCFT_CACHE", str(tmp_path))
    monkeypatch.setitem(B._kernel, "lib", kernel)  # load_kernel(fresh=True) below: the module's kernel after
    compiler = shutil.which("g++") or shutil.which("c++")
    real = B.cpu_features()
    assert real is not None and B.target_isa(compiler) and set(B.target_isa(compiler)) <= real
    # this CPU, as an AVX2 node sees it: no AVX-512 in its flags nor in what -march=native resolves to
    no512 = frozenset(f for f in real if not f.startswith("avx512"))
    monkeypatch.setattr(B, "cpu_features", lambda: no512)
    targets = {"-march=native": tuple(f for f in B.target_isa(compiler) if not f.startswith("avx512"))}
    resolve = B.target_isa
    monkeypatch.setattr(B, "target_isa", lambda c, flags=B.FLAGS: targets.get(flags[1], resolve(c, flags)))
    path = B.kernel_path(compiler)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\x7fELF not a loadable library: dlopen of it would fail")  # the AVX-512 node's build
    B.isa_record(path).write_text(json.dumps({"isa": ["avx2", "avx512bw", "avx512f", "fma"]}))
    assert B.missing_isa(path) == ["avx512bw", "avx512f"]
    loaded = B.load_kernel(fresh=True)
    assert loaded is not None and loaded.path == path and loaded.lib.ccft_blocks_abi() == B.ABI
    assert B.missing_isa(path) == [] and json.loads(B.isa_record(path).read_text())["isa"] == list(
        targets["-march=native"]
    )
    # the AVX-512 node's key differs from this node's: the two builds never share a file
    monkeypatch.setattr(B, "target_isa", resolve)
    assert (B.kernel_path(compiler) == path) is (real == no512)
    # a build with no record is not trusted either
    B.isa_record(path).unlink()
    assert B.missing_isa(path) == ["(no ISA record)"]
    monkeypatch.setattr(B, "target_isa", lambda c, flags=B.FLAGS: targets.get(flags[1], resolve(c, flags)))
    assert B.build_kernel(compiler) == path and B.missing_isa(path) == []


@pytest.mark.parametrize("build", ["plain", "avx2"])
def test_other_builds_match_torch(kernel, tmp_path, monkeypatch, build):
    """The kernel built without ``-march=native`` (the plain C++ loops) and built without AVX-512 (the AVX2
    path, on a CPU that has AVX-512; the same build as the default elsewhere) compute the same products."""
    import shutil

    monkeypatch.setenv("CCFT_CACHE", str(tmp_path))
    if build == "plain":
        flags = tuple(f for f in B.FLAGS if f != "-march=native")
    else:
        if not kernel.avx2:
            pytest.skip("this CPU has no AVX2")
        flags = (*B.FLAGS, "-mno-avx512f")
    plain = B.BlockKernel(B.build_kernel(shutil.which("g++") or shutil.which("c++"), flags))
    features = kernel.lib.ccft_blocks_features()
    assert kernel.avx2 is bool(features & 1) and kernel.avx512 is bool(features & 2)
    assert plain.avx512 is False and plain.avx2 is (build == "avx2")
    assert plain.isa == {"plain": "plain C++", "avx2": "AVX2+FMA"}[build]
    for fmt in ("Q4_1", "Q8_0"):
        bm, w = _random_blocks(fmt, 19, 96, plain, seed=9)
        assert torch.equal(bm.dequantize(), w)
        for rows in (1, 6, 11):
            x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
            torch.testing.assert_close(
                bm.matmul(x), (x.double() @ w.double().T).float(), rtol=1e-5, atol=1e-5
            )
        up, wu = _random_blocks(fmt, 19, 96, plain, seed=10)
        ref = torch.nn.functional.silu(x.double() @ w.double().T) * (x.double() @ wu.double().T)
        torch.testing.assert_close(B.fused_mlp(bm, up, x), ref.float(), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def other_kernels(kernel, tmp_path_factory):
    """The kernel built without ``-march=native`` (plain C++) and, on an AVX-512 CPU, without AVX-512
    (AVX2)."""
    import os
    import shutil

    cache = tmp_path_factory.mktemp("kernels")
    old = os.environ.get("CCFT_CACHE")
    os.environ["CCFT_CACHE"] = str(cache)
    try:
        cxx = shutil.which("g++") or shutil.which("c++")
        out = {"plain": B.BlockKernel(B.build_kernel(cxx, tuple(f for f in B.FLAGS if f != "-march=native")))}
        if kernel.avx512:
            out["avx2"] = B.BlockKernel(B.build_kernel(cxx, (*B.FLAGS, "-mno-avx512f")))
    finally:
        if old is None:
            os.environ.pop("CCFT_CACHE")
        else:
            os.environ["CCFT_CACHE"] = old
    return out


def _stepped(engine, prompts, decoders, new=8):
    """Per step, each row's (token, top-5 log-probabilities), and the tail pool's K/V of the rows after it."""
    with engine.prefill(prompts) as h:
        ids = [
            engine.add_request(h, i, decoder=d, max_new_tokens=new, logprobs=5, ignore_eos=True)
            for i, d in enumerate(decoders)
        ]
        out = []
        while engine.active:
            by_id = {o.request_id: o for o in engine.step()}
            out.append([(by_id[r].token_id, by_id[r].top_logprobs) for r in ids if r in by_id])
        kv = {
            lane: (e.pool.k[:, : len(prompts), :, :new].clone(), e.pool.v[:, : len(prompts), :, :new].clone())
            for lane, e in engine.lanes.items()
        }
    return out, kv


def _assert_steps_close(a, b):
    assert [[t for t, _ in s] for s in a] == [[t for t, _ in s] for s in b]  # greedy tokens
    for sa, sb in zip(a, b, strict=True):
        for (_, la), (_, lb) in zip(sa, sb, strict=True):
            assert [t for t, _ in la] == [t for t, _ in lb]
            assert max(abs(x - y) for (_, x), (_, y) in zip(la, lb, strict=True)) < 1e-4


def test_decode_step_plan_refuses_head_shapes_the_kernel_cannot_run(block_dir, kernel):
    """``decode_step_plan`` (the fused step's eligibility) returns a plan for the tiny lane and None for the
    same lane with a head dim above ``MAX_HEAD_DIM``, more than ``MAX_GROUP`` query heads per KV head, or
    query heads that are not a multiple of the KV heads (the kernel's fixed buffers, its grouping)."""
    import dataclasses

    import ccft

    lw = SharedPrefillEngine(ccft.load_base(str(block_dir)), decode="eager").lanes["base"].weights
    assert B.decode_step_plan(lw) is not None
    for change in (
        {"head_dim": B.MAX_HEAD_DIM + 1},
        {"heads": B.MAX_GROUP + 1, "kv_heads": 1},
        {"heads": lw.kv_heads * 2 + 1},
    ):
        assert B.decode_step_plan(dataclasses.replace(lw, **change)) is None, change
    assert B.decode_step_plan(dataclasses.replace(lw, heads=B.MAX_GROUP, kv_heads=1)) is not None


def _fused_and_loop(base, loras, build, other_kernels, monkeypatch):
    """Two engines computing from ``base``'s blocks: the fused step (on ``build``'s kernel) and the layer
    loop; and the list the fused step's calls are counted in."""
    from ccft.inference import model as M

    fused = SharedPrefillEngine(base, loras, decode="eager", block_weights="on")
    loop = SharedPrefillEngine(base, loras, decode="eager", block_weights="on")
    plan = fused.lanes["base"].weights.block_step
    assert plan is not None and plan.dims[0] == len(base.model.model.layers)
    if build != "native":
        plan.kernel = other_kernels[build]
    loop.lanes["base"].weights.block_step = None
    calls = []
    real = M.decode_step_layers
    monkeypatch.setattr(M, "decode_step_layers", lambda *a, **k: calls.append(1) or real(*a, **k))
    return fused, loop, calls


def _assert_fused_equals_loop(fused, loop, calls, stepped, *args):
    """``stepped(engine, *args)`` (``_stepped`` or ``_stepped_reads``) on both engines: the fused step ran,
    its steps are close to the loop's (``_assert_steps_close``) and the tail pools' K/V agree."""
    before = len(calls)
    a, kv_a = stepped(fused, *args)
    assert len(calls) > before, args  # the fused step ran
    b, kv_b = stepped(loop, *args)
    _assert_steps_close(a, b)
    for lane in kv_a:
        torch.testing.assert_close(kv_a[lane], kv_b[lane], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("build", ["native", "plain", "avx2"])
def test_fused_decode_step_equals_the_layer_loop(
    proj_format_dir, build, kernel, other_kernels, tokenizer, gsm8k_rows, monkeypatch
):
    """The fused step (``blocks.decode_step_layers``: every layer in one kernel call) against the eager layer
    loop on the same blocks: per-step log-probabilities within fp32 rounding, the same greedy tokens, the
    same K/V written into the tail pool; rows of different prompt lengths (left padding), the base, one LoRA
    decoder on every row, and a batch mixing the base and two LoRA decoders (each row its own adapter)."""
    import ccft

    if build != "native" and build not in other_kernels:
        pytest.skip(f"no {build} build on this CPU")
    base = ccft.load_base(str(proj_format_dir))
    loras = {"math": make_lora(base, "math", seed=3, r=4), "code": make_lora(base, "code", seed=5, r=8)}
    fused, loop, calls = _fused_and_loop(base, loras, build, other_kernels, monkeypatch)
    cases = [["base"], ["math"], ["base", "base", "base"], ["math", "math", "math"], ["code", "base", "math"]]
    for decoders in cases:
        prompts = _prompts(tokenizer, gsm8k_rows, len(decoders))
        _assert_fused_equals_loop(fused, loop, calls, _stepped, prompts, decoders)


def test_fused_decode_step_of_an_fp32_lane_equals_the_layer_loop(block_dir, kernel, tokenizer, gsm8k_rows):
    """An fp32 lane (no block weights) runs the fused step from its fp32 weights read in place (``"F32"``
    matrices) up to ``F32_FUSED_ROWS`` rows: greedy tokens and log-probabilities equal the oneDNN layer loop's
    within fp32 rounding, for the base and for a batch mixing it with a LoRA decoder."""
    import ccft

    base = ccft.load_base(str(block_dir))
    lora = {"math": make_lora(base, "math", seed=3, r=4)}
    fused = SharedPrefillEngine(base, lora, decode="eager", block_weights="off")
    loop = SharedPrefillEngine(base, lora, decode="eager", block_weights="off")
    plan = fused.lanes["base"].weights.block_step
    assert plan is not None and set(plan.kinds) == {B.KINDS["F32"]} and plan.max_rows == B.F32_FUSED_ROWS
    loop.lanes["base"].weights.block_step = None
    for decoders in (["base", "base", "base"], ["math", "base", "math"]):
        prompts = _prompts(tokenizer, gsm8k_rows, len(decoders))
        _assert_steps_close(_stepped(fused, prompts, decoders)[0], _stepped(loop, prompts, decoders)[0])


def test_fused_step_reads_every_layer_from_one_view(block_dir, kernel, tokenizer, gsm8k_rows, monkeypatch):
    """The fused step takes a handle's prefix as one ``(L, P, h, p, d)`` view of keys and one of values
    (``PrefixHandle.every_layer``: the kernel's per-layer addresses computed from the first) instead of 2·L
    per-layer views; its steps are bit-identical to the per-layer form's (same addresses, same kernel)."""
    import ccft
    from ccft.inference import model as M
    from ccft.inference.handles import PrefixHandle

    base = ccft.load_base(str(block_dir))
    lora = {"math": make_lora(base, "math", seed=3, r=4)}
    engine = SharedPrefillEngine(base, lora, decode="eager", block_weights="on")
    forms = []
    real = M.decode_step_layers
    monkeypatch.setattr(
        M,
        "decode_step_layers",
        lambda p, x, c, s, k, *a, **kw: forms.append(type(k)) or real(p, x, c, s, k, *a, **kw),
    )
    decoders = ["math", "base", "math"]
    prompts = _prompts(tokenizer, gsm8k_rows, len(decoders))
    layered, kv_layered = _stepped(engine, prompts, decoders)
    assert forms and set(forms) == {torch.Tensor}
    with pytest.raises(ValueError, match="layers"):  # a view of too few layers is refused, not read past
        with engine.prefill(prompts[:1]) as h:
            k, v = h.every_layer()
            B.decode_step_layers(
                engine.lanes["base"].weights.block_step,
                torch.zeros(1, k.shape[-1] * base.model.config.num_attention_heads),
                torch.zeros(1, k.shape[-1]),
                torch.zeros(1, k.shape[-1]),
                k[:-1],
                v[:-1],
                h.key_start,
                engine.lanes["base"].pool.k,
                engine.lanes["base"].pool.v,
                torch.zeros(1, dtype=torch.long),
                torch.ones(1, dtype=torch.long),
            )
    monkeypatch.setattr(PrefixHandle, "every_layer", lambda self: None)  # the per-layer form
    forms.clear()
    per_layer, kv_per_layer = _stepped(engine, prompts, decoders)
    assert forms and set(forms) == {list}
    assert layered == per_layer  # tokens and log-probabilities, exactly
    for lane in kv_layered:
        assert all(torch.equal(a, b) for a, b in zip(kv_layered[lane], kv_per_layer[lane], strict=True))


def _stepped_reads(engine, prompts, reads, new=6):
    """As ``_stepped``, for requests ``reads = [(prompt row, decoder, suffix ids)]`` on one handle: several
    requests may read one prompt row (agents sharing a context)."""
    with engine.prefill(prompts) as h:
        ids = [
            engine.add_request(
                h, row, decoder=d, max_new_tokens=new, logprobs=5, ignore_eos=True, suffix_ids=suffix
            )
            for row, d, suffix in reads
        ]
        out = []
        while engine.active:
            by_id = {o.request_id: o for o in engine.step()}
            out.append([(by_id[r].token_id, by_id[r].top_logprobs) for r in ids if r in by_id])
        n = len(reads)
        kv = {lane: (e.pool.k[:, :n].clone(), e.pool.v[:, :n].clone()) for lane, e in engine.lanes.items()}
    return out, kv


@pytest.mark.parametrize("weights", ["blocks", "fp32"])
def test_fused_decode_step_with_shared_prefix_rows_equals_the_layer_loop(
    proj_format_dir, weights, kernel, tokenizer, gsm8k_rows, monkeypatch
):
    """Several requests reading one prompt row of a handle (agents on one context: the prefix group's table of
    readers, ``model._prefix_rows``) run the fused step with a prefix row per batch row: per step the top-5
    log-probabilities within 1e-4, the greedy tokens and the tail pool's K/V equal the layer loop's. Covered:
    four decoders on one context row (one with its own suffix tokens), readers of rows 2 and 0 of three
    (the rows read in place), and of rows 0 and 5 of six (the rows gathered)."""
    import ccft
    from ccft.inference import model as M

    base = ccft.load_base(str(proj_format_dir))
    loras = {"math": make_lora(base, "math", seed=3, r=4), "code": make_lora(base, "code", seed=5, r=8)}
    setting = "on" if weights == "blocks" else "off"
    fused = SharedPrefillEngine(base, loras, decode="eager", block_weights=setting)
    loop = SharedPrefillEngine(base, loras, decode="eager", block_weights=setting)
    assert fused.lanes["base"].weights.block_step is not None
    loop.lanes["base"].weights.block_step = None
    rows_seen = []
    real = M.decode_step_layers

    def spy(*a, **k):
        rows_seen.append(k.get("prefix_row"))
        return real(*a, **k)

    monkeypatch.setattr(M, "decode_step_layers", spy)
    suffix = tokenizer.encode(" Answer briefly.", add_special_tokens=False)
    cases = [
        (1, [(0, "base", None), (0, "math", None), (0, "code", suffix), (0, "math", None)], [0, 0, 0, 0]),
        (3, [(2, "math", None), (0, "base", None), (2, "code", None)], [2, 0, 2]),
        (6, [(0, "code", None), (5, "math", None)], [0, 5]),
    ]
    for n_prompts, reads, expect in cases:
        prompts = _prompts(tokenizer, gsm8k_rows, n_prompts)
        rows_seen.clear()
        a, kv_a = _stepped_reads(fused, prompts, reads)
        assert rows_seen and rows_seen[0] is not None  # the fused step ran, with a prefix row per batch row
        assert rows_seen[0].tolist() == expect
        b, kv_b = _stepped_reads(loop, prompts, reads)
        _assert_steps_close(a, b)
        for lane in kv_a:
            torch.testing.assert_close(kv_a[lane], kv_b[lane], rtol=1e-4, atol=1e-5)


@pytest.fixture(
    scope="module", params=[(192, 6, 1), (192, 3, 1), (96, 4, 2)], ids=["d32-g6", "d64-g3", "d24-g2"]
)
def head_shape_dir(request, tmp_path_factory, tokenizer):
    """Block folders of tiny Llamas with other head shapes than the default tiny one's (head dim 16, 2 query
    heads per KV head): (hidden, heads, KV heads) -> head dim 32 with 6 query heads per KV head, 64 with 3
    (SmolLM2-135M's shape) and 24 with 2."""
    hidden, heads, kv_heads = request.param
    folder = tmp_path_factory.mktemp(f"blocks_{hidden}_{heads}_{kv_heads}")
    return make_block_folder(folder, tokenizer, hidden=hidden, heads=heads, kv_heads=kv_heads)


def _long_prompts(tokenizer, gsm8k_rows, n):
    """``n`` prompts of 61, 74, 87, ... tokens (GSM8K questions one after another), for attention over more
    keys than a vector holds."""
    from ccft.core.tokens import tokenize_prompt

    text = [t for r in gsm8k_rows[:12] for t in tokenize_prompt(tokenizer, r["prompt"], chat_template=False)]
    return [text[7 * i : 7 * i + 61 + 13 * i] for i in range(n)]


@pytest.mark.parametrize("build", ["native", "plain", "avx2"])
def test_fused_attention_of_other_head_shapes_equals_the_layer_loop(
    head_shape_dir, build, kernel, other_kernels, tokenizer, gsm8k_rows, monkeypatch
):
    """The fused step's attention for head dims 32, 64 and 24 and 2-6 query heads per KV head, over 61-113
    keys (the vector paths of its softmax and its sums of values, and their remainders), against the eager
    layer loop: per-step top-5 log-probabilities within 1e-4, the same greedy tokens and tail K/V. With 2
    threads a batch of one row runs a task per query head and a batch of five a task per KV head (its query
    heads read each key and value once: 4 + 2 of 6, or 3); four agents on one context row are covered too."""
    import ccft

    if build != "native" and build not in other_kernels:
        pytest.skip(f"no {build} build on this CPU")
    base = ccft.load_base(str(head_shape_dir))
    fused, loop, calls = _fused_and_loop(
        base, {"math": make_lora(base, "math", seed=3, r=4)}, build, other_kernels, monkeypatch
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the kernel's task split depends on it (blocks.cpp: `per`)
    try:
        for decoders in (["math"], ["base", "math", "base", "math", "math"]):
            prompts = _long_prompts(tokenizer, gsm8k_rows, len(decoders))
            _assert_fused_equals_loop(fused, loop, calls, _stepped, prompts, decoders)
        suffix = tokenizer.encode(" Answer briefly.", add_special_tokens=False)
        reads = [(0, "base", None), (0, "math", None), (0, "math", suffix), (0, "base", None)]
        prompts = _long_prompts(tokenizer, gsm8k_rows, 1)
        _assert_fused_equals_loop(fused, loop, calls, _stepped_reads, prompts, reads)
    finally:
        torch.set_num_threads(threads)
