"""llama.cpp: its install, where it lives, how it is started and its quirks, for the deploy judge (`LlamaCppEngine`).

- Install: `draftsmith engines install llamacpp` (`install`): `llama-server` and the GGUF converter from the
  llama-cpp-python VERSION sdist on PyPI (it vendors both; no model hub needed), built once into
  $DRAFTSMITH_HOME/engines/llamacpp with cmake (about 11 minutes on 2 cores); the converter runs in draftsmith's env
  and needs sentencepiece there.
- Launch: `llama-server -m target.gguf [-md draft.gguf]` on a free local port, one request per sample, both models
  converted to GGUF by its own converter (f32, so the judge's fp32 probabilities are the engine's), cached by hash.
- Feature drafts (EAGLE-3): the vendored converter (llama.cpp's PR #18039, "add EAGLE3 speculative decoding
  support", in llama-cpp-python 0.3.36's tree) turns the bundle's `LlamaForCausalLMEagle3` draft, `d2t` included,
  into an EAGLE3 GGUF given `--target-model-dir`; the server runs it with `--spec-type draft-eagle3`, reading the
  target layers the draft's config names (`eagle_aux_hidden_state_layer_ids`; each the input of that layer, as
  ours and vLLM's). A build without it is refused in one line (`eagle3_missing`).
- Batching: `Job.batched` requests go to the server at once, on `-np B` slots (continuous batching), each slot
  with its own draft state.
- Quirks: without `--spec-type draft-simple` the server loads the draft and never drafts; its sampler chain must be
  set to HF's order (temperature, then top-p) with min-p and top-k off to sample the same distribution.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from draftsmith.engines.base import Engine, Output
from draftsmith.sampling.cli import engine_k
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.machine import cache_home, files_sha256

VERSION = "0.3.36"
INSTALL = "draftsmith engines install llamacpp"
# the llama.cpp change that brought EAGLE-3 (PR #18039, merged into ggml-org/llama.cpp) and a tree known to have it
# (llama-cpp-python 0.3.36 vendors ggml-org/llama.cpp@0c1e57098, its CHANGELOG): what a refusal names
EAGLE3_SINCE = ("llama.cpp with PR #18039 (EAGLE-3), e.g. ggml-org/llama.cpp@0c1e57098 as vendored by "
                "llama-cpp-python 0.3.36")


def home() -> Path:
    """Where `install` builds it: DRAFTSMITH_LLAMACPP, else $DRAFTSMITH_HOME/engines/llamacpp."""
    return Path(os.environ.get("DRAFTSMITH_LLAMACPP", cache_home() / "engines" / "llamacpp"))


def missing() -> str | None:
    """Why llama.cpp cannot run here (one line with the fix), or None: the server binary, the vendored GGUF converter
    and the sentencepiece it imports must all be present; a built llama.cpp in a fresh venv lacks the last."""
    where = home()
    if not ((where / "bin" / "llama-server").is_file() and (where / "src" / "convert_hf_to_gguf.py").is_file()):
        return (f"llama.cpp is not built ({where / 'bin' / 'llama-server'} missing): run `{INSTALL}` "
                "(builds it from the llama-cpp-python sdist, several minutes on 2 cores)")
    try:
        import sentencepiece  # noqa: F401  (the converter imports it for every Llama)
    except ImportError:
        return f"llama.cpp's GGUF converter needs sentencepiece: run `{INSTALL}` in this venv"
    return None


def install() -> Path:
    """Build llama.cpp's server from the llama-cpp-python VERSION sdist into `home()` and install sentencepiece for
    its converter; nothing is built when both are there. Returns the folder."""
    where = home()
    if missing() is None:
        print(f"llama.cpp already built in {where}")
        return where
    server = where / "bin" / "llama-server"
    if not (server.is_file() and (where / "src" / "convert_hf_to_gguf.py").is_file()):
        for tool in ("cmake", "c++"):
            if shutil.which(tool) is None:
                raise DraftsmithError(f"building llama.cpp needs {tool}, which is not on PATH: install it (e.g. "
                                      "apt install cmake g++) and run this again")
        dl = where / "dl"
        dl.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps",
              f"llama-cpp-python=={VERSION}", "-d", str(dl)], f"downloading the llama-cpp-python {VERSION} sdist")
        for old in ("src", "build"):
            shutil.rmtree(where / old, ignore_errors=True)
        with tarfile.open(dl / f"llama_cpp_python-{VERSION}.tar.gz") as tar:
            # the safe filter where this Python has it (3.10.12+, 3.11.4+): nothing outside dl/, no links out
            tar.extractall(dl, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        shutil.move(dl / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp", where / "src")
        # no curl/openssl (models come from disk); static libs so bin/ holds everything the server needs
        _run(["cmake", "-S", str(where / "src"), "-B", str(where / "build"), "-DCMAKE_BUILD_TYPE=Release",
              "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DBUILD_SHARED_LIBS=OFF",
              "-DGGML_NATIVE=ON"], "configuring llama.cpp (cmake)")
        cores = len(os.sched_getaffinity(0))  # the cores this process may use (a container's), not the host's
        _run(["cmake", "--build", str(where / "build"), "-j", str(cores), "--target", "llama-server"],
             f"building llama-server on {cores} cores (6-11 minutes on 2)")
        server.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(where / "build" / "bin" / "llama-server", server)
        (where / "VERSION").write_text(f"llama-cpp-python {VERSION} (llama.cpp vendored)\n")
    # the vendored converter (convert_hf_to_gguf.py) runs in draftsmith's env and imports sentencepiece
    _run([sys.executable, "-m", "pip", "install", "--quiet", "sentencepiece>=0.2"], "installing sentencepiece")
    print(f"llama.cpp built in {where}")
    return where


def _run(cmd: list[str], what: str) -> None:
    """One step of the build, with a line saying it; its output goes to build.log, a failure is one line."""
    print(f"  {what}", flush=True)
    log = home() / "build.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as fh:
        code = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
        raise DraftsmithError(f"llama.cpp's install failed {what} (exit {code}; the whole output: {log}): {tail}")


def eagle3_missing(where: Path | None = None) -> str | None:
    """Why this llama.cpp cannot serve a feature (EAGLE-3) draft, or None: its converter must know the EAGLE3
    architecture and its server the `draft-eagle3` speculative type."""
    src = (where or home()) / "src"
    files = [src / "conversion" / "llama.py", src / "convert_hf_to_gguf.py", src / "common" / "speculative.cpp"]
    text = "".join(f.read_text(errors="replace") for f in files if f.is_file())
    if "LlamaForCausalLMEagle3" in text and "draft-eagle3" in text:
        return None
    return (f"the llama.cpp in {where or home()} cannot serve a feature (EAGLE-3) draft: it needs {EAGLE3_SINCE}; "
            f"rebuild it with `{INSTALL}` after removing that folder, or judge the bundle with --engine vllm")


def unmapped_norms(model_dir: Path) -> str | None:
    """Why llama.cpp cannot serve this feature head, or None: one trained with `draft.feature_norm=each` holds
    `fc_norm.N.weight`, which its EAGLE3 converter (llama-cpp-python 0.3.36) cannot map ("Can not map tensor
    'fc_norm.0.weight'"), found only after the target's GGUF is made and, in `bench serve`, the plain arm has run."""
    if json.loads((model_dir / "config.json").read_text()).get("fc_norm"):
        return (f"llama.cpp cannot serve {model_dir}: its EAGLE3 converter has no per-state norm (fc_norm, from "
                "draft.feature_norm=each); serve this head in vLLM or draftsmith, or train it with "
                "draft.feature_norm=none for llama.cpp")
    return None


class LlamaCppEngine(Engine):
    """llama.cpp's server: `-m target.gguf`, plus `-md draft.gguf --draft-max K` for speculative decoding. One
    request per sample (each with its own seed), token ids in and out; its sampler chain is set to HF's order
    (temperature, then top-p) with min-p off, so both engines sample the same distribution."""

    name = "llamacpp"
    starts_per_run = True  # each run() starts a server: bench serve alternates its arms by run (ABBA), not by job
    cache_prompts = True  # the server's cache_prompt; bench serve turns it off (a row must not reuse another's prefill)

    def __init__(self, bundle, timeout_s: int = 1800, draft_type: str = "f32"):
        self.bundle, self.timeout_s, self.draft_type = bundle, timeout_s, draft_type
        why = missing()
        if why:
            raise DraftsmithError(why)
        self.server = home() / "bin" / "llama-server"
        self.converter = home() / "src" / "convert_hf_to_gguf.py"
        self.k = engine_k(bundle.spec, self.name)
        from draftsmith.sampling.feature import is_feature_dir

        self.eagle3 = is_feature_dir(bundle.draft_dir)
        # a feature draft this build cannot convert is refused before any GGUF is made or server started
        if self.eagle3 and (why := eagle3_missing() or unmapped_norms(bundle.draft_dir)):
            raise DraftsmithError(why)

    def version(self) -> str:
        return (home() / "VERSION").read_text().strip() if (home() / "VERSION").is_file() else "?"

    def variants(self) -> dict[str, Engine]:
        # exactness does not depend on the draft, so the draft may be quantized while the target keeps f32: a
        # cheaper draft step (c) is the whole of what Q8_0 changes
        return {} if self.draft_type != "f32" else {"Q8_0 draft": LlamaCppEngine(self.bundle, self.timeout_s, "q8_0")}

    def gguf(self, model_dir: Path, outtype: str = "f32", target_dir: Path | None = None) -> Path:
        """The model converted to GGUF (`outtype`: f32, or q8_0 for a draft) once, cached by its weights' hash.
        `target_dir`: a feature draft's target, whose config and tokenizer its EAGLE3 GGUF takes (part of the hash)."""
        names = [f.name for f in sorted(model_dir.glob("*.safetensors"))] + ["config.json"]
        suffix = "" if outtype == "f32" else f"-{outtype}"
        key = files_sha256(model_dir, names)[:16]
        extra = []
        if target_dir is not None:
            key += "-eagle3-" + files_sha256(target_dir, ["config.json"])[:8]
            extra = ["--target-model-dir", str(target_dir)]
        out = home() / "gguf" / f"{key}{suffix}.gguf"
        if not out.is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_suffix(".partial")
            env = {**os.environ, "PYTHONPATH": str(self.converter.parent / "gguf-py")}  # the converter's own gguf
            res = subprocess.run([sys.executable, str(self.converter), str(model_dir), "--outtype", outtype,
                                  "--outfile", str(tmp), *extra], capture_output=True, text=True, env=env)
            if res.returncode != 0:
                tail = "\n".join(res.stderr.strip().splitlines()[-8:])
                raise DraftsmithError(f"llama.cpp's converter failed on {model_dir}:\n{tail}")
            os.replace(tmp, out)
        return out

    def run(self, jobs, speculative):
        import socket
        import urllib.request

        target = self.gguf(self.bundle.target_dir)
        # slots: the largest batch served at once; each slot's window holds the longest prompt and its answer
        slots = max([len(j.prompts) for j in jobs if j.batched] + [1])
        window = max([len(p) + j.max_new_tokens + 8 for j in jobs for p in j.prompts] + [1024])
        cmd = [str(self.server), "-m", str(target), "-c", str(window * slots), "-np", str(slots),
               "-t", str(torch.get_num_threads()), "--host", "127.0.0.1"]
        if speculative:
            # without --spec-type the server loads the draft and never drafts (llama.cpp of llama-cpp-python 0.3.36);
            # a feature draft is an EAGLE3 GGUF, made with the target's config and tokenizer
            if self.eagle3:
                draft = self.gguf(self.bundle.draft_dir, self.draft_type, target_dir=self.bundle.target_dir)
            else:
                draft = self.gguf(self.bundle.draft_dir, self.draft_type)
            cmd += ["-md", str(draft), "--spec-type", "draft-eagle3" if self.eagle3 else "draft-simple",
                    "--spec-draft-n-max", str(self.k), "--spec-draft-n-min", "0",
                    # p-min 0 drafts K tokens every step, as the other engines do: its default has moved between
                    # versions (0.75, later 0), and above 0 it stops drafting where the draft is unsure, so K would
                    # be a maximum
                    "--spec-draft-p-min", "0"]
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
                    raise DraftsmithError(f"llama-server ({mode}) exited with status {proc.returncode}:\n{tail}")
                try:
                    with urllib.request.urlopen(url + "/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.time() > deadline:
                    raise DraftsmithError(f"llama-server ({mode}) did not become ready within 300 s")
                time.sleep(0.5)
            from tqdm import tqdm

            outs = []
            bar = tqdm(total=sum(len(j.prompts) * j.n for j in jobs), desc=f"llama.cpp {mode}", unit="request",
                       file=sys.stderr, leave=False)  # one request per sample: thousands for the chi-square
            for job in jobs:
                if job.batched and job.n == 1:  # the prompts at once, one slot each
                    outs.append(self._batch(job, post, bar, speculative))
                    continue
                tokens, seconds, drafted, accepted, i = [], 0.0, 0, 0, 0
                for prompt in job.prompts:
                    rows = []
                    for _ in range(job.n):
                        bar.update()
                        body = _body(job, prompt, job.seed + i, self.cache_prompts)
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

    def _batch(self, job, post, bar, speculative) -> Output:
        """The job's prompts sent together (a thread each), served at once on the server's slots; its time is the
        batch's wall time."""
        from concurrent.futures import ThreadPoolExecutor

        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(job.prompts)) as pool:
            res = list(pool.map(post, [_body(job, p, job.seed + i, self.cache_prompts)
                                       for i, p in enumerate(job.prompts)]))
        seconds = time.perf_counter() - t0
        bar.update(len(res))
        timing = [r.get("timings", {}) for r in res]
        drafted = sum(int(t.get("draft_n", 0)) for t in timing)
        accepted = sum(int(t.get("draft_n_accepted", 0)) for t in timing)
        return Output([[list(r["tokens"])] for r in res], seconds, drafted if speculative else None,
                      accepted if speculative else None)


def _body(job, prompt: list[int], seed: int, cache_prompt: bool = True) -> dict:
    """One /completion request: token ids in and out, HF's sampler order (temperature, then top-p), top-k and min-p
    off; `cache_prompt` off for timed runs (`bench serve`)."""
    return {"prompt": prompt, "n_predict": job.max_new_tokens, "temperature": job.temperature, "top_p": job.top_p,
            "top_k": 0, "min_p": 0.0, "seed": seed, "samplers": ["temperature", "top_p"], "return_tokens": True,
            "cache_prompt": cache_prompt}
