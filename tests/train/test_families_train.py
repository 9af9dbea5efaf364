"""Training, the C_base store and the exports on every model family the engine supports (tests/families.py).

For each of llama, mistral, qwen2, qwen3, gemma2, gemma3 (``Gemma3ForCausalLM``, ``gemma3_text``) and phi3 —
tiny random fp32 bases built offline with what makes the family differ switched on (q/k/v biases, q/k norms,
(1 + w) and sandwich norms, embedding scaling, final-logit soft-capping, a local and a global RoPE, fused
projections, partial RoPE):

1. a CCFT step's loss (LoRA and full weights) equals the two-pass reference computed with transformers alone
   (the base prefills ``prompt[:-1]`` into its own cache, the decoder runs the tail on a copy of it), on the
   chunked loss path (soft-capped for gemma) whose loss and gradients equal the full-logits path's and, for
   LoRA, the one-pass path's; a few steps make the loss go down; the C_base of a prompt longer than a
   sliding window keeps every position;
2. the default LoRA targets adapt every linear projection of every layer (phi3: fused ``qkv_proj``,
   ``gate_up_proj``);
3. the C_base store's fingerprint changes with a family-specific weight: a stale store is refused, rebuilt;
4. ``ccft export --to peft-alora`` and ``--to merged`` give folders that load (stock PEFT / transformers /
   ``ccft.load_decoder``) with the decoder's logits; ``--to gguf-alora`` needs llama.cpp (slow, skipped when
   it is not built);
5. Full-FT's padding-free layout equals the padded one.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ccft
from ccft.cli.main import main
from ccft.core.cache import prefill_tensors
from ccft.core.errors import FingerprintMismatchError
from ccft.core.tokens import tokenize_prompt, tokenize_response
from ccft.train.cache_store import CacheStore, precompute
from ccft.train.data import Collator, build_dataset
from ccft.train.run import setup
from conftest import make_full, make_lora, perturb_lora, short_sum_rows, two_step_config
from families import MODEL_FAMILIES, make_family_folder

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

#: ``config.model_type`` of each family
MODEL_TYPES = {"gemma3": "gemma3_text"}
#: a weight only (or typically) this family has, in layer 0 (so it shows in layer 1's K/V)
FAMILY_WEIGHTS = {
    "llama": "model.layers.0.post_attention_layernorm.weight",
    "mistral": "model.layers.0.mlp.gate_proj.weight",
    "qwen2": "model.layers.0.self_attn.q_proj.bias",
    "qwen3": "model.layers.0.self_attn.q_norm.weight",
    "gemma2": "model.layers.0.post_feedforward_layernorm.weight",
    "gemma3": "model.layers.0.self_attn.q_norm.weight",
    "phi3": "model.layers.0.self_attn.qkv_proj.weight",
}
#: families with sliding-window layers (mistral: every layer; gemma: the local ones)
SLIDING = ["mistral", "gemma2", "gemma3"]
TOL = 1e-5


@pytest.fixture(scope="module")
def short_data(tmp_path_factory) -> Path:
    return short_sum_rows(tmp_path_factory.mktemp("fam_rows") / "rows.jsonl", done_suffix=True)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, tokenizer):
    """family -> a tiny base folder with sharpened logits (×8: a LoRA adapter can move the loss), built on
    first use."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = make_family_folder(
                tmp_path_factory.mktemp(f"fam_{family}"), tokenizer, family, seed=1, scale=8.0
            )
        return made[family]

    return get


def _cache_kw(model) -> str:
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def two_pass_reference(ref_base, decoder_model, examples) -> tuple[float, int]:
    """Σ NLL over response + EOS and the token count, with transformers alone: the base prefills
    ``prompt[:-1]`` unpadded into its own cache (deep-copied), the decoder runs ``prompt[-1:] + response`` at
    positions n-1, n, ... on it."""
    from ccft.core.decoder import unwrap_pretrained

    total, count = 0.0, 0
    kw = _cache_kw(unwrap_pretrained(decoder_model))
    for ex in examples:
        p, r = list(ex.prompt_ids), list(ex.response_ids)
        with torch.no_grad():
            out = ref_base(input_ids=torch.tensor([p[:-1]]), use_cache=True)
            cache = copy.deepcopy(getattr(out, "cache", None) or out.past_key_values)
            tail = p[-1:] + r
            pos = torch.arange(len(p) - 1, len(p) - 1 + len(tail))[None]
            logits = decoder_model(
                input_ids=torch.tensor([tail]), position_ids=pos, use_cache=True, **{kw: cache}
            ).logits[0]
        total += F.cross_entropy(logits[:-1].double(), torch.tensor(tail[1:]), reduction="sum").item()
        count += len(r)
    return total, count


def _perturb(model, *, lora_only: bool, seed: int = 123, std: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if lora_only and "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif not lora_only and p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * std * p.detach().abs().mean().clamp(min=1e-3))


def _plain(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _step(trainer, batch):
    """(loss, gradients by name) of one ``compute_loss`` + backward."""
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad(set_to_none=True)
    return loss.item(), grads


# ------------------------------------------------------------------ 1: the loss


@pytest.mark.parametrize("kind", ["lora", "full"])
@pytest.mark.parametrize("family", MODEL_FAMILIES)
def test_ccft_loss_equals_the_two_pass_reference(tmp_path, family_dirs, short_data, family, kind):
    folder = family_dirs(family)
    cfg, _ = two_step_config(folder, tmp_path / "run", short_data, decoder_kind=kind)
    base, decoder, train_set, _, trainer = setup(cfg)
    assert base.config.model_type == MODEL_TYPES.get(family, family)
    # Every family takes the chunked loss (gemma: soft-capped in the chunks) and the two-pass path.
    assert trainer.loss_path == "chunked", trainer.loss_unchunked_reason
    assert trainer.train_path == "two-pass"
    _perturb(decoder.model, lora_only=kind == "lora")
    examples = [train_set[i] for i in (0, 5, 10, 2)]  # mixed prompt and response lengths
    batch = trainer.data_collator(examples)
    loss, grads = _step(trainer, batch)

    ref_base = _plain(folder)
    total, count = two_pass_reference(ref_base, decoder.model, examples)
    assert count == int(batch["num_supervised"])
    assert abs(loss - total / count) <= TOL, (loss, total / count)
    # The test can fail: the decoder differs from the base.
    base_only = two_pass_reference(ref_base, ref_base, examples)[0] / count
    assert abs(loss - base_only) > 1e-3, (loss, base_only)

    # The full-logits path (the model's own head, soft-capping included): the same loss and gradients.
    trainer.loss_path = "full-logits"
    full_loss, full_grads = _step(trainer, batch)
    assert abs(full_loss - loss) <= TOL, (full_loss, loss)
    assert grads.keys() == full_grads.keys() and grads
    for n, g in full_grads.items():
        assert torch.allclose(grads[n], g, atol=1e-6, rtol=1e-4), (n, (grads[n] - g).abs().max())
    if kind == "lora":  # the one-pass path (LoRA gated off on the prompt): the same loss and gradients too
        from ccft.train.fastpath import gate_for_step

        trainer.loss_path, trainer.train_path = "chunked", "one-pass"
        with gate_for_step(trainer.model, True) as gate:
            trainer._gate = gate
            one_loss, one_grads = _step(trainer, batch)
        assert abs(one_loss - loss) <= TOL, (one_loss, loss)
        for n, g in grads.items():
            assert torch.allclose(one_grads[n], g, atol=1e-6, rtol=1e-4), (n, (one_grads[n] - g).abs().max())


@pytest.mark.parametrize("family", MODEL_FAMILIES)
def test_a_few_steps_make_the_loss_go_down(tmp_path, family_dirs, short_data, family):
    cfg, _ = two_step_config(
        family_dirs(family),
        tmp_path / "run",
        short_data,
        train_rows=24,
        max_steps=8,
        learning_rate=2e-2,
        lr_scheduler_type="constant",
    )
    trainer = setup(cfg)[-1]
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-2:]) / 2 < losses[0] - 0.5, losses


@pytest.mark.parametrize("family", SLIDING)
def test_c_base_of_a_prompt_longer_than_the_sliding_window(tmp_path, tokenizer, family):
    """A window of 5 positions and prompts of 12-30 tokens: C_base keeps every prefix position (the model's
    own cache would keep the last 4 in its sliding layers), and the CCFT loss equals transformers' two-pass
    reference, whose sliding-window cache and mask are its own."""
    folder = make_family_folder(tmp_path / "base", tokenizer, family, seed=2, scale=8.0)
    cfg_file = folder / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "sliding_window": 5}))
    rows = short_sum_rows(tmp_path / "rows.jsonl", done_suffix=True)
    cfg, _ = two_step_config(folder, tmp_path / "run", rows, decoder_kind="lora")
    base, decoder, train_set, _, trainer = setup(cfg)
    assert base.config.sliding_window == 5
    perturb_lora(decoder.model)
    examples = [train_set[i] for i in (0, 5, 10, 2)]
    batch = trainer.data_collator(examples)
    loss = trainer.compute_loss(trainer.model, batch).item()
    cache = trainer.last_base_cache
    assert all(k.shape[2] == batch["prefix_ids"].shape[1] > 5 for k in cache.keys + cache.values)
    ref_base = _plain(folder)
    total, count = two_pass_reference(ref_base, decoder.model, examples)
    assert abs(loss - total / count) <= TOL, (loss, total / count)
    # The window matters here: the same model with a window wider than the prompts scores differently.
    wide = _plain(folder)
    wide.config.sliding_window = 4096
    for layer in wide.model.layers:
        if getattr(layer.self_attn, "sliding_window", None):
            layer.self_attn.sliding_window = 4096
    assert abs(two_pass_reference(wide, decoder.model, examples)[0] / count - loss) > 1e-3


@pytest.mark.parametrize("family", MODEL_FAMILIES)
def test_padding_free_full_ft_equals_the_padded_layout(tmp_path, family_dirs, short_data, family):
    cfg, _ = two_step_config(family_dirs(family), tmp_path / "run", short_data, method="full-ft")
    base, decoder, train_set, _, trainer = setup(cfg)
    assert trainer.packs_full_ft, trainer.padding_free_reason
    perturb_lora(decoder.model)
    batch = trainer.data_collator([train_set[i] for i in (1, 6, 11)])
    assert batch["prefix_mask"].sum(1).unique().numel() > 1
    results = {}
    for free in (False, True):
        trainer.args.padding_free = free
        results[free] = _step(trainer, batch)
    (padded, g_padded), (packed, g_packed) = results[False], results[True]
    assert abs(packed - padded) <= TOL, (packed, padded)
    assert g_padded.keys() == g_packed.keys() and g_padded
    for n, g in g_padded.items():
        assert torch.allclose(g_packed[n], g, atol=1e-5, rtol=1e-4), n


# ------------------------------------------------------------------ 2: LoRA targets


@pytest.mark.parametrize("family", MODEL_FAMILIES)
def test_default_lora_targets_adapt_every_projection(tmp_path, family_dirs, short_data, family):
    from peft.tuners.lora import LoraLayer

    cfg, _ = two_step_config(family_dirs(family), tmp_path / "run", short_data)
    base, decoder, *_ = setup(cfg)
    targets = set(decoder.model.peft_config["default"].target_modules)
    fused = family == "phi3"
    want = (
        {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
        if fused
        else {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    )
    assert targets == want
    # Every linear layer of every decoder layer carries the adapter (what the plain model has in its layers).
    plain = _plain(family_dirs(family)).model.layers
    linear = {n for n, m in plain.named_modules() if isinstance(m, torch.nn.Linear)}
    adapted = {
        n for n, m in decoder.model.get_base_model().model.layers.named_modules() if isinstance(m, LoraLayer)
    }
    assert adapted == linear and len(linear) == len(want) * base.config.num_hidden_layers
    # An explicit list is taken as given (and refused when it names no module of this family).
    cfg, _ = two_step_config(
        family_dirs(family), tmp_path / "run2", short_data, lora_target_modules="[o_proj]"
    )
    _, dec2, *_ = setup(cfg)
    assert set(dec2.model.peft_config["default"].target_modules) == {"o_proj"}


# ------------------------------------------------------------------ 3: the C_base store


def _with_changed_weight(src: Path, out: Path, name: str, tokenizer) -> Path:
    """A copy of the base at ``src`` with one weight ``name`` changed (phi3's fused qkv: the q rows only)."""
    model = _plain(src)
    params = dict(model.named_parameters())
    with torch.no_grad():
        p = params[name]
        rows = model.config.num_attention_heads * model.config.head_dim if "qkv_proj" in name else p.shape[0]
        p[:rows] += 0.25 * torch.randn(p[:rows].shape, generator=torch.Generator().manual_seed(9))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.parametrize("family", MODEL_FAMILIES)
def test_store_fingerprint_follows_a_family_weight_and_a_stale_store_is_refused(
    tmp_path, family_dirs, tokenizer, family
):
    folder = family_dirs(family)
    base = ccft.load_base(str(folder))
    rows = [
        {"prompt": f"Q{i}: what is {i} times {i + 2}?" + " Go." * i, "response": f"{i}."} for i in range(5)
    ]
    ds = build_dataset(rows, tokenizer, chat_template=False, handoff_tokens=1)
    path = tmp_path / "store"
    precompute(base, ds.examples, path, log=lambda m: None)
    batch = Collator(tokenizer.pad_token_id, 1)(ds.examples)
    args = (batch["prefix_ids"], batch["prefix_mask"], batch["tail_ids"][:, :1])
    stored = CacheStore(path).batch_cache(*args, base=base)
    with base.base_weights() as m:
        live = prefill_tensors(m, *args, handoff_tokens=1, fingerprint=base.fingerprint)
    assert stored is not None and stored.fingerprint == base.fingerprint
    for a, b in zip(stored.keys + stored.values, live.keys + live.values, strict=True):
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-5

    name = FAMILY_WEIGHTS[family]
    other = ccft.load_base(str(_with_changed_weight(folder, tmp_path / "changed", name, tokenizer)))
    assert other.fingerprint != base.fingerprint
    with other.base_weights() as m:
        changed = prefill_tensors(m, *args, handoff_tokens=1, fingerprint=other.fingerprint)
    # The weight matters to C_base (layer 1 reads layer 0's output): the old store would be wrong for it ...
    assert (changed.keys[1] - stored.keys[1]).abs().max() > 1e-3
    # ... so it is refused, and precompute rebuilds it for the new base.
    with pytest.raises(FingerprintMismatchError, match="computed by base"):
        CacheStore(path).batch_cache(*args, base=other)
    rebuilt = precompute(other, ds.examples, path, log=lambda m: None)
    assert rebuilt.stale and "fingerprint" in rebuilt.stale and rebuilt.reused == 0
    fresh = CacheStore(path).batch_cache(*args, base=other)
    for a, b in zip(fresh.keys + fresh.values, changed.keys + changed.values, strict=True):
        assert (a - b).abs().max() <= 1e-5


# ------------------------------------------------------------------ 4: exports


@pytest.fixture(scope="module")
def chat_row(tokenizer, gsm8k_rows):
    return (
        tokenize_prompt(tokenizer, gsm8k_rows[3]["prompt"], chat_template=True),
        tokenize_response(tokenizer, gsm8k_rows[3]["response"])[:40],
    )


def _prefillshare(dec, prompt, response):
    k = dec.handoff_tokens
    cache = ccft.compute_base_cache(dec.base, [prompt], handoff_tokens=k)
    with torch.no_grad():
        return ccft.decoder_forward(dec, cache, torch.tensor([prompt[-k:] + response]))[0]


def _close(ours, theirs) -> bool:
    return (ours - theirs).abs().max().item() <= 3e-5 * max(1.0, ours.abs().max().item())


@pytest.mark.parametrize("family", MODEL_FAMILIES)
def test_exports_load_with_the_decoders_logits(tmp_path, family_dirs, chat_row, family, capsys):
    from peft import PeftModel

    folder = family_dirs(family)
    prompt, response = chat_row
    base = ccft.load_base(str(folder))
    dec = make_lora(base, "default", seed=4, r=4, handoff=4)  # random A and B, default targets
    ccft.save_decoder(dec, tmp_path / "lora", recipe={"chat_template": "true"})
    ours = _prefillshare(dec, prompt, response)
    with torch.no_grad(), dec.model.disable_adapter():
        untouched = _prefillshare(dec, prompt, response)
    assert (ours - untouched).abs().max().item() > 1e-2  # the adapter matters

    # peft-alora: stock PEFT over prompt + response, no ccft code.
    assert main(["export", str(tmp_path / "lora"), "--to", "peft-alora", str(tmp_path / "alora")]) == 0
    assert "warning" not in capsys.readouterr().err
    stock = PeftModel.from_pretrained(_plain(folder), str(tmp_path / "alora")).eval()
    with torch.no_grad():
        theirs = stock(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 4 :]
    assert _close(ours, theirs), (ours - theirs).abs().max()

    # merged LoRA: a plain transformers folder; ccft.load_decoder gives the prefillshare logits.
    assert main(["export", str(tmp_path / "lora"), "--to", "merged", str(tmp_path / "merged")]) == 0
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    merged = ccft.load_decoder(tmp_path / "merged", base=ccft.load_base(str(folder)))
    assert merged.kind == "full" and merged.handoff_tokens == 4
    assert _close(ours, _prefillshare(merged, prompt, response))
    assert type(_plain(tmp_path / "merged")).__name__ == type(base.model).__name__

    # merged full-weight Full-FT decoder: transformers' own forward over prompt + response.
    full = make_full(ccft.load_base(str(folder)), seed=2, method="full-ft")
    ccft.save_decoder(full, tmp_path / "full", recipe={"chat_template": "true"})
    assert main(["export", str(tmp_path / "full"), "--to", "merged", str(tmp_path / "full-merged")]) == 0
    with torch.no_grad():
        want = full.model(input_ids=torch.tensor([prompt + response])).logits[0]
        got = _plain(tmp_path / "full-merged")(input_ids=torch.tensor([prompt + response])).logits[0]
    assert _close(want, got)


#: the families whose tiny test base llama.cpp's converter takes offline: gemma2 and phi3 need a SentencePiece
#: ``tokenizer.model`` and qwen2's converter does not recognise the embedded SmolLM2 BPE pre-tokenizer (the
#: fixture's tokenizer, not the model, is what it refuses; docs/models.md)
GGUF_FAMILIES = ["llama", "mistral", "qwen3", "gemma3"]
#: config fields of the GGUF test's base where llama.cpp reads a released checkpoint's layout, not the config:
#: its gemma3 scales queries by head_dim^-1/2 (query_pre_attn_scalar is head_dim in the released checkpoints
#: but 27B) and places the global layers by its own pattern (every 6th), so the tiny base takes both
GGUF_OVERRIDES = {"gemma3": {"query_pre_attn_scalar": 16, "layer_types": ["sliding_attention"] * 2}}


@pytest.mark.slow
@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_gguf_alora_export(tmp_path, family, tokenizer):
    """``--to gguf-alora`` on each family, served by llama-server of the pinned llama.cpp build (``make
    llamacpp``; skipped without one): the adapter's log-probabilities over its greedy continuation (top 10
    per token) equal ccft's prefillshare ones within 1e-3 and its greedy tokens are ccft's, as
    tests/bench/test_llamacpp_alora.py checks for the tiny Llama."""
    from ccft.bench import llamacpp as lc
    from ccft.bench.llamacpp_alora import alora_server_args, complete, export_gguf_alora

    build = lc.find_build()
    if build is None:
        pytest.skip("llama.cpp is not built (make llamacpp)")
    folder = make_family_folder(
        tmp_path / "base", tokenizer, family, seed=1, scale=8.0, **GGUF_OVERRIDES.get(family, {})
    )
    base = ccft.load_base(str(folder))
    dec = make_lora(base, "default", seed=4, r=4, handoff=4)
    ccft.save_decoder(dec, tmp_path / "lora", recipe={"chat_template": "true"})
    g = export_gguf_alora(tmp_path / "lora", tmp_path / "gguf", build=build, log=lambda m: None)
    assert g.adapter_gguf.is_file() and g.base_gguf.is_file()
    prompt = tokenize_prompt(
        tokenizer, "Natalia sold clips to 48 of her friends in April.", chat_template=True
    )
    n_new = 8
    with lc.server(
        build, g.base_gguf, len(prompt) + n_new + 8, 2, extra_args=alora_server_args([g.adapter_gguf])
    ) as url:
        got = complete(url, prompt, n_new, adapter_id=0, n_adapters=1, n_probs=10, cache_prompt=False)
    k = dec.handoff_tokens
    cache = ccft.compute_base_cache(dec.base, [prompt], handoff_tokens=k)
    with torch.no_grad():
        logits = ccft.decoder_forward(dec, cache, torch.tensor([prompt[-k:] + got["tokens"][:-1]]))[0]
    want = torch.log_softmax(logits[k - 1 :].double(), dim=-1)
    gap = max(
        abs(float(want[i, t]) - lp) for i, step in enumerate(got["top_logprobs"]) for t, lp in step.items()
    )
    assert got["tokens"] == want.argmax(-1).tolist() and gap < 1e-3, (family, gap)
