"""llama.cpp beside the engine in ``ccft bench decode --llamacpp``: a pinned build, the same weights as an
F32 GGUF, its speed at batch 1 and 16, and its greedy tokens.

* **Source**: the sdist of ``llama-cpp-python`` at :data:`LLAMA_CPP_PYTHON_VERSION` (the pin in the source
  repository's ``constraints.txt``; a test keeps the two equal), which vendors one llama.cpp commit.
  ``pip download --no-binary llama-cpp-python --no-deps`` fetches it from the package registry; nothing else
  is downloaded.
* **Build** (once per CPU target, CPU only, cmake + ninja, ``-DGGML_NATIVE=ON``, i.e. ``-march=native``; on
  x86-64 without ggml's AMX kernels, :data:`NO_AMX`): the tools :data:`TOOLS` in
  ``<cache>/llama.cpp/<version>/build-<target>/`` (:func:`build_dir`) with ``<cache>`` = ``$CCFT_CACHE``,
  else ``$CCFT_HOME``, else ``$XDG_CACHE_HOME/ccft``, else ``~/.cache/ccft``. ``<target>``
  (:func:`native_target`) names what ``-march=native`` resolves to on this CPU with the C++ compiler
  :func:`check_toolchain` finds (e.g. ``avx2-1f0c9e2a7b``), so CPUs of different instruction sets sharing one
  cache (a home folder on a cluster) each get their own build; ``source/`` and ``gguf/`` are shared per
  version. The file :data:`MARKER` (in the build folder) is written last and records the instruction sets
  the build targets; a folder without it is a half-finished build and is rebuilt from scratch (discarded,
  never trusted), and so is one whose marker records other CMake flags than :func:`cmake_flags`, no
  instruction sets, or one this CPU lacks (an illegal instruction would kill the tool): a tool of a build
  for another CPU is never run. ``make llamacpp`` or ``python -m ccft.bench.llamacpp build`` builds it
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
import functools
import hashlib
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
#: written last into the build folder (:func:`build_dir`): its presence means the build finished
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
    """``<cache_root()>/llama.cpp/<version>``: ``source/``, ``gguf/`` and one ``build-<target>/`` per CPU
    target (:func:`build_dir`)."""
    return cache_root() / "llama.cpp" / version


def native_flags(machine: str | None = None) -> tuple[str, ...]:
    """The machine options the build compiles with: ``-march=native`` (``-DGGML_NATIVE=ON``), plus
    :data:`NO_AMX` on x86-64 (``machine``: default ``platform.machine()``), as :func:`cmake_flags` adds."""
    if (machine or platform.machine()).lower() in ("x86_64", "amd64"):
        return ("-march=native", *NO_AMX.split())
    return ("-march=native",)


@functools.lru_cache(maxsize=8)
def native_target(cxx: str, machine: str | None = None) -> tuple[str, tuple[str, ...]]:
    """``(tag, isa)`` of builds by the C++ compiler ``cxx`` on this CPU (probed once per process, compiler).

    ``isa``: the instruction-set extensions :func:`native_flags` target here
    (``ccft.inference.blocks.target_isa``: what ``-march=native`` resolves to), recorded in :data:`MARKER`.
    ``tag``: the build folder's suffix (:func:`build_dir`), the widest vector extension (``avx512``,
    ``avx2``, ``avx``; else the machine name) and 10 hex digits of a hash of every macro the machine options
    define beyond the compiler's defaults, so CPUs whose ``-march=native`` differs in anything (also
    extensions outside ``isa``) get different folders."""
    from ccft.inference.blocks import target_isa

    flags = native_flags(machine)
    isa = target_isa(cxx, flags)

    def macros(opts: tuple[str, ...]) -> set[str]:
        cmd = [cxx, *opts, "-dM", "-E", "-x", "c++", os.devnull]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        return {line.strip() for line in r.stdout.splitlines() if line.startswith("#define ")}

    delta = sorted(macros(flags) - macros(()))
    level = next(
        (name for name, flag in (("avx512", "avx512f"), ("avx2", "avx2"), ("avx", "avx")) if flag in isa),
        re.sub(r"[^a-z0-9]+", "", (machine or platform.machine()).lower()) or "cpu",
    )
    digest = hashlib.sha256("\n".join([*isa, *delta]).encode()).hexdigest()[:10]
    return f"{level}-{digest}", isa


def cxx_compiler(path: str | None = None) -> str | None:
    """The C++ compiler the build uses (``$CXX``, else ``c++``, ``g++``, ``clang++`` on ``path``, default
    ``$PATH``), or None."""
    names = (os.environ.get("CXX", "") or "c++", "g++", "clang++")
    return next((w for n in names if (w := shutil.which(n, path=path))), None)


def build_dir(
    version: str = LLAMA_CPP_PYTHON_VERSION, cxx: str | None = None, *, path: str | None = None
) -> Path | None:
    """``<llamacpp_dir(version)>/build-<tag>``: the build for this CPU (:func:`native_target` with ``cxx``,
    default :func:`cxx_compiler` on ``path``); None without a C++ compiler (then nothing can be found or
    built)."""
    cxx = cxx or cxx_compiler(path)
    if cxx is None:
        return None
    return llamacpp_dir(version) / f"build-{native_target(cxx)[0]}"


def lacking_isa(info: dict, features: frozenset[str] | None = None) -> list[str]:
    """The instruction sets a build's :data:`MARKER` contents ``info`` records (``"isa"``) that the running
    CPU (``features``, default ``ccft.inference.blocks.cpu_features``) lacks; ``["(no ISA record)"]`` when it
    records none (a build of unknown target is not trusted); none when the CPU's flags cannot be read."""
    from ccft.inference.blocks import cpu_features

    features = cpu_features() if features is None else features
    isa = info.get("isa")
    if not isinstance(isa, list) or not all(isinstance(x, str) for x in isa):
        return ["(no ISA record)"]
    return [] if features is None else sorted(set(isa) - features)


@dataclass
class LlamaCpp:
    """A finished build: the version folder ``root`` (``source/``, ``gguf/``), the build folder
    ``build_folder`` (:func:`build_dir`; default ``root/build``) and what :data:`MARKER` records."""

    root: Path
    version: str
    build_info: dict = field(default_factory=dict)
    build_folder: Path | None = None

    @property
    def source(self) -> Path:
        return self.root / "source"

    @property
    def build_root(self) -> Path:
        """The folder CMake built into (its tools in ``bin/``, :data:`MARKER` beside them)."""
        return self.build_folder or self.root / "build"

    def tool(self, name: str) -> Path:
        """Path of the built tool ``name`` (one of :data:`TOOLS`). Raises LlamaCppError when the build records
        an instruction set this CPU lacks (its tools would die of an illegal instruction)."""
        if "isa" in self.build_info and (lacking := lacking_isa(self.build_info)):
            raise LlamaCppError(
                f"{self.build_root} was built for {', '.join(lacking)}, which this CPU lacks; "
                "`python -m ccft.bench.llamacpp build` builds one for this CPU"
            )
        return self.build_root / "bin" / name

    def describe(self) -> dict:
        return {"version": self.version, "root": str(self.root), **self.build_info}


def read_marker(folder: Path) -> dict | None:
    """The JSON object :data:`MARKER` in the build folder ``folder`` holds, or None (missing, unreadable)."""
    try:
        info = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def find_build(version: str = LLAMA_CPP_PYTHON_VERSION, *, path: str | None = None) -> LlamaCpp | None:
    """The finished build of ``version`` for this CPU (:func:`build_dir`, with the C++ compiler on ``path``,
    default ``$PATH``), or None when there is no C++ compiler, :data:`MARKER` or any tool is missing (an
    interrupted or foreign folder), the marker records other CMake flags than :func:`cmake_flags` (a build
    of an older ccft) or another target, or it records no instruction sets or one this CPU lacks
    (:func:`lacking_isa`): :func:`ensure_built` redoes it."""
    folder = build_dir(version, path=path)
    info = read_marker(folder) if folder is not None else None
    if folder is None or info is None:
        return None
    build = LlamaCpp(llamacpp_dir(version), version, info, folder)
    if info.get("version") != version or info.get("cmake_flags") != list(cmake_flags()):
        return None
    if info.get("target") != folder.name.removeprefix("build-") or lacking_isa(info):
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
    cxx = cxx_compiler(path)
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

    def complete() -> bool:
        return (source / "CMakeLists.txt").is_file() and (source / "convert_hf_to_gguf.py").is_file()

    if complete():
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
        if complete():  # another process (maybe another CPU's build) moved a complete tree in meanwhile
            return source
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
    """The finished build of ``version`` for this CPU; builds it first when :func:`find_build` finds none.

    Its folder is :func:`build_dir` for the C++ compiler :func:`check_toolchain` finds. A folder there without
    :data:`MARKER` (an interrupted build), or whose marker records other CMake flags (an older ccft's build)
    or no or other instruction sets than this CPU has: it is removed and compiled again (the unpacked
    ``source/`` is reused: it is moved into place only once complete). Builds for other CPUs (other
    folders) are left alone. Checks the toolchain (:func:`check_toolchain`) before downloading anything.
    ``jobs``: parallel compile jobs."""
    found = find_build(version, path=path)
    if found is not None:
        return found
    tools = check_toolchain(path)
    root = llamacpp_dir(version)
    tag, isa = native_target(tools["cxx"])
    folder = root / f"build-{tag}"  # = build_dir(version, tools["cxx"])
    if lacking := lacking_isa({"isa": list(isa)}):
        raise LlamaCppError(
            f"{tools['cxx']} {' '.join(native_flags())} targets {', '.join(lacking)}, which this CPU lacks "
            "(set CXX to this machine's compiler)"
        )
    log(
        f"[ccft] building llama.cpp (from llama-cpp-python=={version}'s sdist) CPU-only into {folder} "
        f"({', '.join(isa) or 'no vector extensions'}): {', '.join(TOOLS)}; once per CPU type, roughly "
        "10-30 minutes on 2 cores (`make llamacpp` does it ahead)"
    )
    if (root / "build" / "bin").is_dir():
        log(f"[ccft] {root / 'build'} is an older ccft's build (not keyed by CPU): no longer used")
    if folder.exists():
        old = read_marker(folder)
        if old is None:
            why = f"has no {MARKER} (an interrupted build)"
        elif old.get("cmake_flags") != list(cmake_flags()):
            why = "was built with other CMake flags"
        elif lacking_isa(old, frozenset()) == ["(no ISA record)"]:
            why = "records no instruction sets (a build of unknown target is not trusted)"
        elif lacking := lacking_isa(old):
            why = f"was built for {', '.join(lacking)}, which this CPU lacks"
        else:
            why = "is not a finished build for this CPU"
        log(f"[ccft] {folder} {why}: discarding it")
        (folder / MARKER).unlink(missing_ok=True)
        shutil.rmtree(folder)
    source = fetch_source(root, version, log=log, runner=runner)
    return _compile(root, source, version, tools, jobs=jobs, log=log, runner=runner)


def _compile(
    root: Path, source: Path, version: str, tools: dict, *, jobs: int, log, runner: Runner
) -> LlamaCpp:
    """Configure and build :data:`TOOLS` from ``source`` into :func:`build_dir`, then write :data:`MARKER`
    there (with the target's tag and instruction sets)."""
    tag, isa = native_target(tools["cxx"])
    folder = root / f"build-{tag}"
    env = {**os.environ, "CC": tools["c"], "CXX": tools["cxx"]}
    _run(
        [tools["cmake"], "-S", source, "-B", folder, "-G", tools["generator"], *cmake_flags()],
        log=log,
        runner=runner,
        env=env,
    )
    _run(
        [tools["cmake"], "--build", folder, "-j", str(jobs), "--target", *TOOLS],
        log=log,
        runner=runner,
        env=env,
    )
    build = LlamaCpp(root, version, build_folder=folder)
    missing = [t for t in TOOLS if not os.access(build.tool(t), os.X_OK)]
    if missing:
        raise LlamaCppError(f"the llama.cpp build finished without {missing} in {folder / 'bin'}")
    build.build_info = {
        "version": version,
        "ggml_version": ggml_version(source),
        "cmake_flags": list(cmake_flags()),
        "generator": tools["generator"],
        "compiler": tools["cxx"],
        "machine": platform.machine(),
        "target": tag,
        "isa": list(isa),
    }
    atomic_write_text(folder / MARKER, json.dumps(build.build_info, indent=2))  # last: the build is complete
    log(f"[ccft] llama.cpp built: {folder / 'bin'}")
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
    record: dict | None = None,
):
    """``llama-server`` on 127.0.0.1 (no web UI, fp32 KV) for the ``with`` block; yields its base URL.

    ``ctx``: context tokens in all (``-c``; llama-server splits it over the ``parallel`` slots, ``-np``,
    unless ``extra_args`` has ``--kv-unified``); ``extra_args``: more flags (``--lora FILE``,
    ``--lora-init-without-apply``, ...). ``record``: a dict updated with ``"command"`` (the command line, a
    list of str) before the server starts. Raises LlamaCppError when it exits or is not healthy within
    ``ready_timeout`` seconds."""
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
    if record is not None:
        record["command"] = [str(c) for c in cmd]
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
        folder = build_dir()
        state = ("built" if found else "not built") + ("" if folder else ", no C++ compiler found")
        print(f"{folder or llamacpp_dir()} ({state})")
        return 0 if found else 1
    try:
        build = ensure_built(jobs=args.jobs, log=lambda m: print(m, file=sys.stderr, flush=True))
    except LlamaCppError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(build.build_root / "bin")
    return 0


if __name__ == "__main__":
    sys.exit(main())
