"""``StudyRecipe``: the specialists study as phases, each resumable (docs/study.md).

setup → per specialist (train → evaluate → sweep) → serve → report. Every phase's wall time is added up over
sittings (``StudyPhases``); finished work is reused and interrupted work resumes (training from its newest
checkpoint, evaluation item by item, the sweep point by point); results computed with other decoders than
the ones now trained (``resume.stamp_matches``) or with other settings are computed again. The report is
rewritten after each specialist, so a partial study already has its numbers.

The serving phase runs ``ccft bench serve``, a layer above the evaluation: the caller passes it in
(``serve=``; ``ccft.cli.study`` does).
"""

from __future__ import annotations

import dataclasses
import gc
import sys
from pathlib import Path
from typing import Callable

from ccft.core.errors import ConfigError
from ccft.evals.study.config import StudyConfig, metrics_of, recipe_overrides
from ccft.evals.study.resume import StudyPhases, run_digest, stamp_matches, write_stamp

__all__ = ["StudyRecipe"]


class StudyRecipe:
    """The study of ``cfg`` into ``cfg.out`` (see the module docstring).

    Args:
        cfg: a validated ``StudyConfig`` (``load_study_config``).
        command: the command line named in the report ("make study", "ccft study ...").
        where: the config file, named in errors.
        serve: ``serve(cfg, ccft_decoder_paths, base_name, out) -> dict`` for the serving phase; None skips
            it.
    Raises (from ``run``):
        ConfigError: the specialists' recipes name different bases, or a phase's inputs are invalid.
    """

    def __init__(
        self, cfg: StudyConfig, *, command: str, serve: Callable | None = None, where: str = "the study"
    ):
        self.cfg, self.command, self.serve_fn, self.where = cfg, command, serve, where
        self.out, self.runs = Path(cfg.out), Path(cfg.runs)
        self.parsed = {name: recipe_overrides(spec) for name, spec in cfg.specialists.items()}
        bases = {tc.base for tc, _, _ in self.parsed.values()}
        if len(bases) != 1:
            raise ConfigError(
                f"{where}: the specialists' recipes name different bases {sorted(bases)}; the study "
                "compares decoders on one frozen base (set specialists.NAME.train.base to one model)"
            )
        self.base_name = bases.pop()
        self.dtype = next(iter(self.parsed.values()))[0].dtype
        self.phases: StudyPhases | None = None
        self.base = None
        self.summaries: dict[str, list[dict]] = {}
        self.sweeps: dict[str, dict] = {}
        self.specialists_meta: dict[str, dict] = {}
        self.ccft_decoders: dict[str, str] = {}
        self.serving: dict | None = None
        self.settings_of: dict[str, dict] = {}  # per specialist: task -> EvalSettings of its evaluation
        self.frontiers: dict[str, list[dict]] = {}  # per specialist: one frontier per task
        self.records: dict[str, dict] = {}  # per specialist: task -> mode -> item id -> record (the report)

    # ------------------------------------------------------------------ the recipe
    def run(self) -> dict:
        """Every phase in order; returns the report (also in ``OUT/report.json``).

        Every specialist's recipe, data rows and run folders are checked before the first write
        (``check``): a study that fails to start leaves ``runs`` and ``out`` as they were."""
        self.check()
        self.out.mkdir(parents=True, exist_ok=True)
        if self.cfg.threads:
            import torch

            torch.set_num_threads(int(self.cfg.threads))
        self.phases = StudyPhases(self.out)
        self.setup()
        for name in self.cfg.specialists:  # one specialist at a time: its numbers are complete early
            trained = self.train(name)
            decoders, paths, task_list, records, fresh, fmt = self.evaluate(name, trained)
            self.sweep(name, decoders, paths, records, fresh=fresh, prompt_format=fmt)
            self.frontier(name, records)
            self.describe(name, trained, paths, task_list)
            self.write_report()  # partial
        if self.serve_fn is not None:
            with self.phases("serving"):
                self.serving = self.serve_fn(self.cfg, self.ccft_decoders, self.base_name, self.out)
        with self.phases("report"):
            return self.write_report()

    def check(self) -> None:
        """What ``ccft train --dry-run`` checks, for each specialist and method, without loading weights: the
        tokenizer, every data row (``FILE:LINE``), the run folders; and the report folder ``out``.

        Raises:
            ConfigError, DataError, StoreError: the first problem found, naming the specialist's recipe.
        """
        from ccft.core.io import check_output_folder
        from ccft.train.config import METHODS
        from ccft.train.run import check_run, method_config

        check_output_folder(self.out, "out", self.where)
        for name, (tc, _, raw) in self.parsed.items():
            for method in METHODS:
                m_cfg, _ = method_config(tc, raw, method, self.runs / name / method)
                check_run(m_cfg, store=False)

    def setup(self) -> None:
        """Convert the embedded base once; set up the BFCL checker's environment when a task needs it."""
        from ccft.core.models import resolve_model_path

        with self.phases("setup"):
            resolve_model_path(self.base_name)
            if any("bfcl-multiple" in s.tasks for s in self.cfg.specialists.values()):
                from ccft.evals.bfcl import checker_python, setup_checker_env

                if checker_python() is None:
                    print("[ccft study] setting up the BFCL checker environment (pip, once)", flush=True)
                    setup_checker_env()

    def train(self, name: str) -> dict:
        """The specialist's decoders, method ``ccft`` and ``full-ft``, from its recipe (reused when
        finished)."""
        from ccft.train.config import METHODS
        from ccft.train.run import method_config, train_or_reuse

        tc, _, raw = self.parsed[name]
        trained = {"histories": {}, "rows": {}, "reused": {}}
        for method in METHODS:
            m_cfg, m_raw = method_config(tc, raw, method, self.runs / name / method)
            with self.phases(f"train_{name}_{method.replace('-', '_')}"):
                h, rows, reused = train_or_reuse(m_cfg, m_raw, prefix="[ccft study]")
            trained["histories"][method], trained["rows"][method], trained["reused"][method] = h, rows, reused
            gc.collect()
        return trained

    def evaluate(self, name: str, trained: dict):
        """Every task of the specialist in the four modes; results of other decoders or settings are
        recomputed. Returns (decoders, their paths, the task list, per task: mode -> item id -> record,
        whether every result was recomputed, the decoders' prompt format)."""
        from ccft.core.checkpoint import load_decoder
        from ccft.core.models import load_base
        from ccft.evals.prompting import resolve_prompt_format
        from ccft.evals.protocol import get_task
        from ccft.evals.results import clear_task_folder, stale_settings
        from ccft.evals.runner import EvalMemo, decode_ahead, run_task
        from ccft.evals.settings import EvalSettings, mode_specs, shared_handoff
        from ccft.train.config import METHODS

        cfg, out, spec = self.cfg, self.out, self.cfg.specialists[name]
        if self.base is None:
            self.base = load_base(self.base_name, dtype=self.dtype, device=_device(cfg.device))
        paths = {m: str(self.runs / name / m) for m in METHODS}
        decoders = {m: load_decoder(paths[m], base=self.base) for m in METHODS}
        self.ccft_decoders[name] = paths["ccft"]
        # earlier results are stale when the decoders they were computed with (the stamp next to them) are not
        # these: a sitting killed between training and evaluation leaves new decoders beside old items. A
        # retrained run that came out bit for bit the same (training is deterministic on one machine) keeps
        # its results. A folder without a stamp is taken as it is unless a decoder was retrained now.
        digests = {m: run_digest(paths[m]) for m in METHODS}
        stamped = stamp_matches(out / name, digests)
        fresh = stamped is False or (stamped is None and not all(trained["reused"].values()))
        fmt = resolve_prompt_format("decoder", decoders.values())
        handoff = shared_handoff(decoders.values())
        task_list = spec.task_list()
        self.summaries[name] = []
        records = {}  # per task: mode -> item id -> record (the sweep reuses the points that are eval modes)
        if fresh:  # every result of this specialist goes before the stamp says they are these decoders'
            for t, _, _ in task_list:
                if (out / name / t).is_dir():
                    clear_task_folder(out / name / t)
            for f in ("points.jsonl", "meta.json"):
                (out / name / "sweep" / f).unlink(missing_ok=True)
        write_stamp(out / name, digests)
        memo = EvalMemo()  # humaneval-plus takes humaneval's texts and NLLs (same prompts and references)
        specs = mode_specs(cfg.modes, decoders, paths)
        settings_of = {
            t: EvalSettings(
                limit=limit,
                max_new_tokens=max_new,
                seed=cfg.seed,
                handoff_tokens=handoff,
                prompt_format=fmt,
                engine=True,
            )
            for t, limit, max_new in task_list
        }
        self.settings_of[name] = settings_of
        # a task folder of this study written with other settings (the study config or the task's protocol
        # changed) is the study's own stale output: computed again
        for t, _, _ in task_list:
            diff = {} if fresh else stale_settings(out / name / t, settings_of[t].as_dict(get_task(t)))
            if diff:
                print(
                    f"[ccft study] {name}: {t} was evaluated with other settings {diff} (was, "
                    "now): computing it again",
                    flush=True,
                )
                clear_task_folder(out / name / t)
        # tasks too small to fill the engine's rows alone (MultiPL-E: 10 items per language) decode together
        small = [t for t, limit, _ in task_list if limit is not None and limit < cfg.batch_size]
        with self.phases(f"eval_{name}"):
            for task_name, limit, _ in task_list:
                if task_name == (small[0] if small else None):
                    n = decode_ahead(
                        [(get_task(t), settings_of[t]) for t in small],
                        self.base,
                        specs,
                        out / name,
                        memo=memo,
                        batch_size=cfg.batch_size,
                        overwrite=fresh,
                    )
                    if n:
                        print(
                            f"[ccft study] {name}: {n} generations of {len(small)} small tasks decoded "
                            f"together ({', '.join(small)})",
                            flush=True,
                        )
                print(f"[ccft study] {name}: {task_name} (n={limit})", flush=True)
                res = run_task(
                    get_task(task_name),
                    self.base,
                    specs,
                    out / name,
                    settings=settings_of[task_name],
                    batch_size=cfg.batch_size,
                    n_resamples=cfg.bootstrap,
                    overwrite=fresh,
                    memo=memo,
                )
                self.summaries[name].append(res.summary)
                records[task_name] = {m: {r["id"]: r for r in rs} for m, rs in res.records.items()}
        self.records[name] = records
        return decoders, paths, task_list, records, fresh, fmt

    def sweep(
        self, name: str, decoders: dict, paths: dict, records: dict, *, fresh: bool, prompt_format
    ) -> None:
        """NLL/token against the sharing ratio ρ on the specialist's first task (its eval modes' points
        reused)."""
        from ccft.evals.protocol import get_task
        from ccft.evals.sweep import run_sweep

        cfg = self.cfg
        first = next(iter(cfg.specialists[name].tasks), None)
        if not (first and cfg.sweep_limit):
            return
        with self.phases(f"sweep_{name}"):
            self.sweeps[name] = run_sweep(
                get_task(first),
                self.base,
                {"naive": decoders["full-ft"], "prefillshare": decoders["ccft"]},
                self.out / name / "sweep",
                rhos=cfg.sweep_rhos,
                axes=("positions",),
                limit=cfg.sweep_limit,
                batch_size=cfg.batch_size,
                overwrite=fresh,
                decoder_paths={"naive": paths["full-ft"], "prefillshare": paths["ccft"]},
                n_resamples=cfg.bootstrap,
                prompt_format=prompt_format,
                eval_records=records.get(first),
            )

    def frontier(self, name: str, records: dict) -> None:
        """CCFT decoders of the specialist trained at each sharing depth of ``cfg.frontier`` (its recipe with
        ``share_from_layer: m``, into ``RUNS/NAME/ccft-mM``; reused when finished), each evaluated in mode
        prefillshare on the specialist's tasks with the study's settings (into ``OUT/NAME/frontier/mM``;
        resumed item by item, recomputed when the decoder changed), then the frontier of every task
        (``ccft.evals.study.frontier``) beside the study's full-ft, naive and prefillshare (m = 0) points."""
        from ccft.core.compact import kv_nbytes
        from ccft.evals.study.frontier import choose_depth, frontier_points
        from ccft.inference.engine import kv_bytes_per_token

        fc = self.cfg.frontier
        if fc is None or name not in fc.specialists:
            return
        missing = [m for m in ("full-ft", "naive", "prefillshare") if m not in self.cfg.modes]
        if missing:
            raise ConfigError(
                f"{self.where}: frontier needs the modes full-ft, naive and prefillshare; "
                f"modes lacks {missing}"
            )
        depth_records: dict[int, dict] = {}
        for m in fc.depths:
            folder = self._train_ccft_variant(name, f"m{m}", share_from_layer=m)
            depth_records[m] = self._frontier_eval(
                name, f"m={m}", folder, self.out / name / "frontier" / f"m{m}", None
            )
            # naive sharing at depth m: the study's Full-FT decoder, its own K/V below layer m (no training)
            depth_records[f"naive-m{m}"] = self._frontier_eval(
                name,
                f"naive m={m}",
                self.runs / name / "full-ft",
                self.out / name / "frontier" / f"naive-m{m}",
                None,
                method="full-ft",
                depth=m,
            )
        for (
            fmt
        ) in fc.cache_formats:  # the compact C_base: the study's decoder served on it, one trained on it
            trained_dir = self._train_ccft_variant(name, fmt, cache_format=fmt)
            for label, folder, served_on in (
                (f"prefillshare {fmt} (native-trained)", self.runs / name / "ccft", fmt),
                (f"prefillshare {fmt} ({fmt}-trained)", trained_dir, None),  # its own format
            ):
                key = "served" if served_on else "trained"
                depth_records[f"{fmt}-{key}"] = self._frontier_eval(
                    name, label, folder, self.out / name / "frontier" / f"{fmt}-{key}", served_on
                )
        layers = self.base.model.config.num_hidden_layers
        per_token = kv_bytes_per_token(self.base)  # all layers
        lw = self.base.model.config
        kv_heads = getattr(lw, "num_key_value_heads", None) or lw.num_attention_heads
        head_dim = per_token // (2 * layers * kv_heads * self.base.dtype.itemsize)
        self.frontiers[name] = []
        for task_name in self.cfg.specialists[name].tasks:
            recs = records[task_name]
            points = {
                "full-ft": recs["full-ft"],
                "naive": recs["naive"],
                "prefillshare m=0": recs["prefillshare"],
                **{f"naive m={m}": depth_records[f"naive-m{m}"][task_name] for m in fc.depths},
                **{f"prefillshare m={m}": depth_records[m][task_name] for m in fc.depths},
            }
            ratio = {}
            for fmt in fc.cache_formats:
                points[f"prefillshare {fmt} (native-trained)"] = depth_records[f"{fmt}-served"][task_name]
                points[f"prefillshare {fmt} ({fmt}-trained)"] = depth_records[f"{fmt}-trained"][task_name]
                p_tokens = max(
                    1,
                    round(
                        sum(r.get("prompt_tokens", 0) for r in recs["full-ft"].values())
                        / max(1, len(recs["full-ft"]))
                    ),
                )
                shape = dict(layers=layers, kv_heads=kv_heads, head_dim=head_dim, tokens=p_tokens)
                r = kv_nbytes(fmt, **shape) / kv_nbytes("native", **shape, dtype=self.base.dtype)
                ratio[f"prefillshare {fmt} (native-trained)"] = ratio[
                    f"prefillshare {fmt} ({fmt}-trained)"
                ] = r
            f = frontier_points(
                task_name,
                points,
                metrics=metrics_of(task_name),
                layers=layers,
                bytes_per_layer_token=per_token // layers,
                agents=fc.agents,
                cbase_ratio=ratio,
                n_resamples=self.cfg.bootstrap,
                seed=self.cfg.seed,
            )
            f["choice"] = choose_depth(f, fc.target_retention)
            self.frontiers[name].append(f)

    def _train_ccft_variant(self, name: str, tag: str, **changes) -> Path:
        """The specialist's CCFT decoder from its recipe with ``changes`` (recipe keys) on top, into
        ``RUNS/NAME/ccft-TAG`` (reused when finished; phase ``frontier_NAME_train_TAG``); returns the
        folder."""
        from ccft.train.run import method_config, train_or_reuse

        tc, _, raw = self.parsed[name]
        folder = self.runs / name / f"ccft-{tag}"
        m_cfg, m_raw = method_config(tc, raw, "ccft", folder)
        m_cfg, m_raw = dataclasses.replace(m_cfg, **changes), m_raw | changes
        with self.phases(f"frontier_{name}_train_{tag}"):
            train_or_reuse(m_cfg, m_raw, prefix="[ccft study]")
        gc.collect()
        return folder

    def _frontier_eval(
        self,
        name: str,
        label: str,
        folder,
        res_dir,
        cache_format: str | None,
        *,
        method: str = "ccft",
        depth: int | None = None,
    ) -> dict:
        """The decoder in ``folder`` (``method`` ccft: mode prefillshare; full-ft: mode naive) on the
        specialist's main tasks (not MultiPL-E) with the study's settings, into ``res_dir``; ``cache_format``
        serves it on that C_base format (None: its own); ``depth`` reads it at that sharing depth instead of
        the one it was trained at (naive sharing at depth m: the Full-FT decoder's own K/V below layer m).
        Results of another decoder or depth (stamp) are recomputed. Returns task → item id → record."""
        from ccft.core.checkpoint import load_decoder
        from ccft.evals.protocol import get_task
        from ccft.evals.results import clear_task_folder
        from ccft.evals.runner import EvalMemo, run_task
        from ccft.evals.settings import mode_specs

        dec = load_decoder(str(folder), base=self.base)
        if depth is not None:
            dec = dataclasses.replace(dec, share_from_layer=depth)
        digests = {method: run_digest(folder), **({"share_from_layer": str(depth)} if depth else {})}
        stale = stamp_matches(res_dir, digests) is False
        if stale:
            for t in self.settings_of[name]:
                if (res_dir / t).is_dir():
                    clear_task_folder(res_dir / t)
        write_stamp(res_dir, digests)
        mode = "prefillshare" if method == "ccft" else "naive"
        specs = mode_specs([mode], {method: dec}, {method: str(folder)})
        out: dict = {}
        with self.phases(f"frontier_{name}_eval_{res_dir.name}"):
            for task_name in self.cfg.specialists[name].tasks:
                print(f"[ccft study] {name}: frontier {label}, {task_name}", flush=True)
                settings = self.settings_of[name][task_name]
                if cache_format is not None:
                    settings = dataclasses.replace(settings, cache_format=cache_format)
                res = run_task(
                    get_task(task_name),
                    self.base,
                    specs,
                    res_dir,
                    settings=settings,
                    batch_size=self.cfg.batch_size,
                    n_resamples=self.cfg.bootstrap,
                    overwrite=stale,
                    memo=EvalMemo(),
                )
                out[task_name] = {r["id"]: r for r in res.records[mode]}
        del dec
        gc.collect()
        return out

    def describe(self, name: str, trained: dict, paths: dict, task_list: list) -> None:
        """The specialist's training facts for the report."""
        tc = self.parsed[name][0]
        spec, hist = self.cfg.specialists[name], trained["histories"]
        self.specialists_meta[name] = {
            "recipe": spec.recipe,
            "overrides": spec.train,
            "runs": paths,
            "tasks": [t for t, _, _ in task_list],
            "training": {
                "train_data": tc.train_data,
                "train_rows": trained["rows"]["ccft"],
                "steps": tc.max_steps,
                "learning_rate": tc.learning_rate,
                "batch": tc.per_device_train_batch_size * tc.gradient_accumulation_steps,
                "max_length": tc.max_length,
                "seed": tc.seed,
                "loss_curve": {m: [[x["step"], x["loss"]] for x in hist[m] if "loss" in x] for m in hist},
                "final_loss": {
                    m: next((x["loss"] for x in reversed(hist[m]) if "loss" in x), None) for m in hist
                },
            },
        }

    def write_report(self) -> dict:
        """``OUT/report.json``, ``OUT/README.md`` and the plots from what is finished; returns the report."""
        from ccft.core.io import atomic_write_json, atomic_write_text
        from ccft.core.models import describe_model
        from ccft.evals.report import plot_sweep, plot_task
        from ccft.evals.results import hardware
        from ccft.evals.study.report import build_study_report, study_readme

        out, plots = self.out, {}
        for name, ss in self.summaries.items():
            for s in ss:
                png = out / name / f"{s['task']}.png"
                try:
                    plot_task(s, png)
                    plots[f"{name}/{s['task']}"] = f"{name}/{png.name}"
                except Exception as e:  # plotting must not lose the numbers
                    print(f"[ccft study] plot {png}: {e}", file=sys.stderr)
            if self.sweeps.get(name):
                try:
                    plot_sweep(self.sweeps[name], out / name / "sweep.png")
                    plots[f"{name}/sweep"] = f"{name}/sweep.png"
                except Exception as e:
                    print(f"[ccft study] sweep plot: {e}", file=sys.stderr)
        report = build_study_report(
            self.cfg,
            self.summaries,
            specialists_meta=self.specialists_meta,
            sweeps=self.sweeps,
            serving=self.serving,
            phases=self.phases.data,
            hardware=hardware(),
            model=describe_model(self.base_name),
            records=self.records,
        )
        report["plots"] = plots
        report["complete"] = set(self.summaries) == set(self.cfg.specialists)
        fplots: dict[str, str] = {}
        if self.frontiers:
            from ccft.evals.study.frontier import plot_frontier

            for name, fs in self.frontiers.items():
                for f in fs:
                    png = out / name / "frontier" / f"{f['task']}.png"
                    try:
                        plot_frontier(f, png)
                        fplots[f"{name}/{f['task']}"] = f"{name}/frontier/{png.name}"
                    except Exception as e:  # plotting must not lose the numbers
                        print(f"[ccft study] frontier plot {png}: {e}", file=sys.stderr)
            report["frontier"] = {
                "config": self.cfg.frontier.as_dict(),
                "specialists": self.frontiers,
                "plots": fplots,
            }
        atomic_write_json(out / "report.json", report, default=str)
        notes = out / "SITTINGS.md"  # hand-written notes on each sitting, kept across regenerations
        readme = study_readme(
            report, self.command, notes.read_text(encoding="utf-8") if notes.is_file() else None
        )
        if self.frontiers:
            from ccft.evals.study.frontier import frontier_markdown

            readme = readme.rstrip("\n") + "\n\n" + frontier_markdown(self.frontiers, fplots)
        atomic_write_text(out / "README.md", readme)
        return report


def _device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice
