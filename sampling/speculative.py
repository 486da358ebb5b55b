"""The decoding loops that call the models: speculative sampling (SpS) and the autoregressive baseline (ArS).

Both loops share one cache path (`cache.Decoder`), one logits processing (`probs.process_logits`) and one
row bookkeeping (`_Rows`), so a speed-up measured between them is a fair one. The rejection math lives
in `rejection.py`.

Batches: rows accept different numbers of draft tokens. Rather than recomputing, each model's KV cache
keeps the slots of rejected tokens as holes masked out of attention (position ids stay the true token
positions, so RoPE is unaffected); trailing slots no row uses are cropped, and once the holes exceed a
budget each row's valid slots are moved to the front (`cache.compact_cache`), so one buffer of the
generation's length holds the whole generation. At batch size 1 there are never holes, the mask is all
ones and the fast causal path runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from draftsmith.sampling.cache import Decoder
from draftsmith.sampling.compiled import StaticDecoder, check_compilable
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.feature import FeatureTap, is_feature_draft
from draftsmith.sampling.kauto import KChooser
from draftsmith.sampling.machine import Timeline, device_of
from draftsmith.sampling.probs import SamplingConfig, process_logits, sample
from draftsmith.sampling.rejection import acceptance_probability, expected_acceptance, verify
from draftsmith.sampling.stats import GenerationStats


@dataclass
class Generation:
    tokens: list[torch.Tensor]  # new tokens of each input row, 1-D LongTensors
    stats: GenerationStats


def _decoder(model, capacity: int, holes: int | None = None, compile: bool = False):
    return StaticDecoder(model, capacity, holes) if compile else Decoder(model, capacity, holes)


class _Rows:
    """Per-row outputs, budgets and EOS, all on the host; drops finished rows from the batch. `index` maps active
    rows to input rows on the device (it selects cache rows there), `active` the same on the host."""

    def __init__(self, batch: int, max_new_tokens: int, eos_token_id, device):
        self.out: list[list[int]] = [[] for _ in range(batch)]
        self.index = torch.arange(batch, device=device)
        self.active = torch.arange(batch)  # host
        self.remaining = [max_new_tokens] * batch  # indexed by input row
        if eos_token_id is None:
            eos = set()
        elif isinstance(eos_token_id, Iterable):
            eos = {int(e) for e in eos_token_id}
        else:
            eos = {int(eos_token_id)}
        self.eos = eos

    def max_remaining(self) -> int:
        return max(self.remaining[r] for r in self.active.tolist())

    def emit(self, new: list[list[int]]) -> tuple[list[bool], int]:
        """new[i]: tokens produced for active row i. Returns (done, per active row; tokens kept)."""
        done, kept = [], 0
        for r, toks in zip(self.active.tolist(), new):
            toks = toks[: self.remaining[r]]
            ends = next((j for j, t in enumerate(toks) if t in self.eos), None)
            if ends is not None:
                toks = toks[: ends + 1]
            self.out[r].extend(toks)
            self.remaining[r] = 0 if ends is not None else self.remaining[r] - len(toks)  # nothing follows EOS
            kept += len(toks)
            done.append(self.remaining[r] == 0)
        return done, kept

    def keep(self, done: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """Drop the finished rows: (rows kept on the device, the same on the host), to select every row-indexed
        state with. A copy to the device, paid when rows finish, not in every loop."""
        live_host = torch.tensor([i for i, d in enumerate(done) if not d], dtype=torch.long)
        live = live_host.to(self.index.device)
        self.index, self.active = self.index[live], self.active[live_host]
        return live, live_host

    def tensors(self, device) -> list[torch.Tensor]:
        return [torch.tensor(o, dtype=torch.long, device=device) for o in self.out]


def _on_device(model, input_ids, attention_mask):
    """The prompt on the model's device (a CPU tensor of ids meets a CUDA model in every user's first call)."""
    dev = device_of(model)
    return input_ids.to(dev), None if attention_mask is None else attention_mask.to(dev)


def _check_inputs(models, input_ids, attention_mask, max_new_tokens, k=None):
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise DraftsmithError("input_ids must be a (batch, length) LongTensor")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise DraftsmithError("the prompt is empty: give at least one token per row")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise DraftsmithError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                              f"{tuple(input_ids.shape)}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise DraftsmithError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens}")
    if k is not None and (not isinstance(k, int) or k < 1):
        raise DraftsmithError(f"k (draft tokens per loop) must be an integer >= 1, got {k}")
    for m in models:
        limit = getattr(m.config, "max_position_embeddings", None)
        if limit and input_ids.shape[1] + max_new_tokens > limit:
            raise DraftsmithError(
                f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                f"context of {limit} tokens; shorten the prompt or lower max_new_tokens"
            )


def _vocab_size(model) -> int:
    if is_feature_draft(model):
        return model.config.vocab_size
    head = model.get_output_embeddings()
    return head.weight.shape[0] if head is not None else model.config.vocab_size


def last_probs(out, cfg: SamplingConfig) -> torch.Tensor:
    """(B, V) processed distribution at the last position; a pruned draft head is processed over its subset."""
    ids = getattr(out, "token_ids", None)
    if ids is None:
        return process_logits(out.logits[:, -1], cfg)
    small = process_logits(out.sub_logits[:, -1], cfg)  # (B, N)
    return small.new_zeros(small.shape[0], out.vocab).index_copy_(-1, ids, small)


def _last_argmax(out) -> torch.Tensor:
    """(B,) greedy token at the last position: an argmax of the logits, no distribution built (temperature 0)."""
    ids = getattr(out, "token_ids", None)
    if ids is None:
        return out.logits[:, -1].argmax(-1)
    return ids[out.sub_logits[:, -1].argmax(-1)]


def _next_token(out, cfg: SamplingConfig, generator):
    """(p (B, V) or None when greedy, token (B,)) at the last position."""
    if cfg.greedy:
        return None, _last_argmax(out)
    p = last_probs(out, cfg)
    return p, sample(p, generator)


def _draft_tokens(out, K: int, cfg: SamplingConfig, generator, feed, stop=None):
    """Up to K draft tokens from output `out` on; `feed(i, d_i, out)` runs the draft on its i-th token and returns the
    next output. `stop(confs)`, given the draft's probability of each token drafted so far (k="auto"), may end the
    drafting early: it sees only the draft's side, so the output stays exact.
    -> (p (B, K', V), or None when greedy; drafts (B, K'); confs (B, K') or None without `stop`), K' <= K."""
    p_list, d_list, c_list = [], [], []
    for i in range(K):
        p_i, d_i = _next_token(out, cfg, generator)
        p_list.append(p_i)
        d_list.append(d_i)
        if stop is not None:
            c_list.append(_confidence(out, p_i, d_i))
            if i < K - 1 and stop(c_list):
                break
        if i < K - 1:
            out = feed(i, d_i, out)
    confs = torch.stack(c_list, 1) if c_list else None
    return None if cfg.greedy else torch.stack(p_list, 1), torch.stack(d_list, 1), confs


def _confidence(out, p_i, d_i) -> torch.Tensor:
    """(B,) the draft's probability of the token it drew; greedy: of its argmax, at temperature 1."""
    if p_i is not None:
        return p_i.gather(-1, d_i[:, None]).squeeze(-1).double()
    logits = out.logits[:, -1] if getattr(out, "token_ids", None) is None else out.sub_logits[:, -1]
    return torch.softmax(logits.double(), -1).amax(-1)


def _prefill(dec: Decoder, input_ids, attention_mask, logits_to_keep=1, mask_host=None, **extra):
    """The prompt into `dec`'s cache. `mask_host`: the prompt's attention mask on the host (read once per
    generation, before its loop)."""
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    positions = (valid.long().cumsum(1) - 1).clamp_min(0)
    return dec(input_ids, positions, valid, logits_to_keep, valid_host=mask_host, **extra)


def _host_mask(attention_mask) -> torch.Tensor | None:
    return None if attention_mask is None else attention_mask.bool().cpu()


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
    compile: bool = False,
    on_logits: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> Generation:
    """Plain autoregressive sampling (ArS) from the target: the baseline SpS is measured against.

    attention_mask (optional, (B, T)) marks left padding in a batch of prompts of different lengths.
    compile: static-shape decoding steps compiled with torch.compile (`sampling/compiled.py`).
    on_logits(rows, logits): called before each token is drawn with the input rows still decoding (a LongTensor on
    the host) and their raw logits (len(rows), V) on the device, the distribution that token comes from: a draft
    trained on these samples needs the target's logits at exactly these positions, and recomputing them costs a
    teacher pass (`data/corpus.py`)."""
    cfg = SamplingConfig(temperature, top_k, top_p)
    _check_inputs([target], input_ids, attention_mask, max_new_tokens)
    input_ids, attention_mask = _on_device(target, input_ids, attention_mask)
    dev = input_ids.device
    clock = Timeline(dev)
    B = input_ids.shape[0]
    stats = GenerationStats(k=0, rows=B)
    rows = _Rows(B, max_new_tokens, eos_token_id, input_ids.device)
    dec = _decoder(target, input_ids.shape[1] + max_new_tokens, compile=compile)
    mask_host = _host_mask(attention_mask)
    out = _prefill(dec, input_ids, attention_mask, mask_host=mask_host)
    pos = dec.valid.sum(1)  # (B,) position of the next token
    stats.record_loop(0, clock.span("prefill", clock.start))
    while True:
        if on_logits is not None:
            on_logits(rows.active, out.logits[:, -1])
        _, tok = _next_token(out, cfg, generator)
        done, kept = rows.emit([[x] for x in tok.tolist()])  # the loop's one read of the device
        stats.new_tokens += kept
        stats.record_loop(kept, clock.mark())
        stats.row_loops += len(done)
        if all(done):
            break
        if any(done):
            live, live_host = rows.keep(done)
            tok, pos = tok[live], pos[live]
            dec.select(live, live_host)
        t = clock.mark()
        out = dec(tok[:, None], pos[:, None], torch.ones_like(tok[:, None], dtype=torch.bool), 1)
        clock.span("target", t)
        stats.target_calls += 1
        pos = pos + 1
    stats.finish(clock)
    return Generation(rows.tensors(input_ids.device), stats)


class _ModelDrafter:
    """An independent draft (the paper's): its own KV cache, fed the tokens it proposed."""

    can_draft = True

    def __init__(self, draft, tap=None, capacity: int | None = None, holes: int | None = None, compile=False):
        self.dec = _decoder(draft, capacity, holes, compile)
        # a row whose K drafts were all accepted owes the draft its last one (on the device, and on the host)
        self.backlog = self.has_backlog = self.has_backlog_host = None

    def prefill(self, input_ids, head_mask, head_mask_host):
        _prefill(self.dec, input_ids[:, :-1], head_mask, mask_host=head_mask_host)
        self.start(input_ids.shape[0], input_ids.device)

    def start(self, B, dev):  # also the whole start of a one-token prompt: nothing to prefill
        self.backlog = torch.zeros(B, dtype=torch.long, device=dev)
        self.has_backlog = torch.zeros(B, dtype=torch.bool, device=dev)
        self.has_backlog_host = torch.zeros(B, dtype=torch.bool)

    def propose(self, pending, pos, K, cfg, generator, stop=None):
        ones = torch.ones(pending.shape[0], 1, dtype=torch.bool, device=pending.device)
        self.fed_backlog = bool(self.has_backlog_host.any())
        if self.fed_backlog:
            out = self.dec(torch.stack([self.backlog, pending], 1), torch.stack([pos - 1, pos], 1),
                           torch.stack([self.has_backlog, ones[:, 0]], 1), 1,
                           valid_host=torch.stack([self.has_backlog_host, torch.ones_like(self.has_backlog_host)], 1))
        else:
            out = self.dec(pending[:, None], pos[:, None], ones, 1)
        return _draft_tokens(out, K, cfg, generator,
                             lambda i, d_i, out: self.dec(d_i[:, None], (pos + 1 + i)[:, None], ones, 1), stop)

    def accept(self, n, n_host, drafts, nxt, pos, features, last: bool):
        """Roll the cache back to what it was fed of the accepted prefix (its last draft token is never fed)."""
        K = drafts.shape[1]
        new = torch.arange(K, device=n.device)[None, :] <= n[:, None]  # pending, d_1..d_{K-1}
        new_host = torch.arange(K)[None, :] <= n_host[:, None]
        if self.fed_backlog:
            new = torch.cat([self.has_backlog[:, None], new], 1)
            new_host = torch.cat([self.has_backlog_host[:, None], new_host], 1)
        self.dec.settle(new, new_host)
        self.has_backlog, self.has_backlog_host = n == K, n_host == K
        self.backlog = drafts[:, -1]

    def select(self, live, live_host):
        self.dec.select(live, live_host)
        self.backlog, self.has_backlog = self.backlog[live], self.has_backlog[live]
        self.has_backlog_host = self.has_backlog_host[live_host]


class _FeatureDrafter:
    """A feature draft (EAGLE-3; `feature.py`). Draft slot j reads token x_{j+1} and the target's features at
    position j. Its cache holds only slots fed with the target's features: after each verification the slots it
    filled with its own outputs are dropped, and the kept positions are fed again with the target's features from
    that verification pass (they are exact there, its own were guesses)."""

    def __init__(self, draft, tap, capacity: int | None = None, holes: int | None = None, compile=False):
        self.draft, self.tap, self.dec = draft, tap, Decoder(draft, capacity, holes)
        self.hidden = None  # (B, 1, H): output at the last verified slot, whose head proposes the first draft
        self.own = 0  # cache slots fed with its own outputs in this loop (dropped after verification)

    @property
    def can_draft(self) -> bool:  # not before the target has produced a feature (a one-token prompt)
        return self.hidden is not None

    def prefill(self, input_ids, head_mask, head_mask_host):
        features = self.tap.take()  # the target's, at positions 0..L-2
        out = _prefill(self.dec, input_ids[:, 1:], head_mask, None, mask_host=head_mask_host, features=features)
        self.hidden = out.hidden[:, -1:]

    def start(self, B, dev):
        self.hidden = None  # a one-token prompt: the first loop drafts nothing (K = 0)

    def propose(self, pending, pos, K, cfg, generator, stop=None):
        ones = torch.ones(pending.shape[0], 1, dtype=torch.bool, device=pending.device)
        # slot pos + i: its own output stands in for the target's feature
        p, drafts, confs = _draft_tokens(self.draft.head(self.hidden), K, cfg, generator,
                                         lambda i, d_i, out: self.dec(d_i[:, None], (pos + i)[:, None], ones, 1,
                                                                      features=out.hidden), stop)
        self.own = drafts.shape[1] - 1
        return p, drafts, confs

    def accept(self, n, n_host, drafts, nxt, pos, features, last: bool):
        B = n.shape[0]
        if self.own > 0:
            self.dec.settle(torch.zeros(B, self.own, dtype=torch.bool, device=n.device),
                            torch.zeros(B, self.own, dtype=torch.bool))
        self.own = 0
        if last:
            return
        m = int(n_host.max()) + 1  # rows that accepted fewer leave holes (masked), as in the target's cache
        steps = torch.arange(m, device=n.device)
        rows = torch.arange(B, device=n.device)
        tokens = torch.cat([drafts, nxt[:, None]], 1)[:, :m].clone()
        tokens[rows, n] = nxt  # slot pos + i reads x_{pos+i+1}: d_{i+1}, then the emitted token
        valid, valid_host = steps[None, :] <= n[:, None], torch.arange(m)[None, :] <= n_host[:, None]
        out = self.dec(tokens, pos[:, None] + steps, valid, None, valid_host=valid_host, features=features[:, :m])
        self.dec.settle(valid, valid_host)  # compacts the holes past their budget, as after the target's verify
        self.hidden = out.hidden[rows, n][:, None]

    def select(self, live, live_host):
        self.dec.select(live, live_host)
        self.hidden = self.hidden[live]


HOLE_LOOPS = 16  # loops' worth of holes (K + 1 slots each) a cache may hold before it is compacted


@torch.inference_mode()
def speculative_generate(
    target,
    draft,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    k: int | str = 4,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id=None,
    generator: torch.Generator | None = None,
    attention_mask: torch.Tensor | None = None,
    k_max: int = 8,
    cost: dict | None = None,
    alpha_prior: float = 0.5,
    compile: bool = False,
) -> Generation:
    """Speculative sampling (SpS, Chen et al. 2023, Algorithm 2): output distributed exactly as the target's.

    k="auto" chooses K in each loop as the draft runs (`KChooser`): from the draft's probability of each token it
    drew, each row's running acceptance (prior `alpha_prior`, e.g. a bundle card's alpha) and the cost model's c
    and v(K) (`cost`, as `sampling.cost.measure_costs` returns; measured once per model pair when not given), up to
    `k_max`. Exact: whether to draft one more token depends on the draft's side and on past loops only.

    Each loop: the draft proposes K tokens autoregressively from its processed distribution p; the target
    scores all K+1 positions in one pass (q); `rejection.verify` keeps a prefix and emits one more token.
    temperature 0 is greedy and reproduces the target's greedy decoding. `draft` is an independent causal LM
    or a feature draft (`sampling.feature.FeatureDraft`), which reads the target's hidden states.
    compile: static-shape decoding steps compiled with torch.compile (`sampling/compiled.py`), both models.
    """
    cfg = SamplingConfig(temperature, top_k, top_p)
    if compile:
        check_compilable(target)
        check_compilable(draft)
    chooser = None
    if k == "auto":
        chooser = KChooser(target, draft, input_ids.shape[0], k_max, cost, alpha_prior, compile=compile)
        k = chooser.k_max
    _check_inputs([target, draft], input_ids, attention_mask, max_new_tokens, k)
    if _vocab_size(target) != _vocab_size(draft):
        raise DraftsmithError(
            f"draft vocabulary ({_vocab_size(draft)}) differs from the target's ({_vocab_size(target)}): "
            "the draft must share the target's tokenizer and vocabulary"
        )
    tap = None
    if is_feature_draft(draft):
        draft.config.check_target(target.config)
        tap = FeatureTap(target, draft.feature_layers, device=device_of(draft))
    input_ids, attention_mask = _on_device(target, input_ids, attention_mask)
    try:
        return _speculative_loop(target, draft, tap, input_ids, attention_mask, max_new_tokens, k, cfg,
                                 eos_token_id, generator, chooser, compile)
    finally:
        if tap is not None:
            tap.close()


def _speculative_loop(target, draft, tap, input_ids, attention_mask, max_new_tokens, k, cfg, eos_token_id,
                      generator, chooser=None, compile=False) -> Generation:
    """One read of the device per loop: the accepted counts, the next tokens and the drafts, together (on an
    accelerator every read waits for its queue); everything the loop decides (which rows go on, how far the caches
    roll back, K) is taken from that copy on the host. k="auto" reads one decision per drafted token besides."""
    dev = input_ids.device
    clock = Timeline(dev)
    B = input_ids.shape[0]
    stats = GenerationStats(k=k, rows=B)
    rows = _Rows(B, max_new_tokens, eos_token_id, dev)
    # Holes (rejected slots of rows that accepted less) are compacted once 16 loops' worth pile up: a copy of the
    # cache every ~16 loops or more, and a cache that never outgrows the generation's length + this budget.
    holes = HOLE_LOOPS * (k + 1)
    capacity = input_ids.shape[1] + max_new_tokens + k + 2 + holes
    tgt = _decoder(target, capacity, holes, compile)
    drafter = (_FeatureDrafter if tap is not None else _ModelDrafter)(draft, tap, capacity, holes, compile)
    analytic = torch.zeros((), dtype=torch.float64, device=dev)  # sum_x min(p, q) at tested positions, read at the end

    # Both caches hold everything but the last token, `pending`, which each loop feeds first.
    pending = input_ids[:, -1]
    if input_ids.shape[1] > 1:
        head_mask = None if attention_mask is None else attention_mask[:, :-1]
        head_mask_host = _host_mask(head_mask)
        _prefill(tgt, input_ids[:, :-1], head_mask, mask_host=head_mask_host)
        drafter.prefill(input_ids, head_mask, head_mask_host)
        pos = tgt.valid.sum(1)
    else:
        pos = torch.zeros(B, dtype=torch.long, device=dev)
        drafter.start(B, dev)
    stats.record_loop(0, clock.span("prefill", clock.start))

    while True:
        Bn = pending.shape[0]
        K = max(1, min(k, rows.max_remaining() - 1))  # no drafting past the end of every row
        if not drafter.can_draft:
            K = 0  # a feature draft before its first target features: this loop is one plain target step

        # 1. Draft up to K tokens (k="auto": the chooser may stop earlier).
        t = clock.mark()
        if K:
            stop = chooser.stopper(rows.index, K) if chooser is not None else None
            p, drafts, confs = drafter.propose(pending, pos, K, cfg, generator, stop)  # (Bn, K, V), (Bn, K)
            K = drafts.shape[1]
        else:
            drafts = torch.zeros(Bn, 0, dtype=torch.long, device=dev)
        if chooser is not None:
            stats.k_per_loop.append(K)
        t = clock.span("draft", t)
        stats.draft_calls += K

        # 2. Score K+1 positions with the target in one pass.
        block = torch.cat([pending[:, None], drafts], 1)  # (Bn, K+1)
        steps = torch.arange(K + 1, device=dev)
        logits = tgt(block, pos[:, None] + steps, torch.ones_like(block, dtype=torch.bool), K + 1).logits
        features = tap.take() if tap is not None else None
        clock.span("target", t)
        stats.target_calls += 1

        # 3. Accept or reject. Greedy (temperature 0) is the same rule on one-hot p and q: keep the drafts that
        #    equal the target's argmax, then emit its argmax; no distribution is built.
        if cfg.greedy:
            best = logits.argmax(-1)  # (Bn, K+1)
            match = drafts == best[:, :K]
            n = match.long().cumprod(-1).sum(-1)
            nxt = best.gather(1, n[:, None]).squeeze(1)
            accept = match.float()  # sum_x min(p, q) of two one-hot distributions
        else:
            q = process_logits(logits, cfg)
            if not K:  # nothing drafted (a feature draft's first loop): one plain step
                p = q[:, :0]
            n, nxt = verify(p, q, drafts, generator)  # (Bn,), (Bn,)
            accept = expected_acceptance(p, q[:, :K])
        if K:
            was_tested = steps[None, :K] <= n[:, None]  # (Bn, K): positions up to the first rejection were tested
            analytic += (accept * was_tested).sum()

        # 4. The loop's one read of the device; emit, honouring max_new_tokens and EOS per row.
        host = torch.cat([n[:, None], nxt[:, None], drafts], 1).tolist()
        n_host = torch.tensor([h[0] for h in host], dtype=torch.long, device="cpu")
        done, kept = rows.emit([h[2: 2 + h[0]] + [h[1]] for h in host])
        stats.new_tokens += kept
        stats.record_loop(kept, clock.mark())
        if K:
            for a in n_host.tolist():
                stats.record_row(a, K)
            if chooser is not None:
                chooser.update(rows.index, n, K, confs, match.float() if cfg.greedy else  # confs: p at drafts
                               acceptance_probability(confs, q[:, :K].gather(-1, drafts[..., None]).squeeze(-1)))

        # 5. Roll both caches back to the accepted prefix: the target holds pending + n accepted drafts.
        tgt.settle(steps[None, :] <= n[:, None], torch.arange(K + 1)[None, :] <= n_host[:, None])
        t = clock.mark()
        drafter.accept(n, n_host, drafts, nxt, pos, features, last=all(done))
        clock.span("draft", t)
        pos = pos + n + 1
        pending = nxt
        if all(done):
            break
        if any(done):
            live, live_host = rows.keep(done)
            pending, pos = pending[live], pos[live]
            tgt.select(live, live_host)
            drafter.select(live, live_host)
    stats.finish(clock, analytic)
    return Generation(rows.tensors(dev), stats)
