"""Architecture rules that the import contract does not cover (docs/design.md, "Layers").

``.importlinter`` (run by ``make lint``) checks the layers and cycles; this test checks that no module
imports another module's private (``_name``) symbols, in the package and in the benchmarks.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def private_imports(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ccft":
            for alias in node.names:
                if alias.name.startswith("_") and not (
                    alias.name.startswith("__") and alias.name.endswith("__")
                ):
                    found.append(
                        f"{path.relative_to(root)}:{node.lineno}: from {node.module} import {alias.name}"
                    )
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] == "ccft"
            and any(part.startswith("_") and part != "__init__" for part in node.module.split(".")[1:])
        ):
            found.append(f"{path.relative_to(root)}:{node.lineno}: from {node.module} (a private module)")
    return found


def test_no_private_name_is_imported_across_modules():
    files = sorted((ROOT / "src" / "ccft").rglob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.py"))
    assert len(files) > 40
    bad = [line for f in files for line in private_imports(f)]
    assert bad == []


def test_the_checker_sees_a_private_import(tmp_path):
    f = tmp_path / "probe.py"
    f.write_text("from ccft.core.cache import _versions\nfrom ccft.core import __version__\n")
    assert private_imports(f, tmp_path) == ["probe.py:1: from ccft.core.cache import _versions"]
