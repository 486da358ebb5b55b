"""Static-shape decoding steps compiled with torch.compile (opt-in: `compile=True`).

Eager decoding pays per-operator overhead every step: compiled, a step fuses the small operators (norms, RoPE,
activations, residual adds) around the matrix products. What it gains: docs/sampler.md and docs/results.md.

A model in bf16 or fp16 whose weights no optimiser updates (every parameter `requires_grad=False`: a loaded target
or draft) is compiled with its weights frozen into the graph, and its products by inductor's C++ GEMM template
where that wins at autotuning: on a CPU with AMX, the template's bf16 micro-kernels over weights packed once read
the weights about twice as fast as aten's one-row product, which about halves a 1-token step (docs/sampler.md).
The price is compile time (minutes a step shape instead of seconds) and a guard: the weights'
identity and version are checked at every generation, and a frozen graph whose weights changed in place is thrown
away and compiled again.

A compiled graph is specialised to its shapes, so everything a step sees keeps one shape for the whole
generation:
- the KV cache is transformers' `StaticCache`, `capacity` slots long (a power of two of at least 512, so
  generations of other lengths and the cost model's timing reuse the graphs); attention always spans all of it,
  and the mask says which slots count (the masked holes of speculative decoding, padding, unwritten slots);
- finished rows stay in the batch (their results are dropped): dropping them would be a new batch size.
The price: every step reads the whole cache, and finished rows are still computed. At batch 1 the cache is small
beside the weights; at batch 63 with 512 slots it is ~1.5 GB of keys and values per step of the demo target, and
compiled sampling of that many rows runs slower than eager. Compile for few rows.
The shapes left are the number of new tokens per step: 1 for a draft step and for plain decoding, K + 1 for a
verify pass, 2 when a draft catches up on a token it never saw. Each compiles once per process (tens of seconds
on this CPU; `compile_report()` lists them). Prefill (one pass over the prompt) runs eagerly on the same cache.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from types import SimpleNamespace

import torch
from transformers.cache_utils import StaticCache, StaticLayer

from draftsmith.sampling.cache import Decoder, compaction_order, expand_slots, keep_index
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.feature import is_feature_draft
from draftsmith.sampling.pruned import PrunedHeadDraft, PrunedOutput

MIN_CAPACITY = 512  # capacities round up to a power of two, at least this: one graph serves most generations
MAX_COMPILED_TOKENS = 16  # steps over more new tokens than this (prefill) run eagerly
_REPORT: list[dict] = []  # one entry per (model, shape) compiled in this process
_STEPPED = weakref.WeakSet()  # the models holding a compiled step


def compile_report() -> list[dict]:
    """[{'model', 'tokens', 'rows', 'compile_s'}] for every step shape compiled in this process so far."""
    return list(_REPORT)


def check_compilable(model) -> None:
    if is_feature_draft(model):
        raise DraftsmithError("compile=True runs independent drafts and targets; a feature draft (its target's hidden "
                              "states are handed over by hooks) runs eagerly: drop compile")
    types = getattr(model.config, "layer_types", None) or []
    if any(t != "full_attention" for t in types) or getattr(model.config, "sliding_window", None):
        raise DraftsmithError(f"compile=True needs full-attention layers; {type(model).__name__} has sliding-window "
                              "layers, whose static cache cannot hold masked holes: drop compile")


# inductor's settings for a model with frozen weights: the weights become constants of the graph (packed once for
# the GEMM kernels) and each product's kernel is chosen by timing the C++ template against aten's (quietly: inductor
# prints a table per product otherwise)
FROZEN = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
          "autotune_num_choices_displayed": 0}


# where freezing pays: half-precision weights, whose few-row products aten computes slowly on a CPU. fp32 keeps the
# calibrated kernels of kernels.py traced into an unfrozen graph, which beat inductor's frozen products on AVX2
FREEZE_DTYPES = (torch.bfloat16, torch.float16)


def _weights_key(model) -> tuple | None:
    """None for a model whose graph keeps its weights as inputs: one an optimiser may update (some parameter
    requires grad), on a GPU, or in fp32; else the identity and in-place version of every weight, which a frozen
    graph has baked in."""
    params = list(model.parameters())
    if any(p.requires_grad or p.device.type != "cpu" or p.dtype not in FREEZE_DTYPES for p in params):
        return None
    return tuple((p.data_ptr(), p._version) for p in params)


def _step_fn(model):
    """The compiled forward of `model`: tensors in, logits out (a pruned head's over its subset). Made once per
    model and weights: a trained draft's weights stay inputs of the graph, so a draft validated between optimiser
    steps is read as it is now, and the calibrated kernels of `kernels.py` are traced into it (on an AVX2 CPU they
    beat inductor's own frozen, packed products at these few rows). Frozen weights are frozen into the graph
    (`FROZEN`)."""
    key = _weights_key(model)
    step = model.__dict__.get("_draftsmith_step")
    if step is not None and step.key != key:
        # dynamo keys its graphs by code object and guards on the model's identity, not its numbers: a frozen graph
        # would be found again with the old weights in it, so every graph goes, and each model compiles anew
        torch._dynamo.reset()
        for m in list(_STEPPED):
            m.__dict__.pop("_draftsmith_step", None)
        step = None
    if step is None:
        import torch._inductor.config as inductor  # loaded by torch.compile anyway; not at import of sampling

        pruned = isinstance(model, PrunedHeadDraft)

        def forward(input_ids, position_ids, attention_mask, cache, logits_to_keep: int):
            out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache,
                        use_cache=True, logits_to_keep=logits_to_keep)
            return out.sub_logits if pruned else out.logits

        # dynamo keeps one list of graphs per code object, and every model's `forward` shares this one: a target's
        # K + 1 shapes and a draft's would pass the default limit of 8 and fall back to eager without a word
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        step = torch.compile(forward, dynamic=False)
        step.eager, step.shapes, step.key = forward, set(), key  # eager: the prefill, whose shape never recurs
        # around each call, not as compile(options=): measured, inductor ignores `freezing` given as an option
        step.settings = contextlib.nullcontext if key is None else functools.partial(inductor.patch, FROZEN)
        model.__dict__["_draftsmith_step"] = step
        _STEPPED.add(model)
    return step


def _wrap(model, logits):
    if isinstance(model, PrunedHeadDraft):
        return PrunedOutput(logits, model.token_ids, model.vocab)
    return SimpleNamespace(logits=logits)


def _plain_inputs(cache: StaticCache) -> None:
    """Untag the tensors a StaticCache tags as static addresses at its first write (for CUDA graphs): inductor's
    freezing bakes tagged tensors into the graph like weights, so every later generation, with a new cache, read and
    wrote the first one's (wrong logits, then an index past the cache's end)."""
    for layer in cache.layers:
        for t in (layer.keys, layer.values, layer.cumulative_length):
            if hasattr(t, "_dynamo_static_input_type"):
                del t._dynamo_static_input_type


class StaticDecoder(Decoder):
    """A `Decoder` over a StaticCache of fixed shape, with compiled steps; `settle` (crop, then compact past the
    holes' budget) is the Decoder's. `valid` (B_active, S) covers the active rows' filled slots."""

    def __init__(self, model, capacity: int, holes: int | None = None):
        check_compilable(model)
        self.model = model
        self.capacity = max(MIN_CAPACITY, 1 << (capacity - 1).bit_length())
        self.cache = StaticCache(config=model.config, max_cache_len=self.capacity)
        if not all(type(layer) is StaticLayer for layer in self.cache.layers):
            raise DraftsmithError("compile=True needs full-attention layers only: drop compile")
        self.step = _step_fn(model)
        self.valid: torch.Tensor | None = None
        self.valid_host: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None  # active row -> row of the static batch
        self.holes = holes
        self.compactions = 0

    def _mask(self, valid: torch.Tensor, q: int) -> torch.Tensor:
        """(B, 1, q, capacity) bool: each query sees the valid slots before it and itself (a padding query
        sees at least itself, so no row of the softmax is empty); finished rows see only their new slots."""
        B, S = self.batch, self.filled
        dev = valid.device
        causal = torch.ones(q, q, dtype=torch.bool, device=dev).tril()
        own = torch.eye(q, dtype=torch.bool, device=dev)
        mask = torch.zeros(B, 1, q, self.capacity, dtype=torch.bool, device=dev)
        mask[:, 0, :, S:S + q] = own
        active = torch.zeros(len(self.rows), 1, q, self.capacity, dtype=torch.bool, device=dev)
        if S:
            active[:, 0, :, :S] = self.valid[:, None, :]
        active[:, 0, :, S:S + q] = (causal & valid[:, None, :]) | own
        mask[self.rows] = active
        return mask

    @property
    def filled(self) -> int:
        return 0 if self.valid is None else self.valid.shape[1]

    def __call__(self, tokens, positions, valid, logits_to_keep: int | None, valid_host=None):
        Bn, q = tokens.shape
        if self.rows is None:
            self.batch, self.rows = Bn, torch.arange(Bn, device=tokens.device)
        if self.filled + q > self.capacity:
            raise DraftsmithError(f"static cache of {self.capacity} slots is full ({self.filled} + {q})")
        full_tokens = tokens.new_zeros(self.batch, q)
        full_pos = positions.new_zeros(self.batch, q)
        full_tokens[self.rows], full_pos[self.rows] = tokens, positions
        mask = self._mask(valid, q)
        keep = logits_to_keep or q
        if self.valid is None or q > MAX_COMPILED_TOKENS:  # prefill: once, eagerly, into the same cache
            logits = self.step.eager(full_tokens, full_pos, mask, self.cache, keep_index(keep, q, tokens.device))
            _plain_inputs(self.cache)
        else:
            logits = self._compiled(full_tokens, full_pos, mask, keep)
        if valid_host is None:
            valid_host = torch.ones(valid.shape, dtype=torch.bool, device="cpu")
        self.valid = valid if self.valid is None else torch.cat([self.valid, valid], dim=1)
        self.valid_host = valid_host if self.valid_host is None else torch.cat([self.valid_host, valid_host], dim=1)
        return _wrap(self.model, logits[self.rows])

    def _compiled(self, tokens, positions, mask, keep):
        t = time.perf_counter()
        try:
            with self.step.settings():
                logits = self.step(tokens, positions, mask, self.cache, keep)
        except torch._dynamo.exc.BackendCompilerFailed as e:  # ValueError: the CLIs print it in one line
            # seen here: a process killed while g++ wrote a kernel leaves an empty .so in inductor's cache, and every
            # later compile of that kernel loads it ("file too short")
            from torch._inductor.runtime.cache_dir_utils import cache_dir

            raise DraftsmithError(f"torch.compile could not build the decoding step ({str(e.__cause__ or e)[:200]}); "
                                  "on a CPU inductor needs a working C++ compiler (g++) and an intact kernel cache: "
                                  f"install g++, or delete {cache_dir()} (a killed compile can leave a broken kernel "
                                  "there), or drop compile") from e
        if (tokens.shape, keep) not in self.step.shapes:  # the first call of a shape compiled it
            self.step.shapes.add((tokens.shape, keep))
            _REPORT.append({"model": f"{type(self.model).__name__} ({self.model.config.num_hidden_layers} layers)",
                            "tokens": tokens.shape[1], "rows": tokens.shape[0],
                            "compile_s": round(time.perf_counter() - t, 1)})
        return logits

    def _compact(self) -> None:
        """Each active row's valid slots to the front, in order (exact: see `cache.compact_cache`), in place."""
        n = int(self.valid_host.sum(1).max())
        order = compaction_order(self.valid, n)
        index = torch.arange(n, device=order.device).repeat(self.batch, 1)  # finished rows: anything in range
        index[self.rows] = order
        S = self.filled
        for layer in self.cache.layers:
            for kv in (layer.keys, layer.values):
                kv[:, :, :n] = kv[:, :, :S].gather(2, expand_slots(index, kv))
            layer.cumulative_length.fill_(n)
        self.valid = self.valid.gather(1, order)
        self.valid_host = self.valid_host.gather(1, compaction_order(self.valid_host, n))
        self.compactions += 1

    def select(self, rows: torch.Tensor, rows_host: torch.Tensor) -> None:
        """Keep active rows `rows`; the others stay in the static batch, unread."""
        self.rows = self.rows[rows]
        self.valid, self.valid_host = self.valid[rows], self.valid_host[rows_host]
