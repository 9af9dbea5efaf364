"""Multi-process training: launching ``ccft train`` through accelerate, and placing the frozen base.

``ccft train RECIPE --num-processes N [--accelerate-config FILE]`` re-runs itself under
``accelerate launch`` (shipped configs: ``recipes/accelerate/{ddp,zero2,zero3}.yaml``). Each process
builds the same base and decoder; the trainer is the stock ``transformers.Trainer``, so DDP and
DeepSpeed wrap the DECODER only. The frozen base is placed the way TRL places reference models:

* LoRA decoders share their weights with the base (one copy, adapters disabled for the prefill), so
  whatever wraps the decoder also holds the base: under ZeRO-3 its weights are partitioned with the
  decoder's and gathered layer by layer for the prefill.
* Full-weight decoders have a second, frozen copy. Under ZeRO-3 it is partitioned too
  (``deepspeed.initialize`` without an optimizer, eval mode); under DDP / ZeRO-1/2 every process keeps
  a plain replica, in eval mode, run under ``torch.inference_mode``.

The loss is normalised by the global supervised-token count (``CacheConditionedTrainer.compute_loss``),
so N processes with per-device batch B train like one process with batch N·B.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from ccft.core.errors import ConfigError


def inside_launcher() -> bool:
    """True in a process started by accelerate / torchrun (they set ``WORLD_SIZE`` / ``LOCAL_RANK``)."""
    return "LOCAL_RANK" in os.environ or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def accelerate_command(
    argv: Sequence[str],
    *,
    num_processes: int | None = None,
    config_file: str | None = None,
    use_cpu: bool | None = None,
) -> list[str]:
    """The ``accelerate launch`` command that runs ``ccft <argv>`` in ``num_processes`` processes.

    ``use_cpu``: force CPU processes (gloo); default: when no CUDA device is visible. A config file
    sets the engine (DDP, DeepSpeed ZeRO-2/3); without one, N > 1 processes run plain DDP.
    """
    import torch

    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if config_file:
        if not Path(config_file).is_file():
            raise ConfigError(
                f"accelerate config {config_file} does not exist; see recipes/accelerate/ "
                "(ddp.yaml, zero2.yaml, zero3.yaml)"
            )
        cmd += ["--config_file", str(config_file)]
    elif (num_processes or 1) > 1:
        cmd += ["--multi_gpu"]  # torchrun-style launch; on CPU the processes form a gloo group
    if num_processes:
        cmd += ["--num_processes", str(num_processes)]
    cmd += ["--num_machines", "1", "-m", "ccft.cli.main", *argv]
    if use_cpu is None:
        use_cpu = not torch.cuda.is_available()
    if use_cpu and not any(a.startswith("use_cpu=") for a in argv):
        cmd.append("use_cpu=true")  # without it accelerate would not form a CPU process group
    return cmd


def relaunch(
    argv: Sequence[str],
    *,
    num_processes: int | None = None,
    config_file: str | None = None,
    env: dict | None = None,
) -> int:
    """Run ``ccft <argv>`` under ``accelerate launch``; returns its exit status."""
    cmd = accelerate_command(argv, num_processes=num_processes, config_file=config_file)
    run_env = dict(os.environ, **(env or {}))
    run_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, num_processes or 1))))
    print(f"[ccft] launching: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    return subprocess.call(cmd, env=run_env)


def zero_stage(accelerator) -> int:
    """The DeepSpeed ZeRO stage of a run (0 without DeepSpeed)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return 0
    return int(plugin.deepspeed_config.get("zero_optimization", {}).get("stage", 0) or 0)


def place_frozen_base(base, accelerator, *, decoder_kind: str) -> None:
    """Put a full-weight decoder's frozen base where the engine wants it (see module docstring).

    ZeRO-3: the base copy is partitioned over the processes like the decoder (``deepspeed.initialize``,
    no optimizer, eval mode) and gathered layer by layer during the prefill. Otherwise it stays a plain
    replica on the process's device. LoRA decoders need nothing: the base is the decoder's own module.
    """
    if (
        decoder_kind != "full"
        or zero_stage(accelerator) != 3
        or getattr(base, "_ds_engine", None) is not None
    ):
        return
    import deepspeed

    cfg = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    hidden = getattr(base.config, "hidden_size", None)
    zero = cfg.setdefault("zero_optimization", {})
    for key in ("offload_optimizer",):
        zero.pop(key, None)
    for key in ("optimizer", "scheduler"):
        cfg.pop(key, None)
    if hidden:
        zero.update(
            {
                "reduce_bucket_size": hidden * hidden,
                "stage3_param_persistence_threshold": 10 * hidden,
                "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            }
        )
    for k, v in list(cfg.items()):  # an inference engine needs no batch-size bookkeeping left on "auto"
        if v == "auto":
            cfg.pop(k)
    cfg["train_micro_batch_size_per_gpu"] = 1
    cfg.pop("train_batch_size", None)
    cfg.pop("gradient_accumulation_steps", None)
    engine, *_ = deepspeed.initialize(model=base.model, config=cfg)
    engine.eval()
    base._ds_engine = engine  # keeps the partitioned copy alive; base.model is the engine's module


__all__ = ["inside_launcher", "accelerate_command", "relaunch", "zero_stage", "place_frozen_base"]
