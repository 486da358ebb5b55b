"""EAGLE-3 heads trained elsewhere (speculators, SpecForge/SGLang) read as our feature draft (`sampling/peers.py`),
and the d2t guard: a pruned head without its map is refused in one line.

Fast: each format written by hand from one of our drafts (their names and numbering, as the formats publish them)
loads back to the same logits and samples exactly; the sampler's cached loop computes what `unroll` does with
speculators' layer variants on; the refusals. Slow (`-m slow`): the peers' own code builds the checkpoints and
computes the logits, in vLLM's venv (`engines/workers/eagle3_reference.py`), and ours must match them; vLLM's own
EAGLE-3 model drafts inside its engine (`engines/workers/vllm_eagle3_logits.py`) what ours does.
"""

import json
import os
import subprocess
import zipfile

import pytest
import torch
from conftest import tiny_llama
from safetensors.torch import load_file, save_file
from test_feature import loop_matches_unroll

from draftsmith.sampling import autoregressive_generate, speculative_generate
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.feature import FeatureConfig, FeatureDraft
from draftsmith.sampling.load import load_model

V = 16
HEAD = [1, 2, 5, 7, 8, 11, 13, 15]  # a pruned head whose rows are not the first ids: d2t is not zero
FLAGS = dict(norm_before_residual=True, norm_before_fc=True, norm_output=True)


def draft_for(target, seed=1, layers=(1, 2, 3), head=HEAD, fc_scale=1.0, lm_scale=6.0, **flags):
    """A random head with norms away from 1 (so a misplaced one shows), a pruned vocabulary `head` and the target's
    own embedding, as training leaves it (vLLM shares the target's where a head's equals it)."""
    torch.manual_seed(seed)
    head = torch.as_tensor(head)
    c = FeatureConfig.for_target(target.config, feature_layers=list(layers), draft_vocab_size=len(head))
    d = FeatureDraft(FeatureConfig(**{**c.__dict__, **flags}))
    d.set_vocab(head)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape))
        d.fc.weight.mul_(fc_scale)
        d.lm_head.weight.mul_(lm_scale)
        d.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    return d.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=V, layers=4, hidden=32, seed=0, logit_scale=8.0)


def layer_config(c: FeatureConfig) -> dict:
    return {"model_type": "llama", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
            "max_position_embeddings": c.max_position_embeddings, "num_hidden_layers": 1, "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta}}


def write_speculators(draft: FeatureDraft, path) -> None:
    """As speculators' Eagle3DraftModel.save_pretrained lays it out: `layers.0.*`, a nested layer config."""
    c = draft.config
    path.mkdir(parents=True)
    state = {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v.contiguous()
             for k, v in draft.state_dict().items()}
    state["verifier_norm.weight"] = torch.ones(c.hidden_size)  # training-only, dropped on load
    save_file(state, str(path / "model.safetensors"))
    cfg = {"architectures": ["Eagle3DraftModel"], "auto_map": {"": "config.Eagle3SpeculatorConfig"},
           "speculators_model_type": "eagle3", "transformer_layer_config": layer_config(c),
           "draft_vocab_size": draft.lm_head.weight.shape[0],
           "eagle_aux_hidden_state_layer_ids": list(c.feature_layers),
           "target_hidden_size": None, "norm_before_residual": c.norm_before_residual,
           "norm_before_fc": c.norm_before_fc, "fc_norm": c.fc_norm, "norm_output": c.norm_output,
           "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": None, "architectures": []}}}
    (path / "config.json").write_text(json.dumps(cfg))


def write_specforge(draft: FeatureDraft, path) -> None:
    """As SpecForge's export: a flat LlamaForCausalLMEagle3 config, `midlayer.*`, SGLang's layer numbering."""
    c = draft.config
    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, str(path / "model.safetensors"))
    cfg = {**layer_config(c), "architectures": ["LlamaForCausalLMEagle3"],
           "draft_vocab_size": draft.lm_head.weight.shape[0],
           "target_hidden_size": c.target_hidden_size,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in c.feature_layers]}}
    (path / "config.json").write_text(json.dumps(cfg))


def drop_key(path, key) -> None:
    f = path / "model.safetensors"
    state = load_file(str(f))
    del state[key]
    save_file(state, str(f))


@pytest.mark.parametrize("fmt,flags", [("speculators", FLAGS), ("speculators", dict(fc_norm=True)),
                                       ("specforge", {})])
def test_a_peers_head_loads_as_our_feature_draft(target, tmp_path, fmt, flags):
    """Written in the peer's layout, read back by `load_model` (what generate, bench and deploy-check call): the
    same logits over two drafting steps, the same layers (SGLang's numbering shifted), and greedy speculative
    output equal to the target's own."""
    draft = draft_for(target, **flags)
    (write_speculators if fmt == "speculators" else write_specforge)(draft, tmp_path / "head")
    again = load_model(str(tmp_path / "head"), dtype="fp32")
    assert again.feature_layers == draft.feature_layers
    assert all(getattr(again.config, k) == getattr(draft.config, k) for k in (*FLAGS, "fc_norm"))
    assert torch.equal(again.token_ids(), torch.tensor(HEAD))
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(0))
    feats = torch.randn(1, 9, 3 * 32, generator=torch.Generator().manual_seed(1))
    for a, b in zip(draft.unroll(ids, feats, 2), again.unroll(ids, feats, 2)):
        assert torch.equal(draft.head(a).logits, again.head(b).logits)
    prompt = torch.tensor([[1, 5, 2, 7]])
    plain = autoregressive_generate(target, prompt, max_new_tokens=12, temperature=0)
    spec = speculative_generate(target, again, prompt, max_new_tokens=12, k=3, temperature=0)
    assert spec.tokens[0].tolist() == plain.tokens[0].tolist()


@pytest.mark.parametrize("temperature", [0.9])
def test_the_loop_drafts_what_unroll_computes_with_speculators_variants(target, monkeypatch, temperature):
    """The sampler's cached loop and `unroll` (which the slow test matches to speculators' own module) agree with
    norm_before_residual, norm_before_fc and norm_output on: the own-output feedback is normed once, not twice."""
    draft = draft_for(target, **FLAGS)
    calls, _ = loop_matches_unroll(target, draft, monkeypatch, temperature, [1, 5, 2], 12)
    assert calls >= 3


@pytest.mark.parametrize("fmt", ["ours", "speculators", "specforge"])
def test_a_pruned_head_without_d2t_is_refused_in_one_line(target, tmp_path, fmt):
    """vLLM serves such a checkpoint silently wrong (head row i proposes token i); we refuse it, in every format."""
    draft = draft_for(target)
    path = tmp_path / "head"
    {"ours": lambda d, p: d.save_pretrained(p), "speculators": write_speculators,
     "specforge": write_specforge}[fmt](draft, path)
    drop_key(path, "d2t")
    with pytest.raises(DraftsmithError, match=r"covers 8 of the target's 16 tokens but its weights hold no d2t") as e:
        load_model(str(path), dtype="fp32")
    assert "\n" not in str(e.value)


def test_a_full_head_needs_no_d2t(target, tmp_path):
    torch.manual_seed(0)
    draft = FeatureDraft(FeatureConfig.for_target(target.config, feature_layers=[1, 2, 3])).eval()
    write_speculators(draft, tmp_path / "head")
    drop_key(tmp_path / "head", "d2t")
    drop_key(tmp_path / "head", "t2d")
    again = load_model(str(tmp_path / "head"), dtype="fp32")
    assert not again.pruned and torch.equal(again.token_ids(), torch.arange(V))


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def test_what_does_not_map_is_refused_in_one_line(target, tmp_path):
    draft = draft_for(target)
    cases = {
        "ambiguous": ("speculators", {"norm_before_residual": None}, "speculators reads as false and vLLM as true"),
        "no layers": ("speculators", {"eagle_aux_hidden_state_layer_ids": None}, "name the 3 target layers"),
        "qwen3": ("speculators", {"transformer_layer_config": {**layer_config(draft.config), "model_type": "qwen3"}},
                  "only Llama-style"),
        "yarn": ("specforge", {"rope_parameters": {"rope_type": "yarn", "factor": 32.0, "rope_theta": 1e4}},
                 "RoPE is scaled"),
        "no final norm": ("specforge", {"norm_output": False}, "un-normed output"),
        "no ids": ("specforge", {"eagle_config": None}, r"\[1, L//2-1, L-4\]"),
    }
    for name, (fmt, changes, message) in cases.items():
        path = tmp_path / name.replace(" ", "_")
        (write_speculators if fmt == "speculators" else write_specforge)(draft, path)
        _edit_config(path, **changes)
        with pytest.raises(DraftsmithError, match=message):
            load_model(str(path), dtype="fp32")
    # ModelOpt writes the same architecture with `layers.0.*`, and a layer 0 that norms the feature twice
    path = tmp_path / "modelopt"
    write_specforge(draft, path)
    state = {k.replace("midlayer.", "layers.0."): v for k, v in load_file(str(path / "model.safetensors")).items()}
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(DraftsmithError, match="ModelOpt"):
        load_model(str(path), dtype="fp32")
    # the pair check names the layers a peer's head reads where the target is too shallow for them
    write_specforge(draft, tmp_path / "ok")
    with pytest.raises(DraftsmithError, match=r"layers \[1, 2, 3\]"):
        load_model(str(tmp_path / "ok"), dtype="fp32").config.check_target(tiny_llama(vocab=V, layers=2).config)


def _speculators_head_for_tiny_random(path):
    """A speculators head (FLAGS on, a 64-row head over every 8th token, the target's embeddings) for the smoke
    target, written in speculators' format to `path`."""
    target = load_model("tiny-random", dtype="fp32")
    torch.manual_seed(0)
    c = FeatureConfig.for_target(target.config, draft_vocab_size=64)
    draft = FeatureDraft(FeatureConfig(**{**c.__dict__, **FLAGS}))
    draft.set_vocab(torch.arange(0, 512, 8))
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    write_speculators(draft, path)


def test_draftsmith_generate_runs_a_peers_head(tmp_path, capsys):
    """`draftsmith generate --target T HEAD`: a speculators head with no tokenizer of its own (it is the target's),
    greedy, prints the target's own greedy continuation; our sampler counts its drafts."""
    from draftsmith.sampling.generate import main

    _speculators_head_for_tiny_random(tmp_path / "head")
    args = ["--target", "tiny-random", "--prompt", "def f(x):", "--max-new-tokens", "8", "--temperature", "0",
            "--dtype", "fp32", "--json"]
    assert main([str(tmp_path / "head"), *args]) == 0, capsys.readouterr().err
    spec = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert spec["completion"] == plain["completion"] and spec["stats"]["drafted"] > 0


@pytest.mark.slow  # about a minute: export measures acceptance and costs
def test_a_peers_head_is_exported_and_judged_by_deploy_check(tmp_path):
    """`draftsmith export HEAD --target T` turns a speculators head (no tokenizer of its own) into a bundle in our
    format, its layer variants kept in the config vLLM and speculators read; `deploy-check`'s judge passes it."""
    from draftsmith.deploy.conformance import Setting, check, open_bundle
    from draftsmith.deploy.export import export
    from draftsmith.engines.draftsmith import DraftsmithEngine

    _speculators_head_for_tiny_random(tmp_path / "head")
    out = export(tmp_path / "head", tmp_path / "bundle", target_arg="tiny-random", n_prompts=1, max_new_tokens=6,
                 dtype="fp32", ks=(1, 2))
    cfg = json.loads((out / "draft" / "config.json").read_text())
    assert cfg["draftsmith_kind"] == "feature_head" and cfg["speculators_model_type"] == "eagle3"
    assert all(cfg[k] is True for k in FLAGS) and cfg["draft_vocab_size"] == 64
    bundle = open_bundle(out)
    report = check(bundle, DraftsmithEngine(bundle), [Setting(0.0)], n_prompts=1, max_new_tokens=8)
    assert report["verdict"] == "pass", report["settings"]


# -- slow: the peers' own modules ------------------------------------------------------------------------------
SPECFORGE = ("specforge", "0.2.0")


def _specforge_path():
    """SpecForge's wheel, unpacked (its draft model file imports without its sglang pin)."""
    from draftsmith.sampling.machine import cache_home
    from helpers import pypi_wheel

    name, version = SPECFORGE
    root = cache_home() / "peers" / f"{name}-{version}"
    if not (root / name / "__init__.py").is_file():
        with zipfile.ZipFile(pypi_wheel(name, version)) as z:
            z.extractall(root)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("fmt,flags", [
    ("speculators", {"norm_before_residual": False}),
    ("speculators", {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}),
    ("speculators", {"norm_before_residual": True, "fc_norm": True}),
    ("specforge", {}),
], ids=["speculators-classic", "speculators-0.9-defaults", "speculators-fc_norm", "specforge"])
def test_our_feature_draft_matches_the_peers_own_module(tmp_path, fmt, flags):
    """The peer's own code (speculators 0.9 `Eagle3DraftModel`; SpecForge 0.2 `LlamaForCausalLMEagle3`) builds a
    random head with a pruned vocabulary, saves it in its format and computes its teacher-forced logits for two
    drafting steps (its training-time test); ours, loaded from that checkpoint, computes the same to fp32 noise."""
    from draftsmith.engines.vllm import _clean_env
    from draftsmith.engines.vllm import missing as vllm_missing
    from draftsmith.engines.vllm import python_path
    from helpers import missing_resource

    if vllm_missing():
        missing_resource("vllm", vllm_missing())
    env = _clean_env()
    if fmt == "specforge":
        root = _specforge_path()
        env.update(PYTHONPATH=str(root), TORCH_COMPILE_DISABLE="1")  # its norms are @torch.compile'd
    worker = os.path.join(os.path.dirname(__file__), "..", "engines", "workers", "eagle3_reference.py")
    res = subprocess.run([str(python_path()), worker, fmt, str(tmp_path), json.dumps(flags)], capture_output=True,
                         text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    draft = load_model(str(tmp_path / "head"), dtype="fp32")
    ref = load_file(str(tmp_path / "reference.safetensors"))
    T = ref["features"].shape[1]
    with torch.no_grad():
        outs = draft.unroll(ref["input_ids"][:, :T], ref["features"], steps=2)
        # their step-1 slot j is our slot j + 1 (it reads the token after ours and our slot j's output)
        ours = [draft.head(outs[0]).sub_logits, draft.head(outs[1]).sub_logits[:, 1:]]
    diffs = [float((a - ref[f"logits{s}"]).abs().max()) for s, a in enumerate(ours)]
    print(f"{fmt} {flags}: max |logit diff| step 0 {diffs[0]:.2e}, step 1 {diffs[1]:.2e} "
          f"(logits up to {float(ref['logits0'].abs().max()):.1f})")
    assert torch.equal(draft.token_ids(), torch.arange(len(draft.d2t)) + load_file(
        str(tmp_path / "head" / "model.safetensors"))["d2t"])
    assert max(diffs) < 1e-4


def _vllm_sized_target(path):
    """A tiny random Llama that vLLM's CPU build serves (head size 64, its attention kernels' smallest common one),
    saved where vLLM reads it; 6 layers, so the head reads three of them, none the embedding."""
    target = tiny_llama(vocab=256, layers=6, hidden=128, heads=2, seed=0, logit_scale=4.0)
    target.config.architectures = ["LlamaForCausalLM"]
    target.save_pretrained(path, safe_serialization=True)
    return target


def _vllm_sized_head(target, **flags):
    """A random feature head on layers [1, 3, 5] with a scattered 96-token head (d2t offsets all nonzero) and an O(1)
    fc, so a misread layer, norm or row shows in the logits (the shared embedding: this test cannot tell which)."""
    scattered = torch.randperm(255, generator=torch.Generator().manual_seed(2))[:96].sort().values + 1
    return draft_for(target, seed=2, layers=(1, 3, 5), head=scattered, fc_scale=8.0, lm_scale=4.0, **flags)


def _our_two_steps(target, draft, prompt: list[int], t1: int, d1: int) -> list[torch.Tensor]:
    """Our head's logits over its tokens for the two drafts after prompt + t1 (the second after d1), computed as
    training does (`unroll`, FeatureDist's slots) from the HF target's features."""
    from draftsmith.sampling.feature import FeatureTap

    with torch.no_grad(), FeatureTap(target, draft.feature_layers) as tap:
        target(input_ids=torch.tensor([prompt]))
        feats = tap.take()
        feats = torch.cat([feats, feats.new_zeros(1, 1, feats.shape[-1])], 1)  # slot of d1: never attended
        outs = draft.unroll(torch.tensor([prompt[1:] + [t1, d1]]), feats, steps=2)
        e = len(prompt) - 1
        return [draft.head(outs[s][:, e + s: e + s + 1]).sub_logits[0, 0] for s in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("fmt,flags", [("ours", {}), ("speculators", FLAGS)], ids=["ours", "speculators-0.9-defaults"])
def test_our_feature_draft_drafts_what_vllms_eagle3_model_does(tmp_path, fmt, flags):
    """vLLM's own EAGLE-3 model, inside its engine (`engines/workers/vllm_eagle3_logits.py`), and ours, each fed its
    own engine's target features (vLLM's CPU build and transformers, fp32): the same logits over the head's tokens
    for the first two drafts after each prompt, -inf elsewhere; in our format and in speculators' with its norm
    flags on."""
    from draftsmith.engines.vllm import _clean_env
    from draftsmith.engines.vllm import missing as vllm_missing
    from draftsmith.engines.vllm import python_path
    from helpers import missing_resource

    if vllm_missing():
        missing_resource("vllm", vllm_missing())
    target = _vllm_sized_target(tmp_path / "target")
    draft = _vllm_sized_head(target, **flags)
    if fmt == "ours":
        draft.save_pretrained(tmp_path / "head")
    else:  # as speculators' own save_pretrained writes it: without the training-only verifier_norm (vLLM refuses it)
        write_speculators(draft, tmp_path / "head")
        drop_key(tmp_path / "head", "verifier_norm.weight")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (5, 11, 23)]
    request = {"target": str(tmp_path / "target"), "head": str(tmp_path / "head"), "prompts": prompts, "k": 2,
               "max_model_len": 128}
    (tmp_path / "request.json").write_text(json.dumps(request))
    worker = os.path.join(os.path.dirname(__file__), "..", "engines", "workers", "vllm_eagle3_logits.py")
    res = subprocess.run([str(python_path()), worker, str(tmp_path / "request.json"), str(tmp_path / "out.st")],
                         capture_output=True, text=True, env=_clean_env(), timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    got = load_file(str(tmp_path / "out.st"))
    ids = draft.token_ids()
    outside = torch.ones(256, dtype=torch.bool)
    outside[ids] = False
    diffs, scale = [], 0.0
    for i, prompt in enumerate(prompts):
        theirs = got["logits"][i]
        assert torch.isinf(theirs[:, outside]).all() and (theirs[:, outside] < 0).all()
        d1 = int(theirs[0].argmax())
        ours = _our_two_steps(target, draft, prompt, int(got["t1"][i]), d1)
        assert int(ids[ours[0].argmax()]) == d1
        for s in range(2):
            diffs.append(float((ours[s] - theirs[s, ids]).abs().max()))
            scale = max(scale, float(ours[s].abs().max()))
    print(f"{fmt}: max |logit diff| {max(diffs):.2e} over {len(diffs)} drafts (logits up to {scale:.1f})")
    assert max(diffs) < 1e-3 * scale
