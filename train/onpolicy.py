"""On-policy batches (DistillSpec, Zhou et al. 2023): the draft learns on the sequences it samples itself.

A draft trained on a fixed corpus learns the corpus, not what the target samples: measured, alpha_analytic 0.756
teacher-forced on held-out stdlib text against alpha 0.34 on the target's own code samples. DistillSpec found the
data matters more than the divergence, and on-policy data wins: in the training step the current draft samples
continuations of prompts (the bundled sampler's batched, KV-cached decoding, at the deployment temperature and
top-p), the frozen target scores them in one teacher-forced pass, and the divergence is taken on the sampled
positions only. `fraction` of each batch is on-policy, the rest stays fixed corpus (DistillSpec's lambda).
"""

from __future__ import annotations

import torch

from draftsmith.drafts.batch import Batch
from draftsmith.sampling import autoregressive_generate
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.machine import seeded


class OnPolicy:
    """Turns a fixed-corpus batch into a mixed one: its first round(fraction * B) rows are replaced by prompts
    continued by the draft. Prompts are `prompts` rows ((N, P) left-padded ids and mask: corpus openings or a
    prompts file), drawn at random. Continuations fill the block exactly (EOS does not stop them), so every batch
    has the same shape and the compiled loss never recompiles.

    Decoding is sequential in tokens but nearly free in rows (a memory-bound pass reads the same weights for 4 rows
    or 32), so `buffer` rows are sampled at once and used over the next steps: with 4 on-policy rows a step and
    a buffer of 16, the draft that sampled a row is at most 3 optimiser steps old."""

    def __init__(self, fraction: float, prompts: tuple[torch.Tensor, torch.Tensor], *, temperature: float,
                 top_p: float = 1.0, top_k: int = 0, buffer: int = 16, seed: int = 0, start: float = 0.0):
        if not 0.0 <= fraction <= 1.0:
            raise DraftsmithError(f"data.on_policy_fraction must be in [0, 1], got {fraction}")
        if not 0.0 <= start < 1.0:
            raise DraftsmithError(f"data.on_policy_from must be in [0, 1), got {start}")
        self.fraction, self.prompts, self.buffer, self.start = fraction, prompts, buffer, start
        self.sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
        self.seed = seed
        self.generator = torch.Generator(device="cpu").manual_seed(seed)  # picks rows and seeds: host-side
        self._rows: list[tuple[torch.Tensor, torch.Tensor]] = []  # sampled (ids, mask) rows not yet trained on
        self.sampled_rows = 0

    def seed_rank(self, rank: int) -> None:
        """Every rank its own stream of prompts and samples (rank 0 keeps the seed's): with one seed everywhere,
        each rank would sample the same rows, and data parallelism would train on one rank's samples N times."""
        self.generator.manual_seed(self.seed + 1_000_003 * rank)

    def rows(self, batch_size: int) -> int:
        return int(round(self.fraction * batch_size))

    def _refill(self, draft, n: int, T: int, device) -> None:
        if not isinstance(draft, torch.nn.Module):
            draft = draft()
        pick = torch.randint(0, len(self.prompts[0]), (max(n, self.buffer),), generator=self.generator, device="cpu")
        prompt, pmask = self.prompts[0][pick].to(device), self.prompts[1][pick].to(device)
        P = prompt.shape[1]
        if P >= T:
            raise DraftsmithError(f"prompts of {P} tokens leave no room for a continuation in blocks of {T}: "
                                  "lower data.prompt_tokens or raise data.block_size")
        was_training = draft.training
        draft.eval()
        g = seeded(device, int(torch.randint(0, 2**62, (1,), generator=self.generator, device="cpu")))
        gen = autoregressive_generate(draft, prompt, attention_mask=pmask, max_new_tokens=T - P, generator=g,
                                      **self.sampling)
        draft.train(was_training)
        # clone: the sampler returns inference tensors, which an embedding cannot save for backward
        ids = torch.cat([prompt, torch.stack(gen.tokens).clone()], 1)  # (rows, T)
        mask = torch.cat([pmask, torch.ones_like(ids[:, P:])], 1)
        self._rows.extend(zip(ids, mask))
        self.sampled_rows += len(ids)

    def __call__(self, draft, ids: torch.Tensor, progress: float = 1.0) -> Batch:
        """`draft`: the model that samples, or a function that builds it, called only when rows are sampled (the
        sampler's pruned-head view of a draft copies its head). `progress`: the fraction of training done; before
        `start` the batch stays as it is (a cold draft's samples are not text: distilling on them from the first
        step collapsed acceptance: docs/results.md, "What trains the best draft")."""
        B, T = ids.shape
        n = self.rows(B) if progress >= self.start else 0
        if n == 0:
            return Batch(ids)
        if len(self._rows) < n:
            self._refill(draft, n, T, ids.device)
        rows, self._rows = self._rows[:n], self._rows[n:]
        out_ids = torch.cat([torch.stack([r[0] for r in rows]), ids[n:]], 0)
        mask = torch.cat([torch.stack([r[1] for r in rows]), torch.ones_like(ids[n:])], 0)
        P = self.prompts[0].shape[1]
        loss_mask = torch.ones(B, T - 1, dtype=torch.bool, device=ids.device)
        loss_mask[:n, : P - 1] = False  # labels at P-1.. are the sampled tokens; the prompt is not the draft's
        return Batch(out_ids, None if bool(mask.all()) else mask, loss_mask, sampled=n)
