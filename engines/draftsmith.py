"""Our own sampler as an engine (`sampling.speculative`), in this process: nothing to install."""

from __future__ import annotations

import time

import torch

from draftsmith.engines.base import InProcess, Output
from draftsmith.sampling.machine import device_of, seeded
from draftsmith.sampling.speculative import autoregressive_generate, speculative_generate


class DraftsmithEngine(InProcess):
    """Our sampler: each job's n samples of a prompt are n rows of one batch (chunked)."""

    name = "draftsmith"
    chunk = 512

    def version(self) -> str:
        from importlib.metadata import version

        return version("draftsmith")

    def run(self, jobs, speculative):
        outs = []
        for job in jobs:
            if job.batched and job.n == 1:
                outs.append(self._batch(job, speculative))
                continue
            g = seeded(device_of(self.target), job.seed)
            tokens, seconds, drafted, accepted = [], 0.0, 0, 0
            counts = {"target_passes": 0, "accepted_at": [], "tested_at": []}  # our sampler's per-row counts
            for prompt in job.prompts:
                rows = []
                for start in range(0, job.n, self.chunk):
                    ids = torch.tensor([prompt] * min(self.chunk, job.n - start))
                    t0 = time.perf_counter()
                    with torch.inference_mode():
                        if speculative:
                            gen = speculative_generate(self.target, self.draft, ids, max_new_tokens=job.max_new_tokens,
                                                       k=self.k, temperature=job.temperature, top_p=job.top_p,
                                                       eos_token_id=self.eos, generator=g)
                            drafted, accepted = drafted + gen.stats.drafted, accepted + gen.stats.accepted
                            _add(counts, gen.stats)
                        else:
                            gen = autoregressive_generate(self.target, ids, max_new_tokens=job.max_new_tokens,
                                                          temperature=job.temperature, top_p=job.top_p,
                                                          eos_token_id=self.eos, generator=g)
                    seconds += time.perf_counter() - t0
                    rows += [t.tolist() for t in gen.tokens]
                tokens.append(rows)
            outs.append(Output(tokens, seconds, drafted if speculative else None, accepted if speculative else None,
                               counts if speculative else {}))
        return outs


    def _batch(self, job, speculative) -> Output:
        """The job's prompts as one left-padded batch (one sample each), as a server batches requests."""
        width = max(len(p) for p in job.prompts)
        ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in job.prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in job.prompts])
        kw = dict(max_new_tokens=job.max_new_tokens, temperature=job.temperature, top_p=job.top_p,
                  eos_token_id=self.eos, generator=seeded(device_of(self.target), job.seed), attention_mask=mask)
        counts = {"target_passes": 0, "accepted_at": [], "tested_at": []}
        t0 = time.perf_counter()
        with torch.inference_mode():
            if speculative:
                gen = speculative_generate(self.target, self.draft, ids, k=self.k, **kw)
                _add(counts, gen.stats)
            else:
                gen = autoregressive_generate(self.target, ids, **kw)
        seconds = time.perf_counter() - t0
        tokens = [[t.tolist()] for t in gen.tokens]
        if not speculative:
            return Output(tokens, seconds)
        return Output(tokens, seconds, gen.stats.drafted, gen.stats.accepted, counts)


def _add(counts: dict, stats) -> None:
    """Sum a generation's row loops (each a target pass of that row) and per-position counts into `counts`."""
    counts["target_passes"] += stats.row_loops
    for key in ("accepted_at", "tested_at"):
        got = getattr(stats, key)
        counts[key] += [0] * (len(got) - len(counts[key]))
        for i, v in enumerate(got):
            counts[key][i] += v
