"""The C_base store in the compact format (``ccft precompute --cache-format int8``, issue 35): int8
entries read back equal the quantised native C_base exactly and take the bytes ``kv_nbytes`` says on disk; a
CCFT run on the int8 C_base trains on them with the loss of one quantising on the fly, and a run on the
native C_base refuses them with a ConfigError naming the manifest and the fix."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from ccft.cli.main import main
from ccft.core.compact import CompactCache, kv_nbytes, read_cache
from ccft.core.errors import ConfigError
from ccft.train.cache_store import MANIFEST, CacheStore, kv_shape, precompute, prefixes_of, store_bytes
from ccft.train.config import load_recipe
from ccft.train.data import Collator, build_dataset
from ccft.train.run import check_run, setup

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def rows(n: int = 7) -> list[dict]:
    return [
        {
            "prompt": f"Q{i}: what is {i} times {i + 2}?" + " Show the steps." * (i % 3),
            "response": f"{i * (i + 2)}." + " Done." * (i % 2),
        }
        for i in range(n)
    ]


def quiet(_msg: str) -> None:
    pass


def data_bytes(folder: Path) -> tuple[int, int]:
    """(tensor bytes, header bytes) of a store's shards: a safetensors file is an 8-byte length N, N bytes of
    JSON header, then the tensor data."""
    data = header = 0
    for f in folder.glob("*.safetensors"):
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header += 8 + n
        data += len(raw) - 8 - n
    return data, header


def test_int8_store_equals_the_quantised_native_store_and_takes_kv_nbytes_on_disk(
    tmp_path, tiny_base, tokenizer
):
    ds = build_dataset(rows(), tokenizer, chat_template=False, handoff_tokens=1)
    native = precompute(tiny_base, ds.examples, tmp_path / "native", log=quiet)
    int8 = precompute(tiny_base, ds.examples, tmp_path / "int8", log=quiet, cache_format="int8")
    manifest = json.loads((tmp_path / "int8" / MANIFEST).read_text())
    assert manifest["cache_format"] == "int8" and native.computed == int8.computed == len(rows())
    s_native, s_int8 = CacheStore(tmp_path / "native"), CacheStore(tmp_path / "int8")
    assert (s_native.cache_format, s_int8.cache_format) == ("native", "int8")

    # read back: the codes and scales CompactCache.from_base makes of the same C_base, bit for bit
    batch = Collator(tokenizer.pad_token_id, 1)(ds.examples)
    args = (batch["prefix_ids"], batch["prefix_mask"], batch["tail_ids"][:, :1])
    c_base = s_native.batch_cache(*args, base=tiny_base)
    compact = s_int8.batch_cache(*args, base=tiny_base)
    want = CompactCache.from_base(c_base)
    assert isinstance(compact, CompactCache) and compact.dtype == c_base.dtype
    for name in ("key_codes", "key_scales", "value_codes", "value_scales"):
        for a, b in zip(getattr(compact, name), getattr(want, name), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), name
    assert torch.equal(compact.attention_mask, c_base.attention_mask)
    # and what a reader attends to is the int8 C_base computed on the fly
    for a, b in zip(
        read_cache(compact, "int8").keys + read_cache(compact, "int8").values,
        read_cache(c_base, "int8").keys + read_cache(c_base, "int8").values,
        strict=True,
    ):
        assert torch.equal(a, b)
    with pytest.raises(ConfigError, match="read it with cache_format=int8"):
        read_cache(compact, "native")

    # bytes on disk: the tensors are exactly kv_nbytes per prefix; the files add only safetensors headers
    lengths = [len(p) for p in prefixes_of(ds.examples, 1)]
    layers, kv_heads, head_dim = kv_shape(tiny_base.config)
    geo = {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim}
    want_int8 = sum(kv_nbytes("int8", tokens=n, **geo) for n in lengths)
    want_native = sum(kv_nbytes("native", tokens=n, dtype=tiny_base.dtype, **geo) for n in lengths)
    assert store_bytes(tiny_base.config, tiny_base.dtype, lengths, "int8") == want_int8 == int8.estimate_bytes
    (d_int8, h_int8), (d_native, h_native) = data_bytes(tmp_path / "int8"), data_bytes(tmp_path / "native")
    assert (d_int8, d_native) == (want_int8, want_native)
    assert int8.bytes_on_disk == d_int8 + h_int8 and native.bytes_on_disk == d_native + h_native
    # the format from the shapes: 1-byte codes for every fp32 element, 2-byte scales per key channel and per
    # value token
    codes = sum(2 * layers * kv_heads * n * head_dim for n in lengths)
    scales = sum(2 * layers * kv_heads * (head_dim + n) for n in lengths)
    assert want_int8 == codes + scales and want_native == 4 * codes
    expected = want_int8 / want_native
    assert expected == pytest.approx(0.25 * (1 + scales / codes), rel=1e-12)
    ratio = int8.bytes_on_disk / native.bytes_on_disk
    # the ratio on disk differs from the tensors' only by the headers (tolerance from the format)
    assert abs(ratio - expected) <= (h_int8 + h_native) / native.bytes_on_disk
    print(f"int8 store / native store on disk: {ratio:.4f} (tensors {expected:.4f})")


def recipe_overrides(tmp_path: Path, tiny_dir: Path, **extra) -> list[str]:
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
        **extra,
    }
    return [f"{k}={v}" for k, v in ov.items()]


def test_training_on_int8_shards_equals_quantising_on_the_fly(tmp_path, tiny_dir):
    curves = {}
    for name, extra in (("live", {}), ("store", {"base_cache_store": str(tmp_path / "cbase")})):
        cfg, _, _ = load_recipe(
            None,
            recipe_overrides(tmp_path, tiny_dir, output_dir=tmp_path / name, cache_format="int8", **extra),
        )
        _, _, _, _, trainer = setup(cfg)
        trainer.train()
        curves[name] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        if name == "store":  # a new store of an int8 run is written int8, and every batch came from it
            assert trainer.cache_store.cache_format == "int8"
            assert trainer.cache_store.hits == 3 and trainer.cache_store.misses == 0
    assert len(curves["store"]) == 3
    for a, b in zip(curves["store"], curves["live"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), curves


def test_a_native_run_refuses_int8_shards_before_training(tmp_path, tiny_dir, tiny_base, tokenizer, capsys):
    ds = build_dataset(rows(), tokenizer, chat_template=False, handoff_tokens=1)
    precompute(tiny_base, ds.examples, tmp_path / "int8", log=quiet, cache_format="int8")
    manifest = str(tmp_path / "int8" / MANIFEST)
    with pytest.raises(ConfigError, match="--cache-format native") as e:
        CacheStore(tmp_path / "int8").check_format("native")
    assert manifest in str(e.value) and "cache_format=int8 in the recipe" in str(e.value)
    CacheStore(tmp_path / "int8").check_format("int8")
    # the recipe path: --dry-run (check_run) and setup refuse it; nothing is rebuilt
    before = sorted(p.name for p in (tmp_path / "int8").iterdir())
    cfg, _, _ = load_recipe(
        None,
        recipe_overrides(tmp_path, tiny_dir, output_dir=tmp_path / "run", base_cache_store=tmp_path / "int8"),
    )
    with pytest.raises(ConfigError, match=manifest.replace("\\", "\\\\")):
        check_run(cfg)
    with pytest.raises(ConfigError, match="holds C_base in cache_format=int8"):
        setup(cfg)
    assert sorted(p.name for p in (tmp_path / "int8").iterdir()) == before
    assert json.loads(Path(manifest).read_text())["cache_format"] == "int8"


def test_cli_precompute_cache_format_int8(tmp_path, tiny_dir, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"base: {tiny_dir}\ntrain_data: {data}\nchat_template: false\noutput_dir: {tmp_path / 'run'}\n"
    )
    out = tmp_path / "s"
    assert main(["precompute", str(recipe), "--out", str(out), "--cache-format", "int8", "--json"]) == 0
    text = capsys.readouterr().out
    assert "stored as int8 codes and scales" in text and "cache_format=int8`" in text
    assert json.loads((out / MANIFEST).read_text())["cache_format"] == "int8"
    from safetensors import safe_open

    for f in out.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            assert h.metadata()["cache_format"] == "int8"
    assert main(["precompute", str(recipe), "--out", str(out), "--cache-format", "int4"]) == 2
    assert "--cache-format='int4'" in capsys.readouterr().err
    # a native run on it fails at --dry-run, naming the manifest
    assert main(["train", str(recipe), f"base_cache_store={out}", "--dry-run"]) == 2
    assert str(out / MANIFEST) in capsys.readouterr().err
