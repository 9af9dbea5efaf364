#!/usr/bin/env bash
# The specialists study at full scale on one CUDA GPU (not run yet: no device was lent while it was written).
#
#   scripts/gpu_study.sh            # writes runs/study-gpu/ and reports/study-gpu/
#
# Same command and code as `make study` (docs/study.md) with GPU settings: every bundled training row
# (GSM8K train 7,473; MBPP train 374; glaive 957), one epoch each (code: 3 epochs), bf16 base and training,
# full test sets (GSM8K 1,319; GSM-Plus testmini 2,400; HumanEval(+) 164; BFCL multiple 200; MultiPL-E 161 per
# language with a toolchain), batch 64. Sized from the CPU run's per-token costs, not measured on a GPU yet:
# treat the target of <= 8 minutes on one H200 as unverified until this script has run once there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
GPU_TRAIN="dtype=bfloat16 bf16=true use_cpu=false per_device_train_batch_size=32 gradient_accumulation_steps=1 max_steps=-1"
args=(runs=runs/study-gpu out=reports/study-gpu device=cuda batch_size=64 bootstrap=2000 sweep_limit=200)
for spec in math code tools; do
  for kv in $GPU_TRAIN; do args+=("specialists.$spec.train.$kv"); done
  args+=("specialists.$spec.train.num_train_epochs=1")
done
args+=(specialists.math.train.train_rows=null specialists.math.train.learning_rate=5.0e-4
       specialists.code.train.num_train_epochs=3
       specialists.math.tasks.gsm8k.limit=1319 specialists.math.tasks.gsm-plus.limit=2400
       specialists.code.tasks.humaneval.limit=164 specialists.code.tasks.humaneval-plus.limit=164
       specialists.code.multipl_e_limit=161 specialists.tools.tasks.bfcl-multiple.limit=200
       "serving.sessions=[1, 2, 4, 8]" serving.turns=3)
exec "$PY" -m ccft study recipes/study.yaml "${args[@]}" "$@"
