"""llama.cpp beside the engine in ``ccft bench decode --llamacpp``: a pinned build, the same weights as an
F32 GGUF, its speed at batch 1 and 16, and its greedy tokens.

* **Source**: the sdist of ``llama-cpp-python`` at :data:`LLAMA_CPP_PYTHON_VERSION` (the pin in the source
  repository's ``constraints.txt``; a test keeps the two equal), which vendors one llama.cpp commit.
  ``pip download --no-binary llama-cpp-python --no-deps`` fetches it from the package registry; nothing else
  is downloaded.
* **Build** (once, CPU only, cmake + ninja, ``-DGGML_NATIVE=ON``; on x86-64 without ggml's AMX kernels,
  :data:`NO_AMX`): the tools :data:`TOOLS` in :func:`llamacpp_dir` = ``<cache>/llama.cpp/<version>/`` with
  ``<cache>`` = ``$CCFT_CACHE``, else ``$CCFT_HOME``, else ``$XDG_CACHE_HOME/ccft``, else ``~/.cache/ccft``.
  The file :data:`MARKER` is written last; a folder without it is a half-finished build and is rebuilt from
  scratch (its ``build/`` is discarded, never trusted), and so is one whose marker records other CMake flags
  than :func:`cmake_flags`. ``make llamacpp`` or ``python -m ccft.bench.llamacpp build`` builds it
  explicitly; ``ccft bench decode --llamacpp`` builds it when missing.
* **Weights**: llama.cpp's own ``convert_hf_to_gguf.py`` from the same source tree, ``--outtype f32``,
  from the HF folder ccft loads, cached as ``<version>/gguf/<fingerprint>.f32.gguf``.
* **Speed**: every batch size B (1 included) with ``llama-batched-bench -npp P -ntg N -npl B,B,..``
  (B independent sequences prefilled, then N decode steps of B tokens each after the prompt, as the
  engine decodes; one run per repeat, medians) and an fp32 KV cache like the engine's
  (:data:`KV_FLAGS`). Decode tok/s = B·N / decode seconds, prefill tok/s = B·P / prefill seconds.
  At batch 1 also ``llama-bench`` as users run it (``-p P -n 0`` and ``-p 0 -n N -d P``; f16 KV, its
  default: llama-bench offers no f32 KV), reported beside it, not used for the ratio.
* **Greedy tokens**: ``llama-server`` on 127.0.0.1, chosen as the least fragile: it takes the prompt as
  token ids and returns the generated ids as documented JSON (``llama-simple`` / ``llama-cli`` take text,
  so llama.cpp would re-tokenise, and print text or logs that would have to be scraped). One request per
  prompt, ``temperature 0, top_k 1, ignore_eos``; :func:`agreement` compares them with the engine's.

Errors: :class:`LlamaCppError` (a ``ConfigError``) names the missing tool and the fix (cmake, a C/C++
compiler, sentencepiece for the converter) before any download or compile.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ccft.bench.process import free_port, server_process
from ccft.core.errors import ConfigError
from ccft.core.io import atomic_write_file, atomic_write_text

#: ``llama-cpp-python`` release whose sdist is the llama.cpp source (= the pin in constraints.txt)
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
#: the tools built (targets of llama.cpp's CMake project)
TOOLS = ("llama-bench", "llama-batched-bench", "llama-server")
#: written last into the version folder: its presence means the build finished
MARKER = "ccft-build.json"
#: CMake options: CPU only, no tests/examples, no web UI (which would download assets), no OpenSSL
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
#: x86-64: compiler flags that keep ggml's AMX kernels out of the build. ``-DGGML_NATIVE=ON`` compiles with
#: ``-march=native``, which on an Intel CPU with AMX (Sapphire Rapids and later) defines ``__AMX_INT8__``:
#: ggml then registers its AMX buffer type and moves Q4_0 / Q4_1 / Q8_0 / K-quant weights (never F32)
#: there. On this project's 2-core Intel Xeon VM the build without these flags ended with a segmentation
#: fault on the embedded model's Q4_1 GGUF while the F32 GGUF ran; the same source on an AMD EPYC with
#: AVX-512 and no AMX runs the Q4_1 file (docs/inference.md, "Block weights"). Explicit ``-mno-amx-*``
#: flags win over ``-march=native`` (gcc), and on a CPU without AMX ``-march=native`` already implies them.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
#: KV cache in fp32 like the engine's (llama.cpp's default is f16), for every tool run
KV_FLAGS = ("-ctk", "f32", "-ctv", "f32")
INSTALL_HINT = (
    "install cmake and a C/C++ compiler, e.g. `apt-get install cmake ninja-build g++` "
    "(or `pip install cmake ninja` plus the distribution's g++)"
)


def cmake_flags(machine: str | None = None) -> tuple[str, ...]:
    """:data:`CMAKE_FLAGS`, plus :data:`NO_AMX` as C and C++ flags on x86-64 (``machine``: default
    ``platform.machine()``). Recorded in :data:`MARKER`; a build with other flags is not reused."""
    if (machine or platform.machine()).lower() in ("x86_64", "amd64"):
        return (*CMAKE_FLAGS, f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")
    return CMAKE_FLAGS


class LlamaCppError(ConfigError):
    """llama.cpp cannot be built or run here (the message names what is missing and the fix)."""


def cache_root() -> Path:
    """``ccft.core.models.cache_root()`` (``$CCFT_CACHE``, else ``$CCFT_HOME``, else ``$XDG_CACHE_HOME/ccft``,
    else ``~/.cache/ccft``), imported when called."""
    from ccft.core.models import cache_root as root

    return root()


def portable(obj, root: Path | None = None):
    """``obj`` (str / list / dict, nested) with the cache folder (``cache_root()``) written as
    ``$CCFT_CACHE``, so commands and paths recorded in a committed benchmark result name no machine-specific
    folder."""
    root_s = str((root or cache_root()).absolute())
    if isinstance(obj, str):
        return obj.replace(root_s, "$CCFT_CACHE")
    if isinstance(obj, list):
        return [portable(x, root) for x in obj]
    if isinstance(obj, dict):
        return {k: portable(v, root) for k, v in obj.items()}
    return obj


def llamacpp_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """``<cache_root()>/llama.cpp/<version>``: ``source/``, ``build/``, ``gguf/`` and :data:`MARKER`."""
    return cache_root() / "llama.cpp" / version


@dataclass
class LlamaCpp:
    """A finished build: its folder and what :data:`MARKER` records."""

    root: Path
    version: str
    build_info: dict = field(default_factory=dict)

    @property
    def source(self) -> Path:
        return self.root / "source"

    def tool(self, name: str) -> Path:
        """Path of the built tool ``name`` (one of :data:`TOOLS`)."""
        return self.root / "build" / "bin" / name

    def describe(self) -> dict:
        return {"version": self.version, "root": str(self.root), **self.build_info}


def find_build(version: str = LLAMA_CPP_PYTHON_VERSION) -> LlamaCpp | None:
    """The finished build of ``version``, or None when :data:`MARKER` or any tool is missing (an
    interrupted or foreign folder) or the marker records other CMake flags than :func:`cmake_flags` (a build
    of an older ccft): :func:`ensure_built` redoes it."""
    root = llamacpp_dir(version)
    try:
        info = json.loads((root / MARKER).read_text())
    except (OSError, ValueError):
        return None
    build = LlamaCpp(root, version, info)
    if info.get("version") != version or info.get("cmake_flags") != list(cmake_flags()):
        return None
    if not all(os.access(build.tool(t), os.X_OK) for t in TOOLS):
        return None
    return build


def check_toolchain(path: str | None = None) -> dict:
    """The build tools on ``path`` (default ``$PATH``): ``{"cmake", "c", "cxx", "generator"}``.

    Raises LlamaCppError naming what is missing (cmake; a C or C++ compiler) and how to install it.
    Ninja is used when present, else CMake's Makefile generator (``make``)."""

    def which(*names):
        return next((w for n in names if (w := shutil.which(n, path=path))), None)

    cmake = which("cmake")
    cc = which(os.environ.get("CC", "") or "cc", "gcc", "clang")
    cxx = which(os.environ.get("CXX", "") or "c++", "g++", "clang++")
    ninja, make = which("ninja"), which("make")
    missing = [
        name
        for name, found in (
            ("cmake", cmake),
            ("a C compiler (cc/gcc/clang)", cc),
            ("a C++ compiler (c++/g++/clang++)", cxx),
        )
        if not found
    ]
    if not ninja and not make:
        missing.append("ninja or make")
    if missing:
        raise LlamaCppError(
            f"building llama.cpp needs {', '.join(missing)}, not found on PATH; {INSTALL_HINT}"
        )
    return {"cmake": cmake, "c": cc, "cxx": cxx, "generator": "Ninja" if ninja else "Unix Makefiles"}


Runner = Callable[..., subprocess.CompletedProcess]


def _run(cmd: Sequence[str], *, log: Callable[[str], None], runner: Runner = subprocess.run, **kw):
    log("[ccft] $ " + " ".join(map(str, cmd)))
    proc = runner([str(c) for c in cmd], **kw)
    if proc.returncode != 0:
        tail = (proc.stderr or "")[-2000:] if isinstance(proc.stderr, str) else ""
        raise LlamaCppError(
            f"command failed (exit {proc.returncode}): {' '.join(map(str, cmd))}"
            + (f"\n{tail}" if tail else "")
        )
    return proc


def fetch_source(root: Path, version: str, *, log=print, runner: Runner = subprocess.run) -> Path:
    """``root/source``: llama.cpp from the ``llama-cpp-python==version`` sdist (downloaded with pip,
    unpacked to a temporary folder, then renamed into place, so a present folder is complete)."""
    source = root / "source"
    if (source / "CMakeLists.txt").is_file() and (source / "convert_hf_to_gguf.py").is_file():
        return source
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=root) as tmp:
        # only llama-cpp-python from source: ":all:" would also build every build-backend package from source
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-binary",
                "llama-cpp-python",
                "--no-deps",
                "-d",
                tmp,
                f"llama-cpp-python=={version}",
            ],
            log=log,
            runner=runner,
        )
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"), None)
        if sdist is None:
            raise LlamaCppError(f"pip download of llama-cpp-python=={version} left no sdist in {tmp}")
        unpack = Path(tmp) / "unpacked"
        with tarfile.open(sdist) as tar:
            # the "data" filter (no links out of the folder, no devices) where Python has it (3.10.12+)
            tar.extractall(unpack, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        vendored = next(unpack.glob("*/vendor/llama.cpp"), None)
        if vendored is None or not (vendored / "CMakeLists.txt").is_file():
            raise LlamaCppError(f"{sdist.name} has no vendor/llama.cpp source tree")
        if source.exists():
            shutil.rmtree(source)
        os.replace(vendored, source)
    return source


def ensure_built(
    version: str = LLAMA_CPP_PYTHON_VERSION,
    *,
    jobs: int = 2,
    log: Callable[[str], None] = print,
    runner: Runner = subprocess.run,
    path: str | None = None,
) -> LlamaCpp:
    """The finished build of ``version``; builds it first when :func:`find_build` finds none.

    A folder without :data:`MARKER` (an interrupted build) or whose marker records other CMake flags (an
    older ccft's build): its ``build/`` is removed and compiled again (the unpacked ``source/`` is reused: it
    is moved into place only once complete). Checks the toolchain (:func:`check_toolchain`) before
    downloading anything. ``jobs``: parallel compile jobs."""
    found = find_build(version)
    if found is not None:
        return found
    tools = check_toolchain(path)
    root = llamacpp_dir(version)
    log(
        f"[ccft] building llama.cpp (from llama-cpp-python=={version}'s sdist) CPU-only into {root}: "
        f"{', '.join(TOOLS)}; once, roughly 10-30 minutes on 2 cores (`make llamacpp` does it ahead)"
    )
    try:
        old_flags = json.loads((root / MARKER).read_text()).get("cmake_flags")
    except (OSError, ValueError, AttributeError):
        old_flags = None
    (root / MARKER).unlink(missing_ok=True)
    if (root / "build").exists():
        why = (
            f"has no {MARKER} (an interrupted build)"
            if old_flags is None or old_flags == list(cmake_flags())
            else "was built with other CMake flags"
        )
        log(f"[ccft] {root / 'build'} {why}: discarding it")
        shutil.rmtree(root / "build")
    source = fetch_source(root, version, log=log, runner=runner)
    return _compile(root, source, version, tools, jobs=jobs, log=log, runner=runner)


def _compile(
    root: Path, source: Path, version: str, tools: dict, *, jobs: int, log, runner: Runner
) -> LlamaCpp:
    """Configure and build :data:`TOOLS` from ``source`` into ``root/build``, then write :data:`MARKER`."""
    env = {**os.environ, "CC": tools["c"], "CXX": tools["cxx"]}
    _run(
        [tools["cmake"], "-S", source, "-B", root / "build", "-G", tools["generator"], *cmake_flags()],
        log=log,
        runner=runner,
        env=env,
    )
    _run(
        [tools["cmake"], "--build", root / "build", "-j", str(jobs), "--target", *TOOLS],
        log=log,
        runner=runner,
        env=env,
    )
    build = LlamaCpp(root, version)
    missing = [t for t in TOOLS if not os.access(build.tool(t), os.X_OK)]
    if missing:
        raise LlamaCppError(f"the llama.cpp build finished without {missing} in {root / 'build' / 'bin'}")
    build.build_info = {
        "version": version,
        "ggml_version": ggml_version(source),
        "cmake_flags": list(cmake_flags()),
        "generator": tools["generator"],
        "compiler": tools["cxx"],
        "machine": platform.machine(),
    }
    atomic_write_text(root / MARKER, json.dumps(build.build_info, indent=2))  # last: the build is complete
    log(f"[ccft] llama.cpp built: {root / 'build' / 'bin'}")
    return build


def ggml_version(source: Path) -> str | None:
    """The vendored ggml's version (``MAJOR.MINOR.PATCH`` from ``ggml/CMakeLists.txt``); the sdist has no
    git history, so llama.cpp's own build number is not known."""
    text = (source / "ggml" / "CMakeLists.txt").read_text(errors="replace")
    parts = [re.search(rf"set\(GGML_VERSION_{k} (\d+)\)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else None


# ------------------------------------------------------------------ weights


def convert_to_gguf(
    build: LlamaCpp, model_dir: str | Path, fingerprint: str, *, log=print, runner: Runner = subprocess.run
) -> Path:
    """The HF folder ``model_dir`` written as an F32 GGUF by llama.cpp's ``convert_hf_to_gguf.py`` (same
    source tree as the build), cached as ``<build.root>/gguf/<fingerprint>.f32.gguf`` (written to a
    temporary file, then renamed). Raises LlamaCppError when the folder has no ``config.json`` or
    the converter's ``sentencepiece`` is missing."""
    out = build.root / "gguf" / f"{fingerprint}.f32.gguf"
    if out.is_file():
        return out
    if not (Path(model_dir) / "config.json").is_file():
        raise LlamaCppError(
            f"model folder {model_dir} has no config.json; llama.cpp converts an HF folder "
            "(ccft.core.models.resolve_model_path gives the embedded model's)"
        )
    try:
        import sentencepiece  # noqa: F401  (convert_hf_to_gguf imports it for Llama models)
    except ImportError:
        raise LlamaCppError(
            "llama.cpp's convert_hf_to_gguf.py needs sentencepiece; run "
            "`pip install -c constraints.txt sentencepiece` (`make llamacpp` does)"
        ) from None
    log(f"[ccft] converting {model_dir} to an F32 GGUF at {out} (once)")
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: str) -> None:
        _run(
            [
                sys.executable,
                build.source / "convert_hf_to_gguf.py",
                model_dir,
                "--outtype",
                "f32",
                "--outfile",
                tmp,
            ],
            log=log,
            runner=runner,
            capture_output=True,
            text=True,
        )

    return atomic_write_file(out, write)


# ------------------------------------------------------------------ output parsers


def parse_llama_bench(text: str) -> list[dict]:
    """``llama-bench -o json`` output -> one dict per test with ``n_prompt``, ``n_gen``, ``n_depth``,
    ``n_threads``, ``avg_ts`` (tokens/s, mean over repetitions), ``stddev_ts`` and ``samples_ts``.

    Raises ValueError when ``text`` holds no JSON list of tests."""
    start, end = text.find("["), text.rfind("]")
    if start < 0 or end < start:
        raise ValueError("llama-bench output has no JSON list (was it run with -o json?)")
    tests = json.loads(text[start : end + 1])
    keys = ("n_prompt", "n_gen", "n_depth", "n_threads", "avg_ts", "stddev_ts", "samples_ts", "avg_ns")
    return [{k: t[k] for k in keys if k in t} for t in tests]


def parse_batched_bench(text: str) -> list[dict]:
    """``llama-batched-bench --output-format jsonl`` output -> one dict per (pp, tg, pl) row with
    ``pp`` (prompt tokens per sequence), ``tg`` (generated per sequence), ``pl`` (parallel sequences),
    ``t_pp`` / ``t_tg`` (seconds), ``speed_pp`` = pl·pp / t_pp and ``speed_tg`` = pl·tg / t_tg (tokens/s).

    Lines that are not JSON objects (logs) are skipped; ValueError when no row is found."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            rows.append(json.loads(line))
    if not rows:
        raise ValueError(
            "llama-batched-bench output has no JSON rows (was it run with --output-format jsonl?)"
        )
    return rows


def agreement(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]], first: int) -> dict:
    """Greedy agreement over each row's first ``first`` tokens.

    ``leading_share``: matching leading tokens (up to the first difference) summed over rows, over the
    tokens compared; ``rows_equal``: rows whose first ``first`` tokens are all equal, over rows;
    ``first_divergence``: per row, the index of the first difference (None when equal).
    Raises ValueError when the row counts differ."""
    if len(reference) != len(other):
        raise ValueError(f"agreement: {len(reference)} reference rows but {len(other)} rows to compare")
    lead, compared, equal, div = 0, 0, 0, []
    for a, b in zip(reference, other, strict=True):
        n = min(first, len(a), len(b))
        k = next((i for i in range(n) if a[i] != b[i]), n)
        lead, compared = lead + k, compared + n
        equal += k == n and min(len(a), first) == min(len(b), first)
        div.append(None if k == n else k)
    rows = len(reference)
    return {
        "first_tokens": first,
        "rows": rows,
        "tokens_compared": compared,
        "leading_share": lead / compared if compared else None,
        "rows_equal": equal / rows if rows else None,
        "first_divergence": div,
    }


# ------------------------------------------------------------------ running the tools


def _capture(cmd: Sequence, *, log, runner: Runner = subprocess.run) -> str:
    return _run(cmd, log=log, runner=runner, capture_output=True, text=True).stdout


def bench_batched(
    build: LlamaCpp,
    gguf: Path,
    prompt_tokens: int,
    new_tokens: int,
    batch: int,
    threads: int,
    repeats: int = 1,
    *,
    log=print,
    runner: Runner = subprocess.run,
) -> dict:
    """``llama-batched-bench`` at ``batch`` (1 included): ``batch`` sequences of ``prompt_tokens`` prefilled,
    then ``new_tokens`` decode steps of ``batch`` tokens each, fp32 KV; ``repeats`` runs (``-npl B,B,...``)
    whose median decode and prefill tokens/s are reported."""
    ctx = batch * (prompt_tokens + new_tokens) + 16
    cmd = [
        build.tool("llama-batched-bench"),
        "-m",
        gguf,
        "-t",
        threads,
        "-tb",
        threads,
        "-c",
        ctx,
        *KV_FLAGS,
        "-npp",
        prompt_tokens,
        "-ntg",
        new_tokens,
        "-npl",
        ",".join([str(batch)] * max(1, repeats)),
        "--output-format",
        "jsonl",
    ]
    rows = [r for r in parse_batched_bench(_capture(cmd, log=log, runner=runner)) if r["pl"] == batch]
    if not rows:
        raise LlamaCppError(
            f"llama-batched-bench reported no row for {batch} sequences: {' '.join(map(str, cmd))}"
        )
    return {
        "tool": "llama-batched-bench",
        "kv_type": "f32",
        "prefill_tok_s": statistics.median(r["speed_pp"] for r in rows),
        "decode_tok_s": statistics.median(r["speed_tg"] for r in rows),
        "commands": [" ".join(map(str, cmd))],
        "raw": rows,
    }


def bench_llama_bench(
    build: LlamaCpp,
    gguf: Path,
    prompt_tokens: int,
    new_tokens: int,
    threads: int,
    repeats: int,
    *,
    log=print,
    runner: Runner = subprocess.run,
) -> dict:
    """Batch 1 with ``llama-bench`` as llama.cpp users run it (its KV cache types are f16, bf16 or
    quantised, so f16, llama.cpp's default): prefill of ``prompt_tokens`` (``-p P -n 0``) and
    ``new_tokens`` decoded after a context of ``prompt_tokens`` (``-p 0 -n N -d P``), ``repeats``
    repetitions each; tokens/s are llama-bench's means."""
    common = [build.tool("llama-bench"), "-m", gguf, "-t", threads, "-r", repeats, "-o", "json"]
    cmds = [
        [*common, "-p", prompt_tokens, "-n", 0],
        [*common, "-p", 0, "-n", new_tokens, "-d", prompt_tokens],
    ]
    pp = parse_llama_bench(_capture(cmds[0], log=log, runner=runner))
    tg = parse_llama_bench(_capture(cmds[1], log=log, runner=runner))
    return {
        "tool": "llama-bench",
        "kv_type": "f16",
        "prefill_tok_s": pp[0]["avg_ts"],
        "decode_tok_s": tg[0]["avg_ts"],
        "commands": [" ".join(map(str, c)) for c in cmds],
        "raw": {"prefill": pp, "decode": tg},
    }


def post_json(url: str, body: dict, timeout: float) -> dict:
    """POST ``body`` as JSON to ``url`` and return the decoded JSON reply (urllib; raises its errors)."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@contextlib.contextmanager
def server(
    build: LlamaCpp,
    gguf: Path,
    ctx: int,
    threads: int,
    *,
    parallel: int = 1,
    extra_args: Sequence = (),
    log=print,
    ready_timeout: float = 300.0,
):
    """``llama-server`` on 127.0.0.1 (no web UI, fp32 KV) for the ``with`` block; yields its base URL.

    ``ctx``: context tokens in all (``-c``; llama-server splits it over the ``parallel`` slots, ``-np``);
    ``extra_args``: more flags (``--lora FILE``, ``--lora-init-without-apply``, ...).
    Raises LlamaCppError when it exits or is not healthy within ``ready_timeout`` seconds."""
    port = free_port()
    cmd = [
        build.tool("llama-server"),
        "-m",
        gguf,
        "--host",
        "127.0.0.1",
        "--port",
        port,
        "-t",
        threads,
        "-tb",
        threads,
        "-c",
        ctx,
        *KV_FLAGS,
        "-np",
        parallel,
        "--no-webui",
        "--no-warmup",
        *extra_args,
    ]
    url = f"http://127.0.0.1:{port}"
    with server_process(cmd, url, "/health", log=log, ready_timeout=ready_timeout, error=LlamaCppError):
        yield url


def greedy_tokens(
    build: LlamaCpp, gguf: Path, prompts: Sequence[Sequence[int]], new_tokens: int, threads: int, *, log=print
) -> list[list[int]]:
    """llama.cpp's greedy continuation (``new_tokens`` ids, EOS ignored) of each prompt, given as token
    ids (no BOS added: the ids are used as they are), from ``llama-server``'s ``/completion``."""
    ctx = max(map(len, prompts)) + new_tokens + 8
    out = []
    with server(build, gguf, ctx, threads, log=log) as url:
        for ids in prompts:
            r = post_json(
                url + "/completion",
                {
                    "prompt": list(map(int, ids)),
                    "n_predict": new_tokens,
                    "temperature": 0.0,
                    "top_k": 1,
                    "ignore_eos": True,
                    "cache_prompt": False,
                    "return_tokens": True,
                    "seed": 0,
                },
                timeout=600,
            )
            out.append([int(t) for t in r["tokens"]])
    return out


# ------------------------------------------------------------------ command line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ccft.bench.llamacpp", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build llama.cpp's tools into the cache (no-op when built)")
    b.add_argument("--jobs", type=int, default=2, help="parallel compile jobs")
    sub.add_parser("where", help="print the build folder and whether it is complete")
    args = p.parse_args(argv)
    if args.cmd == "where":
        found = find_build()
        print(f"{llamacpp_dir()} ({'built' if found else 'not built'})")
        return 0 if found else 1
    try:
        build = ensure_built(jobs=args.jobs, log=lambda m: print(m, file=sys.stderr, flush=True))
    except LlamaCppError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(build.root / "build" / "bin")
    return 0


if __name__ == "__main__":
    sys.exit(main())
