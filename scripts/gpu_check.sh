#!/usr/bin/env bash
# GPU_CHECK_STEPS=a bash scripts/gpu_check.sh OUT    on the GPU machine, then GPU_CHECK_STEPS=b, each one command
# GPU_CHECK_DEVICE=cpu bash scripts/gpu_check.sh OUT  the CPU dry run: the same steps, the device arguments mapped
# Everything the CPU tests cannot show, on one GPU, the most valuable first (docs/training.md, "The GPU check", has
# the device tool's exact commands and each one's time limit):
#   a  devices      tests/test_devices.py on CUDA; the sampler's host waits counted by CUDA's sync debug mode
#      exactness    SpS's chi-square test on the device at a tiny size (tests/test_exactness.py)
#      costs_8b     an 8B-shape target (random weights): its 3-layer cut, a paper-shaped draft and the target as its
#                   own draft (alpha ~1): tok/s, alpha, c and v(K)
#      costs_demo   the demo target's shape (smollm2-135m-shape) and its 3-layer cut: c and v(K) on the GPU
#   b  smoke        recipe=smoke in bf16 with validation, then its export measured on the GPU
#      plan_8b      plan=true for the training below: memory per GPU by the plan
#      train_8b     a shallow_wide-shaped draft trained 2 epochs against the full-depth 8B shape; then
#      visits_8b    tokens/s on each block's first visit (the target's pass) and on revisits (kept logits)
#   c  (optional) ZeRO-2, ZeRO-3 and FSDP: 20 steps each, then a resume to 30
# GPU_CHECK_STEPS (default "a b") names parts or steps. OUT ends with at most 8 files: PART.log (the steps' logs, each
# tail-capped) and summary.json (every step's outcome and figure rows); models, runs and the installed wheels go
# under GPU_CHECK_SCRATCH. A step that passed in an earlier run into the same OUT is skipped. With wheels in
# GPU_CHECK_WHEELS (default .whl, made by bash scripts/fetch_gpu_wheels.sh) they are installed first, --no-deps,
# into the scratch folder; a draftsmith wheel that differs from this tree is refused. Without CUDA (and
# GPU_CHECK_DEVICE unset) it refuses in one line.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-$(mktemp -d)}}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
SCRATCH=${GPU_CHECK_SCRATCH:-${TMPDIR:-/tmp}/draftsmith-gpu-check}
WHEELS=${GPU_CHECK_WHEELS:-.whl}
HELPER=scripts/gpu_check_summary.py
STEPS=${GPU_CHECK_STEPS:-a b}
case $DEVICE in
    cuda) if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
              echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False): run it on a GPU machine," \
                   "or GPU_CHECK_DEVICE=cpu for the CPU dry run" >&2
              exit 2
          fi ;;
    cpu) ;;
    *) echo "gpu_check: GPU_CHECK_DEVICE=$DEVICE: use cuda (the default) or cpu (the dry run)" >&2; exit 2 ;;
esac
mkdir -p "$SCRATCH/logs" "$SCRATCH/runs"
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    for w in "$WHEELS"/draftsmith-*.whl; do
        [ -e "$w" ] && { "$PY" "$HELPER" wheel-matches "$w" || exit 2; }
    done
    rm -rf "$SCRATCH/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SCRATCH/site" "$WHEELS"/*.whl \
        || { echo "gpu_check: the wheels in $WHEELS did not install" >&2; exit 2; }
    export PYTHONPATH=$SCRATCH/site${PYTHONPATH:+:$PYTHONPATH}
fi
export DRAFTSMITH_HOME=${DRAFTSMITH_HOME:-$SCRATCH/home}

# The device arguments of each step. The dry run maps gpu->cpu and cuda->cpu, the 8B shape to tiny-random (4 layers,
# 512 tokens) at a size a CPU trains in seconds, bf16-mixed training to fp32 (bf16 matmuls are ~70x slower on an
# AVX2-only CPU: DESIGN.md section 6), and runs what has no CPU path as a named stand-in.
if [ "$DEVICE" = cuda ]; then
    TRAINER=gpu TORCH=cuda TESTS=cuda PRECISION=bf16-mixed DTYPE=bf16 BIG=random:llama3-8b-shape CUT=3 RECIPE=gpu_8b
    DEMO=random:smollm2-135m-shape PROMPTS=2 NEW=64 EXACT=speculative_generate_passes_chi_square
    BIGTRAIN=(data.max_documents=40 data.block_size=512 data.batch_size=8 draft.draft_vocab=8192 draft.layers=3
              data.chat_template=false)  # the random shape has tiny-random's tokenizer: no chat template
    EXPORT=()
else
    TRAINER=cpu TORCH=cpu TESTS=meta PRECISION=32-true DTYPE=fp32 BIG=tiny-random CUT=1 RECIPE=shallow_wide
    DEMO=tiny-random PROMPTS=1 NEW=8 EXACT="speculative_generate_passes_chi_square and 3-setting0-None"
    BIGTRAIN=(data.max_documents=12 data.val_blocks=4 data.block_size=64 data.batch_size=8 draft.draft_vocab=128 draft.layers=1)
    EXPORT=(--n-prompts 2 --max-new-tokens 16)
fi
# a command, not a shell function: `timeout` runs it; no progress bar (the logs keep one line an event)
TRAIN=("$PY" -m draftsmith.train.draft logger=csv trainer.enable_progress_bar=false)
failed=0
"$PY" -c "import torch, transformers, lightning
dev = torch.cuda.get_device_name(0) + ' x %d' % torch.cuda.device_count() if '$DEVICE' == 'cuda' else 'CPU dry run'
print('gpu_check:', dev, '| torch', torch.__version__, '| transformers', transformers.__version__, '| lightning',
      lightning.__version__)" || exit 2

# step PART NAME LIMIT_S FIGURES CMD...: runs CMD under `timeout` (its log in the scratch folder, then appended,
# tail-capped, to OUT/PART.log) and prints one line, the step, ok or FAILED and its seconds, then its figure rows
# (the log's lines matching the extended regex FIGURES, case-insensitive). STAND_IN, when set, says why a CPU
# stand-in runs instead of the GPU step; FRESH, a run folder that a failed earlier try may have left (its corpus and
# settings would be taken up again) and that is removed first. A step that passed into this OUT before is skipped.
STAND_IN="" FRESH=""
step() {
    local part=$1 name=$2 limit=$3 figures=$4 t0=$SECONDS
    shift 4
    if ! on "$part" && ! on "$name"; then STAND_IN="" FRESH=""; return 0; fi
    if "$PY" "$HELPER" done "$OUT/summary.json" "$name"; then
        echo "[skip] $name: passed in an earlier run (summary.json)"
        STAND_IN="" FRESH=""
        return 0
    fi
    [ -n "$STAND_IN" ] && echo "[cpu stand-in] $name: $STAND_IN"
    local log=$SCRATCH/logs/$name.log
    [ -n "$FRESH" ] && rm -rf "$FRESH"
    timeout "$limit" "$@" > "$log" 2>&1
    local rc=$? took=$((SECONDS - t0))
    { echo "===== $name: rc=$rc, ${took}s: $*"; tail -c 2000000 "$log"; } >> "$OUT/$part.log"
    local rows
    rows=$(grep -iE "$figures" "$log" | grep -v '%|' | head -16)
    if "$PY" "$HELPER" record "$OUT/summary.json" "$name" "$part" "$rc" "$took" "$STAND_IN" <<< "$rows"; then
        echo "[ok] $name (${took}s)"
    elif [ $rc -eq 0 ]; then
        echo "[FAILED: no figure row] $name (${took}s): $(tail -2 "$log" | tr '\n' ' ' | cut -c1-300)"; failed=1
    else
        echo "[FAILED rc=$rc] $name (${took}s): $(tail -3 "$log" | tr '\n' ' ' | cut -c1-400)"; failed=1
    fi
    [ -n "$rows" ] && sed 's/^/    /' <<< "$rows"
    STAND_IN="" FRESH=""
    return $rc
}
on() { [[ " $STEPS " == *" $1 "* ]]; }

# part a
[ "$DEVICE" = cpu ] && STAND_IN="no CUDA here: the tests run on the meta device (DESIGN.md section 8), host reads counted by their own counter"
step a devices 240 "[0-9]+ passed|failed|host reads" env DRAFTSMITH_TEST_DEVICE=$TESTS "$PY" -m pytest -q -s \
    -p no:cacheprovider -m "not slow" tests/test_devices.py
step a exactness 180 "[0-9]+ passed|failed|p-value" env DRAFTSMITH_TEST_DEVICE=$TESTS "$PY" -m pytest -q -s \
    -p no:cacheprovider tests/test_exactness.py -k "$EXACT"
step a costs_8b 300 "^(ours|hf)_| c=|v\(" "$PY" -m draftsmith.deploy.cli bench sampler --target "$BIG" \
    --device $TORCH --dtype $DTYPE --cut-layers $CUT --paper-draft --n-prompts $PROMPTS --max-new-tokens $NEW \
    --json "$SCRATCH/costs_8b.json"
step a costs_demo 180 "^ours_| c=" "$PY" -m draftsmith.deploy.cli bench sampler --target "$DEMO" --device $TORCH \
    --dtype $DTYPE --cut-layers 3 --no-self-draft --n-prompts 1 --max-new-tokens $NEW --json "$SCRATCH/costs_demo.json"
# part b
REPORT="^  [a-z_0-9]+ +[a-z_]+ +[0-9.]+ +[0-9.]+|c = |throughput|peak GPU"  # the run's acceptance table and costs
FRESH=$SCRATCH/runs/smoke
step b smoke 240 "$REPORT" "${TRAIN[@]}" recipe=smoke trainer=$TRAINER trainer.devices=1 trainer.precision=$PRECISION \
    hydra.run.dir="$SCRATCH/runs/smoke"
FRESH=$SCRATCH/runs/smoke_bundle
step b smoke_export 180 "alpha|recommended|c = |c=" "$PY" -m draftsmith.deploy.cli export "$SCRATCH/runs/smoke" \
    --out "$SCRATCH/runs/smoke_bundle" --device $TORCH "${EXPORT[@]}"
# the default recipe's draft (3 layers copied from the target, its width, a pruned head) against every layer of
# the 8B shape, on a fixed corpus (the random target samples noise) for 2 epochs: the first visits every block
# with the target's pass, the second reads the kept logits. On a GPU through the GPU recipe (shallow_wide, the CPU
# demo, is refused with a GPU trainer); the dry run maps it to shallow_wide, as it maps the trainer
SHAPE=(recipe=$RECIPE target.name="$BIG" data=fixed "${BIGTRAIN[@]}" trainer=$TRAINER trainer.devices=1)
step b plan_8b 120 "draft:|total|GiB" "${TRAIN[@]}" "${SHAPE[@]}" plan=true hydra.run.dir="$SCRATCH/runs/plan8b"
FRESH=$SCRATCH/runs/train8b
step b train_8b 330 "$REPORT" "${TRAIN[@]}" "${SHAPE[@]}" ++trainer.max_epochs=2 trainer.max_steps=-1 \
    trainer.max_time=00:00:04:00 trainer.log_every_n_steps=1 trainer.val_check_interval=100000 \
    sampler.on_target_prompts=2 sampler.n_prompts=2 eval.n_prompts=2 eval.baseline=false \
    hydra.run.dir="$SCRATCH/runs/train8b"
step b visits_8b 60 "tokens/s" "$PY" "$HELPER" visits "$SCRATCH/runs/train8b"
# part c (optional)
if [ "$DEVICE" = cuda ]; then
    for s in deepspeed_stage_2 deepspeed_stage_3 fsdp; do
        FRESH=$SCRATCH/runs/$s
        step c "$s" 240 "$REPORT" "${TRAIN[@]}" recipe=smoke trainer=$s trainer.devices=1 \
            trainer.max_steps=20 trainer.val_check_interval=10 hydra.run.dir="$SCRATCH/runs/$s" \
        && step c "${s}_resume" 240 "$REPORT" "${TRAIN[@]}" recipe=smoke trainer=$s \
            trainer.devices=1 trainer.max_steps=30 trainer.val_check_interval=10 ckpt_path=last \
            hydra.run.dir="$SCRATCH/runs/$s"
    done
else
    STAND_IN="Lightning refuses DeepSpeed and FSDP without CUDA: DDP on 2 gloo processes, 20 steps then a resume"
    FRESH=$SCRATCH/runs/ddp
    step c ddp 300 "$REPORT" "${TRAIN[@]}" recipe=smoke trainer=ddp trainer.max_steps=20 \
        trainer.val_check_interval=10 hydra.run.dir="$SCRATCH/runs/ddp" \
    && step c ddp_resume 300 "$REPORT" "${TRAIN[@]}" recipe=smoke trainer=ddp \
        trainer.max_steps=30 trainer.val_check_interval=10 ckpt_path=last hydra.run.dir="$SCRATCH/runs/ddp"
fi
echo "gpu_check: $([ $failed = 0 ] && echo 'every step passed' || echo 'some steps FAILED') (logs and summary.json in $OUT)"
exit $failed
