"""``ccft bench soak``, short: a tiny model served by ``ccft serve`` (child process, 127.0.0.1) under
streaming clients that abandon some streams, hostile bodies and hot reloads for ~30 s of load.

The server's prefix arena is allocated whole from its ``--kv-budget-mb`` (``--max-prefix-tokens budget``, the
soak's default) and a warm-up fills the prefix store before the clock starts. The invariants of ``make soak``
must hold: no request lost, no 5xx, every hostile body answered with
its status, live KV 0 after the last request, every reload's probes equal a cold start on the weights
it loaded. Nothing asserts on time (RSS and p95 figures are reported, not checked, here).
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import threading

import pytest

from ccft.cli.main import main
from ccft.core.errors import ConfigError
from ccft.serving.malloc import MallocTrimmer, apply_malloc_policy, trim_malloc
from conftest import make_tiny_folder

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _in_a_child(code: str) -> str:
    """``code``'s printed output, run in a fresh interpreter: an mmap threshold set by ``mallopt`` stays for
    the life of the process, and the tests after this one must not run under it."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


def test_tune_malloc_is_accepted_or_a_no_op():
    code = "from ccft.serving.malloc import apply_malloc_policy, tune_malloc\n"
    code += "print(tune_malloc(), apply_malloc_policy('mmap-64k'))"
    assert _in_a_child(code).split() == [str(GLIBC), "None"]


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_trim_gives_free_arena_pages_back():
    """Free memory that glibc keeps in a thread's arena (1 KiB blocks freed between survivors, so the arena
    cannot shrink from its top) leaves RSS as it was until ``trim_malloc`` (``malloc_trim(0)``) returns it."""
    kept = []

    def churn():
        blocks = [bytes(1024) for _ in range(160_000)]  # ~170 MB in this thread's arena
        kept.extend(blocks[::64])  # a survivor every 64 blocks pins the arena's layout
        blocks.clear()

    t = threading.Thread(target=churn)
    t.start()
    t.join()
    before = _rss_bytes()
    assert trim_malloc() is True
    after = _rss_bytes()
    assert before - after > 64 * 2**20, (before, after)
    assert len(kept) == 2500


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_the_trim_policy_runs_a_trimmer_thread():
    trimmer = MallocTrimmer(interval_s=0.01)
    assert trimmer.start()
    for _ in range(3000):  # its calls are counted
        if trimmer.trims >= 2:
            break
        threading.Event().wait(0.01)
    trimmer.stop()
    calls = trimmer.trims
    assert calls >= 2
    threading.Event().wait(0.05)
    assert trimmer.trims == calls  # stopped
    with pytest.raises(ValueError, match="interval_s=0"):
        MallocTrimmer(interval_s=0)
    running = apply_malloc_policy("trim")
    assert isinstance(running, MallocTrimmer) and running.interval_s == 10.0
    running.stop()
    assert apply_malloc_policy("glibc") is None


def test_the_malloc_flags_parse_to_one_policy(capsys):
    from ccft.cli.main import build_parser

    for argv, want in (([], "trim"), (["--malloc", "mmap-64k"], "mmap-64k"), (["--no-tune-malloc"], "glibc")):
        assert build_parser().parse_args(["serve", *argv]).malloc == want
        assert build_parser().parse_args(["bench", "soak", *argv]).malloc == want
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--no-tune-malloc the same as --malloc glibc --dtype" in text  # no "(default: None)" of its own
    assert "each Ray Serve replica applies it in its own process (default: trim)" in text


def test_an_unknown_malloc_policy_is_refused_before_anything_runs(capsys):
    with pytest.raises(ConfigError, match="--malloc 'jemalloc': use one of trim, mmap-64k, glibc"):
        apply_malloc_policy("jemalloc")
    assert main(["serve", "--malloc", "jemalloc", "--model", "no-such-model"]) == 2
    assert "--malloc 'jemalloc': use one of trim, mmap-64k, glibc" in capsys.readouterr().err
    assert main(["bench", "soak", "--malloc", "jemalloc", "--duration-s", "1"]) == 2
    assert "--malloc 'jemalloc': use one of trim, mmap-64k, glibc" in capsys.readouterr().err


def test_a_bad_arena_value_is_refused_before_anything_runs(capsys):
    assert main(["bench", "soak", "--max-prefix-tokens", "lots", "--duration-s", "1"]) == 2
    err = capsys.readouterr().err
    assert "--max-prefix-tokens 'lots': use 'budget', a number of token slots N, or 0" in err


def test_short_soak_keeps_the_invariants(tmp_path, tokenizer, capsys):
    model = make_tiny_folder(tmp_path / "base", tokenizer, seed=7, scale=30.0)
    out = tmp_path / "soak.json"
    rc = main(
        [
            "bench",
            "soak",
            "--model",
            str(model),
            "--duration-s",
            "30",
            "--window-s",
            "6",
            "--clients",
            "3",
            "--abandon-fraction",
            "0.25",
            "--hostile-every-s",
            "0.5",
            "--reload-every-s",
            "7",
            "--sample-s",
            "0.5",
            "--sessions",
            "4",
            "--turns",
            "2",
            "--shared-tokens",
            "64",
            "--unique-tokens",
            "16",
            "--growth-tokens",
            "16",
            "--max-new-tokens",
            "8",
            "--threads",
            "1",
            "--kv-budget-mb",
            "8",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["invariants"] == {k: True for k in result["invariants"]}, printed
    assert rc == 0 and result["ok"]
    q = result["requests"]
    assert q["lost"] == 0 and q["completed"] > 0 and q["abandoned"] > 0
    assert result["status_5xx"] == 0
    assert result["live_kv_bytes_at_end"] == 0
    assert result["hostile"]["by_kind"] == {
        "body_too_large": ["413"],
        "malformed_json": ["400"],
        "prompt_too_long": ["400"],
        "unknown_model": ["404"],
    }
    reloads = result["reloads"]
    assert [r["status"] for r in reloads][:2] == [400, 200]  # the refused folder first, then a real reload
    assert sum(r["status"] == 200 for r in reloads) >= 2 and all(r["probes_equal"] for r in reloads)
    assert result["reload_changes_outputs"]  # the probes tell the two weight sets apart
    assert result["final_metrics"]["scheduler_reloads_total"] == sum(r["status"] == 200 for r in reloads)
    assert result["rss_first_bytes"] and result["windows"]["per_window"]
    # the prefix arena was allocated whole from the budget (8 MiB; whole tokens of 512 bytes) and never grew
    assert result["settings"]["max_prefix_tokens"] == "budget"
    assert result["settings"]["malloc"] == "trim"  # ccft serve's default, passed to the server
    arena = result["prefix_arena"]
    assert arena["start_bytes"] == arena["end_bytes"] == 8 * 2**20 and arena["grew"] is False
    assert result["final_metrics"]["prefix_arena_bytes"] == 8 * 2**20
    assert result["final_metrics"]["scheduler_arena_waits_total"] == 0  # 8 MiB holds every live context
    # the warm-up, before the clock started: one request per distinct shared context; the 4 sessions' first
    # 64 tokens are the same (the trace's opening text), so 1 context of turn 1 and 4 of turn 2
    assert result["warmup"]["requests"] == 5 and result["warmup"]["prefix_store_bytes"] > 0
    assert "prefix arena (--max-prefix-tokens budget): 8.0 MiB at start -> 8.0 MiB at end" in printed
    assert "lost" in printed and "probes equal cold start" in printed
