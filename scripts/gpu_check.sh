#!/usr/bin/env bash
# bash scripts/gpu_check.sh        (on a CUDA machine, after `pip install -e ".[dev,deepspeed]"`; ~10 min on one GPU)
# The checks that need a GPU, in one run: the sampler and its costs on CUDA fed CPU inputs, the smoke recipe on one
# GPU in bf16, DDP across the visible GPUs, DeepSpeed ZeRO-2/3 a few steps each with a resume. Prints each step's
# result; exits non-zero on the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device: run this on a GPU node'; \
print('GPU:', torch.cuda.get_device_name(0), 'x', torch.cuda.device_count(), 'torch', torch.__version__)"
out=${GPU_CHECK_OUT:-$(mktemp -d)}
echo "== 1. sampler and costs on CUDA (pytest -m gpu)"
python -m pytest -q -m gpu -p no:cacheprovider tests/test_devices.py
echo "== 2. recipe=smoke on one GPU"
python train/draft.py recipe=smoke trainer=gpu trainer.devices=1 hydra.run.dir="$out/smoke_gpu" | tail -12
n=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$n" -ge 2 ]; then
  echo "== 3. DDP over $n GPUs"
  python train/draft.py recipe=smoke trainer=ddp trainer.accelerator=gpu trainer.devices="$n" \
    hydra.run.dir="$out/smoke_ddp" | tail -6
else
  echo "== 3. DDP skipped: one GPU visible"
fi
for stage in 2 3; do
  echo "== 4. DeepSpeed ZeRO-$stage, then a resume from last"
  python train/draft.py recipe=smoke trainer=deepspeed_stage_$stage trainer.max_steps=20 \
    hydra.run.dir="$out/ds$stage" | tail -4
  python train/draft.py recipe=smoke trainer=deepspeed_stage_$stage trainer.max_steps=30 ckpt_path=last \
    hydra.run.dir="$out/ds$stage" | tail -4
done
echo "gpu_check: all steps ran ($out)"
