"""The dtype table (docs/design.md, fault classes K3 and K11): {fp32, bf16} × {base, LoRA, full-weight
decoder} × {reference ``ccft.generate``, engine eager, engine static, scheduler}.

Tolerance policy (K3): in fp32 every path's greedy tokens equal the fp32 reference exactly. In bf16
the arithmetic legitimately differs between paths (other kernels, other reduction orders), and one
near-tie changes every later token, so the check is top-1 agreement under teacher forcing:

* every path's own greedy tokens are the bf16 reference's argmax (``ccft.decoder_forward`` over
  C_base, or the base alone) given the same history, on at least ``BF16_MIN_AGREEMENT`` of the steps;
* the engine paths (eager, static), fed the bf16 reference's tokens, pick them on at least as many;
* the bf16 reference, fed the fp32 reference's tokens, picks them on at least as many.

Bound: 0.8 of 4 prompts × 8 tokens (at most 6 of 32 steps differ); measured on this tiny model
(lm_head sharpened ×10): 0.94-1.0 for every cell.

The LoRA decoder's adapter is created in fp32 by PEFT on the bf16 base (``autocast_adapter_dtype``);
registering it with an engine casts it to bf16 (``ccft.inference.weights.cast_adapter``), which the
world fixture does first, so every path of a dtype runs the same weights.
"""

from __future__ import annotations

import pytest
import torch

import ccft
from ccft.inference import SharedPrefillEngine
from ccft.serving.scheduler import Scheduler, ServeRequest
from conftest import make_full, make_lora, make_tiny_folder, ragged_prompts

N_NEW = 8
DTYPES = ("float32", "bfloat16")
KINDS = ("base", "lora", "full")
PATHS = ("reference", "eager", "static", "scheduler")
#: bf16: least fraction of teacher-forced steps whose argmax equals the reference token
BF16_MIN_AGREEMENT = 0.8


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tokenizer):
    return make_tiny_folder(tmp_path_factory.mktemp("dtypes"), tokenizer, seed=11, scale=10.0)


@pytest.fixture(scope="module")
def prompts(gsm8k_rows, tokenizer):
    return ragged_prompts(gsm8k_rows, tokenizer, 4, 6, 6)


@pytest.fixture(scope="module")
def worlds(folder):
    """dtype -> (base, {"lora": ..., "full": ...}), the same seeds in both dtypes."""
    out = {}
    for dtype in DTYPES:
        base = ccft.load_base(str(folder), dtype=dtype)
        full = make_full(base, 7)  # before any adapter is attached
        decs = {"lora": make_lora(base, "math", 1, 4), "full": full}  # served as "lora"
        SharedPrefillEngine(base, decoders=decs)  # registration casts the adapter to the base dtype
        out[dtype] = (base, decs)
    return out


def _reference(world, kind, prompts):
    base, decs = world
    if kind == "base":
        return ccft.generate(prompts, mode="base", base=base, max_new_tokens=N_NEW)
    return ccft.generate(prompts, mode="prefillshare", decoder=decs[kind], max_new_tokens=N_NEW)


@pytest.fixture(scope="module")
def refs(worlds, prompts):
    """(dtype, kind) -> the reference path's greedy token ids per prompt."""
    return {
        (dtype, kind): [g.token_ids for g in _reference(worlds[dtype], kind, prompts)]
        for dtype in DTYPES
        for kind in KINDS
    }


def _tokens(world, kind, path, prompts):
    base, decs = world
    if path == "reference":
        return [g.token_ids for g in _reference(world, kind, prompts)]
    eng = SharedPrefillEngine(
        base, decoders=decs, decode="eager" if path == "scheduler" else path, fill=float("nan")
    )
    if path == "scheduler":
        sched = Scheduler(eng)
        tickets = [sched.submit(ServeRequest(kind, p, max_new_tokens=N_NEW)) for p in prompts]
        sched.run_until_idle()
        assert [t.state for t in tickets] == ["done"] * len(prompts)
        return [t.result.token_ids for t in tickets]
    with eng.prefill(prompts) as h:
        return [g.token_ids for g in eng.generate(h, decoder=kind, max_new_tokens=N_NEW)]


def _forced_agreement(world, kind, decode, prompts, want) -> list[list[bool]]:
    """Per prompt, per step: the engine's argmax == ``want``'s token, fed ``want``'s tokens."""
    base, decs = world
    eng = SharedPrefillEngine(base, decoders=decs, decode=decode, fill=float("nan"))
    out = []
    with eng.prefill(prompts) as h:
        for row, toks in enumerate(want):
            assert toks, "the reference generated nothing to compare with"
            rid = eng.add_request(h, row, decoder=kind, forced_tokens=toks)
            got = []
            while eng.active:
                got += [int(o.logits.argmax()) for o in eng.step(return_logits=True) if o.request_id == rid]
            out.append([a == b for a, b in zip(got, toks, strict=True)])
    return out


def _ref_forced_agreement(world, kind, prompts, want) -> list[list[bool]]:
    """The reference path teacher-forced: argmax of ``ccft.decoder_forward`` / the base over
    prompt + ``want``."""
    base, decs = world
    model = base.model if kind == "base" else decs[kind].model
    out = []
    for p, toks in zip(prompts, want, strict=True):
        with torch.no_grad():
            if kind == "base":  # the base over prompt + tokens: position j predicts token j+1
                with base.base_weights() as model:  # LoRA adapters attached to the base disabled
                    logits = model(input_ids=torch.tensor([list(p) + list(toks)], device=base.device)).logits[
                        0
                    ]
                first = len(p) - 1
            else:  # prefillshare: C_base of p[:-k], the decoder over p[-k:] + tokens
                k = decs[kind].handoff_tokens
                cache = ccft.compute_base_cache(base, [list(p)], handoff_tokens=k)
                tail = torch.tensor([list(p[-k:]) + list(toks)], device=base.device)
                logits = ccft.decoder_forward(decs[kind], cache, tail)[0]
                first = k - 1
        pred = logits[first : first + len(toks)].argmax(-1).tolist()
        out.append([a == b for a, b in zip(pred, toks, strict=True)])
    return out


def _rate(agree) -> float:
    return sum(map(sum, agree)) / sum(map(len, agree))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_fp32_every_path_equals_the_reference(worlds, refs, prompts, kind, path):
    assert _tokens(worlds["float32"], kind, path, prompts) == refs[("float32", kind)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_bf16_top1_agreement(worlds, refs, prompts, kind, path):
    world = worlds["bfloat16"]
    want = refs[("bfloat16", kind)]
    got = _tokens(world, kind, path, prompts)
    # each token the path chose is the bf16 reference's top-1 given the same history
    assert _rate(_ref_forced_agreement(world, kind, prompts, got)) >= BF16_MIN_AGREEMENT
    if path == "reference":  # bf16 against fp32: the fp32 reference's tokens, teacher-forced in bf16
        assert (
            _rate(_ref_forced_agreement(world, kind, prompts, refs[("float32", kind)])) >= BF16_MIN_AGREEMENT
        )
    elif path != "scheduler":  # the engine teacher-forced on the bf16 reference's tokens
        assert _rate(_forced_agreement(world, kind, path, prompts, want)) >= BF16_MIN_AGREEMENT


@pytest.mark.parametrize("native", [True, False])
def test_half_precision_on_a_cpu_without_native_kernels_warns_with_the_fix(tiny_dir, monkeypatch, native):
    """bf16 on an AVX2-only CPU runs oneDNN's fallback kernels (7x slower than fp32 measured on one):
    load_base says so and names the fix; where the CPU has the kernels (or in fp32) it says nothing."""
    import warnings

    import ccft.core.models as models

    monkeypatch.setattr(models, "cpu_has_native_kernels", lambda dtype: native or dtype == torch.float32)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        base = ccft.load_base(str(tiny_dir), dtype="bfloat16")
        ccft.load_base(str(tiny_dir), dtype="float32")
    slow = [w for w in seen if "native bfloat16 matmul kernels" in str(w.message)]
    assert base.dtype == torch.bfloat16  # a warning, not a refusal: the run still works
    if native:
        assert not slow
    else:
        assert len(slow) == 1 and "dtype=float32" in str(slow[0].message)
        assert slow[0].filename == __file__  # points at the caller's line


def test_native_kernel_probe_answers_for_this_cpu():
    """float32 is always native; the half-precision answers agree with oneDNN's own probes on this machine."""
    from ccft.core.models import cpu_has_native_kernels

    assert cpu_has_native_kernels(torch.float32)
    assert cpu_has_native_kernels(torch.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert cpu_has_native_kernels(torch.float16) == torch.ops.mkldnn._is_mkldnn_fp16_supported()
