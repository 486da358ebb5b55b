"""Record the logits vLLM's own EAGLE-3 model (`Eagle3LlamaForCausalLM`) drafts from, inside its engine; run with
vLLM's venv python:

    python engines/workers/vllm_eagle3_logits.py request.json OUT.safetensors

request.json: {"target": DIR, "head": DIR, "prompts": [[ids], ...], "k": 2, "max_model_len": 128}. For each
prompt vLLM prefills it, picks the target's greedy token t1 and drafts k tokens from the target's features of the
prompt and t1; this records the drafter's logits at each of those k steps (full vocabulary, -inf outside a pruned
head, as vLLM computes them), before it samples. OUT holds `logits` (prompts, k, vocab) and `t1` (prompts,). The
engine runs in this process (no engine-core process), so a wrapper around the drafter's `compute_logits` sees every
call; fp32, eager. Imports only vLLM, torch and the standard library.
"""

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: its drafter is reachable
# a small KV space, as engines/vllm.py gives its workers: the CPU build's default sizes it from the free memory, which
# a long test session has used up
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def drafter_model(llm):
    """The speculative drafter's model (vLLM 0.32's V1 in-process engine: engine core, executor, worker, runner)."""
    core = llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner.drafter.model


def main(request_path: str, out_path: str) -> None:
    import torch
    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    req = json.loads(open(request_path).read())
    k = req["k"]
    llm = LLM(model=req["target"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
              max_model_len=req["max_model_len"],
              speculative_config={"method": "eagle3", "model": req["head"], "num_speculative_tokens": k})
    model = drafter_model(llm)
    seen = []
    real = model.compute_logits

    def spy(hidden_states, *args, **kwargs):
        logits = real(hidden_states, *args, **kwargs)
        seen.append(logits.detach().float().clone())
        return logits

    model.compute_logits = spy
    logits, firsts = [], []
    for ids in req["prompts"]:
        seen.clear()
        # two tokens: the request lives past its prefill, so the drafter drafts from the prompt and t1 once
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        if len(seen) < k or any(s.shape[0] != 1 for s in seen[:k]):
            raise SystemExit(f"the drafter computed logits {[tuple(s.shape) for s in seen]}; expected {k} calls of "
                             "one row after the prefill (another vLLM version?)")
        logits.append(torch.cat(seen[:k]))
        firsts.append(out.outputs[0].token_ids[0])
    save_file({"logits": torch.stack(logits).contiguous(), "t1": torch.tensor(firsts)}, out_path)
    print(json.dumps({"prompts": len(firsts), "k": k, "vocab": int(logits[0].shape[-1])}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
