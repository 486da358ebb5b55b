"""Run by tests/test_fsdp.py under torchrun (2 gloo processes): PyTorch FSDP on CPU with the strategy our
`trainer=fsdp` recipe builds for a draft (train/strategy.py). Lightning refuses FSDP without CUDA, and passes FSDP
`device_id=root_device.index`, which is None on a CPU; FSDP itself runs on a CPU given `device_id=cpu`, so the
worker wraps as Lightning's `_setup_model` does (the strategy's sharding strategy and kwargs), with that device."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from transformers import AutoModelForCausalLM, LlamaConfig

from draftsmith.drafts.build import DraftConfig, draft_config_for
from draftsmith.train.schema import register
from draftsmith.train.strategy import build_strategy

register()  # the config schema recipes/draft.yaml starts from

out, freeze = Path(sys.argv[1]), sys.argv[2] == "frozen"
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
recipes = Path(__file__).resolve().parent.parent / "recipes"
with initialize_config_dir(config_dir=str(recipes), version_base="1.3"):
    cfg = compose("draft", overrides=["out_dir=/tmp/unused", "trainer=fsdp"])
torch.manual_seed(0)
tc = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=30, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=False)
draft = AutoModelForCausalLM.from_config(draft_config_for(tc, DraftConfig()))
if freeze:  # draft.freeze_embeddings: frozen and trained parameters in one FSDP unit
    draft.get_input_embeddings().requires_grad_(False)
layer_params = sum(p.numel() for p in draft.model.layers[0].parameters())
embedding = draft.get_input_embeddings().weight.detach().clone()
total = sum(p.numel() for p in draft.parameters())
strategy = build_strategy(cfg.trainer.strategy, draft)
model = FSDP(draft, sharding_strategy=strategy.sharding_strategy, device_id=torch.device("cpu"), **strategy.kwargs)
units = [m for m in model.modules() if isinstance(m, FSDP)]
local = sum(p.numel() for p in model.parameters())  # each unit keeps 1 / world of its parameters (padded to divide)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
losses = []
for _ in range(3):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
state = sum(t.numel() for s in opt.state.values() for t in s.values() if t.dim())
with FSDP.summon_full_params(model):
    embedding_kept = bool(torch.equal(draft.get_input_embeddings().weight.detach(), embedding))
result = {"units": len(units), "layers": len(draft.model.layers), "layer_params": layer_params, "params": total,
          "local": local, "embedding_kept": embedding_kept, "losses": losses, "moments": state, "world": world,
          "policy": sorted(c.__name__ for c in getattr(strategy.kwargs.get("auto_wrap_policy"), "_module_classes",
                                                       ()))}
(out / f"rank{rank}.json").write_text(json.dumps(result))
# leave together, then skip the interpreter's teardown, as tests/ds_worker.py does: there, after all was written, a
# rank aborted now and then (CI, and 2 of 42 runs here: "terminate called without an active exception", exit -6, no
# Python frame) when the process group FSDP still holds died with the interpreter
dist.barrier()
dist.destroy_process_group()
os._exit(0)
