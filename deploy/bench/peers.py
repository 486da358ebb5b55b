"""The peers' own EAGLE-3 trainers, installed and launched by draftsmith so that `bench trainers` sets them beside
ours on the same samples: speculators 0.9.0 (vllm-project) and SpecForge 0.2.0 (sgl-project).

- Install (`install`): each in a venv of its own under $DRAFTSMITH_HOME/peers/NAME, built once and reused, as the
  engines' are (their pins, transformers 5.8-5.19 and torch 2.9-2.14, are not ours). Both take the CPU torch
  2.13.0 this kind of machine keeps on disk (~0.2 GB) rather than the multi-GB CUDA build their metadata pulls, and
  leave out what their training path never imports: speculators' torchvision and torchaudio (PyPI's torchvision
  does not import beside the CPU torch 2.13), SpecForge's SGLang stack (sglang 0.5.14 and its CUDA-13 kernels:
  only its online capture, not its offline trainer, imports it), yunchang, wandb, tensorboard.
- Launch: a launcher of ours run by that venv's python (`peer_speculators.py`, `peer_specforge.py`), which imports
  no draftsmith and patches none of their files: it replaces, at import time, what assumes an accelerator.
- Data (`prepare`): the rows of one corpus of the target's samples, as each peer reads them: speculator-format rows
  (`input_ids`, `loss_mask` = the sampled tokens) through speculators' own `prepare-data`, the target's hidden
  states from a plain transformers pass (`peer_features.py`: neither peer can make them without vLLM or SGLang),
  and one pruned vocabulary (`d2t`/`t2d`) for all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from draftsmith.engines.vllm import install_step
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.machine import cache_home

HERE = Path(__file__).resolve().parent
FEATURES = HERE / "peer_features.py"
# the CPU torch this kind of machine keeps on disk: pip takes it there; a range would pull a multi-GB CUDA build
CPU_TORCH = "torch==2.13.0"


@dataclass(frozen=True)
class Peer:
    name: str
    version: str
    launcher: Path
    packages: list[str]  # installed with --no-deps: the peer and its own connectors
    deps: list[str]  # what its training path imports, with its pins where they bind
    left_out: str  # what its metadata asks for that is not installed, and why
    env: dict = field(default_factory=dict)


PEERS = {
    "speculators": Peer(
        "speculators", "0.9.0", HERE / "peer_speculators.py", ["speculators==0.9.0", "hs-connectors==0.9.0"],
        [CPU_TORCH, "transformers>=5.0,<=5.19", "datasets>=4,<=5.1.0", "loguru>=0.7.2,<=0.7.3", "numpy>=2,<=2.5.4",
         "openai>=2", "pydantic>=2", "pydantic-settings>=2", "typer>=0.12", "tqdm>=4.66.3,<=4.70.1", "aiohttp",
         "click", "httpx", "huggingface-hub", "protobuf", "psutil", "rich", "safetensors"],
        "torchvision and torchaudio (never imported by its trainer; PyPI's torchvision breaks beside torch 2.13)"),
    "specforge": Peer(
        "specforge", "0.2.0", HERE / "peer_specforge.py", ["specforge==0.2.0"],
        [CPU_TORCH, "transformers==5.8.1", "triton", "accelerate", "datasets", "safetensors", "pydantic", "pyyaml",
         "psutil", "tqdm", "huggingface-hub", "numpy", "requests", "typing-extensions"],
        "sglang 0.5.14 and its CUDA-13 kernels (its offline trainer never imports them), yunchang, wandb, "
        "tensorboard, openai-harmony; torch 2.13.0 (CPU) for its pinned 2.11.0 (a CUDA build)",
        {"SPECFORGE_DEVICE": "cpu", "TORCH_COMPILE_DISABLE": "1"}),
}


def home(name: str) -> Path:
    """The venv `install` makes: $DRAFTSMITH_HOME/peers/NAME."""
    return cache_home() / "peers" / name


def python_path(name: str) -> Path:
    return home(name) / "bin" / "python"


def _peer(name: str) -> Peer:
    if name not in PEERS:
        raise DraftsmithError(f"no peer trainer {name!r}: {', '.join(PEERS)}")
    return PEERS[name]


def clean_env(extra: dict | None = None) -> dict:
    """Our environment without PYTHONPATH (it must not leak into a peer's venv), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return {**env, **(extra or {})}


def installed(name: str) -> bool:
    """Its venv holds the version we launch (read from its metadata: importing it takes a minute on a busy CPU)."""
    python = python_path(name)
    check = f"import importlib.metadata as m, sys; sys.exit(m.version({name!r}) != {_peer(name).version!r})"
    return python.is_file() and subprocess.run([str(python), "-c", check], capture_output=True,
                                               env=clean_env()).returncode == 0


def install(name: str) -> Path:
    """The peer's venv (once: nothing is done when it imports already); returns its python."""
    peer = _peer(name)
    venv, python = home(name), python_path(name)
    if installed(name):
        return python
    print(f"draftsmith: installing {name} {peer.version} in {venv} (once), without {peer.left_out}", flush=True)
    install_step([sys.executable, "-m", "venv", str(venv)], "creating its venv", name)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    install_step([*pip, "--upgrade", "pip"], "upgrading its pip", name)
    install_step([*pip, *peer.deps], "installing its dependencies", name)
    install_step([*pip, "--no-deps", *peer.packages], f"installing {' '.join(peer.packages)}", name)
    if subprocess.run([str(python), "-c", f"import {name}"], capture_output=True,
                      env=clean_env(peer.env)).returncode != 0:
        raise DraftsmithError(f"{name} was installed in {venv} but does not import there")
    return python


def venv_size(name: str) -> int:
    """Bytes the peer's venv takes on disk."""
    return sum(f.stat().st_size for f in home(name).rglob("*") if f.is_file() and not f.is_symlink())


# ---- data -------------------------------------------------------------------------------------------------------

def corpus_rows(corpus: Path, limit: int | None = None) -> list[dict]:
    """Speculator-format rows of one of our corpora (a `generate_corpus` JSONL: `ids` = prompt + sample,
    `prompt_tokens`): the loss mask is the sampled tokens, the ones our trainer learns."""
    rows = []
    with open(corpus) as f:
        for line in f:
            r = json.loads(line)
            ids, p = r["ids"], r["prompt_tokens"]
            if len(ids) > p:
                rows.append({"input_ids": ids, "loss_mask": [0] * p + [1] * (len(ids) - p)})
            if limit and len(rows) >= limit:
                break
    return rows


def write_vocab(head_tokens, vocab_size: int, out: Path) -> dict:
    """One pruned vocabulary in every peer's format, from the target tokens of the head's rows: speculators'
    `d2t.npy` (offsets: target = draft + d2t[draft]) and `t2d.npy` (bool over the target's vocabulary), and
    SpecForge's `vocab_map.pt` ({"d2t", "t2d"} tensors, the same)."""
    import torch

    ids = np.sort(np.asarray(head_tokens, dtype=np.int64))
    d2t = ids - np.arange(len(ids))
    t2d = np.zeros(vocab_size, dtype=bool)
    t2d[ids] = True
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "d2t.npy", d2t)
    np.save(out / "t2d.npy", t2d)
    torch.save({"d2t": torch.from_numpy(d2t), "t2d": torch.from_numpy(t2d)}, out / "vocab_map.pt")
    return {"d2t": out / "d2t.npy", "t2d": out / "t2d.npy", "map": out / "vocab_map.pt", "size": len(ids)}


def head_tokens_of(draft_dir: Path) -> list[int]:
    """The target tokens of a trained feature draft's head rows (its saved `d2t`): the vocabulary every peer gets."""
    from safetensors import safe_open

    files = sorted(Path(draft_dir).glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), "pt") as st:
            if "d2t" in st.keys():
                d2t = st.get_tensor("d2t").long()
                return (d2t + np.arange(len(d2t))).tolist()
    raise DraftsmithError(f"{draft_dir} holds no d2t: train it with a pruned head (draft.draft_vocab)")


def prepare(corpus: Path, target_dir: Path, layers: list[int], out: Path, *, peers: list[str],
            max_length: int = 2048, threads: int = 0) -> dict:
    """Each peer's data from the same rows, once per `out`: speculators' prepared dataset and hidden states
    (`out/speculators`), SpecForge's feature files (`out/specforge`); the rows themselves in `out/rows.jsonl`."""
    out.mkdir(parents=True, exist_ok=True)
    rows_file = out / "rows.jsonl"
    done = out / "prepared.json"
    if done.is_file() and json.loads(done.read_text()).get("peers") == sorted(peers):
        return json.loads(done.read_text())
    rows = corpus_rows(corpus)
    if not rows:
        raise DraftsmithError(f"{corpus} holds no sampled tokens")
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = clean_env({"OMP_NUM_THREADS": str(threads)} if threads else None)
    record = {"rows": len(rows), "tokens": sum(len(r["input_ids"]) for r in rows),
              "trained_tokens": sum(sum(r["loss_mask"]) for r in rows), "peers": sorted(peers)}
    layer_args = ["--layers", *map(str, layers), "--threads", str(threads)]
    if "speculators" in peers:
        spec = out / "speculators"
        python = python_path("speculators")
        # its own data preparation (it shuffles the rows: the hidden states follow its order, file i = its row i)
        cli = python.parent / "speculators"
        _check([str(cli), "prepare-data", "--model", str(target_dir), "--data", str(rows_file), "--output",
                str(spec / "data"), "--seq-length", str(max_length), "--num-preprocessing-workers", "1",
                "--overwrite"], env, "speculators prepare-data")
        _check([str(python), str(FEATURES), "--target", str(target_dir), "--prepared", str(spec / "data"),
                "--speculators", str(spec / "data" / "hidden_states"), *layer_args], env,
               "the target's hidden states for speculators")
    if "specforge" in peers:
        sf = out / "specforge"
        _check([str(python_path("specforge")), str(FEATURES), "--target", str(target_dir), "--rows", str(rows_file),
                "--specforge", str(sf / "features"), *layer_args], env, "the target's hidden states for SpecForge")
    done.write_text(json.dumps(record))
    return record


def _check(cmd: list[str], env: dict, what: str) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-8:])
        raise DraftsmithError(f"{what} failed (exit {res.returncode}):\n{tail}")
    return res.stdout


# ---- the runs ---------------------------------------------------------------------------------------------------

def speculators_command(*, target_dir: Path, data: Path, vocab: dict, layers: list[int], save: Path, steps: int,
                        seq_len: int, matched: bool = False, lr: float | None = None) -> list[str]:
    """speculators' own trainer as its users run it, with what a CPU forces (sdpa attention, the eager loss, fp32
    hidden states, no dataloader workers) and what the budget forces (`--max-steps`, the LR schedule over them,
    its best checkpoint by its own validation loss kept). `matched`: the arm set to our trainer's knobs where its
    command line allows: AdamW, no norm before fc, the raw residual, the pre-norm output fed back, 4 unrolled
    steps (its defaults: Muon, the three norms on, 3 steps)."""
    cmd = [str(python_path("speculators")), str(PEERS["speculators"].launcher),
           "--verifier-name-or-path", str(target_dir), "--data-path", str(data / "data"),
           "--hidden-states-path", str(data / "data" / "hidden_states"), "--on-missing", "raise",
           "--save-path", str(save), "--d2t-path", str(vocab["d2t"]), "--t2d-path", str(vocab["t2d"]),
           "--draft-vocab-size", str(vocab["size"]), "--target-layer-ids", *map(str, layers),
           "--draft-attn-impl", "sdpa", "--hidden-states-dtype", "float32", "--loss-implementation", "eager",
           "--num-workers", "0", "--total-seq-len", str(seq_len), "--epochs", "100000",
           "--max-steps", str(steps), "--scheduler-total-steps", str(steps), "--no-resume-from-checkpoint",
           "--save-best", "--log-freq", "10", "--log-dir", str(save / "logs")]
    if matched:
        cmd += ["--optimizer", "adamw", "--no-norm-before-fc", "--no-norm-before-residual", "--no-norm-output",
                "--ttt-steps", "4"]
    if lr is not None:
        cmd += ["--lr", str(lr)]
    return cmd


def speculators_checkpoint(save: Path) -> Path:
    """The checkpoint speculators kept: its best by validation loss, else its last epoch's."""
    best = save / "checkpoint_best"
    if (best / "config.json").is_file():
        return best.resolve()
    epochs = sorted((p for p in save.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    if not epochs:
        raise DraftsmithError(f"speculators left no checkpoint in {save}")
    return epochs[-1]


def specforge_target(target_dir: Path, out: Path) -> Path:
    """The target as SpecForge's target head reads it: it wants a `*.index.json` beside the weights (a one-file
    checkpoint has none): a folder of links to the target's files with that index added."""
    from safetensors import safe_open

    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for f in sorted(Path(target_dir).iterdir()):
        link = out / f.name
        if not link.exists():
            link.symlink_to(f.resolve())
        if f.suffix == ".safetensors":
            with safe_open(str(f), "pt") as st:
                weight_map.update({k: f.name for k in st.keys()})
    if not any(Path(target_dir).glob("*.index.json")):
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def specforge_draft_config(target_config, layers: list[int], draft_vocab: int, out: Path) -> Path:
    """SpecForge's draft config (`LlamaForCausalLMEagle3`): one layer of the target's shape, the pruned head, the
    feature layers in SGLang's numbering (id i = the output of layer i: ours minus one). Written out because its
    export needs the file, and its generated default has a 32000-token head."""
    if min(layers) < 1:
        raise DraftsmithError(f"feature layers {layers}: SGLang's numbering cannot name the embedding's output "
                              "(id 0); give our trainer draft.feature_layers of 1 or more")
    tc = target_config.to_dict()
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling", "max_position_embeddings", "vocab_size",
            "hidden_act", "bos_token_id", "eos_token_id", "pad_token_id")
    cfg = {k: tc[k] for k in keep if tc.get(k) is not None}
    cfg.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
               draft_vocab_size=draft_vocab, tie_word_embeddings=False,
               eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers]})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(cfg, indent=1))
    return out


def specforge_run(*, target_dir: Path, features: Path, draft_config: Path, vocab: dict, out: Path, steps: int,
                  max_length: int, lm_head_key: str, matched: bool = False) -> tuple[list[str], Path]:
    """SpecForge's own trainer as its users run it (its YAML), with what a CPU forces (fp32 draft, sdpa, no FSDP
    sharding, no dataloader workers) and the budget (`max_steps`, its cosine schedule over them), a checkpoint at
    the end. `matched`: 4 unrolled steps as ours (its default: 7). Returns the command and its checkpoint's dir."""
    run = {"model": {"target_model_path": str(target_dir), "draft_model_config": str(draft_config),
                     "lm_head_key": lm_head_key, "vocab_mapping_path": str(vocab["map"]), "torch_dtype": "float32"},
           "data": {"hidden_states_path": str(features), "max_length": max_length, "dataloader_num_workers": 0,
                    "cache_dir": str(out / "cache")},
           "training": {"strategy": "eagle3", "max_steps": steps, "attention_backend": "sdpa",
                        "fsdp_sharding": "NO_SHARD", "log_interval": 10, "save_interval": steps,
                        **({"ttt_length": 4} if matched else {})},
           "deployment": {"mode": "local_colocated"}, "output_dir": str(out / "out")}
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").write_text(json.dumps(run, indent=1))  # YAML's superset: its loader reads JSON
    cmd = [str(python_path("specforge")), str(PEERS["specforge"].launcher), "train", "--config", str(out / "run.json")]
    return cmd, out / "out" / f"specforge-run-step{steps}"


def specforge_export(checkpoint: Path, draft_config: Path, vocab: dict, target_dir: Path, out: Path) -> Path:
    """Its checkpoint as the HF `LlamaForCausalLMEagle3` folder SGLang and vLLM serve (and our loader reads), by
    its own `specforge export`."""
    _check([str(python_path("specforge").parent / "specforge"), "export", "--to", "hf", "--checkpoint",
            str(checkpoint), "--draft-config", str(draft_config), "--output-dir", str(out), "--vocab-mapping",
            str(vocab["map"]), "--embedding-source", str(target_dir)], clean_env(PEERS["specforge"].env),
           "specforge export")
    return out
