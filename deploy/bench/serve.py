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
message, run plain and speculative alike. Per set, turn and batch size: tau (`tokens_per_call`: tokens per
verification pass, bonus token included, the prompt pass and its token excluded, in every engine), acceptance at
each draft position where the engine gives it (unconditional, as vLLM defines it), both arms' tokens, tokens/s
with and without speculation, the speed-up and its range over `--rounds`, the speculative arm's end-to-end latency
per token (each request's wall time, or its batch's, over its tokens, prefill included: not vLLM's TPOT; P50 and
P90 over requests), and at T = 0 how many outputs differ between the arms.

Timing: the arms alternate (per job in this process; ABBA for the engines that start a server per arm), each arm
serves an untimed warm-up job first, prompt and prefix caches are off, vLLM's CPU build runs with its venv's
libiomp5 preloaded where it has one (recorded), llama.cpp's draft length is pinned (`--spec-draft-p-min 0`).

Where each figure comes from (`SOURCE`):

- draftsmith: our sampler's own counts (verification passes per row, acceptance at each position);
- transformers: none of its own; we count the target's forward passes (tau), no per-position figure;
- vllm: its spec-decode counters (drafts, draft tokens, accepted tokens, accepted per position): tau = (tokens -
  requests) / drafts; its own 1 + accepted / drafts kept in the JSON; its CPU build (the device, not the package
  name) samples wrongly at T > 0 with speculation (vLLM issue 55005): that speed-up is printed invalid;
- llamacpp: its per-request totals (draft_n, draft_n_accepted): tau = (tokens - requests) / (tokens - requests -
  accepted), no per-position figure.

At T > 0 each row names its drafting rule: a sampled draft token accepted with min(1, p/q) (draftsmith,
transformers) or a greedy draft token kept when it equals the target's own sample (llama.cpp; vLLM unless its
draft_sample_method is probabilistic). Both are lossless; the first accepts sum_x min(p, q), the second p(draft
token), so tau is compared only between rows of one rule.
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

# tau, in every engine: tokens emitted per verification pass (a target pass that checks drafts), bonus token
# included, the prompt pass and the token it emits excluded (vLLM's and llama.cpp's prompt pass emits a token and
# verifies nothing; our sampler's prefill and transformers' first pass emit none of their own). Each engine's own
# figure is kept beside it in the JSON (`native`), under its own name.
SOURCE = {
    "draftsmith": "our sampler's counts: tokens / verification passes (its prefill emits nothing)",
    "transformers": "counted by us: tokens / the target's forward passes (transformers reports none; its first pass "
                    "is the prompt and the first drafts); no per-position figure",
    "vllm": "vLLM's spec-decode counters: (tokens - requests) / drafts (its own 1 + accepted / drafts kept as "
            "vllm_mean_acceptance_length: it counts drafts accepted past EOS or max_tokens)",
    "llamacpp": "llama.cpp's per-request totals (draft_n, draft_n_accepted): (tokens - requests) / (tokens - requests "
                "- accepted), no per-position figure",
}
# acceptance at draft position i, as the field (vLLM) gives it: the share of verification passes whose first i + 1
# drafts were all accepted (unconditional), so that 1 + their sum is tau where nothing is cut at EOS or max tokens
POSITION = "unconditional: passes whose first i+1 drafts were all accepted / passes"

# the drafting rule at T > 0 (at T = 0 the two are one rule): what tau compares there, beside the draft
SAMPLED = "sampled draft, accepted with min(1, p/q)"  # Chen et al.: acceptance sum_x min(p, q)
GREEDY = "greedy draft, kept when equal to the target's sample"  # lossless too, but accepts p(draft token)


def drafting_rule(engine: str, temperature: float, handle=None) -> str | None:
    """How the engine drafts and accepts at this T (None at T = 0): our sampler and transformers sample the draft
    token and accept it with min(1, p/q); llama.cpp drafts greedily and keeps a draft token equal to the target's
    own sample, as vLLM does unless its `draft_sample_method` is probabilistic (`VllmEngine.draft_sampling`)."""
    if temperature == 0:
        return None
    if engine == "llamacpp":
        return GREEDY
    if engine == "vllm":
        how = getattr(handle, "draft_sampling", None)
        return SAMPLED if how and how() == "probabilistic" else GREEDY
    return SAMPLED


def notes(engine: str, build: str | None, temperature: float) -> list[str]:
    """What is known wrong with an engine's speculative sampling at this setting, printed beside its rows."""
    if temperature > 0 and engine == "vllm" and build == "cpu":
        return ["vLLM's CPU build samples wrongly at T > 0 with speculation (vLLM issue 55005): tau and the speed-up "
                "describe another generation (speed-up invalid)"]
    return []


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


def caveat(engine: str, build: str | None, temperature: float) -> str | None:
    """The row's `note`: `notes` joined, or None."""
    return "; ".join(notes(engine, build, temperature)) or None


def tau_of(engine: str, out, k: int) -> tuple[float | None, list[float] | None, dict]:
    """(tau, acceptance at each draft position, the engine's own figures) of one speculative Output, as `SOURCE`
    says: tau is tokens per verification pass in every engine, acceptance by position unconditional (`POSITION`)."""
    tokens, x = out.new_tokens, out.extra or {}
    requests = sum(len(p) for p in out.tokens)
    native: dict = {}
    if not tokens:
        return None, None, native
    tau = pos = None
    if engine in ("draftsmith", "transformers"):
        passes = x.get("target_passes")
        tau = tokens / passes if passes else None
        native["target_passes"] = passes
        if x.get("tested_at") and x["tested_at"][0]:
            # every verification pass tests its first draft: tested_at[0] counts the passes that drafted
            pos = [a / x["tested_at"][0] for a in x["accepted_at"]]
            native["acceptance_by_position_conditional"] = [a / t if t else None
                                                            for a, t in zip(x["accepted_at"], x["tested_at"])]
    elif engine == "vllm":
        drafts = x.get("spec_decode_num_drafts")
        if drafts:
            tau = (tokens - requests) / drafts
            native["vllm_mean_acceptance_length"] = 1 + (out.accepted or 0) / drafts
            if x.get("accepted_per_pos"):
                pos = [a / drafts for a in x["accepted_per_pos"]]  # vLLM's own: per draft, unconditional
        native.update({key: x.get(key) for key in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                                   "spec_decode_num_accepted_tokens") if key in x})
    else:
        if out.accepted is not None:
            passes = tokens - requests - out.accepted
            tau = (tokens - requests) / passes if passes > 0 else None
            native.update(llamacpp_draft_n=out.drafted, llamacpp_draft_n_accepted=out.accepted)
            if out.drafted:  # the server's own "draft acceptance rate"
                native["llamacpp_draft_acceptance_rate"] = out.accepted / out.drafted
    return tau, pos, native


def measure(engine, name: str, sets: dict[str, list[list[int]]], temperatures, top_p: float, max_new_tokens: int,
            k: int, seed: int, batches=(1,), follow: dict | None = None, rounds: int = 1, warmup: bool = True,
            k_set: str | None = None) -> list[dict]:
    """One row per (set, T, batch size, turn): every request run plain and speculative in `engine`, `rounds` times
    (`_run`: the arms alternate, so load that comes and goes falls on both). At batch 1 each request is a job of its
    own (so each has its own time); at batch b, b requests are one job served at once (`Job.batched`), and each
    request's latency is its job's wall time over its tokens. `follow[set]` (`follow_up`) makes the set's turn-2
    prompts from the engine's own speculative turn-1 answers (the first round's), at the same T and batch size;
    turn 2 is then run plain and speculative on those same prompts (so their tokens/s compare). `k_set`: the set K
    was chosen on (`export --engines`), said beside that set's rows. One round unless asked (the command's
    --rounds is 2): a test that only reads tau pays one server start per arm."""
    build = engine.build() if hasattr(engine, "build") else None
    first = {(s, t, b): list(enumerate(sets[s])) for s in sets for t in temperatures for b in batches}
    keys, plain, spec = _run(engine, first, top_p, max_new_tokens, seed, rounds, warmup)
    rows = _rows(name, engine, build, keys, plain, spec, top_p, k, 1, k_set)
    second: dict = {}
    for (s, t, b, idx), out in zip(keys, spec[0]):
        if follow and s in follow:
            for pos, i in enumerate(idx):
                ids = follow[s](i, out.tokens[pos][0])
                if ids is not None:
                    second.setdefault((s, t, b), []).append((i, ids))
    if second:
        keys, plain, spec = _run(engine, second, top_p, max_new_tokens, seed, rounds, warmup)
        rows += _rows(name, engine, build, keys, plain, spec, top_p, k, 2, k_set)
    return rows


def _run(engine, requests: dict, top_p: float, max_new_tokens: int, seed: int, rounds: int = 2,
         warmup: bool = True):
    """requests: (set, T, b) -> [(index, prompt ids)]. Returns each job's (set, T, b, indices) and, per round, its
    plain and speculative Outputs. The arms alternate: an engine in this process runs each job plain then
    speculative, the next job the other way round, and each round starts where the last ended (ABAB / BABA per job);
    an engine that starts a server per run (`starts_per_run`: vLLM, llama.cpp) runs every job in one arm, then in
    the other, the next round the other way round (ABBA over two rounds). Each arm first serves one untimed job
    (the first prompt, 8 tokens): first-call costs (allocations, kernel choice, a server's first request) fall on
    no timed job."""
    keys, jobs = [], []
    for (s, t, b), reqs in requests.items():
        for c in range(0, len(reqs), b):
            chunk = reqs[c: c + b]
            keys.append((s, t, b, [i for i, _ in chunk]))
            jobs.append(Job([ids for _, ids in chunk], 1, max_new_tokens, t, top_p if t > 0 else 1.0,
                            seed + chunk[0][0], batched=b > 1))
    warm = [Job([jobs[0].prompts[0]], 1, min(8, max_new_tokens), jobs[0].temperature, jobs[0].top_p,
                jobs[0].seed)] if warmup and jobs else []
    plain = [[None] * len(jobs) for _ in range(rounds)]
    spec = [[None] * len(jobs) for _ in range(rounds)]
    arms = (False, True)
    if getattr(engine, "starts_per_run", False):
        for r in range(rounds):
            for speculative in arms if r % 2 == 0 else arms[::-1]:
                (spec if speculative else plain)[r] = engine.run(warm + jobs, speculative)[len(warm):]
        return keys, plain, spec
    for speculative in arms if warm else ():
        engine.run(warm, speculative)
    for r in range(rounds):
        for j, job in enumerate(jobs):
            for speculative in arms if (r * len(jobs) + j) % 2 == 0 else arms[::-1]:
                (spec if speculative else plain)[r][j] = engine.run([job], speculative)[0]
    return keys, plain, spec


def greedy_mismatches(keys, idx, plain, spec) -> tuple[int, int, dict | None]:
    """(requests whose speculative output differs from the plain one, requests compared, the first such: set
    index, round, the token position where they part and a few tokens of each) over every round of a T = 0 row."""
    bad, n, first = 0, 0, None
    for r in range(len(plain)):
        for j in idx:
            for i, (a, b) in enumerate(zip(plain[r][j].tokens, spec[r][j].tokens)):
                a, b = a[0], b[0]
                n += 1
                if a != b:
                    bad += 1
                    at = next((p for p, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    if first is None:
                        first = {"prompt": keys[j][3][i], "round": r, "position": at, "plain": a[at: at + 5],
                                 "speculative": b[at: at + 5]}
    return bad, n, first


def _rows(name: str, engine, build, keys, plain, spec, top_p: float, k: int, turn: int,
          k_set: str | None = None) -> list[dict]:
    rows = []
    rounds = len(plain)
    for s, t, b in dict.fromkeys(key[:3] for key in keys):
        idx = [j for j, key in enumerate(keys) if key[:3] == (s, t, b)]
        per_round = []
        for r in range(rounds):
            p_tok, s_tok = sum(plain[r][j].new_tokens for j in idx), sum(spec[r][j].new_tokens for j in idx)
            p_sec, s_sec = sum(plain[r][j].seconds for j in idx), sum(spec[r][j].seconds for j in idx)
            per_round.append((p_tok, p_sec, s_tok, s_sec))
        p_tok, p_sec, s_tok, s_sec = (sum(x[i] for x in per_round) for i in range(4))
        merged = _merge([spec[r][j] for r in range(rounds) for j in idx])
        tau, pos, native = tau_of(name, merged, k)
        lat_plain = [1e3 * plain[r][j].seconds / len(q[0]) for r in range(rounds) for j in idx
                     for q in plain[r][j].tokens if q[0]]
        lat_spec = [1e3 * spec[r][j].seconds / len(q[0]) for r in range(rounds) for j in idx
                    for q in spec[r][j].tokens if q[0]]
        tps_p = p_tok / p_sec if p_sec else 0.0
        tps_s = s_tok / s_sec if s_sec else 0.0
        by_round = [(st / ss) / (pt / ps) if pt and ps and ss else None for pt, ps, st, ss in per_round]
        known = [x for x in by_round if x is not None]
        note = caveat(name, build, t)
        row = {"set": s, "turn": turn, "batch": b, "temperature": t, "top_p": top_p if t > 0 else 1.0,
               "prompts": sum(len(keys[j][3]) for j in idx), "rounds": rounds,
               "tokens_per_call": tau, "acceptance_by_position": pos, "native": native,
               "drafting_rule": drafting_rule(name, t, engine),
               "alpha": merged.accepted / merged.drafted if merged.drafted else None,
               "tok_s_plain": tps_p, "tok_s_speculative": tps_s,
               "speedup": tps_s / tps_p if tps_p else None,
               "speedup_valid": not (name == "vllm" and build == "cpu" and t > 0),
               "speedup_by_round": by_round,
               # a spread over rounds that holds 1.0 has not shown speculation faster or slower here
               "speedup_crosses_1": len(known) > 1 and min(known) <= 1.0 <= max(known),
               "ms_per_token_plain": summary(lat_plain), "ms_per_token_speculative": summary(lat_spec),
               "new_tokens_plain": p_tok, "new_tokens_speculative": s_tok,
               "k_chosen_on_this_set": k_set == s,
               "note": note}
        if t == 0:
            row["greedy_mismatches"], row["greedy_compared"], row["greedy_first_mismatch"] = greedy_mismatches(
                keys, idx, plain, spec)
        rows.append(row)
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
    print(f"  {TAU}: tokens per verification pass, bonus included, the prompt pass and its token excluded; from "
          f"{SOURCE[report['engine']]}")
    print(f"  accept. by position: {POSITION}")
    rounds = report.get("rounds", 1)
    print(f"  timing: {rounds} round(s), plain and speculative alternating"
          + (" (ABBA: a server start per arm and round)" if report.get("starts_per_run") else " per job")
          + ", an untimed warm-up per arm, prompt caches off"
          + (f"; LD_PRELOAD={report['ld_preload']}" if report.get("ld_preload") else ""))
    if any(r["drafting_rule"] for r in report["rows"]):
        print(f"  T > 0: tau compares only rows of one drafting rule ({SAMPLED}: accepts sum min(p, q); {GREEDY}: "
              "accepts p(draft token)); both lossless")
    print(f"  {'set':<8}{'turn':>5}{'batch':>6}{'T':>5}{'prompts':>9}{'tau':>7}{'accept. by position':>26}"
          f"{'tokens plain/spec':>19}{'tok/s plain':>13}{'tok/s spec':>12}{'speed-up':>10}{'range':>14}"
          f"{'spec e2e ms/tok P50':>21}{'P90':>7}")
    for r in report["rows"]:
        tau = "-" if r["tokens_per_call"] is None else f"{r['tokens_per_call']:.2f}"
        pos = "-" if not r["acceptance_by_position"] else " ".join(
            "-" if a is None else f"{a:.2f}" for a in r["acceptance_by_position"])
        lat = r["ms_per_token_speculative"] or {"p50": float("nan"), "p90": float("nan")}
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        if not r.get("speedup_valid", True):
            sp = "invalid"
        known = [x for x in r.get("speedup_by_round") or [] if x is not None]
        spread = f"{min(known):.2f}-{max(known):.2f}" if len(known) > 1 else "-"
        toks = f"{r['new_tokens_plain']}/{r['new_tokens_speculative']}"
        print(f"  {r['set']:<8}{r['turn']:>5}{r['batch']:>6}{r['temperature']:>5g}{r['prompts']:>9}{tau:>7}{pos:>26}"
              f"{toks:>19}{r['tok_s_plain']:>13.1f}{r['tok_s_speculative']:>12.1f}{sp:>10}{spread:>14}"
              f"{lat['p50']:>21.1f}{lat['p90']:>7.1f}")
        for line in row_notes(r):
            print(f"  {'':<8}^ {line}")


def row_notes(r: dict) -> list[str]:
    """The lines printed under a row (and numbered in the plot): its caveat, drafting rule, a spread over rounds
    that holds 1.0, greedy outputs that differ between the arms, and K chosen on this very set."""
    out = [r["note"]] if r.get("note") else []
    if r.get("drafting_rule"):
        out.append(f"drafting rule: {r['drafting_rule']}")
    if r.get("speedup_crosses_1") and r.get("speedup_valid", True):
        out.append("speed-up range over rounds holds 1.0: not shown faster or slower than plain")
    if r.get("greedy_mismatches"):
        f = r["greedy_first_mismatch"]
        out.append(f"greedy: {r['greedy_mismatches']} of {r['greedy_compared']} outputs differ between the arms "
                   f"(first: prompt {f['prompt']}, round {f['round'] + 1}, from token {f['position']}: plain "
                   f"{f['plain']} vs speculative {f['speculative']})")
    if r.get("k_chosen_on_this_set"):
        out.append("K was chosen on this set (export --engines): its speed-up is a little favoured")
    return out


def plot(report: dict, path: Path) -> None:
    """tau and the speed-up per set and temperature: two bar panels; a row with notes is hatched and numbered,
    its notes under the panels, and an invalid speed-up drawn as an empty bar."""
    from draftsmith.deploy.plots import _pyplot

    plt = _pyplot()
    rows = report["rows"]
    marks, footer = [], []
    for r in rows:
        lines = row_notes(r)
        if lines:
            footer.append(f"[{len(footer) + 1}] {r['set']} T={r['temperature']:g}: " + "; ".join(lines))
        marks.append(f" [{len(footer)}]" if lines else "")
    labels = [f"{r['set']}" + (f" t{r['turn']}" if r["turn"] > 1 else "") + (f" b{r['batch']}" if r["batch"] > 1
              else "") + f"\nT={r['temperature']:g}{m}" for r, m in zip(rows, marks)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(6, 1.4 * len(rows) + 3), 3.8 + 0.3 * len(footer)))
    hatch = ["//" if m else "" for m in marks]
    bars = left.bar(labels, [r["tokens_per_call"] or 0 for r in rows], color="tab:blue")
    for bar, h in zip(bars, hatch):
        bar.set_hatch(h)
    left.set_ylabel(f"{TAU}, tokens per verification pass")
    left.axhline(report["k"] + 1, ls=":", c="grey")
    valid = [r.get("speedup_valid", True) for r in rows]
    bars = right.bar(labels, [(r["speedup"] or 0) if ok else 0 for r, ok in zip(rows, valid)], color="tab:green")
    for bar, h in zip(bars, hatch):
        bar.set_hatch(h)
    for i, r in enumerate(rows):
        known = [x for x in r.get("speedup_by_round") or [] if x is not None]
        if not valid[i]:
            right.text(i, 0.05, "invalid", ha="center", rotation=90, fontsize=8)
        elif len(known) > 1:  # the range over rounds
            right.vlines(i, min(known), max(known), colors="k", lw=1.5)
    right.axhline(1.0, ls="--", c="k")
    right.set_ylabel("speed-up (tokens/s, speculative / plain)")
    fig.suptitle(f"{report['engine']} {report['version']}, K={report['k']}")
    if footer:
        fig.text(0.01, 0.01, "\n".join(footer), fontsize=7, va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.07 * len(footer) / (1 + 0.1 * len(footer)), 1, 1))
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
    ap.add_argument("--rounds", type=int, default=2,
                    help="times every request runs in each arm, the arms alternating (ABBA for vLLM and llama.cpp, "
                    "which start a server per arm and round); the speed-up's range over rounds is printed "
                    "(default: %(default)s)")
    ap.add_argument("--json", type=Path, help="write the rows, engine version, flags, K, T, top-p and template here")
    ap.add_argument("--plot", type=Path, help="write tau and the speed-up per set as a PNG here")
    args = ap.parse_args(argv)
    try:
        bundle = open_bundle(args.bundle, args.target)
        s = bundle.spec.get("sampling", {})
        temps = args.temperatures if args.temperatures is not None else [0.0, float(s.get("temperature", 0.8))]
        top_p = args.top_p if args.top_p is not None else float(s.get("top_p", 1.0))
        k = args.k or engine_k(bundle.spec, args.engine)
        # the set K was chosen on (export --engines), where the bundle's measured K is the one run
        k_set = None if args.k else ((bundle.spec.get("engine_k") or {}).get(args.engine) or {}).get("prompts")
        if args.rounds < 1:
            raise DraftsmithError(f"--rounds must be at least 1, got {args.rounds}")
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
        for_bench(engine)
        rows = measure(engine, args.engine, sets, temps, top_p, args.max_new_tokens, k, args.seed, batches, follow,
                       rounds=args.rounds, k_set=k_set)
    except ValueError as e:  # a DraftsmithError (a bad bundle, a missing engine), or bad input
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = {"engine": args.engine, "version": engine.version(),
              "build": engine.build() if hasattr(engine, "build") else None,
              "flags": list(argv if argv is not None else sys.argv[1:]), "k": k, "temperatures": temps,
              "top_p": top_p, "template": "none (raw text)" if args.raw else "the target's chat template",
              "max_new_tokens": args.max_new_tokens, "n_prompts": args.n_prompts, "seed": args.seed,
              "batches": batches, "rounds": args.rounds, "starts_per_run": getattr(engine, "starts_per_run", False),
              "prompt_cache": False, "ld_preload": getattr(engine, "ld_preload", None), "k_chosen_on": k_set,
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


def for_bench(engine) -> None:
    """Timed runs: no prompt or prefix cache carried from one row to the next (vLLM's prefix cache, llama.cpp's
    cache_prompt), so batch 4 after batch 1 on the same prompts, or a second T, pays its prefill as the first did."""
    engine.cache_prompts = False


def set_k(engine, k: int) -> None:
    """K for the engine's speculative runs, in the place each engine reads it."""
    engine.k = k
    draft = getattr(engine, "draft", None)
    if engine.name == "transformers" and draft is not None:  # assisted generation reads K from the draft's config
        draft.generation_config.update(num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                                       assistant_confidence_threshold=0.0)


if __name__ == "__main__":
    sys.exit(main())
