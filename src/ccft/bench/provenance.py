"""Provenance of a benchmark JSON: which code, on which machine, under which load and settings, wrote it.

Every ``ccft bench X --out F`` (``ccft.cli.bench.run``, and ``python -m ccft.bench.X``) writes
:func:`collect`'s dict under the JSON's ``"provenance"`` key, collected when the run starts; so does
``benchmarks/prefix_pool.py``. A benchmark that resumes from an existing ``--out`` (``ccft bench peers``)
calls :func:`check_resume` before it measures anything, so one file never mixes numbers of two commits.

The fields of :func:`collect`:

* ``git_commit``: the 40-hex commit checked out (``git rev-parse HEAD``) in the checkout ccft runs from,
  or None where there is none (an installed wheel) or git cannot tell (git missing, no commit yet);
* ``git_dirty``: True when tracked files differ from that commit (staged or not; untracked files do not
  count), False when they do not, None when unknown;
* ``git_diff_sha256``: sha256 of ``git diff HEAD --binary`` when dirty, else None (two dirty runs with the
  same hash ran the same uncommitted changes);
* ``source``: ``"checkout"`` (ccft imported from a git checkout's tracked files) or ``"installed"``;
* ``started_utc``: when the run started, ISO 8601 in UTC (``2026-12-08T09:15:02Z``);
* ``cpu_model``: ``/proc/cpuinfo``'s ``model name``, else ``platform.processor()``, else None;
  ``machine``: ``platform.machine()``;
* ``isa``: the CPU's instruction-set extensions (``ccft.inference.blocks.cpu_features``): on x86 the ones
  the block kernel and ``-march=native`` may use (``blocks.ISA_MACROS``: avx, avx2, fma, avx512f, ...,
  amx), elsewhere every flag the CPU lists; None where ``/proc/cpuinfo`` cannot be read;
* ``load_average_1m``: the 1-minute load average at the start (``os.getloadavg()[0]``), None where the
  platform has none; ``cpus``: ``os.cpu_count()``;
* ``hardware``: ``ccft.evals.results.hardware()`` at the start, the line eval results carry (CPU, the
  vector instructions torch dispatches to, cores, torch threads, the GPU or "no GPU");
* ``python``, ``torch``, ``ccft``: their versions;
* ``argv``: ``sys.argv``; ``settings``: the settings given (:func:`settings_of`), JSON-safe.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from ccft.core.errors import CCFTError

#: seconds one git command may take before its values are recorded as unknown
GIT_TIMEOUT_S = 10.0
#: argparse keys that are wiring, not settings (``ccft.cli.bench``: ``func``, ``bench_module``)
NOT_SETTINGS = frozenset({"func", "bench_module"})
#: environment variables that would point git at another repository than the folder asked about
GIT_LOCATION_VARS = (
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_INDEX_FILE",
    "GIT_OBJECT_DIRECTORY",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES",
    "GIT_COMMON_DIR",
    "GIT_NAMESPACE",
)
#: how many hex digits of a commit (or diff hash) the messages show
SHORT = 12


class ProvenanceMismatch(CCFTError, ValueError):
    """A benchmark JSON being resumed was written by other code (another commit, other uncommitted changes)
    or records no provenance at all (:func:`check_resume`)."""


def json_safe(value: Any) -> Any:
    """``value`` with only JSON types: dicts (keys as str), lists (tuples and sets too; sets sorted), str,
    int, float, bool, None; a ``Path`` becomes its str, anything else its ``str()``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted((json_safe(v) for v in value), key=repr)
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return str(value)


def settings_of(args) -> dict:
    """The settings of a run: an argparse ``Namespace`` (or a dict) as a JSON-safe dict, without the wiring:
    callables and modules, private keys (``_x``) and :data:`NOT_SETTINGS` (``func``, ``bench_module``) are
    dropped, Paths become str, tuples lists (:func:`json_safe`)."""
    items = args.items() if isinstance(args, dict) else vars(args).items()
    return {
        str(k): json_safe(v)
        for k, v in items
        if not str(k).startswith("_")
        and k not in NOT_SETTINGS
        and not callable(v)
        and not isinstance(v, ModuleType)
    }


def _git_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in GIT_LOCATION_VARS}
    env["GIT_OPTIONAL_LOCKS"] = "0"  # read-only: no opportunistic index refresh written back
    env["LC_ALL"] = "C"
    return env


def _git(top: Path, *args: str) -> bytes | None:
    """stdout of ``git args`` in the checkout ``top``, or None when git is missing, fails or times out."""
    # safe.directory: the checkout is the one ccft's own code (or the caller's root) comes from; git would
    # otherwise refuse a checkout owned by another user (root running a user's checkout)
    cmd = ["git", "-c", f"safe.directory={top}", "-C", str(top), *args]
    try:
        r = subprocess.run(cmd, capture_output=True, env=_git_env(), timeout=GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def _checkout_top(start: Path) -> Path | None:
    """The nearest folder at or above ``start`` holding ``.git`` (a folder, or a file: worktrees)."""
    for folder in (start, *start.parents):
        if (folder / ".git").exists():
            return folder
    return None


def _package_checkout() -> Path | None:
    """The checkout ccft is imported from: the nearest ``.git`` above ``ccft.__file__``, if ccft's
    ``__init__.py`` is a tracked file of it (a wheel installed into a venv inside a checkout is not)."""
    import ccft

    init = Path(ccft.__file__).resolve()
    top = _checkout_top(init.parent)
    if top is None:
        return None
    tracked = _git(top, "ls-files", "--error-unmatch", "--", str(init.relative_to(top)))
    return top if tracked is not None else None


def git_state(root: str | Path | None = None) -> dict:
    """``source``, ``git_commit``, ``git_dirty``, ``git_diff_sha256`` of :func:`collect` (the module
    docstring) for the checkout at or above ``root`` (default: the one ccft is imported from). Never
    raises: what git cannot tell is None."""
    top = _package_checkout() if root is None else _checkout_top(Path(root).resolve())
    state = {"source": "installed", "git_commit": None, "git_dirty": None, "git_diff_sha256": None}
    if top is None:
        return state
    state["source"] = "checkout"
    head = _git(top, "rev-parse", "--verify", "HEAD^{commit}")
    commit = head.decode().strip() if head else ""
    if len(commit) != 40:
        return state
    state["git_commit"] = commit
    diff = _git(top, "diff", "HEAD", "--binary", "--no-ext-diff", "--no-textconv", "--no-color")
    if diff is not None:
        state["git_dirty"] = bool(diff)
        state["git_diff_sha256"] = hashlib.sha256(diff).hexdigest() if diff else None
    return state


def cpu_model() -> str | None:
    """``/proc/cpuinfo``'s first ``model name``, else ``platform.processor()``, else None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def isa() -> list[str] | None:
    """The CPU's instruction-set extensions (``isa`` of :func:`collect`), from
    ``ccft.inference.blocks.cpu_features``."""
    from ccft.inference.blocks import ISA_MACROS, cpu_features

    features = cpu_features()
    if features is None:
        return None
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86"):
        return sorted(features & set(ISA_MACROS.values()))
    return sorted(features)


def collect(settings: dict | None = None, *, root: str | Path | None = None) -> dict:
    """The provenance of a run starting now (every field: the module docstring), JSON-safe.

    ``settings``: the run's settings (:func:`settings_of` of its arguments), recorded as ``settings``
    (``{}`` when None). ``root``: a folder of the git checkout to describe (default: the checkout ccft is
    imported from; none when ccft is an installed wheel). Never raises for git: a missing git, a folder
    outside any checkout or a timeout leave the git values None.
    """
    try:
        load: float | None = round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        load = None
    import torch

    from ccft.core.version import __version__
    from ccft.evals.results import hardware

    return {
        **git_state(root),
        "started_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu_model": cpu_model(),
        "machine": platform.machine(),
        "isa": isa(),
        "load_average_1m": load,
        "cpus": os.cpu_count(),
        "hardware": hardware(),
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "ccft": __version__,
        "argv": json_safe(list(sys.argv)),
        "settings": json_safe(dict(settings or {})),
    }


def recorded(run: Callable[[Any], dict], args) -> dict:
    """``run(args)``'s result with :func:`collect` of ``settings_of(args)``, taken before ``run`` starts,
    under ``"provenance"``; a result that already has one (a resumed run keeps the file's) keeps it."""
    provenance = collect(settings_of(args))
    result = run(args)
    if isinstance(result, dict):
        result.setdefault("provenance", provenance)
    return result


def _describe(p: dict) -> str:
    commit = p.get("git_commit")
    text = commit[:SHORT] if commit else f"no git commit (ccft {p.get('ccft')}, {p.get('source')})"
    if p.get("git_dirty"):
        text += f" with uncommitted changes (diff sha256 {str(p.get('git_diff_sha256'))[:SHORT]})"
    elif p.get("git_dirty") is False:
        text += " (clean)"
    return text


def check_resume(saved: dict | None, current: dict, *, path: str | Path | None = None) -> None:
    """Refuse to resume a benchmark JSON that other code wrote: ``saved`` is the ``"provenance"`` of the
    file at ``path`` (None when it has none), ``current`` this run's :func:`collect`. Call it only when a
    file is being resumed, before anything is measured.

    Passes when both have the same ``git_commit`` and are both clean, or both dirty with the same
    ``git_diff_sha256``. Two runs without a commit (installed wheels) pass when their ``ccft`` versions
    are equal.

    Raises:
        ProvenanceMismatch: ``saved`` is None or records no ``git_commit`` field (a file written before
            provenance was recorded cannot be shown to come from this code), the commits differ, one is
            dirty and the other not, or both are dirty with different diffs. The message names the file,
            both commits (first 12 hex digits) and the fix: a new ``--out``, or a rerun from the commit that
            wrote the file.
    """
    where = str(path) if path is not None else "the JSON being resumed"
    if not isinstance(saved, dict) or "git_commit" not in saved:
        raise ProvenanceMismatch(
            f"{where} records no provenance, so its numbers cannot be shown to come from this code "
            f"({_describe(current)}): pass a new --out, or delete the file to measure again"
        )
    if saved.get("git_commit") != current.get("git_commit"):
        why = "another commit"
    elif saved.get("git_commit") is None and saved.get("ccft") != current.get("ccft"):
        why = "another ccft version"
    elif bool(saved.get("git_dirty")) != bool(current.get("git_dirty")):
        why = "uncommitted changes on one side"
    elif saved.get("git_dirty") and saved.get("git_diff_sha256") != current.get("git_diff_sha256"):
        why = "other uncommitted changes"
    else:
        return
    raise ProvenanceMismatch(
        f"{where} was written from {_describe(saved)}, this run is from {_describe(current)}: {why}, and "
        "resuming would mix their numbers; pass a new --out, or rerun from the commit that wrote it"
    )


__all__ = [
    "GIT_TIMEOUT_S",
    "NOT_SETTINGS",
    "ProvenanceMismatch",
    "check_resume",
    "collect",
    "cpu_model",
    "git_state",
    "isa",
    "json_safe",
    "recorded",
    "settings_of",
]
