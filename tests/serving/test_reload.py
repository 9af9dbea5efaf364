"""Hot reload of a LoRA decoder (engine, scheduler, ``POST /v1/models/{model}/reload``).

After a reload the decoder's greedy outputs equal a cold start on the new weights (a fresh engine on
the folder); a refused folder changes nothing and the error names the field; the route exists only
with ``allow_reload`` (404 otherwise) and answers 400 for a bad path.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

import ccft
from ccft.core.errors import ConfigError, FingerprintMismatchError
from ccft.core.tokens import tokenize_prompt
from ccft.inference import SharedPrefillEngine
from ccft.serving.scheduler import Scheduler, ServeRequest
from ccft.serving.server import BackgroundServer, create_app
from conftest import make_lora, make_tiny_folder

N_NEW = 6


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer, gsm8k_rows):
    """The tiny base folder, decoder folders math-a / math-b (same shape, other weights) / math-r8
    (another rank) / math-k2 (another handoff), and 4 probe prompts."""
    root = tmp_path_factory.mktemp("reload")
    base_dir = make_tiny_folder(root / "base", tokenizer, seed=3, scale=30.0)
    folders = {}
    for tag, seed, r, k in (("a", 1, 4, 1), ("b", 2, 4, 1), ("r8", 3, 8, 1), ("k2", 4, 4, 2)):
        base = ccft.load_base(str(base_dir))
        folders[tag] = ccft.save_decoder(make_lora(base, "math", seed, r, handoff=k), root / f"math-{tag}")
    probes = [tokenize_prompt(tokenizer, r["prompt"], chat_template=False)[:20] for r in gsm8k_rows[:4]]
    return base_dir, folders, probes


def _engine(base_dir, folder):
    return SharedPrefillEngine(ccft.load_base(str(base_dir)), decoders={"math": str(folder)})


def _greedy(engine, probes):
    out = []
    for ids in probes:
        with engine.prefill([ids]) as h:
            out.append(engine.generate(h, decoder="math", max_new_tokens=N_NEW, ignore_eos=True)[0].token_ids)
    return out


def test_engine_reload_equals_cold_start_and_refusals_change_nothing(world):
    base_dir, folders, probes = world
    cold_a, cold_b = (
        _greedy(_engine(base_dir, folders["a"]), probes),
        _greedy(_engine(base_dir, folders["b"]), probes),
    )
    assert cold_a != cold_b  # the two weight sets are told apart by the probes
    engine = _engine(base_dir, folders["a"])
    key_a = engine.producer_key("math")
    for tag, err, words in (
        ("r8", ConfigError, "field 'r'"),
        ("k2", ConfigError, "'handoff_tokens'"),
    ):
        with pytest.raises(err, match=words):
            engine.reload_decoder("math", folders[tag])
    with pytest.raises(ConfigError, match="no such folder"):
        engine.reload_decoder("math", folders["a"].parent / "missing")
    with pytest.raises(ConfigError, match="only LoRA decoders"):
        engine.reload_decoder("base", folders["b"])
    assert engine.producer_key("math") == key_a
    assert _greedy(engine, probes) == cold_a  # refused reloads changed nothing
    key_b = engine.reload_decoder("math", folders["b"])
    assert key_b != key_a
    assert _greedy(engine, probes) == cold_b
    assert engine.reload_decoder("math", folders["a"]) == key_a  # the key follows the weights
    assert _greedy(engine, probes) == cold_a


def test_reload_refuses_damaged_and_foreign_folders(world, tmp_path, tokenizer):
    base_dir, folders, _ = world
    engine = _engine(base_dir, folders["a"])
    before = [t.clone() for t in engine.decoders["math"].watched]
    bad = tmp_path / "nan"
    bad.mkdir()
    for f in folders["b"].iterdir():
        if f.is_file():
            (bad / f.name).write_bytes(f.read_bytes())
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(bad / "adapter_model.safetensors"))
    first = sorted(tensors)[0]
    tensors[first] = torch.full_like(tensors[first], float("nan"))
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(ConfigError, match="NaN"):
        engine.reload_decoder("math", bad)
    meta = json.loads((bad / "ccft.json").read_text())
    (bad / "ccft.json").write_text(json.dumps(dict(meta, base_fingerprint="0" * 16)))
    with pytest.raises(FingerprintMismatchError, match="base_fingerprint"):
        engine.reload_decoder("math", bad)
    assert all(torch.equal(a, b) for a, b in zip(before, engine.decoders["math"].watched, strict=True))


def test_scheduler_reloads_at_a_step_boundary_while_serving(world):
    base_dir, folders, probes = world
    cold_b = _greedy(_engine(base_dir, folders["b"]), probes)
    s = Scheduler(_engine(base_dir, folders["a"]))
    s.start()
    try:
        busy = [
            s.submit(ServeRequest("math", probes[0], max_new_tokens=40, ignore_eos=True)) for _ in range(3)
        ]
        s.reload_decoder("math", folders["b"], timeout=60)
        assert s.counters["reloads"] == 1
        tickets = [s.submit(ServeRequest("math", p, max_new_tokens=N_NEW, ignore_eos=True)) for p in probes]
        for t in busy + tickets:
            assert t.done.wait(60)
        assert [t.tokens for t in tickets] == cold_b
        assert all(t.state == "done" for t in busy)
    finally:
        s.stop()
    assert s.live_bytes == 0


def _post(url, path, body):
    return httpx.post(url + path, content=body if isinstance(body, bytes) else json.dumps(body), timeout=60)


def test_reload_route(world):
    base_dir, folders, probes = world
    cold_b = _greedy(_engine(base_dir, folders["b"]), probes)
    off = Scheduler(_engine(base_dir, folders["a"]))
    with BackgroundServer(create_app(off)) as srv:
        r = _post(srv.url, "/v1/models/math/reload", {"path": str(folders["b"])})
        assert r.status_code == 404 and "--allow-reload" in r.json()["error"]["message"]
    s = Scheduler(_engine(base_dir, folders["a"]))
    with BackgroundServer(create_app(s, allow_reload=True)) as srv:
        r = _post(srv.url, "/v1/models/math/reload", {"path": str(folders["a"].parent / "missing")})
        assert r.status_code == 400 and "no such folder" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "path"
        r = _post(srv.url, "/v1/models/math/reload", {"path": str(folders["r8"])})
        assert r.status_code == 400 and "field 'r'" in r.json()["error"]["message"]
        assert _post(srv.url, "/v1/models/math/reload", b"{not json").status_code == 400
        assert _post(srv.url, "/v1/models/math/reload", {"folder": "x"}).status_code == 400
        assert _post(srv.url, "/v1/models/nope/reload", {"path": str(folders["b"])}).status_code == 404
        r = _post(srv.url, "/v1/models/math/reload", {"path": str(folders["b"])})
        assert r.status_code == 200, r.text
        assert r.json()["producer_key"] == s.engine.producer_key("math")
        got = []
        for ids in probes:
            body = {"model": "math", "prompt": ids, "max_tokens": N_NEW, "ignore_eos": True}
            r = _post(srv.url, "/v1/completions", dict(body, return_token_ids=True))
            assert r.status_code == 200
            got.append(r.json()["choices"][0]["token_ids"])
        assert got == cold_b
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        assert "ccft_scheduler_reloads_total 1.0" in metrics
        assert "ccft_prefix_arena_bytes" in metrics
