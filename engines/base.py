"""What every engine is to the judge (`deploy/conformance.py`): it runs `Job`s with speculative decoding on or off
and hands back the sampled token ids (`Output`). `InProcess`: an engine that runs in this process on the bundle's
models loaded by our loader."""

from __future__ import annotations

from dataclasses import dataclass, field

from draftsmith.sampling.cli import engine_k
from draftsmith.sampling.pruned import split_head
from draftsmith.sampling.runtime import prepared_model


@dataclass
class Job:
    prompts: list[list[int]]  # token ids, BOS included where the tokenizer adds one
    n: int  # samples per prompt
    max_new_tokens: int
    temperature: float  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    # the prompts served at once, as one batch (`bench serve --batch`), by an engine that batches; otherwise one
    # after another (the judge's jobs: each prompt's samples must not depend on what runs beside it)
    batched: bool = False


@dataclass
class Output:
    tokens: list[list[list[int]]]  # [prompt][sample] -> new token ids (an EOS ends a sample)
    seconds: float  # wall time of the generate calls, model loading excluded
    drafted: int | None = None  # the engine's own counts, where it reports them
    accepted: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def new_tokens(self) -> int:
        return sum(len(s) for p in self.tokens for s in p)


class Engine:
    """One engine, opened on one bundle; `install()`, where an engine needs one, is its module's."""

    name = "?"
    batches = True  # serves several requests at once (a `Job.batched`); transformers' assisted generation does not
    precision = "fp32"  # what the engine computes the target in: the greedy check's rounding band (conformance)

    def version(self) -> str:
        raise NotImplementedError

    def run(self, jobs: list[Job], speculative: bool) -> list[Output]:
        raise NotImplementedError

    def variants(self) -> dict[str, Engine]:
        """Other ways to run the same pair whose speed is worth reporting beside this one's (a quantized draft)."""
        return {}


class InProcess(Engine):
    pruned_head = True  # a draft trained with a pruned head runs with it; an engine that cannot, runs the full head

    def __init__(self, bundle, dtype: str = "fp32"):
        """dtype: fp32 (the judge's: the target's probabilities do not depend on the pass's shape), or `bundle`
        (the precisions the bundle was exported in, as its users run it)."""
        self.bundle = bundle
        dtypes = bundle.spec.get("dtype", {}) if dtype == "bundle" else {"target": dtype, "draft": dtype}
        self.precision = dtypes.get("target", "fp32")
        self.target = prepared_model(str(bundle.target_dir), self.precision)
        self.draft = prepared_model(str(bundle.draft_dir), dtypes.get("draft", "fp32"))
        if not self.pruned_head:
            self.draft = split_head(self.draft)[0]
        self.k = engine_k(bundle.spec, self.name)
        self.eos = self.target.generation_config.eos_token_id
