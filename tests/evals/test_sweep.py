"""Partial prefill sharing and the sharing sweep (docs/design.md, "Terms": sharing ratio ρ).

Invariants (fp32, ≤ 1e-5): ρ=1 on either axis is exactly ``decoder_forward`` on C_base; ρ=0 is the
decoder's own prefill (``full_forward``); a decoder equal to the base gives the base's NLL at every ρ;
layer sharing acts layer by layer; ragged per-row splits equal row-by-row computation.
"""

from __future__ import annotations

import json

import pytest
import torch
from harness_fixtures import ToyTask, decoders, perturb

import ccft
from ccft.core.errors import ConfigError
from ccft.core.tokens import tokenize_prompt, tokenize_response
from ccft.evals.sharing import recompute_tokens, row_nlls, shared_forward, shared_generate, shared_layer_list
from ccft.evals.sweep import run_sweep
from ccft.train.data import Collator, Example
from conftest import make_tiny_folder

TOL = 1e-5
TEXTS = [
    ("Natalia sold clips to 48 of her friends in April, and then she sold half as many in May.", "72 clips"),
    ("What is 2 + 2?", "4"),
    (
        "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
        "How much did she earn?",
        "She earned $10.",
    ),
]


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory, tokenizer):
    """Four layers, so ρ over layers moves one layer per 0.25 (plain logits: the equality checks are
    absolute)."""
    return make_tiny_folder(tmp_path_factory.mktemp("sweep4"), tokenizer, seed=4, layers=4)


@pytest.fixture(scope="module")
def sharp_dir(tmp_path_factory, tokenizer):
    """Four layers with clear logit margins (lm_head × 30) for the generation checks."""
    return make_tiny_folder(tmp_path_factory.mktemp("sweep4s"), tokenizer, seed=4, layers=4, scale=30.0)


@pytest.fixture
def base(deep_dir):
    return ccft.load_base(str(deep_dir))


@pytest.fixture
def sharp(sharp_dir):
    return ccft.load_base(str(sharp_dir))


@pytest.fixture(scope="module")
def rows(tokenizer):
    prompts = [tokenize_prompt(tokenizer, q, chat_template=False) for q, _ in TEXTS]
    responses = [tokenize_response(tokenizer, a) for _, a in TEXTS]
    assert len({len(p) for p in prompts}) == 3  # a mixed-length, left-padded batch
    return prompts, responses


def _decoder(base, kind):
    if kind == "full":
        return perturb(ccft.make_decoder(base, "full", method="ccft"), 7)
    return ccft.make_decoder(base, "lora", method="ccft", lora={"r": 4, "init_lora_weights": False})


def _batch(tok, prompts, responses, k=1):
    return Collator(tok.pad_token_id, k)(
        [Example(tuple(p), tuple(r)) for p, r in zip(prompts, responses, strict=True)]
    )


def _own_prefill_nll(model, tok, prompts, responses):
    b = _batch(tok, prompts, responses)
    with torch.no_grad():
        logits = ccft.full_forward(model, b["prefix_ids"], b["prefix_mask"], b["tail_ids"], b["tail_mask"])
    return [s / n for s, n in row_nlls(logits, b["labels"])]


@pytest.mark.parametrize(
    "n,rho,h,k",
    [
        (10, 1.0, 1, 1),
        (10, 0.0, 1, 10),
        (10, 0.5, 1, 5),
        (10, 0.75, 1, 3),
        (10, 0.25, 1, 8),
        (7, 0.7, 1, 3),
        (10, 1.0, 3, 3),
        (10, 0.9, 3, 3),
        (10, 0.6, 3, 4),
        (2, 0.0, 1, 2),
        (3, 0.999, 1, 1),
    ],
)
def test_recompute_tokens_table(n, rho, h, k):
    assert recompute_tokens(n, rho, h) == k


@pytest.mark.parametrize(
    "rho,L,layers",
    [
        (0.0, 4, []),
        (0.25, 4, [0]),
        (0.5, 4, [0, 1]),
        (0.75, 4, [0, 1, 2]),
        (1.0, 4, [0, 1, 2, 3]),
        (0.5, 3, [0, 1]),
        (0.3, 30, list(range(9))),
    ],
)
def test_shared_layer_table(rho, L, layers):
    assert shared_layer_list(rho, L) == layers


def test_rho_out_of_range_and_bad_axis(base, rows):
    with pytest.raises(ConfigError, match="rho"):
        recompute_tokens(5, 1.5)
    dec = _decoder(base, "full")
    with pytest.raises(ConfigError, match="over"):
        shared_forward(base, dec, *rows, over="heads")
    with pytest.raises(ConfigError, match="out of range"):
        shared_forward(base, dec, *rows, over="layers", shared_layers=[0, 9])


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_rho_1_is_prefillshare_on_both_axes(base, rows, kind):
    prompts, responses = rows
    dec = _decoder(base, kind)
    b = _batch(base.tokenizer, prompts, responses)
    with torch.no_grad():
        ref = ccft.decoder_forward(dec, ccft.compute_base_cache(base, prompts), b["tail_ids"], b["tail_mask"])
    for over in ("positions", "layers"):
        logits, labels = shared_forward(base, dec, prompts, responses, over=over, rho=1.0)
        assert torch.equal(labels, b["labels"])
        assert (logits - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_rho_0_is_the_decoders_own_prefill(base, rows, kind):
    prompts, responses = rows
    dec = _decoder(base, kind)
    b = _batch(base.tokenizer, prompts, responses)
    with torch.no_grad():
        own = ccft.full_forward(dec, b["prefix_ids"], b["prefix_mask"], b["tail_ids"], b["tail_mask"])
    logits, labels = shared_forward(base, dec, prompts, responses, over="layers", rho=0.0)
    real = b["tail_mask"].bool()
    assert (logits - own)[real].abs().max().item() <= TOL
    # over positions, ρ=0 recomputes the whole prompt on an empty C_base: compare the response predictions
    logits, labels = shared_forward(base, dec, prompts, responses, over="positions", rho=0.0)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        n = len(p)
        assert (labels[i] != -100).sum().item() == len(r)
        assert (logits[i, n - 1 : n - 1 + len(r)] - own[i, : len(r)]).abs().max().item() <= TOL
    want = _own_prefill_nll(dec, base.tokenizer, prompts, responses)
    got = [s / c for s, c in row_nlls(logits, labels)]
    assert got == pytest.approx(want, abs=TOL)


def test_decoder_equal_to_base_gives_the_base_nll_at_every_rho(base, rows):
    prompts, responses = rows
    dec = ccft.make_decoder(base, "full", method="ccft")  # an untouched copy: the base reading its own cache
    want = _own_prefill_nll(base.model, base.tokenizer, prompts, responses)
    for over in ("positions", "layers"):
        for rho in (0.0, 0.25, 0.5, 0.75, 1.0):
            logits, labels = shared_forward(base, dec, prompts, responses, over=over, rho=rho)
            got = [s / c for s, c in row_nlls(logits, labels)]
            assert got == pytest.approx(want, abs=TOL), (over, rho)


def test_layer_sharing_acts_layer_by_layer(base, rows):
    """A decoder that differs from the base only in layers 2-3 has the base's K/V in layers 0-1, so sharing
    layers 0-1 (ρ=0.5) changes nothing, while sharing layers 2-3 does."""
    prompts, responses = rows
    dec = perturb(ccft.make_decoder(base, "full", method="ccft"), 3, scale=0.05, only_layers={2, 3})
    own, _ = shared_forward(base, dec, prompts, responses, over="layers", rho=0.0)
    half, _ = shared_forward(base, dec, prompts, responses, over="layers", rho=0.5)
    top, _ = shared_forward(base, dec, prompts, responses, over="layers", shared_layers=[2, 3])
    full, _ = shared_forward(base, dec, prompts, responses, over="layers", rho=1.0)
    assert (half - own).abs().max().item() <= TOL
    assert (top - own).abs().max().item() > 1e-3
    assert (full - top).abs().max().item() <= TOL


def test_ragged_position_split_equals_row_by_row(base, rows):
    prompts, responses = rows
    dec = _decoder(base, "full")
    logits, labels = shared_forward(base, dec, prompts, responses, over="positions", rho=0.5)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        k = recompute_tokens(len(p), 0.5)
        assert 1 < k < len(p)
        cache = ccft.compute_base_cache(base, [p], handoff_tokens=k)
        with torch.no_grad():
            one = ccft.decoder_forward(dec, cache, torch.tensor([p[-k:] + r]))
        assert (labels[i] != -100).sum().item() == len(r)
        assert (logits[i, : k + len(r)] - one[0]).abs().max().item() <= TOL


def test_shared_generation_matches_reference_generation(sharp, rows):
    base = sharp
    prompts, _ = rows
    ff, cc = decoders(base)
    kw = dict(max_new_tokens=5)
    ref_ps = [g.token_ids for g in ccft.generate(prompts, mode="prefillshare", decoder=cc, **kw)]
    ref_ff = [g.token_ids for g in ccft.generate(prompts, mode="full-ft", decoder=ff, **kw)]
    assert ref_ps != ref_ff
    for over in ("positions", "layers"):
        assert [g.token_ids for g in shared_generate(base, cc, prompts, over=over, rho=1.0, **kw)] == ref_ps
        assert [g.token_ids for g in shared_generate(base, ff, prompts, over=over, rho=0.0, **kw)] == ref_ff


def test_run_sweep_references_resume_and_cli(sharp, tmp_path, capsys):
    base = sharp
    task = ToyTask(4)
    ff, cc = decoders(base)
    curves = {"naive": ff, "prefillshare": cc}
    s = run_sweep(
        task,
        base,
        curves,
        tmp_path / "sw",
        rhos=[0.0, 1.0],
        gen_rows=1,
        batch_size=3,
        progress=False,
        n_resamples=200,
    )
    pts = {(p["label"], p["over"], p["rho"]): p for p in s["per_item"]}
    assert len(pts) == 2 + 2 * 2 * 2  # full-ft and base references + 2 curves x 2 axes x 2 ratios
    ref = pts[("full-ft", None, None)]["nll"]
    assert pts[("naive", "layers", 0.0)]["nll"] == pytest.approx(ref, abs=TOL)  # ρ=0: own prefill
    assert pts[("naive", "positions", 0.0)]["nll"] == pytest.approx(ref, abs=TOL)
    from ccft.evals.scoring import batch_nll, prepare

    prep = prepare(task, base.tokenizer, None)
    ps = [a / b for a, b in batch_nll("prefillshare", base, cc, prep.prompts, prep.references)]
    for over in ("positions", "layers"):
        assert pts[("prefillshare", over, 1.0)]["nll"] == pytest.approx(ps, abs=TOL)
        assert pts[("prefillshare", over, 1.0)][
            "recomputed_mean" if over == "positions" else "shared_layers"
        ] in (1.0, [0, 1, 2, 3])
    rows = {(p["label"], p["over"], p["rho"]): p for p in s["points"]}
    assert rows[("naive", "layers", 0.0)]["delta_nll_vs_full_ft"]["delta"] == pytest.approx(0.0, abs=TOL)
    assert rows[("naive", "layers", 1.0)]["n"] == 4 and set(rows[("naive", "layers", 1.0)]["metrics"]) == {
        "long",
        "has_space",
    }
    assert s["meta"]["n_items"] == 4 and s["meta"]["model"] and s["meta"]["hardware"] and s["meta"]["data"]
    # resume: finished points are kept, only the new ratio runs
    lines = (tmp_path / "sw" / "points.jsonl").read_text().splitlines()
    s2 = run_sweep(
        task,
        base,
        curves,
        tmp_path / "sw",
        rhos=[0.0, 0.5, 1.0],
        axes=["layers"],
        gen_rows=1,
        batch_size=3,
        progress=False,
        n_resamples=200,
    )
    lines2 = (tmp_path / "sw" / "points.jsonl").read_text().splitlines()
    assert lines2[: len(lines)] == lines and len(lines2) == len(lines) + 2
    assert len(s2["points"]) == len(pts) + 2
    with pytest.raises(ConfigError, match="other settings"):
        run_sweep(task, base, curves, tmp_path / "sw", rhos=[0.0], gen_rows=2, progress=False)
    # the CLI, on saved decoders
    from ccft.cli.main import main

    ccft.save_decoder(ff, tmp_path / "ff")
    ccft.save_decoder(cc, tmp_path / "cc")
    assert (
        main(
            [
                "sweep",
                "--task",
                "gsm8k",
                "--decoder",
                str(tmp_path / "ff"),
                "--decoder",
                str(tmp_path / "cc"),
                "--limit",
                "2",
                "--rho",
                "0",
                "1",
                "--over",
                "layers",
                "--no-progress",
                "--bootstrap",
                "100",
                "--out",
                str(tmp_path / "cli"),
            ]
        )
        == 0
    )
    out = json.loads((tmp_path / "cli" / "sweep.json").read_text())
    assert {(p["label"], p["rho"]) for p in out["points"]} == {
        ("full-ft", None),
        ("base", None),
        ("naive", 0.0),
        ("naive", 1.0),
        ("prefillshare", 0.0),
        ("prefillshare", 1.0),
    }
    assert "wrote" in capsys.readouterr().out


def test_sweep_points_that_are_eval_modes_reuse_the_eval_records(sharp, tmp_path):
    """The references, ρ = 1 (either axis) and the naive curve at ρ = 0 are eval modes: with ``eval_records``
    from an eval run of the same items they take its per-item NLLs (equal to computing them, ≤ 1e-5); the
    other points are computed; a record on another prompt is not reused."""
    from ccft.evals.runner import EvalSettings, ModeSpec, run_task

    base = sharp
    task = ToyTask(4)
    ff, cc = decoders(base)
    curves = {"naive": ff, "prefillshare": cc}
    specs = [
        ModeSpec("base"),
        ModeSpec("full-ft", ff, "ff"),
        ModeSpec("naive", ff, "ff"),
        ModeSpec("prefillshare", cc, "cc"),
    ]
    ev = run_task(
        task,
        base,
        specs,
        tmp_path / "ev",
        settings=EvalSettings(generate=False),
        progress=False,
        n_resamples=100,
    )
    recs = {m: {r["id"]: r for r in rs} for m, rs in ev.records.items()}
    kw = dict(rhos=[0.0, 0.5, 1.0], batch_size=3, progress=False, n_resamples=100)
    fresh = run_sweep(task, base, curves, tmp_path / "a", **kw)
    reused = run_sweep(task, base, curves, tmp_path / "b", eval_records=recs, **kw)
    a = {(p["label"], p["over"], p["rho"]): p for p in fresh["per_item"]}
    b = {(p["label"], p["over"], p["rho"]): p for p in reused["per_item"]}
    assert a.keys() == b.keys()
    for key, p in b.items():
        assert p["ids"] == a[key]["ids"] and p["nll_tokens"] == a[key]["nll_tokens"]
        assert p["nll"] == pytest.approx(a[key]["nll"], abs=TOL), key
        assert p.get("recomputed_mean") == a[key].get("recomputed_mean")
    from_eval = {k: p["source"] for k, p in b.items() if "source" in p}
    assert from_eval == {
        ("base", None, None): "eval:base",
        ("full-ft", None, None): "eval:full-ft",
        ("naive", "positions", 0.0): "eval:full-ft",
        ("naive", "positions", 1.0): "eval:naive",
        ("naive", "layers", 0.0): "eval:full-ft",
        ("naive", "layers", 1.0): "eval:naive",
        ("prefillshare", "positions", 1.0): "eval:prefillshare",
        ("prefillshare", "layers", 1.0): "eval:prefillshare",
    }
    # a record on another prompt: that mode's points are computed
    first = next(iter(recs["naive"]))
    recs["naive"][first] = dict(recs["naive"][first], prompt_sha="0" * 16)
    other = run_sweep(task, base, curves, tmp_path / "c", eval_records=recs, **kw)
    assert not any(p.get("source") == "eval:naive" for p in other["per_item"])
    assert any(p.get("source") == "eval:prefillshare" for p in other["per_item"])
