"""``CacheConditionedTrainer``: a ``transformers.Trainer`` that overrides only the loss (and eval NLL).

CCFT loss (PrefillShare, arXiv 2602.12029, §3; docs/design.md, "Terms"):

    L(θ_i) = − Σ_t log p_θi(r_t | C_base(prompt[:n−k]), prompt[n−k:], r_<t)

summed over the response tokens and the final EOS and divided by the GLOBAL count of supervised
tokens in the optimizer step (all micro-batches, all processes), so gradient accumulation and data
parallelism do not change it. ``C_base`` is computed by the frozen base under ``torch.no_grad``
(with LoRA decoders: the same weights, adapters disabled) and fed as a read-only cache, which
also keeps it under gradient checkpointing (transformers drops ordinary caches there).
Full-FT: the same loss with the decoder prefilling its own prompt.

Everything else (optimizer, schedule, accumulation, logging/``report_to``, checkpoints, resume,
accelerate/DeepSpeed) is the stock Trainer. Checkpoints are written into a temporary folder and
renamed into place, so a killed run never leaves a half-written ``checkpoint-N``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ccft.core.cache import prefill_tensors
from ccft.core.decoder import decoder_forward, full_forward
from ccft.core.tokens import IGNORE_INDEX
from ccft.train.fastpath import gate_for_step, one_pass_forward, resolve_train_path


def response_nll_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token NLL and token count. ``logits (b, t, v)`` at j predict ``labels (b, t)`` at j+1."""
    targets = labels[:, 1:]
    lg = logits[:, :-1].float()
    nll = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                          reduction="sum")
    return nll, (targets != IGNORE_INDEX).sum()


class CacheConditionedTrainer(Trainer):
    """Trainer for CCFT and Full-FT decoders.

    Args:
        model: the decoder's trainable module (``Decoder.model``: ``PeftModel`` or full-weight copy).
        args: ``ccft.TrainConfig``; ``args.method`` picks ccft or full-ft.
        base: the frozen ``ccft.Base`` that computes C_base (unused by full-ft).
        cache_store: optional ``ccft.cache_store.CacheStore`` holding precomputed C_base for the rows
            (``ccft precompute``); rows it lacks are prefilled as usual.
        train_dataset / eval_dataset: ``ccft.data.TokenizedDataset``; data_collator: ``ccft.data.Collator``.
    Paths (``args.train_path``, resolved into ``self.train_path``; see ``ccft.fastpath``): CCFT runs
    ``two-pass`` (no-grad base prefill, then the decoder on the tail) or, LoRA only, ``one-pass``
    (one forward, LoRA gated off on the prefix); Full-FT runs ``self-prefill``.
    Supports: LoRA and full weights, gradient accumulation, gradient checkpointing, eval NLL,
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
            raise ValueError("method='ccft' needs the frozen base: CacheConditionedTrainer(..., base=ccft.load_base(...))")
        from peft import PeftModel

        self._decoder_kind = "lora" if isinstance(self.model, PeftModel) else "full"
        self.train_path = resolve_train_path(getattr(self.args, "train_path", "auto"), method=self.method,
                                             decoder_kind=self._decoder_kind, model=self.model)
        self._gate = None  # the LoRA token gate of the running one-pass step
        if base is not None and self.method == "ccft" and self.is_deepspeed_enabled:
            from ccft.train.distributed import place_frozen_base

            place_frozen_base(base, self.accelerator, decoder_kind=self._decoder_kind)
        # Count supervised tokens over labels[:, 1:] for every micro-batch of the step (our loss shifts labels).
        self.model_accepts_loss_kwargs = True
        self._loss_shifts_labels = True
        self.last_base_cache = None  # the C_base of the latest step (tests check it is unchanged)

    def _signature_columns_if_needed(self):  # keep every collator key
        self._signature_columns = ["prefix_ids", "prefix_mask", "tail_ids", "tail_mask", "labels",
                                   "num_supervised"]

    def _base_cache(self, inputs):
        if self.cache_store is not None:
            cache = self.cache_store.batch_cache(inputs["prefix_ids"], inputs["prefix_mask"],
                                                 inputs["tail_ids"][:, : self.args.handoff_tokens], base=self.base)
            if cache is not None:
                return cache
        # A full-weight decoder's base is a separate, frozen copy: run it in inference mode (its K/V
        # become inference tensors, which torch itself refuses to modify in place).
        mode = torch.inference_mode() if self._decoder_kind == "full" else torch.no_grad()
        with self.base.base_weights() as model, mode:
            return prefill_tensors(model, inputs["prefix_ids"], inputs["prefix_mask"], inputs["tail_ids"][:, : self.args.handoff_tokens],
                                    handoff_tokens=self.args.handoff_tokens, fingerprint=self.base.fingerprint)

    def tail_logits(self, model, inputs) -> torch.Tensor:
        """Decoder logits over the tail ``(b, t, v)`` for this trainer's method."""
        if self.method == "ccft" and self.train_path == "one-pass":
            self.last_base_cache = None  # C_base is never materialised: the prefix runs inside the forward
            return one_pass_forward(model, inputs["prefix_ids"], inputs["prefix_mask"], inputs["tail_ids"],
                                    inputs["tail_mask"], gate=self._gate)
        if self.method == "ccft":
            cache = self._base_cache(inputs)
            self.last_base_cache = cache
            return decoder_forward(model, cache, inputs["tail_ids"], inputs["tail_mask"])
        return full_forward(model, inputs["prefix_ids"], inputs["prefix_mask"], inputs["tail_ids"],
                            inputs["tail_mask"])

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The stock step; on the one-pass path the LoRA token gate stays on through the backward
        (gradient checkpointing recomputes the gated forward there)."""
        one_pass = self.method == "ccft" and self.train_path == "one-pass"
        with gate_for_step(self.accelerator.unwrap_model(model), one_pass) as gate:
            self._gate = gate
            try:
                return super().training_step(model, inputs, num_items_in_batch)
            finally:
                self._gate = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logits = self.tail_logits(model, inputs)
        nll, count = response_nll_sum(logits, inputs["labels"])
        if count.item() == 0:
            raise ValueError("a training batch has no supervised tokens; every row needs a non-empty response")
        if num_items_in_batch is None:
            loss = nll / count
        else:
            loss = nll / num_items_in_batch
            if self.args.average_tokens_across_devices and self.accelerator.num_processes > 1:
                loss = loss * self.accelerator.num_processes  # DDP averages gradients over processes
        return (loss, {"logits": logits}) if return_outputs else loss

    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """Held-out response NLL per supervised token (token-weighted over the whole set), logged as ``eval_loss``."""
        dataloader = self.get_eval_dataloader(eval_dataset)
        model = self.model
        was_training = model.training
        model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.args.device)
        count = torch.zeros((), dtype=torch.float64, device=self.args.device)
        for inputs in dataloader:
            inputs = self._prepare_inputs(inputs)
            nll, n = response_nll_sum(self.tail_logits(model, inputs), inputs["labels"])
            total += nll.double()
            count += n.double()
        total = self.accelerator.reduce(total, reduction="sum")
        count = self.accelerator.reduce(count, reduction="sum")
        if was_training:
            model.train()
        metrics = {f"{metric_key_prefix}_loss": float(total / count.clamp(min=1)),
                   f"{metric_key_prefix}_tokens": int(count)}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def _save_checkpoint(self, model, trial):
        """Write ``checkpoint-N`` into a temporary folder first, then rename it into place (crash-safe)."""
        final = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging_root = final.parent / ".staging"
        staging_root.mkdir(parents=True, exist_ok=True)
        real_output = self.args.output_dir
        real_get = self._get_output_dir
        self._get_output_dir = lambda trial=None: str(staging_root)  # type: ignore[method-assign]
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._get_output_dir = real_get  # type: ignore[method-assign]
            self.args.output_dir = real_output
        staged = staging_root / final.name
        if self.args.should_save and staged.is_dir():
            if final.exists():
                shutil.rmtree(final)
            os.replace(staged, final)
            shutil.rmtree(staging_root, ignore_errors=True)
            self._rotate_final(final.parent)

    def _rotate_final(self, run_dir: Path) -> None:
        limit = self.args.save_total_limit
        if not limit:
            return
        ckpts = sorted((p for p in run_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if p.is_dir()),
                       key=lambda p: int(p.name.rsplit("-", 1)[-1]))
        for old in ckpts[:-limit]:
            shutil.rmtree(old, ignore_errors=True)
