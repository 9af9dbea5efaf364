"""``CacheConditionedTrainer``: a ``transformers.Trainer`` that overrides only the loss (and eval NLL).

CCFT loss (PrefillShare, arXiv 2602.12029, §3; docs/design.md, "Terms"):

    L(θ_i) = − Σ_t log p_θi(r_t | C_base(prompt[:n−k]), prompt[n−k:], r_<t)

summed over the response tokens and the final EOS and divided by the GLOBAL count of supervised
tokens in the optimizer step (all micro-batches, all processes), so gradient accumulation and data
parallelism do not change it. ``C_base`` is computed by the frozen base under ``torch.no_grad``
(with LoRA decoders: the same weights, adapters disabled) and fed as a read-only cache, which
also keeps it under gradient checkpointing (transformers drops ordinary caches there).
Full-FT: the same loss with the decoder prefilling its own prompt. At sharing depth
m = ``args.share_from_layer`` (issue 35; ``ccft.core.depth``) the decoder reads a hybrid prefix: its own
K/V of ``prompt[:n−k]`` in layers ``0..m−1`` (a partial prefill with gradient) and C_base in ``m..L−1``
(constant, from the store when there is one). With ``args.cache_format`` ``int8`` (issue 35;
``ccft.core.compact``) the decoder reads the compact C_base, quantised and dequantised before the attention
(from the store too), so it learns the cache it will be served; at depth m > 0 only C_base's layers
``m..L−1`` are compact (``ccft.core.depth.decoder_prefix``: one order for every reader).

Everything else (optimizer, schedule, accumulation, logging/``report_to``, evaluation with
``compute_metrics``, checkpoints and their rotation, ``load_best_model_at_end``, resume,
accelerate/DeepSpeed) is the stock Trainer. Hooks overridden, all of them real ``transformers.Trainer``
hooks: ``_set_signature_columns_if_needed`` (the row fields the collator reads), ``compute_loss``,
``training_step`` (the one-pass LoRA gate; ``activation_checkpointing_min_tokens``), ``prediction_step`` /
``evaluation_loop`` (token-weighted eval NLL) and ``_save_checkpoint``: a checkpoint is written into
``OUTPUT_DIR/.staging/checkpoint-N`` and renamed into place (docs/design.md, "Atomic writes"), so a killed run
never leaves a half-written ``checkpoint-N``, while rotation and the best checkpoint refer to the run folder.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import Trainer
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from transformers.utils import logging

from ccft.core.cache import prefill_tensors
from ccft.core.compact import check_cache_format
from ccft.core.decoder import (
    check_share_from_layer,
    decoder_forward,
    full_forward,
    num_layers,
    padding_free_unsupported,
)
from ccft.core.depth import decoder_prefix
from ccft.core.errors import ConfigError
from ccft.core.io import replace_dir
from ccft.core.tokens import IGNORE_INDEX
from ccft.train.data import Collator
from ccft.train.fastpath import gate_for_step, one_pass_forward, resolve_train_path
from ccft.train.loss import (
    NO_LOGITS,
    capture_final_hidden,
    chunked_loss_unsupported,
    chunked_nll,
    lm_head,
    logit_softcap,
)

logger = logging.get_logger(__name__)

#: Where checkpoints are written before they are renamed into ``OUTPUT_DIR/checkpoint-N``.
STAGING_DIR = ".staging"


def response_nll_rows(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token NLL summed per row ``(b,)`` (fp32) and supervised-token count per row ``(b,)``.

    ``logits (b, t, v)`` at position j predict ``labels (b, t)`` at j + 1; ``IGNORE_INDEX`` labels are
    skipped."""
    targets = labels[:, 1:]
    lg = logits[:, :-1].float()
    nll = F.cross_entropy(
        lg.reshape(-1, lg.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(targets.shape)
    return nll.sum(-1), (targets != IGNORE_INDEX).sum(-1)


def response_nll_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token NLL and token count over the batch (``response_nll_rows`` summed)."""
    nll, count = response_nll_rows(logits, labels)
    return nll.sum(), count.sum()


def freeze_input_embeddings(model) -> list[str]:
    """Freeze the input embedding matrix of a full-weight decoder (``requires_grad=False``); returns the names
    of the parameters frozen. With tied embeddings (SmolLM2) this one matrix is also the LM head's weight.

    A trained embedding costs a dense ``(v, h)`` gradient and optimizer update every step although a
    batch touches a few hundred of its rows (the ``freeze_embeddings`` recipe key, docs/training.md)."""
    emb = model.get_input_embeddings()
    frozen = []
    for name, p in model.named_parameters():
        if any(p is q for q in emb.parameters()) and p.requires_grad:
            p.requires_grad_(False)
            frozen.append(name)
    return frozen


@contextlib.contextmanager
def checkpointing_off(model: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """Run the enclosed forward and backward without activation checkpointing, then restore each module's
    ``gradient_checkpointing`` flag as it was (``transformers``' per-layer flags, ``every_n_layers``
    included).

    Checkpointing recomputes a layer's forward in the backward with the same inputs and kernels, so a step
    gives the same loss and gradients either way; only the memory held between forward and backward (and the
    recompute time) differ."""
    flagged = (
        [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True] if enabled else []
    )
    for m in flagged:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in flagged:
            m.gradient_checkpointing = True


class CacheConditionedTrainer(Trainer):
    """Trainer for CCFT and Full-FT decoders.

    Args:
        model: the decoder's trainable module (``Decoder.model``: ``PeftModel`` or full-weight copy).
        args: ``ccft.TrainConfig``; ``args.method`` picks ccft or full-ft.
        base: the frozen ``ccft.Base`` that computes C_base (unused by full-ft).
        cache_store: optional ``ccft.train.cache_store.CacheStore`` holding precomputed C_base for the rows
            (``ccft precompute``); rows it lacks are prefilled as usual.
        train_dataset / eval_dataset: ``ccft.train.data.TokenizedDataset`` (or a ``datasets.Dataset`` with the
            ``Collator.features`` columns); data_collator: ``ccft.train.data.Collator``.
    Paths (``args.train_path``, resolved into ``self.train_path``; see ``ccft.train.fastpath``): CCFT runs
    ``two-pass`` (no-grad base prefill, then the decoder on the tail) or, LoRA only, ``one-pass``
    (one forward, LoRA gated off on the prefix); Full-FT runs ``self-prefill``, its rows packed into one
    sequence without pads when ``args.padding_free`` and the model qualifies (``self.packs_full_ft``; why not:
    ``self.padding_free_reason``, from ``ccft.core.decoder.padding_free_unsupported``).
    Loss (``self.loss_path``): ``chunked`` (``args.loss_chunk_tokens`` > 0 and the model qualifies,
    ``ccft.train.loss``: the LM head and cross-entropy over the supervised tokens, that many at a time, no
    full-vocabulary logits; the tail's logits are still computed where they are returned: ``return_outputs``,
    ``compute_metrics``) or ``full-logits`` (``response_nll_rows`` over the tail's logits); why not chunked:
    ``self.loss_unchunked_reason``. Full-weight decoders get their input embedding frozen when
    ``args.freeze_embeddings`` (default; ``self.frozen_embeddings`` names what was frozen).
    Supports: LoRA and full weights, gradient accumulation, gradient checkpointing, eval NLL with
    ``compute_metrics``, ``load_best_model_at_end`` with ``save_total_limit``,
    ``report_to`` (wandb/tensorboard), resume from checkpoint, accelerate/DeepSpeed launches.
    Raises:
        CacheMutatedError: if anything wrote into C_base during a step.
    """

    # compute_loss divides by the global supervised-token count itself.
    loss_is_scaled_for_ga = True

    def __init__(self, *args, base=None, cache_store=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.base = base
        self.cache_store = cache_store
        self.method = getattr(self.args, "method", "ccft")
        if self.method == "ccft" and base is None:
            raise ValueError(
                "method='ccft' needs the frozen base: CacheConditionedTrainer(..., base=ccft.load_base(...))"
            )
        from peft import PeftModel

        self._decoder_kind = "lora" if isinstance(self.model, PeftModel) else "full"
        self.share_from_layer = int(getattr(self.args, "share_from_layer", 0) or 0)
        if self.share_from_layer and self.method != "ccft":
            raise ConfigError(
                f"share_from_layer={self.share_from_layer} applies to method=ccft only; method={self.method} "
                "prefills the whole prompt itself"
            )
        check_share_from_layer(self.share_from_layer, num_layers(self.model))
        self.cache_format = check_cache_format(getattr(self.args, "cache_format", "native") or "native")
        if self.cache_format != "native" and self.method != "ccft":
            raise ConfigError(
                f"cache_format={self.cache_format} applies to method=ccft only; method={self.method} reads "
                "no C_base"
            )
        if cache_store is not None:  # an int8 store cannot serve a run on the native C_base (ConfigError)
            cache_store.check_format(self.cache_format)
        self.train_path = resolve_train_path(
            getattr(self.args, "train_path", "auto"),
            method=self.method,
            decoder_kind=self._decoder_kind,
            model=self.model,
            share_from_layer=self.share_from_layer,
            cache_format=self.cache_format,
        )
        self._gate = None  # the LoRA token gate of the running one-pass step
        self.frozen_embeddings: list[str] = []
        if self._decoder_kind == "full" and getattr(self.args, "freeze_embeddings", True):
            self.frozen_embeddings = freeze_input_embeddings(self.model)
        chunk = int(getattr(self.args, "loss_chunk_tokens", 0) or 0)
        self.loss_unchunked_reason = (
            "loss_chunk_tokens=0" if chunk <= 0 else chunked_loss_unsupported(self.model)
        )
        self.loss_path = "full-logits" if self.loss_unchunked_reason else "chunked"
        self.padding_free_reason = padding_free_unsupported(self.model) if self.method == "full-ft" else None
        if self.padding_free_reason and getattr(self.args, "padding_free", False):
            logger.warning("padding_free: Full-FT runs the padded layout: %s", self.padding_free_reason)
        if base is not None and self.method == "ccft" and self.is_deepspeed_enabled:
            from ccft.train.distributed import place_frozen_base

            place_frozen_base(base, self.accelerator, decoder_kind=self._decoder_kind)
        # Count supervised tokens over labels[:, 1:] for every micro-batch of the step (our loss shifts
        # labels).
        self.model_accepts_loss_kwargs = True
        self._loss_shifts_labels = True
        self.last_base_cache = None  # the C_base of the latest step (tests check it is unchanged)
        self._eval_totals = torch.zeros(
            2, dtype=torch.float64
        )  # eval NLL and supervised tokens (evaluation_loop)

    def _set_signature_columns_if_needed(self):
        """Keep the row fields ``ccft.train.data.Collator`` reads (``remove_unused_columns``).

        The stock hook keeps the model's ``forward`` arguments (``input_ids``, ...), which would strip a
        ``datasets.Dataset`` of tokenised rows down to nothing the collator can use."""
        if self._signature_columns is None:
            self._signature_columns = list(Collator.features)

    def _base_cache(self, inputs):
        if self.cache_store is not None:
            cache = self.cache_store.batch_cache(
                inputs["prefix_ids"],
                inputs["prefix_mask"],
                inputs["tail_ids"][:, : self.args.handoff_tokens],
                base=self.base,
            )
            if cache is not None:
                return cache
        # A full-weight decoder's base is a separate, frozen copy: run it in inference mode (its K/V
        # become inference tensors, which torch itself refuses to modify in place).
        mode = torch.inference_mode() if self._decoder_kind == "full" else torch.no_grad()
        with self.base.base_weights() as model, mode:
            return prefill_tensors(
                model,
                inputs["prefix_ids"],
                inputs["prefix_mask"],
                inputs["tail_ids"][:, : self.args.handoff_tokens],
                handoff_tokens=self.args.handoff_tokens,
                fingerprint=self.base.fingerprint,
            )

    def tail_logits(self, model, inputs, *, logits_to_keep: int | torch.Tensor | None = None) -> torch.Tensor:
        """Decoder logits over the tail ``(b, t, v)`` for this trainer's method (``logits_to_keep``: default
        all t tail positions; an empty index tensor projects none)."""
        if self.method == "ccft" and self.train_path == "one-pass":
            self.last_base_cache = None  # C_base is never materialised: the prefix runs inside the forward
            return one_pass_forward(
                model,
                inputs["prefix_ids"],
                inputs["prefix_mask"],
                inputs["tail_ids"],
                inputs["tail_mask"],
                gate=self._gate,
                logits_to_keep=logits_to_keep,
            )
        if self.method == "ccft":
            cache = self._base_cache(inputs)
            self.last_base_cache = cache
            # C_base in the recipe's format, then the decoder's own prompt K/V (with gradient) below layer m
            cache = decoder_prefix(
                model,
                cache,
                inputs["prefix_ids"],
                inputs["prefix_mask"],
                share_from_layer=self.share_from_layer,
                cache_format=self.cache_format,
            )
            return decoder_forward(
                model,
                cache,
                inputs["tail_ids"],
                inputs["tail_mask"],
                logits_to_keep=0 if logits_to_keep is None else logits_to_keep,
            )
        return full_forward(
            model,
            inputs["prefix_ids"],
            inputs["prefix_mask"],
            inputs["tail_ids"],
            inputs["tail_mask"],
            logits_to_keep=logits_to_keep,
            packed=self.packs_full_ft,
        )

    def response_nll(
        self, model, inputs, *, logits: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(nll_sum (), nll_rows (b,), count_rows (b,), logits (b, t, v) or None)`` of a batch, the NLL over
        its supervised tokens. On the ``chunked`` loss path the LM head projects no position in the forward
        (unless ``logits`` are asked for) and the NLL comes from the final hidden states
        (``ccft.train.loss.chunked_nll``), so its value does not depend on ``logits``."""
        labels = inputs["labels"]
        if self.loss_path != "chunked":
            out = self.tail_logits(model, inputs)
            nll_rows, count_rows = response_nll_rows(out, labels)
            return nll_rows.sum(), nll_rows, count_rows, out
        t = inputs["tail_ids"].shape[1]
        keep = None if logits else NO_LOGITS.to(inputs["tail_ids"].device)
        with capture_final_hidden(model) as captured:
            out = self.tail_logits(model, inputs, logits_to_keep=keep)
        hidden = captured["hidden"][:, -t:]
        total, nll_rows, count_rows = chunked_nll(
            hidden, labels, lm_head(model), self.args.loss_chunk_tokens, logit_softcap(model)
        )
        return total, nll_rows, count_rows, out if logits else None

    @property
    def packs_full_ft(self) -> bool:
        """Whether Full-FT batches run packed (``args.padding_free`` and no ``self.padding_free_reason``)."""
        return (
            self.method == "full-ft"
            and bool(getattr(self.args, "padding_free", False))
            and self.padding_free_reason is None
        )

    def grad_tokens(self, inputs) -> int:
        """Token positions the decoder's forward runs with gradient for a collated batch: the tail
        (rows × padded length) on the two-pass CCFT path; the prompt and the tail otherwise (one-pass and
        Full-FT run the whole sequence in one forward; at sharing depth m > 0 the prompt runs m layers with
        gradient), their real tokens only with Full-FT's ``padding_free``."""
        tail = inputs["tail_ids"].numel()
        if self.method == "ccft" and self.train_path != "one-pass" and not self.share_from_layer:
            return tail
        if self.packs_full_ft:  # only the real tokens run
            return int(inputs["prefix_mask"].sum() + inputs["tail_mask"].sum())
        return tail + inputs["prefix_ids"].numel()

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The stock step; on the one-pass path the LoRA token gate stays on through the backward
        (gradient checkpointing recomputes the gated forward there). With
        ``activation_checkpointing_min_tokens`` a batch below that many ``grad_tokens`` runs with
        checkpointing off (``checkpointing_off``)."""
        one_pass = self.method == "ccft" and self.train_path == "one-pass"
        low = int(getattr(self.args, "activation_checkpointing_min_tokens", 0) or 0)
        skip = bool(low) and self.grad_tokens(inputs) < low
        unwrapped = self.accelerator.unwrap_model(model)
        with gate_for_step(unwrapped, one_pass) as gate, checkpointing_off(unwrapped, skip):
            self._gate = gate
            try:
                return super().training_step(model, inputs, num_items_in_batch)
            finally:
                self._gate = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        nll, _, count_rows, logits = self.response_nll(model, inputs, logits=return_outputs)
        count = count_rows.sum()
        if count.item() == 0:
            raise ValueError(
                "a training batch has no supervised tokens; every row needs a non-empty response"
            )
        if num_items_in_batch is None:
            loss = nll / count
        else:
            loss = nll / num_items_in_batch
            if self.args.average_tokens_across_devices and self.accelerator.num_processes > 1:
                loss = loss * self.accelerator.num_processes  # DDP averages gradients over processes
        return (loss, {"logits": logits}) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """One eval batch: ``(loss, logits (b, t, v), labels (b, t))`` over the tail, the loss being the
        batch's response NLL per supervised token; logits and labels only when ``compute_metrics`` needs them
        (the logit at j predicts ``labels[:, j + 1]``, the causal-LM convention of ``EvalPrediction``).
        The rows' summed NLL and token counts (gathered from all processes) are added to the totals
        ``evaluation_loop`` reports."""
        inputs = self._prepare_inputs(inputs)
        one_pass = self.method == "ccft" and self.train_path == "one-pass"
        need_logits = not prediction_loss_only and self.compute_metrics is not None
        with torch.no_grad(), gate_for_step(self.accelerator.unwrap_model(model), one_pass) as gate:
            self._gate = gate
            try:
                _, nll, count, logits = self.response_nll(model, inputs, logits=need_logits)
            finally:
                self._gate = None
        # Per row, so that the rows accelerate repeats to even out the last batch across processes drop out.
        rows = self.accelerator.gather_for_metrics(torch.stack([nll.double(), count.double()], dim=-1))
        self._eval_totals += rows.sum(0)
        loss = (nll.sum() / count.sum().clamp(min=1)).detach()
        if not need_logits:
            return loss, None, None
        return loss, logits.detach(), inputs["labels"]

    def evaluation_loop(
        self,
        dataloader,
        description,
        prediction_loss_only=None,
        ignore_keys=None,
        metric_key_prefix: str = "eval",
    ):
        """The stock loop (``compute_metrics``, ``preprocess_logits_for_metrics``, gathering), with
        ``{prefix}_loss`` replaced by the held-out response NLL per supervised token, token-weighted over the
        whole set and all processes, and ``{prefix}_tokens``, the supervised-token count."""
        self._eval_totals = torch.zeros(2, dtype=torch.float64, device=self.args.device)
        output = super().evaluation_loop(
            dataloader,
            description,
            prediction_loss_only=prediction_loss_only,
            ignore_keys=ignore_keys,
            metric_key_prefix=metric_key_prefix,
        )
        total, count = self._eval_totals
        metrics = dict(output.metrics)
        metrics[f"{metric_key_prefix}_loss"] = float(total / count.clamp(min=1))
        metrics[f"{metric_key_prefix}_tokens"] = int(count)
        return output._replace(metrics=metrics)

    def _save_checkpoint(self, model, trial):
        """Write ``checkpoint-N`` with the stock method into ``RUN_DIR/.staging``, then rename it into place.

        The stock method is pointed at the staging folder; afterwards the best checkpoint it found
        there is pointed back at the run folder (in the state and the staged ``trainer_state.json``),
        the folder replaces any ``RUN_DIR/checkpoint-N`` (``ccft.core.io.replace_dir``), and the stock
        rotation runs on the run folder, so ``save_total_limit`` and ``load_best_model_at_end`` keep the
        best checkpoint. Every process takes part (a barrier before and after the rename)."""
        run_dir = Path(self._get_output_dir(trial=trial))
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging = run_dir / STAGING_DIR
        if self.args.should_save:  # leftovers of a killed save
            shutil.rmtree(staging, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        real_get = self._get_output_dir
        self._get_output_dir = lambda trial=None: str(staging)  # type: ignore[method-assign]
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._get_output_dir = real_get  # type: ignore[method-assign]
        best = self.state.best_model_checkpoint
        if best is not None and Path(best).parent == staging:
            self.state.best_model_checkpoint = str(run_dir / Path(best).name)
            if self.args.should_save:
                self.state.save_to_json(str(staging / name / TRAINER_STATE_NAME))
        self.accelerator.wait_for_everyone()  # every process has written its part (RNG state, shards)
        if self.args.should_save:
            replace_dir(staging / name, run_dir / name)
            shutil.rmtree(staging, ignore_errors=True)
            rotate_checkpoints(
                output_dir=str(run_dir),
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )
        self.accelerator.wait_for_everyone()
