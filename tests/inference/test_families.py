"""The engine on every supported family == transformers' own forward (docs/models.md).

Per family (tiny random bases from ``tests/families.py``: llama and its rope scalings, mistral, qwen2, qwen3,
gemma2, gemma3, phi3; fp32, GQA, every family-specific weight perturbed): the engine's C_base equals the
model's own KV cache; its logits over a prompt equal the model's plain forward; teacher-forced decode steps of
the base, two LoRA decoders (different ranks and targets) and a full-weight decoder sharing one prefill equal
the reference path (``ccft.decoder_forward``, transformers' forward over C_base) at handoff k = 1 and 2, in
the eager and the static step; a chunked prefill writes the one-shot prefill's K/V; greedy generation equals
``ccft.generate``. Every buffer is NaN-filled before use. What the engine cannot reproduce is refused by name
before anything is allocated.
"""

from __future__ import annotations

import pytest
import torch

import ccft
from ccft.core.errors import ConfigError, IncompatibleModelError
from ccft.core.tokens import right_pad
from ccft.inference import SharedPrefillEngine
from ccft.inference.architectures import architecture
from conftest import make_full, make_lora, ragged_prompts
from families import FAMILIES, MODEL_FAMILIES, family_config, make_family_folder

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-5
N_NEW = 4
NAN = float("nan")
#: LoRA targets per family: phi3's projections are fused (qkv_proj, gate_up_proj)
TARGETS = {
    "phi3": (["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], ["qkv_proj", "down_proj"]),
}
DEFAULT_TARGETS = (None, ["k_proj", "up_proj"])


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, tokenizer):
    return {
        f: make_family_folder(tmp_path_factory.mktemp(f"fam_{f}"), tokenizer, f, seed=1) for f in FAMILIES
    }


@pytest.fixture(scope="module")
def sharp_dirs(tmp_path_factory, tokenizer):
    """family -> a tiny base with clear logit margins (LM head x8), for the bf16 agreement test."""

    class Dirs(dict):
        def __missing__(self, f):
            self[f] = make_family_folder(
                tmp_path_factory.mktemp(f"sharp_{f}"), tokenizer, f, seed=1, scale=8.0
            )
            return self[f]

    return Dirs()


@pytest.fixture(scope="module")
def prompts(gsm8k_rows, tokenizer):
    """Four real prompts cut to different lengths: ragged prefixes, left padding."""
    return ragged_prompts(gsm8k_rows, tokenizer, 4, 6, 7)


def _decoders(base, family, handoff):
    full = make_full(base, 9, handoff)
    t1, t2 = TARGETS.get(family, DEFAULT_TARGETS)
    return {
        "math": make_lora(base, "math", 1, 4, handoff, t1),
        "code": make_lora(base, "code", 2, 2, handoff, t2),
        "full": full,
    }


def _forced_logits(base, dec, cache, tails):
    ids, mask = right_pad(tails, base.tokenizer.pad_token_id)
    with torch.no_grad():
        if dec is None:
            with base.base_weights() as m:
                return ccft.decoder_forward(m, cache, ids, mask)
        return ccft.decoder_forward(dec, cache, ids, mask)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_architecture_is_read(family, tokenizer):
    """Each family resolves to its own switches (a family read as llama would pass the other tests only by
    accident: this pins what is read)."""
    arch = architecture(family_config(family, tokenizer))
    fam = arch.family
    base_family = family.split("-")[0]
    assert fam.qk_norm == (base_family in ("qwen3", "gemma3"))
    assert (
        fam.sandwich_norms == fam.embed_scale == (fam.norm_offset == 1.0) == base_family.startswith("gemma")
    )
    assert arch.activation == ("gelu_tanh" if base_family.startswith("gemma") else "silu")
    assert arch.attn_scale == pytest.approx((24 if base_family.startswith("gemma") else 16) ** -0.5)
    assert arch.final_softcap == (5.0 if base_family.startswith("gemma") else None)
    assert arch.rotary_dim == (8 if family == "phi3" else 16)
    assert len(arch.rope_types) == (2 if family == "gemma3" else 1)
    assert arch.llama_like == (not base_family.startswith("gemma"))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_and_prompt_logits_equal_the_model(family, family_dirs, prompts):
    """C_base == the model's own KV cache (``compute_base_cache``: transformers' forward); the engine's logits
    over each prompt's last tokens, on its own prefix, == the model's plain forward over the whole prompt."""
    base = ccft.load_base(str(family_dirs[family]))
    eng = SharedPrefillEngine(base, decoders={}, fill=NAN)
    ref = ccft.compute_base_cache(base, prompts)
    with eng.prefill(prompts) as h:
        got = h.to_base_cache()
        assert torch.equal(got.attention_mask, ref.attention_mask)
        for a, b in zip(got.keys + got.values, ref.keys + ref.values, strict=True):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    t = 3
    prefixes = [
        p[:-t] for p in prompts
    ]  # handoff 1: C_base holds p[: -t - 1], the handle's tail is p[-t - 1]
    tails = [p[-t - 1 :] for p in prompts]
    ids, mask = right_pad(tails, base.tokenizer.pad_token_id)
    with eng.prefill(prefixes, handoff_tokens=1) as h:
        got = eng.tail_logits(h, list(range(len(prompts))), ids, mask, decoder="base")
    with torch.no_grad():
        for r, p in enumerate(prompts):
            want = base.model(torch.tensor([p])).logits[0, -t - 1 :]
            torch.testing.assert_close(got[r], want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("mode", ["eager", "static"])
@pytest.mark.parametrize("handoff", [1, 2])
@pytest.mark.parametrize("family", MODEL_FAMILIES)
def test_decode_steps_equal_reference(family, family_dirs, prompts, handoff, mode):
    """Base, two LoRA decoders and a full-weight decoder decode on one shared prefill (rows of several
    decoders in one step), teacher-forced: every step's logits == decoder_forward over C_base."""
    base = ccft.load_base(str(family_dirs[family]))
    decs = _decoders(base, family, handoff)
    cache = ccft.compute_base_cache(base, prompts, handoff_tokens=handoff)
    g = torch.Generator().manual_seed(0)
    forced = torch.randint(0, len(base.tokenizer), (len(prompts), N_NEW), generator=g).tolist()
    eng = SharedPrefillEngine(base, decoders=decs, max_batch=16, decode=mode, fill=NAN)
    h = eng.prefill(prompts)
    assert h.handoff_tokens == handoff
    names = ["base", "math", "code", "full"]
    rid = {
        (n, i): eng.add_request(h, i, decoder=n, forced_tokens=forced[i])
        for n in names
        for i in range(len(prompts))
    }
    steps = []
    while eng.active:
        steps.append({o.request_id: o for o in eng.step(return_logits=True)})
    assert len(steps) == N_NEW
    h.release()
    tails = [cache.tail_ids[i].tolist() + forced[i] for i in range(len(prompts))]
    for n in names:
        ref = _forced_logits(base, None if n == "base" else decs[n], cache, tails)
        for i in range(len(prompts)):
            got = torch.stack([s[rid[n, i]].logits for s in steps])
            torch.testing.assert_close(got, ref[i, handoff - 1 : handoff - 1 + N_NEW], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", MODEL_FAMILIES)
def test_tail_logits_and_greedy_equal_reference(family, family_dirs, prompts):
    """Teacher-forced tails on one handle for every decoder == decoder_forward; greedy generation of every
    decoder == ccft.generate (the reference path)."""
    base = ccft.load_base(str(family_dirs[family]))
    decs = _decoders(base, family, 1)
    eng = SharedPrefillEngine(base, decoders=decs, max_batch=8, fill=NAN)
    g = torch.Generator().manual_seed(1)
    rows = [3, 0, 2]
    tails = [
        prompts[r][-1:] + torch.randint(0, len(base.tokenizer), (2 + r,), generator=g).tolist() for r in rows
    ]
    ids, mask = right_pad(tails, base.tokenizer.pad_token_id)
    with eng.prefill(prompts) as h:
        cache = h.to_base_cache().select(rows)
        for name in ["base", "math", "code", "full"]:
            got = eng.tail_logits(h, rows, ids, mask, decoder=name)
            ref = _forced_logits(base, None if name == "base" else decs[name], cache, tails)
            torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], atol=ATOL, rtol=0)
        for name in ["base", "math", "full"]:
            got = eng.generate(h, decoder=name, max_new_tokens=N_NEW)
            if name == "base":
                want = ccft.generate(prompts, mode="base", base=base, max_new_tokens=N_NEW)
            else:
                want = ccft.generate(prompts, mode="prefillshare", decoder=decs[name], max_new_tokens=N_NEW)
            assert [x.token_ids for x in got] == [x.token_ids for x in want], name


@pytest.mark.parametrize("family", MODEL_FAMILIES)
def test_chunked_prefill_equals_one_shot(family, family_dirs, prompts):
    """A prefill computed in chunks of 3 positions (each attending to the K/V before it) == one prefill."""
    base = ccft.load_base(str(family_dirs[family]))
    eng = SharedPrefillEngine(base, decoders={}, fill=NAN)
    prompt = prompts[-1]
    job = eng.begin_prefill(prompt)
    chunks = 0
    while job.remaining:
        job.advance(3)
        chunks += 1
    assert chunks > 2
    h, _ = job.finish()
    with eng.prefill([prompt]) as one:
        for a, b in zip(
            h.to_base_cache().keys + h.to_base_cache().values,
            one.to_base_cache().keys + one.to_base_cache().values,
            strict=True,
        ):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    h.release()


def test_sliding_window_bounds_positions(tmp_path, tokenizer):
    """A mistral base with sliding_window=24: the engine is exact within the window (nothing is masked there)
    and refuses a prompt + max_new_tokens past it, naming the field, before anything is allocated."""
    import transformers

    cfg = family_config("mistral", tokenizer)
    cfg.sliding_window = 24
    torch.manual_seed(0)
    transformers.MistralForCausalLM(cfg).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    base = ccft.load_base(str(tmp_path))
    eng = SharedPrefillEngine(base, decoders={}, fill=NAN)
    assert eng.max_positions == 24
    with pytest.raises(ConfigError, match="sliding_window"):
        eng.prefill([list(range(100, 126))])
    assert eng.arena.used_tokens == 0
    with eng.prefill([list(range(100, 120))]) as h:
        with pytest.raises(ConfigError, match="sliding_window"):
            eng.add_request(h, 0, decoder="base", max_new_tokens=5)
        assert (
            eng.generate(h, decoder="base", max_new_tokens=4)[0].token_ids
            == ccft.generate([list(range(100, 120))], mode="base", base=base, max_new_tokens=4)[0].token_ids
        )


@pytest.mark.parametrize(
    "family,field,value,match",
    [
        ("gemma2", "attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0"),
        (
            "llama",
            "rope_parameters",
            {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
            "rope_type='dynamic'",
        ),
        ("llama", "hidden_act", "gelu", "hidden_act='gelu'"),
        ("qwen3", "hidden_act", "relu", "hidden_act='relu'"),
        ("gemma3", "hidden_activation", "silu", "hidden_activation='silu'"),
    ],
)
def test_unsupported_config_is_refused_by_name(tokenizer, family, field, value, match):
    cfg = family_config(family, tokenizer)
    setattr(cfg, field, value)
    with pytest.raises(IncompatibleModelError, match=match):
        architecture(cfg)


def test_unknown_family_is_refused_before_the_engine_allocates(tmp_path, tokenizer):
    import transformers

    cfg = transformers.GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    base = ccft.load_base(str(tmp_path))
    with pytest.raises(IncompatibleModelError, match=r"model_type='gpt2' \(supported: llama, mistral"):
        SharedPrefillEngine(base, decoders={})


@pytest.mark.parametrize("family", MODEL_FAMILIES)
def test_the_fused_cpu_step_runs_where_the_family_is_llamas_block(family, family_dirs):
    """The eager decode tests above run the fused CPU step (every layer in one kernel call) for llama,
    mistral, qwen2 and qwen3 (q/k/v biases and per-head q/k norms are in the kernel), the layer loop for the
    others."""
    from ccft.inference.blocks import load_kernel

    if load_kernel() is None:
        pytest.skip("no C++ compiler builds the block kernel here")
    base = ccft.load_base(str(family_dirs[family]))
    eng = SharedPrefillEngine(base, decoders={})
    fused = eng.lanes["base"].weights.block_step is not None
    assert fused is (family in ("llama", "mistral", "qwen2", "qwen3"))


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "phi3"])
def test_bf16_greedy_agrees_with_the_reference(family, sharp_dirs, prompts):
    """bf16 (docs/design.md, K3: top-1 agreement >= 0.8 in bf16): the engine's greedy tokens for the base and
    a LoRA decoder on one shared prefill agree with ccft.generate's on at least 80% of the steps, each row
    counted up to its first difference (stricter than per step); gemma's norms take their (1 + w) product in
    fp32 there (``model.rms_norm``)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CPU without native bf16 matmuls warns that it is slow
        base = ccft.load_base(str(sharp_dirs[family]), dtype="bfloat16")
    lora = make_lora(base, "math", 1, 4, 1, TARGETS.get(family, DEFAULT_TARGETS)[0])
    eng = SharedPrefillEngine(base, decoders={"math": lora})
    n = 8
    agree = []  # per row and decoder: the steps until the first difference (then the contexts differ)
    with eng.prefill(prompts) as h:
        for name in ("base", "math"):
            got = eng.generate(h, decoder=name, max_new_tokens=n)
            if name == "base":
                want = ccft.generate(prompts, mode="base", base=base, max_new_tokens=n)
            else:
                want = ccft.generate(prompts, mode="prefillshare", decoder=lora, max_new_tokens=n)
            for g, w in zip(got, want, strict=True):
                steps = min(len(g.token_ids), len(w.token_ids))
                first = next((t for t in range(steps) if g.token_ids[t] != w.token_ids[t]), steps)
                agree.append((first, steps))
    same, total = sum(a for a, _ in agree), sum(s for _, s in agree)
    assert total and same / total >= 0.8, (family, agree)
