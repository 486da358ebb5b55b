"""transformers' assisted generation (`generate(assistant_model=...)`), in this process: nothing to install. Its
quirks: batch 1 for assisted generation; `top_k` must be switched off (its default is 50); finished rows of a batch
are padded; no EAGLE-3, so a feature draft is refused."""

from __future__ import annotations

import time

import torch

from draftsmith.engines.base import InProcess, Output
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.feature import is_feature_dir


class TransformersEngine(InProcess):
    """Hugging Face assisted generation with the bundle's draft as `assistant_model` (batch 1: one call per sample,
    as transformers requires); plain decoding too, except the chi-square's thousands of draws (one batched call)."""

    name = "transformers"
    batches = False  # assisted generation takes one sequence a call: `bench serve --batch` above 1 is refused
    pruned_head = False  # its users load the draft with AutoModelForCausalLM: the full head, exact all the same

    def __init__(self, bundle, dtype: str = "fp32"):
        if is_feature_dir(bundle.draft_dir):
            raise DraftsmithError(f"transformers cannot run {bundle.draft_dir}: it is a feature draft (EAGLE-3), "
                                  "which assisted generation does not support; judge it with --engine vllm or "
                                  "draftsmith")
        super().__init__(bundle, dtype)

    def version(self) -> str:
        import transformers

        return transformers.__version__

    def run(self, jobs, speculative):
        outs = []
        for job in jobs:
            torch.manual_seed(job.seed)
            kw = dict(max_new_tokens=job.max_new_tokens, eos_token_id=self.eos, pad_token_id=self.eos)
            kw.update(do_sample=False) if job.temperature == 0 else kw.update(
                do_sample=True, temperature=job.temperature, top_p=job.top_p, top_k=0)  # top_k: off, not HF's 50
            tokens, seconds = [], 0.0
            # assisted generation counts nothing: we count the target's forward passes (one per verification)
            passes = [0]
            hook = self.target.register_forward_pre_hook(lambda *_: passes.__setitem__(0, passes[0] + 1))
            try:
                for prompt in job.prompts:
                    ids = torch.tensor([prompt])
                    t0 = time.perf_counter()
                    with torch.inference_mode():
                        if speculative:
                            rows = [self.target.generate(ids, attention_mask=torch.ones_like(ids),
                                                         assistant_model=self.draft, **kw)[0] for _ in range(job.n)]
                        elif job.n > 64:  # the chi-square's draws: batched (their time is not reported)
                            many = ids.expand(job.n, -1)
                            rows = list(self.target.generate(many, attention_mask=torch.ones_like(many), **kw))
                        else:  # timed: one sample per call, as assisted generation must, so tokens/s compare
                            rows = [self.target.generate(ids, attention_mask=torch.ones_like(ids), **kw)[0]
                                    for _ in range(job.n)]
                    seconds += time.perf_counter() - t0
                    tokens.append([_until_eos(r[len(prompt):].tolist(), self.eos) for r in rows])
            finally:
                hook.remove()
            outs.append(Output(tokens, seconds, extra={"target_passes": passes[0]} if speculative else {}))
        return outs


def _until_eos(ids: list[int], eos) -> list[int]:
    """Drop what follows the first EOS (transformers pads finished rows of a batch)."""
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos])
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids
