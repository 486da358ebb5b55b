"""Run a conformance request in vLLM; started by `engines/vllm.py` `VllmEngine` with the vLLM venv's python:

    ~/.cache/draftsmith/engines/vllm/bin/python engines/vllm_judge.py request.json result.json

Imports only vLLM and the standard library: that venv has no draftsmith (vLLM pins an older transformers).
The request's `speculative_config` is the bundle's `vllm_speculative_config.json`, passed as written.
"""

import json
import sys
import time


def counters(llm) -> dict:
    """vLLM's own speculative-decoding counters (Prometheus), summed over the engine's life so far; the accepted
    tokens at each draft position as a list (`accepted_per_pos`)."""
    out = {}
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_pos"] = [int(v) for v in m.values]
        elif m.name in ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
                      "vllm:spec_decode_num_drafts"):
            out[m.name.split(":")[1]] = int(getattr(m, "value", 0))
    return out


def main(request_path: str, result_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    req = json.loads(open(request_path).read())
    # eager mode and a small window (512 tokens, or the longest prompt and its answer): the CPU build's compile step
    # and default KV space cost minutes and GBs
    t0 = time.perf_counter()
    # the prefix cache off for timed runs (bench serve): a row would otherwise find its prompts' KV blocks cached
    # by the row before it on the same prompts
    llm = LLM(model=req["target"], speculative_config=req["speculative_config"], dtype=req["dtype"],
              max_model_len=req.get("max_model_len", 512), enforce_eager=True, seed=0, disable_log_stats=False,
              enable_prefix_caching=req.get("enable_prefix_caching", True))
    print(f"draftsmith: engine started in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    results = []
    for i, job in enumerate(req["jobs"]):
        greedy = job["temperature"] == 0
        params = SamplingParams(n=job["n"], temperature=job["temperature"], top_p=1.0 if greedy else job["top_p"],
                                max_tokens=job["max_new_tokens"], seed=job["seed"])
        prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
        before = counters(llm)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        after = counters(llm)
        delta = {k: after[k] - before.get(k, 0) for k in after if k != "accepted_per_pos"}
        if "accepted_per_pos" in after:
            was = before.get("accepted_per_pos") or [0] * len(after["accepted_per_pos"])
            delta["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], was)]
        # progress the parent shows (the lines it passes on start with 'draftsmith: ')
        print(f"draftsmith: job {i + 1}/{len(req['jobs'])}: {len(prompts)} prompt(s) x {job['n']} in {seconds:.1f} s",
              file=sys.stderr, flush=True)
        results.append({"tokens": [[list(c.token_ids) for c in o.outputs] for o in outs], "seconds": seconds,
                        "drafted": delta.get("spec_decode_num_draft_tokens"),
                        "accepted": delta.get("spec_decode_num_accepted_tokens"), "extra": delta})
    with open(result_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":  # vLLM's engine starts processes: the guard keeps them from re-running this
    main(*sys.argv[1:3])
