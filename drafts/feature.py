"""Training the feature draft (EAGLE-3): its teacher pass, its training-time test, its acceptance.

One target pass gives both what the draft reads (the hidden states entering three target layers, kept by a
`FeatureTap`) and what it must match (the target's logits): no second target pass. Alignment, for a batch of
T tokens x_0..x_{T-1}: the target runs on x_0..x_{T-2}; draft slot j (j = 0..T-3) reads x_{j+1} and the features
at position j, and is trained towards the target's distribution of x_{j+2}. The draft is unrolled `steps` times on
its own outputs (`FeatureDraft.unroll`), as the sampler runs it for K = steps drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.drafts.batch import Batch
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.feature import FeatureConfig, FeatureDraft, FeatureTap
from draftsmith.sampling.probs import SamplingConfig
from draftsmith.sampling.rejection import teacher_forced_acceptance


def build_feature_draft(target, feature_layers=None, draft_vocab: int | None = None, token_counts=None,
                        freeze_head: bool = True, probe: torch.Tensor | None = None, feature_norm: str = "none",
                        norm_output: bool = False) -> FeatureDraft:
    """The target's embedding (frozen), its final norm and head rows (for a pruned head: the `draft_vocab` most
    frequent tokens of the corpus) as a start; the layer is new, and fc starts as the highest feature layer's state
    (after `feature_norm`'s RMSNorm: none, each state, or all three) at unit scale, measured on `probe` (token ids,
    (B, T); None: random tokens); `norm_output` feeds the next step the normed output. Parameters and head printed."""
    cfg = FeatureConfig.for_target(target.config, feature_layers, draft_vocab)
    cfg.fc_norm, cfg.norm_before_fc, cfg.norm_output = feature_norm == "each", feature_norm == "all", norm_output
    torch.manual_seed(0)
    dev = target.get_input_embeddings().weight.device  # where it copies from: no tensor crosses to the host
    with torch.device(dev):
        draft = FeatureDraft(cfg).float()
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.get_input_embeddings().weight.float())
        draft.norm.weight.copy_(target.get_decoder().norm.weight.float())
        head = target.get_output_embeddings().weight.float()
        if draft_vocab:
            if token_counts is None:
                raise DraftsmithError("draft.draft_vocab needs the corpus' token counts to choose the head's tokens")
            draft.set_vocab(token_counts.topk(draft_vocab).indices.to(dev))
        draft.lm_head.weight.copy_(head[draft.token_ids()])
        # The target's hidden states are large (SmolLM2-135M, entering layer 27: median RMS 23 per token, 2e4 at the
        # first one), so a default fc fed the residual a random vector of RMS ~30 to which the new layer added
        # ~0.02: the token it reads barely counted. Starting fc as the highest layer's state at RMS ~1 puts the
        # residual where the target's final norm and head read, at the layer's own scale (val/alpha_on_target 0.297
        # -> 0.327 at 450 steps; a default fc rescaled to RMS 1: 0.313: docs/results.md, "The feature head").
        H = cfg.target_hidden_size
        draft.fc.weight.zero_()
        draft.fc.weight[:, 2 * H:] = torch.eye(H, device=dev) / _top_feature_scale(target, draft, probe)
    draft.embed_tokens.requires_grad_(False)
    draft.lm_head.requires_grad_(not freeze_head)
    n = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    print(f"draftsmith: feature draft: 1 layer of width {cfg.hidden_size} on target layers {cfg.feature_layers}, "
          f"head over {draft.lm_head.weight.shape[0]} tokens{' (frozen)' if freeze_head else ''}; "
          f"{n / 1e6:.1f}M trainable parameters", flush=True)
    return draft


def _top_feature_scale(target, draft: FeatureDraft, probe: torch.Tensor | None) -> torch.Tensor:
    """Median per-token RMS, on `probe`, of the highest of the draft's features as `fc` reads it (after the draft's
    own norms of the states, if any), on the target's device (a 0-d tensor: reading it back would stop at the
    device)."""
    if probe is None:
        g = torch.Generator(device="cpu").manual_seed(0)  # the same probe on any device; moved to the target
        probe = torch.randint(0, target.config.vocab_size, (4, 64), generator=g, device="cpu")
    with FeatureTap(target, draft.feature_layers) as tap, torch.no_grad():
        target(input_ids=probe.to(target.device))
        top = draft.normed(tap.take().float())[..., 2 * target.config.hidden_size:]
    return top.pow(2).mean(-1).sqrt().median().clamp_min(1e-6)


@dataclass
class FeatureBatch:
    """What one teacher pass gives the feature draft: its inputs (tokens, features, positions, slot mask) and
    the target's logits for what each slot predicts; `keep` (B, T-2) marks the slots with a real label (None:
    all)."""

    tokens: torch.Tensor
    features: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor | None
    teacher: torch.Tensor
    labels: torch.Tensor
    keep: torch.Tensor | None
    known: torch.Tensor | None = None  # (B, T-2) on the host: slots whose feature and teacher were kept (None: all)
    rooted: torch.Tensor | None = None  # (B, T-2) on the host: slots whose feature was kept (None: all)


def target_outputs(target, layers: list[int], b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's logits and features (B, T-1, V) and (B, T-1, 3 H) at every position but the last."""
    with torch.no_grad(), FeatureTap(target, layers, device=b.ids.device) as tap:
        pos = b.positions()
        logits = target(input_ids=b.ids[:, :-1], attention_mask=None if b.mask is None else b.mask[:, :-1],
                        position_ids=None if pos is None else pos[:, :-1]).logits
        return logits, tap.take()


def teacher_pass(target, layers: list[int], b: Batch) -> FeatureBatch:
    return feature_batch(b, *target_outputs(target, layers, b))


def feature_batch(b: Batch, logits: torch.Tensor, feats: torch.Tensor, known: torch.Tensor | None = None,
                  known_features: torch.Tensor | None = None) -> FeatureBatch:
    """The draft's slots from the target's outputs on `b` (fresh from `target_outputs`, or kept: data/teacher.py);
    `logits` may already be over a pruned head's tokens only. Kept outputs may lack a teacher or a feature at some
    positions (`known`, `known_features`, (B, T-1)): slots there carry no loss, and a slot without its feature is
    hidden from the others' attention, as padding is (the sampler never drafts from a position the target skipped)."""
    T = b.ids.shape[1]
    pos = b.positions()
    if pos is None:
        pos = torch.arange(T, device=b.ids.device)[None].expand(b.ids.shape[0], T)
    # the label of slot j is x_{j+2}: loss_mask index j+1; None: every slot has one (its slots are then counted
    # without reading the device)
    keep = None if b.loss_mask is None else b.loss_mask[:, 1:]
    mask = None if b.mask is None else b.mask[:, : T - 2]
    ok = rooted = None
    if known is not None or known_features is not None:  # the store's flags, on the host
        rooted = (torch.ones(b.ids.shape[0], T - 2, dtype=torch.bool) if known_features is None
                  else known_features[:, : T - 2].cpu())
        ok = rooted if known is None else rooted & known[:, 1:].cpu()
        on_device = rooted.to(b.ids.device)
        mask = on_device if mask is None else mask.bool() & on_device
    return FeatureBatch(tokens=b.ids[:, 1:-1], features=feats[:, :-1], positions=pos[:, : T - 2], mask=mask,
                        teacher=logits[:, 1:], labels=b.ids[:, 2:], keep=keep, known=ok, rooted=rooted)


def noisy_features(features: torch.Tensor, blocks: int, scale: float) -> torch.Tensor:
    """`features` (..., blocks x H) plus uniform noise U(-scale, scale) x each block's per-token RMS, as EAGLE-1
    trains (U(-0.1, 0.1)): the same few thousand samples, seen again each epoch, are never read twice alike.
    Relative, because the blocks differ in scale by orders (SmolLM2-135M: RMS ~20 entering layer 27, 2e4 at a
    first token)."""
    x = features.float().unflatten(-1, (blocks, -1))
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    noise = (torch.rand_like(x) * 2 - 1) * (scale * rms)
    return (x + noise).flatten(-2).to(features.dtype)


def unrolled(draft: FeatureDraft, fb: FeatureBatch, steps: int):
    """(draft logits (N, n), teacher logits (N, n), labels (N,), [N_s per step]): the slots of every step, step by
    step; only slots with a real label and a history of s own steps (j >= s); over the head's n tokens when it is
    pruned (labels outside: -100, ignored by cross-entropy; the teacher renormalised over them, as EAGLE-3 trains
    its reduced vocabulary). One head call and one gather of the teacher for all steps: copying (N, n) tensors
    step by step and concatenating them took 60% of a kept-teacher step (AMX Xeon, bf16), more than the head.

    Restricting only the loss to frequent tokens while keeping a full head is a trap, measured: the 41k logits
    the loss never saw kept 62% of the draft's mass, val/alpha_on_target 0.087 against 0.21 on training batches."""
    outs = draft.unroll(fb.tokens, fb.features, steps, fb.positions, fb.mask)
    labels, vocab = fb.labels, None
    if draft.pruned:
        vocab = draft.token_ids()
        index = torch.full((draft.config.vocab_size,), -100, dtype=torch.long, device=labels.device)
        index[vocab] = torch.arange(len(vocab), device=labels.device)
        labels = index[labels]
    teacher = fb.teacher  # kept logits come over the head's tokens already; fresh ones once, not per step
    if vocab is not None and teacher.shape[-1] != len(vocab):
        teacher = teacher[..., vocab]
    idx = [_slots(fb.keep, s, fb.labels) for s in range(steps)]
    hidden = torch.cat([h.reshape(-1, h.shape[-1]).index_select(0, i) for h, i in zip(outs, idx)])
    lp = draft.lm_head(draft.norm(hidden))
    flat = torch.cat(idx)
    slots = teacher.shape[1]
    lq, lab = teacher[flat // slots, flat % slots], labels.reshape(-1)[flat]
    if fb.known is not None:
        # step s at slot j drafts on from the features at j - s .. j; where the target kept no teacher or one of
        # them, the draft's own detached logits stand in (divergence and gradient 0) and the label is ignored, so
        # the batch keeps its shape (the compiled loss would recompile on every new count of slots)
        # (decided on the host, where the store's flags live: no read of the device)
        keep = None if fb.keep is None else fb.keep.cpu()
        ok, good = fb.known.clone(), []
        for s in range(len(idx)):
            if s:
                ok[:, s:] &= fb.rooted[:, : ok.shape[1] - s]
            good.append(ok.reshape(-1)[_slots(keep, s, ok)])
        bad = (~torch.cat(good)).nonzero().squeeze(1).to(lq.device)
        lq[bad] = lp.detach()[bad].to(lq.dtype)
        lab[bad] = -100
    return lp, lq, lab, [len(i) for i in idx]


@torch.no_grad()
def feature_alpha(target, draft: FeatureDraft, b: Batch, cfg: SamplingConfig, steps: int,
                  chunk: int = 512) -> list[float]:
    """Teacher-forced alpha_analytic of each drafting step 0..steps-1 (full-vocabulary p, exact for a pruned
    head) on the positions of `b`: what the sampler meets at draft positions 1..K when the earlier drafts match."""
    fb = teacher_pass(target, draft.feature_layers, b)
    out = []
    logits, _, _, sizes = unrolled(draft, fb, steps)
    for s, lp in enumerate(logits.split(sizes)):
        lq = _full_teacher(fb, s)
        columns = draft.token_ids() if draft.pruned else None
        out.append(float(teacher_forced_acceptance(lp, lq, cfg, columns, chunk).mean()))
    return out


def _slots(keep: torch.Tensor | None, s: int, labels: torch.Tensor) -> torch.Tensor:
    """Flat indices of the slots (`labels`' (B, n)) step s is scored on: a real label (`keep`; None: every slot),
    and j >= s (a history of s own steps). With every slot kept (training) they follow from the shape alone: no
    read of the device."""
    if keep is None:
        (B, n), dev = labels.shape, labels.device
        return (torch.arange(B, device=dev)[:, None] * n + torch.arange(s, n, device=dev)[None]).reshape(-1)
    keep = keep.clone()
    keep[:, :s] = False
    return keep.reshape(-1).nonzero().squeeze(1)


def _full_teacher(fb: FeatureBatch, s: int):
    return fb.teacher.reshape(-1, fb.teacher.shape[-1]).index_select(0, _slots(fb.keep, s, fb.labels))
