"""The pieces `train/draft.py` assembles: output dir, loggers, data loaders, validation prompts."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch.utils.data import DataLoader, Sampler, TensorDataset


class SetupError(ValueError):
    pass


def check_writable(out_dir: str) -> Path:
    path = Path(out_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write_probe_{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise SetupError(f"output directory {path} is not writable ({e.strerror}); set hydra.run.dir=<writable dir>")
    return path


_CLAIMS = []  # the open lock files of the run dirs this process holds (closed by the kernel when it dies)


def claim_run_dir(path: Path) -> None:
    """One training run per run directory: a second run (or a resume) there while the first lives is refused.
    flock, so a run that was SIGKILLed leaves no stale claim; DDP's other ranks (LOCAL_RANK > 0) share rank 0's."""
    if int(os.environ.get("LOCAL_RANK", "0")) > 0:
        return
    lock = open(path / ".run.lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        raise SetupError(f"{path} is in use by another training run (pid {lock.read().strip() or '?'}); "
                         "give this one its own hydra.run.dir, or wait for that run to end") from None
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    _CLAIMS.append(lock)


def _wandb_mode(mode: str) -> str:
    """auto: online only when a key is configured (env or netrc); offline otherwise, so it never blocks."""
    if mode != "auto":
        return mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path.home() / ".netrc"
    if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return "online"
    return "offline"


def loggers(cfg, out_dir: Path) -> list:
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    out = []
    if cfg.logger.get("csv"):
        out.append(CSVLogger(str(out_dir), name="csv", version=""))
    wb = cfg.logger.get("wandb")
    if wb:
        mode = _wandb_mode(wb.get("mode", "auto"))
        if mode != "disabled":
            os.environ["WANDB_MODE"] = mode  # WandbLogger(offline=True) would set the legacy "dryrun" instead
            out.append(WandbLogger(project=wb.get("project", "draftsmith"), save_dir=str(out_dir),
                                   name=Path(out_dir).name, settings={"init_timeout": 60, "silent": True}))
    return out


def loaders(blocks: dict, cfg) -> tuple[DataLoader, DataLoader]:
    d = cfg.data
    rows = torch.arange(len(blocks["train"]))  # each block's index: the key of its kept teacher logits
    train = DataLoader(TensorDataset(blocks["train"], rows), batch_size=d.batch_size, drop_last=True,
                       sampler=EpochOrder(len(blocks["train"]), cfg.seed), num_workers=d.num_workers)
    val = blocks["val"][: d.val_blocks]
    return train, DataLoader(TensorDataset(val), batch_size=d.batch_size, num_workers=d.num_workers)


class EpochOrder(Sampler[int]):
    """A shuffle that is a function of (seed, epoch) alone, so a resumed run sees the batches the killed one would
    have: a DataLoader's `shuffle=True` draws each epoch's order from a generator whose state no checkpoint holds.
    `skip` rows of epoch `skip_epoch` are left out once (the ones trained on before the checkpoint)."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, seed, 0
        self.skip, self.skip_epoch = 0, 0

    def set_epoch(self, epoch: int) -> None:  # Lightning calls it before every epoch
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.n, generator=g).tolist()
        skip = self.skip if self.epoch == self.skip_epoch else 0
        self.skip = 0
        return iter(order[skip:])

    def __len__(self) -> int:
        return self.n


class DataOrder(Callback):
    """Saves in each checkpoint how many batches of the current epoch were trained on, and on resume makes the
    sampler skip them: `ckpt_path=last` continues with the next batch, not the epoch's first (Lightning restores
    the step count, not the position in a plain DataLoader). Under DDP Lightning wraps the sampler in a
    distributed one, whose split a global skip would shift: there the resumed epoch starts over, as in Lightning."""

    def __init__(self, loader: DataLoader):
        self.sampler, self.batch_size = loader.sampler, loader.batch_size
        self.batches, self._resume = 0, None

    def on_train_start(self, trainer, pl_module):
        if self._resume is not None and trainer.world_size == 1:
            self.sampler.epoch, self.sampler.skip_epoch = self._resume["epoch"], self._resume["epoch"]
            self.sampler.skip = self._resume["batches"] * self.batch_size

    def on_train_epoch_start(self, trainer, pl_module):  # not called for an epoch resumed mid-way
        self.sampler.set_epoch(trainer.current_epoch)  # also when a distributed wrapper hides it from Lightning
        self.batches = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches += 1  # before the step: a checkpoint written after it counts this batch as trained on

    def state_dict(self) -> dict:
        return {"epoch": self.sampler.epoch, "batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        self.batches, self._resume = state["batches"], state


def validation_prompts(blocks: dict, n: int, prompt_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Openings of held-out blocks (never trained on) as sampler prompts: (n, prompt_tokens) ids and mask."""
    val = blocks["val"]
    n = min(n, len(val))
    idx = torch.linspace(0, len(val) - 1, n).long()
    ids = val[idx, :prompt_tokens].clone()
    return ids, torch.ones_like(ids)


def check_data(cfg, tokenizer) -> None:
    """Refuse data settings that cannot work, before anything is loaded or written (one line each)."""
    d = cfg.data
    if cfg.checkpoint.monitor == "val/alpha_on_target" and not cfg.sampler.on_target_tokens:
        raise SetupError("checkpoint.monitor=val/alpha_on_target needs its sample set: set sampler.on_target_tokens "
                         "> 0 or monitor another metric (val/alpha, val/alpha_analytic)")
    f = d.on_policy_fraction
    if not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
        raise SetupError(f"data.on_policy_fraction must be in [0, 1] (the share of each batch the draft samples "
                         f"itself), got {f}")
    start = d.get("on_policy_from", 0.0)
    if not isinstance(start, (int, float)) or not 0.0 <= start < 1.0:
        raise SetupError(f"data.on_policy_from must be in [0, 1) (the fraction of training after which on-policy "
                         f"rows start), got {start}")
    if cfg.sampler.get("compile") and cfg.draft.get("kind", "independent") == "feature_head":
        raise SetupError("sampler.compile=true compiles independent drafts; a feature draft validates eagerly: "
                         "set sampler.compile=false")
    if cfg.draft.get("init_from") and cfg.draft.get("kind", "independent") == "feature_head":
        raise SetupError("draft.init_from continues an independent draft; a feature draft cannot start from one")
    if f > 0 and cfg.draft.get("kind", "independent") == "feature_head":
        raise SetupError(f"data.on_policy_fraction={f}: a feature draft cannot sample alone (it reads the target's "
                         "features); use data=generated (the target's own samples) or data=fixed")
    if f > 0 and not cfg.loss.get("distill", True):
        raise SetupError(f"data.on_policy_fraction={f} needs the target's logits on the draft's samples: "
                         "choose a distillation loss (loss=distill_tv, forward_kl, jsd, ...), not loss=ce")
    if f > 0 and round(f * d.batch_size) == 0:
        raise SetupError(f"data.on_policy_fraction={f} of a batch of {d.batch_size} rounds to no row: raise it to "
                         f"at least {0.5 / d.batch_size:.3f} or set it to 0")
    if f > 0 and d.prompt_tokens >= d.block_size:
        raise SetupError(f"data.prompt_tokens ({d.prompt_tokens}) leaves no room for an on-policy continuation in "
                         f"blocks of {d.block_size}: lower it or raise data.block_size")
    if d.chat_template and not getattr(tokenizer, "chat_template", None):
        raise SetupError(f"data.chat_template=true but the target ({cfg.target.name}) has no chat template: "
                         "set data.chat_template=false")
    topk = cfg.loss.get("teacher_topk", 0)
    if topk and not cfg.loss.get("distill", True):
        raise SetupError(f"loss.teacher_topk={topk} keeps the target's logits for distillation; with loss=ce set "
                         "it to 0")
    g = d.generated
    if g.enabled:
        if g.max_minutes is not None and not g.max_minutes > 0:
            raise SetupError(f"data.generated.max_minutes must be > 0 (or null: no time limit), got {g.max_minutes}")
        budget = g.n_prompts * g.samples_per_prompt * g.max_new_tokens
        if budget < d.batch_size * d.block_size:
            raise SetupError(f"data.generated asks for {budget} new tokens ({g.n_prompts} prompts x "
                             f"{g.samples_per_prompt} x {g.max_new_tokens}), less than one batch of "
                             f"{d.batch_size} x {d.block_size}: raise data.generated.n_prompts or max_new_tokens")


def prompt_texts(cfg, tokenizer, openings: torch.Tensor | None = None, use_file: bool = True) -> list[str]:
    """Generation prompts: `data.prompts` (a JSONL with a `prompt` field) or decoded corpus openings; wrapped in the
    target's chat template when `data.chat_template` (an Instruct target is deployed that way)."""
    from train.evaluate import load_prompts

    if cfg.data.prompts and use_file:
        try:
            texts = [r["prompt"] for r in load_prompts(str(cfg.data.prompts))]
        except (ValueError, OSError) as e:
            raise SetupError(f"data.prompts: {e}") from None
    else:
        texts = [tokenizer.decode(row, skip_special_tokens=True) for row in openings]
    if cfg.data.chat_template:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                               add_generation_prompt=True) for t in texts]
    return texts


def prompt_tensor(texts: list[str], tokenizer, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (N, <= max_tokens) ids and mask; longer prompts keep their last max_tokens tokens (the part a
    continuation depends on most). Chat-templated text already holds its special tokens."""
    rows = [ids[-max_tokens:] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] if ids]
    if not rows:
        raise SetupError("no usable generation prompt: every prompt tokenizes to nothing")
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def split_prompts(cfg, tokenizer) -> tuple[list[str] | None, list[str] | None]:
    """`data.prompts` as (training prompts, held-out prompts for val/alpha_on_target): every k-th prompt is held
    out and never trained on. (None, None) without a prompts file."""
    if not cfg.data.prompts:
        return None, None
    texts = prompt_texts(cfg, tokenizer)
    if len(texts) < 4:
        return texts, None
    n = min(cfg.sampler.on_target_prompts, len(texts) // 2)
    held = set(torch.linspace(0, len(texts) - 1, n).long().tolist())
    return [t for i, t in enumerate(texts) if i not in held], [t for i, t in enumerate(texts) if i in held]


def on_target_prompts(cfg, tokenizer, blocks: dict, held_out: list[str] | None):
    """Prompts the target continues once for val/alpha_on_target: the prompts file's held-out ones, else held-out
    corpus openings (through the chat template when asked). None when the metric is off."""
    s = cfg.sampler
    if not s.on_target_tokens:
        return None
    if held_out is not None:
        return prompt_tensor(held_out, tokenizer, s.prompt_tokens + 64)
    openings, ones = validation_prompts(blocks, s.on_target_prompts, s.prompt_tokens)
    if cfg.data.chat_template:
        return prompt_tensor(prompt_texts(cfg, tokenizer, openings, use_file=False), tokenizer, s.prompt_tokens + 64)
    return openings, ones


def resume_checkpoint(out_dir: Path, ckpt_path: str | None) -> str | None:
    """`ckpt_path=last` (or a path): the checkpoint to resume from, checked to load before any work; a truncated
    or corrupt file is refused naming it and the newest other checkpoint of the run that does load."""
    if not ckpt_path:
        return None
    ckpt_dir = Path(out_dir) / "checkpoints"
    path = ckpt_dir / "last.ckpt" if ckpt_path == "last" else Path(ckpt_path)
    if not path.is_file():
        raise SetupError(f"ckpt_path={ckpt_path}: {path} does not exist (resume with hydra.run.dir=<the run dir>)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, bad pickle, a file that is not ours
        if "Weights only load failed" in str(e):  # weights_only refuses any object but tensors and plain data
            raise SetupError(f"checkpoint {path} holds pickled objects beyond tensors: refused, nothing in it was "
                             "run (draftsmith's checkpoints hold only tensors and plain data)") from None
        good = []
        for other in sorted(ckpt_dir.glob("*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True):
            if other == path:
                continue
            try:
                torch.load(other, map_location="cpu", weights_only=True)
                good.append(other)
                break
            except Exception:
                continue
        hint = f"; resume from the previous good one with ckpt_path={good[0]}" if good else ""
        raise SetupError(f"checkpoint {path} is truncated or corrupt ({type(e).__name__}){hint}") from None
    state = ckpt.get("state_dict") if isinstance(ckpt, dict) else None
    if not state or "global_step" not in ckpt or not all(k.startswith("draft.") for k in state):
        raise SetupError(f"checkpoint {path} is not a draftsmith training checkpoint (no Lightning state of a "
                         "draft): resume from this run's own checkpoints/last.ckpt")
    return str(path)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's torch checkpoint IO, written to a temporary name and renamed: a process killed mid-write leaves
    the previous checkpoint in place, never a truncated one under the real name."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        path = Path(path)
        tmp = path.with_name(f".{path.name}.partial")
        super().save_checkpoint(checkpoint, tmp, storage_options)
        os.replace(tmp, path)
