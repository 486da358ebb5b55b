"""The decoding loops that call the models: speculative sampling (SpS) and the autoregressive baseline (ArS).

Both loops share one cache path (`_Decoder`), one logits processing (`probs.process_logits`) and one
row bookkeeping (`_Rows`), so a speed-up measured between them is a fair one. The rejection math lives
in `rejection.py`.

Batches: rows accept different numbers of draft tokens. Rather than recomputing, each model's KV cache
keeps the slots of rejected tokens as holes masked out of attention (position ids stay the true token
positions, so RoPE is unaffected); trailing slots no row uses are cropped. At batch size 1 there are never
holes, the mask is all ones and the fast causal path runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from sampling.probs import SamplingConfig, process_logits, sample
from sampling.rejection import expected_acceptance, verify
from sampling.stats import GenerationStats


@dataclass
class Generation:
    tokens: list[torch.Tensor]  # new tokens of each input row, 1-D LongTensors
    stats: GenerationStats


class _Decoder:
    """One model's decoding state for the active rows: its KV cache and which cache slots are valid."""

    def __init__(self, model):
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.valid: torch.Tensor | None = None  # (B, S) bool

    def __call__(self, tokens, positions, valid, logits_to_keep: int):
        """tokens, positions, valid: (B, T). Returns the model output (`.logits`: (B, logits_to_keep, V))."""
        mask = valid if self.valid is None else torch.cat([self.valid, valid], dim=1)
        out = self.model(
            input_ids=tokens,
            position_ids=positions,
            attention_mask=None if bool(mask.all()) else mask,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        self.valid = mask
        return out

    def settle(self, new_valid: torch.Tensor) -> None:
        """Set the validity of the newest slots (B, n), then crop trailing slots that no row uses."""
        n = new_valid.shape[1]
        self.valid[:, self.valid.shape[1] - n:] = new_valid
        used = self.valid.any(0).nonzero()
        keep = int(used[-1]) + 1 if len(used) else 0
        drop = self.valid.shape[1] - keep
        if drop:
            self.cache.crop(-drop)  # transformers 5.x: a negative count of tokens to remove
            self.valid = self.valid[:, :keep]

    def select(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.valid = self.valid[rows]


class _Rows:
    """Per-row outputs, budgets and EOS; drops finished rows from the batch."""

    def __init__(self, batch: int, max_new_tokens: int, eos_token_id, device):
        self.out: list[list[int]] = [[] for _ in range(batch)]
        self.index = torch.arange(batch, device=device)  # active row -> input row (selects cache rows)
        self.remaining = [max_new_tokens] * batch  # indexed by input row
        if eos_token_id is None:
            eos = set()
        elif isinstance(eos_token_id, Iterable):
            eos = {int(e) for e in eos_token_id}
        else:
            eos = {int(eos_token_id)}
        self.eos = eos

    def max_remaining(self) -> int:
        return max(self.remaining[r] for r in self.index.tolist())

    def emit(self, new: list[list[int]]) -> tuple[torch.Tensor, int]:
        """new[i]: tokens produced for active row i. Returns (done mask over active rows, tokens kept)."""
        done, kept = [], 0
        for r, toks in zip(self.index.tolist(), new):
            toks = toks[: self.remaining[r]]
            ends = next((j for j, t in enumerate(toks) if t in self.eos), None)
            if ends is not None:
                toks = toks[: ends + 1]
            self.out[r].extend(toks)
            self.remaining[r] = 0 if ends is not None else self.remaining[r] - len(toks)  # nothing follows EOS
            kept += len(toks)
            done.append(self.remaining[r] == 0)
        return torch.tensor(done, device=self.index.device), kept

    def tensors(self, device) -> list[torch.Tensor]:
        return [torch.tensor(o, dtype=torch.long, device=device) for o in self.out]


def _check_inputs(models, input_ids, attention_mask, max_new_tokens, k=None):
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError("input_ids must be a (batch, length) LongTensor")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token per row")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens}")
    if k is not None and (not isinstance(k, int) or k < 1):
        raise ValueError(f"k (draft tokens per loop) must be an integer >= 1, got {k}")
    for m in models:
        limit = getattr(m.config, "max_position_embeddings", None)
        if limit and input_ids.shape[1] + max_new_tokens > limit:
            raise ValueError(
                f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                f"context of {limit} tokens; shorten the prompt or lower max_new_tokens"
            )


def _vocab_size(model) -> int:
    head = model.get_output_embeddings()
    return head.weight.shape[0] if head is not None else model.config.vocab_size


def _last_probs(out, cfg: SamplingConfig) -> torch.Tensor:
    """(B, V) processed distribution at the last position; a pruned draft head is processed over its subset."""
    ids = getattr(out, "token_ids", None)
    if ids is None:
        return process_logits(out.logits[:, -1], cfg)
    small = process_logits(out.sub_logits[:, -1], cfg)  # (B, N)
    return small.new_zeros(small.shape[0], out.vocab).index_copy_(-1, ids, small)


def _prefill(dec: _Decoder, input_ids, attention_mask, logits_to_keep=1):
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    positions = (valid.long().cumsum(1) - 1).clamp_min(0)
    return dec(input_ids, positions, valid, logits_to_keep)


@torch.inference_mode()
def autoregressive_generate(
    target,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id=None,
    generator: torch.Generator | None = None,
    attention_mask: torch.Tensor | None = None,
) -> Generation:
    """Plain autoregressive sampling (ArS) from the target: the baseline SpS is measured against.

    attention_mask (optional, (B, T)) marks left padding in a batch of prompts of different lengths.
    """
    cfg = SamplingConfig(temperature, top_k, top_p)
    _check_inputs([target], input_ids, attention_mask, max_new_tokens)
    t0 = time.perf_counter()
    B = input_ids.shape[0]
    stats = GenerationStats(k=0, rows=B)
    rows = _Rows(B, max_new_tokens, eos_token_id, input_ids.device)
    dec = _Decoder(target)
    out = _prefill(dec, input_ids, attention_mask)
    pos = dec.valid.sum(1)  # (B,) position of the next token
    stats.prefill_s = time.perf_counter() - t0
    stats.record_loop(0)
    while True:
        probs = _last_probs(out, cfg)
        tok = probs.argmax(-1) if cfg.greedy else sample(probs, generator)
        done, kept = rows.emit([[x] for x in tok.tolist()])
        stats.new_tokens += kept
        stats.record_loop(kept)
        stats.row_loops += len(tok)
        if bool(done.all()):
            break
        if bool(done.any()):
            live = (~done).nonzero().squeeze(1)
            rows.index, tok, pos = rows.index[live], tok[live], pos[live]
            dec.select(live)
        t = time.perf_counter()
        out = dec(tok[:, None], pos[:, None], torch.ones_like(tok[:, None], dtype=torch.bool), 1)
        stats.target_s += time.perf_counter() - t
        stats.target_calls += 1
        pos = pos + 1
    stats.total_s = time.perf_counter() - t0
    return Generation(rows.tensors(input_ids.device), stats)


@torch.inference_mode()
def speculative_generate(
    target,
    draft,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    k: int = 4,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id=None,
    generator: torch.Generator | None = None,
    attention_mask: torch.Tensor | None = None,
) -> Generation:
    """Speculative sampling (SpS, Chen et al. 2023, Algorithm 2): output distributed exactly as the target's.

    Each loop: the draft proposes K tokens autoregressively from its processed distribution p; the target
    scores all K+1 positions in one pass (q); `rejection.verify` keeps a prefix and emits one more token.
    temperature 0 is greedy and reproduces the target's greedy decoding.
    """
    cfg = SamplingConfig(temperature, top_k, top_p)
    _check_inputs([target, draft], input_ids, attention_mask, max_new_tokens, k)
    if _vocab_size(target) != _vocab_size(draft):
        raise ValueError(
            f"draft vocabulary ({_vocab_size(draft)}) differs from the target's ({_vocab_size(target)}): "
            "the draft must share the target's tokenizer and vocabulary"
        )
    t0 = time.perf_counter()
    B = input_ids.shape[0]
    dev = input_ids.device
    stats = GenerationStats(k=k, rows=B)
    rows = _Rows(B, max_new_tokens, eos_token_id, dev)
    tgt, drf = _Decoder(target), _Decoder(draft)

    # Both caches hold everything but the last token, `pending`, which each loop feeds first.
    pending = input_ids[:, -1]
    if input_ids.shape[1] > 1:
        head, head_mask = input_ids[:, :-1], None if attention_mask is None else attention_mask[:, :-1]
        _prefill(tgt, head, head_mask)
        _prefill(drf, head, head_mask)
        pos = tgt.valid.sum(1)
    else:
        pos = torch.zeros(B, dtype=torch.long, device=dev)
    # A row whose K drafts were all accepted owes the draft its last draft token (never fed to it).
    backlog = torch.zeros(B, dtype=torch.long, device=dev)
    has_backlog = torch.zeros(B, dtype=torch.bool, device=dev)
    stats.prefill_s = time.perf_counter() - t0
    stats.record_loop(0)

    while True:
        Bn = pending.shape[0]
        K = max(1, min(k, rows.max_remaining() - 1))  # no drafting past the end of every row
        ones = torch.ones(Bn, 1, dtype=torch.bool, device=dev)

        # 1. Draft K tokens.
        t = time.perf_counter()
        fed_backlog = bool(has_backlog.any())
        if fed_backlog:
            out = drf(torch.stack([backlog, pending], 1), torch.stack([pos - 1, pos], 1),
                      torch.stack([has_backlog, ones[:, 0]], 1), 1)
        else:
            out = drf(pending[:, None], pos[:, None], ones, 1)
        p_list, d_list = [], []
        for i in range(K):
            p_i = _last_probs(out, cfg)  # (Bn, V)
            d_i = p_i.argmax(-1) if cfg.greedy else sample(p_i, generator)
            p_list.append(p_i)
            d_list.append(d_i)
            if i < K - 1:
                out = drf(d_i[:, None], (pos + 1 + i)[:, None], ones, 1)
        p = torch.stack(p_list, 1)  # (Bn, K, V)
        drafts = torch.stack(d_list, 1)  # (Bn, K)
        stats.draft_s += time.perf_counter() - t
        stats.draft_calls += K

        # 2. Score K+1 positions with the target in one pass.
        t = time.perf_counter()
        block = torch.cat([pending[:, None], drafts], 1)  # (Bn, K+1)
        steps = torch.arange(K + 1, device=dev)
        positions = pos[:, None] + steps
        q = process_logits(tgt(block, positions, torch.ones_like(block, dtype=torch.bool), K + 1).logits, cfg)
        stats.target_s += time.perf_counter() - t
        stats.target_calls += 1

        # 3. Accept or reject.
        n, nxt = verify(p, q, drafts, generator)  # (Bn,), (Bn,)
        n_list = n.tolist()
        was_tested = steps[None, :K] <= n[:, None]  # (Bn, K): positions up to the first rejection were tested
        stats.alpha_analytic_sum += float((expected_acceptance(p, q[:, :K]) * was_tested).sum())
        for a in n_list:
            stats.record_row(a, K)

        # 4. Roll both caches back to the accepted prefix: the target holds pending + n accepted drafts;
        #    the draft also holds what it was fed of them (its last draft token is never fed).
        tgt.settle(steps[None, :] <= n[:, None])
        draft_new = steps[None, :K] <= n[:, None]  # pending, d_1..d_{K-1}
        if fed_backlog:
            draft_new = torch.cat([has_backlog[:, None], draft_new], 1)
        drf.settle(draft_new)
        has_backlog = n == K
        backlog = drafts[:, -1]
        pos = pos + n + 1
        pending = nxt

        # 5. Emit, honouring max_new_tokens and EOS per row.
        d_rows, nxt_list = drafts.tolist(), nxt.tolist()
        done, kept = rows.emit([d_rows[i][: n_list[i]] + [nxt_list[i]] for i in range(Bn)])
        stats.new_tokens += kept
        stats.record_loop(kept)
        if bool(done.all()):
            break
        if bool(done.any()):
            live = (~done).nonzero().squeeze(1)
            rows.index, pending, pos = rows.index[live], pending[live], pos[live]
            backlog, has_backlog = backlog[live], has_backlog[live]
            tgt.select(live)
            drf.select(live)
    stats.total_s = time.perf_counter() - t0
    return Generation(rows.tensors(dev), stats)
