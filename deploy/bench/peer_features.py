"""The target's hidden states for the peers' trainers, written by a plain transformers pass: run by a peer's venv
python (`peers.py`), it imports no draftsmith (the peer's venv has none).

Neither peer can make them here: speculators writes them through vLLM (a hidden-states connector), SpecForge
through an SGLang server. Both read files, so one forward pass per row writes what each reads:

- speculators (`--speculators DIR`): `DIR/hs_{i}.safetensors` for row i of its prepared dataset, in its order,
  `hidden_states` [T, n_layers + 1, H] and `token_ids` [T]. Layer id i in vLLM's numbering is the state entering
  target layer i (HF's `hidden_states[i]`, the output of decoder layer i - 1); the last slot is the output of the
  last decoder layer BEFORE the final norm (speculators applies the target's norm and head to it itself).
- SpecForge (`--specforge DIR`): `DIR/{i:08d}.ckpt`, a torch.save of `input_ids`, `loss_mask`, `aux_hidden_state`
  [1, T, n_layers * H] (the same states) and `hidden_state` [1, T, H] AFTER the final norm (its target head is
  the lm_head alone): the aux states in its draft's dtype (`--specforge-dtype`: it does not cast them), the last
  in bf16, the dtype its target head always runs in.

Hooks on the decoder layers' outputs rather than `output_hidden_states`, whose last entry some transformers
versions return after the final norm.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def _rows(args):
    """(input_ids, loss_mask) per row, in the order the trainer reads them."""
    if args.prepared:  # speculators' prepared dataset (it shuffles: its row i is file i)
        from datasets import load_from_disk

        ds = load_from_disk(args.prepared)
        for row in ds:
            yield list(row["input_ids"]), list(row["loss_mask"])
    else:
        with open(args.rows) as f:
            for line in f:
                row = json.loads(line)
                yield row["input_ids"], row["loss_mask"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="the target's checkpoint directory (safetensors)")
    ap.add_argument("--layers", type=int, nargs="+", required=True, help="vLLM ids: the state entering layer i")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prepared", help="speculators' prepared dataset (datasets.save_to_disk)")
    src.add_argument("--rows", help="a JSONL of {input_ids, loss_mask}")
    ap.add_argument("--speculators", help="write speculators' hs_{i}.safetensors here")
    ap.add_argument("--specforge", help="write SpecForge's {i:08d}.ckpt here")
    ap.add_argument("--specforge-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="SpecForge feeds the stored aux states to its draft as they are: its draft's dtype")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    layers = model.model.layers
    n = len(layers)
    if any(not 0 <= i <= n for i in args.layers):
        raise SystemExit(f"layer ids must be in 0..{n} (the state entering layer i; 0: the embedding's output)")
    got: dict = {}

    def keep(name):
        def hook(_module, _inputs, output):  # a decoder layer returns a tensor (transformers 5) or a tuple
            got[name] = output[0] if isinstance(output, tuple) else output
        return hook

    # id 0 (a small target's default, as our feature draft counts) is the embedding's output
    hooks = [(layers[i - 1] if i else model.model.embed_tokens).register_forward_hook(keep(i))
             for i in sorted(set(args.layers + [n]))]
    hooks.append(model.model.norm.register_forward_hook(keep("norm")))
    outs = [Path(p) for p in (args.speculators, args.specforge) if p]
    for p in outs:
        p.mkdir(parents=True, exist_ok=True)
    count = tokens = 0
    sf_dtype = getattr(torch, args.specforge_dtype)
    with torch.inference_mode():
        for i, (ids, mask) in enumerate(_rows(args)):
            x = torch.tensor([ids], dtype=torch.long)
            got.clear()
            model.model(input_ids=x)  # the decoder alone: the head's logits are not needed
            aux = [got[j][0] for j in args.layers]  # [T, H] each
            if args.speculators:
                hs = torch.stack(aux + [got[n][0]], 1).to(torch.bfloat16).contiguous()  # pre-norm last state
                save_file({"hidden_states": hs, "token_ids": x[0].clone()},
                          str(Path(args.speculators) / f"hs_{i}.safetensors"))
            if args.specforge:
                torch.save({"input_ids": x[0].clone(), "loss_mask": torch.tensor(mask, dtype=torch.long),
                            "aux_hidden_state": torch.cat(aux, -1)[None].to(sf_dtype).clone(),
                            # its target head is bf16 whatever the draft's dtype (TargetHead casts itself so)
                            "hidden_state": got["norm"][0][None].to(torch.bfloat16).clone()},
                           Path(args.specforge) / f"{i:08d}.ckpt")
            count, tokens = count + 1, tokens + len(ids)
    for h in hooks:
        h.remove()
    print(json.dumps({"rows": count, "tokens": tokens}))


if __name__ == "__main__":
    main()
