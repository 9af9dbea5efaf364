"""Result files are written atomically (``ccft.core.io``): a writer that fails part-way leaves the file that
was there before, byte for byte, and no temporary file beside it."""

import json
import os

import pytest

from ccft.bench import decode, train
from ccft.core.io import atomic_write_json, save_figure


def _old(path):
    path.write_text('{"old": true}')
    return path.read_bytes()


def _only(path):
    return sorted(os.listdir(path.parent)) == [path.name]


def test_json_failure_keeps_the_old_file(tmp_path):
    path = tmp_path / "r.json"
    before = _old(path)
    with pytest.raises(TypeError):
        atomic_write_json(path, {"x": object()})
    assert path.read_bytes() == before and _only(path)
    atomic_write_json(path, {"x": 1})
    assert json.loads(path.read_text()) == {"x": 1} and _only(path)


class _HalfFigure:
    """Writes some bytes, then fails, as a plot that raises mid-render does."""

    def savefig(self, fname, format=None, **kw):
        assert format == "png"
        with open(fname, "wb") as f:
            f.write(b"\x89PNG partial")
        raise RuntimeError("render failed")


class _Figure:
    def savefig(self, fname, format=None, dpi=None):
        with open(fname, "wb") as f:
            f.write(f"{format}:{dpi}".encode())


def test_figure_failure_keeps_the_old_file(tmp_path):
    path = tmp_path / "p.png"
    path.write_bytes(b"old png")
    with pytest.raises(RuntimeError):
        save_figure(_HalfFigure(), path)
    assert path.read_bytes() == b"old png" and _only(path)
    save_figure(_Figure(), path, dpi=90)
    assert path.read_bytes() == b"png:90" and _only(path)


class _DiskFull:
    """A text file whose ``write`` stores half the text and then fails (ENOSPC), as a full disk does."""

    def __init__(self, f):
        self.f = f

    def write(self, text):
        self.f.write(text[: len(text) // 2])
        self.f.flush()
        raise OSError(28, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.mark.parametrize("module", [decode, train])
def test_bench_reports_survive_a_failed_write(tmp_path, module, monkeypatch):
    """The file a bench run wrote before (possibly hours of measurements) survives a write that fails
    part-way."""
    import builtins
    import io

    real_open = io.open

    def failing_open(file, mode="r", *a, **kw):
        f = real_open(file, mode, *a, **kw)
        return _DiskFull(f) if "bench.json" in os.fspath(file) and "w" in mode else f

    monkeypatch.setattr(module, "table", lambda result: "")
    path = tmp_path / "bench.json"
    before = _old(path)
    with monkeypatch.context() as m, pytest.raises(OSError):
        m.setattr(builtins, "open", failing_open)
        m.setattr(io, "open", failing_open)
        module.report({"speedup_batch1": 1.5, "rows": list(range(100))}, str(path))
    assert path.read_bytes() == before and _only(path)
    module.report({"speedup_batch1": 1.5}, str(path))
    assert json.loads(path.read_text()) == {"speedup_batch1": 1.5}
