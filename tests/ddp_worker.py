"""Run by tests/test_ddp.py under torchrun (2 gloo processes): a real Lightning DDP fit of a DraftModule with an
on-policy share, where rank 1's loss is made NaN at one step (planted). Each rank writes what it saw."""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from conftest import tiny_llama
from torch.utils.data import DataLoader, TensorDataset

import draftsmith.train.module as module_mod
from draftsmith.train.module import DraftModule
from draftsmith.train.onpolicy import OnPolicy

out, bad_step = Path(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
V = 32
target = tiny_llama(vocab=V, layers=2, hidden=32, seed=0)
draft = tiny_llama(vocab=V, layers=1, hidden=32, seed=1).requires_grad_(True).train()
prompts = torch.randint(0, V, (64, 4), generator=torch.Generator(device="cpu").manual_seed(0), device="cpu")
on_policy = OnPolicy(0.5, (prompts, torch.ones_like(prompts)), temperature=1.0, buffer=2, seed=0)
module = DraftModule(draft, target, loss={"distill": True, "weights": {"forward_kl": 1.0}, "compile": False},
                     optim={"lr": 1e-2, "warmup_steps": 1}, sampler={"temperature": 1.0}, max_steps=6,
                     on_policy=on_policy)
sampled, sums = [], {}
real_loss, real_refill = module_mod.draft_loss, on_policy._refill


def planted_loss(*args, **kwargs):
    total, parts = real_loss(*args, **kwargs)
    if trainer.global_rank == 1 and trainer.global_step == bad_step:
        total = total * float("nan")
    return total, parts


def recorded_refill(*args, **kwargs):
    real_refill(*args, **kwargs)
    sampled.append([r[0].tolist() for r in on_policy._rows])


module_mod.draft_loss, on_policy._refill = planted_loss, recorded_refill


class Sums(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        sums[trainer.global_step] = float(sum(p.double().sum() for p in pl_module.draft.parameters()))


blocks = torch.randint(0, V, (48, 12), generator=torch.Generator(device="cpu").manual_seed(1), device="cpu")
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=6, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Sums()])
trainer.fit(module, DataLoader(TensorDataset(blocks, torch.arange(len(blocks))), batch_size=4))
(out / f"rank{trainer.global_rank}.json").write_text(json.dumps(
    {"sums": sums, "nonfinite": module.nonfinite_steps, "sampled": sampled[0]}))
