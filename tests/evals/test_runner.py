"""Eval runner: four modes on the same items (values checked against independent forwards and ccft.generate),
batch-size independence (K7 in docs/design.md, "Fault classes"), per-item resume after an interruption,
settings guard, the ``ccft eval`` CLI."""

from __future__ import annotations

import json

import pytest
import torch
from harness_fixtures import ToyTask, decoders

import ccft
from ccft.core.errors import ConfigError
from ccft.core.tokens import tokenize_response
from ccft.evals.protocol import task_name
from ccft.evals.runner import EvalSettings, ModeSpec, batch_nll, get_task, read_jsonl, run_task, task_names
from ccft.evals.stats import mean_ci, paired_bootstrap_delta
from conftest import make_tiny_folder

MODES = ("base", "full-ft", "naive", "prefillshare")


@pytest.fixture(scope="module")
def sharp_dir(tmp_path_factory, tokenizer):
    """Clear logit margins (lm_head × 30) so greedy choices are far from ties."""
    return make_tiny_folder(tmp_path_factory.mktemp("runner_sharp"), tokenizer, seed=3, scale=30.0)


@pytest.fixture(scope="module")
def setup(sharp_dir):
    base = ccft.load_base(str(sharp_dir))
    ff, cc = decoders(base)
    specs = [
        ModeSpec("base"),
        ModeSpec("full-ft", ff, "ff"),
        ModeSpec("naive", ff, "ff"),
        ModeSpec("prefillshare", cc, "cc"),
    ]
    return base, ff, cc, specs


@pytest.fixture(scope="module")
def full_run(setup, tmp_path_factory):
    base, _, _, specs = setup
    out = tmp_path_factory.mktemp("full_run")
    return run_task(ToyTask(), base, specs, out, settings=EvalSettings(), batch_size=8, progress=False), out


def _hf_nll(model, prompt, response):
    """Mean NLL per token of ``response`` after ``prompt``: one plain HF forward, no ccft code."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    n = len(prompt)
    tgt = torch.tensor(response)
    return float(-logp[n - 1 : n - 1 + len(response)].gather(-1, tgt[:, None]).mean())


def test_modes_run_same_items_with_real_values(setup, full_run):
    base, ff, cc, _ = setup
    res, out = full_run
    task = ToyTask()
    items = task.load()
    tok = base.tokenizer
    prompts = [task.prompt_ids(tok, it) for it in items]
    refs = [tokenize_response(tok, task.reference_text(it)) for it in items]
    assert set(res.records) == set(MODES)
    for mode in MODES:
        assert [r["id"] for r in res.records[mode]] == [it["id"] for it in items]
    # self-prefill NLL == a plain HF forward over prompt + response
    for mode, model in (("base", base.model), ("full-ft", ff.model)):
        for r, p, y in zip(res.records[mode], prompts, refs, strict=True):
            assert r["nll"] == pytest.approx(_hf_nll(model, p, y), abs=1e-4)
    # shared modes == decoder_forward on C_base of the same prompt ids, row by row
    for mode, dec in (("naive", ff), ("prefillshare", cc)):
        for r, p, y in zip(res.records[mode], prompts, refs, strict=True):
            cache = ccft.compute_base_cache(base, [p])
            with torch.no_grad():
                logits = ccft.decoder_forward(dec, cache, torch.tensor([[p[-1]] + y]))
            logp = torch.log_softmax(logits[0].float(), -1)
            want = float(-logp[:-1].gather(-1, torch.tensor(y)[:, None]).mean())
            assert r["nll"] == pytest.approx(want, abs=1e-5)
    # naive reads C_base: its NLL differs from the same decoder's own prefill
    assert any(
        abs(a["nll"] - b["nll"]) > 1e-3
        for a, b in zip(res.records["naive"], res.records["full-ft"], strict=True)
    )
    # generations == ccft.generate with the same settings; scores == task.score of that text
    for mode, dec in (("base", None), ("full-ft", ff), ("naive", ff), ("prefillshare", cc)):
        gens = ccft.generate(
            prompts,
            mode=mode,
            base=base,
            decoder=dec,
            max_new_tokens=task.max_new_tokens,
            stop=task.stop,
            batch_size=9,
        )
        for r, g, it in zip(res.records[mode], gens, items, strict=True):
            assert (r["text"], r["finish_reason"]) == (g.text, g.finish_reason)
            assert r["scores"] == {k: float(v) for k, v in task.score(it, g.text).items()}
    # summary numbers are the means / bootstrap CIs of the item records; deltas are paired by item
    s = res.summary
    for mode in MODES:
        nll = [r["nll"] for r in res.records[mode]]
        m = mean_ci(nll)
        assert s["modes"][mode]["nll"] == pytest.approx(m["mean"])
        assert s["modes"][mode]["nll_ci"] == pytest.approx(list(m["ci"]))
        long = [r["scores"]["long"] for r in res.records[mode]]
        assert s["modes"][mode]["metrics"]["long"]["mean"] == pytest.approx(sum(long) / len(long))
        assert s["modes"][mode]["task_aggregate"] == {"items": 9, "long_count": sum(long)}
        assert s["modes"][mode]["n"] == 9 and s["modes"][mode]["complete"]
    d = paired_bootstrap_delta(
        [r["nll"] for r in res.records["naive"]], [r["nll"] for r in res.records["full-ft"]]
    )
    assert s["deltas_vs_full_ft"]["naive"]["nll"]["delta"] == pytest.approx(d["delta"])
    assert s["deltas_vs_full_ft"]["naive"]["nll"]["ci"] == pytest.approx(list(d["ci"]))
    assert "full-ft" not in s["deltas_vs_full_ft"]
    # every number names model, data, n and hardware
    meta = json.loads((out / "toy" / "meta.json").read_text())
    assert (
        meta["n_items"] == 9 and meta["data"] == task.data and "float32" in meta["model"] and meta["hardware"]
    )
    assert meta["settings"]["max_new_tokens"] == 6 and meta["settings"]["prompting"] == task.prompting
    assert json.loads((out / "toy" / "summary.json").read_text())["modes"]["naive"]["n"] == 9


def test_greedy_scores_identical_at_batch_size_1_and_8(setup, full_run, tmp_path):
    """K7: batching (left padding, length sorting, chunking) changes no generation, score or NLL.

    full-ft stands for the self-prefill path (base is the same code), prefillshare for the C_base path (naive
    too).
    """
    base, _, _, specs = setup
    eight, _ = full_run
    two = [s for s in specs if s.mode in ("full-ft", "prefillshare")]
    one = run_task(ToyTask(), base, two, tmp_path, settings=EvalSettings(), batch_size=1, progress=False)
    for mode in ("full-ft", "prefillshare"):
        a, b = one.records[mode], eight.records[mode]
        assert [(r["id"], r["text"], r["finish_reason"], r["scores"]) for r in a] == [
            (r["id"], r["text"], r["finish_reason"], r["scores"]) for r in b
        ]
        assert [r["nll"] for r in a] == pytest.approx([r["nll"] for r in b], abs=1e-5)
        assert len({r["text"] for r in a}) > 1  # the model does not emit one constant string


def test_interrupted_eval_resumes_without_redoing_items(setup, full_run, tmp_path):
    base, _, _, specs = setup
    specs = [s for s in specs if s.mode in ("base", "prefillshare")]
    first: list[tuple[str, str]] = []

    def interrupt_after_5(mode, rec):
        first.append((mode, rec["id"]))
        if len(first) == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_task(ToyTask(), base, specs, tmp_path, batch_size=4, progress=False, on_item=interrupt_after_5)
    path = tmp_path / "toy" / "items.base.jsonl"
    written = {m: len(read_jsonl(tmp_path / "toy" / f"items.{m}.jsonl")) for m in ("base", "prefillshare")}
    assert sum(written.values()) == 5 and written == {m: sum(x == m for x, _ in first) for m in written}
    with open(path, "a") as f:  # a process killed in the middle of a write leaves a torn line
        f.write('{"id": "toy/8", "nll": 1.')
    second: list[tuple[str, str]] = []
    res = run_task(
        ToyTask(),
        base,
        specs,
        tmp_path,
        batch_size=4,
        progress=False,
        on_item=lambda m, r: second.append((m, r["id"])),
    )
    assert not set(first) & set(second), "an item finished before the interruption was computed again"
    assert len(second) == 2 * 9 - 5 and res.computed == {m: 9 - written[m] for m in written}
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()].count("toy/8") == 1
    full, _ = full_run
    for mode in ("base", "prefillshare"):
        assert [(r["id"], r["text"], r["scores"]) for r in res.records[mode]] == [
            (r["id"], r["text"], r["scores"]) for r in full.records[mode]
        ]
        assert res.summary["modes"][mode]["nll"] == pytest.approx(
            full.summary["modes"][mode]["nll"], abs=1e-6
        )
    # a third run has nothing left to do
    again = run_task(ToyTask(), base, specs, tmp_path, batch_size=4, progress=False)
    assert again.computed == {"base": 0, "prefillshare": 0}


def test_other_settings_refused_unless_overwrite(setup, tmp_path):
    base, _, cc, _ = setup
    specs = [ModeSpec("prefillshare", cc, "cc")]
    run_task(ToyTask(), base, specs, tmp_path, settings=EvalSettings(limit=2), progress=False)
    with pytest.raises(ConfigError, match="other settings"):
        run_task(
            ToyTask(), base, specs, tmp_path, settings=EvalSettings(limit=2, max_new_tokens=3), progress=False
        )
    res = run_task(
        ToyTask(),
        base,
        specs,
        tmp_path,
        settings=EvalSettings(limit=2, max_new_tokens=3),
        progress=False,
        overwrite=True,
    )
    assert res.computed == {"prefillshare": 2} and all(
        r["new_tokens"] <= 3 for r in res.records["prefillshare"]
    )
    with pytest.raises(ConfigError, match="needs a decoder"):
        run_task(ToyTask(), base, [ModeSpec("naive")], tmp_path, progress=False)


def test_a_task_that_cannot_run_leaves_earlier_results(setup, tmp_path):
    """--overwrite with a task whose environment check fails: the earlier run's files are untouched (the check
    comes before the folder is cleared), and a fresh folder is not even created."""
    from ccft.evals.task_base import EnvironmentCheckError

    base, _, cc, _ = setup
    specs = [ModeSpec("prefillshare", cc, "cc")]
    run_task(ToyTask(), base, specs, tmp_path, settings=EvalSettings(limit=2), progress=False)
    folder = tmp_path / task_name(ToyTask())
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    class Broken(ToyTask):
        def check_environment(self, limit=None):
            raise EnvironmentCheckError("the toolchain is gone")

    with pytest.raises(EnvironmentCheckError):
        run_task(
            Broken(), base, specs, tmp_path, settings=EvalSettings(limit=2), progress=False, overwrite=True
        )
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    with pytest.raises(EnvironmentCheckError):
        run_task(Broken(), base, specs, tmp_path / "new", settings=EvalSettings(limit=2), progress=False)
    assert not (tmp_path / "new").exists()


def test_gsm8k_task_and_registry():
    from ccft.evals.gsm import GSM8KTask
    from ccft.evals.tasks import TASKS

    task = get_task("gsm8k")  # the one GSM8K definition: the registry's
    assert task.name == "gsm8k" and isinstance(task, GSM8KTask) and task is not TASKS["gsm8k"]
    assert "gsm8k" in task_names() and task_names() == sorted(TASKS)
    with pytest.raises(ConfigError, match="unknown task 'no-such-task'; known tasks: .*gsm8k"):
        get_task("no-such-task")


def test_cli_eval_runs_a_suite(setup, tmp_path, capsys):
    """``ccft eval --suite`` evaluates what the suite declares (task, items, generated items, modes,
    bootstrap)."""
    from ccft.cli.main import main

    base, ff, cc, _ = setup
    ccft.save_decoder(ff, tmp_path / "ff")
    ccft.save_decoder(cc, tmp_path / "cc")
    suite = tmp_path / "suite.yaml"
    suite.write_text(
        "task: gsm8k\nnll_rows: 3\nem_rows: 1\nmax_new_tokens: 3\nbatch_size: 2\n"
        "modes: [full-ft, prefillshare]\nbootstrap: 100\n"
    )
    argv = ["eval", "--suite", str(suite), "--no-progress", "--out", str(tmp_path / "out")]
    argv += ["--decoder", str(tmp_path / "ff"), "--decoder", str(tmp_path / "cc")]
    assert main(argv) == 0
    s = json.loads((tmp_path / "out" / "gsm8k.json").read_text())
    assert set(s["modes"]) == {"full-ft", "prefillshare"} and all(m["n"] == 3 for m in s["modes"].values())
    meta = json.loads((tmp_path / "out" / "gsm8k" / "meta.json").read_text())
    assert meta["settings"]["generate_limit"] == 1 and meta["settings"]["max_new_tokens"] == 3
    items = read_jsonl(tmp_path / "out" / "gsm8k" / "items.prefillshare.jsonl")
    assert sum("text" in r for r in items) == 1  # only the first item is generated
    capsys.readouterr()
    # a mode the suite asks for that the given decoders cannot run: the error says where the modes came from
    argv = ["eval", "--suite", str(suite), "--no-progress", "--out", str(tmp_path / "out2")]
    argv += ["--decoder", str(tmp_path / "cc")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "mode 'full-ft'" in err and f"come from the suite {suite}; choose others with --mode" in err, err


def test_runner_keeps_its_public_names():
    """Names other modules and users import from ``ccft.evals.runner`` stay importable there after the
    split."""
    from ccft.evals import records, results, runner, settings

    assert runner.EvalSettings is settings.EvalSettings and runner.ModeSpec is settings.ModeSpec
    assert runner.summarize_records is records.summarize_records
    assert runner.paired_deltas_by_id is records.paired_deltas_by_id
    assert runner.load_task_folder is results.load_task_folder
    for name in ("run_task", "get_task", "task_names", "batch_nll", "prepare", "read_jsonl"):
        assert callable(getattr(runner, name))


def test_cli_eval_writes_and_resumes(setup, tmp_path, capsys):
    from ccft.cli.main import main

    base, ff, cc, _ = setup
    ccft.save_decoder(ff, tmp_path / "ff")
    ccft.save_decoder(cc, tmp_path / "cc")
    argv = [
        "eval",
        "--task",
        "gsm8k",
        "--decoder",
        str(tmp_path / "ff"),
        "--decoder",
        str(tmp_path / "cc"),
        "--limit",
        "2",
        "--max-new-tokens",
        "3",
        "--batch-size",
        "2",
        "--no-progress",
        "--bootstrap",
        "200",
        "--out",
        str(tmp_path / "out"),
    ]
    assert main(argv) == 0
    first = capsys.readouterr().out
    s = json.loads((tmp_path / "out" / "gsm8k.json").read_text())
    assert set(s["modes"]) == set(MODES) and all(m["n"] == 2 for m in s["modes"].values())
    assert {"exact_match_strict", "exact_match_flexible"} <= set(s["modes"]["prefillshare"]["metrics"])
    assert "(computed now: 2)" in first
    assert (tmp_path / "out" / "gsm8k.md").read_text().startswith("### gsm8k")
    assert main(argv) == 0
    assert first.count("(computed now: 2)") == 4 and capsys.readouterr().out.count("(computed now: 0)") == 4
    assert main(argv[:1] + ["--mode", "prefillshare", "--limit", "2", "--out", str(tmp_path / "x")]) == 2
    assert "needs a decoder" in capsys.readouterr().err


class _SampledTask(ToyTask):
    """n=3 samples per item, batch scoring through ``score_many`` (as the code tasks do)."""

    samples = 3
    name = "toy-sampled"

    def __init__(self):
        super().__init__(3)
        self.calls = 0

    def score_many(self, pairs):
        self.calls += 1
        return [self.score(item, text) for item, text in pairs]


class _NoToolchainTask(ToyTask):
    name = "toy-missing"

    def check_environment(self, limit=None):
        return {"task": self.name, "available": False, "reason": "toolchain `frob` not installed", "ok": True}

    def score(self, item, text):  # pragma: no cover - must never be called
        raise AssertionError("an unavailable task must not be scored")


def test_samples_and_unavailable_toolchain(setup, tmp_path):
    from ccft.evals.report import build_report

    base, _, cc, _ = setup
    specs = [ModeSpec("prefillshare", cc, "cc")]
    task = _SampledTask()
    res = run_task(task, base, specs, tmp_path, progress=False, batch_size=3)
    recs = res.records["prefillshare"]
    assert task.calls == 3 and all(len(r["samples"]) == 3 for r in recs)
    meta = res.summary["meta"]["settings"]
    assert meta["samples"] == 3 and meta["do_sample"] and meta["temperature"] == 0.8
    for r in recs:  # the item's score is the mean over its samples; the texts are scored as generated
        for s in r["samples"]:
            assert s["scores"] == {k: float(v) for k, v in task.score(None, s["text"]).items()}
        assert r["scores"]["long"] == pytest.approx(sum(s["scores"]["long"] for s in r["samples"]) / 3)
    assert res.summary["modes"]["prefillshare"]["task_aggregate"]["items"] == 3
    assert res.summary["modes"]["prefillshare"]["task_aggregate"]["long_count"] == sum(
        s["scores"]["long"] for r in recs for s in r["samples"]
    )

    res = run_task(_NoToolchainTask(3), base, specs, tmp_path, progress=False)
    recs = res.records["prefillshare"]
    assert all("nll" in r and "scores" not in r and "text" not in r for r in recs)
    assert res.summary["meta"]["unavailable"] == "toolchain `frob` not installed"
    assert "metrics" not in res.summary["modes"]["prefillshare"]
    build_report([str(tmp_path)], tmp_path / "rep")
    md = (tmp_path / "rep" / "README.md").read_text()
    assert "| toy-missing | prefillshare | long | unavailable |" in md
    assert "**unavailable**: toolchain `frob` not installed" in md and "| toy-missing | no |" in md


@pytest.mark.parametrize("batch_size", [4, 16])
def test_engine_path_equals_reference_generation(setup, full_run, tmp_path, monkeypatch, batch_size):
    """--engine: every mode decodes through SharedPrefillEngine (base and full-ft on their own prefill, naive
    and prefillshare on C_base); same texts and NLLs as the reference path, the Full-FT decoder registered
    once, and each group of items prefilled once per producer: C_base once for base, naive and prefillshare
    (generation and reference NLL), the Full-FT decoder's own prefix once for full-ft; no other pass over the
    prompts. The four modes' rows decode in the same engine steps (at batch 4 mode after mode through 4 slots,
    at batch 16 all at once)."""
    pytest.importorskip("ccft.inference")
    import ccft.evals.runner as runner_mod
    import ccft.evals.scoring as scoring_mod
    from ccft.evals.generation import make_engine
    from ccft.inference import SharedPrefillEngine

    base, _, _, specs = setup
    assert sorted(s.mode for s in specs) == ["base", "full-ft", "naive", "prefillshare"]
    prefills = []
    real_prefill = SharedPrefillEngine.prefill

    def counted(self, prompts, **kw):
        prefills.append((len(prompts), kw.get("producer")))
        return real_prefill(self, prompts, **kw)

    def no_other_pass(*a, **k):
        raise AssertionError("a prompt was processed outside the group's prefills")

    monkeypatch.setattr(SharedPrefillEngine, "prefill", counted)
    for mod in (runner_mod, scoring_mod):
        monkeypatch.setattr(mod, "compute_base_cache", no_other_pass)
    monkeypatch.setattr(scoring_mod, "full_forward", no_other_pass)
    joint = []
    real_joint = runner_mod.decode_group_jointly
    monkeypatch.setattr(
        runner_mod, "decode_group_jointly", lambda *a, **kw: joint.append(real_joint(*a, **kw))
    )
    res = run_task(
        ToyTask(),
        base,
        specs,
        tmp_path,
        settings=EvalSettings(engine=True),
        batch_size=batch_size,
        progress=False,
    )
    assert prefills == [(9, None), (9, "full-ft")]  # 9 items, one group (up to 4 batches of 4, or < 16 items)
    assert joint == [4 * 9]  # every mode's 9 generations in one joint decode (mode after mode at batch 4)
    assert res.summary["meta"]["settings"]["decode_path"] == "SharedPrefillEngine (every mode)"
    engine = make_engine(base, specs, max_batch=2)
    assert sorted(engine.decoders) == ["base", "full-ft", "prefillshare"]  # naive reuses the Full-FT decoder
    ref, _ = full_run
    for mode in ("base", "full-ft", "naive", "prefillshare"):
        assert [(r["text"], r["finish_reason"], r["scores"]) for r in res.records[mode]] == [
            (r["text"], r["finish_reason"], r["scores"]) for r in ref.records[mode]
        ]
        assert [r["nll"] for r in res.records[mode]] == pytest.approx(
            [r["nll"] for r in ref.records[mode]], abs=1e-5
        )


def test_own_prefill_mode_refuses_a_cache_another_model_wrote(setup):
    from ccft.core.cache import compute_base_cache

    base, ff, _, _ = setup
    prompts, refs = [[5, 6, 7, 8]], [[9, 10, base.tokenizer.eos_token_id]]
    c_base = compute_base_cache(base, prompts)
    with pytest.raises(ConfigError, match="reads its own prefill"):
        batch_nll(
            "full-ft", base, ff, prompts, refs, cache=c_base
        )  # C_base is not the Full-FT decoder's prefix
    assert batch_nll("base", base, None, prompts, refs, cache=c_base)[0][0] == pytest.approx(
        batch_nll("base", base, None, prompts, refs)[0][0], abs=1e-4
    )


def test_sigkill_mid_run_then_resume(sharp_dir, setup, tmp_path):
    """A process killed with SIGKILL (no cleanup at all) after 3 items: the rerun does only the rest."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    script = f"""
import os, signal, sys
sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]
import ccft
from harness_fixtures import ToyTask
from ccft.evals.runner import EvalSettings, ModeSpec, run_task
base = ccft.load_base({str(sharp_dir)!r})
done = []
def kill(mode, rec):
    done.append(rec["id"])
    if len(done) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
run_task(ToyTask(), base, [ModeSpec("base")], {str(tmp_path)!r}, settings=EvalSettings(limit=5), batch_size=2,
         progress=False, on_item=kill)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert len(read_jsonl(tmp_path / "toy" / "items.base.jsonl")) == 3
    base = setup[0]
    again: list[str] = []
    res = run_task(
        ToyTask(),
        base,
        [ModeSpec("base")],
        tmp_path,
        settings=EvalSettings(limit=5),
        batch_size=2,
        progress=False,
        on_item=lambda m, r: again.append(r["id"]),
    )
    assert len(again) == 2 and res.summary["modes"]["base"]["n"] == 5
    assert len({r["id"] for r in res.records["base"]}) == 5


def test_mode_specs_and_settings_follow_core_modes(setup):
    from types import SimpleNamespace

    from ccft.evals.settings import default_modes, mode_specs, shared_handoff

    _, ff, cc, _ = setup
    specs = mode_specs(MODES, {"full-ft": ff, "ccft": cc}, {"full-ft": "ff", "ccft": "cc"})
    assert [(s.mode, s.decoder, s.decoder_path) for s in specs] == [
        ("base", None, None),
        ("full-ft", ff, "ff"),
        ("naive", ff, "ff"),
        ("prefillshare", cc, "cc"),
    ]
    assert default_modes(["ccft"]) == ["base", "prefillshare"]
    assert default_modes(["full-ft", "ccft"]) == list(MODES) and default_modes([]) == ["base"]
    with pytest.raises(ConfigError, match="needs a full-ft decoder"):
        mode_specs(["naive"], {"ccft": cc})
    with pytest.raises(ConfigError, match="trained with method='ccft'"):
        mode_specs(["naive"], {"full-ft": cc})
    assert shared_handoff([]) == 1 and shared_handoff([ff, cc]) == 1
    with pytest.raises(ConfigError, match="different handoff_tokens"):
        shared_handoff([SimpleNamespace(handoff_tokens=1), SimpleNamespace(handoff_tokens=2)])
    # generate_limit enters the resume key only when set: folders written without it still resume
    task = ToyTask(3)
    assert "generate_limit" not in EvalSettings().as_dict(task)
    limited = EvalSettings(generate_limit=2)
    assert limited.as_dict(task)["generate_limit"] == 2
    assert [limited.generates(i) for i in range(3)] == [True, True, False]
    assert not EvalSettings(generate=False).generates(0)


class _ToyPlus(ToyTask):
    """ToyTask's prompts and settings, scored otherwise (as HumanEval+ is HumanEval with more tests)."""

    name = "toy-plus"
    metrics = ("starts_space", "long")

    def score(self, item, text):
        return {"starts_space": text.startswith(" "), "long": len(text) > 12}


def _no_model_pass(m) -> None:
    """Make every prefill, forward and decode of the eval stack raise (results must come from the memo)."""
    from ccft.evals import generation, runner

    def fail(*a, **kw):
        raise AssertionError("computed again")

    m.setattr(runner, "batch_nll", fail)
    m.setattr(runner, "compute_base_cache", fail)
    m.setattr(generation, "generate", fail)
    m.setattr(generation.GroupPrefill, "handle", fail)


@pytest.mark.parametrize("engine", [False, True])
def test_eval_memo_reuses_identical_generations_and_nlls_across_tasks(
    setup, full_run, tmp_path, engine, monkeypatch
):
    """A task with another task's prompts, references and settings is scored on the same greedy texts and NLLs
    without computing them again (no prefill, no forward, no decode); its records equal a run without the
    memo."""
    from ccft.evals.runner import EvalMemo

    base, _, _, specs = setup
    memo = EvalMemo()
    settings = EvalSettings(engine=engine)
    first = run_task(
        ToyTask(), base, specs, tmp_path / "a", settings=settings, batch_size=4, progress=False, memo=memo
    )
    assert memo.hits == 0 and memo.nll_hits == 0
    n = len(first.records["base"])
    with monkeypatch.context() as m:  # everything comes from the memo: any model pass would raise
        _no_model_pass(m)
        plus = run_task(
            _ToyPlus(),
            base,
            specs,
            tmp_path / "a",
            settings=settings,
            batch_size=4,
            progress=False,
            memo=memo,
        )
    assert memo.hits == len(specs) * n and memo.nll_hits == len(specs) * n  # every item of every mode reused
    alone = run_task(_ToyPlus(), base, specs, tmp_path / "b", settings=settings, batch_size=4, progress=False)
    for mode in ("base", "full-ft", "naive", "prefillshare"):
        assert [r["text"] for r in plus.records[mode]] == [r["text"] for r in first.records[mode]]
        assert [
            (r["text"], r["finish_reason"], r["new_tokens"], r["scores"], r["nll_tokens"])
            for r in plus.records[mode]
        ] == [
            (r["text"], r["finish_reason"], r["new_tokens"], r["scores"], r["nll_tokens"])
            for r in alone.records[mode]
        ]
        torch.testing.assert_close(
            [r["nll"] for r in plus.records[mode]], [r["nll"] for r in alone.records[mode]], atol=1e-5, rtol=0
        )
    # a changed setting (max_new_tokens) is a different generation: nothing reused
    before = memo.hits
    before_nll = memo.nll_hits
    run_task(
        ToyTask(),
        base,
        specs,
        tmp_path / "c",
        settings=EvalSettings(engine=engine, max_new_tokens=3),
        batch_size=4,
        progress=False,
        memo=memo,
    )
    assert memo.hits == before
    assert memo.nll_hits == before_nll + len(specs) * n  # the NLL does not depend on max_new_tokens
    # another reference is another NLL: nothing reused
    run_task(
        _ToyShortRef(),
        base,
        specs,
        tmp_path / "d",
        settings=settings,
        batch_size=4,
        progress=False,
        memo=memo,
    )
    assert memo.nll_hits == before_nll + len(specs) * n


class _ToyOther(ToyTask):
    """Other items (ToyTask's rows from the fourth on) and a longer generation: a second small task."""

    name = "toy-other"
    max_new_tokens = 9

    def load(self, limit=None):
        rows = self.rows[3:] if limit is None else self.rows[3 : 3 + limit]
        return [
            {"id": f"toy-other/{i}", "question": r["question"][::-1], "answer": r["answer"]}
            for i, r in enumerate(rows)
        ]


def test_decode_ahead_decodes_small_tasks_together_with_the_same_records(
    setup, full_run, tmp_path, monkeypatch
):
    """Two small tasks' generations and NLLs in one joint decode (decode_ahead): run_task then computes
    nothing (no prefill, forward or decode) and writes the records a run without it writes; items already in a
    task's folder are not decoded again; the memo counts no hits for what was decoded ahead."""
    pytest.importorskip("ccft.inference")
    from ccft.evals import generation
    from ccft.evals.runner import EvalMemo, decode_ahead

    base, _, _, specs = setup
    settings = EvalSettings(engine=True, limit=5)
    tasks = [(ToyTask(), settings), (_ToyOther(), settings)]
    # reference: each task alone, no memo
    alone = {
        task_name(t): run_task(t, base, specs, tmp_path / "alone", settings=st, batch_size=4, progress=False)
        for t, st in tasks
    }

    # resume: the first task stopped after its first mode's 5 records
    class Stop(Exception):
        pass

    def stop_after_five(mode, rec, seen=[]):  # noqa: B006 - a counter for this one call
        seen.append(mode)
        if len(seen) == 5:
            raise Stop

    with pytest.raises(Stop):
        run_task(
            ToyTask(),
            base,
            specs,
            tmp_path / "ahead",
            settings=settings,
            batch_size=4,
            progress=False,
            on_item=stop_after_five,
        )
    from ccft.inference import SharedPrefillEngine

    prefills = []
    real_prefill = SharedPrefillEngine.prefill
    monkeypatch.setattr(
        SharedPrefillEngine,
        "prefill",
        lambda self, prompts, **kw: (
            prefills.append((len(prompts), kw.get("producer"))) or real_prefill(self, prompts, **kw)
        ),
    )
    rows = []
    real = generation.decode_jointly
    monkeypatch.setattr(
        generation,
        "decode_jointly",
        lambda engine, jobs, **kw: rows.append(sum(len(j[2]) for j in jobs)) or real(engine, jobs, **kw),
    )
    memo = EvalMemo()
    n = decode_ahead(tasks, base, specs, tmp_path / "ahead", memo=memo, batch_size=4, progress=False)
    assert (
        n == rows[0] == 3 * 5 + 4 * 5
    )  # one decode: the first task's 3 pending modes and the other's 4, 5 items
    assert sorted(prefills, key=str) == [
        (10, "full-ft"),
        (10, None),
    ]  # both tasks' items: one prefill per producer
    with monkeypatch.context() as m:  # everything comes from the memo: any model pass would raise
        _no_model_pass(m)
        ahead = {
            task_name(t): run_task(
                t, base, specs, tmp_path / "ahead", settings=st, batch_size=4, progress=False, memo=memo
            )
            for t, st in tasks
        }
    assert memo.hits == 0 and memo.nll_hits == 0
    assert (
        decode_ahead(tasks, base, specs, tmp_path / "ahead", memo=EvalMemo(), batch_size=4, progress=False)
        == 0
    )
    for name, res in ahead.items():
        for mode in MODES:
            assert [
                (r["id"], r["text"], r["finish_reason"], r["new_tokens"], r["scores"], r["nll_tokens"])
                for r in res.records[mode]
            ] == [
                (r["id"], r["text"], r["finish_reason"], r["new_tokens"], r["scores"], r["nll_tokens"])
                for r in alone[name].records[mode]
            ], (name, mode)
            torch.testing.assert_close(
                [r["nll"] for r in res.records[mode]],
                [r["nll"] for r in alone[name].records[mode]],
                atol=1e-5,
                rtol=0,
            )
    assert {r["text"] for r in ahead["toy-other"].records["base"]} != {
        r["text"] for r in ahead["toy"].records["base"]
    }


class _ToyShortRef(ToyTask):
    name = "toy-short-ref"

    def reference_text(self, item):
        return item["answer"][:40]


def test_length_chunks_sorts_and_bounds_forwards():
    from ccft.evals.scoring import length_chunks

    lengths = {7: 30, 2: 10, 5: 500, 1: 12, 9: 11, 4: 31}
    chunks = length_chunks(lengths, max_rows=2, max_tokens=100)
    assert chunks == [[2, 9], [1, 7], [4], [5]]  # sorted by length, ≤ 2 rows each, 500 > 100 alone
    assert length_chunks([5, 5, 5, 5], max_rows=8, max_tokens=10) == [[0, 1], [2, 3]]
    assert length_chunks({}, max_rows=4, max_tokens=100) == []
    for chunk in length_chunks(list(range(1, 60)), max_rows=16, max_tokens=200):
        assert len(chunk) == 1 or (len(chunk) <= 16 and len(chunk) * max(c + 1 for c in chunk) <= 200)


def test_group_prefills_grow_the_arena_once_and_records_stay_the_same(setup, tmp_path, monkeypatch):
    """Each group sizes the engine's prefix arena once for its producers' prefills (``GroupPrefill.reserve``),
    so no prefill grows it by doubling; memory only: the records equal a run without the reservation."""
    from ccft.evals.generation import GroupPrefill
    from ccft.inference.kv import PrefixArena

    base, _, _, specs = setup
    grows, reserves = [], []
    real_grow, real_reserve = PrefixArena._grow, PrefixArena.reserve
    monkeypatch.setattr(
        PrefixArena, "_grow", lambda self, tokens: grows.append(tokens) or real_grow(self, tokens)
    )
    monkeypatch.setattr(
        PrefixArena, "reserve", lambda self, tokens: reserves.append(tokens) or real_reserve(self, tokens)
    )
    settings = EvalSettings(engine=True)
    task = ToyTask(n=40)  # 32 + 8 items in two groups; two producers (the base and the Full-FT decoder)
    got = run_task(task, base, specs, tmp_path / "reserved", settings=settings, batch_size=8, progress=False)
    assert grows == [] and len(reserves) == 2
    from ccft.evals.scoring import prepare

    prep_widths = [len(p) for p in prepare(task, base.tokenizer, None).prompts]
    assert reserves[0] == 2 * 32 * (max(sorted(prep_widths)[:32]) - 1)  # shortest prompts first; k = 1
    monkeypatch.setattr(GroupPrefill, "reserve", lambda self, specs: None)
    plain = run_task(
        ToyTask(n=40), base, specs, tmp_path / "plain", settings=settings, batch_size=8, progress=False
    )
    assert grows, (
        "without the reservation a prefill grows the arena (the test needs prompts that overflow it)"
    )
    for mode in MODES:
        assert [(r["id"], r["text"], r["new_tokens"], r["nll"]) for r in got.records[mode]] == [
            (r["id"], r["text"], r["new_tokens"], r["nll"]) for r in plain.records[mode]
        ]
