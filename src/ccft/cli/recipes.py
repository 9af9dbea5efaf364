"""``ccft recipes {list,cp}``: the recipes and evaluation suites shipped in the package
(``ccft.train.recipes``).

    ccft recipes list                  # name, the command that runs it, what it is
    ccft recipes cp demo .             # ./demo.yaml and ./evals/demo.yaml (the suite it names)
    ccft recipes cp math-gsm8k my.yaml # a recipe under a new name
    ccft recipes cp study exp/ --force # exp/study.yaml, exp/evals/study.yaml, exp/recipes/*.yaml, overwriting

A copy runs from any working directory: the files a recipe names are read from its own folder first.
"""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser(
        "recipes",
        help="list the packaged recipes and suites, or copy one to edit",
        description="The recipes and evaluation suites shipped with ccft. Any command taking a recipe also "
        "takes a packaged recipe's name (ccft train math-gsm8k --dry-run).",
    )
    rsub = p.add_subparsers(dest="recipes_command", required=True)
    ls = rsub.add_parser("list", help="name, command and description of every packaged recipe and suite")
    ls.set_defaults(func=run_list)
    cp = rsub.add_parser(
        "cp",
        help="copy a packaged recipe, with the files it names (its evaluation suite), to DEST",
        description="Copy the packaged recipe NAME to DEST with every file it names (its evaluation suite; a "
        "study's recipes), at the same relative paths, so the copy runs from any folder. DEST is the new "
        "recipe's file name when it ends in .yaml, else a folder (NAME.yaml goes in it). Existing files are "
        "not overwritten unless --force is given.",
    )
    cp.add_argument("name", help="a packaged recipe (ccft recipes list)")
    cp.add_argument("dest", help="a folder, or the copy's file name (ending in .yaml)")
    cp.add_argument("--force", action="store_true", help="overwrite existing files")
    cp.set_defaults(func=run_cp)


def run_list(args) -> int:
    from ccft.train.recipes import describe, packaged_recipes, packaged_suites

    recipes = packaged_recipes()
    suites = packaged_suites()
    width = max(len(n) for n in [*recipes, *suites])
    print("recipes (ccft recipes cp NAME DEST; or give NAME where a recipe is asked for):")
    for name, path in recipes.items():
        command, text = describe(path)
        command = "accelerate" if name.startswith("accelerate/") else command
        print(f"  {name:{width}s}  {command:11s}  {text}")
    print("evaluation suites (a recipe's eval: NAME or a study's suite: NAME; ccft eval --suite NAME):")
    for name, path in suites.items():
        print(f"  {name:{width}s}  {'ccft eval':11s}  {describe(path)[1]}")
    return 0


def run_cp(args) -> int:
    from ccft.train.recipes import copy_recipe

    written = copy_recipe(args.name, args.dest, force=args.force)
    print(f"[ccft] copied {args.name}: {', '.join(str(p) for p in written)}")
    print(f"[ccft] run it with: {_command(written[0])}")
    return 0


def _command(recipe) -> str:
    from ccft.train.recipes import describe

    command = describe(recipe)[0] or "ccft train"
    return f"{command} {recipe}" + (" --dry-run" if command != "ccft study" else "")
