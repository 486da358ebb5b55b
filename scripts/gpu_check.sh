#!/usr/bin/env bash
# bash scripts/gpu_check.sh OUT                       on the GPU machine: parts a and b, one command of 10 min at most
# GPU_CHECK_STEPS=c bash scripts/gpu_check.sh OUT     part c, in a session of its own
# GPU_CHECK_DEVICE=cpu bash scripts/gpu_check.sh OUT  the CPU dry run: the same steps, the device arguments mapped
# Everything the CPU tests cannot show, on one GPU, the most valuable first (docs/training.md, "The GPU check", has
# the device tool's exact commands and each step's estimate against the command's limit):
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
# GPU_CHECK_STEPS (default "a b") names parts or steps. OUT ends with at most 7 files: freeze.txt (the machine's
# `pip freeze`) and machine.txt (nvidia-smi, df of the scratch folder), written first; PART.log (the steps' logs,
# each tail-capped) and summary.json (every step's outcome and figure rows). Models, runs and the installed wheels
# go under GPU_CHECK_SCRATCH. A step that passed in an earlier run into the same OUT is skipped, unless what a later
# step reads from it is gone (a retry on a fresh machine): then it runs again. With wheels in GPU_CHECK_WHEELS
# (default .whl, made by bash scripts/fetch_gpu_wheels.sh) they are installed first, --no-deps, into the scratch
# folder (not again while the same set is installed there); a draftsmith wheel that differs from this tree is
# refused. Without CUDA (and GPU_CHECK_DEVICE unset) it refuses in one line.
#
# The deadline: the device tool kills a command at its limit (10 minutes), and the running step's log with it, so
# the check stops itself first. GPU_CHECK_DEADLINE_S (default that limit less 20 s) counts from this script's
# start; each step runs under `timeout -k`, capped at the time left less what stopping it and keeping its log take.
# A step stopped by its limit leaves its log's tail in OUT/PART.log and a "timeout" entry in summary.json; a step
# with under MIN_STEP_S left is not started and recorded "no time"; a step in flight is recorded "running" first,
# so even a kill from outside leaves its name.
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
COMMAND_LIMIT_S=600  # the device tool's limit on one command (its README, "Limits")
DEADLINE=${GPU_CHECK_DEADLINE_S:-$((COMMAND_LIMIT_S - 20))}
KILL_AFTER=5  # a step that ignores timeout's TERM is killed this long after it
KEEP_S=5      # copying a stopped step's log tail to OUT and recording it
MIN_STEP_S=5
if ! [[ $DEADLINE =~ ^[0-9]+$ ]]; then
    echo "gpu_check: GPU_CHECK_DEADLINE_S=$DEADLINE: give whole seconds" >&2
    exit 2
fi
OWN_HOME=${DRAFTSMITH_HOME:+no}
export DRAFTSMITH_HOME=${DRAFTSMITH_HOME:-$SCRATCH/home}
mkdir -p "$SCRATCH/logs" "$SCRATCH/runs" "$DRAFTSMITH_HOME/models"

# First into OUT, so that even a command that goes no further brings back the machine as it is: its own package
# list (before any wheel is installed: the image's, what scripts/gpu_image.txt stands for), its GPU and the scratch
# folder's free space (the 8B steps need ~45 GB there)
"$PY" -m pip freeze --exclude-editable > "$OUT/freeze.txt" 2>&1 \
    || echo "gpu_check: pip freeze failed" >> "$OUT/freeze.txt"
{
    echo "gpu_check: started $(date -u +%Y-%m-%dT%H:%M:%SZ), deadline ${DEADLINE}s, kernel $(uname -r)"
    # a save killed mid-write (the 8B model: 16 GB) leaves its temporary folder beside the models; in the check's own
    # home nothing else writes there, so any such folder is stale (another home may have a save in flight)
    if [ -z "$OWN_HOME" ]; then
        while IFS= read -r -d '' d; do
            echo "removed $(du -sh "$d" | cut -f1) left by a killed save: $d"
            rm -rf "$d"
        done < <(find "$DRAFTSMITH_HOME/models" -mindepth 1 -maxdepth 1 -type d -name '.*' -print0)
    fi
    if command -v nvidia-smi >/dev/null; then nvidia-smi 2>&1; else echo "nvidia-smi: not here"; fi
    df -h "$SCRATCH" 2>&1
} > "$OUT/machine.txt"

case $DEVICE in
    cuda) if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
              echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False): run it on a GPU machine," \
                   "or GPU_CHECK_DEVICE=cpu for the CPU dry run" >&2
              exit 2
          fi ;;
    cpu) ;;
    *) echo "gpu_check: GPU_CHECK_DEVICE=$DEVICE: use cuda (the default) or cpu (the dry run)" >&2; exit 2 ;;
esac
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    for w in "$WHEELS"/draftsmith-*.whl; do
        [ -e "$w" ] && { "$PY" "$HELPER" wheel-matches "$w" || exit 2; }
    done
    carried=$(cd "$WHEELS" && sha256sum -- *.whl | sha256sum | cut -c1-16)
    if [ "$(cat "$SCRATCH/site/.carried" 2>/dev/null)" = "$carried" ]; then
        echo "wheels: the set in $WHEELS ($carried) is installed already, not again" >> "$OUT/machine.txt"
    else
        rm -rf "$SCRATCH/site"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SCRATCH/site" \
            "$WHEELS"/*.whl || { echo "gpu_check: the wheels in $WHEELS did not install" >&2; exit 2; }
        echo "$carried" > "$SCRATCH/site/.carried"
    fi
    export PYTHONPATH=$SCRATCH/site${PYTHONPATH:+:$PYTHONPATH}
fi

# The device arguments of each step. The dry run maps gpu->cpu and cuda->cpu, the 8B shape to tiny-random (4 layers,
# 512 tokens) at a size a CPU trains in seconds, bf16-mixed training to fp32 (bf16 matmuls are ~70x slower on an
# AVX2-only CPU: DESIGN.md section 6), and runs what has no CPU path as a named stand-in.
SLOWER=1
if [ "$DEVICE" = cuda ]; then
    TRAINER=gpu TORCH=cuda TESTS=cuda PRECISION=bf16-mixed DTYPE=bf16 BIG=random:llama3-8b-shape CUT=3 RECIPE=gpu_8b
    DEMO=random:smollm2-135m-shape PROMPTS=2 NEW=64 EXACT=speculative_generate_passes_chi_square
    # 20 stdlib files: 482 blocks of 512 tokens, 61 steps an epoch; one prompt set for the report
    BIGTRAIN=(data.max_documents=20 data.block_size=512 data.batch_size=8 draft.draft_vocab=8192 draft.layers=3
              data.chat_template=false)  # the random shape has tiny-random's tokenizer: no chat template
else
    TRAINER=cpu TORCH=cpu TESTS=meta PRECISION=32-true DTYPE=fp32 BIG=tiny-random CUT=1 RECIPE=shallow_wide
    DEMO=tiny-random PROMPTS=1 NEW=8 EXACT="speculative_generate_passes_chi_square and 3-setting0-None"
    # 8 stdlib files: 371 blocks of 64 tokens, 46 steps an epoch
    BIGTRAIN=(data.max_documents=8 data.val_blocks=4 data.block_size=64 data.batch_size=8 draft.draft_vocab=128
              draft.layers=1 data.chat_prompts=0)  # tiny-random has no chat template for shallow_wide's chat turns
    SLOWER=2  # a small CPU takes up to twice a step's GPU limit here (2 shared cores, measured: smoke over 150 s)
fi
# a command, not a shell function: `timeout` runs it; no progress bar (the logs keep one line an event)
TRAIN=("$PY" -m draftsmith.train.draft logger=csv trainer.enable_progress_bar=false)
failed=0
# one Python start: the versions, and every module the steps start from imported (a missing package, say the wheels
# left behind, is one line here instead of a failure in every step)
"$PY" -c "import sys, torch, transformers, lightning
try:
    import draftsmith.train.draft, draftsmith.deploy.cli
except ImportError as e:
    sys.exit(f'gpu_check: draftsmith does not import here ({type(e).__name__}: {e}): carry its wheels '
             '(bash scripts/fetch_gpu_wheels.sh, then carry .whl)')
dev = torch.cuda.get_device_name(0) + ' x %d' % torch.cuda.device_count() if '$DEVICE' == 'cuda' else 'CPU dry run'
print('gpu_check:', dev, '| torch', torch.__version__, '| transformers', transformers.__version__, '| lightning',
      lightning.__version__)" || exit 2

# step PART NAME LIMIT_S FIGURES CMD...: runs CMD under `timeout -k`, its limit the smaller of LIMIT_S (twice it in
# the dry run) and the deadline's time left (its log in the scratch folder, then appended, tail-capped, to OUT/PART.log) and prints one
# line, the step, ok, FAILED, TIMEOUT or no time and its seconds, then its figure rows (the log's lines matching the
# extended regex FIGURES, case-insensitive). Set before a call: STAND_IN says why a CPU stand-in runs instead of the
# GPU step; FRESH, a run folder that a failed earlier try may have left (its corpus and settings would be taken up
# again) and that is removed first; KEEPS, what later steps read from this one: a step that passed into this OUT
# before is skipped only while all of it is there.
STAND_IN="" FRESH="" KEEPS=()
step() {
    local part=$1 name=$2 limit=$3 figures=$4 stand_in=$STAND_IN fresh=$FRESH keeps=("${KEEPS[@]}") k gone=""
    shift 4
    STAND_IN="" FRESH="" KEEPS=()
    on "$part" || on "$name" || return 0
    if "$PY" "$HELPER" done "$OUT/summary.json" "$name"; then
        for k in "${keeps[@]}"; do [ -e "$k" ] || gone+=" $k"; done
        if [ -z "$gone" ]; then
            echo "[skip] $name: passed in an earlier run (summary.json)"
            return 0
        fi
        echo "[again] $name: passed in an earlier run, but what later steps read from it is gone:$gone"
    fi
    local left=$((DEADLINE - SECONDS - KILL_AFTER - KEEP_S))
    limit=$((limit * SLOWER))
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt "$MIN_STEP_S" ]; then
        "$PY" "$HELPER" record "$OUT/summary.json" "$name" "$part" -1 0 "$stand_in" "no time" < /dev/null
        echo "[no time] $name: $((DEADLINE - SECONDS))s left before the deadline (GPU_CHECK_DEADLINE_S=$DEADLINE)"
        failed=1
        return 1
    fi
    [ -n "$stand_in" ] && echo "[cpu stand-in] $name: $stand_in"
    local log=$SCRATCH/logs/$name.log t0=$SECONDS
    [ -n "$fresh" ] && rm -rf "$fresh"
    "$PY" "$HELPER" record "$OUT/summary.json" "$name" "$part" -1 0 "$stand_in" running < /dev/null
    timeout -k "$KILL_AFTER" "$limit" "$@" > "$log" 2>&1
    local rc=$? took=$((SECONDS - t0)) status="" rows
    # 124: stopped by TERM at the limit; 137 after it: killed KILL_AFTER later (137 sooner is another kill)
    if [ $rc -eq 124 ] || { [ $rc -eq 137 ] && [ $took -ge "$limit" ]; }; then status=timeout; fi
    { echo "===== $name: rc=$rc, ${took}s${status:+ (stopped at its limit of ${limit}s)}: $*"
      tail -c 2000000 "$log"; } >> "$OUT/$part.log"
    rows=$(grep -iE "$figures" "$log" | grep -v '%|' | head -16)
    if "$PY" "$HELPER" record "$OUT/summary.json" "$name" "$part" "$rc" "$took" "$stand_in" $status <<< "$rows"; then
        echo "[ok] $name (${took}s)"
    elif [ -n "$status" ]; then
        echo "[TIMEOUT] $name (${took}s): stopped at its limit of ${limit}s (deadline ${DEADLINE}s):" \
             "$(tail -2 "$log" | tr '\n' ' ' | cut -c1-300)"; failed=1
    elif [ $rc -eq 0 ]; then
        echo "[FAILED: no figure row] $name (${took}s): $(tail -2 "$log" | tr '\n' ' ' | cut -c1-300)"; failed=1
    else
        echo "[FAILED rc=$rc] $name (${took}s): $(tail -3 "$log" | tr '\n' ' ' | cut -c1-400)"; failed=1
    fi
    [ -n "$rows" ] && sed 's/^/    /' <<< "$rows"
    [ -n "$status" ] && return 1
    return $rc
}
on() { [[ " $STEPS " == *" $1 "* ]]; }

# part a
[ "$DEVICE" = cpu ] && STAND_IN="no CUDA here: the tests run on the meta device (DESIGN.md section 8), host reads \
counted by their own counter"
step a devices 150 "[0-9]+ passed|failed|host reads" env DRAFTSMITH_TEST_DEVICE=$TESTS "$PY" -m pytest -q -s \
    -p no:cacheprovider -m "not slow" tests/test_devices.py
step a exactness 120 "[0-9]+ passed|failed|p-value" env DRAFTSMITH_TEST_DEVICE=$TESTS "$PY" -m pytest -q -s \
    -p no:cacheprovider tests/test_exactness.py -k "$EXACT"
step a costs_8b 240 "^(ours|hf)_| c=|v\(" "$PY" -m draftsmith.deploy.cli bench sampler --target "$BIG" \
    --device $TORCH --dtype $DTYPE --cut-layers $CUT --paper-draft --n-prompts $PROMPTS --max-new-tokens $NEW \
    --json "$SCRATCH/costs_8b.json"
step a costs_demo 120 "^ours_| c=" "$PY" -m draftsmith.deploy.cli bench sampler --target "$DEMO" --device $TORCH \
    --dtype $DTYPE --cut-layers 3 --no-self-draft --n-prompts 1 --max-new-tokens $NEW --json "$SCRATCH/costs_demo.json"
# part b
REPORT="^  [a-z_0-9]+ +[a-z_]+ +[0-9.]+ +[0-9.]+|c = |throughput|peak GPU"  # the run's acceptance table and costs
FRESH=$SCRATCH/runs/smoke KEEPS=("$SCRATCH/runs/smoke/best_draft")
step b smoke 150 "$REPORT" "${TRAIN[@]}" recipe=smoke trainer=$TRAINER trainer.devices=1 trainer.precision=$PRECISION \
    hydra.run.dir="$SCRATCH/runs/smoke"
# the export's own measurement at the dry run's sizes: what the check needs is that it runs on the GPU
FRESH=$SCRATCH/runs/smoke_bundle
step b smoke_export 120 "alpha|recommended|c = |c=" "$PY" -m draftsmith.deploy.cli export "$SCRATCH/runs/smoke" \
    --out "$SCRATCH/runs/smoke_bundle" --device $TORCH --n-prompts 2 --max-new-tokens 16
# the default recipe's draft (3 layers copied from the target, its width, a pruned head) against every layer of
# the 8B shape, on a fixed corpus (the random target samples noise) for 2 epochs: the first visits every block
# with the target's pass, the second reads the kept logits. On a GPU through the GPU recipe (shallow_wide, the CPU
# demo, is refused with a GPU trainer); the dry run maps it to shallow_wide, as it maps the trainer. The recipe's
# 500 warm-up steps outlast the run's ~120: the LR never leaves its ramp, which the throughput figures do not mind.
# Training stops after 2 min whatever the steps (~30 s by estimate), and the report still fits the step's limit
SHAPE=(recipe=$RECIPE target.name="$BIG" data=fixed "${BIGTRAIN[@]}" trainer=$TRAINER trainer.devices=1)
step b plan_8b 90 "draft:|total|GiB" "${TRAIN[@]}" "${SHAPE[@]}" plan=true hydra.run.dir="$SCRATCH/runs/plan8b"
FRESH=$SCRATCH/runs/train8b KEEPS=("$SCRATCH/runs/train8b")
step b train_8b 300 "$REPORT" "${TRAIN[@]}" "${SHAPE[@]}" ++trainer.max_epochs=2 trainer.max_steps=-1 \
    trainer.max_time=00:00:02:00 trainer.log_every_n_steps=1 trainer.val_check_interval=100000 \
    sampler.on_target_prompts=2 sampler.n_prompts=2 eval.n_prompts=2 "eval.prompt_sets=[code]" eval.baseline=false \
    hydra.run.dir="$SCRATCH/runs/train8b"
step b visits_8b 30 "tokens/s" "$PY" "$HELPER" visits "$SCRATCH/runs/train8b"
# part c (optional). One GPU: ZeRO and FSDP run their code paths, checkpoints and resume, but shard over one rank:
# they prove no sharding
if [ "$DEVICE" = cuda ]; then
    for s in deepspeed_stage_2 deepspeed_stage_3 fsdp; do
        FRESH=$SCRATCH/runs/$s KEEPS=("$SCRATCH/runs/$s/checkpoints/last.ckpt")
        step c "$s" 240 "$REPORT" "${TRAIN[@]}" recipe=smoke trainer=$s trainer.devices=1 \
            trainer.max_steps=20 trainer.val_check_interval=10 hydra.run.dir="$SCRATCH/runs/$s" \
        && step c "${s}_resume" 240 "$REPORT" "${TRAIN[@]}" recipe=smoke trainer=$s \
            trainer.devices=1 trainer.max_steps=30 trainer.val_check_interval=10 ckpt_path=last \
            hydra.run.dir="$SCRATCH/runs/$s"
    done
else
    STAND_IN="Lightning refuses DeepSpeed and FSDP without CUDA: DDP on 2 gloo processes, 20 steps then a resume"
    FRESH=$SCRATCH/runs/ddp KEEPS=("$SCRATCH/runs/ddp/checkpoints/last.ckpt")
    step c ddp 300 "$REPORT" "${TRAIN[@]}" recipe=smoke trainer=ddp trainer.max_steps=20 \
        trainer.val_check_interval=10 hydra.run.dir="$SCRATCH/runs/ddp" \
    && step c ddp_resume 300 "$REPORT" "${TRAIN[@]}" recipe=smoke trainer=ddp \
        trainer.max_steps=30 trainer.val_check_interval=10 ckpt_path=last hydra.run.dir="$SCRATCH/runs/ddp"
fi
echo "gpu_check: $([ $failed = 0 ] && echo 'every step passed' || echo 'some steps FAILED') in ${SECONDS}s" \
     "(logs and summary.json in $OUT)"
exit $failed
