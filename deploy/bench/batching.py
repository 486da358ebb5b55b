"""Chat samples batched per sample (length-bucketed padding, data/chat.py) against today's packing, in real
(non-padding) tokens per second of a draft's training step (forward, cross-entropy, backward, AdamW step).

    draftsmith bench batching                               # 400 ShareGPT conversations, the demo target's template
    draftsmith bench batching --conversations 200 --block 256 --layers 2

Packing runs the same tokens end to end in full blocks (no padding, but samples see each other: what the chat path
refuses); padding pays for its pad positions. The two alternate step by step in one process, so the machine's noise
falls on both; medians are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from draftsmith.sampling.cli import examples


def main(argv=None, prog=None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0], epilog=examples(__doc__),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m", help="whose tokenizer, template and width")
    ap.add_argument("--conversations", type=int, default=400)
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4, help="the draft's layers, at the target's width")
    ap.add_argument("--steps", type=int, default=12, help="steps of each, alternating")
    a = ap.parse_args(argv)
    from collections import Counter

    from transformers import AutoConfig, LlamaForCausalLM

    from draftsmith.data.chat import chat_batches, cut, padding_share, render
    from draftsmith.data.conversations import read_conversations
    from draftsmith.sampling.load import load_tokenizer
    from draftsmith.sampling.names import resolve

    tok = load_tokenizer(a.target)
    convs = read_conversations("sharegpt", limit=a.conversations, quiet=True)
    counts = Counter()
    samples = [s for s in (cut(render(tok, c.messages), a.block, counts) for c in convs) if s is not None]
    padded = chat_batches(samples, a.batch, tok.pad_token_id or 0)
    flat = torch.tensor([t for s in samples for t in s.ids])
    n = len(flat) // (a.block * a.batch)
    packed = flat[: n * a.block * a.batch].view(n, a.batch, a.block)
    cfg = AutoConfig.from_pretrained(resolve(a.target))
    cfg.num_hidden_layers = a.layers
    torch.manual_seed(0)
    draft = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-4)

    def step(ids, mask=None):
        t0 = time.perf_counter()
        pos = None if mask is None else (mask.cumsum(1) - 1).clamp_min(0)
        logits = draft(input_ids=ids[:, :-1], attention_mask=None if mask is None else mask[:, :-1],
                       position_ids=None if pos is None else pos[:, :-1]).logits
        labels = ids[:, 1:] if mask is None else ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
        opt.step()
        opt.zero_grad()
        return (ids.numel() if mask is None else int(mask.sum())) / (time.perf_counter() - t0)

    rates = {"padded": [], "packed": []}
    g = torch.Generator().manual_seed(0)
    for i in range(a.steps + 2):
        b = padded[int(torch.randint(len(padded), (1,), generator=g))]
        r_pad, r_pack = step(b["ids"], b["mask"]), step(packed[i % len(packed)])
        if i >= 2:  # the first steps warm the allocator
            rates["padded"].append(r_pad)
            rates["packed"].append(r_pack)
    print(f"{len(samples)} conversations of sharegpt ({dict(counts)}), block {a.block}, batch {a.batch}, "
          f"a {a.layers}-layer draft at {a.target}'s width; padding share {padding_share(padded):.1%}")
    for name, r in rates.items():
        print(f"{name:>7}: {statistics.median(r):8.0f} real tokens/s (median of {len(r)} steps; min {min(r):.0f}, "
              f"max {max(r):.0f})")
    print(f"padded / packed: {statistics.median(rates['padded']) / statistics.median(rates['packed']):.2f}")
    return 0
