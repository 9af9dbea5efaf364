"""Every Python example of README.md and docs/*.md runs (K12: what the docs promise is an entry point too).

The ```python blocks of each file run in order in one namespace (later blocks continue earlier ones), on
the tiny test base: ``load_base`` is pointed at the tiny model for any name, and ``runs/math`` /
``runs/code`` (what ``ccft train`` would have written) are LoRA decoders saved on it. The working folder
is a temporary one holding ``recipes/`` of the repository. A block preceded by an HTML comment
``<!-- not run: REASON -->`` is skipped (for examples that need a GPU or a server).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
BLOCK = re.compile(
    r"(?P<skip><!--\s*not run:(?P<reason>[^>]*)-->\s*\n)?^```python\n(?P<code>.*?)^```", re.S | re.M
)


def blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, code, skip reason or None) of each python block of ``path``."""
    text = path.read_text(encoding="utf-8")
    return [
        (
            text[: m.start("code")].count("\n") + 1,
            m.group("code"),
            m.group("reason").strip() if m.group("skip") else None,
        )
        for m in BLOCK.finditer(text)
    ]


def test_the_docs_have_examples():
    found = {p.name: len(blocks(p)) for p in DOCS}
    assert found["README.md"] >= 3 and sum(found.values()) >= 8, found
    skipped = [(p.name, line, why) for p in DOCS for line, _, why in blocks(p) if why is not None]
    assert len(skipped) <= 3, skipped  # keep these few
    assert all(why for _, _, why in skipped), skipped  # each says why


@pytest.fixture
def docs_world(tmp_path, tiny_dir, smol_dir, monkeypatch):
    import ccft
    import ccft.core.models as models

    original = models.load_base

    def tiny_load_base(name_or_path=None, *, dtype="float32", device="cpu"):
        return original(str(tiny_dir), dtype=dtype, device=device)

    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("ccft") and getattr(mod, "load_base", None) is original:
            monkeypatch.setattr(mod, "load_base", tiny_load_base)
    monkeypatch.setattr(ccft, "load_base", tiny_load_base, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    base = original(str(tiny_dir))
    for i, name in enumerate(("math", "code")):
        torch.manual_seed(i)
        dec = ccft.make_decoder(base, "lora", method="ccft", adapter_name=name, lora={"r": 2})
        ccft.save_decoder(dec, tmp_path / "runs" / name)
    return tmp_path


@pytest.mark.parametrize("doc", [p for p in DOCS if blocks(p)], ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_examples_run(doc, docs_world, capsys):
    namespace: dict = {"__name__": "__docs__"}
    ran = 0
    for line, code, skip in blocks(doc):
        if skip is not None:
            continue
        exec(compile(code, f"{doc.relative_to(ROOT)}:{line}", "exec"), namespace)  # noqa: S102 - our own docs
        ran += 1
    assert ran
