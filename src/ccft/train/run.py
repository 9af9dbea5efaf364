"""The training recipe: setup -> train -> save, one function per phase (torchtune style).

``run_training(cfg)`` is what ``ccft train RECIPE.yaml`` runs:
  setup   seed -> base (frozen) -> decoder (LoRA or full) -> data (train/eval) -> trainer
  train   ``CacheConditionedTrainer.train``, resuming from the newest complete ``checkpoint-N``
  save    final decoder + ``ccft.json`` into ``cfg.output_dir`` (checkpoints kept beside it)
Raises ConfigError / DataError before the base is loaded when the recipe or data is bad.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import set_seed
from transformers.trainer_utils import get_last_checkpoint

from ccft.core.checkpoint import RECIPE_STAMP, save_decoder
from ccft.core.decoder import Decoder, check_share_from_layer, make_decoder, num_layers, resolve_lora_targets
from ccft.core.errors import ConfigError
from ccft.core.io import atomic_write_text
from ccft.core.models import Base, load_base
from ccft.core.tokens import pad_token_id
from ccft.train.config import TrainConfig, resolve_data
from ccft.train.data import Collator, TokenizedDataset, build_dataset
from ccft.train.trainer import CacheConditionedTrainer


@dataclass
class TrainResult:
    """What a run produced: the decoder, its folder, the loss curve and timing."""

    decoder: Decoder
    output_dir: Path
    log_history: list[dict]
    train_rows: int
    dropped_too_long: int
    seconds: float
    trainer: Any = None
    extra: dict = field(default_factory=dict)

    @property
    def loss_curve(self) -> list[tuple[int, float]]:
        return [(h["step"], h["loss"]) for h in self.log_history if "loss" in h]

    @property
    def eval_curve(self) -> list[tuple[int, float]]:
        return [(h["step"], h["eval_loss"]) for h in self.log_history if "eval_loss" in h]


def load_split(spec: str, tokenizer, cfg: TrainConfig, rows: int | None, offset: int = 0) -> TokenizedDataset:
    """Tokenise ``rows`` rows of a data spec (built-in ``name:split`` or a file) for this config."""
    path, columns = resolve_data(spec, cfg.columns)
    return build_dataset(
        path,
        tokenizer,
        max_length=cfg.max_length,
        handoff_tokens=cfg.handoff_tokens,
        chat_template=cfg.chat_template_flag,
        system_prompt=cfg.system_prompt,
        columns=columns,
        limit=rows,
        offset=offset,
    )


def load_tokenizer(name_or_path: str):
    """The base's tokenizer, loaded before any weights. Raises ConfigError naming the base when it cannot
    load."""
    from transformers import AutoTokenizer

    from ccft.core.models import resolve_model_path

    path = resolve_model_path(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError, UnicodeDecodeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"base {name_or_path!r}: its tokenizer cannot be loaded from {path} ({first})"
        ) from None


def check_depth(cfg: TrainConfig, where: str = "share_from_layer") -> None:
    """Refuse a ``share_from_layer`` above the base's layer count, from its ``config.json`` (no weights load).

    Raises:
        ConfigError: naming the key, the base's layer count and the range (``check_share_from_layer``).
    """
    if not cfg.share_from_layer:
        return
    from transformers import AutoConfig

    from ccft.core.models import resolve_model_path

    try:
        config = AutoConfig.from_pretrained(resolve_model_path(cfg.base))
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"base {cfg.base!r}: its config cannot be loaded ({first})") from None
    check_share_from_layer(cfg.share_from_layer, num_layers(config), where=where)


def check_run(cfg: TrainConfig, *, store: bool = True) -> tuple[TokenizedDataset, TokenizedDataset | None]:
    """Everything ``--dry-run`` checks without loading weights: the base's tokenizer, the train and eval data
    (``FILE:LINE`` for a bad row), the output folder and the C_base store (``ccft.train.config.check_paths``;
    an existing store's manifest, unless ``store=False``: ``ccft precompute`` rebuilds it). Returns the
    tokenised (train, eval) sets.

    Raises:
        ConfigError, DataError, StoreError: the first problem found, with the file (and line) it is in.
    """
    from ccft.train.cache_store import MANIFEST, CacheStore
    from ccft.train.config import check_paths

    check_paths(cfg)
    tokenizer = load_tokenizer(cfg.base)
    check_depth(cfg)
    train_set = load_split(cfg.train_data, tokenizer, cfg, cfg.train_rows, cfg.data_offset)
    eval_set = load_split(cfg.eval_data, tokenizer, cfg, cfg.eval_rows) if cfg.eval_data else None
    folder = Path(cfg.base_cache_store) if cfg.base_cache_store and store else None
    if folder is not None and (folder / MANIFEST).exists():
        # a manifest that does not parse is a StoreError here, not a traceback in training; an int8 store
        # given to a run on the native C_base a ConfigError
        CacheStore(folder).check_format(cfg.cache_format)
    return train_set, eval_set


def setup(cfg: TrainConfig, *, base: Base | None = None):
    """Build (base, decoder, train set, eval set, trainer) for ``cfg``. The data is checked before the base
    loads."""
    set_seed(cfg.seed)
    if base is None:
        # Tokenise with the base's tokenizer before loading weights, so bad data fails fast.
        tokenizer = load_tokenizer(cfg.base)
    else:
        tokenizer = base.tokenizer
    if base is None:
        check_depth(cfg)
    else:
        check_share_from_layer(cfg.share_from_layer, num_layers(base))
    train_set = load_split(cfg.train_data, tokenizer, cfg, cfg.train_rows, cfg.data_offset)
    eval_set = load_split(cfg.eval_data, tokenizer, cfg, cfg.eval_rows) if cfg.eval_data else None
    if base is None:
        base = load_base(cfg.base, dtype=cfg.dtype)
    set_seed(cfg.seed)  # same decoder init whatever was loaded before
    # ccft's default list (every attention and MLP projection) by the base family's module names (phi3:
    # fused qkv_proj, gate_up_proj; ccft.core.decoder.default_lora_targets); any other list is kept as given
    targets = resolve_lora_targets(base.model, list(cfg.lora_target_modules))
    lora = {
        "r": cfg.lora_r,
        "lora_alpha": cfg.lora_alpha,
        "lora_dropout": cfg.lora_dropout,
        "target_modules": targets,
    }
    if cfg.decoder_kind == "lora":
        names = [n for n, _ in base.model.named_modules()]
        missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
        if missing:
            leaves = sorted({n.rsplit(".", 1)[-1] for n in names if n and not n.rsplit(".", 1)[-1].isdigit()})
            raise ConfigError(
                f"lora_target_modules {missing} match no module of base {cfg.base}; "
                f"its module names include {leaves[:12]}"
            )
    decoder = make_decoder(
        base,
        cfg.decoder_kind,
        lora=lora,
        method=cfg.method,
        handoff_tokens=cfg.handoff_tokens,
        share_from_layer=cfg.share_from_layer,
        cache_format=cfg.cache_format,
    )
    store = None
    if cfg.base_cache_store and cfg.method == "ccft":
        from ccft.train.cache_store import open_store_for_training

        with cfg.main_process_first(desc="C_base store"):  # one writer; the other processes then reuse it
            store = open_store_for_training(
                cfg.base_cache_store,
                base,
                train_set,
                handoff_tokens=cfg.handoff_tokens,
                eval_set=eval_set,
                cache_format=cfg.cache_format,
            )
    collator = Collator(pad_token_id(base.tokenizer), cfg.handoff_tokens)
    trainer = CacheConditionedTrainer(
        model=decoder.model,
        args=cfg,
        base=base,
        train_dataset=train_set,
        eval_dataset=eval_set,
        data_collator=collator,
        cache_store=store,
    )
    return base, decoder, train_set, eval_set, trainer


def check_process_group(trainer) -> None:
    """Refuse a multi-process launch whose processes did not join one group (they would each train alone)."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1 and trainer.accelerator.num_processes != world:
        raise ConfigError(
            f"launched {world} processes but accelerate formed a group of "
            f"{trainer.accelerator.num_processes}; on a machine without GPUs set use_cpu=true "
            "(`ccft train --num-processes N` does this for you)"
        )


def recorded_recipe(out: str | os.PathLike) -> dict | None:
    """The recipe the run in folder ``out`` was started with (``ccft-recipe.json``, else a finished run's
    ``ccft.json``), or None when the folder records none (nothing trained there, or checkpoints written before
    the stamp existed)."""
    out = Path(out)
    if (out / RECIPE_STAMP).is_file():
        return json.loads((out / RECIPE_STAMP).read_text())
    if (out / "ccft.json").is_file():
        from ccft.core.checkpoint import read_meta

        return read_meta(out).get("recipe") or None
    return None


def check_resumable_run(out: str | os.PathLike, recipe: dict) -> None:
    """Refuse to resume checkpoints in ``out`` that another recipe trained (they would carry its weights,
    optimizer and step count into this run: a changed learning rate or step count silently not applied).

    Raises:
        ConfigError: naming the keys that differ (was, now) and the way out.
    """
    recorded = recorded_recipe(out)
    recipe = json.loads(json.dumps(recipe, default=str))  # as recorded
    if recorded is None or recorded == recipe or not get_last_checkpoint(str(out)):
        return
    diff = {
        k: (recorded.get(k), recipe.get(k))
        for k in sorted(set(recorded) | set(recipe))
        if recorded.get(k) != recipe.get(k)
    }
    raise ConfigError(
        f"{out} holds checkpoints of a run with another recipe {diff} (was, now): resuming would "
        "continue that run. Delete the folder (or its checkpoint-* folders) to train this recipe "
        "from the start, set output_dir to another folder, or pass --no-resume (ccft train)"
    )


def run_training(
    cfg: TrainConfig, *, recipe: dict | None = None, base: Base | None = None, resume: bool = True
) -> TrainResult:
    """Set up, train (resuming from the newest complete checkpoint when ``resume``) and save a decoder.

    With ``recipe`` (the parsed recipe, as ``ccft train`` and the study pass it), checkpoints another recipe
    trained are refused before any work (``check_resumable_run``) and the recipe is recorded in
    ``output_dir/ccft-recipe.json`` for the next resume. Nothing is written to ``output_dir`` before the
    data, the base and the decoder are set up: a run that fails to start leaves the folder as it was.

    Raises:
        ConfigError: checkpoints in ``output_dir`` from another recipe (``resume``), or a bad config.
    """
    start = time.time()
    out = Path(cfg.output_dir)
    if recipe is not None and resume and out.is_dir():
        check_resumable_run(out, recipe)
    # every input is checked (recipe, data rows, base, LoRA targets, store) before the first write to
    # output_dir
    base, decoder, train_set, eval_set, trainer = setup(cfg, base=base)
    check_process_group(trainer)
    if recipe is not None:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / RECIPE_STAMP, json.dumps(recipe, indent=2, default=str))
    last = get_last_checkpoint(str(out)) if resume and out.is_dir() else None
    if last:
        print(f"[ccft] resuming from {last}", flush=True)
    trainer.train(resume_from_checkpoint=last)
    history = list(trainer.state.log_history)
    data_meta = {
        "train_data": cfg.train_data,
        "train_rows": len(train_set),
        "data_offset": cfg.data_offset,
        "dropped_too_long": train_set.dropped_too_long,
        "max_length": cfg.max_length,
        "supervised_tokens": train_set.supervised_tokens,
        "eval_data": cfg.eval_data,
        "eval_rows": len(eval_set) if eval_set else 0,
    }
    acc = trainer.accelerator
    acc.wait_for_everyone()
    state_dict = None
    from ccft.train.distributed import zero_stage

    if zero_stage(acc) == 3:  # gather the partitioned decoder (a collective: every process takes part)
        state_dict = acc.get_state_dict(trainer.model_wrapped)
    if acc.is_main_process:  # one writer per run folder under accelerate / DeepSpeed launches
        save_decoder(
            decoder,
            out,
            state_dict=state_dict,
            data=data_meta,
            recipe=recipe or {},
            steps=trainer.state.global_step,
            seed=cfg.seed,
            train_path=trainer.train_path,
            distributed={
                "num_processes": acc.num_processes,
                "type": str(acc.distributed_type).split(".")[-1],
            },
        )
        atomic_write_text(out / "log_history.json", json.dumps(history, indent=2))
        from ccft.core.checkpoint import read_meta
        from ccft.train.card import write_model_card

        write_model_card(out, read_meta(out))  # README.md: Hub model card from ccft.json
    acc.wait_for_everyone()
    return TrainResult(
        decoder=decoder,
        output_dir=out,
        log_history=history,
        train_rows=len(train_set),
        dropped_too_long=train_set.dropped_too_long,
        seconds=time.time() - start,
        trainer=trainer,
    )


def method_config(
    cfg: TrainConfig, raw: dict, method: str, output_dir: str | os.PathLike
) -> tuple[TrainConfig, dict]:
    """``cfg`` (parsed from the recipe ``raw``) with ``method`` and ``output_dir`` set, and the recipe
    recorded for that run (``raw`` with the same two keys, without its ``eval:`` section).

    The keys the recipe sets are kept as given; everything else takes ``TrainConfig``'s defaults, so the
    two methods of a comparison (``ccft``, ``full-ft``) differ only in ``method`` and ``output_dir`` (and
    ``share_from_layer`` and ``cache_format``, CCFT keys that the Full-FT run leaves out).
    """
    import dataclasses

    given = {
        f.name: getattr(cfg, f.name) for f in dataclasses.fields(TrainConfig) if f.init and f.name in raw
    }
    # CCFT-only keys (sharing depth, C_base format)
    drop = {"eval"} | ({"share_from_layer", "cache_format"} if method != "ccft" else set())
    given = {k: v for k, v in given.items() if k not in drop}
    m_cfg = TrainConfig(**{**given, "method": method, "output_dir": str(output_dir)})
    m_raw = {k: v for k, v in raw.items() if k not in drop} | {
        "method": method,
        "output_dir": str(output_dir),
    }
    return m_cfg, m_raw


def train_or_reuse(cfg: TrainConfig, raw: dict, *, prefix: str = "[ccft]") -> tuple[list[dict], int, bool]:
    """(log history, train rows, reused) of the decoder ``cfg`` describes.

    A finished run (``cfg.output_dir/ccft.json`` recording the same recipe ``raw`` and ``cfg.max_steps``) is
    reused; anything else trains, resuming from the newest complete checkpoint (``run_training``).
    """
    from ccft.core.checkpoint import read_meta

    out = Path(cfg.output_dir)
    if (out / "ccft.json").is_file():
        meta = read_meta(out)
        if meta.get("recipe") == raw and meta.get("steps") == cfg.max_steps:
            print(f"{prefix} reusing finished run {out}", flush=True)
            history = json.loads((out / "log_history.json").read_text())
            return history, meta["data"]["train_rows"], True
    result = run_training(cfg, recipe=raw)
    return result.log_history, result.train_rows, False
