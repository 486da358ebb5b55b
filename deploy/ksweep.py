"""K measured in each engine, for `draftsmith export --engines ...`: the recommended K of the card is predicted from
c and v(K) measured in our sampler; each engine has its own costs, so each one serving the bundle is timed at
K = 1..4 (plain once, then speculative at each K, in one run), and the K that ran fastest there is written into
that engine's config, labelled with the temperature it was measured at:

- vllm: `vllm_speculative_config.json` `num_speculative_tokens`, and a feature draft's speculators proposal K in
  `draft/config.json` (what `vllm serve BUNDLE/draft` reads);
- transformers: `draft/generation_config.json` `num_assistant_tokens`;
- draftsmith, llamacpp: the card (`engine_k` in speculative.json; llama-server takes it as --spec-draft-n-max).

The card shows the measured speed-up beside the predicted one per engine, and says where speculation does not pay.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.deploy.bench.serve import _merge, encode, set_k, tau_of
from draftsmith.deploy.bench.sets import SETS, load_set
from draftsmith.engines.base import Job
from draftsmith.sampling.load import load_tokenizer
from draftsmith.sampling.prompts import load_prompts

KS = (1, 2, 3, 4)


def sweep(bundle, engine_name: str, ks=KS, temperature: float = 0.0, top_p: float = 1.0, n_prompts: int = 4,
          max_new_tokens: int = 32, prompts: str = "english", seed: int = 0) -> dict:
    """Tokens/s of the bundle in one engine, plain and at each K, on the first `n_prompts` of a prompt set (raw
    text where the target has no chat template); the fastest K is `best_k`. The default set, `english`, is none
    that `bench serve` reports (chat, code, math): the K that won on a set's first prompts would otherwise be
    reported on the same prompts, a winner's-curse bias; the set is recorded (`prompts`), and a bench serve row on
    it says so."""
    from draftsmith.engines import open_engine

    tok = load_tokenizer(str(bundle.target_dir))
    convs = load_set(prompts, n_prompts) if prompts in SETS else [
        [{"role": "user", "content": r["prompt"]}] for r in load_prompts(prompts, n_prompts)]
    ids = encode(tok, convs, raw=not getattr(tok, "chat_template", None))
    jobs = [Job([p], 1, max_new_tokens, temperature, top_p if temperature > 0 else 1.0, seed + i)
            for i, p in enumerate(ids)]
    engine = open_engine(engine_name, bundle)
    plain = engine.run(jobs, speculative=False)
    tps_plain = sum(o.new_tokens for o in plain) / max(sum(o.seconds for o in plain), 1e-9)
    by_k = {}
    for k in ks:
        set_k(engine, k)
        spec = engine.run(jobs, speculative=True)
        tps = sum(o.new_tokens for o in spec) / max(sum(o.seconds for o in spec), 1e-9)
        tau = tau_of(engine_name, _merge(spec), k)[0]
        by_k[str(k)] = {"tok_s": tps, "speedup": tps / tps_plain, "tokens_per_call": tau}
    best = max(by_k, key=lambda k: by_k[k]["tok_s"])
    return {"version": engine.version(), "temperature": temperature, "top_p": top_p if temperature > 0 else 1.0,
            "prompts": prompts, "n_prompts": len(jobs), "max_new_tokens": max_new_tokens, "tok_s_plain": tps_plain,
            "by_k": by_k, "best_k": int(best), "speedup": by_k[best]["speedup"]}


def write_engine_k(folder: Path, results: dict) -> None:
    """Each engine's measured K into the config it reads (see the module's list)."""
    if "vllm" in results:
        path = folder / "vllm_speculative_config.json"
        cfg = json.loads(path.read_text())
        cfg["num_speculative_tokens"] = results["vllm"]["best_k"]
        path.write_text(json.dumps(cfg, indent=2))
        draft = folder / "draft" / "config.json"
        spec = json.loads(draft.read_text()) if draft.is_file() else {}
        if spec.get("speculators_config"):  # a feature draft: `vllm serve BUNDLE/draft` takes its K from here
            for method in spec["speculators_config"]["proposal_methods"]:
                method["speculative_tokens"] = results["vllm"]["best_k"]
            draft.write_text(json.dumps(spec, indent=2) + "\n")
    gen = folder / "draft" / "generation_config.json"
    if "transformers" in results and gen.is_file():
        cfg = json.loads(gen.read_text())
        cfg.update(num_assistant_tokens=results["transformers"]["best_k"], num_assistant_tokens_schedule="constant")
        gen.write_text(json.dumps(cfg, indent=2) + "\n")


def card_section(results: dict, predicted: dict) -> str:
    """The card's table: per engine, the fastest K measured there, its speed-up beside the predicted one."""
    sets = sorted({str(r.get("prompts", "code")) for r in results.values()})
    lines = ["## K per engine", "", "Each engine timed at K = 1..4 on this machine (plain once, then each K, one run) "
             f"on the {', '.join(sets)} prompts; the fastest K is written into its config.", "",
             "| engine | version | T | K | tau | tokens/s plain | tokens/s speculative | speed-up | predicted |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    slower = []
    for name, r in results.items():
        b = r["by_k"][str(r["best_k"])]
        pred = predicted.get(str(r["best_k"]))
        tau = "-" if b["tokens_per_call"] is None else f"{b['tokens_per_call']:.2f}"
        lines.append(f"| {name} | {r['version']} | {r['temperature']:g} | {r['best_k']} | {tau} | "
                     f"{r['tok_s_plain']:.1f} | {b['tok_s']:.1f} | {b['speedup']:.2f}x | "
                     + ("-" if pred is None else f"{pred:.2f}x") + " |")
        if b["speedup"] < 1:
            slower.append(name)
    if slower:
        lines += ["", f"Speculation does not pay in {', '.join(slower)} on the machine measured (< 1x at every K): "
                  "serve without the draft there."]
    return "\n".join(lines) + "\n"
