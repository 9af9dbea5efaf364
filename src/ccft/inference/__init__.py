"""Inference: one shared prefill, many decoders, static caches, captured decode (DESIGN.md §3).

``SharedPrefillEngine`` runs the base once per batch of prompts into a read-only prefix arena
and decodes any number of decoders (LoRA adapters on the base's single weight copy, or
full-weight models) on it, with a step-level API for schedulers. Its decode attention is split at
the shared prefix (``attention``; Triton kernel in ``triton_kernels``); the static decode step is
captured as CUDA graphs on GPUs (``graphs``). ``ccft.generate`` is the slow reference it equals.
"""

from ccft.inference.engine import BASE, PrefixHandle, SamplingParams, SharedPrefillEngine, StepOutput
from ccft.inference.kv import CapacityError

__all__ = ["SharedPrefillEngine", "PrefixHandle", "SamplingParams", "StepOutput", "CapacityError", "BASE"]
