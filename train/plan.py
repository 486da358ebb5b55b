"""The plan before a large run: the draft's shape and what each rank holds under each strategy, from the target's
config alone (no weights are read, nothing is allocated: the models are built on the meta device).

    python train/draft.py recipe=paper_ratio_70b plan=true
    python train/draft.py recipe=shallow_wide target.name=DIR_WITH_CONFIG_JSON plan=true trainer.devices=8

Bytes per trained parameter follow mixed-precision AdamW (Lightning's `bf16-mixed`, DeepSpeed and FSDP alike):
fp32 weights 4, fp32 gradients 4, two fp32 moments 8. DDP replicates all 16 on each rank; ZeRO-2 shards the
gradients and moments over the ranks; ZeRO-3 and FSDP shard all of it. The frozen target is bf16 (2 bytes a
parameter) on every rank that holds it, or once, spread over a node's GPUs, where no rank needs it to train
(`target.ranks=first`). Activations of one micro-batch: s*b*h*(34 + 5*a*s/h) bytes a layer
(Korthikanti et al. 2022, no recomputation), an upper bound that counts every intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GB = 1024**3
STRATEGIES = ("ddp", "deepspeed_stage_2", "deepspeed_stage_3", "fsdp")


def meta_params(config) -> int:
    """Parameters of the causal LM `config` describes, counted without allocating it (tied weights once)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@dataclass
class Plan:
    draft_layers: int
    draft_hidden: int
    draft_params: int
    target_params: int
    ranks: int
    batch: int
    block: int
    activations: int  # bytes of one micro-batch's activations, the draft's layers
    devices_per_node: int = 1

    def per_rank(self, strategy: str) -> dict[str, float]:
        """Bytes one rank holds for the draft's training state, by part."""
        n, p = self.ranks, self.draft_params
        weights, grads, moments = 4 * p, 4 * p, 8 * p
        if strategy == "deepspeed_stage_2":
            grads, moments = grads / n, moments / n
        elif strategy in ("deepspeed_stage_3", "fsdp"):
            weights, grads, moments = weights / n, grads / n, moments / n
        elif strategy != "ddp":
            raise ValueError(f"unknown strategy {strategy!r}: one of {', '.join(STRATEGIES)}")
        return {"weights": weights, "gradients": grads, "optimizer": moments, "activations": self.activations,
                "target (bf16 replica)": 2 * self.target_params}


def plan(target_config, draft_config, ranks: int, batch: int, block: int, devices_per_node: int | None = None) -> Plan:
    d = draft_config
    s, h, a = block, d.hidden_size, d.num_attention_heads
    activations = int(d.num_hidden_layers * s * batch * h * (34 + 5 * a * s / h))
    return Plan(d.num_hidden_layers, h, meta_params(d), meta_params(target_config), ranks, batch, block,
                activations, devices_per_node or ranks)


def print_plan(p: Plan, target_name: str, target_config) -> None:
    tc = target_config
    print(f"plan for {target_name}: target {tc.num_hidden_layers} layers, d {tc.hidden_size}, "
          f"{p.target_params / 1e9:.2f} B parameters ({2 * p.target_params / GB:.1f} GB in bf16)")
    print(f"draft: {p.draft_layers} layers, d {p.draft_hidden}, {p.draft_params / 1e9:.3f} B parameters "
          f"({p.draft_layers / tc.num_hidden_layers:.2f} of the depth, {p.draft_hidden / tc.hidden_size:.2f} of "
          f"the width)")
    print(f"per rank, {p.ranks} rank(s), micro-batch {p.batch} x {p.block} tokens (GB):")
    parts = list(p.per_rank("ddp"))
    print(f"  {'strategy':<18}" + "".join(f"{k:>22}" for k in parts) + f"{'total':>10}")
    for s in STRATEGIES:
        row = p.per_rank(s)
        print(f"  {s:<18}" + "".join(f"{v / GB:>22.2f}" for v in row.values())
              + f"{sum(row.values()) / GB:>10.2f}")
    if p.ranks > 1:
        share = 2 * p.target_params / p.devices_per_node
        print(f"with target.ranks=first (every training block has the target's kept logits), no rank holds a replica:"
              f"\n  rank 0 holds the target once, spread over the node's {p.devices_per_node} GPU(s) by "
              f"target.device_map=auto ({share / GB:.2f} GB on each), the other ranks none:")
        for s in STRATEGIES:
            row = p.per_rank(s)
            train = sum(row.values()) - row["target (bf16 replica)"]
            print(f"  {s:<18} {train / GB:>8.2f} GB per rank, {(train + share) / GB:.2f} on a GPU holding a share")
