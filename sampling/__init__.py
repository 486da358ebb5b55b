"""draftsmith's speculative sampler: exact speculative sampling for any pair of HF causal LMs.

Pure: imports torch and transformers only (no Lightning, Hydra or `train/`), so it deploys alone.
"""

from draftsmith.sampling.probs import SamplingConfig, process_logits
from draftsmith.sampling.speculative import Generation, autoregressive_generate, speculative_generate
from draftsmith.sampling.stats import GenerationStats

__all__ = [
    "Generation",
    "GenerationStats",
    "SamplingConfig",
    "autoregressive_generate",
    "process_logits",
    "speculative_generate",
]
