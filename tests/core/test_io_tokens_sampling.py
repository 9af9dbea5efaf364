"""ccft.core.io (atomic writes), ccft.core.tokens (special ids) and ccft.core.sampling."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ccft.core.io import atomic_write_dir, atomic_write_file, atomic_write_text
from ccft.core.sampling import SamplingParams, nucleus_probs, select_tokens
from ccft.core.tokens import eos_token_ids, pad_token_id, strip_duplicate_bos


def test_atomic_write_text_replaces_and_leaves_no_temporary(tmp_path):
    p = tmp_path / "sub" / "a.txt"
    atomic_write_text(p, "one")
    atomic_write_text(p, "two ✓")
    assert p.read_text(encoding="utf-8") == "two ✓"
    assert sorted(x.name for x in p.parent.iterdir()) == ["a.txt"]


def test_atomic_writes_get_the_mode_of_a_plain_write(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    plain_dir = tmp_path / "plain_dir"
    plain_dir.mkdir()
    atomic_write_text(tmp_path / "a.txt", "x")
    atomic_write_dir(tmp_path / "d", lambda d: None)
    mode = lambda p: p.stat().st_mode & 0o777  # noqa: E731
    assert mode(tmp_path / "a.txt") == mode(plain)  # 0644 under the usual umask 022, not mkstemp's 0600
    assert mode(tmp_path / "d") == mode(plain_dir)


def test_atomic_write_file_failure_keeps_old_version(tmp_path):
    p = tmp_path / "a.bin"
    p.write_bytes(b"old")

    def boom(tmp):
        with open(tmp, "wb") as f:
            f.write(b"half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        atomic_write_file(p, boom)
    assert p.read_bytes() == b"old"
    assert [x.name for x in tmp_path.iterdir()] == ["a.bin"]


def test_atomic_write_dir(tmp_path):
    target = tmp_path / "ckpt"
    atomic_write_dir(target, lambda d: (d / "w.txt").write_text("1"))
    atomic_write_dir(target, lambda d: (d / "w.txt").write_text("2"))
    assert (target / "w.txt").read_text() == "2"
    atomic_write_dir(target, lambda d: (d / "w.txt").write_text("3"), keep_existing=True)
    assert (target / "w.txt").read_text() == "2"  # another writer finished first: kept
    with pytest.raises(RuntimeError):
        atomic_write_dir(target, lambda d: (_ for _ in ()).throw(RuntimeError("x")))
    assert (target / "w.txt").read_text() == "2"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["ckpt"]


def test_special_ids():
    tok = SimpleNamespace(pad_token_id=None, eos_token_id=7)
    assert pad_token_id(tok) == 7
    assert pad_token_id(SimpleNamespace(pad_token_id=3, eos_token_id=7)) == 3
    assert pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=None)) == 0
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[7, 9]))
    assert eos_token_ids(tok, model) == {7, 9}
    assert eos_token_ids(tok, SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=2))) == {2, 7}
    assert eos_token_ids(tok) == {7}
    assert strip_duplicate_bos([1, 1, 1, 5], 1) == [1, 5]
    assert strip_duplicate_bos([1, 5], 1) == [1, 5]
    assert strip_duplicate_bos([1, 1], None) == [1, 1]


def test_sampling_greedy_and_nucleus():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    assert select_tokens(logits, SamplingParams()).tolist() == [1, 0]
    probs = nucleus_probs(torch.log(torch.tensor([0.5, 0.3, 0.2])), 1.0, 0.6)
    assert torch.allclose(probs, torch.tensor([0.5, 0.3, 0.0]))  # smallest set reaching top_p
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    params = SamplingParams(do_sample=True, temperature=0.7, top_p=0.9)
    a = [int(select_tokens(logits[:1], params, g1)) for _ in range(20)]
    b = [int(select_tokens(logits[:1], params, g2)) for _ in range(20)]
    assert a == b and set(a) <= {1, 2}  # seeded; token 0 (p≈0.04 at T=0.7) is outside the nucleus


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8), (1.0, 0.5)])
def test_sampling_matches_the_exact_distribution(temperature, top_p):
    """Seeded draws follow softmax(logits / T) restricted to the nucleus and renormalised (total
    variation)."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.3, -0.5, -1.0])
    p = torch.softmax(logits / temperature, -1)
    order = p.argsort(descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for i in order.tolist():  # the smallest prefix (by probability) reaching top_p, computed by hand
        keep[i] = True
        mass += float(p[i])
        if mass >= top_p:
            break
    exact = torch.where(keep, p, torch.zeros_like(p))
    exact = exact / exact.sum()
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(do_sample=True, temperature=temperature, top_p=top_p)
    n = 20000
    draws = select_tokens(logits.expand(n, -1), params, g)
    freq = torch.bincount(draws, minlength=len(logits)).float() / n
    assert float((freq - exact).abs().sum() / 2) < 0.015  # TV distance; sampling noise at n=20k is ~0.005
    assert freq[~keep].sum() == 0  # never a token outside the nucleus


def test_display_path(tmp_path):
    from ccft.core.io import display_path

    assert display_path(tmp_path / "runs" / "eval", start=tmp_path) == "runs/eval"
    assert display_path("/somewhere/else/runs/full-ft", start=tmp_path) == "runs/full-ft"
