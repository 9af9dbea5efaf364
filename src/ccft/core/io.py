"""Atomic writes: a reader (or a resumed run) sees the old file or folder or the new one, never half of one.

Each helper writes into a temporary sibling in the same folder (same file system) and moves it into
place with ``os.replace``; a crash leaves at most a hidden ``.NAME.*`` temporary that the next write
ignores. Used for decoder checkpoints, converted models, reports, eval results and the C_base store.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


#: read once at import (os.umask can only be read by setting it, which races with other threads)
UMASK = _current_umask()


def atomic_write_file(path: str | Path, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` to produce the file, then move it to ``path`` (replacing it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~UMASK)  # mkstemp makes 0600; give the file the mode a plain open() would
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    return atomic_write_file(path, write)


def atomic_write_json(path: str | Path, obj, *, indent: int | None = 2, **dumps_kwargs) -> Path:
    """``json.dumps(obj)`` written to ``path`` atomically: a reader (or a crash) sees the old file or the new
    one."""
    import json

    return atomic_write_text(path, json.dumps(obj, indent=indent, **dumps_kwargs))


def save_figure(fig, path: str | Path, **savefig_kwargs) -> Path:
    """``fig.savefig`` (a matplotlib figure) to ``path`` atomically; the format is the path's suffix (png
    default)."""
    fmt = Path(path).suffix.lstrip(".") or "png"
    return atomic_write_file(path, lambda tmp: fig.savefig(tmp, format=fmt, **savefig_kwargs))


def atomic_write_dir(
    target: str | Path, write: Callable[[Path], None], *, keep_existing: bool = False
) -> Path:
    """Call ``write(tmp_dir)`` then move ``tmp_dir`` to ``target`` as atomically as the OS allows.

    An existing ``target`` is replaced, or with ``keep_existing=True`` kept when it appeared meanwhile
    (another process finished the same write first). Returns ``target``."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        write(tmp)
        os.chmod(tmp, 0o777 & ~UMASK)  # mkdtemp makes 0700; give the folder the mode a plain mkdir() would
        if target.exists() and keep_existing:
            return target
        replace_dir(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def replace_dir(staged: str | Path, target: str | Path) -> Path:
    """Move the finished folder ``staged`` to ``target`` (same file system), replacing an existing ``target``.

    For folders written by someone else into a staging place (a ``transformers.Trainer`` checkpoint):
    an existing ``target`` is first renamed into a hidden ``.NAME.old-*`` sibling, then ``staged`` is
    renamed to ``target`` and the old copy deleted, so ``target`` is only ever absent between two renames
    and never half written. Returns ``target``; ``OSError`` from the renames propagates."""
    staged, target = Path(staged), Path(target)
    if not target.exists():
        os.replace(staged, target)
        return target
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.replace(target, old / "x")
    os.replace(staged, target)
    shutil.rmtree(old, ignore_errors=True)
    return target


def display_path(path: str | Path, start: str | Path | None = None) -> str:
    """``path`` as reports should name it: relative to ``start`` (default: the working directory) when inside
    it, else its last two components, so no machine-specific absolute path lands in a committed report."""
    p = Path(path).absolute()
    base = Path(start if start is not None else os.getcwd()).absolute()
    try:
        return str(p.relative_to(base))
    except ValueError:
        return str(Path(*p.parts[-2:]))


def check_output_folder(path: str | Path, key: str, where: str | None = None) -> Path:
    """Refuse, before any work, a folder a command is to write that it could not: ``path`` must be a folder or
    not exist yet, under a writable folder with no existing file on the way. Nothing is created.

    Args:
        path: the output folder.
        key: the option or recipe key that names it (``output_dir``, ``--out``), quoted in the error.
        where: the file the key comes from (``r.yaml``), put before the message; None for a command-line
            option (the command's error line names the command).
    Returns:
        ``Path(path)``.
    Raises:
        ConfigError: ``path`` is a file, lies under a file, or its nearest existing folder is not writable by
            this user; the message names ``where``, ``key`` and the fix.
    """
    from ccft.core.errors import ConfigError

    at = f"{where}: " if where else ""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(
            f"{at}{key} {str(p)!r} is an existing file, not a folder; choose another {key} or move the file"
        )
    parent = p
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{at}{key} {str(p)!r} lies under {str(parent)!r}, which is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{at}{key} {str(p)!r}: {str(parent)!r} is not writable by this user")
    return p
