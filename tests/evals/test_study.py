"""``ccft study``: config validation, the secondary metrics, the report built from the runner's summaries, and
the whole study on a tiny base — rerun reuses everything, a SIGKILLed study resumes to the same numbers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ccft.core.errors import ConfigError
from ccft.evals.bfcl import calls_offered_function
from ccft.evals.humaneval import defines_entry_point
from ccft.evals.protocol import get_task
from ccft.evals.study import full_ft_beats_base, load_study_config, task_entry
from ccft.train.config import parse_overrides
from conftest import TINY_RECIPE, make_tiny_folder

ROOT = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------- secondary metrics (known answers)


@pytest.mark.parametrize(
    "text, form",
    [
        ("She pays 3 + 4 = 7 dollars.\n#### 7", 1.0),
        ("#### 1,325.", 1.0),  # a well-formed number, wrong or right
        ("The answer is 7.", 0.0),  # a number, but not in the #### form
        ("#### seven", 0.0),
        ("", 0.0),
    ],
)
def test_gsm8k_answer_format(text, form):
    task = get_task("gsm8k")
    item = task.load(1)[0]
    assert task.score(item, text)["answer_format"] == form


def test_gsm_plus_answer_format_counts_an_explicit_none():
    task = get_task("gsm-plus")
    item = task.load(1)[0]
    assert task.score(item, "#### None")["answer_format"] == 1.0
    assert task.score(item, "I cannot tell")["answer_format"] == 0.0


@pytest.mark.parametrize(
    "code, ok",
    [
        ("def f(x):\n    return x\n", True),
        ("import math\n\ndef f(x):\n    '''doc'''\n    return math.sqrt(x)\n", True),
        ("def f(x):\n    '''doc'''\nreturn x\n", False),  # module-level return: a compile-time error
        ("def f(x):\n    return (x\n", False),  # unbalanced parenthesis
        ("def g(x):\n    return x\n", False),  # the entry point is not defined
        ("class A:\n    def f(self):\n        return 1\n", False),  # only as a method, not at module level
        ("def f(x):\n    return x\x00\n", False),  # NUL byte
    ],
)
def test_defines_entry_point(code, ok):
    assert defines_entry_point(code, "f") is ok


def test_humaneval_compiles_on_canonical_and_truncated_completions():
    task = get_task("humaneval")
    item = task.load(1)[0]
    assert task.score(item, item.reference) == {"passed": 1.0, "compiles": 1.0}
    cut = item.reference.splitlines()[0] + "\n        ("  # stops inside an expression
    assert task.score(item, cut) == {"passed": 0.0, "compiles": 0.0}


def test_calls_offered_function():
    functions = [{"name": "math.factorial"}, {"name": "get_weather"}]
    assert calls_offered_function([{"get_weather": {"city": "Paris"}}], functions)
    assert calls_offered_function([{"nope": {}}, {"math.factorial": {"n": 5}}], functions)
    assert not calls_offered_function([{"nope": {}}], functions)
    assert not calls_offered_function([], functions)


# ---------------------------------------------------------------- config


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_config_errors_name_the_key_and_the_fix(tmp_path):
    good = _write(
        tmp_path / "s.yaml",
        "specialists:\n  math:\n    recipe: recipes/math-gsm8k.yaml\n    tasks: {gsm8k: {limit: 5}}\n",
    )
    cfg = load_study_config(good, ["specialists.math.tasks.gsm8k.limit=7", "batch_size=4"])
    assert cfg.specialists["math"].tasks["gsm8k"].limit == 7 and cfg.batch_size == 4
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['batchsize'\]"):
        load_study_config(good, ["batchsize=4"])
    with pytest.raises(ConfigError, match="is not key=value"):
        load_study_config(good, ["batch_size"])
    # one override rule with ccft train (ccft.train.config.parse_override): unquoted text stays text
    text = load_study_config(good, ["specialists.math.train.system_prompt=Answer: briefly, after #### N"])
    assert text.specialists["math"].train["system_prompt"] == "Answer: briefly, after #### N"
    assert (
        parse_overrides(["system_prompt=Answer: briefly, after #### N"])["system_prompt"]
        == text.specialists["math"].train["system_prompt"]
    )
    with pytest.raises(ConfigError, match="not a valid YAML value"):
        load_study_config(good, ["batch_size=[1, 2"])
    with pytest.raises(ConfigError, match=r"specialists\.math\.tasks\.gsm9k.*unknown task 'gsm9k'"):
        load_study_config(good, ["specialists.math.tasks.gsm9k.limit=3"])
    with pytest.raises(ConfigError, match="max_stepz"):  # a bad training key fails before any model loads
        load_study_config(good, ["specialists.math.train.max_stepz=3"])
    with pytest.raises(
        ConfigError,
        match=r"s.yaml: specialists.math.train sets activation_checkpointing_min_tokens "
        r"\(applied to .*math-gsm8k.yaml.*needs activation_checkpointing: true",
    ):
        load_study_config(good, ["specialists.math.train.activation_checkpointing_min_tokens=64"])
    with pytest.raises(ConfigError, match="needs `recipe:`"):
        load_study_config(_write(tmp_path / "b.yaml", "specialists:\n  math:\n    tasks: {gsm8k: {}}\n"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_study_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="modes"):
        load_study_config(good, ["modes=[base, shared]"])


def test_shipped_study_config_parses():
    cfg = load_study_config(ROOT / "recipes" / "study.yaml")
    assert set(cfg.specialists) == {"math", "code", "tools"}
    assert cfg.specialists["tools"].tasks["bfcl-multiple"].limit >= 100
    for spec in cfg.specialists.values():
        assert all(t.limit >= 100 for t in spec.tasks.values())


# --------------------------------------------------------------- report from summaries (hand-computed values)


def test_task_entry_and_resolution_from_a_summary():
    def block(nll, acc, form):
        return {
            "n": 10,
            "nll": nll,
            "nll_ci": [nll - 0.1, nll + 0.1],
            "metrics": {
                "exact_match_flexible": {"mean": acc, "ci": [acc - 0.1, acc + 0.1], "n": 10},
                "answer_format": {"mean": form, "ci": [form - 0.1, form + 0.1], "n": 10},
            },
        }

    summary = {
        "task": "gsm8k",
        "meta": {"settings": {"limit": 10}},
        "modes": {
            "base": block(1.5, 0.0, 0.1),
            "full-ft": block(0.9, 0.2, 0.8),
            "naive": block(1.0, 0.1, 0.4),
            "prefillshare": block(0.92, 0.2, 0.6),
        },
        "deltas_vs_full_ft": {
            "base": {
                "nll": {"delta": 0.6, "ci": [0.5, 0.7]},
                "exact_match_flexible": {"delta": -0.2, "ci": [-0.4, 0.0]},
                "answer_format": {"delta": -0.7, "ci": [-0.9, -0.5]},
            },
            "naive": {
                "nll": {"delta": 0.1, "ci": [0.05, 0.15]},
                "exact_match_flexible": {"delta": -0.1, "ci": [-0.3, 0.1]},
                "answer_format": {"delta": -0.4, "ci": [-0.6, -0.2]},
            },
            "prefillshare": {
                "nll": {"delta": 0.02, "ci": [0.0, 0.04]},
                "exact_match_flexible": {"delta": 0.0, "ci": [-0.1, 0.1]},
                "answer_format": {"delta": -0.2, "ci": [-0.4, 0.0]},
            },
        },
    }
    e = task_entry(summary, "math")
    assert (e["primary_metric"], e["secondary_metric"], e["n"]) == (
        "exact_match_flexible",
        "answer_format",
        10,
    )
    assert e["modes"]["naive"] | {} == {**e["modes"]["naive"], "score": 0.1, "secondary": 0.4, "nll": 1.0}
    assert e["paired_vs_full_ft"]["naive"]["secondary_ci"] == [-0.6, -0.2]
    assert e["retention"]["naive"] == {"score": pytest.approx(0.5), "secondary": pytest.approx(0.5)}
    assert e["retention"]["prefillshare"] == {"score": pytest.approx(1.0), "secondary": pytest.approx(0.75)}
    # exact match's CI touches 0 (not resolved); the answer form and NLL resolve
    assert full_ft_beats_base(e) == {"score": False, "secondary": True, "nll": True}


# ---------------------------------------------------------------- the whole study on a tiny base

STUDY = """runs: {runs}
out: {out}
bootstrap: 200
batch_size: 4
sweep_limit: 2
sweep_rhos: [0.0, 1.0]
serving: {{sessions: [1, 2], turns: 2, shared_tokens: 32, unique_tokens: 8, growth_tokens: 8, \
max_new_tokens: 4,
          threads: 1, block_tokens: 8}}
specialists:
  math:
    recipe: {math}
    tasks: {{gsm8k: {{limit: 3, max_new_tokens: 6}}}}
  code:
    recipe: {code}
    tasks: {{humaneval: {{limit: 2, max_new_tokens: 6}}}}
"""


def _study_files(root: Path, base: Path, name: str) -> Path:
    math = _write(root / "math.yaml", TINY_RECIPE.format(base=base, data="gsm8k:train", chat="true"))
    code = _write(root / "code.yaml", TINY_RECIPE.format(base=base, data="mbpp:train", chat="false"))
    return _write(
        root / f"{name}.yaml",
        STUDY.format(runs=root / f"runs-{name}", out=root / f"out-{name}", math=math, code=code),
    )


def _env():
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    return env


def spec_runs(report: dict, name: str) -> str:
    return report["specialists"][name]["runs"]["ccft"]


def _numbers(out: Path) -> dict:
    report = json.loads((out / "report.json").read_text())
    return {
        (t["task"], m): (b["score"], b["secondary"], b["nll"])
        for t in report["tasks"]
        for m, b in t["modes"].items()
    }


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("study")
    base = make_tiny_folder(root / "base", tokenizer, seed=5, scale=30.0)
    cfg = _study_files(root, base, "whole")
    proc = subprocess.run(
        [sys.executable, "-m", "ccft", "study", str(cfg)], env=_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # both specialists' tasks are smaller than the engine's 4 rows: decoded together ahead of scoring
    assert proc.stdout.count("small tasks decoded together") == 2
    return root, base, cfg


def test_study_report_has_every_field(tiny_study):
    root, _, _ = tiny_study
    out = root / "out-whole"
    report = json.loads((out / "report.json").read_text())
    assert report["complete"] is True
    assert set(report["specialists"]) == {"math", "code"}
    for spec in report["specialists"].values():
        assert set(spec["runs"]) == {"ccft", "full-ft"}
        assert all(Path(p, "ccft.json").is_file() for p in spec["runs"].values())
        assert spec["training"]["steps"] == 6
    assert [t["task"] for t in report["tasks"]] == ["gsm8k", "humaneval"]
    for t in report["tasks"]:
        assert {"specialist", "primary_metric", "secondary_metric", "n", "modes", "paired_vs_full_ft"} <= set(
            t
        )
        assert set(t["modes"]) == {"base", "full-ft", "naive", "prefillshare"}
        assert set(t["paired_vs_full_ft"]) == {"base", "naive", "prefillshare"}
        for b in t["modes"].values():
            assert {"score", "score_ci", "secondary", "secondary_ci", "nll", "nll_ci"} <= set(b)
            assert b["nll"] > 0 and b["score"] is not None and b["secondary"] is not None
    # the report's numbers are the runner's per-item records, averaged
    items = [json.loads(x) for x in (out / "math" / "gsm8k" / "items.naive.jsonl").read_text().splitlines()]
    gsm = next(t for t in report["tasks"] if t["task"] == "gsm8k")
    assert gsm["modes"]["naive"]["nll"] == pytest.approx(sum(r["nll"] for r in items) / len(items))
    assert gsm["modes"]["naive"]["secondary"] == pytest.approx(
        sum(r["scores"]["answer_format"] for r in items) / len(items)
    )
    assert set(report["phase_seconds"]) >= {
        "setup",
        "train_math_ccft",
        "train_math_full_ft",
        "eval_math",
        "sweep_math",
        "train_code_ccft",
        "eval_code",
    }
    assert "| math | gsm8k (exact_match_flexible) | 3 |" in (out / "README.md").read_text()
    # serving with the trained CCFT decoders as agents; outputs equal offline ccft.generate per request
    serving = report["serving"]
    assert serving["decoders"]["math"] == f"folder {spec_runs(report, 'math')}"
    assert serving["decoders"]["planner"] == "random LoRA r=8"
    eq = serving["outputs_vs_offline"]
    assert eq["requests"] == 2 * 4 and eq["equal"] == eq["requests"], eq["mismatches"]
    assert serving["throughput_ratio"] > 0 and (out / "serving" / "serve.json").is_file()


def test_rerun_reuses_everything(tiny_study):
    root, _, cfg = tiny_study
    out = root / "out-whole"
    before = _numbers(out)
    mtimes = {p: p.stat().st_mtime for p in (root / "runs-whole").rglob("adapter_model.safetensors")}
    sweeps = {p: p.read_text() for p in out.rglob("sweep/*.json")}
    assert sweeps and "SITTINGS.md" not in (out / "README.md").read_text()
    (out / "SITTINGS.md").write_text("Sitting 1: paused 5 min with SIGSTOP.\nSitting 2: idle machine.\n")
    proc = subprocess.run(
        [sys.executable, "-m", "ccft", "study", str(cfg)], env=_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("reusing finished run") == 4
    assert (
        "reusing" in proc.stdout and "serve.json" in proc.stdout
    )  # the serving result: same decoders (stamp)
    assert {p: p.stat().st_mtime for p in mtimes} == mtimes
    assert {
        p: p.read_text() for p in sweeps
    } == sweeps  # reused sweeps keep their meta and summary as written
    assert _numbers(out) == before
    assert json.loads((out / "phases.json").read_text())["sittings"] == 2
    readme = (out / "README.md").read_text()  # the hand-written notes survive the regenerated README, quoted
    assert "> Sitting 1: paused 5 min with SIGSTOP.\n> Sitting 2: idle machine.\n" in readme
    assert readme.index("## Sittings") < readme.index("## Specialists")


@pytest.mark.parametrize("kill_when", ["checkpoint", "items"])
def test_sigkilled_study_resumes_to_the_same_numbers(tiny_study, tmp_path, kill_when):
    root, base, _ = tiny_study
    cfg = _study_files(tmp_path, base, "killed")
    runs, out = tmp_path / "runs-killed", tmp_path / "out-killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ccft", "study", str(cfg)],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def reached():
        if kill_when == "checkpoint":  # mid-training: the first CCFT run has a checkpoint but is not finished
            return (
                any((runs / "math" / "ccft").glob("checkpoint-*"))
                and not (runs / "math" / "ccft" / "ccft.json").exists()
            )
        return any((out / "math" / "gsm8k").glob("items.*.jsonl"))  # mid-evaluation

    while proc.poll() is None and not reached():
        time.sleep(0.05)
    assert proc.poll() is None, "the study finished before the kill point; the test needs a later kill point"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    again = subprocess.run(
        [sys.executable, "-m", "ccft", "study", str(cfg)], env=_env(), capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr[-3000:]
    got, want = _numbers(out), _numbers(root / "out-whole")
    assert got.keys() == want.keys()
    for k in want:
        assert got[k][:2] == want[k][:2], k
        assert got[k][2] == pytest.approx(want[k][2], rel=1e-5), k


def test_run_digest_and_stamps(tmp_path):
    from ccft.evals.study import run_digest, stamp_matches, write_stamp

    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(ConfigError, match="not a finished training run"):
        run_digest(run)
    meta = {"method": "ccft", "handoff_tokens": 1, "recipe": {"activation_checkpointing": True}}
    (run / "ccft.json").write_text(json.dumps(meta))
    (run / "adapter_model.safetensors").write_bytes(b"\x00" * 10)
    (run / "log_history.json").write_text("[]")
    (run / "tokenizer_config.json").write_text("{}")
    first = run_digest(run)
    (run / "log_history.json").write_text("[1]")  # not the decoder
    (run / "ccft.json").write_text(json.dumps({**meta, "recipe": {}, "steps": 5}))  # how it was trained
    (run / "README.md").write_text("a model card")
    (run / "checkpoint-5").mkdir()
    assert run_digest(run) == first
    (run / "ccft.json").write_text(json.dumps({**meta, "handoff_tokens": 2}))  # how it reads C_base
    assert run_digest(run) != first
    (run / "ccft.json").write_text(json.dumps(meta))
    (run / "tokenizer_config.json").write_text('{"chat_template": "x"}')  # how prompts are rendered
    assert run_digest(run) != first
    (run / "tokenizer_config.json").write_text("{}")
    assert run_digest(run) == first
    (run / "adapter_config.json").write_text('{"r": 16, "target_modules": ["q_proj", "v_proj"]}')
    second = run_digest(run)
    assert second != first
    (run / "adapter_config.json").write_text(
        '{"target_modules": ["v_proj", "q_proj"], "r": 16}'
    )  # PEFT's set order
    (run / "ccft-recipe.json").write_text('{"max_steps": 5}')  # the recipe stamp training writes first
    assert run_digest(run) == second
    (run / "adapter_model.safetensors").write_bytes(b"\x00" * 9 + b"\x01")  # one weight byte
    assert run_digest(run) != first
    out = tmp_path / "out"
    assert stamp_matches(out, {"ccft": first}) is None
    write_stamp(out, {"ccft": first, "full-ft": "ab"})
    assert stamp_matches(out, {"full-ft": "ab", "ccft": first}) is True
    assert stamp_matches(out, {"full-ft": "ab", "ccft": run_digest(run)}) is False


def test_a_retrained_run_with_the_same_weights_keeps_its_results(tiny_study, tmp_path):
    """A run trained again (here: its folder deleted) comes out bit for bit the same decoder, so the stamp
    still matches and the specialist's results, sweep and the serving result are reused, not computed
    again."""
    import shutil

    root, _, _ = tiny_study
    runs, out = tmp_path / "runs-whole", tmp_path / "out-whole"
    shutil.copytree(root / "runs-whole", runs)
    shutil.copytree(root / "out-whole", out)
    for meta in runs.rglob("ccft.json"):  # the copies record their new folder, as runs trained there would
        meta.write_text(meta.read_text().replace(str(root / "runs-whole"), str(runs)))
    digest_before = json.loads((out / "code" / "decoders.json").read_text())["full-ft"]
    shutil.rmtree(runs / "code" / "full-ft")
    items = {f: f.stat().st_mtime_ns for f in out.rglob("items.*.jsonl")}
    cfg = _write(
        tmp_path / "again.yaml",
        (root / "whole.yaml")
        .read_text()
        .replace(str(root / "out-whole"), str(out))
        .replace(str(root / "runs-whole"), str(runs)),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "ccft", "study", str(cfg)], env=_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("reusing finished run") == 3  # code full-ft trained again
    assert json.loads((out / "code" / "decoders.json").read_text())["full-ft"] == digest_before
    assert "small tasks decoded together" not in proc.stdout  # nothing evaluated again
    assert {f: f.stat().st_mtime_ns for f in out.rglob("items.*.jsonl")} == items
    assert _numbers(out) == _numbers(root / "out-whole")


def _study_again_into(root: Path, out: Path) -> subprocess.CompletedProcess:
    """``ccft study`` with the tiny study's config and runs, writing into ``out`` (a copy of its results)."""
    cfg = _write(
        out.parent / f"{out.name}.yaml",
        (root / "whole.yaml").read_text().replace(str(root / "out-whole"), str(out)),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "ccft", "study", str(cfg)], env=_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_a_task_evaluated_with_other_settings_is_computed_again(tiny_study, tmp_path):
    """A task folder of the study written with other settings (here: other stop strings, as MultiPL-E's
    results from before its generation stopped at the stop tokens) is the study's own stale output: computed
    again with a message naming the setting, not refused with FolderConflictError; the other task's items are
    kept."""
    import shutil

    root, _, _ = tiny_study
    shutil.copytree(root / "out-whole", tmp_path / "out-old")
    out = tmp_path / "out-old"
    meta_path = out / "code" / "humaneval" / "meta.json"
    meta = json.loads(meta_path.read_text())
    now_stop = meta["settings"]["stop"]
    meta["settings"]["stop"] = []
    meta_path.write_text(json.dumps(meta))
    kept = {f: f.stat().st_mtime_ns for f in (out / "math").rglob("items.*.jsonl")}
    proc = _study_again_into(root, out)
    assert f"humaneval was evaluated with other settings {{'stop': ([], {now_stop!r})}}" in proc.stdout
    assert proc.stdout.count("small tasks decoded together") == 1  # code evaluated again, math reused
    assert {f: f.stat().st_mtime_ns for f in (out / "math").rglob("items.*.jsonl")} == kept
    assert json.loads(meta_path.read_text())["settings"]["stop"] == now_stop
    assert _numbers(out) == _numbers(root / "out-whole")


def test_results_of_other_decoders_are_computed_again(tiny_study, tmp_path):
    """Results whose stamp names other decoders (a sitting killed between retraining and evaluation leaves new
    decoders beside old items) are evaluated again, serving too; with these decoders the numbers are the
    same."""
    import shutil

    root, base, _ = tiny_study
    shutil.copytree(root / "out-whole", tmp_path / "out-stale")
    out = tmp_path / "out-stale"
    stamp = json.loads((out / "math" / "decoders.json").read_text())
    assert set(stamp) == {"ccft", "full-ft"}
    (out / "math" / "decoders.json").write_text(json.dumps({**stamp, "ccft": "0" * 64}))
    (out / "serving" / "decoders.json").write_text("{}")
    before = {f: f.stat().st_mtime_ns for f in (out / "code").rglob("items.*.jsonl")}
    proc = _study_again_into(root, out)
    assert proc.stdout.count("reusing finished run") == 4  # nothing retrained
    assert proc.stdout.count("small tasks decoded together") == 1  # math evaluated again, code reused
    assert {f: f.stat().st_mtime_ns for f in (out / "code").rglob("items.*.jsonl")} == before
    assert "reusing" not in proc.stdout.split("== serving ==")[1].split("\n")[1]  # serving ran again
    assert json.loads((out / "math" / "decoders.json").read_text()) == stamp
    assert _numbers(out) == _numbers(root / "out-whole")
