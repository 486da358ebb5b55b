"""Shared statistical helpers for the exactness tests: the same chi-square that judges engines."""

from collections import defaultdict

import torch

from draftsmith.sampling.exactness import chi2_pvalue


def counts_of(gen) -> dict:
    """How often each generated row (a tuple of token ids) occurs in a batched generation."""
    counts = defaultdict(int)
    for t in gen.tokens:
        counts[tuple(t.tolist())] += 1
    return counts


def sample_counts(fn, n_rows, budget, prompt):
    """(counts, stats) of `fn` run once on `n_rows` copies of `prompt` (`budget`: the tokens each row may add)."""
    gen = fn(torch.tensor([prompt]).repeat(n_rows, 1))
    return counts_of(gen), gen.stats


def pvalue(counts, exact) -> float:
    """Chi-square p-value of sequence counts against exact sequence probabilities."""
    keys = sorted(set(exact) | set(counts))
    return chi2_pvalue([counts.get(s, 0) for s in keys], [exact.get(s, 0.0) for s in keys])


def fit_losses(module, blocks, tmp_path, steps: int = 6) -> list[float]:
    """A real Lightning fit of `module` on `blocks` (batches of 4, with their row indices, no validation): the
    train/loss of every step."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    seen = []
    module.log = lambda name, v, **kw: seen.append(float(v)) if name == "train/loss" else None
    data = DataLoader(TensorDataset(blocks, torch.arange(len(blocks))), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, default_root_dir=tmp_path, limit_val_batches=0)
    trainer.fit(module, data)
    return seen


def wandb_records(path) -> list:
    """The records of an offline W&B run file (`run-*.wandb`: what `wandb sync` uploads): a 7-byte header, then a
    LevelDB-style log of 32 KiB blocks whose chunks (4-byte CRC, 2-byte length, 1-byte type: full, first, middle,
    last) carry serialised `Record` protos."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    out, pos, block, parts = [], 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos: pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        parts += data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full or last: a whole record
            rec = pb.Record()
            rec.ParseFromString(parts)
            out.append(rec)
            parts = b""
    return out
