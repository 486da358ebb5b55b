"""vLLM's processes end with the run that started them, however it ends (engines/process_tree.py), in the trainer's
corpus engine (`engines.vllm.batches`) and in deploy_check's (`VllmEngine`). Here a stand-in for vLLM's python runs the
real guard and a fake worker that, as vLLM's does, starts an engine process of its own and leaves it running: a
worker killed alone leaves it behind. The same endings with vLLM itself: tests/test_engines.py."""

import json
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from helpers import processes_after, processes_of

from draftsmith.sampling.errors import DraftsmithError
from draftsmith.engines.vllm import batches as vllm_batches


class Check:
    """A stand-in for EngineCheck: passes, or refuses the engine (`refuse`)."""

    request = {"prompt": [1, 2], "n": 4, "seed": 0}

    def __init__(self, refuse: bool = False):
        self.refuse = refuse

    def __call__(self, samples, version):
        if self.refuse:
            raise DraftsmithError("planted: the check refuses the engine")


def _corpus(target, check, **kw):
    import torch

    return list(vllm_batches(str(target), torch.float32, [[1, 2], [3, 4], [5, 6]], 2, seed=0, first_row=0,
                             max_new_tokens=2, temperature=1.0, top_p=1.0, eos=0, check=check, timeout_s=120, **kw))


def _deploy(target):
    from draftsmith.engines.vllm import VllmEngine

    return VllmEngine(SimpleNamespace(target_dir=target, path=target), timeout_s=120).run([], speculative=False)


@pytest.mark.parametrize("which", ["corpus", "deploy"])
def test_the_engines_process_tree_ends_with_the_run_done_or_failed(fake_vllm, monkeypatch, which):
    """The run's work done, then an error: no process of the engine's is left after either (before process_tree,
    the engine's own process outlived both, and deploy_check waited on its open pipe until its timeout)."""

    for key, value in fake_vllm.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("FAKE_VLLM", "exit")
    done = _corpus(fake_vllm.target, Check()) if which == "corpus" else _deploy(fake_vllm.target)
    assert done == [] if which == "deploy" else [b[2] for b in done] == [[[5, 6], [5, 6]], [[5, 6]]]
    left = processes_after(fake_vllm.marker)
    assert left == [], f"{len(left)} process(es) of the engine outlived the run's success: {left}"
    if which == "corpus":
        with pytest.raises(DraftsmithError, match="planted"):
            _corpus(fake_vllm.target, Check(refuse=True))
    else:
        monkeypatch.setenv("FAKE_VLLM", "fail")
        with pytest.raises(DraftsmithError, match="planted failure"):
            _deploy(fake_vllm.target)
    left = processes_after(fake_vllm.marker)
    assert left == [], f"{len(left)} process(es) of the engine outlived the run's error: {left}"


RUN = {  # a run that uses the engine, in a process of its own, until a signal ends it
    "corpus": """
import sys, torch
from draftsmith.engines.vllm import batches as vllm_batches
class Check:
    request = {"prompt": [1, 2], "n": 4, "seed": 0}
    def __call__(self, samples, version):
        pass
list(vllm_batches(sys.argv[1], torch.float32, [[1, 2]], 1, seed=0, first_row=0, max_new_tokens=2, temperature=1.0,
                  top_p=1.0, eos=0, check=Check(), timeout_s=120))
""",
    "deploy": """
import sys
from pathlib import Path
from types import SimpleNamespace
from draftsmith.engines.vllm import VllmEngine
VllmEngine(SimpleNamespace(target_dir=Path(sys.argv[1])), timeout_s=120).run([], speculative=False)
""",
}


def _wait_for_tree(run, marker: str, timeout_s: float = 180) -> None:
    """Until the run, the guard, the worker and its engine process are all up (the run imports torch first)."""
    t_end = time.monotonic() + timeout_s
    while len(processes_of(marker)) < 4:
        assert run.poll() is None, f"the run ended early: {run.communicate()[1][-2000:]}"
        assert time.monotonic() < t_end, f"the fake engine did not start: {processes_of(marker)}"
        time.sleep(0.1)


@pytest.mark.parametrize("which, sig", [("corpus", signal.SIGINT), ("corpus", signal.SIGKILL),
                                        ("deploy", signal.SIGINT)])
def test_the_engines_process_tree_ends_with_the_run_interrupted(fake_vllm, which, sig):
    """Ctrl-C (SIGINT to the run alone, as `kill -INT` sends it) and a run killed outright (SIGKILL: no `finally`
    runs; the guard sees its parent gone): no process of the engine's is left. Before process_tree the engine's
    own process outlived Ctrl-C, and the worker too outlived SIGKILL."""
    env = dict(fake_vllm.env, FAKE_VLLM="hang")
    # Ctrl-C as a terminal delivers it: a shell's background job (`pytest ... &`) ignores SIGINT and its children
    # inherit that, so the run is given the default back
    run = subprocess.Popen([sys.executable, "-c", RUN[which], str(fake_vllm.target)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _wait_for_tree(run, fake_vllm.marker)
    run.send_signal(sig)
    _, err = run.communicate(timeout=120)
    assert run.returncode != 0 and (sig != signal.SIGINT or "KeyboardInterrupt" in err), err[-2000:]
    left = processes_after(fake_vllm.marker)
    assert left == [], f"{len(left)} process(es) of the engine outlived the run ({sig.name}): {left}"

def test_the_request_carries_vllms_share_of_the_gpu(fake_vllm, monkeypatch):
    """vLLM starts first on a GPU and takes data.generated.gpu_memory_utilization of it, leaving the rest to the
    target that loads beside it: the setting reaches the worker's request (and through it LLM(...))."""
    for key, value in fake_vllm.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("FAKE_VLLM", "exit")
    monkeypatch.setenv("FAKE_VLLM_REQUEST", str(fake_vllm.tmp / "request.json"))
    batches = list(vllm_batches(str(fake_vllm.target), __import__("torch").bfloat16, [[1, 2]], 1, seed=0,
                                first_row=0, max_new_tokens=2, temperature=1.0, top_p=1.0, eos=0,
                                gpu_memory_utilization=0.35, tensor_parallel_size=1))
    assert [b[2] for b in batches] == [[[5, 6]]]
    request = json.loads((fake_vllm.tmp / "request.json").read_text())
    assert request["gpu_memory_utilization"] == 0.35 and request["dtype"] == "bfloat16"
    assert request["tensor_parallel_size"] == 1
    assert processes_after(fake_vllm.marker) == []
    with pytest.raises(DraftsmithError, match=r"gpu_memory_utilization must be in \(0, 1\], got 1.5"):
        next(vllm_batches(str(fake_vllm.target), __import__("torch").float32, [[1, 2]], 1, seed=0, first_row=0,
                          max_new_tokens=2, temperature=1.0, top_p=1.0, eos=0, gpu_memory_utilization=1.5))
