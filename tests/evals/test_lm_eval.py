"""lm-eval integration: ``--model ccft`` runs generation and log-likelihood tasks on the shared prefill.

Offline: the tasks are the YAML files in ``tests/evals/lm_eval_tasks`` with local data. Every value lm-eval
reports is recomputed here from ccft primitives (C_base + ``decoder_forward``, plain HF forwards,
``ccft.generate``), not from the adapter's code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness_fixtures import perturb

import ccft
from ccft.core.compact import read_cache
from ccft.core.errors import ConfigError
from conftest import make_tiny_folder

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.tasks import TaskManager  # noqa: E402

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("lm_eval")
    base_dir = make_tiny_folder(root / "base", tokenizer, seed=5, scale=30.0)
    base = ccft.load_base(str(base_dir))
    ff = perturb(ccft.make_decoder(base, "full", method="full-ft"), 1)
    ccft.save_decoder(ff, root / "ff")
    ccft.save_decoder(ccft.make_decoder(base, "full", method="ccft"), root / "same")  # == the base
    cc = ccft.make_decoder(base, "lora", method="ccft", lora={"r": 4, "init_lora_weights": False})
    ccft.save_decoder(cc, root / "cc")
    cc.cache_format = "int8"  # trained on the compact C_base (issue 35): its log-likelihoods read that cache
    ccft.save_decoder(cc, root / "cc8")
    return {
        "base": base_dir,
        "ff": root / "ff",
        "cc": root / "cc",
        "cc8": root / "cc8",
        "same": root / "same",
        "root": root,
    }


def _evaluate(model_args: str, tasks=("ccft_tiny_gen", "ccft_tiny_mc")):
    import ccft.evals.lm_eval_model  # noqa: F401  (registers "ccft")

    tm = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    return lm_eval.simple_evaluate(
        model="ccft",
        model_args=model_args,
        tasks=list(tasks),
        task_manager=tm,
        log_samples=True,
        bootstrap_iters=0,
    )


def _expected_logprob(mode, base, decoder, ctx: str, cont: str) -> float:
    tok = base.tokenizer
    ctx_ids = tok(ctx, add_special_tokens=False)["input_ids"]
    cont_ids = tok(ctx + cont, add_special_tokens=False)["input_ids"][len(ctx_ids) :]
    with torch.no_grad():
        if mode in ("naive", "prefillshare"):
            cache = read_cache(ccft.compute_base_cache(base, [ctx_ids]), decoder.cache_format)
            logits = ccft.decoder_forward(decoder, cache, torch.tensor([ctx_ids[-1:] + cont_ids]))[0]
            lp = torch.log_softmax(logits.float(), -1)[:-1]
        else:
            model = base.model if mode == "base" else decoder.model
            logits = model(input_ids=torch.tensor([ctx_ids + cont_ids])).logits[0]
            lp = torch.log_softmax(logits.float(), -1)[len(ctx_ids) - 1 : -1]
    return float(lp.gather(-1, torch.tensor(cont_ids)[:, None]).sum())


def _check_against_primitives(res, mode, base, decoder):
    samples = res["samples"]["ccft_tiny_mc"]
    correct = []
    for s in samples:
        want = [
            _expected_logprob(mode, base, decoder, ctx, cont) for ctx, cont in (a for a in s["arguments"])
        ]
        got = [r[0] for r in s["filtered_resps"]]
        assert got == pytest.approx(want, rel=1e-5, abs=1e-3)
        correct.append(max(range(len(want)), key=want.__getitem__) == s["target"])
    assert res["results"]["ccft_tiny_mc"]["acc,none"] == pytest.approx(sum(correct) / len(correct))
    tok = base.tokenizer
    gen = res["samples"]["ccft_tiny_gen"]
    prompts = [tok(s["arguments"][0][0], add_special_tokens=False)["input_ids"] for s in gen]
    kw = gen[0]["arguments"][0][1]
    ref = ccft.generate(
        prompts,
        mode=mode,
        base=base,
        decoder=decoder if mode != "base" else None,
        max_new_tokens=kw["max_gen_toks"],
        stop=kw["until"],
        batch_size=1,
    )
    assert [s["filtered_resps"][0] for s in gen] == [g.text for g in ref]
    assert len({g.text for g in ref}) > 1
    em = sum(s["filtered_resps"][0] == s["target"] for s in gen) / len(gen)
    assert res["results"]["ccft_tiny_gen"]["exact_match,none"] == pytest.approx(em)
    return [[r[0] for r in s["filtered_resps"]] for s in samples]


@pytest.mark.parametrize("mode,key", [("prefillshare", "cc"), ("prefillshare", "cc8"), ("full-ft", "ff")])
def test_generation_and_loglikelihood_tasks_match_ccft(folders, mode, key):
    res = _evaluate(f"base={folders['base']},decoder={folders[key]},mode={mode},batch_size=3")
    base = ccft.load_base(str(folders["base"]))
    dec = ccft.load_decoder(folders[key], base=base)
    _check_against_primitives(res, mode, base, dec)


def test_decoder_equal_to_base_scores_like_the_base(folders):
    """docs/design.md, "Invariants the tests hold" 1, through lm-eval: a decoder equal to the base, reading
    C_base, scores as the base itself."""
    tasks = ("ccft_tiny_mc",)
    a = _evaluate(f"base={folders['base']},mode=base", tasks)["samples"]["ccft_tiny_mc"]
    b = _evaluate(f"decoder={folders['same']},mode=prefillshare", tasks)["samples"]["ccft_tiny_mc"]
    for x, y in zip(a, b, strict=True):
        assert [r[0] for r in y["filtered_resps"]] == pytest.approx(
            [r[0] for r in x["filtered_resps"]], rel=1e-5, abs=1e-3
        )


def test_mode_errors(folders):
    import ccft.evals.lm_eval_model as m

    with pytest.raises(ConfigError, match="method"):
        m.CCFTLM(decoder=str(folders["cc"]), mode="naive")
    with pytest.raises(ConfigError, match="needs decoder"):
        m.CCFTLM(mode="prefillshare")
    with pytest.raises(ConfigError, match="unknown model_args"):
        m.CCFTLM(decoder=str(folders["cc"]), mode="prefillshare", temperature=0.5)


def test_lm_eval_command_line(folders, tmp_path):
    """The lm_eval CLI (its own argument parser) with ccft registered: naive mode, a log-likelihood task."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_TOKEN", "OPENAI"))}
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [
        sys.executable,
        "-m",
        "ccft.evals.lm_eval_model",
        "--model",
        "ccft",
        "--model_args",
        f"base={folders['base']},decoder={folders['ff']},mode=naive",
        "--tasks",
        "ccft_tiny_mc",
        "--include_path",
        str(TASKS_DIR),
        "--output_path",
        str(tmp_path / "out"),
        "--log_samples",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = sorted((tmp_path / "out").rglob("results_*.json"))
    samples = sorted((tmp_path / "out").rglob("samples_ccft_tiny_mc_*.jsonl"))
    assert results and samples
    acc = json.loads(results[-1].read_text())["results"]["ccft_tiny_mc"]["acc,none"]
    base = ccft.load_base(str(folders["base"]))
    dec = ccft.load_decoder(folders["ff"], base=base)
    correct = []
    for line in samples[-1].read_text().splitlines():
        s = json.loads(line)
        want = (
            [_expected_logprob("naive", base, dec, a["arg_0"], a["arg_1"]) for a in s["arguments"].values()]
            if isinstance(s["arguments"], dict)
            else [_expected_logprob("naive", base, dec, ctx, cont) for ctx, cont in s["arguments"]]
        )
        got = [float(r[0]) for r in s["filtered_resps"]]
        assert got == pytest.approx(want, rel=1e-5, abs=1e-3)
        correct.append(max(range(len(want)), key=want.__getitem__) == int(s["target"]))
    assert acc == pytest.approx(sum(correct) / len(correct))
