"""The C_base store (``ccft precompute``): sizes, equality with the on-the-fly prefill, reuse, corruption,
staleness, the disk-space refusal, and training on it (K1/K5 for stored caches)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ccft import load_base
from ccft.cli.main import main
from ccft.core.cache import prefill_tensors
from ccft.core.errors import FingerprintMismatchError
from ccft.train.cache_store import (
    MANIFEST,
    CacheStore,
    StoreError,
    bytes_per_token,
    entry_key,
    estimate_bytes,
    precompute,
)
from ccft.train.config import load_recipe
from ccft.train.data import Collator, build_dataset
from ccft.train.run import setup

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def rows(n: int = 7) -> list[dict]:
    out = [
        {
            "prompt": f"Q{i}: what is {i} times {i + 2}?" + " Show the steps." * (i % 3),
            "response": f"{i * (i + 2)}." + " Done." * (i % 2),
        }
        for i in range(n)
    ]
    out.append(dict(out[0], response="A different answer to the same prompt."))  # a shared prefix
    return out


def dataset(tokenizer, k: int = 1):
    return build_dataset(rows(), tokenizer, chat_template=False, handoff_tokens=k)


def quiet(_msg: str) -> None:
    pass


def test_size_estimate_is_layers_x2_x_kv_heads_x_head_dim_x_tokens_x_dtype_bytes(tiny_base, smol_dir):
    from transformers import AutoConfig

    cfg = tiny_base.config  # 2 layers, 2 kv heads, head dim 16
    assert bytes_per_token(cfg, torch.float32) == 2 * 2 * 2 * 16 * 4
    assert estimate_bytes(cfg, torch.bfloat16, 1000) == 2 * 2 * 2 * 16 * 2 * 1000
    smol = AutoConfig.from_pretrained(smol_dir)  # the embedded SmolLM2-135M: 30 layers, 3 kv heads, 64
    assert bytes_per_token(smol, torch.float32) == 30 * 2 * 3 * 64 * 4 == 46080


@pytest.mark.parametrize("k", [1, 2])
def test_stored_c_base_equals_the_prefill_for_a_padded_batch(tmp_path, tiny_base, tokenizer, k):
    ds = dataset(tokenizer, k)
    report = precompute(
        tiny_base,
        ds.examples,
        tmp_path / "store",
        handoff_tokens=k,
        batch_size=3,
        shard_bytes=4096,
        log=quiet,
    )
    assert report.prefixes == len(ds) - 1  # the repeated prompt is stored once
    assert report.computed == report.prefixes and report.reused == 0 and report.shards > 1
    assert report.tokens == sum(len(e.prompt_ids) - k for e in ds.examples[:-1])
    data_bytes = estimate_bytes(tiny_base.config, torch.float32, report.tokens)
    assert data_bytes <= report.bytes_on_disk <= data_bytes + report.shards * 64 * 1024  # + headers
    assert_store_equals_prefill(CacheStore(tmp_path / "store"), tiny_base, tokenizer, ds, k)


def assert_store_equals_prefill(store, tiny_base, tokenizer, ds, k):
    """Every row of ``ds`` is served from ``store`` with the values of an on-the-fly prefill (pads zero)."""
    batch = Collator(tokenizer.pad_token_id, k)(ds.examples)
    stored = store.batch_cache(
        batch["prefix_ids"], batch["prefix_mask"], batch["tail_ids"][:, :k], base=tiny_base
    )
    with tiny_base.base_weights() as m:
        live = prefill_tensors(
            m,
            batch["prefix_ids"],
            batch["prefix_mask"],
            batch["tail_ids"][:, :k],
            handoff_tokens=k,
            fingerprint=tiny_base.fingerprint,
        )
    assert stored is not None and stored.fingerprint == tiny_base.fingerprint and stored.producer == "base"
    assert torch.equal(stored.attention_mask, live.attention_mask) and torch.equal(
        stored.tail_ids, live.tail_ids
    )
    real = live.attention_mask.bool()[:, None, :, None]
    for a, b in zip(stored.keys + stored.values, live.keys + live.values, strict=True):
        assert a.shape == b.shape
        assert (a - b).abs().masked_fill(~real, 0).max() <= 1e-5
        assert torch.equal(a.masked_fill(real, 0), torch.zeros_like(a))  # pad slots are zero, as in a prefill


def test_reuse_corruption_and_missing_entries_are_recomputed(tmp_path, tiny_base, tokenizer):
    ds = dataset(tokenizer)
    path = tmp_path / "store"
    first = precompute(tiny_base, ds.examples[:4], path, shard_bytes=2048, batch_size=2, log=quiet)
    again = precompute(tiny_base, ds.examples[:4], path, shard_bytes=2048, batch_size=2, log=quiet)
    assert again.computed == 0 and again.reused == first.prefixes and not again.corrupt_shards

    grown = precompute(
        tiny_base, ds.examples, path, shard_bytes=2048, batch_size=2, log=quiet
    )  # new rows are appended
    assert grown.reused == first.prefixes and grown.computed == grown.prefixes - first.prefixes

    manifest = json.loads((path / MANIFEST).read_text())
    names = sorted(manifest["shards"])
    assert len(names) >= 3
    flipped, truncated, deleted = (path / n for n in names[:3])
    raw = bytearray(flipped.read_bytes())
    raw[-5] ^= 0xFF  # one flipped byte inside the tensor data: same size, other sha256
    flipped.write_bytes(bytes(raw))
    truncated.write_bytes(truncated.read_bytes()[:-16])
    deleted.unlink()
    lost = sum(len(manifest["shards"][n]["keys"]) for n in names[:3])

    fixed = precompute(tiny_base, ds.examples, path, shard_bytes=2048, batch_size=2, log=quiet)
    assert sorted(fixed.corrupt_shards) == names[:3]
    assert fixed.computed == lost and fixed.reused == fixed.prefixes - lost
    clean = precompute(tiny_base, ds.examples, path, shard_bytes=2048, batch_size=2, log=quiet)
    assert clean.computed == 0 and not clean.corrupt_shards
    # The repaired store answers every row with the prefill's values.
    assert_store_equals_prefill(CacheStore(path), tiny_base, tokenizer, ds, 1)


def test_a_store_of_another_base_or_dtype_is_stale_and_never_served(tmp_path, tiny_base, tokenizer, tiny_dir):
    from conftest import make_tiny_folder

    ds = dataset(tokenizer)
    path = tmp_path / "store"
    precompute(tiny_base, ds.examples, path, log=quiet)
    other = load_base(str(make_tiny_folder(tmp_path / "other", tokenizer, seed=5)))
    assert other.fingerprint != tiny_base.fingerprint
    batch = Collator(tokenizer.pad_token_id, 1)(ds.examples)
    store = CacheStore(path)
    # Keys carry the fingerprint: the store has nothing for another base (K5), and refuses its reader.
    ids = list(ds.examples[0].prompt_ids[:-1])
    assert entry_key(tiny_base.fingerprint, torch.float32, ids) in store
    assert entry_key(other.fingerprint, torch.float32, ids) not in store
    with pytest.raises(FingerprintMismatchError, match="computed by base"):
        store.batch_cache(batch["prefix_ids"], batch["prefix_mask"], batch["tail_ids"][:, :1], base=other)
    rebuilt = precompute(other, ds.examples, path, log=quiet)
    assert rebuilt.stale and "fingerprint" in rebuilt.stale and rebuilt.reused == 0
    assert CacheStore(path).fingerprint == other.fingerprint
    bf16 = load_base(str(tiny_dir), dtype="bfloat16")
    again = precompute(bf16, ds.examples, path, log=quiet)
    assert again.stale and ("fingerprint" in again.stale or "dtype" in again.stale)
    assert CacheStore(path).dtype == torch.bfloat16


def test_refuses_with_a_clear_message_when_the_disk_is_too_small(tmp_path, tiny_base, tokenizer, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 << 20, 9 << 20, 1 << 20))
    with pytest.raises(StoreError, match=r"needs ≈ .* but only .* is free"):
        precompute(tiny_base, dataset(tokenizer).examples, tmp_path / "store", log=quiet)
    assert not list((tmp_path / "store").glob("*.safetensors"))


def test_training_on_the_store_equals_training_on_the_fly(tmp_path, tiny_dir):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    ov = {
        "base": str(tiny_dir),
        "train_data": str(data),
        "max_steps": 3,
        "per_device_train_batch_size": 4,
        "logging_steps": 1,
        "use_cpu": "true",
        "chat_template": "false",
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": "true",
        "learning_rate": 0.01,
        "lora_r": 4,
        "seed": 5,
        "handoff_tokens": 2,
    }
    curves = {}
    for name, extra in (("live", {}), ("store", {"base_cache_store": str(tmp_path / "cbase")})):
        cfg, _, _ = load_recipe(
            None, [f"{k}={v}" for k, v in dict(ov, output_dir=tmp_path / name, **extra).items()]
        )
        _, _, _, _, trainer = setup(cfg)
        trainer.train()
        curves[name] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        if name == "store":
            assert trainer.cache_store.hits == 3 and trainer.cache_store.misses == 0
    assert len(curves["store"]) == 3
    for a, b in zip(curves["store"], curves["live"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), curves


def test_cli_prints_the_estimate_then_writes_the_store(tmp_path, tiny_dir, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"base: {tiny_dir}\ntrain_data: {data}\nchat_template: false\noutput_dir: {tmp_path / 'run'}\n"
    )
    assert main(["precompute", str(recipe), "--out", str(tmp_path / "s"), "--estimate-only"]) == 0
    out = capsys.readouterr().out
    assert "estimate:" in out and "prefix tokens × 512 B" in out and not (tmp_path / "s" / MANIFEST).exists()
    assert main(["precompute", str(recipe), "--out", str(tmp_path / "s"), "--json"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{") : out.rindex("}") + 1])
    assert report["computed"] == report["prefixes"] == len(rows()) - 1
    assert (tmp_path / "s" / MANIFEST).is_file()
    # Too little disk: refused by the CLI with the ccft error format, exit status 2.
    import shutil
    from collections import namedtuple

    real = shutil.disk_usage
    shutil.disk_usage = lambda p: namedtuple("u", "total used free")(1, 1, 0)
    try:
        assert main(["precompute", str(recipe), "--out", str(tmp_path / "t")]) == 2
    finally:
        shutil.disk_usage = real
    assert "is free at" in capsys.readouterr().err
    assert Path(tmp_path / "s").is_dir()
