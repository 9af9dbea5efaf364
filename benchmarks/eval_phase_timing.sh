#!/usr/bin/env bash
# Issue 33: the evaluation phase of the tools specialist, old code (2668a93 = ffadd51^, before "each group of
# items is prefilled once per producer") vs the current code, side by side on the same items:
# bfcl-multiple, n = LIMIT (100), four modes, max_new_tokens 160 (evals/study.yaml), the engine path (the old
# study passed engine=True; the current code's default), one batch size for both (BATCH, default 64 = the
# current evals/study.yaml; the old recipes/study.yaml had batch_size 16: OLD_BATCH=16 reproduces that).
#
#   benchmarks/eval_phase_timing.sh                       # old ~24 min, then new ~11 min, on a 2-core CPU
#   LIMIT=4 OUT_ROOT=/tmp/pt benchmarks/eval_phase_timing.sh   # a smoke run
#
# Needs: the old worktree   git worktree add --detach ../ccft-old 2668a93
#        two tools decoders (trained with the current code, both codes load them):
#          ccft train recipes/tools-glaive.yaml method=ccft    max_steps=2 save_steps=2 logging_steps=1 output_dir=runs/phase-timing/tools-ccft
#          ccft train recipes/tools-glaive.yaml method=full-ft max_steps=2 save_steps=2 logging_steps=1 output_dir=runs/phase-timing/tools-full-ft
#        the BFCL checker env (python -m ccft.evals.bfcl setup -> .venv-bfcl; without it NOTHING is generated:
#          the task is "unavailable" and only reference NLLs run). The old code looks for it under ITS repo
#          root, so CCFT_BFCL_PYTHON points both codes at main's.
# Writes OUT_ROOT/{old,new}/ (ccft eval output), OUT_ROOT/{old,new}.phases.json (in-process phase timers),
# OUT_ROOT/{old,new}.time-v.txt (/usr/bin/time -v), OUT_ROOT/{old,new}.log, OUT_ROOT/{old,new}.wall.txt,
# OUT_ROOT/compare.txt (the table and the record check).
#
# The same command on one code with the base's fp32 weights and with the GGUF's Q4_1 / Q8_0 blocks (issue 32:
# time, peak memory and records of the evaluation on the block path; CCFT_BLOCK_WEIGHTS per run):
#   OLD_SRC=$PWD/src OLD_BLOCKS=off NEW_BLOCKS=auto LABELS=fp32,blocks NLL_TOL=1e-4 NICE= \
#     OUT_ROOT=runs/eval-blocks benchmarks/eval_phase_timing.sh
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
LIMIT=${LIMIT:-100}
BATCH=${BATCH:-64}
OLD_BATCH=${OLD_BATCH:-$BATCH}
NEW_BATCH=${NEW_BATCH:-$BATCH}
MAX_NEW=${MAX_NEW:-160}
OUT_ROOT=${OUT_ROOT:-runs/phase-timing}
OLD_SRC=${OLD_SRC:-../ccft-old/src}
NEW_SRC=${NEW_SRC:-$REPO/src}
DEC_CCFT=${DEC_CCFT:-$REPO/runs/phase-timing/tools-ccft}
DEC_FULL=${DEC_FULL:-$REPO/runs/phase-timing/tools-full-ft}
PY=${PY:-$REPO/.venv/bin/python}
NICE=${NICE-nice -n 19}   # NICE= (empty) on a machine that is the timing's alone
OLD_BLOCKS=${OLD_BLOCKS-}  # CCFT_BLOCK_WEIGHTS of each run (empty: as in the environment)
NEW_BLOCKS=${NEW_BLOCKS-}
ENV_BLOCKS=${CCFT_BLOCK_WEIGHTS-}
LABELS=${LABELS:-old,new}
NLL_TOL=${NLL_TOL:-1e-5}
export CCFT_BFCL_PYTHON=${CCFT_BFCL_PYTHON:-$REPO/.venv-bfcl/bin/python}
export PYTHONHASHSEED=0

[ -x "$CCFT_BFCL_PYTHON" ] || { echo "no BFCL checker env at $CCFT_BFCL_PYTHON (python -m ccft.evals.bfcl setup)"; exit 2; }
for d in "$DEC_CCFT" "$DEC_FULL"; do [ -f "$d/ccft.json" ] || { echo "no decoder at $d"; exit 2; }; done
[ -d "$OLD_SRC/ccft" ] || { echo "no old code at $OLD_SRC (git worktree add --detach ../ccft-old 2668a93)"; exit 2; }
mkdir -p "$OUT_ROOT"

run_one() {  # label src batch blocks
  local label=$1 src=$2 batch=$3 blocks=$4 out="$OUT_ROOT/$1"
  export CCFT_BLOCK_WEIGHTS=${blocks:-$ENV_BLOCKS}
  rm -rf "$out"
  # the same ccft command line for both codes (every flag exists in both; --engine is the old code's opt-in
  # and the new code's default)
  local args=(eval --task bfcl-multiple --mode base --mode full-ft --mode naive --mode prefillshare
              --decoder "$DEC_CCFT" --decoder "$DEC_FULL" --limit "$LIMIT" --max-new-tokens "$MAX_NEW"
              --batch-size "$batch" --engine --prompt-format decoder --seed 0 --bootstrap 2000
              --overwrite --no-progress --out "$out")
  local which
  which=$(PYTHONPATH="$src" "$PY" -c 'import ccft; print(ccft.__file__)')
  case "$which" in "$src"/*) ;; *) echo "$label: ccft comes from $which, not $src"; exit 2;; esac
  {
    echo "label=$label ccft=$which git=$(git -C "$src/.." rev-parse --short HEAD) batch=$batch limit=$LIMIT" \
      "CCFT_BLOCK_WEIGHTS=${CCFT_BLOCK_WEIGHTS-}"
    echo "start=$(date -u +%FT%TZ) loadavg_before=$(cut -d' ' -f1-3 /proc/loadavg)"
  } > "$OUT_ROOT/$label.wall.txt"
  local t0 t1
  t0=$(date +%s.%N)
  PYTHONPATH="$src" $NICE /usr/bin/time -v -o "$OUT_ROOT/$label.time-v.txt" \
    "$PY" "$REPO/benchmarks/eval_phase_timing.py" probe "$OUT_ROOT/$label.phases.json" -- "${args[@]}" \
    > "$OUT_ROOT/$label.log" 2>&1
  t1=$(date +%s.%N)
  {
    echo "end=$(date -u +%FT%TZ) loadavg_after=$(cut -d' ' -f1-3 /proc/loadavg)"
    echo "wall_s=$(echo "$t1 - $t0" | bc)"
    grep -E "Elapsed \(wall|Maximum resident" "$OUT_ROOT/$label.time-v.txt" | sed 's/^\s*//'
  } >> "$OUT_ROOT/$label.wall.txt"
  cat "$OUT_ROOT/$label.wall.txt"
}

load1=$(cut -d' ' -f1 /proc/loadavg)
if [ "$(echo "$load1 > 0.5" | bc)" = 1 ]; then
  echo "WARNING: load average $load1: other jobs share the 2 cores; under nice the times are inflated and not comparable"
fi
for label in ${ORDER:-old new}; do  # ORDER="new old" to check the order does not matter
  case $label in
    old) run_one old "$OLD_SRC" "$OLD_BATCH" "$OLD_BLOCKS";;
    new) run_one new "$NEW_SRC" "$NEW_BATCH" "$NEW_BLOCKS";;
  esac
done

PYTHONPATH="$NEW_SRC" $NICE "$PY" "$REPO/benchmarks/eval_phase_timing.py" compare "$OUT_ROOT/old" "$OUT_ROOT/new" \
  --old-phases "$OUT_ROOT/old.phases.json" --new-phases "$OUT_ROOT/new.phases.json" --labels "$LABELS" \
  --nll-tol "$NLL_TOL" | tee "$OUT_ROOT/compare.txt"
