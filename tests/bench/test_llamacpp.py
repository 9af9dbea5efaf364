"""ccft.bench.llamacpp: the pin, the cache folder and its rebuild rule, the toolchain error, the parsers on
output captured from a real build (tests/data/llamacpp/), the greedy agreement; and (slow) a real build
whose greedy tokens on the tiny model equal HF's."""

from __future__ import annotations

import json
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

from ccft.bench import llamacpp as lc

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parents[1] / "data" / "llamacpp"


def test_version_is_the_constraints_pin():
    pins = re.findall(r"^llama-cpp-python==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    assert pins == [lc.LLAMA_CPP_PYTHON_VERSION]


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for var in ("CCFT_CACHE", "CCFT_HOME", "XDG_CACHE_HOME", "CC", "CXX"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def test_cache_root_order(clean_env, tmp_path):
    assert lc.cache_root() == tmp_path / "home" / ".cache" / "ccft"
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert lc.cache_root() == tmp_path / "xdg" / "ccft"
    clean_env.setenv("CCFT_HOME", str(tmp_path / "home2"))
    assert lc.cache_root() == tmp_path / "home2"
    clean_env.setenv("CCFT_CACHE", str(tmp_path / "cache"))
    assert lc.cache_root() == tmp_path / "cache"
    assert lc.llamacpp_dir("1.2.3") == tmp_path / "cache" / "llama.cpp" / "1.2.3"


#: the CPU target the tests pretend to build for (``native_target`` is replaced by ``cpu``): the tag of its
#: build folder and the instruction sets it records
AVX2 = ("avx2-0123456789", ("avx", "avx2", "fma"))
AVX512 = ("avx512-abcdef0123", ("avx", "avx2", "avx512f", "fma"))


@pytest.fixture
def cpu(clean_env, tmp_path):
    """A pretend CPU: ``cpu.set(target, features)`` makes ``lc.native_target`` answer ``target`` (no compiler
    probe) and ``cpu_features`` (read by ``lc.lacking_isa``) answer ``features`` (default: ``target``'s ISA);
    the cache is ``tmp_path / "c"``; starts as an AVX2 CPU."""
    from ccft.inference import blocks

    clean_env.setenv("CCFT_CACHE", str(tmp_path / "c"))

    class Cpu:
        def set(self, target, features=None):
            clean_env.setattr(lc, "native_target", lambda cxx, machine=None: target)
            clean_env.setattr(
                blocks, "cpu_features", lambda: frozenset(target[1] if features is None else features)
            )
            self.target = target
            return self

        def folder(self, version: str = "9.9") -> Path:
            return lc.llamacpp_dir(version) / f"build-{self.target[0]}"

    return Cpu().set(AVX2)


def _marker(version: str, target=AVX2, **kw) -> str:
    info = {"version": version, "cmake_flags": list(lc.cmake_flags()), "target": target[0]}
    return json.dumps({**info, "isa": list(target[1]), **kw})


def _finish(folder: Path, version: str, *, marker: bool = True, tools=lc.TOOLS, target=AVX2) -> None:
    for t in tools:
        p = folder / "bin" / t
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("#!/bin/sh\n")
        p.chmod(0o755)
    if marker:
        (folder / lc.MARKER).write_text(_marker(version, target))


def test_find_build_needs_marker_version_and_every_tool(cpu):
    folder = cpu.folder()
    assert folder == lc.llamacpp_dir("9.9") / "build-avx2-0123456789" == lc.build_dir("9.9")
    assert lc.find_build("9.9") is None
    _finish(folder, "9.9", marker=False)
    assert lc.find_build("9.9") is None  # tools without the marker: an interrupted build
    (folder / lc.MARKER).write_text(json.dumps({"version": "9.8"}))
    assert lc.find_build("9.9") is None  # a marker of another version
    (folder / lc.MARKER).write_text(_marker("9.9", cmake_flags=list(lc.CMAKE_FLAGS[:-1])))
    assert lc.find_build("9.9") is None  # built with other CMake flags (an older ccft's build)
    (folder / lc.MARKER).write_text(_marker("9.9"))
    found = lc.find_build("9.9")
    assert found is not None and found.tool("llama-server") == folder / "bin" / "llama-server"
    assert (
        found.root == lc.llamacpp_dir("9.9") and found.source == found.root / "source"
    )  # shared per version
    assert found.build_root == folder and found.describe()["isa"] == list(AVX2[1])
    (folder / "bin" / "llama-bench").unlink()
    assert lc.find_build("9.9") is None


def test_marker_without_isa_record_is_not_trusted(cpu):
    folder = cpu.folder()
    _finish(folder, "9.9", marker=False)
    old = {"version": "9.9", "cmake_flags": list(lc.cmake_flags()), "target": AVX2[0]}
    (folder / lc.MARKER).write_text(json.dumps(old))  # an older ccft's marker: no instruction sets
    assert lc.lacking_isa(old) == ["(no ISA record)"]
    assert lc.find_build("9.9") is None
    (folder / lc.MARKER).write_text(json.dumps({**old, "isa": "avx2"}))  # not a list
    assert lc.find_build("9.9") is None
    (folder / lc.MARKER).write_text(_marker("9.9", target=("avx2-other", AVX2[1])))  # another folder's
    assert lc.find_build("9.9") is None
    (folder / lc.MARKER).write_text(json.dumps(old))
    logged, run = [], FakeRunner(folder)
    build = lc.ensure_built("9.9", runner=run, log=logged.append)
    assert any("records no instruction sets" in m for m in logged)
    assert [("-S" in c, "--build" in c) for c in run.calls if "download" not in c] == [
        (True, False),
        (False, True),
    ]
    assert build.build_root == folder and json.loads((folder / lc.MARKER).read_text())["isa"] == list(AVX2[1])
    assert lc.find_build("9.9") is not None


def test_build_for_another_cpu_is_not_found_and_this_cpu_gets_its_own(cpu):
    """One cache shared by an AVX-512 node and an AVX2 node (a home folder on a cluster): each finds only its
    own build; the AVX-512 build is never used (nor clobbered) on the AVX2 node."""
    cpu.set(AVX512)
    wide = cpu.folder()
    lc.ensure_built("9.9", runner=FakeRunner(wide), log=lambda m: None)
    assert lc.find_build("9.9").build_root == wide
    # the AVX2 node: its compiler's -march=native is another target, its CPU lacks avx512f
    cpu.set(AVX2)
    narrow = cpu.folder()
    assert narrow != wide and lc.find_build("9.9") is None
    run = FakeRunner(narrow)
    build = lc.ensure_built("9.9", runner=run, log=lambda m: None)
    assert build.build_root == narrow and all(str(narrow) in map(str, c) for c in run.calls)
    assert json.loads((narrow / lc.MARKER).read_text())["isa"] == list(AVX2[1])
    assert json.loads((wide / lc.MARKER).read_text())["isa"] == list(AVX512[1])  # left alone
    assert sorted(p.name for p in lc.llamacpp_dir("9.9").glob("build-*")) == [narrow.name, wide.name]
    # the AVX-512 build's tools refuse to run here
    foreign = lc.LlamaCpp(lc.llamacpp_dir("9.9"), "9.9", json.loads((wide / lc.MARKER).read_text()), wide)
    with pytest.raises(lc.LlamaCppError, match="built for avx512f, which this CPU lacks"):
        foreign.tool("llama-server")
    # back on the AVX-512 node: its build is still there, nothing is rebuilt
    cpu.set(AVX512)
    again = FakeRunner(wide)
    assert lc.ensure_built("9.9", runner=again, log=lambda m: None).build_root == wide and again.calls == []


def test_build_recording_an_isa_this_cpu_lacks_is_rebuilt(cpu, clean_env):
    """A folder of this CPU's tag whose marker records an instruction set the CPU lacks (e.g. copied from
    another machine) is not found; ensure_built discards it and builds there for this CPU."""
    folder = cpu.folder()
    _finish(folder, "9.9", marker=False)
    (folder / lc.MARKER).write_text(_marker("9.9", target=(AVX2[0], AVX512[1])))
    assert lc.lacking_isa(json.loads((folder / lc.MARKER).read_text())) == ["avx512f"]
    assert lc.find_build("9.9") is None
    logged, run = [], FakeRunner(folder)
    build = lc.ensure_built("9.9", runner=run, log=logged.append)
    assert any("built for avx512f, which this CPU lacks: discarding it" in m for m in logged)
    assert "--build" in run.calls[-1] and build.build_info["isa"] == list(AVX2[1])
    assert lc.find_build("9.9").build_root == folder
    # where the CPU's flags cannot be read, a recorded ISA is not refused (as for the block kernel)
    from ccft.inference import blocks

    (folder / lc.MARKER).write_text(_marker("9.9", target=(AVX2[0], AVX512[1])))
    assert lc.find_build("9.9") is None
    clean_env.setattr(blocks, "cpu_features", lambda: None)
    assert lc.find_build("9.9") is not None


def test_no_compiler_finds_no_build(cpu, tmp_path):
    _finish(cpu.folder(), "9.9")
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    assert lc.cxx_compiler(str(empty)) is None
    assert lc.find_build("9.9", path=str(empty)) is None
    assert lc.find_build("9.9") is not None  # with the compiler on $PATH
    with pytest.raises(lc.LlamaCppError, match=r"a C\+\+ compiler \(c\+\+/g\+\+/clang\+\+\)"):
        lc.ensure_built("9.9", path=str(empty), runner=FakeRunner(cpu.folder()), log=lambda m: None)


def test_native_target_probes_the_compiler_once(clean_env):
    """The real probe: a readable tag (widest vector extension, hash), the ISA the compiler's -march=native
    targets (all on this CPU), computed once per process and compiler."""
    from ccft.inference.blocks import cpu_features

    cxx = lc.cxx_compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    lc.native_target.cache_clear()
    tag, isa = lc.native_target(cxx)
    assert re.fullmatch(r"[a-z0-9]+-[0-9a-f]{10}", tag) and list(isa) == sorted(isa)
    assert not lc.lacking_isa({"isa": list(isa)})  # -march=native targets this CPU
    assert "amx_int8" not in isa  # the build's -mno-amx-* are part of the probe on x86-64
    if cpu_features() is not None and "avx2" in cpu_features() and "avx512f" not in cpu_features():
        assert tag.startswith("avx2-")
    assert lc.native_target(cxx) == (tag, isa) and lc.native_target.cache_info().hits >= 1


def test_tool_of_an_unrecorded_build_is_its_path(tmp_path):
    # a LlamaCpp made by hand (no ISA record, no build folder): tool() is the path, nothing is checked
    build = lc.LlamaCpp(tmp_path / "v", "9.9", {"ggml_version": "0.25.3"})
    assert build.tool("llama-bench") == tmp_path / "v" / "build" / "bin" / "llama-bench"


def test_cmake_flags_keep_amx_out_on_x86_only():
    # ggml's AMX kernels (compiled in by -march=native on an Intel CPU with AMX) are left out on x86-64
    for machine in ("x86_64", "AMD64"):
        flags = lc.cmake_flags(machine)
        assert flags[: len(lc.CMAKE_FLAGS)] == lc.CMAKE_FLAGS
        assert f"-DCMAKE_C_FLAGS={lc.NO_AMX}" in flags and f"-DCMAKE_CXX_FLAGS={lc.NO_AMX}" in flags
    assert set(lc.NO_AMX.split()) == {"-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"}
    assert lc.cmake_flags("aarch64") == lc.CMAKE_FLAGS  # -mno-amx-* is an x86 option


class FakeRunner:
    """Stands in for subprocess.run: pip download writes a small sdist, cmake --build writes the tools."""

    def __init__(self, folder: Path):
        self.folder, self.calls = folder, []

    def __call__(self, cmd, **kw):
        self.calls.append(cmd)
        assert not (self.folder / lc.MARKER).exists(), "the marker must be written last"
        if "download" in cmd:
            dest = Path(cmd[cmd.index("-d") + 1])
            tree = dest / "t" / "llama_cpp_python-9.9" / "vendor" / "llama.cpp"
            (tree / "ggml").mkdir(parents=True)
            (tree / "CMakeLists.txt").write_text("project(llama.cpp)\n")
            (tree / "convert_hf_to_gguf.py").write_text("")
            (tree / "ggml" / "CMakeLists.txt").write_text(
                "set(GGML_VERSION_MAJOR 0)\nset(GGML_VERSION_MINOR 25)\nset(GGML_VERSION_PATCH 3)\n"
            )
            with tarfile.open(dest / "llama_cpp_python-9.9.tar.gz", "w:gz") as tar:
                tar.add(dest / "t" / "llama_cpp_python-9.9", arcname="llama_cpp_python-9.9")
        elif "--build" in cmd:
            assert str(self.folder) in map(str, cmd), "built into this CPU's folder"
            _finish(self.folder, "9.9", marker=False)
        return subprocess.CompletedProcess(cmd, 0, "", "")


def test_interrupted_build_is_discarded_and_redone(cpu):
    root, folder = lc.llamacpp_dir("9.9"), cpu.folder()
    stale = folder / "half-written.o"
    stale.parent.mkdir(parents=True)
    stale.write_text("junk")
    run = FakeRunner(folder)
    build = lc.ensure_built("9.9", runner=run, log=lambda m: None)
    assert not stale.exists()
    kinds = [("download" in c, "-S" in c, "--build" in c) for c in run.calls]
    assert kinds == [(True, False, False), (False, True, False), (False, False, True)]
    # only the llama-cpp-python sdist from source: ":all:" would build every build backend from source too
    dl = [str(c) for c in run.calls[0]]
    assert dl[dl.index("--no-binary") + 1] == "llama-cpp-python" and ":all:" not in dl
    assert all(t in run.calls[2] for t in lc.TOOLS) and all(f in run.calls[1] for f in lc.cmake_flags())
    info = json.loads((folder / lc.MARKER).read_text())
    assert info["version"] == "9.9" and info["ggml_version"] == "0.25.3" and info == build.build_info
    assert info["cmake_flags"] == list(lc.cmake_flags())
    assert info["target"] == AVX2[0] and info["isa"] == list(AVX2[1])
    assert (root / "source" / "convert_hf_to_gguf.py").is_file() and build.source == root / "source"
    assert build.root == root and build.build_root == folder
    # finished: nothing runs again
    again = FakeRunner(folder)
    assert lc.ensure_built("9.9", runner=again, log=lambda m: None).root == root and again.calls == []
    # marker lost (e.g. killed while writing it): the build folder is redone, the complete source/ is reused
    (folder / lc.MARKER).unlink()
    redo = FakeRunner(folder)
    lc.ensure_built("9.9", runner=redo, log=lambda m: None)
    assert [("-S" in c, "--build" in c) for c in redo.calls] == [(True, False), (False, True)]
    # a finished build with other CMake flags (an older ccft's, e.g. with AMX): redone, source/ reused
    (folder / lc.MARKER).write_text(json.dumps({**info, "cmake_flags": list(lc.CMAKE_FLAGS[:-1])}))
    stale.write_text("junk")
    logged, rebuilt = [], FakeRunner(folder)
    lc.ensure_built("9.9", runner=rebuilt, log=logged.append)
    assert not stale.exists() and [("-S" in c, "--build" in c) for c in rebuilt.calls] == [
        (True, False),
        (False, True),
    ]
    assert any("other CMake flags" in m for m in logged)
    assert json.loads((folder / lc.MARKER).read_text())["cmake_flags"] == list(lc.cmake_flags())


def test_old_unkeyed_build_is_left_alone_and_not_used(cpu):
    """An older ccft's ``<version>/build/`` (one folder for every CPU, marker beside it) is never found; the
    build for this CPU goes into its own folder and the old one is left as it is."""
    root = lc.llamacpp_dir("9.9")
    for t in lc.TOOLS:
        (root / "build" / "bin").mkdir(parents=True, exist_ok=True)
        (root / "build" / "bin" / t).write_text("")
    (root / lc.MARKER).write_text(json.dumps({"version": "9.9", "cmake_flags": list(lc.cmake_flags())}))
    assert lc.find_build("9.9") is None
    logged = []
    build = lc.ensure_built("9.9", runner=FakeRunner(cpu.folder()), log=logged.append)
    assert build.build_root == cpu.folder() and (root / "build" / "bin" / "llama-server").exists()
    assert any("older ccft's build" in m for m in logged)


def _bin_without(tmp_path: Path, missing: str) -> str:
    folder = tmp_path / f"bin-no-{missing}"
    folder.mkdir()
    for name in ("cmake", "cc", "c++", "ninja", "make"):
        if name != missing:
            target = folder / name
            target.write_text("#!/bin/sh\n")
            target.chmod(0o755)
    return str(folder)


def test_missing_cmake_is_named_before_any_download(clean_env, tmp_path):
    clean_env.setenv("CCFT_CACHE", str(tmp_path / "c"))

    def no_run(cmd, **kw):
        raise AssertionError(f"ran {cmd}")

    path = _bin_without(tmp_path, "cmake")
    with pytest.raises(lc.LlamaCppError, match=r"needs cmake, not found on PATH; install cmake"):
        lc.ensure_built("9.9", runner=no_run, path=path, log=lambda m: None)
    with pytest.raises(lc.LlamaCppError, match=r"a C\+\+ compiler"):
        lc.check_toolchain(_bin_without(tmp_path, "c++"))
    tools = lc.check_toolchain(_bin_without(tmp_path, "ninja"))  # make instead of ninja
    assert tools["generator"] == "Unix Makefiles" and tools["cmake"] == str(
        tmp_path / "bin-no-ninja" / "cmake"
    )


# ------------------------------------------------------------------ parsers on captured output


def test_parse_llama_bench_captured():
    pp = lc.parse_llama_bench((DATA / "llama_bench_pp.json").read_text())
    tg = lc.parse_llama_bench((DATA / "llama_bench_tg.json").read_text())
    assert [(t["n_prompt"], t["n_gen"], t["n_depth"], t["n_threads"]) for t in pp] == [(94, 0, 0, 2)]
    assert [(t["n_prompt"], t["n_gen"], t["n_depth"], t["n_threads"]) for t in tg] == [(0, 8, 94, 2)]
    assert pp[0]["avg_ts"] == 2.433824 and pp[0]["samples_ts"] == [2.17331, 2.69434]
    assert tg[0]["avg_ts"] == 0.09157 and tg[0]["samples_ts"] == [0.0777434, 0.105397]
    with pytest.raises(ValueError, match="-o json"):
        lc.parse_llama_bench("| model | size |\n")


def test_parse_batched_bench_captured():
    rows = lc.parse_batched_bench((DATA / "batched_bench.jsonl").read_text())
    assert [(r["pp"], r["tg"], r["pl"], r["n_threads"]) for r in rows] == [
        (32, 4, 1, 1),
        (32, 4, 1, 1),
        (32, 4, 2, 1),
    ]
    assert [r["speed_tg"] for r in rows] == [1.406437, 9.129502, 7.252427]
    assert [r["speed_pp"] for r in rows] == [12.678329, 10.325822, 32.816643]
    for r in rows:  # the tool's own definitions
        assert r["speed_tg"] == pytest.approx(r["pl"] * r["tg"] / r["t_tg"], rel=1e-5)
        assert r["speed_pp"] == pytest.approx(r["pl"] * r["pp"] / r["t_pp"], rel=1e-5)
    with pytest.raises(ValueError, match="jsonl"):
        lc.parse_batched_bench("main: n_kv_max = 2048\n|    PP |     TG |\n")


class Replay:
    """A runner that answers each command with captured output, in order, and records the commands."""

    def __init__(self, *files: str):
        self.outputs, self.calls = [(DATA / f).read_text() for f in files], []

    def __call__(self, cmd, **kw):
        self.calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, self.outputs.pop(0), "")


def test_runners_on_captured_output(tmp_path):
    build = lc.LlamaCpp(tmp_path, "9.9")
    run = Replay("batched_bench.jsonl")
    r = lc.bench_batched(build, Path("m.gguf"), 32, 4, 1, 1, repeats=2, runner=run, log=lambda m: None)
    assert r["decode_tok_s"] == pytest.approx((1.406437 + 9.129502) / 2)  # median of the two pl=1 rows
    assert r["prefill_tok_s"] == pytest.approx((12.678329 + 10.325822) / 2) and len(r["raw"]) == 2
    cmd = run.calls[0]
    assert cmd[cmd.index("-npl") + 1] == "1,1" and cmd[cmd.index("-ctk") + 1] == "f32"
    assert cmd[cmd.index("-c") + 1] == str(1 * (32 + 4) + 16) and cmd[0] == str(
        build.tool("llama-batched-bench")
    )
    run = Replay("batched_bench.jsonl")
    assert (
        lc.bench_batched(build, Path("m.gguf"), 32, 4, 2, 1, runner=run, log=lambda m: None)["decode_tok_s"]
        == 7.252427
    )
    with pytest.raises(lc.LlamaCppError, match="no row for 16 sequences"):
        lc.bench_batched(
            build, Path("m.gguf"), 32, 4, 16, 1, runner=Replay("batched_bench.jsonl"), log=lambda m: None
        )
    run = Replay("llama_bench_pp.json", "llama_bench_tg.json")
    r = lc.bench_llama_bench(build, Path("m.gguf"), 94, 8, 2, 2, runner=run, log=lambda m: None)
    assert (r["prefill_tok_s"], r["decode_tok_s"]) == (2.433824, 0.09157)
    assert [c[c.index("-p") + 1 :] for c in run.calls] == [["94", "-n", "0"], ["0", "-n", "8", "-d", "94"]]


def test_agreement_known_answers():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    other = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]]
    a = lc.agreement(ref, other, first=4)
    assert a["tokens_compared"] == 12 and a["leading_share"] == (4 + 2 + 0) / 12
    assert a["rows_equal"] == 1 / 3 and a["first_divergence"] == [None, 2, 0]
    b = lc.agreement(ref, other, first=2)  # only the first two tokens of each row
    assert b["leading_share"] == (2 + 2 + 0) / 6 and b["rows_equal"] == 2 / 3
    c = lc.agreement([[1, 2, 3]], [[1, 2]], first=3)  # a shorter row is not equal
    assert c["tokens_compared"] == 2 and c["leading_share"] == 1.0 and c["rows_equal"] == 0.0
    with pytest.raises(ValueError, match="2 reference rows but 1"):
        lc.agreement([[1], [2]], [[1]], first=1)


# ------------------------------------------------------------------ a real build (slow)


@pytest.mark.slow
def test_llamacpp_greedy_equals_hf_on_tiny_model(tiny_dir, tokenizer):
    """Builds (or reuses) llama.cpp, converts the tiny fp32 test Llama (tests/conftest.py) to an F32 GGUF and
    checks llama-server's greedy tokens equal HF's on three prompts, 8 tokens each. The tiny model is
    seeded, so this is deterministic; its top-1/top-2 logit margins on these prompts are >= 0.003,
    far above fp32 summation-order differences."""
    import torch
    from transformers import AutoModelForCausalLM

    from ccft.core.fingerprint import fingerprint_folder

    build = lc.ensure_built()
    gguf = lc.convert_to_gguf(build, tiny_dir, "test-" + fingerprint_folder(tiny_dir, tokenizer))
    assert gguf.stat().st_size > 4 * 64 * len(tokenizer)  # fp32 embedding alone
    prompts = [
        tokenizer.encode(t)
        for t in (
            "Natalia sold clips to 48 of her friends in April.",
            "def add(a, b):",
            "The quick brown fox jumps over the lazy dog.",
        )
    ]
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    want = []
    for ids in prompts:
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        want.append(out[0, len(ids) :].tolist())
    got = lc.greedy_tokens(build, gguf, prompts, 8, threads=2)
    assert got == want
    assert lc.agreement(want, got, 8)["rows_equal"] == 1.0


def test_portable_writes_the_cache_folder_as_a_variable(tmp_path, monkeypatch):
    """Recorded commands and paths name $CCFT_CACHE, not this machine's folder (no machine paths in
    results)."""
    monkeypatch.setenv("CCFT_CACHE", str(tmp_path / "cache"))
    root = lc.cache_root()
    block = {
        "root": str(root / "llama.cpp" / "0.3.36"),
        "n": 3,
        "batches": {
            "1": {"commands": [f"{root}/llama.cpp/0.3.36/build/bin/llama-bench -m {root}/x.gguf -t 2"]}
        },
    }
    out = lc.portable(block)
    assert out["root"] == "$CCFT_CACHE/llama.cpp/0.3.36" and out["n"] == 3
    assert out["batches"]["1"]["commands"] == [
        "$CCFT_CACHE/llama.cpp/0.3.36/build/bin/llama-bench -m $CCFT_CACHE/x.gguf -t 2"
    ]
    assert str(tmp_path) not in repr(out)
