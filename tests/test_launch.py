"""One run for every process of a job, however it is launched: torchrun (two "nodes" on this host), a simulated
srun, Lightning's own launcher; launchers told apart from their variables; every wait bounded by a timeout."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from draftsmith.sampling.errors import DraftsmithError
from draftsmith.train.launch import Launch, agree, cluster_environment, detect

LAUNCH_VARS = ("SLURM_", "TORCHELASTIC_", "MASTER_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_",
               "LOCAL_WORLD_SIZE", "ROLE_", "PL_")
DIGEST = re.compile(r"rank (\d+) trains on (\d+) blocks of (\S+), sha256 (\w+)")


def clean_env(**extra) -> dict:
    """This process' environment without any launcher's variables (pytest may itself run inside one), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARS)}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline", **extra)
    return env


def free_port(lo: int = 20000, hi: int = 30000) -> int:
    for port in range(lo + os.getpid() % 997, hi):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def srun_env(rank: int, tasks: int, port: int, **extra) -> dict:
    """The variables srun sets for task `rank` of a `tasks`-task step, one task a node, on this host (Lightning's
    SLURMEnvironment takes the first node of SLURM_NODELIST as MASTER_ADDR and 15000 + the job id's last 4 digits
    as MASTER_PORT)."""
    assert 15000 <= port < 25000
    return clean_env(SLURM_JOB_ID=f"7{port - 15000:04d}", SLURM_JOB_NAME="draft", SLURM_STEP_ID="0",
                     SLURM_NTASKS=str(tasks), SLURM_NTASKS_PER_NODE="1", SLURM_NNODES=str(tasks),
                     SLURM_STEP_NUM_NODES=str(tasks), SLURM_NODELIST="127.0.0.1", SLURM_PROCID=str(rank),
                     SLURM_LOCALID="0", SLURM_NODEID=str(rank), **extra)


# ---- the launchers, told apart (env in, ranks out) -------------------------------------------------------------

TORCHRUN = dict(TORCHELASTIC_RUN_ID="none", RANK="3", LOCAL_RANK="1", GROUP_RANK="1", WORLD_SIZE="4",
                LOCAL_WORLD_SIZE="2", GROUP_WORLD_SIZE="2", MASTER_ADDR="n0", MASTER_PORT="29500")
SRUN = dict(SLURM_JOB_ID="1234", SLURM_JOB_NAME="train", SLURM_STEP_ID="0", SLURM_NTASKS="8",
            SLURM_NTASKS_PER_NODE="4", SLURM_NNODES="2", SLURM_PROCID="5", SLURM_LOCALID="1", SLURM_NODEID="1")
SBATCH = dict(SLURM_JOB_ID="1234", SLURM_JOB_NAME="train", SLURM_NTASKS="8", SLURM_NTASKS_PER_NODE="4",
              SLURM_NNODES="2", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0")  # the batch script: no step


@pytest.mark.parametrize("env, devices, nodes, want", [
    ({}, 1, 1, Launch("single", 0, 0, 0, 1, 1, 1, 0)),
    (TORCHRUN, 2, 2, Launch("torchrun", 3, 1, 1, 4, 2, 4, 3)),
    ({**SRUN, **TORCHRUN}, 2, 2, Launch("torchrun", 3, 1, 1, 4, 2, 4, 3)),  # srun torchrun: torchrun's ranks
    (SRUN, 4, 2, Launch("srun", 5, 1, 1, 8, 2, 8, 5)),
    # an sbatch script running plain python: one process, whatever SLURM_NTASKS says (Lightning would wait for 8)
    (SBATCH, 1, 1, Launch("single", 0, 0, 0, 1, 1, 1, 0)),
    (SBATCH, 2, 1, Launch("lightning", 0, 0, 0, 2, 1, 1, 0)),  # ...or Lightning's own launcher inside it
    ({**SRUN, "SLURM_JOB_NAME": "interactive"}, 1, 1, Launch("single", 0, 0, 0, 1, 1, 1, 0)),  # Lightning's opt-out
    # Lightning's own launcher: the parent on node 1 of 2 (4 devices a node), and a rank it spawned there
    (dict(NODE_RANK="1", MASTER_ADDR="n0", MASTER_PORT="1"), 4, 2, Launch("lightning", 4, 0, 1, 8, 2, 2, 1)),
    ({**SBATCH, "LOCAL_RANK": "3", "NODE_RANK": "1", "WORLD_SIZE": "8"}, 4, 2,
     Launch("lightning", 7, 3, 1, 8, 2, 2, None)),
])
def test_launchers_are_told_apart_from_their_variables(env, devices, nodes, want):
    assert detect(env, devices, nodes) == want


def test_rank_0_alone_prepares_and_claims_under_every_launcher(monkeypatch, tmp_path):
    """srun's rank 5 and torchrun's rank 3 are not rank 0: they neither prepare the corpus nor claim the run dir
    (both used to read RANK/LOCAL_RANK/NODE_RANK only, so every srun task was rank 0)."""
    from draftsmith.train.data import first_rank
    from draftsmith.train.rundir import claim_run_dir

    for k in list(os.environ):
        if k.startswith(LAUNCH_VARS):
            monkeypatch.delenv(k)
    for env in (SRUN, TORCHRUN):
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            assert not first_rank()
            claim_run_dir(tmp_path)
            assert not (tmp_path / ".run.lock").exists()


def test_lightning_is_handed_the_environment_we_detected(monkeypatch):
    """An sbatch script (2 tasks a node) running plain python with trainer.devices=2: Lightning alone picks
    SLURMEnvironment, which says the processes are started outside, so it starts no second rank and the first waits
    for one nobody starts; with the environment we detected its own launcher starts it. Under srun and torchrun
    Lightning is handed theirs."""
    import lightning as L
    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

    for k in list(os.environ):
        if k.startswith(LAUNCH_VARS):
            monkeypatch.delenv(k)
    for k, v in {**SBATCH, "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1"}.items():
        monkeypatch.setenv(k, v)
    kw = dict(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False)
    alone = L.Trainer(**kw)
    assert isinstance(alone.strategy.cluster_environment, SLURMEnvironment)
    assert alone.strategy.cluster_environment.creates_processes_externally  # so its launcher starts no rank 1
    ours = L.Trainer(**kw, plugins=[cluster_environment(detect(devices=2))])
    assert isinstance(ours.strategy.cluster_environment, LightningEnvironment)
    assert not ours.strategy.cluster_environment.creates_processes_externally  # its launcher starts rank 1
    assert isinstance(ours.strategy.launcher, _SubprocessScriptLauncher) and ours.world_size == 2
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert isinstance(cluster_environment(detect()), SLURMEnvironment)
    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)
    assert isinstance(cluster_environment(detect()), TorchElasticEnvironment)


# ---- the rendezvous: one answer for all, and a rank that never comes --------------------------------------------

AGREE = """
import os, sys
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.train.launch import agree, detect
try:
    print("agreed", agree(detect(), "x", sys.argv[1], float(sys.argv[2]), same=sys.argv[3] or None), flush=True)
except DraftsmithError as e:
    print("error:", e, flush=True)
"""


def _agree(rank, tasks, port, value, timeout=60, same=""):
    return subprocess.Popen([sys.executable, "-c", AGREE, value, str(timeout), same], env=srun_env(rank, tasks, port),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


@pytest.mark.slow  # among the longest (11-14 s): the default suite stays under its 12 minutes
def test_every_rank_learns_rank_0s_answer_and_a_disagreement_stops_them_all():
    agreeing, refusing = free_port(15000, 20000), free_port(20000, 25000)
    procs = [_agree(1, 2, agreeing, "v1"), _agree(0, 2, agreeing, "v0"),  # rank 1 first: it waits for rank 0
             *(_agree(r, 2, refusing, f"v{r}", same="give each the same") for r in (0, 1))]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert outs == ["agreed v0"] * 2 + ["error: srun rank 1 has x v1, rank 0 v0: give each the same"] * 2, outs


@pytest.mark.slow  # among the longest: the default suite stays under its 12 minutes
def test_a_rank_that_never_comes_stops_the_others_with_one_line():
    """Rank 0 of a 2-task step alone, then rank 1 alone: each stops after its timeout saying who it waited for and
    where, instead of hanging (the test's own timeout only guards against a hang)."""
    port = free_port(15000, 25000)
    out = _agree(0, 2, port, "a", timeout=3).communicate(timeout=120)[0].strip()
    assert out == f"error: rank 0: ranks 1 of 2 never joined at 127.0.0.1:{port} (srun) within 3 s: start them " \
                  "(the same command on every node), or raise launch.join_minutes", out
    out = _agree(1, 2, port, "b", timeout=3).communicate(timeout=120)[0].strip()
    assert out.startswith(f"error: rank 1 (srun) found no rank 0 at 127.0.0.1:{port} within 3 s (") and \
        out.endswith("): start rank 0, or raise launch.join_minutes"), out


def test_a_single_process_agrees_with_itself_without_a_store():
    assert agree(detect({}), "x", "mine", 0.01) == "mine"
    with pytest.raises(DraftsmithError, match="set MASTER_ADDR and MASTER_PORT alike on every node"):
        agree(Launch("lightning", 0, 0, 0, 2, 2, 2, 0), "x", "mine", 0.01)


@pytest.mark.slow  # among the longest (11-14 s): the default suite stays under its 12 minutes
def test_a_training_rank_that_never_comes_stops_rank_0_before_any_work(tmp_path):
    """`python train/draft.py` as rank 0 of a 2-task srun step whose rank 1 never starts: one error line within
    launch.join_minutes, and no run dir made (the rendezvous names it)."""
    port = free_port(15000, 25000)
    res = subprocess.run([sys.executable, str(ROOT / "train" / "draft.py"), "recipe=smoke", "trainer=ddp",
                          "trainer.devices=1", "trainer.num_nodes=2", "launch.join_minutes=0.05"],
                         env=srun_env(0, 2, port, DRAFTSMITH_HOME=str(tmp_path / "home")), cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: rank 0: ranks 1 of 2 never joined at 127.0.0.1:{port} (srun) within 3 s: start them (the same "
        "command on every node), or raise launch.join_minutes"), res.stderr[-2000:]
    assert not (tmp_path / "outputs").exists()


def test_the_corpus_wait_has_a_timeout(tmp_path):
    from draftsmith.sampling.errors import DraftsmithError
    from draftsmith.train.data import prepared_once

    with pytest.raises(DraftsmithError, match=r"^rank 1 waited 0.0005 min for rank 0 to prepare the corpus "
                                              r"\(.*data.json never came\): see rank 0's log; a slow preparation "
                                              r"needs a larger launch.wait_minutes$"):
        prepared_once(tmp_path, lambda: {}, 0.03, Launch("srun", 1, 0, 1, 2, 2, 2, 1), poll_s=0.01)


WAIT = """
import sys
from pathlib import Path
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.train.data import prepared_once
from draftsmith.train.launch import agree, detect
launch = detect()
agree(launch, "start", "", 60)
if launch.first:
    sys.exit(3)  # fails before it prepares anything
try:
    prepared_once(Path(sys.argv[1]), None, 600, launch, poll_s=0.2)
except DraftsmithError as e:
    print("error:", e, flush=True)
"""


def test_the_corpus_wait_ends_when_rank_0_is_gone(tmp_path):
    """Rank 0 fails after the job met and before the corpus: rank 1 stops with one line once rank 0's store is gone,
    long before its 10 min wait would end (the test's own timeout only guards against a hang)."""
    port = free_port(15000, 25000)
    procs = [subprocess.Popen([sys.executable, "-c", WAIT, str(tmp_path)], env=srun_env(r, 2, port),
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert procs[0].returncode == 3
    assert re.fullmatch(rf"error: rank 1: rank 0 stopped before it prepared the corpus \({tmp_path}/data.json never "
                        r"came; its store: .+\): see rank 0's log", outs[1]), outs[1]


# ---- whole runs: two "nodes" on this host -------------------------------------------------------------------------

# a time box of 3 s, ending after the batch that crosses it: one batch of 32 samples at least (enough blocks however
# slow the machine), never the 4000 asked for
GENERATED = ("recipe=smoke", "data=generated", "data.generated.n_prompts=40", "data.generated.samples_per_prompt=100",
             "data.generated.max_new_tokens=48", "data.generated.batch_size=32", "data.generated.max_minutes=0.05",
             "trainer=ddp", "trainer.devices=1", "trainer.num_nodes=2", "logger=csv")


def _two_node_run(tmp_path, commands) -> Path:
    """Start each (command, env) from one working directory (each "node" with its own DRAFTSMITH_HOME), wait for
    all; check: all exit 0, one run dir, one corpus in it that neither node-local home holds, identical blocks."""
    work = tmp_path / "work"
    work.mkdir()
    logs = [tmp_path / f"node{i}.log" for i in range(len(commands))]
    procs = [subprocess.Popen(cmd, env=env, cwd=work, stdout=log.open("w"), stderr=subprocess.STDOUT)
             for (cmd, env), log in zip(commands, logs)]
    try:
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:
            p.kill()
    outs = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n=====\n".join(o[-3000:] for o in outs)
    runs = [p.parent for p in (work / "outputs").rglob("data.json")]
    assert len(runs) == 1 and len(list((work / "outputs").glob("*/*"))) == 1, runs
    run = runs[0]
    assert (run / "report.json").is_file()
    corpus = list((run / "corpus" / "generated").glob("*.jsonl"))
    assert len(corpus) == 1 and json.loads((run / "data.json").read_text())["source"] == str(corpus[0])
    for i in (0, 1):
        assert not (tmp_path / f"home{i}" / "generated").exists()  # node-local: no other node would see it
    ranks = {r: (n, src, h) for out in outs for r, n, src, h in DIGEST.findall(out)}
    assert set(ranks) == {"0", "1"} and ranks["0"] == ranks["1"] and ranks["0"][1] == str(corpus[0]), ranks
    assert outs[0].count("min spent (data.generated.max_minutes)") == 1 and "max_minutes" not in outs[1]
    assert f"beside the corpus in {corpus[0].parent}\n" in outs[0]  # where it is, not rank 0's node-local home
    for i, out in enumerate(outs):  # what each node said of itself and of its blocks (pytest -s shows it)
        print(f"node {i}:", *(ln for ln in out.splitlines() if ln.startswith("draftsmith: launcher")
                              or " trains on " in ln), sep="\n  ")
    return run, outs


@pytest.mark.slow
def test_torchrun_on_two_nodes_makes_one_run(tmp_path):
    """`torchrun --nnodes 2 --nproc-per-node 1 --node-rank R` started twice, no hydra.run.dir: rank 0 names the run
    dir and both train in it on one corpus sampled once (each rank used to name its own dir and rank 1 waited for a
    data.json there forever)."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--master-addr",
           "127.0.0.1", "--master-port", str(port)]
    commands = [([*cmd, "--node-rank", str(i), str(ROOT / "train" / "draft.py"), *GENERATED],
                 clean_env(DRAFTSMITH_HOME=str(tmp_path / f"home{i}"))) for i in (0, 1)]
    _, outs = _two_node_run(tmp_path, commands)
    assert "draftsmith: launcher torchrun, rank 1, local rank 0, node 1 of 2, world size 2" in outs[1]
    assert "distributed_backend=gloo" in outs[0]


@pytest.mark.slow
def test_srun_on_two_nodes_makes_one_run(tmp_path):
    """The same as two srun tasks, one a node (SLURM's variables, no MASTER_*): ranks from SLURM_PROCID, not all 0."""
    port = free_port(15000, 25000)
    commands = [([sys.executable, str(ROOT / "train" / "draft.py"), *GENERATED],
                 srun_env(i, 2, port, DRAFTSMITH_HOME=str(tmp_path / f"home{i}"))) for i in (0, 1)]
    _, outs = _two_node_run(tmp_path, commands)
    assert "draftsmith: launcher srun, rank 1, local rank 0, node 1 of 2, world size 2" in outs[1]


@pytest.mark.slow
def test_lightnings_own_launcher_on_two_nodes_makes_one_run(tmp_path):
    """Lightning's own launcher on two nodes (MASTER_ADDR, MASTER_PORT and NODE_RANK on each): its parent on every
    node used to name a run dir of its own."""
    port = free_port()
    commands = [([sys.executable, str(ROOT / "train" / "draft.py"), *GENERATED],
                 clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(i),
                           DRAFTSMITH_HOME=str(tmp_path / f"home{i}"))) for i in (0, 1)]
    _, outs = _two_node_run(tmp_path, commands)
    assert "draftsmith: launcher lightning, rank 1, local rank 0, node 1 of 2, world size 2" in outs[1]


def test_a_trainer_unlike_the_launch_is_refused_before_any_work(monkeypatch):
    """torchrun started 4 processes on 2 nodes; trainer.devices=1 x num_nodes=1 is refused at the start, in
    Lightning's own words (it found it only when the trainer was built, after the corpus was sampled)."""
    from draftsmith.train.launch import check_trainer

    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)
    launch = detect()
    check_trainer(launch, 2, 2)
    with pytest.raises(DraftsmithError, match=r"^rank 3 \(torchrun\): .*devices=1.*num_nodes=1.* does not match the "
                                          r"world size \(4\)"):
        check_trainer(launch, 1, 1)


def test_where_the_corpus_lives_and_how_long_ranks_wait_for_it(tmp_path):
    """One node: $DRAFTSMITH_HOME (cached across runs); several: the run dir every node reads, unless data.cache_dir
    names shared storage. The corpus wait covers the sampling time box."""
    from omegaconf import OmegaConf

    from draftsmith.sampling.machine import cache_home
    from draftsmith.train.prepare import corpus_dir, corpus_wait_s

    cfg = OmegaConf.create({"data": {"cache_dir": None, "generated": {"enabled": True, "max_minutes": 30}},
                            "launch": {"wait_minutes": 60}})
    one, two = Launch("single", 0, 0, 0, 1, 1, 1, 0), Launch("srun", 0, 0, 0, 2, 2, 2, 0)
    assert corpus_dir(cfg, tmp_path, one) == cache_home()
    assert corpus_dir(cfg, tmp_path, two) == tmp_path / "corpus"
    cfg.data.cache_dir = str(tmp_path / "shared")
    assert corpus_dir(cfg, tmp_path, two) == corpus_dir(cfg, tmp_path, one) == tmp_path / "shared"
    assert corpus_wait_s(cfg) == 90 * 60
    cfg.data.generated.enabled = False
    assert corpus_wait_s(cfg) == 60 * 60
