"""What a recipe is sized for, and its budget in samples x epochs.

A CPU recipe (the 2-core demo) is a time box; a GPU recipe is a budget: `data.generated.n_prompts` x
`samples_per_prompt` samples, `trainer.max_epochs` passes over them, the steps derived from the corpus and printed.
Composing one with the other's trainer is refused in one line naming the recipe to use (`sized_for`), as is a GPU
recipe without a target (`target.name`): its corpus and its draft are the target's, and there is no demo to fall
back on at that size.
"""

from __future__ import annotations

import math
import re

from omegaconf import OmegaConf

from draftsmith.sampling.errors import DraftsmithError

HARDWARE = ("any", "cpu", "gpu")


def trainer_hardware(trainer) -> str:
    """cpu, gpu, or any (accelerator auto: decided by the machine the run lands on)."""
    acc = str(trainer.get("accelerator", "cpu"))
    return {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu"}.get(acc, "any")


def check_recipe(cfg, recipe: str | None = None) -> None:
    """Refuse, in one line, a recipe composed with a trainer for other hardware, a GPU recipe with no target, or a
    time box (trainer.max_time) Lightning cannot read."""
    sized = cfg.get("sized_for") or {}
    hardware = str(sized.get("hardware", "any"))
    if hardware not in HARDWARE:
        raise DraftsmithError(f"sized_for.hardware must be one of {', '.join(HARDWARE)}, got {hardware!r}")
    on = trainer_hardware(cfg.trainer)
    name = f"recipe={recipe}" if recipe else "this recipe"
    if hardware == "cpu" and on == "gpu":
        raise DraftsmithError(f"{name} is the 2-core CPU demo (time boxes of minutes): on GPUs use "
                              f"recipe={sized.get('instead') or 'gpu_8b'} target.name=YOUR_TARGET "
                              "(draftsmith recipes lists them)")
    if hardware == "gpu" and on == "cpu":
        raise DraftsmithError(f"{name} is sized for GPUs ({budget_line(cfg)}): give it a GPU trainer "
                              f"(trainer=gpu, fsdp, deepspeed_stage_2 or _3), or on a CPU use "
                              f"recipe={sized.get('instead') or 'shallow_wide'}")
    if hardware == "gpu" and OmegaConf.is_missing(cfg.target, "name"):
        raise DraftsmithError(f"{name} needs the target you train a draft for: add target.name=HUB_ID_OR_DIR "
                              "(e.g. meta-llama/Llama-3.1-8B-Instruct)")
    if sized.get("refused") and not cfg.get("plan"):  # its plan still prints: it says why
        raise DraftsmithError(f"{name} cannot run yet: {sized.refused} (draftsmith plan {name} shows its memory)")
    box = cfg.trainer.get("max_time")
    # Lightning reads the box only when the trainer is made: after the corpus is sampled, minutes to hours later
    if isinstance(box, str) and not re.fullmatch(r"\d+:\d\d:\d\d:\d\d", box.strip()):
        raise DraftsmithError(f"trainer.max_time must read DD:HH:MM:SS with two digits each after the days (16 "
                              f"minutes: 00:00:16:00), got {box!r}")


def samples(cfg) -> int | None:
    """The samples a generated corpus asks for (prompts x samples each), None for a corpus read as it is."""
    g = cfg.data.generated
    return int(g.n_prompts) * int(g.samples_per_prompt) if g.enabled else None


def budget_line(cfg) -> str:
    """The budget in words: samples x epochs, or the steps and time box a CPU recipe runs for."""
    t = cfg.trainer
    epochs = t.get("max_epochs")
    n = samples(cfg)
    if epochs and int(t.get("max_steps", -1) or -1) < 0:
        return f"{n if n is not None else 'the corpus'}{' samples' if n is not None else ''} x {epochs} epochs"
    box = f", at most {t.max_time}" if t.get("max_time") else ""
    return f"{t.get('max_steps')} steps{box}"


def derived_steps(cfg, items: int, world_size: int, batch_size: int) -> int | None:
    """The optimizer steps of a budget in epochs (trainer.max_epochs with max_steps -1): the whole micro-batches of
    `batch_size` items a rank draws from its share of the loader's `items` (Lightning's distributed sampler gives
    each rank ceil(items / ranks)), over gradient accumulation, times the epochs. A block loader's items are blocks in
    micro-batches of data.batch_size; a chat loader's are whole batches already, one a micro-batch. None where the
    recipe fixes max_steps itself."""
    t = cfg.trainer
    steps = t.get("max_steps")
    if (steps is not None and int(steps) >= 0) or not t.get("max_epochs"):
        return None
    per_rank = math.ceil(items / max(1, world_size)) // int(batch_size)
    accumulate = int(t.get("accumulate_grad_batches", 1) or 1)
    return max(1, math.ceil(per_rank / accumulate) * int(t.max_epochs))


def recipe_choice() -> str | None:
    """The `recipe=` choice of the running Hydra job, for messages; None outside one."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.choices.get("recipe") if HydraConfig.initialized() else None
