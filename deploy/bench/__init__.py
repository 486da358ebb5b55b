"""The benchmarks, one module a question, each run as `draftsmith bench NAME` (its `main(argv)`):

- `paper`: the paper's Table 1 and Figure 1 for a pair (ArS against SpS, K = 0..8), the speed-up model beside them;
- `sampler`: our sampler against transformers' `generate` and assisted generation on the same pair;
- `corpus`: which engine samples the target's corpus faster here, our loop or vLLM;
- `memory`: a long generation's peak memory against the KV caches it must hold;
- `store`: the teacher store's peak memory as the corpus grows;
- `train-memory`: a whole training run's peak memory as its corpus grows;
- `batching`: chat samples padded per sample against today's packing, in real tokens/s of a training step;
- `serve`: a bundle served in an engine (ours, transformers, vLLM, llama.cpp): tau per set, the speed-up there;
- `acceptance`: drafts side by side on the same samples of their target: alpha_on_target per set (chat too);
- `ablation`: the table and plot of a finished ablation multirun.

Each prints its figures and writes its JSON where told; the figures that matter, with their command, machine and
date, are in docs/results.md.
"""

BENCHES = {
    "paper": ("paper", "the paper's Table 1 and Figure 1 for a draft and its target: ArS vs SpS, K = 0..8"),
    "sampler": ("sampler", "our sampler against transformers' generate and assisted generation"),
    "corpus": ("corpus", "which engine samples the target's corpus faster here: our loop or vLLM"),
    "memory": ("memory", "a long generation's peak memory against its KV caches"),
    "store": ("store", "the teacher store's peak memory as the corpus grows"),
    "train-memory": ("train_memory", "a training run's peak memory as its corpus grows"),
    "batching": ("batching", "chat samples padded per sample against packing: real tokens/s of a training step"),
    "serve": ("serve", "a bundle served in an engine: acceptance length (tau) and speed-up per set"),
    "acceptance": ("acceptance", "drafts side by side on the same target samples: alpha_on_target per set"),
    "ablation": ("ablation", "the table and plot of a finished ablation multirun"),
    "trainers": ("trainers", "our EAGLE-3 trainer beside speculators' and SpecForge's own, same samples, one judge"),
}

