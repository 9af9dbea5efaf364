"""The eval runner with a decoder trained at sharing depth m > 0 (issue 35, items 1 and 2): ``engine=True``
serves it (``SharedPrefillEngine``: its own K/V below layer m, C_base above) with the reference path's texts
and NLLs, and those read the hybrid prefix (checked by hand on one row)."""

from __future__ import annotations

import pytest
import torch
from harness_fixtures import ToyTask, perturb

import ccft
from ccft.core.depth import depth_cache, prompt_prefixes
from ccft.core.tokens import pad_token_id, tokenize_response
from ccft.evals.runner import EvalSettings, ModeSpec, run_task
from conftest import make_tiny_folder

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def deep(tmp_path_factory, tokenizer):
    folder = make_tiny_folder(tmp_path_factory.mktemp("deep_eval"), tokenizer, seed=3, layers=4, scale=30.0)
    base = ccft.load_base(str(folder))
    dec = perturb(ccft.make_decoder(base, "full", method="ccft", share_from_layer=2), 2, scale=0.1)
    return base, dec


def test_engine_at_depth_equals_the_reference_path(deep, tmp_path):
    base, dec = deep
    specs = [ModeSpec("prefillshare", dec, "cc")]
    kw = dict(batch_size=4, progress=False)
    asked = run_task(ToyTask(5), base, specs, tmp_path / "engine", settings=EvalSettings(engine=True), **kw)
    ref = run_task(ToyTask(5), base, specs, tmp_path / "ref", settings=EvalSettings(), **kw)
    assert asked.summary["meta"]["settings"]["decode_path"] == "SharedPrefillEngine (every mode)"
    got, want = asked.records["prefillshare"], ref.records["prefillshare"]
    assert [r["text"] for r in got] == [r["text"] for r in want]
    assert [r["nll"] for r in got] == pytest.approx([r["nll"] for r in want], rel=1e-5)

    # the NLL is the hybrid prefix's: one row checked by hand, and it differs from depth 0 (plain C_base)
    task = ToyTask(5)
    item = task.load()[0]
    p = task.prompt_ids(base.tokenizer, item)
    y = tokenize_response(base.tokenizer, task.reference_text(item))
    c_base = ccft.compute_base_cache(base, [p])
    ids, mask = prompt_prefixes([p], 1, pad_token_id(base.tokenizer))
    tail = torch.tensor([[p[-1]] + y])
    with torch.no_grad():
        hybrid = depth_cache(dec, c_base, ids, mask, 2)
        logits = ccft.decoder_forward(dec, hybrid, tail)
        dec.share_from_layer = 0
        try:
            flat = ccft.decoder_forward(dec, c_base, tail)
        finally:
            dec.share_from_layer = 2

    def nll(lg):
        logp = torch.log_softmax(lg[0, :-1].float(), -1)
        return float(-logp.gather(-1, torch.tensor(y)[:, None]).mean())

    assert got[0]["nll"] == pytest.approx(nll(logits), abs=1e-5)
    assert abs(nll(flat) - got[0]["nll"]) > 1e-3
