"""Decoders on C_base: adapters really off for prefill, full copies, K1 interleaving, invariant 3 (no base
grad)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ccft
from ccft.core.cache import prefill
from ccft.core.tokens import IGNORE_INDEX, right_pad, tokenize_prompt, tokenize_response
from ccft.train.data import Collator, Example
from conftest import perturb

PROMPTS = [
    "Janet's ducks lay 16 eggs per day. How much does she make every day at the farmers' market?",
    "What is 7 times 6?",
    "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total?",
]
RESPONSES = ["She makes $18 every day.\n#### 18", "#### 42", "It takes 2 + 1 = 3 bolts.\n#### 3"]
LORA_FALSE = {"init_lora_weights": False}


def _batch(tok, k=1):
    prompts = [tokenize_prompt(tok, p) for p in PROMPTS]
    responses = [tokenize_response(tok, r) for r in RESPONSES]
    tails = [p[-k:] + r for p, r in zip(prompts, responses, strict=True)]
    tail_ids, tail_mask = right_pad(tails, tok.pad_token_id)
    return prompts, responses, tails, tail_ids, tail_mask


def _real_diff(a, b, tails):
    return max((a[i, : len(t)] - b[i, : len(t)]).abs().max().item() for i, t in enumerate(tails))


def test_lora_adapter_changes_decode_but_not_prefill(tiny_base):
    """``base_weights()`` really disables the adapter: C_base with an adapter attached == C_base before it."""
    tok = tiny_base.tokenizer
    prompts, _, tails, tail_ids, tail_mask = _batch(tok)
    before = ccft.compute_base_cache(tiny_base, prompts)
    with torch.no_grad():
        base_logits = ccft.decoder_forward(tiny_base.model, before, tail_ids, tail_mask)

    decoder = ccft.make_decoder(tiny_base, "lora", lora=LORA_FALSE, method="ccft")
    after = ccft.compute_base_cache(tiny_base, prompts)
    assert after.equal(before), "C_base changed once a LoRA adapter was attached"
    assert after.fingerprint == before.fingerprint and after.producer == "base"

    # not vacuous: the same prefill with the adapter active gives different K/V
    own = prefill(decoder.model, prompts, pad_token_id=tok.pad_token_id)
    assert max((a - b).abs().max().item() for a, b in zip(own.keys, before.keys, strict=True)) > 1e-3

    with torch.no_grad():
        dec_logits = ccft.decoder_forward(decoder, after, tail_ids, tail_mask)
        with tiny_base.base_weights() as m:
            base_again = ccft.decoder_forward(m, after, tail_ids, tail_mask)
    assert _real_diff(dec_logits, base_logits, tails) > 1e-2, "the adapter does not change the decode"
    assert _real_diff(base_again, base_logits, tails) <= 1e-6, "base_weights() left the adapter on"


def test_full_decoder_equals_base_until_perturbed(tiny_base):
    tok = tiny_base.tokenizer
    prompts, _, tails, tail_ids, tail_mask = _batch(tok, k=2)
    base_state = {k: v.clone() for k, v in tiny_base.model.state_dict().items()}
    cache = ccft.compute_base_cache(tiny_base, prompts, handoff_tokens=2)
    with torch.no_grad():
        ref = ccft.decoder_forward(tiny_base.model, cache, tail_ids, tail_mask)

    decoder = ccft.make_decoder(tiny_base, "full", method="ccft", handoff_tokens=2)
    assert decoder.fingerprint == tiny_base.fingerprint
    base_ptrs = {p.data_ptr() for p in tiny_base.model.parameters()}
    assert not base_ptrs & {p.data_ptr() for p in decoder.model.parameters()}, (
        "full decoder aliases base weights"
    )
    with torch.no_grad():
        same = ccft.decoder_forward(decoder, cache, tail_ids, tail_mask)
    assert _real_diff(same, ref, tails) <= 1e-6

    perturb(decoder.model, seed=1)
    with torch.no_grad():
        moved = ccft.decoder_forward(decoder, cache, tail_ids, tail_mask)
    assert _real_diff(moved, ref, tails) > 1e-2
    for k, v in tiny_base.model.state_dict().items():
        assert torch.equal(v, base_state[k]), f"perturbing the decoder changed base parameter {k}"
    assert ccft.compute_base_cache(tiny_base, prompts, handoff_tokens=2).equal(cache)


def _two_decoders(base, kind):
    if kind == "lora":
        a = ccft.make_decoder(base, "lora", lora=LORA_FALSE, method="ccft", adapter_name="math")
        torch.manual_seed(123)
        b = ccft.make_decoder(base, "lora", lora=LORA_FALSE, method="ccft", adapter_name="code")
        assert a.model is b.model  # one weight copy, two adapters
    else:
        a = ccft.make_decoder(base, "full", method="ccft")
        b = ccft.make_decoder(base, "full", method="ccft")
        perturb(a.model, seed=1)
        perturb(b.model, seed=2)
    return a, b


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_k1_interleaved_decoders_share_one_cache(tiny_base, kind):
    """K1: decoders A, B, A on one C_base: A's outputs repeat exactly, C_base stays bit-identical."""
    tok = tiny_base.tokenizer
    prompts, _, tails, tail_ids, tail_mask = _batch(tok)
    a, b = _two_decoders(tiny_base, kind)
    cache = ccft.compute_base_cache(tiny_base, prompts)
    snapshot = cache.clone()
    kw = dict(mode="prefillshare", cache=cache, max_new_tokens=4, batch_size=8)

    with torch.no_grad():
        la1 = ccft.decoder_forward(a, cache, tail_ids, tail_mask)
    ga1 = ccft.generate(prompts, decoder=a, **kw)
    gb = ccft.generate(prompts, decoder=b, **kw)
    with torch.no_grad():
        lb = ccft.decoder_forward(b, cache, tail_ids, tail_mask)
    ga2 = ccft.generate(prompts, decoder=a, **kw)
    with torch.no_grad():
        la2 = ccft.decoder_forward(a, cache, tail_ids, tail_mask)

    assert [g.token_ids for g in ga1] == [g.token_ids for g in ga2]
    assert [g.text for g in ga1] == [g.text for g in ga2]
    assert torch.equal(la1, la2), "A's logits changed after B ran"
    assert _real_diff(la1, lb, tails) > 1e-2, (
        "A and B must be different decoders for this test to mean anything"
    )
    assert [g.token_ids for g in ga1] != [g.token_ids for g in gb]
    assert all(len(g.token_ids) == 4 for g in ga1 + gb)
    assert cache.equal(snapshot), "C_base was mutated by interleaved decoding"
    assert [t.shape for t in cache.keys] == [t.shape for t in snapshot.keys]  # the cache did not grow
    cache.check_unmodified()


def test_lora_gradient_reaches_adapter_only(tiny_base):
    """Invariant 3: a loss from decoder_forward gives gradient to LoRA params only; base unchanged after a
    step."""
    tok = tiny_base.tokenizer
    k = 1
    prompts = [tokenize_prompt(tok, p) for p in PROMPTS]
    examples = [
        Example(tuple(p), tuple(tokenize_response(tok, r))) for p, r in zip(prompts, RESPONSES, strict=True)
    ]
    batch = Collator(tok.pad_token_id, handoff_tokens=k)(examples)
    base_state = {n: v.clone() for n, v in tiny_base.model.state_dict().items()}
    decoder = ccft.make_decoder(tiny_base, "lora", lora=LORA_FALSE, method="ccft")
    decoder.model.train()
    cache = ccft.compute_base_cache(tiny_base, prompts, handoff_tokens=k)
    snapshot = cache.clone()

    logits = ccft.decoder_forward(decoder, cache, batch["tail_ids"], batch["tail_mask"])
    loss = (
        torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1),
            batch["labels"][:, 1:].flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        / batch["num_supervised"]
    )
    loss.backward()

    lora = {n: p for n, p in decoder.model.named_parameters() if "lora_" in n}
    others = {n: p for n, p in decoder.model.named_parameters() if "lora_" not in n}
    assert lora and others
    for n, p in lora.items():
        assert p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0, n
    for n, p in others.items():
        assert not p.requires_grad and p.grad is None, f"base parameter {n} received gradient"
    for t in cache.keys + cache.values:
        assert not t.requires_grad and t.grad is None and t.grad_fn is None

    with torch.no_grad():
        for p in lora.values():
            p -= 0.1 * p.grad
    for n, v in tiny_base.model.state_dict().items():
        if "lora_" not in n:
            key = n.replace("base_layer.", "")
            assert torch.equal(v, base_state[key]), f"base parameter {n} changed"
    assert cache.equal(snapshot)
    assert ccft.compute_base_cache(tiny_base, prompts, handoff_tokens=k).equal(snapshot)


def test_full_decoder_gradient_stays_in_the_copy(tiny_base):
    tok = tiny_base.tokenizer
    prompts, _, _, tail_ids, tail_mask = _batch(tok)
    decoder = ccft.make_decoder(tiny_base, "full", method="ccft")
    cache = ccft.compute_base_cache(tiny_base, prompts)
    logits = ccft.decoder_forward(decoder, cache, tail_ids, tail_mask)
    logits.logsumexp(-1).mean().backward()
    grads = [p.grad for p in decoder.model.parameters()]
    assert all(g is not None for g in grads) and sum(g.abs().sum() for g in grads) > 0
    assert all(p.grad is None and not p.requires_grad for p in tiny_base.model.parameters())
    assert all(t.grad is None for t in cache.keys + cache.values)


def test_full_decoder_starts_from_the_stored_base_weights_in_its_own_memory(tiny_base):
    """A full-weight decoder loads θ_base from the base's folder (not a copy of base.model): equal weights,
    its own storage, and no LoRA layers even when the base already hosts an adapter (docs/training.md, Peak
    memory)."""
    from safetensors.torch import load_file

    ccft.make_decoder(
        tiny_base, "lora", method="ccft", adapter_name="math"
    )  # PEFT injects layers into the base
    decoder = ccft.make_decoder(tiny_base, "full", method="full-ft")
    stored = load_file(str(Path(tiny_base.path) / "model.safetensors"))
    state = decoder.model.state_dict()
    assert not [n for n in state if "lora_" in n or "base_layer" in n]
    assert set(stored) <= set(state)
    for name, value in stored.items():
        assert torch.equal(state[name], value), name
    base_ptrs = {p.data_ptr() for p in tiny_base.model.parameters()}
    assert not base_ptrs & {p.data_ptr() for p in decoder.model.parameters()}
    assert all(p.requires_grad for p in decoder.model.parameters())
    with torch.no_grad():
        next(decoder.model.parameters()).add_(1.0)  # training writes to the decoder, never to the base
    base_state = {
        n.replace("base_layer.", "").removeprefix("base_model.model."): v
        for n, v in tiny_base.model.state_dict().items()
        if "lora_" not in n
    }
    for name, value in stored.items():
        assert torch.equal(base_state[name], value), name


def test_loaded_lora_decoders_with_same_folder_name_do_not_overwrite(tiny_base, tmp_path):
    """K1: runs/a/final and runs/b/final loaded onto one base stay two different decoders."""
    tok = tiny_base.tokenizer
    prompts, _, tails, tail_ids, tail_mask = _batch(tok)
    cache = ccft.compute_base_cache(tiny_base, prompts)
    a, b = _two_decoders(tiny_base, "lora")
    with torch.no_grad():
        want_a = ccft.decoder_forward(a, cache, tail_ids, tail_mask)
        want_b = ccft.decoder_forward(b, cache, tail_ids, tail_mask)
    ccft.save_decoder(a, tmp_path / "a" / "final")
    ccft.save_decoder(b, tmp_path / "b" / "final")
    la = ccft.load_decoder(tmp_path / "a" / "final", base=tiny_base)
    lb = ccft.load_decoder(tmp_path / "b" / "final", base=tiny_base)
    assert la.meta["adapter_name"] != lb.meta["adapter_name"]
    with torch.no_grad():
        got_a = ccft.decoder_forward(la, cache, tail_ids, tail_mask)
        got_b = ccft.decoder_forward(lb, cache, tail_ids, tail_mask)
    assert _real_diff(got_a, want_a, tails) <= 1e-6 and _real_diff(got_b, want_b, tails) <= 1e-6
    assert _real_diff(got_a, got_b, tails) > 1e-2
    with pytest.raises(ccft.ConfigError, match="adapter_name='math' is already used"):
        ccft.load_decoder(tmp_path / "b" / "final", base=tiny_base, adapter_name="math")


# ------------------------------------------------------------------ modules_to_save on a tied embedding


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory, tokenizer):
    """A tiny Llama whose lm_head is its input embedding (tie_word_embeddings=True)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    path = tmp_path_factory.mktemp("tied_base")
    LlamaForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _embedding_decoder(base, seed: int, name: str = "default"):
    """A LoRA decoder that also trains (saves) the tied embedding, tied back to lm_head (PEFT
    ensure_weight_tying)."""
    torch.manual_seed(seed)
    dec = ccft.make_decoder(
        base,
        "lora",
        method="ccft",
        adapter_name=name,
        lora={
            "r": 2,
            "init_lora_weights": False,
            "modules_to_save": ["embed_tokens"],
            "ensure_weight_tying": True,
        },
    )
    with torch.no_grad():
        for n, p in dec.model.named_parameters():
            if "modules_to_save" in n and f".{name}." in n:
                p.add_(torch.randn(p.shape))
    dec.model.eval()
    return dec


def test_tied_embedding_adapter_loads_exactly_onto_its_own_base_and_is_refused_as_a_second(
    tied_dir, tmp_path
):
    """A LoRA decoder with modules_to_save on the tied embedding: exact as the first adapter of a base; as a
    second adapter PEFT would untie its lm_head (logits off by tens, silently), so load_decoder and
    make_decoder refuse it with a message naming the fix."""
    tok_ids = torch.tensor([[1, 20, 300, 4000, 50, 6]])
    base = ccft.load_base(str(tied_dir))
    dec = _embedding_decoder(base, 0)
    with torch.no_grad():
        want = dec.model(input_ids=tok_ids).logits
    path = ccft.save_decoder(dec, tmp_path / "emb")

    own = ccft.load_decoder(path, base=ccft.load_base(str(tied_dir)))  # the first adapter of a fresh base
    with torch.no_grad():
        assert torch.equal(own.activate()(input_ids=tok_ids).logits, want)

    used = ccft.load_base(str(tied_dir))
    _embedding_decoder(used, 1, name="other")  # the base already serves a decoder
    with pytest.raises(
        ccft.ConfigError, match=r"tied embedding .*already carries LoRA adapters.*base of its own"
    ):
        ccft.load_decoder(path, base=used)
    with pytest.raises(ccft.ConfigError, match=r"tied embedding"):
        _embedding_decoder(used, 2, name="third")
    # An ordinary adapter (no embedding copy) still shares the used base.
    plain = ccft.make_decoder(used, "lora", method="ccft", adapter_name="plain", lora={"r": 2})
    assert plain.model is used.adapter_hosts[0]
