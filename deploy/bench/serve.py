"""A bundle served in an engine, measured as the field reports drafts: acceptance length (tau) per set.

    draftsmith bench serve BUNDLE --engine draftsmith
    draftsmith bench serve BUNDLE --engine vllm --prompts code math --n-prompts 20 --max-new-tokens 128 --json out.json
    draftsmith bench serve BUNDLE --engine transformers -k 3 --temperatures 0 --plot serve.png
    draftsmith bench serve BUNDLE --engine llamacpp --prompts code math chat --batch 1 4

Each set's conversations (`bench/sets.py`: chat, code, math, or a .jsonl file) go through the target's chat
template, one request at a time (or `--batch B` at once, where the engine batches: draftsmith, vllm, llamacpp;
transformers' assisted generation does not), with speculation and without, in the same engine and run; greedy and
at each T > 0 given. The chat set is measured over two turns, a row each (`turn` 1 and 2): turn 2 is the
conversation with the engine's own speculative turn-1 answer in it, then the held-out conversation's next user
message, run plain and speculative alike. Per set, turn and batch size: tau (`tokens_per_call`: tokens per target
pass, bonus token included), acceptance at each draft position where the engine gives it, tokens/s with and
without speculation, the speed-up, and latency per token (each request's wall time, or its batch's, over its
tokens: P50 and P90 over requests). Where each figure comes from:

- draftsmith: our sampler's own counts (passes per row, acceptance at each position);
- transformers: none of its own; we count the target's forward passes (tau), no per-position figure;
- vllm: its spec-decode counters (drafts, draft tokens, accepted tokens, accepted per position): tau = 1 +
  accepted / drafts; its CPU build samples wrongly at T > 0 with speculation (vLLM issue 55005);
- llamacpp: its per-request totals (draft_n, draft_n_accepted): tau = tokens / (tokens - accepted), no
  per-position figure; at T > 0 it verifies drafts by exact match, not by rejection sampling (not Chen et al.).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from draftsmith.deploy.bench.sets import SETS, load_set, second_turns, turn_two
from draftsmith.deploy.bundle import open_bundle
from draftsmith.engines.base import Job
from draftsmith.sampling.cli import engine_k, examples
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.load import load_tokenizer
from draftsmith.sampling.machine import machine, write_json
from draftsmith.sampling.stats import TAU, summary

SOURCE = {
    "draftsmith": "counted by our sampler (target passes per row; acceptance at each draft position)",
    "transformers": "counted by us: the target's forward passes (transformers reports none); no per-position figure",
    "vllm": "vLLM's spec-decode counters: tau = 1 + accepted / drafts; per position from its per-position counter",
    "llamacpp": "llama.cpp's per-request totals (draft_n, draft_n_accepted): tau = tokens / (tokens - accepted)",
}


def caveat(engine: str, build: str | None, temperature: float) -> str | None:
    """What is known wrong with an engine's speculative sampling at this setting, printed beside its rows."""
    if temperature == 0:
        return None
    if engine == "vllm" and build == "cpu":
        return "vLLM's CPU build samples wrongly at T > 0 with speculation (vLLM issue 55005)"
    if engine == "llamacpp":
        return "llama.cpp verifies drafts by exact match at T > 0 (not rejection sampling): not lossless"
    return None


def encode(tok, conversations: list[list[dict]], raw: bool) -> list[list[int]]:
    """Token ids of each conversation: the chat template with the assistant's turn opened, or (raw) its user and
    assistant messages' texts as a plain opening (the user message alone for a first turn)."""
    if raw:
        return [tok("\n\n".join(m["content"] for m in c if m["role"] != "system"))["input_ids"] for c in conversations]
    if not getattr(tok, "chat_template", None):
        raise DraftsmithError("the target's tokenizer has no chat template: pass --raw to run the prompts as plain "
                              "text")
    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def follow_up(tok, firsts: list[list[dict]], nexts: list[dict | None], raw: bool):
    """turn2(i, answer_ids): conversation i's turn-2 prompt with the engine's own turn-1 answer in it (its text,
    special tokens dropped: the template closes the turn itself), or None where the conversation has no second user
    turn."""
    def turn2(i: int, answer: list[int]) -> list[int] | None:
        if nexts[i] is None:
            return None
        text = tok.decode(answer, skip_special_tokens=True).strip()
        return encode(tok, [turn_two(firsts[i], text, nexts[i])], raw)[0]

    return turn2


def tau_of(engine: str, out, k: int) -> tuple[float | None, list[float] | None]:
    """(tau, acceptance at each draft position) of one speculative Output, from where `SOURCE` says."""
    tokens, x = out.new_tokens, out.extra or {}
    if not tokens:
        return None, None
    if engine in ("draftsmith", "transformers"):
        tau = tokens / x["target_passes"] if x.get("target_passes") else None
    elif engine == "vllm":
        drafts = x.get("spec_decode_num_drafts")
        tau = 1 + out.accepted / drafts if drafts else None
    else:
        tau = tokens / (tokens - out.accepted) if out.accepted is not None and tokens > out.accepted else None
    pos = None
    if x.get("tested_at"):
        pos = [a / t if t else None for a, t in zip(x["accepted_at"], x["tested_at"])]
    elif x.get("accepted_per_pos") and x.get("spec_decode_num_drafts"):
        pos = [a / x["spec_decode_num_drafts"] for a in x["accepted_per_pos"]]  # vLLM's: per draft, unconditional
    return tau, pos


def measure(engine, name: str, sets: dict[str, list[list[int]]], temperatures, top_p: float, max_new_tokens: int,
            k: int, seed: int, batches=(1,), follow: dict | None = None) -> list[dict]:
    """One row per (set, T, batch size, turn): every request run plain and speculative in `engine`. At batch 1 each
    request is a job of its own (so each has its own time); at batch b, b requests are one job served at once
    (`Job.batched`), and each request's latency is its job's wall time over its tokens. `follow[set]` (`follow_up`)
    makes the set's turn-2 prompts from the engine's own speculative turn-1 answers, at the same T and batch size;
    turn 2 is then run plain and speculative on those same prompts (so their tokens/s compare)."""
    build = engine.build() if hasattr(engine, "build") else None
    first = {(s, t, b): list(enumerate(sets[s])) for s in sets for t in temperatures for b in batches}
    keys, plain, spec = _run(engine, first, top_p, max_new_tokens, seed)
    rows = _rows(name, build, keys, plain, spec, top_p, k, turn=1)
    second: dict = {}
    for (s, t, b, idx), out in zip(keys, spec):
        if follow and s in follow:
            for pos, i in enumerate(idx):
                ids = follow[s](i, out.tokens[pos][0])
                if ids is not None:
                    second.setdefault((s, t, b), []).append((i, ids))
    if second:
        keys, plain, spec = _run(engine, second, top_p, max_new_tokens, seed)
        rows += _rows(name, build, keys, plain, spec, top_p, k, turn=2)
    return rows


def _run(engine, requests: dict, top_p: float, max_new_tokens: int, seed: int):
    """requests: (set, T, b) -> [(index, prompt ids)]. Returns each job's (set, T, b, indices) and its plain and
    speculative Outputs (one engine run each: an engine server starts once per mode)."""
    keys, jobs = [], []
    for (s, t, b), reqs in requests.items():
        for c in range(0, len(reqs), b):
            chunk = reqs[c: c + b]
            keys.append((s, t, b, [i for i, _ in chunk]))
            jobs.append(Job([ids for _, ids in chunk], 1, max_new_tokens, t, top_p if t > 0 else 1.0,
                            seed + chunk[0][0], batched=b > 1))
    return keys, engine.run(jobs, speculative=False), engine.run(jobs, speculative=True)


def _rows(name: str, build, keys, plain, spec, top_p: float, k: int, turn: int) -> list[dict]:
    rows = []
    for s, t, b in dict.fromkeys(key[:3] for key in keys):
        idx = [j for j, key in enumerate(keys) if key[:3] == (s, t, b)]
        p_tok, s_tok = sum(plain[j].new_tokens for j in idx), sum(spec[j].new_tokens for j in idx)
        p_sec, s_sec = sum(plain[j].seconds for j in idx), sum(spec[j].seconds for j in idx)
        merged = _merge([spec[j] for j in idx])
        tau, pos = tau_of(name, merged, k)
        lat_plain = [1e3 * plain[j].seconds / len(r[0]) for j in idx for r in plain[j].tokens if r[0]]
        lat_spec = [1e3 * spec[j].seconds / len(r[0]) for j in idx for r in spec[j].tokens if r[0]]
        tps_p = p_tok / p_sec if p_sec else 0.0
        tps_s = s_tok / s_sec if s_sec else 0.0
        rows.append({"set": s, "turn": turn, "batch": b, "temperature": t, "top_p": top_p if t > 0 else 1.0,
                     "prompts": sum(len(keys[j][3]) for j in idx),
                     "tokens_per_call": tau, "acceptance_by_position": pos,
                     "alpha": merged.accepted / merged.drafted if merged.drafted else None,
                     "tok_s_plain": tps_p, "tok_s_speculative": tps_s,
                     "speedup": tps_s / tps_p if tps_p else None,
                     "ms_per_token_plain": summary(lat_plain), "ms_per_token_speculative": summary(lat_spec),
                     "new_tokens_plain": p_tok, "new_tokens_speculative": s_tok,
                     "note": caveat(name, build, t)})
    return rows


def _merge(outs):
    """The Outputs of one row's requests as one: tokens and counters summed."""
    from draftsmith.engines.base import Output

    extra: dict = {}
    for o in outs:
        for key, v in (o.extra or {}).items():
            if isinstance(v, list):
                cur = extra.setdefault(key, [])
                cur += [0] * (len(v) - len(cur))
                for i, x in enumerate(v):
                    cur[i] += x
            elif isinstance(v, (int, float)):
                extra[key] = extra.get(key, 0) + v
    counted = [o for o in outs if o.drafted is not None]
    return Output([t for o in outs for t in o.tokens], sum(o.seconds for o in outs),
                  sum(o.drafted for o in counted) if counted else None,
                  sum(o.accepted for o in counted) if counted else None, extra)


def print_table(report: dict) -> None:
    print(f"{report['engine']} {report['version']}, K={report['k']}, template: {report['template']}, "
          f"{report['machine'].get('cpu', '')}")
    print(f"  {TAU} from: {SOURCE[report['engine']]}")
    print(f"  {'set':<8}{'turn':>5}{'batch':>6}{'T':>5}{'prompts':>9}{'tau':>7}{'accept. by position':>26}"
          f"{'tok/s plain':>13}"
          f"{'tok/s spec':>12}{'speed-up':>10}{'ms/tok P50':>12}{'P90':>7}")
    for r in report["rows"]:
        tau = "-" if r["tokens_per_call"] is None else f"{r['tokens_per_call']:.2f}"
        pos = "-" if not r["acceptance_by_position"] else " ".join(
            "-" if a is None else f"{a:.2f}" for a in r["acceptance_by_position"])
        lat = r["ms_per_token_speculative"] or {"p50": float("nan"), "p90": float("nan")}
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        print(f"  {r['set']:<8}{r['turn']:>5}{r['batch']:>6}{r['temperature']:>5g}{r['prompts']:>9}{tau:>7}{pos:>26}"
              f"{r['tok_s_plain']:>13.1f}"
              f"{r['tok_s_speculative']:>12.1f}{sp:>10}{lat['p50']:>12.1f}{lat['p90']:>7.1f}")
        if r["note"]:
            print(f"  {'':<8}^ {r['note']}")


def plot(report: dict, path: Path) -> None:
    """tau and the speed-up per set and temperature: two bar panels."""
    from draftsmith.deploy.plots import _pyplot

    plt = _pyplot()
    rows = report["rows"]
    labels = [f"{r['set']}" + (f" t{r['turn']}" if r["turn"] > 1 else "") + (f" b{r['batch']}" if r["batch"] > 1
              else "") + f"\nT={r['temperature']:g}" for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(6, 1.4 * len(rows) + 3), 3.8))
    left.bar(labels, [r["tokens_per_call"] or 0 for r in rows], color="tab:blue")
    left.set_ylabel(f"{TAU}, tokens per target pass")
    left.axhline(report["k"] + 1, ls=":", c="grey")
    right.bar(labels, [r["speedup"] or 0 for r in rows], color="tab:green")
    right.axhline(1.0, ls="--", c="k")
    right.set_ylabel("speed-up (tokens/s, speculative / plain)")
    fig.suptitle(f"{report['engine']} {report['version']}, K={report['k']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None, prog=None) -> int:
    from draftsmith.engines import ENGINES, open_engine

    ap = argparse.ArgumentParser(prog=prog or "draftsmith bench serve", description=__doc__.splitlines()[0],
                                 epilog=examples(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path, help="a bundle (draftsmith export)")
    ap.add_argument("--engine", required=True, choices=list(ENGINES))
    ap.add_argument("--target", help="the target's folder or hub id where the bundle does not hold it (the card's "
                    "TARGET; default: the copy inside the bundle, else the name it was exported with)")
    ap.add_argument("--prompts", nargs="+", default=["code", "math"],
                    help=f"sets ({', '.join(SETS)}) or .jsonl files (default: %(default)s)")
    ap.add_argument("--n-prompts", type=int, default=20, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("-k", "--k", type=int, default=None,
                    help="draft tokens per step (default: the bundle's for this engine: the fastest measured there "
                    "by export --engines, else its recommended K)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=None,
                    help="0 is greedy (default: 0 and the bundle's temperature)")
    ap.add_argument("--top-p", type=float, default=None, help="at T > 0 (default: the bundle's)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1], metavar="B",
                    help="requests served at once, a row per size given: e.g. --batch 1 4 (default: 1; transformers' "
                    "assisted generation does not batch: 1 only)")
    ap.add_argument("--raw", action="store_true", help="no chat template: the user message as a plain opening")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the rows, engine version, flags, K, T, top-p and template here")
    ap.add_argument("--plot", type=Path, help="write tau and the speed-up per set as a PNG here")
    args = ap.parse_args(argv)
    try:
        bundle = open_bundle(args.bundle, args.target)
        s = bundle.spec.get("sampling", {})
        temps = args.temperatures if args.temperatures is not None else [0.0, float(s.get("temperature", 0.8))]
        top_p = args.top_p if args.top_p is not None else float(s.get("top_p", 1.0))
        k = args.k or engine_k(bundle.spec, args.engine)
        if k < 1 or any(t < 0 for t in temps) or not 0 < top_p <= 1:
            raise DraftsmithError(f"need K >= 1, T >= 0 and 0 < top-p <= 1; got K={k}, T={temps}, top-p={top_p}")
        batches = list(dict.fromkeys(args.batch))
        if min(batches) < 1:
            raise DraftsmithError(f"--batch must be at least 1, got {min(batches)}")
        if max(batches) > 1 and not engine_class(args.engine).batches:
            raise DraftsmithError(f"{args.engine} serves one request at a time (transformers' assisted generation "
                                  "does not batch): run it with --batch 1")
        tok = load_tokenizer(str(bundle.target_dir))
        convs = {name: load_set(name, args.n_prompts) for name in args.prompts}
        sets = {name: encode(tok, c, args.raw) for name, c in convs.items()}
        nexts = {name: second_turns(name, args.n_prompts) for name in args.prompts}
        follow = {name: follow_up(tok, convs[name], n, args.raw) for name, n in nexts.items() if n}
        engine = open_engine(args.engine, bundle)
        set_k(engine, k)
        rows = measure(engine, args.engine, sets, temps, top_p, args.max_new_tokens, k, args.seed, batches, follow)
    except ValueError as e:  # a DraftsmithError (a bad bundle, a missing engine), or bad input
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = {"engine": args.engine, "version": engine.version(),
              "build": engine.build() if hasattr(engine, "build") else None,
              "flags": list(argv if argv is not None else sys.argv[1:]), "k": k, "temperatures": temps,
              "top_p": top_p, "template": "none (raw text)" if args.raw else "the target's chat template",
              "max_new_tokens": args.max_new_tokens, "n_prompts": args.n_prompts, "seed": args.seed,
              "batches": batches,
              "tau_source": SOURCE[args.engine], "bundle": str(args.bundle), "machine": machine(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "rows": rows}
    print_table(report)
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


def engine_class(name: str):
    """The engine's class, not opened (its `batches` is read before any model loads)."""
    from draftsmith.engines import ENGINES, module

    return getattr(module(name), ENGINES[name][1])


def set_k(engine, k: int) -> None:
    """K for the engine's speculative runs, in the place each engine reads it."""
    engine.k = k
    draft = getattr(engine, "draft", None)
    if engine.name == "transformers" and draft is not None:  # assisted generation reads K from the draft's config
        draft.generation_config.update(num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                                       assistant_confidence_threshold=0.0)


if __name__ == "__main__":
    sys.exit(main())
