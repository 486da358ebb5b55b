"""Training data as Lightning sees it: loaders, a resumable epoch order, the data settings refused up front."""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Sampler, TensorDataset

from draftsmith.data.generation import CORPUS_ENGINES
from draftsmith.data.rows import line_count, rows_digest
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.machine import read_json, write_json
from draftsmith.train.launch import Launch, detect, rank0_gone

DATA_RECORD = "data.json"  # in the run directory: the corpus this run trains on, fixed at its first start


def first_rank() -> bool:
    """Rank 0 of the whole job, before any process group exists, however it was launched (train/launch.py)."""
    return detect().first


def prepared_once(out_dir: Path, prepare, timeout_s: float, launch: Launch | None = None,
                  poll_s: float = 2.0) -> dict:
    """The run's corpus, prepared once per run directory. The first rank of a fresh run calls `prepare()` (which
    may sample the target for a time box) and records what it made in OUT_DIR/data.json; every other rank waits for
    that record, at most `timeout_s`, and every resume reads it: all ranks train on the same blocks, and no resume
    samples again."""
    launch = launch or detect()
    record = Path(out_dir) / DATA_RECORD
    if not record.is_file():
        if launch.first:
            write_json(record, prepare())
        else:
            print(f"draftsmith: rank {launch.rank} waits for rank 0 to prepare the corpus ({record})",
                  file=sys.stderr, flush=True)
            deadline = time.monotonic() + timeout_s
            while not record.is_file():
                gone = rank0_gone(launch)
                if gone and not record.is_file():
                    raise DraftsmithError(f"rank {launch.rank}: rank 0 stopped before it prepared the corpus ({record} "
                                          f"never came; its store: {gone}): see rank 0's log")
                if time.monotonic() > deadline:
                    raise DraftsmithError(f"rank {launch.rank} waited {timeout_s / 60:.3g} min for rank 0 to prepare "
                                          f"the corpus ({record} never came): see rank 0's log; a slow preparation "
                                          "needs a larger launch.wait_minutes")
                time.sleep(poll_s)
    data = read_json(record)
    if data is None:
        raise DraftsmithError(f"{record} is not readable JSON: delete it to prepare this run's corpus again")
    if data.get("rows") is not None:
        path = Path(data["source"])
        have = line_count(path) if path.is_file() else 0
        if have < data["rows"] or rows_digest(path, data["rows"]) != data["sha256"]:
            raise DraftsmithError(f"the corpus this run trained on changed: {path} no longer starts with the "
                                  f"{data['rows']} samples recorded in {record}; resume in a new hydra.run.dir")
    return data


def blocks_digest(blocks: dict) -> str:
    """A short hash of the training blocks in order: equal on every rank, and across a resume, or the data differ."""
    return hashlib.sha256(blocks["train"].numpy().tobytes()).hexdigest()[:16]


def loaders(blocks: dict, cfg) -> tuple[DataLoader, DataLoader]:
    d = cfg.data
    rows = torch.arange(len(blocks["train"]))  # each block's index: the key of its kept teacher logits
    train = DataLoader(TensorDataset(blocks["train"], rows), batch_size=d.batch_size, drop_last=True,
                       sampler=EpochOrder(len(blocks["train"]), cfg.seed), num_workers=d.num_workers)
    val = blocks["val"][: d.val_blocks]
    return train, DataLoader(TensorDataset(val), batch_size=d.batch_size, num_workers=d.num_workers)


def _one(items: list):
    return items[0]


def chat_loaders(blocks: dict, cfg) -> tuple[DataLoader, DataLoader]:
    """data=chat: each item is a whole padded batch (data/chat.py `chat_batches`), the batches in an epoch order
    of their own (so DataOrder's resume skips whole batches: its batch size is 1 item)."""
    train = DataLoader(blocks["train"], batch_size=1, collate_fn=_one, drop_last=True,
                       sampler=EpochOrder(len(blocks["train"]), cfg.seed), num_workers=cfg.data.num_workers)
    return train, DataLoader(blocks["val"], batch_size=1, collate_fn=_one, num_workers=cfg.data.num_workers)


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
        g = torch.Generator(device="cpu").manual_seed(self.seed * 1_000_003 + self.epoch)  # the epoch order
        order = torch.randperm(self.n, generator=g, device="cpu").tolist()
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


def check_data(cfg, tokenizer) -> None:
    """Refuse data settings that cannot work, before anything is loaded or written (one line each)."""
    d = cfg.data
    if cfg.checkpoint.monitor == "val/alpha_on_target" and not cfg.sampler.on_target_tokens:
        raise DraftsmithError("checkpoint.monitor=val/alpha_on_target needs its sample set: set "
                              "sampler.on_target_tokens > 0 or monitor another metric (val/alpha, val/alpha_analytic)")
    f = d.on_policy_fraction
    if not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
        raise DraftsmithError(f"data.on_policy_fraction must be in [0, 1] (the share of each batch the draft samples "
                              f"itself), got {f}")
    start = d.get("on_policy_from", 0.0)
    if not isinstance(start, (int, float)) or not 0.0 <= start < 1.0:
        raise DraftsmithError(f"data.on_policy_from must be in [0, 1) (the fraction of training after which on-policy "
                              f"rows start), got {start}")
    if cfg.sampler.get("compile") and cfg.draft.get("kind", "independent") == "feature_head":
        raise DraftsmithError("sampler.compile=true compiles independent drafts; a feature draft validates eagerly: "
                              "set sampler.compile=false")
    if cfg.draft.get("init_from") and cfg.draft.get("kind", "independent") == "feature_head":
        raise DraftsmithError("draft.init_from continues an independent draft; a feature draft cannot start from one")
    if f > 0 and cfg.draft.get("kind", "independent") == "feature_head":
        raise DraftsmithError(f"data.on_policy_fraction={f}: a feature draft cannot sample alone (it reads the "
                              "target's features); use data=generated (the target's own samples) or data=fixed")
    if f > 0 and not cfg.loss.get("distill", True):
        raise DraftsmithError(f"data.on_policy_fraction={f} needs the target's logits on the draft's samples: "
                              "choose a distillation loss (loss=distill_tv, forward_kl, jsd, ...), not loss=ce")
    if f > 0 and round(f * d.batch_size) == 0:
        raise DraftsmithError(f"data.on_policy_fraction={f} of a batch of {d.batch_size} rounds to no row: raise it to "
                              f"at least {0.5 / d.batch_size:.3f} or set it to 0")
    if f > 0 and d.prompt_tokens >= d.block_size:
        raise DraftsmithError(f"data.prompt_tokens ({d.prompt_tokens}) leaves no room for an on-policy continuation in "
                              f"blocks of {d.block_size}: lower it or raise data.block_size")
    if d.chat_template and not getattr(tokenizer, "chat_template", None):
        raise DraftsmithError(f"data.chat_template=true but the target ({cfg.target.name}) has no chat template: "
                              "set data.chat_template=false")
    share = float(d.get("chat_prompts", 0) or 0)
    if share:
        if not 0 < share <= 1:
            raise DraftsmithError(f"data.chat_prompts is the share of English prompts replaced by chat turns, in "
                                  f"(0, 1]; got {share}")
        if not d.prompts or d.chat_template or d.get("format") == "chat":
            raise DraftsmithError("data.chat_prompts replaces raw English prompts of data.prompts with chat turns: "
                                  "give data.prompts (e.g. broad), with data.chat_template=false and data.format=text")
        if not getattr(tokenizer, "chat_template", None):
            raise DraftsmithError(f"data.chat_prompts renders turns through the target's chat template, and "
                                  f"{cfg.target.name} has none: set data.chat_prompts=0")
    topk = cfg.loss.get("teacher_topk", 0)
    if topk and not cfg.loss.get("distill", True):
        raise DraftsmithError(f"loss.teacher_topk={topk} keeps the target's logits for distillation; with loss=ce set "
                              "it to 0")
    if d.get("features", "stored") not in ("stored", "online"):
        raise DraftsmithError(f"data.features must be stored (kept in the store) or online (the target computes them "
                              f"in each step), got {d.features}")
    if d.get("format", "text") not in ("text", "chat"):
        raise DraftsmithError(f"data.format must be text or chat (data=chat), got {d.format}")
    if d.get("format") == "chat":
        if f > 0 or d.generated.enabled:
            raise DraftsmithError("data=chat is its own corpus: set data.on_policy_fraction=0 and leave "
                                  "data.generated.enabled=false")
        if not getattr(tokenizer, "chat_template", None):
            raise DraftsmithError(f"data=chat needs the target's chat template, and {cfg.target.name} has none: use "
                                  "an Instruct target")
    g = d.generated
    if g.enabled or (d.get("format") == "chat" and d.get("regenerate", False)):  # the target samples its corpus
        if g.max_minutes is not None and not g.max_minutes > 0:
            raise DraftsmithError(f"data.generated.max_minutes must be > 0 (or null: no time limit), got "
                                  f"{g.max_minutes}")
        engine = g.get("engine", "draftsmith")
        if engine not in CORPUS_ENGINES:
            raise DraftsmithError(f"data.generated.engine must be {', '.join(CORPUS_ENGINES[:-1])} or "
                                  f"{CORPUS_ENGINES[-1]}, got {engine}")
        if engine != "draftsmith" and cfg.sampler.get("top_k", 0):
            raise DraftsmithError(f"data.generated.engine={engine} samples with temperature and top-p only; with "
                                  f"sampler.top_k={cfg.sampler.top_k} use data.generated.engine=draftsmith")
    if g.enabled:
        budget = g.n_prompts * g.samples_per_prompt * g.max_new_tokens
        if budget < d.batch_size * d.block_size:
            raise DraftsmithError(f"data.generated asks for {budget} new tokens ({g.n_prompts} prompts x "
                                  f"{g.samples_per_prompt} x {g.max_new_tokens}), less than one batch of "
                                  f"{d.batch_size} x {d.block_size}: raise data.generated.n_prompts or max_new_tokens")


