"""Export a trained draft and its target as a bundle that transformers, vLLM and our sampler load as is.

The command is `draftsmith export` (this module's `main`):
    draftsmith export outputs/2026-11-29/19-59-20 --out bundles/smollm2-draft
    draftsmith export outputs/.../checkpoints/step800-alpha0.4812.ckpt --out bundle --copy-target

Writes DIR/{draft/, target.json or target/, speculative.json, vllm_speculative_config.json,
sglang_speculative_config.json, README.md}, naming no path of this machine (the bundle travels);
speculative.json records every other file's sha256. A feature draft's config is also in the speculators format
(PyPI `speculators` 0.9, eagle3); an independent draft's is not: that format has no algorithm for it.
The recommended K maximises the predicted speed-up from the measured alpha and the c and v(K) measured on this
machine. Atomic: the bundle is assembled in a temporary directory, loaded back and checked (our sampler's alpha
with the same seed must equal the recorded one), and only then renamed into place.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from draftsmith.deploy.bundle import bundle_hashes, files_sha256
from draftsmith.deploy.plots import CARD_PLOT, card_plot
from draftsmith.drafts.evaluate import acceptance_by_set
from draftsmith.drafts.saved import draft_from_checkpoint, save_draft
from draftsmith.engines import ENGINES
from draftsmith.sampling.cli import engine_k, examples
from draftsmith.sampling.cost import best_k, measure_costs, predicted_speedup
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.feature import is_feature_draft
from draftsmith.sampling.load import load_tokenizer, tokenizer_mismatches
from draftsmith.sampling.machine import default_device, device_of, wandb_mode
from draftsmith.sampling.names import ALIASES, resolve
from draftsmith.sampling.precision import describe_run, device_name, run_info
from draftsmith.sampling.pruned import TOKEN_COUNTS, PrunedHeadDraft, split_head, token_counts_file
from draftsmith.sampling.runtime import DTYPE_CHOICES, prepared_model
from draftsmith.sampling.stats import TAU

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def locate(src: Path, target_arg: str | None) -> tuple[Path, str, dict]:
    """-> (draft dir or ckpt, target name, sampler settings of the run)."""
    if src.suffix == ".ckpt":
        run_dir = src.parent.parent
    elif (src / "config.json").is_file():
        run_dir = None
    elif (src / "best_draft").is_dir():
        run_dir, src = src, src / "best_draft"
    else:
        raise DraftsmithError(f"{src} is not a run directory (with best_draft/), a .ckpt, or a draft checkpoint")
    sampler = {"k": 4, "temperature": 0.8, "top_p": 0.95, "top_k": 0}
    target = target_arg
    hydra_cfg = run_dir / ".hydra" / "config.yaml" if run_dir else None
    if hydra_cfg and hydra_cfg.is_file():
        cfg = yaml.safe_load(hydra_cfg.read_text())
        target = target or cfg["target"]["name"]
        sampler.update({k: cfg["sampler"][k] for k in sampler})
    if not target:
        raise DraftsmithError("cannot tell the target: pass --target (the run's .hydra/config.yaml is missing)")
    return src, target, sampler


def trained_chat(src: Path) -> dict | None:
    """{"enable_thinking": null, true or false} when the run that trained the draft at `src` (found as `locate`
    finds it) trained with data=chat, through the target's chat template; None otherwise (or unknown: a bare draft
    checkpoint). The run's config says it; its corpus record (data.json) where the config is missing."""
    run_dir = src.parent.parent if src.suffix == ".ckpt" else src if (src / "best_draft").is_dir() else None
    if run_dir is None:
        return None
    hydra_cfg, record = run_dir / ".hydra" / "config.yaml", run_dir / "data.json"
    if hydra_cfg.is_file():
        data = yaml.safe_load(hydra_cfg.read_text()).get("data") or {}
    elif record.is_file():
        data = json.loads(record.read_text())
    else:
        return None
    return {"enable_thinking": data.get("enable_thinking")} if data.get("format") == "chat" else None


def check_pair(target_tok, draft_tok, target, draft) -> None:
    problems = tokenizer_mismatches(target_tok, draft_tok)
    if is_feature_draft(draft):
        try:
            draft.config.check_target(target.config)
        except ValueError as e:
            problems.append(str(e))
        if problems:
            raise DraftsmithError("draft and target do not form a pair: " + "; ".join(problems))
        return
    tv, dv = target.get_output_embeddings().weight.shape[0], draft.get_output_embeddings().weight.shape[0]
    if tv != dv or target.config.vocab_size != draft.config.vocab_size:
        problems.append(f"vocab sizes {dv} (draft) != {tv} (target)")
    if problems:
        raise DraftsmithError("draft and target do not form a pair: " + "; ".join(problems))


def measure_pair(target, draft, tok, sampler, prompt_sets, n_prompts, max_new_tokens, seed, chat=None) -> dict:
    """Acceptance by prompt set; a draft trained with data=chat (`chat`: `trained_chat`) is measured on each prompt
    as one user turn through the target's template, as it trained and as it will be served."""
    return acceptance_by_set(target, draft, tok, prompt_sets, n_prompts=n_prompts, max_new_tokens=max_new_tokens,
                             seed=seed, chat=chat, **sampler)


@torch.inference_mode()
def measure_bundle(target, draft, tok, sampler, prompt_sets, n_prompts, max_new_tokens, seed, ks,
                   chat=None) -> tuple[dict, dict]:
    """(acceptance by prompt set, costs c and v(K)) of the pair where it is: the card's figures."""
    acc = measure_pair(target, draft, tok, sampler, prompt_sets, n_prompts, max_new_tokens, seed, chat)
    return acc, measure_costs(target, draft, ks=ks)


def target_note(target_name: str, hub_id: str | None, copied: bool) -> str:
    """How the card's commands find the target: one placeholder, TARGET, set once. Never a silent swap: where the
    target has a hub id, the card says whether that is the model the draft was measured against."""
    if copied:
        return ("The target is copied into the bundle (`target/`); the commands below run from the bundle's folder:\n"
                "```bash\ncd BUNDLE\nexport TARGET=target\n```")
    hub = (f" Its hub id `{hub_id}` names the hub's weights, which are not the copy the draft was measured against "
           "(that one is dequantized from a GGUF, the hub's are bf16): acceptance there may differ from this card."
           if hub_id else "")
    return (f"The draft was measured against `{target_name}`, which is not copied into the bundle (export with "
            f"--copy-target to ship it): set TARGET to that model on the serving host (a local folder or hub id).{hub} "
            f"The commands below run from the bundle's folder:\n```bash\ncd BUNDLE\nexport TARGET=...  # the folder "
            f"or hub id of {target_name}\n```")


def chat_note(spec: dict) -> str:
    """The card's paragraph on the chat template: a draft trained with data=chat met its prompts only inside it."""
    chat = spec.get("chat_template")
    if chat is None:
        return ""
    thinking = chat.get("enable_thinking")
    said = "the template's default" if thinking is None else str(thinking).lower()
    return (f"\nTrained and measured through the target's chat template (data=chat, enable_thinking: {said}): in "
            "training each sample was a conversation rendered by the template, the loss on the assistant's tokens; "
            "above, each prompt went in as one user turn rendered by the template with its generation prompt. Serve "
            "it the same way: the commands below apply the template, and a prompt sent raw meets a draft that never "
            "saw text outside it.\n")


def generate_flags(spec: dict) -> str:
    """`draftsmith generate`'s flags that render the prompt as the draft was measured (none for a raw prompt)."""
    chat = spec.get("chat_template")
    if chat is None:
        return ""
    thinking = chat.get("enable_thinking")
    return " --chat" + ("" if thinking is None else f" --enable-thinking {str(thinking).lower()}")


def hf_inputs(spec: dict) -> str:
    """The transformers snippet's inputs: the prompt as is, or as one user turn through the chat template."""
    chat = spec.get("chat_template")
    if chat is None:
        return '**tok("def f(x):", return_tensors="pt")'
    thinking = chat.get("enable_thinking")
    extra = "" if thinking is None else f", enable_thinking={thinking}"
    return ('**tok.apply_chat_template([{"role": "user", "content": "def f(x):"}], add_generation_prompt=True,\n'
            f'                                               return_tensors="pt", return_dict=True{extra})')


def acceptance_rows(spec: dict) -> str:
    return "\n".join(f"| {d} | {r['tokens_per_call']:.2f} | {r['alpha']:.3f} | {r['alpha_analytic']:.3f} | "
                     + " ".join("-" if a is None else f"{a:.2f}" for a in r.get("acceptance_by_position") or []) + " |"
                     for d, r in spec["acceptance"].items())


def model_card(name: str, target_name: str, spec: dict, hub_id: str | None = None, copied: bool = False) -> str:
    k = spec["recommended_k"]
    s = spec["sampling"]
    sglang = sglang_flags(sglang_config(False, k))
    return f"""# {name}: a draft model for speculative sampling with `{target_name}`

Trained with draftsmith. The draft shares the target's tokenizer and vocabulary; the pair is verified to match
(vocabulary, special tokens, chat template) at export time.

## Acceptance card
Measured with draftsmith's exact speculative sampler (Chen et al. 2023), K={spec['measured_k']},
temperature {s['temperature']}, top-p {s['top_p']}, {spec['max_new_tokens']} new tokens per prompt, seed {spec['seed']}.
{TAU} (`tokens_per_call`): tokens per target pass, bonus token included, as SpecForge, speculators, vLLM and SGLang
report it; acceptance at each draft position given the position was reached.
{chat_note(spec)}
| prompts | {TAU} | alpha | alpha_analytic | acceptance by position |
| --- | --- | --- | --- | --- |
{acceptance_rows(spec)}

Draft cost c = {spec['c']:.3f} of a target step, measured on the exporting machine ({describe_run(spec)});
recommended K = {k}
(predicted speed-up {spec['predicted_speedup'][str(k)]:.2f}x there). Acceptance holds only at the sampling
settings above: other temperatures give other rates.

![acceptance by draft position, and the predicted speed-up by K]({CARD_PLOT})

## Use
{target_note(target_name, hub_id, copied)}

transformers (assisted generation; `draft/generation_config.json` fixes K={engine_k(spec, 'transformers')}, constant):
```python
import os
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained(os.environ["TARGET"])
target = AutoModelForCausalLM.from_pretrained(os.environ["TARGET"])
draft = AutoModelForCausalLM.from_pretrained("draft")
out = target.generate({hf_inputs(spec)}, assistant_model=draft, do_sample=True,
                      temperature={s['temperature']}, top_p={s['top_p']}, max_new_tokens=128)
```
vLLM (`vllm_speculative_config.json`; vLLM drafts greedily unless configured for probabilistic rejection,
so its acceptance differs from the card):
```bash
vllm serve "$TARGET" --speculative-config "$(cat vllm_speculative_config.json)"
```
SGLang (`{SGLANG_CONFIG}`: its STANDALONE algorithm runs an independent draft):
```bash
python -m sglang.launch_server --model-path "$TARGET" {sglang}
```
draftsmith's sampler:
```bash
draftsmith generate draft --target "$TARGET" -k {engine_k(spec, 'draftsmith')} \\
    --temperature {s['temperature']} --top-p {s['top_p']}{generate_flags(spec)} --prompt "def f(x):"
```
"""


def feature_card(name: str, target_name: str, spec: dict, hub_id: str | None = None, copied: bool = False) -> str:
    """The independent draft's card with its Use section for a feature draft: no transformers path."""
    k = spec["recommended_k"]
    s = spec["sampling"]
    card = model_card(name, target_name, spec, hub_id, copied)
    head = card[: card.index("## Use")]
    return head.replace("a draft model for", "a feature draft (EAGLE-3) for") + f"""## Use
{target_note(target_name, hub_id, copied)}

This draft is one decoder layer that reads the target's hidden states (layers
{spec.get('feature_layers')}, fused) with the next token's embedding: it cannot run alone, and transformers has no
EAGLE path (its assisted generation takes an independent draft), so there is no transformers recipe here.
`draft/config.json` is vLLM's and SGLang's `LlamaForCausalLMEagle3` config (with its `d2t` map in the weights)
and a speculators eagle3 config, whose verifier is `{verifier_name(target_name, copied)}`.

draftsmith's sampler (exact, Chen et al. 2023, Algorithm 2):
```bash
draftsmith generate draft --target "$TARGET" -k {engine_k(spec, 'draftsmith')} \\
    --temperature {s['temperature']} --top-p {s['top_p']}{generate_flags(spec)} --prompt "def f(x):"
```
vLLM (`vllm_speculative_config.json`):
```bash
vllm serve "$TARGET" --speculative-config "$(cat vllm_speculative_config.json)"
```
SGLang (`{SGLANG_CONFIG}`):
```bash
python -m sglang.launch_server --model-path "$TARGET" {sglang_flags(sglang_config(True, k))}
```
"""


def export(src: Path, out: Path, *, target_arg=None, copy_target=False, prompt_sets=("code", "english"), n_prompts=8,
           max_new_tokens=64, seed=0, dtype="auto", ks=(1, 2, 3, 4, 5, 6, 7, 8), device=None, engines=(),
           sweep_temperature=0.0, sweep_prompts=4, sweep_tokens=32) -> Path:
    """`device`: where the pair is measured (default: the GPU where there is one): the card's c, v(K) and
    recommended K are figures of that device, and the card says which. `engines`: each also timed at K = 1..4
    (`deploy/ksweep.py`, at `sweep_temperature`, `sweep_prompts` code prompts of `sweep_tokens` tokens), its
    fastest K written into its config."""
    chat = trained_chat(Path(src))  # data=chat: measured, and served in the card, through the template
    src, target_name, sampler = locate(Path(src), target_arg)
    out = Path(out).resolve()
    target_dir = resolve(target_name)
    device = device or default_device()
    target, target_tok = prepared_model(target_name, dtype, device=device), load_tokenizer(target_name)
    if src.suffix == ".ckpt":
        arch = src.parent.parent / "best_draft"
        if not (arch / "config.json").is_file():
            raise DraftsmithError(f"{arch} is missing: the checkpoint's architecture comes from the run's best_draft/")
        model, head = split_head(prepared_model(str(arch), "fp32"))  # the checkpoint holds the plain model's weights
        draft = draft_from_checkpoint(model, str(src), device=device)
        draft = (draft if head is None else PrunedHeadDraft(draft, head)).to(target.dtype)
        draft_tok = load_tokenizer(str(arch))
    else:
        draft = prepared_model(str(src), dtype, device=device)
        # a peer's EAGLE-3 head (sampling/peers.py) ships no tokenizer: it is the target's, written into the bundle
        peer = is_feature_draft(draft) and not any(src.glob("tokenizer*"))
        draft_tok = target_tok if peer else load_tokenizer(str(src))
    check_pair(target_tok, draft_tok, target, draft)

    print(f"measuring acceptance and costs on {device_name(device_of(target))}...", file=sys.stderr)
    acc, cost = measure_bundle(target, draft, target_tok, sampler, prompt_sets, n_prompts, max_new_tokens, seed, ks,
                               chat)
    alpha = sum(r["alpha"] * r["prompts"] for r in acc.values()) / sum(r["prompts"] for r in acc.values())
    k_rec, _ = best_k(alpha, cost["c"], cost["v"])
    feature = is_feature_draft(draft)
    spec = {
        "format": "draftsmith-speculative/1",
        "draft_kind": "feature_head" if feature else "independent",
        # trained with a pruned head (draftsmith/head_tokens.safetensors): our sampler runs it so; engines that
        # load the draft as a plain model run its full head, exact still, accepted less
        "draft_head_tokens": len(draft.token_ids) if isinstance(draft, PrunedHeadDraft) else None,
        "sampler_mode": "speculative_sampling (Chen et al. 2023, Algorithm 2): exact, draft sampled from p",
        "recommended_k": k_rec,
        "measured_k": sampler["k"],
        "sampling": {"temperature": sampler["temperature"], "top_p": sampler["top_p"], "top_k": sampler["top_k"]},
        "acceptance": acc,
        "alpha": alpha,
        "c": cost["c"], "v": {str(k): v for k, v in cost["v"].items()},
        "predicted_speedup": {str(k): predicted_speedup(alpha, k, cost["c"], v) for k, v in cost["v"].items()},
        "max_new_tokens": max_new_tokens, "seed": seed, "prompt_sets": list(prompt_sets), "n_prompts": n_prompts,
        # trained with data=chat: {"enable_thinking"}, its prompts measured through the target's template; else null
        "chat_template": chat,
        # what the speed figures were measured on, and each model's precision (auto: measured per machine)
        **run_info(target=target, draft=draft),
    }
    if feature:
        spec["feature_layers"] = draft.feature_layers

    out.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(out):  # a second export to the same place waits for this one, then replaces it whole
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
        try:
            ddir = tmp / "draft"
            if not feature:
                draft.generation_config.update(num_assistant_tokens=k_rec, num_assistant_tokens_schedule="constant",
                                               assistant_confidence_threshold=0.0)
            model, head = split_head(draft)  # trained with a pruned head: its tokens ride along
            save_draft(model, draft_tok, ddir, head_tokens=head)
            if feature:  # one config.json that vLLM, SGLang and the speculators format all read
                cfg = json.loads((ddir / "config.json").read_text())
                verifier = verifier_name(target_name, copy_target)
                cfg.update(speculators_fields(cfg, verifier, target.config.architectures, k_rec))
                (ddir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
            counts = token_counts_file(src.parent.parent / "best_draft" if src.suffix == ".ckpt" else src)
            if counts.is_file():  # lets `--draft-vocab N` prune the head of the exported draft
                (ddir / TOKEN_COUNTS).parent.mkdir(exist_ok=True)
                shutil.copy(counts, ddir / TOKEN_COUNTS)
            hub_id = getattr(ALIASES.get(target_name), "hub_id", None)
            if copy_target:
                shutil.copytree(target_dir, tmp / "target")
            # no path of this machine: the draft and a copied target are named relative to the bundle's folder (the
            # card's commands run there); a target not copied by the name it was given (resolved again on the
            # serving host, or set there through the card's TARGET)
            ref = {"name": target_name, "path": "target" if copy_target else None,
                   "config_sha256": files_sha256(target_dir, ["config.json"]),
                   "tokenizer_sha256": files_sha256(target_dir, TOKENIZER_FILES),
                   "architectures": target.config.architectures, "hub_id": hub_id}
            (tmp / "target.json").write_text(json.dumps(ref, indent=2))
            (tmp / "vllm_speculative_config.json").write_text(json.dumps(
                {"method": "eagle3" if feature else "draft_model", "model": "draft",
                 "num_speculative_tokens": k_rec}, indent=2))
            (tmp / SGLANG_CONFIG).write_text(json.dumps(sglang_config(feature, k_rec), indent=2))
            if engines:
                from draftsmith.deploy.bundle import Bundle
                from draftsmith.deploy.ksweep import sweep, write_engine_k

                here = Bundle(tmp, spec, tmp / "target" if copy_target else target_dir, tmp / "draft")
                spec["engine_k"] = {e: sweep(here, e, temperature=sweep_temperature, n_prompts=sweep_prompts,
                                             max_new_tokens=sweep_tokens) for e in engines}
                write_engine_k(tmp, spec["engine_k"])
            spec["files"] = bundle_hashes(tmp)  # `draftsmith deploy-check` refuses a bundle edited after export
            (tmp / "speculative.json").write_text(json.dumps(spec, indent=2))
            card = feature_card if feature else model_card
            text = card(out.name, target_name, spec, hub_id, copy_target)
            if spec.get("engine_k"):
                from draftsmith.deploy.ksweep import card_section

                text = text.replace("## Use", card_section(spec["engine_k"], spec["predicted_speedup"]) + "\n## Use", 1)
            (tmp / "README.md").write_text(text)
            card_plot(spec, tmp / CARD_PLOT)
            reload_check(tmp, target, target_tok, spec, sampler)
            # two renames: at every moment the destination holds the previous bundle whole or the new one whole
            if out.exists():
                os.replace(out, _previous(out))
            os.replace(tmp, out)
            shutil.rmtree(_previous(out), ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


SGLANG_CONFIG = "sglang_speculative_config.json"


def sglang_config(feature: bool, k: int) -> dict:
    """SGLang's server arguments for the bundle's draft (`python -m sglang.launch_server --model-path TARGET` plus
    each key as a --flag): STANDALONE runs an independent draft (an ordinary causal LM), EAGLE3 a feature head
    (`draft/config.json` is its `LlamaForCausalLMEagle3`). One chain of K drafts (topk 1), K+1 tokens verified."""
    return {"speculative_algorithm": "EAGLE3" if feature else "STANDALONE", "speculative_draft_model_path": "draft",
            "speculative_num_steps": k, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": k + 1}


def sglang_flags(cfg: dict) -> str:
    """The config as the command line's flags, in its order."""
    return " ".join(f"--{key.replace('_', '-')} {value}" for key, value in cfg.items())


def verifier_name(target_name: str, copied: bool) -> str:
    """The feature config's verifier (speculators' `name_or_path`): the copied target relative to the bundle's
    folder, else the target's hub id where its alias has one (named so by the card, which says the draft was
    measured against the local copy), else the name it was exported with."""
    if copied:
        return "target"
    return getattr(ALIASES.get(target_name), "hub_id", None) or target_name


def speculators_fields(cfg: dict, verifier: str, verifier_architectures: list[str], k: int) -> dict:
    """A feature draft's config in the speculators format (PyPI `speculators`, `Eagle3SpeculatorConfig`) beside
    vLLM's own keys: `vllm serve DRAFT_DIR` then finds its verifier and K in it. `model_type` stays "llama", so
    vLLM loads the draft itself as it did. The independent draft has no speculators algorithm."""
    from importlib.metadata import version

    layer = {k: cfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                                  "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                                  "hidden_act")}
    layer.update(model_type="llama", num_hidden_layers=1, rope_parameters=cfg["rope_parameters"])
    return {"speculators_model_type": "eagle3", "speculators_version": "0.9.0",
            "draftsmith_version": version("draftsmith"), "transformer_layer_config": layer,
            "draft_vocab_size": cfg["draft_vocab_size"], "target_hidden_size": cfg["target_hidden_size"],
            # vLLM's speculators reader defaults norm_before_residual to True, so it is always written; the other
            # variants (a peer's head re-exported) where the draft has them
            "norm_before_residual": bool(cfg.get("norm_before_residual", False)),
            **{k: True for k in ("norm_before_fc", "fc_norm", "norm_output") if cfg.get(k)},
            "eagle_aux_hidden_state_layer_ids": cfg["eagle_aux_hidden_state_layer_ids"],
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
                "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures or [])}}}


@contextlib.contextmanager
def _exclusive(out: Path):
    """Holds `.NAME.lock` beside the bundle (flock: released by the kernel even when the holder is SIGKILLed), and
    repairs what a killed export left: partial directories, a previous bundle moved aside but not yet replaced."""
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for stale in out.parent.glob(f".{out.name}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if _previous(out).exists() and not out.exists():
            os.replace(_previous(out), out)
        shutil.rmtree(_previous(out), ignore_errors=True)
        yield


def _previous(out: Path) -> Path:
    """Where the bundle being replaced waits between the two renames of a swap."""
    return out.parent / f".{out.name}.previous"


def reload_check(bundle: Path, target, target_tok, spec: dict, sampler: dict) -> None:
    """Load the bundle back as a user would; our sampler must reproduce the recorded acceptance exactly."""
    draft = prepared_model(str(bundle / "draft"), spec["dtype"]["draft"], device=device_of(target))
    check_pair(target_tok, load_tokenizer(str(bundle / "draft")), target, draft)
    with torch.inference_mode():
        again = measure_pair(target, draft, target_tok, sampler, spec["prompt_sets"], spec["n_prompts"],
                             spec["max_new_tokens"], spec["seed"], spec.get("chat_template"))
    for ps, r in again.items():
        if r["alpha"] != spec["acceptance"][ps]["alpha"]:
            raise DraftsmithError(f"reloaded draft gives alpha {r['alpha']} on {ps}, the export recorded "
                                  f"{spec['acceptance'][ps]['alpha']}: the saved draft is not the measured one")


def log_bundle(run_dir: Path, bundle: Path, spec: dict) -> str | None:
    """The bundle as a W&B artifact (type `bundle`) of the run that trained its draft: that W&B run is resumed by
    its id (OUT_DIR/wandb_id), in the run's own project and mode, so its page holds the draft (`model`) and what
    was shipped of it together. Returns the run id; None when the run did not log to W&B."""
    id_file = run_dir / "wandb_id"
    hydra_cfg = run_dir / ".hydra" / "config.yaml"
    if not id_file.is_file() or not hydra_cfg.is_file():
        return None
    wb = (yaml.safe_load(hydra_cfg.read_text()).get("logger") or {}).get("wandb") or {}
    mode = wandb_mode(wb.get("mode", "auto"))
    if mode == "disabled":
        return None
    import wandb

    run = wandb.init(id=id_file.read_text().strip(), resume="allow", project=wb.get("project", "draftsmith"),
                     entity=wb.get("entity"), dir=str(run_dir), mode=mode,
                     settings=wandb.Settings(silent=True, init_timeout=60))
    art = wandb.Artifact(f"bundle-{run.id}", type="bundle", metadata={
        k: spec.get(k) for k in ("recommended_k", "c", "acceptance", "predicted_speedup", "sampling", "dtype")})
    art.add_dir(str(bundle))
    run.log_artifact(art, aliases=["latest"])
    run.finish()
    return run.id


def main(argv=None, prog=None) -> int:
    ap = argparse.ArgumentParser(prog=prog or "draftsmith export", description=__doc__.splitlines()[0],
                                 epilog=examples(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="run directory (best draft), a .ckpt of a run, or a draft checkpoint dir")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--target", help="target name/path (default: the run's)")
    ap.add_argument("--copy-target", action="store_true", help="copy the target into the bundle")
    ap.add_argument("--prompt-sets", nargs="+", default=["code", "english"])
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                    help="precision of both models (auto: the faster one for decoding on this machine, measured)")
    ap.add_argument("--device", default=default_device(),
                    help="where the pair is measured, the device the bundle will serve on (default: %(default)s)")
    ap.add_argument("--engines", nargs="+", default=[], choices=list(ENGINES), metavar="ENGINE",
                    help="also time the bundle at K = 1..4 in each engine named (draftsmith, transformers, vllm, "
                         "llamacpp), greedy, and write the fastest K into its config (opt-in: minutes per engine)")
    ap.add_argument("--wandb", action="store_true",
                    help="also log the bundle as an artifact of the run's W&B run (a run that logged to W&B; off by "
                         "default, so exporting needs none of the trainer's packages)")
    args = ap.parse_args(argv)
    try:
        out = export(args.src, args.out, target_arg=args.target, copy_target=args.copy_target,
                     prompt_sets=args.prompt_sets, n_prompts=args.n_prompts, max_new_tokens=args.max_new_tokens,
                     dtype=args.dtype, device=args.device, engines=tuple(args.engines))
    except ValueError as e:  # a DraftsmithError, or bad input
        print(f"error: {e}", file=sys.stderr)
        return 2
    spec = json.loads((out / "speculative.json").read_text())
    print(f"bundle: {out}")
    for ps, r in spec["acceptance"].items():
        print(f"  {ps:<10} {TAU} {r['tokens_per_call']:.2f}  alpha {r['alpha']:.3f}")
    print(f"  c {spec['c']:.3f}  recommended K {spec['recommended_k']} "
          f"(predicted {spec['predicted_speedup'][str(spec['recommended_k'])]:.2f}x)")
    for name, r in spec.get("engine_k", {}).items():
        print(f"  {name}: fastest K {r['best_k']} at T={r['temperature']:g} ({r['speedup']:.2f}x against plain)")
    run_dir = args.src if (args.src / "best_draft").is_dir() else None
    run_id = log_bundle(run_dir, out, spec) if args.wandb and run_dir is not None else None
    if run_id:
        print(f"  logged to W&B run {run_id} as artifact bundle-{run_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
