#!/usr/bin/env bash
# bash scripts/gpu_check.sh [OUT]      (on a CUDA machine; ~8 min on one H200; one line per step, its seconds)
# Everything the CPU tests cannot show, on one GPU, in order of what matters most:
#   1. the stand-in-device tests (tests/test_devices.py) with device=cuda, and the sampler's host reads counted
#      by CUDA's own sync debug mode
#   2. recipe=smoke in bf16 with validation, then its export measured on the GPU
#   3. the sampler on an 8B-shape target (random weights) and its 3-layer cut: ArS vs SpS tokens/s, c and v(K)
#   4. a shallow_wide-shaped draft (3 layers, a pruned head) trained 90 s against that target (8 of its layers):
#      tokens/s/GPU and peak GPU memory, beside the plan's figure for the same settings
#   5. ZeRO-2, ZeRO-3 and FSDP: 20 steps each, then a resume to 30
# With .whl/ present (bash scripts/fetch_gpu_wheels.sh, here), installs those wheels first with --no-deps into
# /tmp/site: the lent machine has no registry, and lacks hydra, omegaconf, datasets and deepspeed.
# GPU_CHECK_STEPS="1 2" runs a subset. On a machine without CUDA it refuses in one line.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-$(mktemp -d)}}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False): run it on a GPU machine" >&2
    exit 2
fi
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "gpu_check: the wheels in .whl/ did not install" >&2; exit 2; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export DRAFTSMITH_HOME=${DRAFTSMITH_HOME:-$OUT/home}
STEPS=${GPU_CHECK_STEPS:-1 2 3 4 5}
failed=0
"$PY" -c "import torch, transformers, lightning; print('gpu_check:', torch.cuda.get_device_name(0), 'x',
torch.cuda.device_count(), '| torch', torch.__version__, '| transformers', transformers.__version__, '| lightning',
lightning.__version__)"

# step NAME LIMIT_S CMD...: runs CMD (its output in $OUT/NAME.log), prints one line: the step, ok or FAILED, seconds,
# and the lines of the log that CMD's summary greps for (after the command, as `| grep` would not see a failure)
step() {
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$? took=$((SECONDS - t0))
    if [ $rc -eq 0 ]; then echo "[ok] $name (${took}s)"; else echo "[FAILED rc=$rc] $name (${took}s): $(tail -3 "$OUT/$name.log" | tr '\n' ' ' | cut -c1-400)"; failed=1; fi
    return $rc
}
show() { grep -E "$2" "$OUT/$1.log" | head -"${3:-12}" | sed 's/^/    /'; }
train() { "$PY" train/draft.py "$@" logger=csv; }
on() { [[ " $STEPS " == *" $1 "* ]]; }

if on 1; then
    step devices_on_cuda 240 env DRAFTSMITH_TEST_DEVICE=cuda "$PY" -m pytest -q -s -p no:cacheprovider -m "not slow" \
        tests/test_devices.py
    show devices_on_cuda "passed|failed|host reads" 4
fi
if on 2; then
    step smoke_bf16 240 train recipe=smoke trainer=gpu trainer.devices=1 trainer.precision=bf16-mixed \
        hydra.run.dir="$OUT/smoke" && show smoke_bf16 "best draft|alpha|c =|throughput|peak GPU"
    step smoke_export 180 "$PY" -m draftsmith.deploy.cli export "$OUT/smoke" --out "$OUT/smoke_bundle" --device cuda \
        && show smoke_export "bundle|alpha|recommended"
fi
TARGET8B="random:llama3-8b-shape"
if on 3; then
    step sampler_8b 300 "$PY" -m draftsmith.deploy.cli bench sampler --target "$TARGET8B" --device cuda --dtype bf16 --cut-layers 3 \
        --no-self-draft --prompts 3 --max-new-tokens 128 && show sampler_8b "tok/s|tokens/s|speed|c =|v\(|ArS|SpS" 16
fi
if on 4; then
    # the default recipe's draft (3 layers copied from the target, its width, an 8192-token head) on 8 of the 8B
    # shape's layers, on a fixed corpus (the target's random weights sample noise)
    SHAPE=(recipe=shallow_wide target.name="$TARGET8B:8" draft.layers=3 data=fixed data.max_documents=300
           data.block_size=512 data.batch_size=8 trainer=gpu trainer.devices=1)
    step plan_8b 120 train "${SHAPE[@]}" plan=true hydra.run.dir="$OUT/plan8b" && show plan_8b "draft:|ddp|total"
    step train_8b 400 train "${SHAPE[@]}" trainer.max_time=00:00:01:30 trainer.val_check_interval=100000 \
        sampler.on_target_prompts=2 sampler.n_prompts=2 eval.n_prompts=2 eval.baseline=false \
        hydra.run.dir="$OUT/train8b" && show train_8b "throughput|peak GPU|best draft"
fi
if on 5; then
    for s in deepspeed_stage_2 deepspeed_stage_3 fsdp; do
        step "$s" 240 train recipe=smoke trainer=$s trainer.devices=1 trainer.max_steps=20 trainer.val_check_interval=10 \
            hydra.run.dir="$OUT/$s" && step "${s}_resume" 240 train recipe=smoke trainer=$s trainer.devices=1 \
            trainer.max_steps=30 trainer.val_check_interval=10 ckpt_path=last hydra.run.dir="$OUT/$s" \
            && show "${s}_resume" "best draft|Restored|resum" 3
    done
fi
echo "gpu_check: $([ $failed = 0 ] && echo 'every step passed' || echo 'some steps FAILED') (logs in $OUT)"
exit $failed
