#!/usr/bin/env bash
# GPU check of the inference engine: the decode benchmark against HF generate with the fused captured
# step (decode=compiled_graph) with its weights packed ([q;k;v], [gate;up]: the CUDA default) beside the
# same step unpacked (the previous default), in the same interleaved runs, with each step's wall time
# against its GPU-busy time; then the `gpu`-marked tests (CUDA-graph decode packed and unpacked, the
# compiled step captured as CUDA graphs, Triton shared-prefix kernel).
# Random weights in SmolLM2-135M's shape, so no model weights travel. Up to about 9 minutes on one H200:
# the benchmark compiles the 30-layer step once per batch bucket and engine (cold, more than the 270 s an
# earlier version allowed; with inductor's cache warm, about 1-2 min per batch size), the tests ~1.5 min.
#
#   scripts/gpu_check.sh OUTDIR
#
# Writes OUTDIR/env.txt, OUTDIR/gpu_tests.txt, OUTDIR/decode_bf16.txt and OUTDIR/decode_bf16.json
# (FP32=1 also runs the fp32 benchmark of earlier checks: OUTDIR/decode.{txt,json}).
# Needs transformers, peft, pytest and tqdm importable (triton comes with CUDA torch). A machine
# without network can install them from a folder of wheels: WHEELHOUSE=/path scripts/gpu_check.sh OUT
# (make one elsewhere with `pip download -d wheels -c constraints.txt transformers peft pytest tqdm`).
set -uo pipefail
OUT="${1:?usage: scripts/gpu_check.sh OUTDIR}"
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! $PY -c "import transformers, peft, pytest, tqdm" 2>/dev/null; then
  if [ -n "${WHEELHOUSE:-}" ] && [ -d "$WHEELHOUSE" ]; then
    $PY -m pip install -q --no-index --find-links "$WHEELHOUSE" transformers peft pytest tqdm pyyaml \
      || { echo "gpu_check: installing from $WHEELHOUSE failed" | tee "$OUT/env.txt"; exit 3; }
  else
    echo "gpu_check: transformers, peft, pytest and tqdm must be importable (or set WHEELHOUSE=DIR of wheels)" \
      | tee "$OUT/env.txt"
    exit 3
  fi
fi

$PY - <<'PYEOF' 2>&1 | tee "$OUT/env.txt"
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NONE")
for name in ("transformers", "peft", "triton", "pytest"):
    try:
        print(name, __import__(name).__version__)
    except Exception as e:  # noqa: BLE001
        print(name, "MISSING", e)
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device visible")
PYEOF
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 3

status=0
echo "== decode benchmark (random weights, SmolLM2-135M shape, bf16): compiled_graph packed beside unpacked" \
  | tee "$OUT/decode_bf16.txt"
timeout 420 $PY -m benchmarks.decode --random-weights --device cuda --dtype bfloat16 --batch-sizes 1 16 \
  --new-tokens 15 --repeats 5 --decode compiled_graph --also-decode compiled_graph --also-pack-weights off \
  --out "$OUT/decode_bf16.json" 2>&1 | tee -a "$OUT/decode_bf16.txt" || status=1

echo "== gpu tests" | tee "$OUT/gpu_tests.txt"
timeout 150 $PY -m pytest -q -m gpu --durations=8 -p no:cacheprovider -o addopts="" tests/inference/test_inference_gpu.py tests/inference/test_families_gpu.py \
  2>&1 | tee -a "$OUT/gpu_tests.txt" || status=1

if [ "${FP32:-0}" = 1 ]; then
  echo "== decode benchmark (random weights, SmolLM2-135M shape, fp32)" | tee "$OUT/decode.txt"
  timeout 150 $PY -m benchmarks.decode --random-weights --device cuda --batch-sizes 1 16 64 --new-tokens 64 \
    --repeats 3 --out "$OUT/decode.json" 2>&1 | tee -a "$OUT/decode.txt" || status=1
fi

echo "gpu_check: exit $status (tests: $OUT/gpu_tests.txt, benchmark: $OUT/decode_bf16.json)"
exit $status
