"""The recipes and evaluation suites shipped in the package (``ccft/recipes/``; ``recipes/`` and ``evals/`` of
the repository are links to it), and the one rule for the files a recipe names.

- **Packaged**: ``ccft/recipes/NAME.yaml`` (training recipes, ``ccft demo`` and ``ccft study`` configs),
  ``ccft/recipes/accelerate/NAME.yaml`` (listed as ``accelerate/NAME``) and the evaluation suites
  ``ccft/recipes/evals/NAME.yaml``. ``ccft recipes list`` shows them, ``ccft recipes cp NAME DEST`` copies one
  with the files it names.
- **A file a recipe names** (``eval:`` of a recipe, ``suite:`` and ``specialists.*.recipe`` of a study
  config): a packaged suite by name (``eval: demo``), or a path. A relative path is read from the folder of
  the file that names it first, then from the working directory (older recipes), then from the folder above
  the naming file's (the old ``recipes/`` beside ``evals/`` layout).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ccft.core.errors import ConfigError

__all__ = [
    "PACKAGE_DIR",
    "SUITES_DIR",
    "copy_recipe",
    "describe",
    "named_files",
    "packaged_recipes",
    "packaged_suites",
    "recipe_argument",
    "resolve_named",
]

#: the packaged recipes (``ccft/recipes/``: package data, in the wheel)
PACKAGE_DIR = Path(__file__).resolve().parents[1] / "recipes"
#: the packaged evaluation suites
SUITES_DIR = PACKAGE_DIR / "evals"


def packaged_recipes() -> dict[str, Path]:
    """``{name: path}`` of the packaged recipes: ``NAME.yaml`` as ``NAME``, ``accelerate/NAME.yaml`` as
    ``accelerate/NAME``."""
    found = sorted(PACKAGE_DIR.glob("*.yaml")) + sorted((PACKAGE_DIR / "accelerate").glob("*.yaml"))
    return {p.relative_to(PACKAGE_DIR).with_suffix("").as_posix(): p for p in found}


def packaged_suites() -> dict[str, Path]:
    """``{name: path}`` of the packaged evaluation suites (``evals/NAME.yaml``)."""
    return {p.stem: p for p in sorted(SUITES_DIR.glob("*.yaml"))}


def describe(path: Path) -> tuple[str, str]:
    """(command, description) of a recipe or suite file from its opening comment: the command its first line
    names (``ccft train``, ``ccft demo``, ``ccft study``; "" when none) and the first phrase of the paragraph
    after that line's (of the first paragraph when it names no command), up to the first ``(``, ``:``, ``;``
    or sentence end."""
    paras: list[list[str]] = [[]]
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if text:
            paras[-1].append(text)
        elif paras[-1]:
            paras.append([])
    first = paras[0][0] if paras[0] else ""
    command = next((f"ccft {c}" for c in ("demo", "study", "train") if f"ccft {c} " in first), "")
    if command or first.startswith("make "):
        paras = paras[1:]
    words = " ".join(paras[0]) if paras else ""
    cut = min([i for i in (words.find(c) for c in ("(", ":", ";", ". ")) if i > 0] or [len(words)])
    return command, words[:cut].strip().rstrip(".")


def _is_name(value: str) -> bool:
    return "/" not in value and "\\" not in value and not value.endswith((".yaml", ".yml"))


def _candidates(value: str, referrer: Path | None, cwd: bool = True) -> list[Path]:
    p = Path(value).expanduser()
    if p.is_absolute() or referrer is None:
        return [p]
    here = referrer.resolve().parent
    return list(dict.fromkeys([here / p] + ([p] if cwd else []) + [here.parent / p]))


def resolve_named(
    value: str, referrer: Path | None, field: str, at: str, kind: str = "suite", *, cwd: bool = True
) -> Path:
    """The file ``value`` names: a packaged suite by name (``kind == "suite"``), else a path read from the
    folder of ``referrer`` (the file naming it), then the working directory, then the folder above
    ``referrer``'s.

    Args:
        value: as written in the file (``evals/demo.yaml``, ``demo``).
        referrer: the recipe or study config naming it (None: a command-line option).
        field: the key naming it (``eval``, ``suite``, ``specialists.math.recipe``), quoted in the error.
        at: ``FILE:LINE`` put before the error.
        kind: ``suite`` or ``recipe`` (what is looked up by name).
        cwd: look in the working directory too (False: only beside ``referrer``).
    Raises:
        ConfigError: nothing found; the message names the field, the places looked in and the fix.
    """
    packaged = packaged_suites() if kind == "suite" else packaged_recipes()
    tried = _candidates(value, referrer, cwd)
    for cand in tried:
        if cand.is_file():
            return cand
    if _is_name(value) and value in packaged:
        return packaged[value]
    looked = ", ".join(str(c) for c in tried)
    names = ", ".join(packaged) or "none"
    folder = f"relative to {referrer.name}'s folder" if referrer is not None else "to a file"
    raise ConfigError(
        f"{at}: {field}: {kind} {value!r} not found (looked for {looked}); give a path {folder} or the name "
        f"of a packaged {kind} ({names}; `ccft recipes list`)"
    )


def recipe_argument(value: str, kind: str = "recipe") -> str:
    """A recipe (``kind="suite"``: an evaluation suite) named on the command line: the file ``value`` when it
    exists, else the packaged one of that name (``ccft train math-gsm8k``, ``ccft eval --suite demo``), else
    ``value`` unchanged (the reader reports it missing)."""
    value = str(value)
    if not Path(value).expanduser().exists() and _is_name(value):
        packaged = packaged_suites() if kind == "suite" else packaged_recipes()
        if value in packaged:
            return str(packaged[value])
    return value


def named_files(path: Path) -> list[tuple[str, Path]]:
    """``(as written, file)`` of every file the recipe or study config ``path`` names by a relative path
    (``eval:``, ``suite:``, ``specialists.*.recipe``), and of the files those name, in order; packaged suites
    named by name and absolute paths are left out (they do not move with a copy). A name that resolves to
    nothing is left out too (reading the recipe reports it)."""
    import yaml

    out: dict[str, Path] = {}

    def visit(p: Path, prefix: Path) -> None:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            return
        names = [raw.get("eval"), raw.get("suite")]
        specs = raw.get("specialists")
        if isinstance(specs, dict):
            names += [s.get("recipe") for s in specs.values() if isinstance(s, dict)]
        for value in names:
            if not isinstance(value, str) or Path(value).is_absolute() or _is_name(value):
                continue
            try:  # the packaged files name each other: the working directory is not looked in
                found = resolve_named(value, p, "", str(p), cwd=False)
            except ConfigError:
                continue
            rel = (prefix / value).as_posix()
            if rel not in out:
                out[rel] = found
                visit(found, (prefix / value).parent)

    visit(path, Path("."))
    return list(out.items())


def copy_recipe(name: str, dest: str | Path, *, force: bool = False) -> list[Path]:
    """Copy the packaged recipe ``name`` to ``dest`` with every file it names, at the same path relative to
    the copy, so the copy runs from any working directory. ``dest`` ending in ``.yaml`` / ``.yml`` (and not an
    existing folder) is the copy's file name; anything else is a folder (created when missing) that gets
    ``NAME.yaml``. Nothing is written when any target exists and ``force`` is false.

    Returns:
        the files written, the recipe first.
    Raises:
        ConfigError: an unknown name, or a target that exists (without ``force``) or is a folder.
    """
    recipes = packaged_recipes()
    if name not in recipes:
        raise ConfigError(
            f"no packaged recipe {name!r}; the recipes are {', '.join(recipes)} (`ccft recipes list`)"
        )
    src = recipes[name]
    d = Path(dest).expanduser()
    target = d if d.suffix in (".yaml", ".yml") and not d.is_dir() else d / src.name
    plan = [(src, target)] + [(found, target.parent / rel) for rel, found in named_files(src)]
    for _, t in plan:
        if t.is_dir():
            raise ConfigError(f"{t} is a folder; give another DEST")
    existing = [t for _, t in plan if t.exists()]
    if existing and not force:
        raise ConfigError(
            f"{', '.join(str(t) for t in existing)} already exist(s); nothing copied (add --force to "
            "overwrite, or give another DEST)"
        )
    for s, t in plan:
        t.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(s, t)
    return [t for _, t in plan]
