"""EAGLE-3 heads trained by other toolkits, read as our feature draft (`feature.py`) so that `draftsmith generate`,
`bench` and `deploy-check` measure them with our sampler.

Two formats, told apart by their config.json:
- speculators (vllm-project, PyPI `speculators`): `speculators_model_type: eagle3`, the layer's shape in a nested
  `transformer_layer_config`, layer ids in vLLM's numbering (id i = the state entering target layer i, ours too),
  weights `layers.0.*`, optional `input_norm` / `fc_norm.*`, and the norm flags of its layer variants.
- SpecForge / SGLang (`architectures: [LlamaForCausalLMEagle3]`): a flat Llama config with `draft_vocab_size`,
  weights `midlayer.*` (ours), layer ids in `eagle_config` in SGLang's numbering (id i = the output of layer i, so
  the state entering layer i + 1: ours is i + 1).

Only what our layer computes is accepted; anything else (another layer type, biases, scaled RoPE, several layers,
ModelOpt's export, whose layer 0 norms the feature twice) is refused in one line rather than run differently.
The mapping is ours, written from the formats' published configs and weight names.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.feature import KIND, FeatureConfig, FeatureDraft, check_vocab_map, peer_format

SPECULATORS, SPECFORGE = "speculators", "specforge"
ARCH = "LlamaForCausalLMEagle3"
FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def _refuse(path, what: str) -> DraftsmithError:
    return DraftsmithError(f"{path}: {what}")


def _rope_theta(layer: dict, path) -> float:
    """The RoPE base of a plain (unscaled) RoPE, where transformers 4 or 5 keep it; scaled RoPE is refused."""
    rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", None):
        raise _refuse(path, f"its RoPE is scaled ({kind}); our feature draft runs plain RoPE only: export the head "
                            "with rope_scaling removed if it was trained without it")
    return float(rope.get("rope_theta", layer.get("rope_theta", 10000.0)))


def _layer_shape(layer: dict, path, where: str) -> dict:
    """Our FeatureConfig's layer fields from a Llama layer config (`where`: the key holding it, for errors)."""
    if layer.get("model_type", "llama") != "llama":
        raise _refuse(path, f"its layer is a {layer.get('model_type')!r} layer ({where}); only Llama-style EAGLE-3 "
                            "heads are read")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise _refuse(path, f"{where} has {layer['num_hidden_layers']} decoder layers; our feature draft has one")
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        raise _refuse(path, f"{where} asks for biases in attention or MLP; our feature draft's layer has none")
    if layer.get("hidden_act", "silu") != "silu":
        raise _refuse(path, f"{where} uses {layer['hidden_act']}; our feature draft's MLP is SiLU")
    heads = layer["num_attention_heads"]
    return dict(vocab_size=layer["vocab_size"], hidden_size=layer["hidden_size"],
                intermediate_size=layer["intermediate_size"], num_attention_heads=heads,
                num_key_value_heads=layer.get("num_key_value_heads") or heads,
                head_dim=layer.get("head_dim") or layer["hidden_size"] // heads,
                rms_norm_eps=layer.get("rms_norm_eps", 1e-6), rope_theta=_rope_theta(layer, path),
                max_position_embeddings=layer.get("max_position_embeddings", 2048))


def speculators_config(cfg: dict, path) -> FeatureConfig:
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise _refuse(path, "a speculators eagle3 config without transformer_layer_config; export it again with "
                            "speculators")
    shape = _layer_shape(layer, path, "transformer_layer_config")
    layers = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not layers or len(layers) != 3:
        raise _refuse(path, f"eagle_aux_hidden_state_layer_ids is {layers!r}: name the 3 target layers the head "
                            "reads (speculators resolves them from the verifier at load; we do not guess)")
    # speculators' own config class defaults norm_before_residual to False, vLLM's reader of the same file to True:
    # a config that does not say is read two ways, so we ask for it
    if "norm_before_residual" not in cfg:
        raise _refuse(path, "its config does not say norm_before_residual, which speculators reads as false and "
                            "vLLM as true; add it to config.json as the head was trained")
    return FeatureConfig(**shape, target_hidden_size=cfg.get("target_hidden_size") or shape["hidden_size"],
                         target_num_hidden_layers=None, feature_layers=list(layers),
                         draft_vocab_size=_draft_vocab(cfg, shape["vocab_size"]),
                         **{k: bool(cfg.get(k, False)) for k in FLAGS})


def specforge_config(cfg: dict, path) -> FeatureConfig:
    shape = _layer_shape(cfg, path, "config.json")
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids or len(ids) != 3:
        raise _refuse(path, "eagle_config.eagle_aux_hidden_state_layer_ids is missing: name the 3 target layers "
                            "the head reads (SpecForge's default for an L-layer target is [1, L//2-1, L-4])")
    if cfg.get("norm_output") is False:  # SpecForge: no final norm before lm_head (speculators/vLLM: other meaning)
        raise _refuse(path, "norm_output is false: SpecForge then runs lm_head on the un-normed output, which our "
                            "feature draft does not; remove the key if the head was trained with its final norm")
    if cfg.get("norm_before_residual") or cfg.get("norm_before_fc"):
        raise _refuse(path, "a LlamaForCausalLMEagle3 config with speculators' norm flags; SpecForge's layer has "
                            "none of them: export the head in the speculators format instead")
    # SGLang's id i is the output of target layer i, the state entering layer i + 1: our (and vLLM's) id i + 1
    return FeatureConfig(**shape, target_hidden_size=cfg.get("target_hidden_size") or shape["hidden_size"],
                         target_num_hidden_layers=None, feature_layers=[int(i) + 1 for i in ids],
                         draft_vocab_size=_draft_vocab(cfg, shape["vocab_size"]), fc_norm=bool(cfg.get("fc_norm")))


def _draft_vocab(cfg: dict, vocab: int) -> int | None:
    n = cfg.get("draft_vocab_size")
    return None if n in (None, vocab) else int(n)


def _state(path: Path, fmt: str, config: FeatureConfig) -> dict:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise _refuse(path, "no *.safetensors weights beside config.json")
    raw = {}
    for f in files:
        raw.update(load_file(str(f)))
    if fmt == SPECULATORS and any(k.startswith("layers.") and not k.startswith("layers.0.") for k in raw):
        raise _refuse(path, "weights of more than one decoder layer; our feature draft has one")
    if fmt == SPECFORGE and any(k.startswith("layers.") for k in raw):
        # ModelOpt writes this architecture with `layers.0.*`, and its layer 0 norms the feature twice
        raise _refuse(path, "a LlamaForCausalLMEagle3 checkpoint with layers.0.* weights (ModelOpt's export), "
                            "whose layer 0 differs from SpecForge's and ours; it is not read")
    state = {}
    for k, v in raw.items():
        if k.startswith("verifier_"):  # speculators' training-only copies of the target's norm and head
            continue
        state["midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k] = v
    if "embed_tokens.weight" not in state:
        raise _refuse(path, "no embed_tokens.weight in its weights; export it with the target's embedding (SpecForge: "
                            "`specforge export --embedding-source TARGET`)")
    rows = state["lm_head.weight"].shape[0] if "lm_head.weight" in state else None
    if rows is not None and rows != (config.draft_vocab_size or config.vocab_size):
        raise _refuse(path, f"lm_head has {rows} rows, its config says draft_vocab_size "
                            f"{config.draft_vocab_size or config.vocab_size}")
    check_vocab_map(state, config.draft_vocab_size or config.vocab_size, config.vocab_size, path)
    if "d2t" in state and "t2d" not in state:  # ModelOpt-style: t2d follows from d2t
        d2t = state["d2t"].long()
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[torch.arange(len(d2t)) + d2t] = True
        state["t2d"] = t2d
    if config.draft_vocab_size is None:  # a full head: the identity maps (speculators stores none)
        state.setdefault("d2t", torch.zeros(config.vocab_size, dtype=torch.long))
        state.setdefault("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
    state["d2t"], state["t2d"] = state["d2t"].long(), state["t2d"].bool()
    return state


def load_feature(path, dtype=torch.float32) -> FeatureDraft:
    """A feature draft directory, ours or a peer's."""
    import json

    path = Path(path)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise _refuse(path, f"config.json is not readable JSON ({type(e).__name__}: {e})") from None
    if cfg.get("draftsmith_kind") == KIND:
        return FeatureDraft.from_pretrained(path, dtype)
    return load_peer(path, cfg, dtype)


def load_peer(path, cfg: dict, dtype=torch.float32) -> FeatureDraft:
    """A peer's EAGLE-3 head as our FeatureDraft, or a one-line refusal saying what does not map."""
    path = Path(path)
    fmt = peer_format(cfg)
    if fmt is None:
        raise _refuse(path, "not a feature draft: config.json is neither ours (draftsmith_kind), speculators' "
                            "(speculators_model_type: eagle3) nor SpecForge's (architectures: LlamaForCausalLMEagle3)")
    try:
        config = speculators_config(cfg, path) if fmt == SPECULATORS else specforge_config(cfg, path)
    except KeyError as e:
        raise _refuse(path, f"its {fmt} config lacks {e}; export it again with its trainer") from None
    model = FeatureDraft(config)
    state = _state(path, fmt, config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise _refuse(path, f"its {fmt} weights do not map onto our feature draft (missing {sorted(missing)}, "
                            f"unexpected {sorted(unexpected)})")
    return model.to(dtype).eval()
