"""Build the shallow-wide draft for a target: an ordinary Hugging Face causal LM of the target's family.

The paper's draft for Chinchilla 70B (80 layers, d 8192) has 8 layers and d 6144: a tenth of the depth, three
quarters of the width. Depth costs latency (layers run in sequence); width is cheap at batch 1. The draft keeps
the target's tokenizer and vocabulary, so any engine that loads the target's family loads the draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftsmith.sampling.errors import DraftsmithError


@dataclass
class DraftConfig:
    """Draft sizes, derived from the target's config unless set explicitly."""

    depth_ratio: float = 0.1
    width_ratio: float = 0.75
    min_layers: int = 2
    layers: int | None = None  # fixes the depth
    hidden: int | None = None  # fixes the width (must split into the target's heads)
    intermediate: int | None = None
    init: str = "scratch"  # scratch | target: copy embeddings, head, final norm and `init_layers` of the target
    init_layers: list[int] | None = None  # target layer indices copied into the draft, in order
    init_from: str | None = None  # a saved draft (a best_draft dir) whose weights replace `init`'s: continue
                                  # training it (e.g. on the draft's own samples once it can write)
    freeze_embeddings: bool = False  # keep embeddings/head equal to the target's (saves ~25% of a step on CPU)
    extra: dict = field(default_factory=dict)  # any other config field to override
    kind: str = "independent"  # independent (the paper's) | feature_head (EAGLE-3: reads the target's features)
    feature_layers: list[int] | None = None  # feature_head: target layers read (default 2, L/2, L-3)
    draft_vocab: int | None = None  # head over the N most frequent corpus tokens (None: all); an independent draft
                                    # trains and runs with it (a 4x cheaper head on a CPU), a feature head too
    freeze_head: bool = True  # feature_head: keep the target's head rows
    vocab_source: str | None = None  # a corpus whose token frequencies join the training corpus' in choosing the
                                     # pruned head's tokens (e.g. stdlib)
    unroll: int = 4  # feature_head: drafting steps of the training-time test (the K it is trained for)
    step_decay: float = 1.0  # feature_head: unrolled step s weighs step_decay ** s in the loss (EAGLE-3: 0.8)
    feature_noise: float = 0.0  # feature_head: training adds U(-a, a) x each state's RMS to the features it reads
    init_scale: float = 1.0  # init=target: a copied layer taken after a jump (layer 29 after layer 1) starts with its
                             # output projections scaled by this (it expects the residual of its own depth, RMS ~66 in
                             # the demo target, and receives that of the layer before, ~3): < 1 starts it as a small
                             # correction; 1: copied as is
    vocab_count: str = "all"  # what chooses a pruned head's tokens: all (every training token, prompts included)
                              # or sampled (the target's own sampled tokens alone, as speculators and SpecForge count)
    feature_norm: str = "none"  # feature_head: an RMSNorm on the target's states before fc: none (EAGLE-3's raw
                                # states), each (one per state: speculators' --fc-norm) or all (one over the three
                                # together: speculators' default). The states differ in scale ~20x (RMS 3 / 63 / 66)
    norm_output: bool = False  # feature_head: the next unrolled step reads the output after the final norm
                               # (speculators' default), not before it (EAGLE-3's)

    def __post_init__(self):
        if self.kind not in ("independent", "feature_head"):
            raise DraftsmithError(f"draft.kind must be 'independent' or 'feature_head', got {self.kind!r}")
        if self.draft_vocab is not None and self.draft_vocab < 2:
            raise DraftsmithError(f"draft.draft_vocab must be >= 2 tokens (or null: the full head), got "
                                  f"{self.draft_vocab}")
        if self.unroll < 1:
            raise DraftsmithError(f"draft.unroll must be >= 1, got {self.unroll}")
        if not 0 < self.step_decay <= 1:
            raise DraftsmithError(f"draft.step_decay must be in (0, 1] (step s of the unroll weighs step_decay ** s), "
                                  f"got {self.step_decay}")
        if not 0 <= self.feature_noise < 1:
            raise DraftsmithError(f"draft.feature_noise must be in [0, 1) (uniform noise, relative to each feature's "
                                  f"RMS), got {self.feature_noise}")
        if not 0 < self.init_scale <= 1:
            raise DraftsmithError(f"draft.init_scale must be in (0, 1] (1: the jumped-to layer copied as is), got "
                                  f"{self.init_scale}")
        if self.vocab_count not in ("all", "sampled"):
            raise DraftsmithError(f"draft.vocab_count must be 'all' or 'sampled', got {self.vocab_count!r}")
        if self.feature_norm not in ("none", "each", "all"):
            raise DraftsmithError(f"draft.feature_norm must be 'none', 'each' or 'all', got {self.feature_norm!r}")
        if self.kind != "feature_head" and (self.feature_norm != "none" or self.norm_output):
            raise DraftsmithError("draft.feature_norm and draft.norm_output shape a feature head: set draft.kind="
                                  "feature_head (recipe=feature_head) or leave them at none / false")
        if self.init not in ("scratch", "target"):
            raise DraftsmithError(f"draft.init must be 'scratch' or 'target', got {self.init!r}")
        if self.layers is not None and self.layers < 1:
            raise DraftsmithError(f"draft.layers must be >= 1, got {self.layers}")


def draft_config_for(target_config, cfg: DraftConfig):
    """The target's config with the draft's depth and width."""
    tc = target_config
    layers = cfg.layers or max(cfg.min_layers, round(tc.num_hidden_layers * cfg.depth_ratio))
    heads, kv_heads = tc.num_attention_heads, getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads
    if cfg.hidden is not None:
        hidden = cfg.hidden
    else:  # keep the target's heads, shrink each head (rounded to 8 for fast kernels)
        head_dim = max(8, int(round(tc.hidden_size // heads * cfg.width_ratio / 8)) * 8)
        hidden = heads * head_dim
    if hidden % heads:
        raise DraftsmithError(f"draft hidden size {hidden} does not split into the target's {heads} attention heads; "
                              f"choose a multiple of {heads}")
    if cfg.init == "target" and hidden != tc.hidden_size:
        raise DraftsmithError(f"draft.init=target copies the target's weights, so the width must be the target's "
                              f"({tc.hidden_size}), not {hidden}: set draft.width_ratio=1.0 or draft.init=scratch")
    intermediate = cfg.intermediate or int(round(tc.intermediate_size * hidden / tc.hidden_size))
    d = tc.to_dict()
    d.update(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=intermediate,
             num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads, **cfg.extra)
    if d["vocab_size"] != tc.vocab_size:
        raise DraftsmithError(f"draft vocabulary ({d['vocab_size']}) differs from the target's ({tc.vocab_size}): "
                              "a draft must share the target's tokenizer and vocabulary")
    d.pop("quantization_config", None)
    d.pop("layer_types", None)  # derived from num_hidden_layers by the config class
    return type(tc)(**d)


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


class TargetWeights:
    """The target's tensors by name, read one at a time from its safetensors files, without loading the target: a
    rank that holds no target builds its draft from them, and a 70B target's state in fp32 would be 280 GB of host
    memory where the draft takes a tenth of its layers. Every rank reads the same bytes, so every rank starts from
    the same draft (FSDP does not broadcast rank 0's weights)."""

    def __init__(self, path, config):
        from safetensors import safe_open

        self.path, self.config = Path(path), config
        self._where = {}  # name -> (file, the name it is stored under)
        for f in sorted(self.path.glob("*.safetensors")):
            with safe_open(f, "pt") as h:
                self._where.update({k: (f, k) for k in h.keys()})
        tied = getattr(config, "tie_word_embeddings", False)
        if tied and "lm_head.weight" not in self._where and "model.embed_tokens.weight" in self._where:
            self._where["lm_head.weight"] = self._where["model.embed_tokens.weight"]  # tied: saved once

    @classmethod
    def of(cls, name: str, trust_remote_code: bool = False) -> TargetWeights | None:
        """The target `name`'s weights, or None where they are not in safetensors files."""
        from transformers import AutoConfig

        from draftsmith.sampling.names import resolve

        path = resolve(name)
        if not any(path.glob("*.safetensors")):
            return None
        return cls(path, AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code))

    device = torch.device("cpu")  # the files are read into host memory

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the files store the embedding in (read from the header: no tensor is loaded)."""
        from safetensors import safe_open

        f, key = self._where["model.embed_tokens.weight"]
        with safe_open(f, "pt") as h:
            return _SAFETENSORS_DTYPES[h.get_slice(key).get_dtype()]

    def new_model(self, config):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(config)

    def state_dict(self) -> TargetWeights:
        return self

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        f, key = self._where[name]
        with safe_open(f, "pt") as h:
            return h.get_tensor(key)


def build_draft(target, cfg: DraftConfig):
    """A draft model for `target` (a loaded HF causal LM, or its `TargetWeights`), initialised per `cfg.init`, in
    fp32 on the target's device: the target's tensors it copies never cross to the host and back (a copy from a GPU
    target into a host draft is a host round trip per tensor, and the draft would then sit on the host beside a
    target on the GPU)."""
    config = draft_config_for(target.config, cfg)
    torch.manual_seed(0)
    with torch.device(target.device):
        draft = (target.new_model(config) if isinstance(target, TargetWeights) else type(target)(config)).float()
    if cfg.init == "target":
        n_t, n_d = target.config.num_hidden_layers, config.num_hidden_layers
        # Default: the first layers and the last one; the last target layer produces the residual the (shared)
        # head expects.
        picks = cfg.init_layers or [*range(n_d - 1), n_t - 1]
        if len(picks) != n_d or not all(0 <= i < n_t for i in picks):
            raise DraftsmithError(f"draft.init_layers must list {n_d} target layer indices in [0, {n_t}), got {picks}")
        src = target.state_dict()  # references: only the tensors the draft takes are copied (to fp32), one at a
        dst = {}                   # time; a 70B target's state in fp32 would be 280 GB of host memory
        for k in draft.state_dict():
            if k.startswith("model.layers."):
                i = int(k.split(".")[2])
                dst[k] = src[k.replace(f"model.layers.{i}.", f"model.layers.{picks[i]}.", 1)].float()
            elif k in src:
                dst[k] = src[k].float()
        missing = set(draft.state_dict()) - set(dst)
        if missing:
            raise DraftsmithError(f"could not initialise {sorted(missing)[:3]} from the target")
        draft.load_state_dict(dst)
        if cfg.init_scale != 1.0:
            _scale_jumps(draft, picks, cfg.init_scale)
    if cfg.init_from:
        _load_weights(draft, cfg.init_from)
    if cfg.freeze_embeddings:
        draft.get_input_embeddings().requires_grad_(False)
        draft.get_output_embeddings().requires_grad_(False)
    return draft


@torch.no_grad()
def _scale_jumps(draft, picks: list[int], scale: float) -> None:
    """Scale the residual writes (attention's o_proj, the MLP's down_proj) of every draft layer copied from a target
    layer that does not follow the previous pick: its contribution to the residual stream then starts in proportion
    to the stream it receives."""
    for i in range(1, len(picks)):
        if picks[i] != picks[i - 1] + 1:
            layer = draft.model.layers[i]
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                proj.weight.mul_(scale)
                if getattr(proj, "bias", None) is not None:
                    proj.bias.mul_(scale)


def _load_weights(draft, path: str) -> None:
    """Copy a saved draft's weights into `draft` (same shapes), refusing any other checkpoint in one line."""
    from safetensors.torch import load_file

    from draftsmith.sampling.load import check_weight_files
    from draftsmith.sampling.names import resolve

    src = resolve(path)
    check_weight_files(src)
    files = sorted(src.glob("*.safetensors")) if src.is_dir() else []
    state = {k: v for f in files if f.name != "token_counts.safetensors" for k, v in load_file(f).items()}
    mine = draft.state_dict()
    # tied embeddings are saved once: the head may be absent from the file
    absent = [k for k in mine if k not in state and not (k == "lm_head.weight" and draft.config.tie_word_embeddings)]
    wrong = [k for k in state if k in mine and state[k].shape != mine[k].shape]
    if not state or absent or wrong or set(state) - set(mine):
        raise DraftsmithError(f"draft.init_from={path} does not hold a draft of this shape ({len(mine)} tensors; "
                              f"missing {absent[:2]}, other shapes {wrong[:2]}, extra "
                              f"{sorted(set(state) - set(mine))[:2]}): give a best_draft dir trained for this target "
                              "with the same draft.* settings")
    draft.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)


def truncated_target(target, layers: int):
    """The naive baseline: the target's first `layers` layers + final norm + head, no training; where the target is
    and in its dtype, as the sampler runs it beside the target."""
    cut = build_draft(target, DraftConfig(layers=layers, width_ratio=1.0, init="target",
                                          init_layers=list(range(layers))))
    return cut.to(target.dtype).eval().requires_grad_(False)
