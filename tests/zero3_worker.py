"""Run by tests/test_deepspeed.py under torchrun: a DraftModule with a pruned head inside a real DeepSpeed ZeRO-3
engine on CPU (gloo), where every parameter is a shard outside its owner's forward. Steps its training objective,
and copies its draft for the sampler as the acceptance callback does."""

import json
import sys
from pathlib import Path

import deepspeed
import torch
from conftest import tiny_llama

from draftsmith.drafts.batch import Batch
from draftsmith.train.callbacks import standalone
from draftsmith.train.losses import draft_loss
from draftsmith.train.module import DraftModule

out = Path(sys.argv[1])
deepspeed.init_distributed(dist_backend="gloo")
V = 32
target = tiny_llama(vocab=V, layers=2, hidden=32, seed=0)
draft = tiny_llama(vocab=V, layers=1, hidden=32, seed=1).requires_grad_(True).train()
head = torch.tensor([0, 3, 5, 7, 9, 30])
loss = {"distill": True, "temperature": 1.0, "weights": {"tv": 1.0, "forward_kl": 1.0}, "compile": False}
module = DraftModule(draft, target, loss=loss, optim={"lr": 1e-2}, sampler={"temperature": 1.0}, max_steps=4,
                     head_tokens=head)
opt = torch.optim.AdamW(module.draft.parameters(), lr=1e-2)
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3}}
engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=config)
module.on_fit_start()
weight = module.draft.get_output_embeddings().weight
shard = weight.numel()  # what a read outside any forward sees under ZeRO-3
ids = torch.randint(0, V, (2, 10), generator=torch.Generator(device="cpu").manual_seed(engine.global_rank),
                    device="cpu")
losses = []
for _ in range(3):
    logits, tlogits, labels, weights = module.objective.train_outputs(module, Batch(ids), None)
    total, _ = draft_loss(logits, labels, tlogits, loss["weights"], 1.0, False, weights)
    engine.backward(total)
    engine.step()
    losses.append(float(total))
with deepspeed.zero.GatheredParameters(list(module.draft.parameters()), modifier_rank=None):
    copy = standalone(module.sampling_draft(), torch.float32)
    whole = module.sampling_draft()(input_ids=ids).sub_logits
plain = not any(hasattr(p, "ds_id") for p in copy.parameters())
again = copy(input_ids=ids).sub_logits  # outside the gather: the copy holds its own weights
result = {"shard": shard, "logits": list(logits.shape), "losses": losses, "plain": plain,
          "same": bool(torch.allclose(again, whole)), "head": int(copy.head.weight.shape[0])}
(out / f"zero3_rank{engine.global_rank}.json").write_text(json.dumps(result))
