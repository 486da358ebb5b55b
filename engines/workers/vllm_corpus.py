"""Sample a corpus in vLLM; started by `engines/vllm.py` `Session` (`data.generated.engine=vllm`: a corpus of prompts,
or regenerated conversations) with the vLLM venv's python:

    ~/.cache/draftsmith/engines/vllm/bin/python engines/vllm_corpus.py request.json OUT_DIR

Imports only vLLM, its torch and safetensors, and the standard library: that venv has no draftsmith (vLLM pins an
older transformers). Writes, each atomically (a temporary name, then a rename):
- `OUT_DIR/started.json` once the engine is up, with its start time and version.
- `OUT_DIR/check.json` next, when the request has a `check` job: `n` plain samples of 2 tokens of one prompt,
  which the trainer judges against the target's exact probabilities before it keeps any sample;
- then, for each job the trainer writes as it goes, `OUT_DIR/job-{n:06d}.json` ({"rows": [{"prompt": ids, "seed":
  s}]}, numbered from 0, written atomically), one `OUT_DIR/job-{n:06d}.safetensors` (its generation's seconds in the
  metadata), in the layout of the trainer's kept logits: `tokens` (every row's new tokens, EOS included,
  concatenated), `steps` (tokens per row), `values` / `index` (the top-k log-probabilities of the distribution each
  token was drawn from and their token ids, row-major). vLLM's `raw_logprobs`: the log-softmax of the model's
  logits before temperature, top-k and top-p, which is what the trainer's own loop keeps and the distillation loss
  reads. Jobs come one at a time or all at once: a corpus of prompts writes them all, regenerated conversations
  write a turn's only once the turn before it is back (its prompts hold those answers). `OUT_DIR/stop` ends the
  worker once the jobs before it are done.
"""

import json
import os
import sys
import time


def _atomic(path: str, write) -> None:
    tmp = path + ".tmp"
    write(tmp)
    os.replace(tmp, path)


def main(request_path: str, out_dir: str) -> None:
    t0 = time.perf_counter()
    from importlib.metadata import version

    import torch
    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    req = json.loads(open(request_path).read())
    k = int(req["keep_logits"])
    # eager on a CPU: the CPU build's compile step costs minutes; on a GPU the user's own settings apply.
    # gpu_memory_utilization: vLLM's share of each GPU, the rest left for the trainer's target, which loads after
    # this start (the CPU build sizes its KV cache from VLLM_CPU_KVCACHE_SPACE instead)
    llm = LLM(model=req["target"], dtype=req["dtype"], seed=req["seed"], max_model_len=req["max_model_len"],
              enforce_eager=req.get("enforce_eager", True), tensor_parallel_size=req.get("tensor_parallel_size", 1),
              gpu_memory_utilization=req["gpu_memory_utilization"], max_logprobs=max(k, 1),
              logprobs_mode="raw_logprobs")
    _atomic(os.path.join(out_dir, "started.json"), lambda p: open(p, "w").write(json.dumps(
        {"start_s": time.perf_counter() - t0, "version": version("vllm-cpu" if _cpu_build() else "vllm")})))

    check = req.get("check")
    if check:
        params = SamplingParams(n=check["n"], temperature=req["temperature"], top_p=req["top_p"],
                                top_k=req.get("top_k") or -1, max_tokens=2, seed=check["seed"], detokenize=False)
        out = llm.generate([TokensPrompt(prompt_token_ids=check["prompt"])], params, use_tqdm=False)[0]
        _atomic(os.path.join(out_dir, "check.json"),
                lambda p: open(p, "w").write(json.dumps([list(c.token_ids) for c in out.outputs])))

    n = 0
    while True:  # the trainer's jobs, in order, until it says stop (or ends this process tree)
        job = os.path.join(out_dir, f"job-{n:06d}")
        if not os.path.exists(job + ".json"):
            if os.path.exists(os.path.join(out_dir, "stop")):
                break
            time.sleep(0.02)
            continue
        rows = json.loads(open(job + ".json").read())["rows"]
        params = [SamplingParams(temperature=req["temperature"], top_p=req["top_p"], top_k=req.get("top_k") or -1,
                                 max_tokens=req["max_new_tokens"], seed=r["seed"], logprobs=k or None,
                                 detokenize=False, stop_token_ids=req.get("eos") or None) for r in rows]
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=r["prompt"]) for r in rows], params, use_tqdm=False)
        seconds = time.perf_counter() - t
        tokens, steps, values, index = [], [], [], []
        for o in outs:
            c = o.outputs[0]
            tokens += list(c.token_ids)
            steps.append(len(c.token_ids))
            for lp in (c.logprobs or []) if k else []:  # one dict per token: the top k by rank (+ the drawn one)
                top = sorted(lp.items(), key=lambda kv: kv[1].rank)[:k]
                index.append([t for t, _ in top])
                values.append([v.logprob for _, v in top])
        record = {"tokens": torch.tensor(tokens, dtype=torch.long), "steps": torch.tensor(steps, dtype=torch.long)}
        if k:
            record["values"] = torch.tensor(values, dtype=torch.float32).reshape(-1, k).half()
            record["index"] = torch.tensor(index, dtype=torch.int32).reshape(-1, k)
        _atomic(job + ".safetensors", lambda p: save_file(record, p, metadata={"seconds": str(seconds)}))
        n += 1


def _cpu_build() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
        return True
    except PackageNotFoundError:
        return False


if __name__ == "__main__":  # vLLM's engine starts processes: the guard keeps them from re-running this
    main(*sys.argv[1:3])
