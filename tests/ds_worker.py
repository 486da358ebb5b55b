"""Run by tests/test_deepspeed.py under torchrun: the real DeepSpeed ZeRO engine on CPU (gloo) with the config
our `trainer=deepspeed_stage_N` recipe produces. Lightning refuses DeepSpeed without CUDA; the engine does not."""

import json
import os
import sys
from pathlib import Path

import deepspeed
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.train.schema import register

register()  # the config schema recipes/draft.yaml starts from
stage, out = int(sys.argv[1]), Path(sys.argv[2])
recipes = Path(__file__).resolve().parent.parent / "recipes"
with initialize_config_dir(config_dir=str(recipes), version_base="1.3"):
    cfg = compose("draft", overrides=["out_dir=/tmp/unused", f"trainer=deepspeed_stage_{stage}"])
ds_config = dict(instantiate(cfg.trainer.strategy).config)
ds_config.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1)
ds_config.pop("fp16", None)
ds_config.pop("bf16", None)  # CPU engine: fp32
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=2, intermediate_size=64))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(engine.global_rank))
losses = []
for _ in range(4):
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
engine.save_checkpoint(str(out / "ckpt"))
# the whole weights as a reference for the checkpoint reader (collective under ZeRO-3: every rank gathers)
with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
    whole = {k: v.detach().float().clone() for k, v in engine.module.named_parameters()}
if engine.global_rank == 0:
    from safetensors.torch import save_file

    save_file(whole, str(out / "whole.safetensors"))
    result = {"losses": losses, "optimizer": type(engine.optimizer).__name__, "world_size": engine.world_size,
              "stage": engine.zero_optimization_stage()}
    (out / "result.json").write_text(json.dumps(result))
# leave together, then skip the interpreter's teardown: there a rank aborted now and then ("terminate called without
# an active exception", exit -6) after all the work was done and written, in DeepSpeed's CPU communication threads,
# with or without destroy_process_group
torch.distributed.barrier()
os._exit(0)
