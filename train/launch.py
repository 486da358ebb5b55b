"""Who this process is in a training job, whatever started it, and the one run all its processes share.

Launchers, told apart before any work starts (torchrun first, as Lightning decides, since it also runs inside SLURM):
- torchrun, one node or many (also `srun torchrun ...`): TORCHELASTIC_RUN_ID, RANK, LOCAL_RANK, GROUP_RANK.
- SLURM srun: SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS, in a job step. An sbatch script that runs
  plain `python` carries SLURM_* as well (SLURM_PROCID=0, the allocation's SLURM_NTASKS) but is one process and no
  step; only srun sets SLURM_STEP_ID. Lightning's SLURMEnvironment.detect reads SLURM_NTASKS alone and would make
  that process wait for ranks nobody starts, so Lightning is handed the environment found here
  (`cluster_environment`), and its ranks are ours.
- Lightning's own launcher: `python train/draft.py` with several devices (or nodes, one such process a node, NODE_RANK
  set) spawns the node's other ranks with LOCAL_RANK, NODE_RANK and WORLD_SIZE and hands them its run dir.
- otherwise one process.

The run dir is named by Hydra as each process starts, so processes that a launcher starts on their own (torchrun's,
srun's, Lightning's own parent on each node) would each name another one. Rank 0 of the job names it and the others
learn the name from the job's rendezvous store at MASTER_ADDR:MASTER_PORT: torchrun's agent store, else a store
rank 0 hosts there and keeps, which the process group later reuses (a multi-tenant TCPStore). A name each process
derives from the launcher's ids would need no exchange, but torchrun's run id is "none" unless --rdzv-id is given
(and a reused id would put two jobs in one dir), while every rank reaches that store anyway. The exchange is also
the job's first meeting: rank 0 waits for every rank, each other rank for rank 0, each at most `launch.join_minutes`,
then stops with one line naming who never came, instead of hanging.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

from draftsmith.sampling.errors import DraftsmithError


@dataclass(frozen=True)
class Launch:
    launcher: str  # torchrun | srun | lightning | single
    rank: int
    local_rank: int
    node_rank: int
    world_size: int
    nodes: int
    starters: int  # the processes the launcher started on their own: each names the run dir (Lightning's: one a node)
    starter: int | None  # this process' index among them; None: spawned by Lightning's launcher, handed the run dir

    @property
    def first(self) -> bool:
        return self.rank == 0

    def line(self) -> str:
        return (f"draftsmith: launcher {self.launcher}, rank {self.rank}, local rank {self.local_rank}, "
                f"node {self.node_rank} of {self.nodes}, world size {self.world_size}")

    def who(self) -> str:
        """This process as its launcher counts the processes it starts (Lightning's own: one a node)."""
        return f"node {self.starter}" if self.launcher == "lightning" else f"rank {self.rank}"


def _srun(env) -> bool:
    """A task of an srun step; not an sbatch or salloc shell (no step), nor a job Lightning's convention names
    interactive."""
    return ("SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env
            and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"))


def detect(env=None, devices: int = 1, num_nodes: int = 1) -> Launch:
    """This process' place in the job, from the launcher's variables; `devices` (a node's) and `num_nodes` are the
    trainer's, which only Lightning's own launcher goes by."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" in env:
        world = int(env["WORLD_SIZE"])
        nodes = int(env.get("GROUP_WORLD_SIZE") or max(1, world // int(env.get("LOCAL_WORLD_SIZE") or 1)))
        rank = int(env["RANK"])
        return Launch("torchrun", rank, int(env["LOCAL_RANK"]), int(env.get("GROUP_RANK", 0)), world, nodes, world,
                      rank)
    if _srun(env):
        world, rank = int(env["SLURM_NTASKS"]), int(env["SLURM_PROCID"])
        nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES") or 1)
        return Launch("srun", rank, int(env.get("SLURM_LOCALID", 0)), int(env.get("SLURM_NODEID", 0)), world, nodes,
                      world, rank)
    devices, num_nodes = max(1, int(devices)), max(1, int(num_nodes))
    node = int(env.get("NODE_RANK", env.get("GROUP_RANK", 0)))
    if "LOCAL_RANK" in env:  # a rank Lightning's launcher spawned
        world = int(env.get("WORLD_SIZE", devices * num_nodes))
        local = int(env["LOCAL_RANK"])
        per_node = max(1, world // num_nodes)
        return Launch("lightning", node * per_node + local, local, node, world, num_nodes, num_nodes, None)
    if devices * num_nodes > 1 or node > 0:  # Lightning's launcher will spawn this node's other ranks
        return Launch("lightning", node * devices, 0, node, devices * num_nodes, num_nodes, num_nodes, node)
    return Launch("single", 0, 0, 0, 1, 1, 1, 0)


def devices_per_node(trainer) -> int:
    """A node's devices as the trainer config counts them (`auto`/-1: the visible GPUs of a GPU trainer, else 1)."""
    devices = trainer.get("devices", 1)
    if str(devices) in ("auto", "-1"):
        devices = torch.cuda.device_count() if str(trainer.get("accelerator")) in ("gpu", "cuda", "auto") else 1
    n = len(devices) if not isinstance(devices, (int, str)) else int(devices)
    return max(1, n)


def of_trainer(trainer, env=None) -> Launch:
    return detect(env, devices_per_node(trainer), int(trainer.get("num_nodes", 1) or 1))


def cluster_environment(launch: Launch):
    """The Lightning cluster environment of this launch, so Lightning counts the ranks as we do."""
    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment

    if launch.launcher == "torchrun":
        return TorchElasticEnvironment()
    if launch.launcher == "srun":
        return SLURMEnvironment()
    return LightningEnvironment()


def check_trainer(launch: Launch, devices: int, num_nodes: int) -> None:
    """The trainer's devices and nodes against the processes torchrun or srun started, by Lightning's own rule,
    before any work (Lightning would find the mismatch only when the trainer is built, after the corpus)."""
    if launch.launcher in ("torchrun", "srun"):
        try:
            cluster_environment(launch).validate_settings(num_devices=devices, num_nodes=num_nodes)
        except ValueError as e:
            raise DraftsmithError(f"{launch.who()} ({launch.launcher}): {e}") from None


def _address(launch: Launch) -> tuple[str, int]:
    """Where the job's rendezvous store is: the address and port the process group will use."""
    if launch.launcher == "srun":  # Lightning's rule (the first node of the step, a port from the job id)
        env = cluster_environment(launch)
        return env.main_address, env.main_port
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise DraftsmithError(f"{launch.who()} of {launch.starters} ({launch.launcher}): set MASTER_ADDR and "
                              "MASTER_PORT alike on every node (rank 0's host and a free port), and NODE_RANK on each")
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


_STORES: dict = {}  # held for the process' life: rank 0's server is the one its process group reuses


def _store(launch: Launch, timeout_s: float):
    from torch.distributed import TCPStore

    addr, port = _address(launch)
    if (addr, port) in _STORES:
        return _STORES[addr, port], addr, port
    agent = launch.launcher == "torchrun" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        store = TCPStore(addr, port, world_size=launch.starters, is_master=launch.starter == 0 and not agent,
                         timeout=timedelta(seconds=timeout_s), multi_tenant=True, wait_for_workers=False)
    except RuntimeError as e:  # no one listening within the timeout, or rank 0 cannot listen there
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if launch.starter == 0 and not agent:
            raise DraftsmithError(f"{launch.who()} ({launch.launcher}) cannot host the job's rendezvous at "
                                  f"{addr}:{port} ({why}): set MASTER_PORT to a free port") from None
        raise DraftsmithError(f"{launch.who()} ({launch.launcher}) found no rank 0 at {addr}:{port} within "
                              f"{timeout_s:.0f} s ({why}): start rank 0, or raise launch.join_minutes") from None
    _STORES[addr, port] = store
    return store, addr, port


_REFUSED = "\0refused: "  # rank 0's answer when the processes disagree: each of them stops with its line


def agree(launch: Launch, name: str, value: str, timeout_s: float, same: str | None = None) -> str:
    """Rank 0's `value` of `name`, known to every process the launcher started on its own once all have met (a
    barrier); each waits at most `timeout_s`, then stops with one line saying who never came and where. With `same`
    (what to do about it), every process must bring rank 0's value, or all stop with one line naming who differs."""
    if launch.starter is None or launch.starters == 1:
        return value
    store, addr, port = _store(launch, timeout_s)
    key = f"draftsmith/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}"  # the agent store outlives restarts
    where = f"{addr}:{port} ({launch.launcher})"
    deadline = time.monotonic() + timeout_s
    try:
        store.set(f"{key}/{launch.starter}", value)
        store.add(f"{key}/joined", 1)
        if launch.starter == 0:
            while store.add(f"{key}/joined", 0) < launch.starters:
                if time.monotonic() > deadline:
                    missing = [r for r in range(launch.starters) if not store.check([f"{key}/{r}"])]
                    unit = "nodes" if launch.launcher == "lightning" else "ranks"
                    raise DraftsmithError(f"{launch.who()}: {unit} {', '.join(map(str, missing))} of {launch.starters} "
                                          f"never joined at {where} within {timeout_s:.0f} s: start them (the same "
                                          "command on every node), or raise launch.join_minutes")
                time.sleep(0.05)
            other = [(r, v) for r in range(1, launch.starters) if (v := store.get(f"{key}/{r}").decode()) != value]
            if same and other:
                r, v = other[0]
                refused = (f"{launch.launcher} {launch.who().split()[0]} {r} has {name} {v}, rank 0 {value}"
                           f"{f' (and {len(other) - 1} more)' if len(other) > 1 else ''}: {same}")
                store.set(key, _REFUSED + refused)
                raise DraftsmithError(refused)
            store.set(key, value)
            return value
        store.wait([key], timedelta(seconds=max(0.1, deadline - time.monotonic())))
        answer = store.get(key).decode()
        if answer.startswith(_REFUSED):
            raise DraftsmithError(answer.removeprefix(_REFUSED))
        return answer
    except DraftsmithError:
        raise
    except RuntimeError as e:  # a wait that timed out, or rank 0's store gone
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DraftsmithError(f"{launch.who()}: rank 0 never answered at {where} within {timeout_s:.0f} s ({why}): "
                              "see rank 0's log, or raise launch.join_minutes") from None


def rank0_gone(launch: Launch) -> str | None:
    """Why rank 0 is known to have stopped (the job's store, hosted by rank 0 or torchrun's agent beside it, is
    gone), or None: a wait for rank 0 need not run to its timeout once it has failed."""
    if launch.starter in (None, 0) or launch.starters == 1 or not _STORES:
        return None
    try:
        next(iter(_STORES.values())).check(["draftsmith/alive"])
    except RuntimeError as e:
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return None


_RUN_NAME: list[str] = []


def run_name(launch, timeout_s: float) -> str:
    """The default run dir's name (date/time-pid), rank 0's, decided once per process (Hydra resolves it again
    later, where the trainer settings `launch()` reads are out of its reach)."""
    if not _RUN_NAME:
        _RUN_NAME.append(agree(launch(), "run_name", time.strftime("%Y-%m-%d/%H-%M-%S") + f"-{os.getpid()}",
                               timeout_s))
    return _RUN_NAME[0]
