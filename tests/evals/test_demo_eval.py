"""``ccft demo``'s evaluation is ``ccft eval``: one stack, one prompt rule, one scoring rule, one result
format.

The demo runs end to end on a tiny random Llama (two 1-step LoRA decoders, the GSM8K task of the registry);
its numbers are checked against independent computations (plain HF forwards, ``decoder_forward`` on C_base,
``ccft.generate``, the task's ``score``), its prompt ids against the training rule (``tokenize_row`` with the
recipe's chat template and system prompt) and against ``ccft eval`` on the same decoders.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import ccft
from ccft.core.errors import ConfigError
from ccft.core.generation import Generation
from ccft.core.modes import get_mode
from ccft.core.tokens import tokenize_response
from ccft.evals.extract import exact_match, extract_flexible, extract_reference
from ccft.evals.prompting import PromptFormat, prompt_ids, resolve_prompt_format
from ccft.evals.protocol import get_task
from ccft.evals.records import summarize_records
from ccft.evals.results import read_jsonl
from ccft.evals.scoring import prompt_hash
from ccft.train.config import EvalConfig
from ccft.train.data import tokenize_row
from conftest import make_tiny_folder

MODES = ("base", "full-ft", "naive", "prefillshare")
SYSTEM = "You are a careful math tutor."
RECIPE = """base: {base}
decoder_kind: lora
lora_r: 4
lora_alpha: 8
handoff_tokens: 1
train_data: gsm8k:train
train_rows: 4
max_steps: 1
per_device_train_batch_size: 2
learning_rate: 1.0e-2
seed: 3
logging_steps: 1
save_strategy: "no"
use_cpu: true
report_to: none
disable_tqdm: true
chat_template: true
system_prompt: {system}
eval:
  task: gsm8k
  nll_rows: 3
  em_rows: 2
  max_new_tokens: 4
  batch_size: 2
  bootstrap: 200
"""


@pytest.fixture(scope="module")
def demo(tmp_path_factory, tokenizer):
    """``ccft demo`` on a tiny base: trains both decoders (1 step) and evaluates the four modes."""
    from ccft.cli.main import main

    root = tmp_path_factory.mktemp("demo")
    base_dir = make_tiny_folder(root / "base", tokenizer, seed=11, scale=30.0)
    recipe = root / "demo.yaml"
    recipe.write_text(RECIPE.format(base=base_dir, system=SYSTEM))
    out, runs = root / "report", root / "runs"
    assert main(["demo", str(recipe), "--out", str(out), "--runs", str(runs)]) == 0
    return SimpleNamespace(root=root, base_dir=base_dir, recipe=recipe, out=out, runs=runs)


def _load(demo):
    base = ccft.load_base(str(demo.base_dir))
    return base, {m: ccft.load_decoder(demo.runs / m, base=base) for m in ("ccft", "full-ft")}


def _gsm8k_test(n):
    task = get_task("gsm8k")
    return task, task.load(n)


def _decoder(mode, decoders):
    return {
        "base": None,
        "full-ft": decoders["full-ft"],
        "naive": decoders["full-ft"],
        "prefillshare": decoders["ccft"],
    }[mode]


def _expected_nll(mode, base, dec, prompt, response):
    """Mean NLL per token of ``response`` after ``prompt`` from primitives: a plain forward of the model over
    its own prompt (base, full-ft) or the decoder over the last prompt token + response on C_base (naive,
    prefillshare)."""
    with torch.no_grad():
        if mode in ("naive", "prefillshare"):
            logits = ccft.decoder_forward(
                dec, ccft.compute_base_cache(base, [prompt]), torch.tensor([[prompt[-1]] + response])
            )
            logp = torch.log_softmax(logits[0].float(), -1)[:-1]
        else:
            if mode == "base":
                with base.base_weights() as model:
                    logits = model(input_ids=torch.tensor([prompt + response])).logits[0]
            else:
                logits = dec.activate()(input_ids=torch.tensor([prompt + response])).logits[0]
            logp = torch.log_softmax(logits.float(), -1)[len(prompt) - 1 : -1]
    return float(-logp.gather(-1, torch.tensor(response)[:, None]).mean())


def _records(folder, modes=MODES):
    """Each mode's item records in item order (the file is in the order they finished)."""
    return {m: sorted(read_jsonl(folder / f"items.{m}.jsonl"), key=lambda r: r["index"]) for m in modes}


def test_demo_evaluates_through_the_runner_end_to_end(demo, tmp_path):
    from ccft.cli.demo import demo_readme
    from ccft.cli.main import main
    from ccft.evals.report import build_report, modes_table

    base, decoders = _load(demo)
    tok = base.tokenizer
    task, items = _gsm8k_test(3)
    folder = demo.out / "gsm8k"
    recs = _records(folder)
    # the prompt ids are the training rule's: the recipe's chat template and system prompt, in every mode
    train_ids = [
        tokenize_row(
            tok, {"prompt": it.prompt, "response": it.reference}, chat_template=True, system_prompt=SYSTEM
        ).prompt_ids
        for it in items
    ]
    task_ids = [task.prompt_ids(tok, it) for it in items]
    assert all(list(a) != b for a, b in zip(train_ids, task_ids, strict=True))  # the system prompt is there
    for mode in MODES:
        assert [r["id"] for r in recs[mode]] == [it.id for it in items]
        assert [r["prompt_sha"] for r in recs[mode]] == [prompt_hash(list(p)) for p in train_ids]
    # NLL on the first nll_rows items == primitives; generations on the first em_rows only, == ccft.generate,
    # scored by the registry's GSM8K task
    prompts = [list(p) for p in train_ids]
    refs = [tokenize_response(tok, it.reference) for it in items]
    for mode in MODES:
        dec = _decoder(mode, decoders)
        for r, p, y in zip(recs[mode], prompts, refs, strict=True):
            assert r["nll"] == pytest.approx(_expected_nll(mode, base, dec, p, y), abs=1e-4)
        gens = ccft.generate(prompts[:2], mode=mode, base=base, decoder=dec, max_new_tokens=4, batch_size=1)
        for r, g, it in zip(recs[mode][:2], gens, items[:2], strict=True):
            assert (r["text"], r["finish_reason"]) == (g.text, g.finish_reason)
            assert r["scores"] == task.score(it, g.text)
        assert "text" not in recs[mode][2] and "scores" not in recs[mode][2]
    assert len({r["text"] for m in MODES for r in recs[m][:2]}) > 1
    # one result format: the runner's summary, read back by the demo's results.json, README and ccft report
    summary = json.loads((folder / "summary.json").read_text())
    meta = summary["meta"]
    assert meta["settings"]["prompting"] == PromptFormat(True, SYSTEM).describe() and meta["n_items"] == 3
    assert meta["settings"]["generate_limit"] == 2 and meta["modes"]["prefillshare"]["method"] == "ccft"
    for mode in MODES:
        want = summarize_records(recs[mode], task, n_resamples=200)
        assert summary["modes"][mode]["nll"] == pytest.approx(want["nll"])
        assert summary["modes"][mode]["metrics"] == want["metrics"]
        assert summary["modes"][mode]["n"] == 3 and summary["modes"][mode]["scored_n"] == 2
    result = json.loads((demo.out / "results.json").read_text())
    assert result["kind"] == "ccft-demo" and result["eval"]["modes"] == summary["modes"]
    assert result["eval_folder"] == "gsm8k" and result["train_rows"] == 4 and result["steps"] == 1
    readme = (demo.out / "README.md").read_text()
    assert readme == demo_readme(result, str(demo.recipe))
    assert modes_table(summary) in readme and "| n | n scored | truncated |" in readme
    assert meta["settings"]["decode_path"] == "SharedPrefillEngine (every mode)"  # EvalConfig's default
    assert "- **Decode path**: every mode on `ccft.SharedPrefillEngine`: each group of items" in readme
    for mode in MODES:
        assert f"| {mode} | {get_mode(mode).note} | {summary['modes'][mode]['nll']:.4f}" in readme
    rep = build_report([str(demo.out)], tmp_path / "rep")
    assert sorted(r["mode"] for r in rep["headline"]) == sorted(
        MODES
    )  # results.json is not read a second time
    assert {r["n"] for r in rep["headline"]} == {3}
    # rerunning the demo reuses both decoders and every evaluated item
    lines = {m: (folder / f"items.{m}.jsonl").read_text() for m in MODES}
    assert main(["demo", str(demo.recipe), "--out", str(demo.out), "--runs", str(demo.runs)]) == 0
    assert {m: (folder / f"items.{m}.jsonl").read_text() for m in MODES} == lines
    # a demo with other eval settings starts its own evaluation folder over instead of failing
    import shutil

    shutil.copytree(demo.out, tmp_path / "again")
    assert (
        main(
            [
                "demo",
                str(demo.recipe),
                "eval.em_rows=1",
                "--out",
                str(tmp_path / "again"),
                "--runs",
                str(demo.runs),
            ]
        )
        == 0
    )
    again = _records(tmp_path / "again" / "gsm8k")
    for mode in MODES:
        assert [("text" in r, r["nll"]) for r in again[mode]] == [
            (True, r["nll"]) for r in recs[mode][:1]
        ] + [(False, r["nll"]) for r in recs[mode][1:]]


def test_ccft_eval_builds_the_demos_prompt_ids(demo, tmp_path, capsys):
    """The same item and decoder give identical prompt ids (and so identical NLL) in ``ccft demo`` and
    ``ccft eval``; ``--prompt-format task`` is the task's own rendering."""
    from ccft.cli.main import main

    base = [str(demo.runs / "full-ft"), str(demo.runs / "ccft")]
    argv = [
        "eval",
        "--task",
        "gsm8k",
        "--decoder",
        base[0],
        "--decoder",
        base[1],
        "--limit",
        "3",
        "--nll-only",
        "--batch-size",
        "2",
        "--no-progress",
        "--bootstrap",
        "200",
    ]
    assert main(argv + ["--out", str(tmp_path / "eval")]) == 0
    assert SYSTEM in capsys.readouterr().out  # it says which prompts it measured
    demo_recs, eval_recs = _records(demo.out / "gsm8k"), _records(tmp_path / "eval" / "gsm8k")
    for mode in MODES:
        assert [(r["id"], r["prompt_sha"]) for r in eval_recs[mode]] == [
            (r["id"], r["prompt_sha"]) for r in demo_recs[mode]
        ]
        assert [r["nll"] for r in eval_recs[mode]] == pytest.approx(
            [r["nll"] for r in demo_recs[mode]], abs=1e-6
        )
    assert main(argv + ["--prompt-format", "task", "--out", str(tmp_path / "task")]) == 0
    task, items = _gsm8k_test(3)
    tok = ccft.load_base(str(demo.base_dir)).tokenizer
    for mode, recs in _records(tmp_path / "task" / "gsm8k").items():
        assert [r["prompt_sha"] for r in recs] == [prompt_hash(task.prompt_ids(tok, it)) for it in items]
        assert [r["prompt_sha"] for r in recs] != [r["prompt_sha"] for r in demo_recs[mode]]


def test_prompt_echo_is_scored_by_one_rule(demo, tmp_path, monkeypatch):
    """K7: a generation that only repeats the question scores 0 in ``ccft demo`` and ``ccft eval`` alike, even
    when the question's last number is the answer; the question followed by an answer scores that answer."""
    from ccft.cli.main import main
    from ccft.evals.evaluate import evaluate_decoders

    task, items = _gsm8k_test(5)
    echo_only, echo_answer = items[4], items[3]
    # the old demo rule (flexible extraction on the raw text) scored the pure echo of item 4 as correct
    assert exact_match(extract_flexible(echo_only.prompt), extract_reference(echo_only.reference))
    base, decoders = _load(demo)
    tok = base.tokenizer
    texts = {it.prompt: it.prompt for it in items}
    texts[echo_answer.prompt] = echo_answer.prompt + "\n#### " + extract_reference(echo_answer.reference)

    def echo(prompts, **_):
        out = []
        for p in prompts:
            shown = tok.decode(p, skip_special_tokens=False)
            (q,) = [q for q in texts if q in shown]
            out.append(Generation(text=texts[q], token_ids=[0], finish_reason="eos"))
        return out

    monkeypatch.setattr("ccft.evals.generation.generate", echo)  # the reference path's generator
    ecfg = EvalConfig(
        task="gsm8k",
        nll_rows=5,
        em_rows=5,
        max_new_tokens=4,
        batch_size=5,
        modes=["base", "prefillshare"],
        bootstrap=100,
        engine=False,
    )
    demo_res = evaluate_decoders(base, decoders, ecfg, tmp_path / "demo", progress=False)
    assert (
        main(
            [
                "eval",
                "--task",
                "gsm8k",
                "--decoder",
                str(demo.runs / "ccft"),
                "--mode",
                "base",
                "--mode",
                "prefillshare",
                "--limit",
                "5",
                "--max-new-tokens",
                "4",
                "--no-progress",
                "--bootstrap",
                "100",
                "--no-engine",
                "--out",
                str(tmp_path / "eval"),
            ]
        )
        == 0
    )
    eval_recs = _records(tmp_path / "eval" / "gsm8k", ("base", "prefillshare"))
    zero = {"exact_match_strict": 0.0, "exact_match_flexible": 0.0, "answer_format": 0.0}
    for mode in ("base", "prefillshare"):
        for recs in (demo_res.records[mode], eval_recs[mode]):
            by_id = {r["id"]: r["scores"] for r in recs}
            assert by_id[echo_only.id] == zero
            assert by_id[echo_answer.id] == {
                "exact_match_strict": 1.0,
                "exact_match_flexible": 1.0,
                "answer_format": 1.0,
            }
            assert sum(s["exact_match_flexible"] for s in by_id.values()) == 1.0
        assert [r["scores"] for r in demo_res.records[mode]] == [r["scores"] for r in eval_recs[mode]]


def test_prompt_format_rule(tokenizer):
    assert PromptFormat.from_recipe({}) == PromptFormat("auto", None)  # TrainConfig's defaults
    assert PromptFormat.from_recipe({"chat_template": "false", "system_prompt": "S"}) == PromptFormat(
        False, "S"
    )
    assert PromptFormat.from_recipe({"chat_template": True}) == PromptFormat(True, None)
    task, items = _gsm8k_test(1)
    item = items[0]
    # a chat task in the decoders' format == a training row with that prompt, for each chat_template setting
    for fmt in (PromptFormat(True, SYSTEM), PromptFormat(False, SYSTEM), PromptFormat("auto", None)):
        row = tokenize_row(
            tokenizer,
            {"prompt": item.prompt, "response": "x"},
            chat_template=fmt.chat_template,
            system_prompt=fmt.system_prompt,
        )
        assert prompt_ids(task, tokenizer, item, fmt) == list(row.prompt_ids)
    assert prompt_ids(task, tokenizer, item, None) == task.prompt_ids(tokenizer, item)
    # a completion task keeps its own prompt: its scoring expects a continuation of the text
    code = get_task("humaneval")
    assert not PromptFormat(True, SYSTEM).applies_to(code)
    (cit,) = code.load(1)
    assert prompt_ids(code, tokenizer, cit, PromptFormat(True, SYSTEM)) == code.prompt_ids(tokenizer, cit)
    # resolving from decoders: their recorded recipe; none recorded -> the task's; different ones
    # -> ConfigError
    dec = lambda recipe: SimpleNamespace(meta={"recipe": recipe})  # noqa: E731
    assert resolve_prompt_format(
        "decoder", [dec({"system_prompt": SYSTEM}), dec({"system_prompt": SYSTEM})]
    ) == PromptFormat("auto", SYSTEM)
    assert resolve_prompt_format("decoder", [SimpleNamespace(meta={}), dec({})]) is None
    assert resolve_prompt_format("task", [dec({"system_prompt": SYSTEM})]) is None
    with pytest.raises(ConfigError, match="rendered differently"):
        resolve_prompt_format("decoder", [dec({"system_prompt": SYSTEM}), dec({"chat_template": False})])
    with pytest.raises(ConfigError, match="prompt format"):
        resolve_prompt_format("recipe", [])
