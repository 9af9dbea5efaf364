"""ccft.core.io.replace_dir: a folder finished elsewhere moves into place; an old one is replaced whole."""

from __future__ import annotations

from ccft.core.io import replace_dir


def test_replace_dir_moves_and_replaces(tmp_path):
    staged = tmp_path / ".staging" / "checkpoint-2"
    staged.mkdir(parents=True)
    (staged / "w.txt").write_text("new")
    target = tmp_path / "checkpoint-2"
    assert replace_dir(staged, target) == target
    assert (target / "w.txt").read_text() == "new" and not staged.exists()

    again = tmp_path / ".staging" / "checkpoint-2"
    again.mkdir()
    (again / "other.txt").write_text("newer")
    replace_dir(again, target)
    assert sorted(p.name for p in target.iterdir()) == ["other.txt"]  # the old folder is gone, not merged
    assert (target / "other.txt").read_text() == "newer"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".staging", "checkpoint-2"]  # no .old-* left
