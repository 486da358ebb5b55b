"""The config's schema: Hydra checks every override against these dataclasses (ConfigStore) before any work, so a
misspelt key (`+optim.lrr=1`) or a wrong type (`optim.lr=fast`) is refused in one line. Groups whose keys are their
component's own (a Lightning trainer's, a logger's `_target_` arguments, data and loss options, the draft, checked
by `train/build.py` DraftConfig with its own message) stay open here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class Optim:
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    weight_decay: float = 0.01
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1


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
    device_map: Optional[str] = None  # "auto": rank 0's target spread over the node's GPUs


@dataclass
class Launch:
    join_minutes: float = 10.0
    wait_minutes: float = 60.0


@dataclass
class Draftsmith:
    seed: int = 0
    out_dir: str = MISSING
    ckpt_path: Optional[str] = None
    plan: bool = False
    plan_device_gib: Optional[float] = None  # the GPU memory plan=true holds the totals against (train/plan.py)
    optim: Optim = field(default_factory=Optim)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    eval: Eval = field(default_factory=Eval)
    sampler: Sampler = field(default_factory=Sampler)
    target: Target = field(default_factory=Target)
    launch: Launch = field(default_factory=Launch)
    draft: Any = MISSING
    data: Any = MISSING
    loss: Any = MISSING
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
        raise ValueError(f"unknown setting {key}: {parent or 'the config'} takes {', '.join(known)}") from None
