"""The draft a run starts from: shallow and wide from the target's own weights, or a feature head built from the
target's pass; and the pruned head's rows."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from draftsmith.data.corpus import load_blocks
from draftsmith.drafts.build import DraftConfig, build_draft
from draftsmith.drafts.feature import build_feature_draft
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.pruned import top_tokens


def draft_config(cfg) -> DraftConfig:
    """`draft.*` as a DraftConfig, its values checked (its keys and types are the schema's: train/schema.py)."""
    return DraftConfig(**OmegaConf.to_container(cfg.draft))


def head_frequencies(cfg, draft_cfg, tok, token_counts: torch.Tensor) -> torch.Tensor:
    """Token frequencies that choose a pruned feature head's tokens: the training corpus', plus (equal weight)
    those of `draft.vocab_source`. A 37k-token corpus of target samples holds only 4,129 distinct tokens; with the
    stdlib's frequencies added, the top 16,384 cover 94% of held-out target samples (measured; 87% without)."""
    freq = token_counts.double() / token_counts.sum().clamp_min(1)
    if draft_cfg.draft_vocab and draft_cfg.vocab_source:
        extra = load_blocks(draft_cfg.vocab_source, tok, cfg.data.block_size, cfg.data.val_fraction, cfg.seed,
                            cfg.data.text_field)["train"]
        c = torch.bincount(extra.flatten(), minlength=len(freq)).double()
        freq = freq + c / c.sum().clamp_min(1)
    return freq


def initial_draft(cfg, draft_cfg: DraftConfig, tok, data, weights, target, load_target, one_rank: bool = False):
    """(draft, head_tokens, target): the draft a run trains, and the rows of a pruned independent head (None for the
    full head; a feature head's rows are its own). A feature draft is built from a pass of the target, which it
    loads (`load_target()`) if this rank holds none yet; a shallow-wide draft from the target's weights read by name
    (`weights`), or from the loaded target when they cannot be read so, or when this one rank already holds the
    target whole on an accelerator (`built_on_device`)."""
    target_config = (weights or target).config
    if draft_cfg.kind == "feature_head":  # built from a pass of the target: every rank holds it
        target = target or load_target()
        train = data.blocks["train"]
        draft = build_feature_draft(target, draft_cfg.feature_layers, draft_cfg.draft_vocab,
                                    head_frequencies(cfg, draft_cfg, tok, data.token_counts), draft_cfg.freeze_head,
                                    probe=train[0]["ids"][:4] if data.chat else train[:4],
                                    feature_norm=draft_cfg.feature_norm, norm_output=draft_cfg.norm_output)
    else:
        draft = build_draft(target if built_on_device(target, weights, one_rank) else (weights or target), draft_cfg)
    head_tokens = None
    if draft_cfg.draft_vocab and draft_cfg.kind != "feature_head":  # the sampler's choice of rows (+ EOS)
        if draft_cfg.draft_vocab >= target_config.vocab_size:
            raise DraftsmithError(f"draft.draft_vocab={draft_cfg.draft_vocab} prunes nothing: the target has "
                                  f"{target_config.vocab_size} tokens; set it lower or to null (the full head)")
        head_tokens = top_tokens(head_frequencies(cfg, draft_cfg, tok, data.token_counts), draft_cfg.draft_vocab,
                                 [tok.eos_token_id])
    if draft.config.vocab_size != target_config.vocab_size:
        raise DraftsmithError(f"draft vocabulary ({draft.config.vocab_size}) differs from the target's "
                              f"({target_config.vocab_size}); drafts must share the target's tokenizer")
    return draft, head_tokens, target


def built_on_device(target, weights, one_rank: bool) -> bool:
    """Whether the draft is built from the loaded target rather than from its files read again on the host: where
    one rank holds the whole target on an accelerator in the files' own dtype, its tensors are those bytes already
    (an 8B target's 1.7B-parameter draft: 15-40 s of host work saved). With several ranks every rank must start from
    the same bytes, read by name (FSDP broadcasts nothing); a target spread over GPUs (device_map) is not whole."""
    if not one_rank or target is None or weights is None or getattr(target, "hf_device_map", None):
        return False
    param = next(target.parameters())
    return param.device.type != "cpu" and param.dtype == weights.dtype
