"""A helper process whose whole tree ends with the run that started it: vLLM's worker
(`engines/workers/vllm_corpus.py`, `vllm_judge.py`) starts an EngineCore process, which starts its Workers;
killing the worker alone leaves them behind, re-parented to init, spinning at 100% CPU (on a GPU, holding its memory
for the next run).

`start` runs the command under a small guard (standard library only: it runs in vLLM's own venv) in a session and
process group of its own, so that
- `stop`, which the caller runs on every way out (success, an error, Ctrl-C: KeyboardInterrupt unwinds through its
  `finally`), kills the whole group at once;
- a run killed outright (SIGKILL, the OOM killer, a scheduler's SIGTERM: no `finally` runs) still takes the tree
  with it: the guard sees its parent gone within half a second and kills the group;
- Ctrl-C in a terminal reaches the run alone (the group is not the terminal's foreground group), which then stops
  the tree in order, instead of vLLM's processes each dying mid-work with a traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess

# argv: the run's pid, then the command. The guard starts the command, waits for it and exits with its status;
# if the run that started it is gone, it kills its own process group (itself, the command, all they started).
_GUARD = """
import os, signal, subprocess, sys
run, cmd = int(sys.argv[1]), sys.argv[2:]
child = subprocess.Popen(cmd)
while True:
    try:
        code = child.wait(timeout=0.5)
        break
    except subprocess.TimeoutExpired:
        if os.getppid() != run:
            os.killpg(0, signal.SIGKILL)
sys.exit(code if code >= 0 else 128 - code)
"""


def start(cmd: list[str], **popen_kwargs) -> subprocess.Popen:
    """`cmd` (its first item a python) under the guard, in a new session; the returned process is the guard,
    whose exit status is the command's, and whose pid is the process group's id."""
    return subprocess.Popen([cmd[0], "-c", _GUARD, str(os.getpid()), *cmd], start_new_session=True, **popen_kwargs)


def stop(proc: subprocess.Popen) -> None:
    """Kill `proc`'s whole process group (the command and every process it started) and reap the guard."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # every member already gone
        pass
    proc.wait()
