"""The chunked LM-head + cross-entropy loss (``ccft.train.loss``) and frozen embeddings for full-weight
decoders.

The reference is the full-logits path (``response_nll_rows`` over ``F.cross_entropy`` of the tail's logits;
tests/train/test_trainer.py checks it against independent two-pass and self-prefill references). Everything
is fp32 on tiny random Llamas with the real 49,152-token SmolLM2 vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ccft.core.errors import ConfigError
from ccft.train.config import load_recipe
from ccft.train.loss import LinearCrossEntropy, chunked_loss_unsupported, chunked_nll
from ccft.train.run import setup
from conftest import short_run_overrides

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory) -> Path:
    """16 rows of different prompt and response lengths (3 to 40 response tokens)."""
    rows = []
    for i in range(16):
        a, b = 5 * i + 2, 3 * i % 7 + 1
        rows.append(
            {
                "prompt": f"Q{i}: add {a} and {b}." + " Think step by step." * (i % 3),
                "response": f"{a} + {b} = {a + b}." + " Check: correct." * (i % 5) * (1 + i % 2),
            }
        )
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory, tokenizer) -> Path:
    """A tiny Llama with tied input/output embeddings (as SmolLM2 has)."""
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
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("tied")
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharper logits: gradients well above rounding
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make(model_dir, out, data, **kw):
    kw = {"max_steps": 3, "per_device_train_batch_size": 4, "seed": 11, "loss_chunk_tokens": 7, **kw}
    cfg, _, _ = load_recipe(None, short_run_overrides(model_dir, out, data, **kw))
    return setup(cfg)


def perturb(model, seed: int = 5, std: float = 0.05) -> None:
    """Trainable weights off their init (LoRA B = 0 at init would give zero LoRA-A gradients)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * std * p.detach().abs().mean().clamp(min=1e-2))


def loss_and_grads(trainer, batch) -> tuple[float, dict[str, torch.Tensor]]:
    model = trainer.model
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def assert_same(a: tuple, b: tuple, *, rtol=1e-5, atol=1e-7) -> None:
    (la, ga), (lb, gb) = a, b
    assert abs(la - lb) <= 1e-6 * abs(lb), (la, lb)
    assert ga.keys() == gb.keys() and ga
    for name in gb:
        assert torch.allclose(ga[name], gb[name], rtol=rtol, atol=atol), (
            name,
            (ga[name] - gb[name]).abs().max(),
        )
    assert any(g.abs().max() > 1e-4 for g in gb.values())  # gradients are not all (near) zero


# ------------------------------------------------------------------ the autograd Function


@pytest.mark.parametrize("chunk", [1, 4, 13, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_cross_entropy_equals_full_cross_entropy(chunk, bias):
    g = torch.Generator().manual_seed(0)
    n, h, v = 13, 16, 300
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = (torch.randn(v, h, generator=g) * 0.5).requires_grad_(True)
    b = (torch.randn(v, generator=g) * 0.1).requires_grad_(True) if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    scale = 1 / 7  # the trainer divides by the step's token count

    logits = hidden @ weight.t() + (b if bias else 0)
    ref_tok = F.cross_entropy(logits, targets, reduction="none")
    (ref_tok.sum() * scale).backward()
    ref_grads = [hidden.grad.clone(), weight.grad.clone()] + ([b.grad.clone()] if bias else [])
    for x in (hidden, weight, b):
        if x is not None:
            x.grad = None

    total, per_token = LinearCrossEntropy.apply(hidden, weight, b, targets, chunk)
    assert not per_token.requires_grad
    assert torch.allclose(per_token, ref_tok.detach(), rtol=1e-6, atol=1e-6)
    assert torch.allclose(total, ref_tok.sum().detach(), rtol=1e-6)
    (total * scale).backward()
    got = [hidden.grad, weight.grad] + ([b.grad] if bias else [])
    for want, have in zip(ref_grads, got):
        assert torch.allclose(have, want, rtol=1e-5, atol=1e-7), (have - want).abs().max()


def test_chunked_nll_skips_ignored_positions_and_counts_per_row():
    g = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(3, 6, 8, generator=g)
    labels = torch.randint(0, 50, (3, 6), generator=g)
    labels[:, 0] = -100  # handoff token
    labels[1, 4:] = -100  # padding
    labels[2, 1:3] = -100
    with torch.no_grad():
        total, rows, counts = chunked_nll(hidden, labels, head, 2)
        lg = head(hidden)[:, :-1]
        ref = F.cross_entropy(
            lg.reshape(-1, 50), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="none"
        ).view(3, 5)
    assert counts.tolist() == [5, 3, 3]
    assert torch.allclose(rows, ref.sum(-1), rtol=1e-6) and torch.allclose(total, ref.sum(), rtol=1e-6)


# ------------------------------------------------------------------ the trainer: chunked == full logits


CASES = [
    ("lora", "ccft", "two-pass"),
    ("lora", "ccft", "one-pass"),
    ("lora", "full-ft", "auto"),
    ("full", "ccft", "auto"),
    ("full", "full-ft", "auto"),
]


@pytest.mark.parametrize("kind,method,path", CASES)
def test_trainer_loss_and_gradients_equal_the_full_logits_path(
    tmp_path, tiny_dir, rows_file, kind, method, path
):
    base, decoder, train_set, _, trainer = make(
        tiny_dir, tmp_path / "run", rows_file, decoder_kind=kind, method=method, train_path=path
    )
    assert trainer.loss_path == "chunked", trainer.loss_unchunked_reason
    perturb(trainer.model)
    batch = trainer.data_collator([train_set[i] for i in (0, 5, 9, 11)])
    assert int(batch["num_supervised"]) > 3 * trainer.args.loss_chunk_tokens  # several chunks
    trainer.model.train()

    projected = []
    head = trainer.model.get_output_embeddings()
    handle = head.register_forward_hook(lambda m, a, out: projected.append(tuple(out.shape)))
    try:
        chunked = loss_and_grads(trainer, batch)
    finally:
        handle.remove()
    # The decoder's forward projected no position (the base's no-grad prefill of C_base, on the same LM head
    # with LoRA, projects its last one): no (b, t, v) logits were made.
    assert (len(batch["labels"]), 0, head.out_features) in projected and max(s[1] for s in projected) <= 1, (
        projected
    )
    trainer.loss_path = "full-logits"
    reference = loss_and_grads(trainer, batch)
    assert_same(chunked, reference)
    if kind == "full":
        assert any(
            "lm_head" in n for n in reference[1]
        )  # the (untied) LM head trains, its gradient matches too


def test_tied_embedding_trained_gets_the_same_gradient(tmp_path, tied_dir, rows_file):
    """freeze_embeddings=false on a tied model: the LM head's gradient from the chunked loss adds to the
    embedding's own, as autograd adds them over full logits."""
    base, decoder, train_set, _, trainer = make(
        tied_dir,
        tmp_path / "run",
        rows_file,
        decoder_kind="full",
        method="full-ft",
        freeze_embeddings="false",
    )
    emb = trainer.model.get_input_embeddings().weight
    assert emb is trainer.model.get_output_embeddings().weight and emb.requires_grad
    perturb(trainer.model)
    batch = trainer.data_collator([train_set[i] for i in (1, 4, 7)])
    chunked = loss_and_grads(trainer, batch)
    trainer.loss_path = "full-logits"
    assert_same(chunked, loss_and_grads(trainer, batch))
    assert "model.embed_tokens.weight" in chunked[1]


def test_loss_curves_and_eval_nll_equal_the_full_logits_path(tmp_path, tiny_dir, rows_file):
    """A LoRA CCFT run (the embedding was always frozen there): the loss curve and held-out NLL are those of
    the full-logits path, step by step."""
    results = {}
    for chunk in (0, 5):
        base, decoder, train_set, _, trainer = make(
            tiny_dir,
            tmp_path / f"run{chunk}",
            rows_file,
            loss_chunk_tokens=chunk,
            eval_data=str(rows_file),
            eval_rows=6,
            per_device_eval_batch_size=4,
        )
        assert trainer.loss_path == ("chunked" if chunk else "full-logits")
        trainer.train()
        curve = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        results[chunk] = (curve, trainer.evaluate())
    (c0, e0), (c5, e5) = results[0], results[5]
    assert len(c0) == len(c5) == 3
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(c5, c0)), (c5, c0)
    assert c0[-1] < c0[0] - 1e-3  # it trains: the comparison is not between two flat curves
    assert (
        e5["eval_tokens"] == e0["eval_tokens"]
        and abs(e5["eval_loss"] - e0["eval_loss"]) <= 1e-5 * e0["eval_loss"]
    )


# ------------------------------------------------------------------ fallbacks, frozen embeddings, config


def test_lora_on_the_lm_head_falls_back_to_full_logits(tmp_path, tiny_dir, rows_file):
    base, decoder, train_set, _, trainer = make(
        tiny_dir, tmp_path / "run", rows_file, lora_target_modules="[q_proj, lm_head]"
    )
    why = chunked_loss_unsupported(trainer.model)
    assert trainer.loss_path == "full-logits" and why and "nn.Linear" in why
    batch = trainer.data_collator([train_set[i] for i in (0, 3)])
    assert torch.isfinite(trainer.compute_loss(trainer.model, batch))


def test_full_weight_decoder_freezes_the_tied_embedding_by_default(tmp_path, tied_dir, rows_file):
    base, decoder, train_set, _, trainer = make(
        tied_dir, tmp_path / "run", rows_file, decoder_kind="full", method="ccft", max_steps=2
    )
    emb = trainer.model.get_input_embeddings().weight
    assert trainer.frozen_embeddings == ["model.embed_tokens.weight"]
    assert not emb.requires_grad and trainer.model.get_output_embeddings().weight is emb
    before = emb.detach().clone()
    others = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert torch.equal(emb, before)
    assert any(not torch.equal(p, others[n]) for n, p in trainer.model.named_parameters() if n in others)


def test_full_weight_decoder_untied_keeps_training_its_lm_head(tmp_path, tiny_dir, rows_file):
    base, decoder, train_set, _, trainer = make(
        tiny_dir, tmp_path / "run", rows_file, decoder_kind="full", method="full-ft"
    )
    assert trainer.frozen_embeddings == ["model.embed_tokens.weight"]
    assert trainer.model.lm_head.weight.requires_grad


@pytest.mark.parametrize(
    "key,value,needle",
    [
        ("loss_chunk_tokens", -1, "loss_chunk_tokens=-1"),
        ("loss_chunk_tokens", "many", "loss_chunk_tokens"),
        ("freeze_embeddings", "sometimes", "freeze_embeddings"),
    ],
)
def test_bad_values_name_the_key(tmp_path, tiny_dir, rows_file, key, value, needle):
    with pytest.raises(ConfigError, match=needle):
        load_recipe(
            None,
            [
                f"base={tiny_dir}",
                f"output_dir={tmp_path / 'run'}",
                f"train_data={rows_file}",
                f"{key}={value}",
            ],
        )
