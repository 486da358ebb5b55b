"""The feature draft (EAGLE-3, Li et al. 2025): one decoder layer that reads the target's own hidden states.

An independent draft cheap enough to pay is a weak language model. The feature draft is as cheap (one layer of the
target's width) but starts from what the target already computed: at slot j it takes the embedding of token x_{j+1}
and g_j, a fusion (`fc`) of the target's hidden states at position j from a low, a middle and a high layer, and
predicts x_{j+2}. When it drafts further than the target has verified, its own output h_j (before the final norm)
stands in for g_{j+1}: the "training-time test" unrolls exactly that during training (`unroll`).

Weight names and layout are vLLM's `LlamaForCausalLMEagle3` (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`),
so the export copies tensors as they are. Feature layer ids follow vLLM's `eagle_aux_hidden_state_layer_ids`: id i
is the hidden state entering target layer i (default 2, L/2, L-3).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.sampling.cache import PreallocatedLayer, keep_last
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.pruned import PrunedOutput

KIND = "feature_head"  # `draftsmith_kind` in config.json; an independent draft is a plain HF checkpoint


def _default_layers(L: int) -> list[int]:
    """vLLM's default for EAGLE-3 (2, L // 2, L - 3) where those are 3 distinct layers; on a shallower target
    (tests' tiny ones) the first, middle and last. The config names them either way, so vLLM reads these."""
    vllm = sorted({2, L // 2, L - 3})
    return vllm if len(vllm) == 3 and 0 <= vllm[0] and vllm[-1] < L else [0, L // 2, L - 1]


@dataclass
class FeatureConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_hidden_size: int
    target_num_hidden_layers: int | None  # None: unknown (a peer's checkpoint names only its layer ids)
    feature_layers: list[int]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    draft_vocab_size: int | None = None  # None: the full vocabulary
    hidden_act: str = "silu"
    num_hidden_layers: int = 1
    # speculators' variants of the EAGLE-3 layer (its `Eagle3SpeculatorConfig`; vLLM serves them too), all off in
    # the classic layer we train: the residual taken after hidden_norm, one RMSNorm over the 3 concatenated features
    # before fc (or one per feature: fc_norm), and the final norm applied to the output fed to the next step
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    draftsmith_kind: str = KIND
    extra: dict = field(default_factory=dict)

    @classmethod
    def for_target(cls, tc, feature_layers=None, draft_vocab_size=None, intermediate_size=None) -> FeatureConfig:
        """A feature draft of the target's width and attention shape (EAGLE-3's default)."""
        L = tc.num_hidden_layers
        layers = sorted(feature_layers) if feature_layers else _default_layers(L)
        rope = getattr(tc, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))
        heads = tc.num_attention_heads
        if getattr(tc, "hidden_act", "silu") != "silu":
            raise DraftsmithError(f"the feature draft is a Llama-style layer (SiLU MLP); the target uses "
                                  f"{tc.hidden_act}")
        return cls(vocab_size=tc.vocab_size, hidden_size=tc.hidden_size,
                   intermediate_size=intermediate_size or tc.intermediate_size, num_attention_heads=heads,
                   num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
                   head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
                   target_hidden_size=tc.hidden_size, target_num_hidden_layers=L, feature_layers=layers,
                   rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-5), rope_theta=float(theta),
                   max_position_embeddings=getattr(tc, "max_position_embeddings", 2048),
                   draft_vocab_size=draft_vocab_size)

    def __post_init__(self):
        layers, L = list(self.feature_layers), self.target_num_hidden_layers
        if len(set(layers)) != 3 or not all(0 <= i and (L is None or i < L) for i in layers):
            raise DraftsmithError(f"feature_layers must be 3 distinct layer ids of the target in [0, {L}), got "
                                  f"{layers}")
        if self.norm_before_fc and self.fc_norm:
            raise DraftsmithError("norm_before_fc and fc_norm are exclusive (one norm over the 3 features, or one "
                                  "per feature): set one of them false in the draft's config.json")
        # vLLM collects the target's states in layer order (`tuple(sorted(set(ids)))`): a draft whose fc reads them
        # in another order would be served silently wrong there
        if layers != sorted(layers):
            raise DraftsmithError(f"feature_layers {layers} are not in increasing order, the order in which vLLM "
                                  "passes the target's states: this draft cannot be served as trained")

    def check_target(self, tc) -> None:
        """A feature draft reads the hidden states of one target shape: refuse any other, naming both sides. A
        peer's head (`peers.py`) does not record the target's depth: its layer ids must exist there."""
        L = self.target_num_hidden_layers
        depth_ok = L == tc.num_hidden_layers if L is not None else max(self.feature_layers) < tc.num_hidden_layers
        if (self.target_hidden_size, self.vocab_size) != (tc.hidden_size, tc.vocab_size) or not depth_ok:
            depth = f"{L} layers" if L is not None else f"layers {list(self.feature_layers)}"
            raise DraftsmithError(f"this feature draft was trained on a target of width {self.target_hidden_size}, "
                                  f"{depth}, vocabulary {self.vocab_size}; the target given has width "
                                  f"{tc.hidden_size}, {tc.num_hidden_layers} layers, vocabulary {tc.vocab_size}")


def check_vocab_map(keys, head_rows: int, vocab_size: int, path) -> None:
    """A head over fewer tokens than the target's vocabulary needs its d2t (which target token each head row
    proposes). Without it vLLM silently maps row i to token i and its acceptance collapses; we refuse instead."""
    if head_rows < vocab_size and "d2t" not in keys:
        raise DraftsmithError(f"{path}: the draft's head covers {head_rows} of the target's {vocab_size} tokens but "
                              "its weights hold no d2t (the target token of each head row); export it again with "
                              "d2t, or train it with the full vocabulary")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _rotate(x, cos, sin):
    a, b = x.chunk(2, -1)
    return x * cos + torch.cat([-b, a], -1) * sin


class _Attention(nn.Module):
    def __init__(self, c: FeatureConfig):
        super().__init__()
        self.h, self.kv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, self.h * self.d, bias=False)  # input: [embedding, feature]
        self.k_proj = nn.Linear(2 * c.hidden_size, self.kv * self.d, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.kv * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, c.hidden_size, bias=False)

    def qkv(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.h, self.d).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv, self.d).transpose(1, 2)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def out(self, q, k, v, mask):
        """mask: bool, broadcastable to (B, 1, T, S); True = attend."""
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.h != self.kv)
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.h * self.d))


class _MLP(nn.Module):
    def __init__(self, c: FeatureConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: FeatureConfig):
        super().__init__()
        self.norm_before_residual = c.norm_before_residual
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)  # on the feature
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)

    def inputs(self, embeds, hidden):
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1)

    def finish(self, attn_out, hidden):
        """Residual on the feature (not the embedding), as vLLM's EAGLE-3 layer; on the normed feature where
        norm_before_residual (speculators' variant). Returns the pre-norm output."""
        h = (self.hidden_norm(hidden) if self.norm_before_residual else hidden) + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class FeatureOutput:
    def __init__(self, logits, hidden):
        self.logits, self.hidden = logits, hidden


class FeatureDraft(nn.Module):
    """EAGLE-3's draft. `features` are either the target's three hidden states concatenated (B, T, 3 H_target),
    fused by `fc`, or the draft's own previous output (B, T, H)."""

    def __init__(self, config: FeatureConfig):
        super().__init__()
        c = self.config = config
        n = c.draft_vocab_size or c.vocab_size
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)  # the target's, frozen
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        if c.norm_before_fc:
            self.input_norm = RMSNorm(3 * c.target_hidden_size, c.rms_norm_eps)
        if c.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(c.target_hidden_size, c.rms_norm_eps) for _ in range(3))
        self.midlayer = _MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, n, bias=False)
        # vLLM's maps: target id of draft row i is i + d2t[i]; t2d marks the target ids the head covers
        self.register_buffer("d2t", torch.zeros(n, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool))
        half = torch.arange(0, c.head_dim, 2, dtype=torch.float) / c.head_dim
        self.register_buffer("inv_freq", 1.0 / (c.rope_theta ** half), persistent=False)

    # -- the pieces the sampler and the trainer share --------------------------------------------------------
    @property
    def feature_layers(self) -> list[int]:
        return self.config.feature_layers

    @property
    def dtype(self):
        return self.fc.weight.dtype

    @property
    def pruned(self) -> bool:
        return self.lm_head.weight.shape[0] != self.config.vocab_size

    def token_ids(self) -> torch.Tensor:
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def set_vocab(self, token_ids: torch.Tensor) -> None:
        """Restrict the head to `token_ids` (sorted target ids, one per head row)."""
        ids = token_ids.to(device=self.d2t.device, dtype=torch.long).sort().values
        if len(ids) != self.lm_head.weight.shape[0]:
            raise DraftsmithError(f"{len(ids)} token ids for a head of {self.lm_head.weight.shape[0]} rows")
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def new_cache(self, capacity: int | None = None) -> PreallocatedLayer:
        """Its one layer's KV cache, written in place as the target's (`sampling/cache.py`); past `capacity` (the
        generation's length, when the sampler knows it) it grows by doubling, never by a copy per token."""
        return PreallocatedLayer(capacity or 256)

    def _rope(self, positions, dtype):
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat([freqs, freqs], -1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # (B, 1, T, d)

    def fuse(self, features):
        """The target's three states (B, T, 3 H_target) through fc, or the draft's own pre-norm output (B, T, H)."""
        features = features.to(self.dtype)
        c = self.config
        if features.shape[-1] == c.hidden_size and c.hidden_size != 3 * c.target_hidden_size:
            return self.own_feature(features)
        return self.fc(self.normed(features))

    def normed(self, features):
        """The target's three states as `fc` reads them: through speculators' norms where the config has them
        (norm_before_fc: one over the three; fc_norm: one per state), else raw (EAGLE-3)."""
        c = self.config
        if c.norm_before_fc:
            features = self.input_norm(features)
        if c.fc_norm:
            features = torch.cat([n(f) for n, f in zip(self.fc_norm, features.chunk(3, -1))], -1)
        return features

    def own_feature(self, hidden):
        """What the draft's own output feeds its next step: the pre-norm output (EAGLE-3), or the normed one where
        norm_output (speculators' variant; `.hidden` stays pre-norm, so `head` norms it once)."""
        return self.norm(hidden) if self.config.norm_output else hidden

    def head(self, hidden):
        """Logits of the pre-norm output: full vocabulary, or a `PrunedOutput` over the head's subset."""
        logits = self.lm_head(self.norm(hidden))
        if not self.pruned:
            return FeatureOutput(logits, hidden)
        out = PrunedOutput(logits, self.token_ids(), self.config.vocab_size)
        out.hidden = hidden
        return out

    # -- decoding: one call per sampler step, with a KV cache ---------------------------------------------
    def forward(self, input_ids, features, position_ids, attention_mask=None,
                cache: PreallocatedLayer | None = None,
                logits_to_keep: int | None = 1, **_):
        """input_ids, position_ids: (B, T); attention_mask: (B, S) validity of every cache slot + the new T (None:
        all valid). Returns `.hidden` (B, T, H) and, unless logits_to_keep is None, logits of the last positions."""
        B, T = input_ids.shape
        hidden = self.fuse(features)
        x = self.midlayer.inputs(self.embed_tokens(input_ids).to(self.dtype), hidden)
        cos, sin = self._rope(position_ids, self.dtype)
        q, k, v = self.midlayer.self_attn.qkv(x, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v)
        S = k.shape[2]
        past = S - T
        causal = torch.arange(S, device=q.device)[None, :] <= past + torch.arange(T, device=q.device)[:, None]
        mask = causal[None, None]
        if attention_mask is not None:
            mask = mask & attention_mask.bool()[:, None, None, :]
        mask = mask | (torch.arange(S, device=q.device)[None, :] == past + torch.arange(T, device=q.device)[:, None])
        # (a query always sees itself: a padded slot's output is never used, but must not be NaN)
        out = self.midlayer.finish(self.midlayer.self_attn.out(q, k, v, mask), hidden)
        if logits_to_keep is None:
            return FeatureOutput(None, out)
        return self.head(keep_last(out, logits_to_keep))

    # -- training: the training-time test ------------------------------------------------------------------
    def unroll(self, input_ids, features, steps: int, position_ids=None, mask=None) -> list[torch.Tensor]:
        """Pre-norm outputs (B, T, H) of `steps` drafting steps, as the sampler would run them, in one pass each.

        Slot j of step s stands for the draft's s-th own step after the target's last verified position j - s:
        its feature is step s-1's output at slot j-1, and it attends to step 0's slots <= j - s (target features)
        and to slot j - s + t of each step t in 1..s (its own earlier drafts). Slots j < s have no such history;
        their outputs are meaningless (drop them from the loss). mask: (B, T) validity (padding) or None."""
        B, T = input_ids.shape
        dev = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(T, device=dev)[None].expand(B, T)
        cos, sin = self._rope(position_ids, self.dtype)
        emb = self.embed_tokens(input_ids).to(self.dtype)
        hidden = self.fuse(features)
        j = torch.arange(T, device=dev)
        ks, vs, outs = [], [], []
        for s in range(steps):
            if s:
                hidden = torch.cat([hidden[:, :1] * 0, self.own_feature(outs[-1][:, :-1])], 1)  # own output, slot j-1
            q, k, v = self.midlayer.self_attn.qkv(self.midlayer.inputs(emb, hidden), cos, sin)
            ks.append(k)
            vs.append(v)
            blocks = [j[None, :] <= j[:, None] - s]  # step 0: target-feature slots up to j - s
            blocks += [j[None, :] == j[:, None] - s + t for t in range(1, s + 1)]
            m = torch.cat(blocks, 1)[None, None]  # (1, 1, T, (s+1) T)
            if mask is not None:
                m = m & mask.bool().repeat(1, s + 1)[:, None, None, :]
            m = m | torch.cat([torch.zeros(T, s * T, dtype=torch.bool, device=dev), torch.eye(T, dtype=torch.bool,
                                                                                            device=dev)], 1)
            attn = self.midlayer.self_attn.out(q, torch.cat(ks, 2), torch.cat(vs, 2), m)
            outs.append(self.midlayer.finish(attn, hidden))
        return outs

    # -- files -----------------------------------------------------------------------------------------------
    def save_pretrained(self, path, **_) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(self.config_dict(), indent=2) + "\n")

    def config_dict(self) -> dict:
        """Ours, plus the keys vLLM reads to serve it as `method: eagle3` (`LlamaForCausalLMEagle3`)."""
        c = self.config
        # speculators' layer variants only where set: a classic draft's config stays as it was (SpecForge reads
        # `norm_output` otherwise than speculators and vLLM do)
        flags = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
        ours = {k: v for k, v in asdict(c).items() if k not in flags or v}
        vllm = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "tie_word_embeddings": False,
                "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
                "draft_vocab_size": self.lm_head.weight.shape[0],
                # top level: where vLLM and llama.cpp read them; without them vLLM silently falls back to its
                # default layers and serves a draft trained on others wrongly. Nested: where SGLang reads them, in
                # its own numbering (`sglang_layer_ids`)
                "eagle_aux_hidden_state_layer_ids": list(c.feature_layers),
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_layer_ids(c.feature_layers),
                                 "use_aux_hidden_state": True},
                "torch_dtype": str(self.dtype).removeprefix("torch.")}
        return {**ours, **vllm}

    @classmethod
    def from_pretrained(cls, path, dtype=torch.float32) -> FeatureDraft:
        """Ours (a peer's EAGLE-3 head: `peers.load_feature`, which `load_model` calls)."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = Path(path)
        try:
            cfg = json.loads((path / "config.json").read_text())
            model = cls(FeatureConfig(**{k: v for k, v in cfg.items() if k in FeatureConfig.__dataclass_fields__}))
            state = load_file(str(path / "model.safetensors"))
        except (OSError, json.JSONDecodeError, TypeError, SafetensorError) as e:
            raise DraftsmithError(f"{path} is not a readable feature draft ({type(e).__name__}: {e})") from None
        check_vocab_map(state, model.lm_head.weight.shape[0], model.config.vocab_size, path)
        model.load_state_dict(state)
        return model.to(dtype).eval()


def sglang_layer_ids(layers) -> list[int]:
    """Our layer ids (vLLM's and llama.cpp's: id i = the state entering target layer i) as SGLang reads them from
    `eagle_config`: SGLang, and SpecForge which writes them, number the output of layer i as i (our i + 1), and
    SGLang's Llama, Qwen and most other targets add the 1 back when they capture (`set_eagle3_layers_to_capture`,
    sglang 0.5.23). Our 0, the embedding, is their -1."""
    return [i - 1 for i in layers]


def is_feature_draft(model) -> bool:
    return isinstance(model, FeatureDraft)


def peer_format(cfg: dict) -> str | None:
    """An EAGLE-3 head trained elsewhere that `peers.py` reads: "speculators" (`speculators_model_type: eagle3`),
    "specforge" (SpecForge/SGLang's `LlamaForCausalLMEagle3`), or None (ours, or not such a head)."""
    if cfg.get("draftsmith_kind") is not None:
        return None
    if cfg.get("speculators_model_type") == "eagle3":
        return "speculators"
    if "LlamaForCausalLMEagle3" in (cfg.get("architectures") or []):
        return "specforge"
    return None


def is_feature_dir(path) -> bool:
    """Ours, or a peer's EAGLE-3 head (`peer_format`)."""
    p = Path(path) / "config.json"
    try:
        cfg = json.loads(p.read_text()) if p.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return False
    return cfg.get("draftsmith_kind") == KIND or peer_format(cfg) is not None


class FeatureTap:
    """Forward pre-hooks on the target's decoder layers that keep the hidden states entering the feature layers.
    `take()` returns them concatenated, (B, T, 3 H), for the last forward call, on `device` (default: where the
    target's outputs come back, its first parameter's device): a target spread over several GPUs
    (`device_map="auto"`) holds each layer's state on that layer's GPU, which no concatenation can mix."""

    def __init__(self, target, layers: list[int], device=None):
        decoder = target.get_decoder() if hasattr(target, "get_decoder") else target.model
        blocks = decoder.layers
        self._seen: dict[int, torch.Tensor] = {}
        self._handles = []
        self.layers = list(layers)
        self.device = torch.device(device) if device is not None else next(target.parameters()).device
        for i in dict.fromkeys(self.layers):
            self._handles.append(blocks[i].register_forward_pre_hook(self._hook(i), with_kwargs=True))

    def _hook(self, i):
        def keep(module, args, kwargs):
            self._seen[i] = args[0] if args else kwargs["hidden_states"]
        return keep

    def take(self) -> torch.Tensor:
        out = torch.cat([self._seen[i].to(self.device) for i in self.layers], -1)
        self._seen.clear()
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
