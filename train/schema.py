"""The config's schema: Hydra checks every override against these dataclasses (ConfigStore) before any work, so a
misspelt key (`data.blocksize=1`, `+optim.lrr=1`) or a wrong type (`data.block_size=big`) is refused in one line
(`preflight`, before Hydra composes) naming the keys or the choices that exist. The draft's group is the draft's
own dataclass (`drafts/build.py` DraftConfig, which checks its values); data and loss have theirs here. Groups whose
keys are another component's (a Lightning trainer's, a logger's `_target_` arguments) stay open."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from draftsmith.drafts.build import DraftConfig
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.train.plan import DECODE_MFU, PEAK_TFLOPS, TRAIN_MFU


@dataclass
class Optim:
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    weight_decay: float = 0.01
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    name: str = "adamw"  # adamw | muon (train/module.py `optimizer`)
    muon_lr: float | None = None  # optim.name=muon: Muon's lr (null: optim.lr, at AdamW's update RMS)
    muon_momentum: float = 0.95
    ema: float = 0.0  # > 0: the decay of an average of the weights that validation measures and the report exports


@dataclass
class Checkpoint:
    monitor: str = "val/alpha_on_target"
    mode: str = "max"


@dataclass
class Eval:
    prompt_sets: list[str] = field(default_factory=lambda: ["code", "english"])
    n_prompts: int = 8
    max_new_tokens: int = 64
    baseline: bool = True


@dataclass
class Sampler:
    k: int = 4
    temperature: float = 0.8
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    n_prompts: int = 8
    prompt_tokens: int = 64
    on_target_prompts: int = 16
    on_target_tokens: int = 128
    compile: bool = False


@dataclass
class Target:
    name: str = MISSING
    dtype: str = "auto"
    trust_remote_code: bool = False
    ranks: str = "auto"  # all | first | auto (train/draft.py `_target_ranks`)
    device_map: str | None = None  # "auto": rank 0's target spread over the node's GPUs


@dataclass
class Generated:
    """`data.generated`: a corpus the target samples once (recipes/data/fixed.yaml says what each key does)."""

    enabled: bool = False
    n_prompts: int = 256
    samples_per_prompt: int = 1
    max_new_tokens: int = 192
    batch_size: int = 16
    max_minutes: float | None = None
    engine: str = "draftsmith"  # draftsmith | vllm | auto (checked in train/data.py `check_data`)
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5


@dataclass
class Data:
    """The `data` group: where the corpus comes from and how it is cut and batched."""

    source: str = "stdlib"
    text_field: str = "text"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    max_documents: int | None = None
    cache_dir: str | None = None
    block_size: int = 256
    batch_size: int = 4
    val_fraction: float = 0.03
    val_blocks: int = 16
    num_workers: int = 0
    on_policy_fraction: float = 0.0
    on_policy_from: float = 0.0
    prompt_tokens: int = 64
    on_policy_buffer: int = 16
    features: str = "stored"  # stored | online
    prompts: str | None = None
    chat_template: bool = False
    chat_prompts: float = 0.0  # data/prompts.py with_chat_turns
    generated: Generated = field(default_factory=Generated)
    rows: str = "stream"  # stream | sample | packed (data/corpus.py `load_blocks`)
    # data=chat (recipes/data/chat.yaml says what each key does; data/chatcorpus.py)
    format: str = "text"  # text | chat
    fields: dict[str, str] | None = None
    regenerate: bool = True
    enable_thinking: bool | None = None
    max_turns: int | None = 4
    turn_max_new_tokens: int = 256
    last_turn_only: bool = False
    show: int = 0


@dataclass
class Anneal:
    term: str = MISSING
    to: float = MISSING
    over: float = MISSING


@dataclass
class Loss:
    """The `loss` group: the terms (ce, tv, forward_kl, reverse_kl, jsd) and their weights, from the target's logits
    or kept top-k of them."""

    distill: bool = True
    temperature: float = 1.0
    weights: dict[str, float] = field(default_factory=lambda: {"ce": 1.0})
    anneal: Anneal | None = None
    teacher_topk: int = 0
    compile: bool = True
    truncate: bool = False  # the tv term between the sampler's truncated distributions (train/losses.py)


@dataclass
class Launch:
    join_minutes: float = 10.0
    wait_minutes: float = 60.0


@dataclass
class SizedFor:
    """What a recipe is sized for (train/budget.py): its trainers' hardware, and the recipe named instead on the
    other hardware."""

    hardware: str = "any"  # any | cpu | gpu
    instead: str | None = None
    # why no machine runs the recipe yet (its plan still prints): refused in one line before any work, so that
    # `draftsmith data` does not sample for hours a corpus that training cannot use
    refused: str | None = None


@dataclass
class Draftsmith:
    seed: int = 0
    out_dir: str = MISSING
    ckpt_path: str | None = None
    plan: bool = False
    plan_device_gib: float | None = None  # the GPU memory plan=true holds the totals against (train/plan.py)
    prepare_only: bool = False  # `draftsmith data`: prepare the corpus (and show data.show samples), then stop
    plan_peak_tflops: float = PEAK_TFLOPS  # the stated model of plan=true's hours: a GPU's bf16 peak,
    plan_mfu: float = TRAIN_MFU  # the share of it training reaches,
    plan_decode_mfu: float = DECODE_MFU  # and the share batched decoding reaches (train/plan.py)
    optim: Optim = field(default_factory=Optim)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    eval: Eval = field(default_factory=Eval)
    sampler: Sampler = field(default_factory=Sampler)
    target: Target = field(default_factory=Target)
    launch: Launch = field(default_factory=Launch)
    sized_for: SizedFor = field(default_factory=SizedFor)
    draft: DraftConfig = field(default_factory=DraftConfig)
    data: Data = field(default_factory=Data)
    loss: Loss = field(default_factory=Loss)
    trainer: Any = MISSING
    logger: Any = None
    callbacks: Any = None


def register() -> None:
    ConfigStore.instance().store(name="schema", node=Draftsmith)


def check(cfg) -> None:
    """Refuse, in one line, a key a `+` override added where the schema has none (Hydra lets `+` add to any node)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError

    schema = OmegaConf.structured(Draftsmith)
    try:  # as plain values: Hydra's own nodes carry the flags that let `+` in
        OmegaConf.merge(schema, OmegaConf.to_container(cfg, resolve=False))
    except ConfigKeyError as e:
        key = e.full_key or "?"
        parent = key.rsplit(".", 1)[0] if "." in key else None
        known = list(schema[parent].keys()) if parent else list(Draftsmith.__dataclass_fields__)
        raise DraftsmithError(f"unknown setting {key}: {parent or 'the config'} takes {', '.join(known)}") from None


def preflight(overrides: list[str], config_dir: str, config_name: str = "draft") -> None:
    """Compose the config the command line asks for, as Hydra is about to, and refuse in one line what it would
    refuse in several: an unknown key (naming the keys its group takes), a value of the wrong type, a choice a group
    does not have (naming the ones it has). Sweeps (`-m`) and Hydra's own flags are left to Hydra."""
    if any(a.startswith("-") for a in overrides):
        return
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    mine = [a for a in overrides if not a.lstrip("+~").startswith("hydra.")]
    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            compose(config_name, overrides=mine)
    except Exception as e:  # Hydra's composition, override parsing and OmegaConf's validation errors
        raise DraftsmithError(_one_line(e)) from None
    finally:
        GlobalHydra.instance().clear()


def _one_line(e: Exception) -> str:
    import re

    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    cause = e
    while cause.__cause__ is not None and getattr(cause, "full_key", None) is None:  # OmegaConf's, under Hydra's
        cause = cause.__cause__
    key = getattr(cause, "full_key", None)
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and key:
        parent = key.rsplit(".", 1)[0] if "." in key else None
        node = OmegaConf.structured(Draftsmith)
        sub = OmegaConf.select(node, parent) if parent else node
        # a dataclass's keys are all there is; a dict's (loss.weights) take new ones with +, as Hydra says
        known = list(sub.keys()) if OmegaConf.is_config(sub) and OmegaConf.get_type(sub) not in (dict, None) else []
        if known:
            return f"unknown setting {key}: {parent or 'the config'} takes {', '.join(known)}"
    if isinstance(cause, ValidationError) and key:
        return f"{key}: {str(cause).strip().splitlines()[0]}"
    text = str(e).strip()
    missing = re.search(r"Could not find '([^/']+)/([^']+)'", text)
    if missing:
        group, choice = missing.groups()
        options = re.findall(r"^\t(\S+)$", text, flags=re.M)
        return f"{group}={choice}: no such {group}; choose one of {', '.join(options)}" if options else \
            text.splitlines()[0]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " ".join(lines[:2])
