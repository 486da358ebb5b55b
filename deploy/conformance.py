"""Is an engine's speculative decoding lossless? Judge it against the target. The command is
`draftsmith deploy-check` (this module's `main`):

    draftsmith deploy-check BUNDLE --engine transformers
    draftsmith deploy-check BUNDLE --engine vllm --draws 4000

The engine runs the bundle's pair with speculative decoding and without, on the same prompts and settings:
- greedy: speculative output equals the engine's plain decoding token for token. A divergence where the target's
  two candidates are within rounding of each other (fp32 logits closer than `tie_tol`, or, for an engine that
  computes in bf16 or fp16, than twice how far its logits move with the shape of the pass: `shape_noise`) is a
  tie, not a failure.
- sampling: (1) the first two tokens of `draws` samples of one short prompt, binned, against the target's exact
  probabilities (fp32, transformers): Pearson chi-square at `level`, with its power against a planted bug stated
  (after a rejection, resample from q instead of norm((q - p)+)); when the engine's own plain decoding fails the
  same test (its precision moves the target's probabilities), speculative samples are judged against plain ones
  instead (two-sample chi-square). (2) The target's mean log-probability per token of long samples, speculative
  against plain (Welch t-test at `level`): garbage text cannot hide in a few-token test.
Results go to the bundle's card (`deployment` in speculative.json, a table in README.md).
Exit status: 0 every setting passes, 3 one failed (named), 2 bad input (bundle, engine not installed).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from scipy import stats

from draftsmith.deploy.bundle import Bundle, open_bundle, write_card
from draftsmith.sampling.cli import engine_k, examples
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.exactness import CHI_PROMPT, LEVEL, PairCells, chi2_power, pair_cells, two_sample_pvalue
from draftsmith.sampling.feature import FeatureTap, is_feature_draft
from draftsmith.sampling.machine import machine
from draftsmith.sampling.probs import SamplingConfig, sequence_logprob
from draftsmith.sampling.prompts import load_prompts
from draftsmith.sampling.runtime import DTYPE_CHOICES, prepared_model
from draftsmith.sampling.speculative import last_probs


@torch.inference_mode()
def draft_first_probs(target, draft, prompt: list[int], cfg: SamplingConfig) -> torch.Tensor:
    """(V,) the draft's processed distribution for the first new token, as the sampler sees it."""
    ids = torch.tensor([prompt])
    if is_feature_draft(draft):
        with FeatureTap(target, draft.feature_layers) as tap:
            target(ids)
            features = tap.take()
        out = draft(ids[:, 1:], features[:, :-1], torch.arange(ids.shape[1] - 1)[None])
    else:
        out = draft(ids)
    return last_probs(out, cfg)[0].double()


def planted_bug_probs(cells: PairCells, p1: torch.Tensor) -> dict:
    """Cell probabilities when the first token comes from a sampler that, after a rejection, resamples from q
    instead of norm((q - p)+): min(p, q) + (1 - sum min(p, q)) q. The second token is left exact."""
    q1 = cells.q1
    bug = torch.minimum(p1, q1) + (1 - torch.minimum(p1, q1).sum()) * q1
    out = {}
    for key, pr in cells.probs.items():
        if key == (PairCells.REST,):
            rare = torch.ones_like(q1, dtype=torch.bool)
            rare[list(cells.q2)] = False
            out[key] = float(bug[rare].sum())
        else:
            out[key] = pr * float(bug[key[0]] / q1[key[0]])
    return out


def logprob_per_token(target, prompts: list[list[int]], samples: list[list[list[int]]], temperature: float):
    """The target's mean log-probability per token of each non-empty sample."""
    return np.asarray([sequence_logprob(target, prompt, s, temperature)
                       for prompt, rows in zip(prompts, samples) for s in rows if s])


# -- the check --------------------------------------------------------------------------------------------------
@dataclass
class Setting:
    temperature: float
    top_p: float = 1.0

    @property
    def name(self) -> str:
        return "greedy" if self.temperature == 0 else f"T{self.temperature:g} top-p {self.top_p:g}"


def _tok_s(out) -> float:
    return out.new_tokens / out.seconds if out.seconds > 0 else float("nan")


def check(bundle: Bundle, engine, settings: list[Setting], *, draws: int = 2000, n_prompts: int = 4,
          samples: int = 4, max_new_tokens: int = 48, level: float = LEVEL, tie_tol: float = 1e-3,
          seed: int = 0, texts: list[str] | None = None) -> dict:
    """Run the engine with and without the draft on every setting's jobs (one engine start per mode) and judge.
    texts: the prompts of the greedy and long jobs (None: `n_prompts` of the shipped code and English ones)."""
    from transformers import AutoTokenizer

    from draftsmith.engines.base import Job

    tok = AutoTokenizer.from_pretrained(bundle.target_dir)
    reference = prepared_model(str(bundle.target_dir), "fp32")
    eos = reference.generation_config.eos_token_id
    if texts is None:
        texts = [r["prompt"] for ps in ("code", "english") for r in load_prompts(ps, (n_prompts + 1) // 2)]
        texts = texts[:n_prompts]
    prompts = [tok(t).input_ids for t in texts]
    chi_prompt = tok(CHI_PROMPT).input_ids
    # a first short job in each mode takes the warm-up (allocations, thread pools) out of the timed ones
    jobs, timed_at = [Job(prompts[:1], 1, 8, 0.0)], []  # timed_at: the job each setting's tokens/s is read from
    for i, s in enumerate(settings):
        if s.temperature == 0:
            jobs.append(Job(prompts, 1, max_new_tokens, 0.0))
        else:
            jobs.append(Job([chi_prompt], draws, 2, s.temperature, s.top_p, seed + i))
            jobs.append(Job(prompts, samples, max_new_tokens, s.temperature, s.top_p, seed + 100 + i))
        timed_at.append(len(jobs) - 1)
    print(f"{engine.name}: plain decoding ({len(jobs)} jobs)...", file=sys.stderr)
    plain = engine.run(jobs, speculative=False)[1:]
    print(f"{engine.name}: speculative decoding ({len(jobs)} jobs)...", file=sys.stderr)
    spec = engine.run(jobs, speculative=True)[1:]

    variants = {}
    for label, other in engine.variants().items():  # the timed jobs again, speculative, for their speed alone
        print(f"{engine.name}: speculative decoding, {label} ({len(timed_at)} jobs)...", file=sys.stderr)
        variants[label] = other.run([jobs[0]] + [jobs[i] for i in timed_at], speculative=True)[1:]

    results, j, draft = {}, 0, None
    for n, s in enumerate(settings):
        if s.temperature == 0:
            noise = 0.0
            if getattr(engine, "precision", "fp32") != "fp32":  # ties at the precision the engine computed in
                noise = shape_noise(engine.target, prompts, [c for (c,) in plain[j].tokens])
            r = _judge_greedy(reference, prompts, plain[j].tokens, spec[j].tokens, tie_tol, noise)
            r["shape_noise"] = noise
            timed = (plain[j], spec[j])
            j += 1
        else:
            cfg = SamplingConfig(s.temperature, 0, s.top_p)
            draft = draft or prepared_model(str(bundle.draft_dir), "fp32")
            r = _judge_sampling(reference, draft, chi_prompt, cfg, draws, eos, plain[j], spec[j], prompts,
                                plain[j + 1], spec[j + 1], level)
            timed = (plain[j + 1], spec[j + 1])
            j += 2
        r["tok_s_plain"], r["tok_s_speculative"] = _tok_s(timed[0]), _tok_s(timed[1])
        r["speedup"] = r["tok_s_speculative"] / r["tok_s_plain"]
        d, a = timed[1].drafted, timed[1].accepted
        r["engine_acceptance"] = a / d if d else None
        if d == 0:  # it reports its drafts and made none: speculative decoding never ran, nothing was judged
            r["verdict"], r["detail"] = "fail", "the engine drafted no token: speculative decoding never ran"
        r["engine_counts"] = {"drafted": d, "accepted": a, **timed[1].extra}
        r["variants"] = {}
        for label, outs in variants.items():
            o = outs[n]
            r["variants"][label] = {"tok_s_speculative": _tok_s(o), "speedup": _tok_s(o) / r["tok_s_plain"],
                                    "engine_acceptance": o.accepted / o.drafted if o.drafted else None,
                                    # greedy: the same tokens as plain decoding, as the judged run had to
                                    "identical": o.tokens == timed[0].tokens if s.temperature == 0 else None}
        results[s.name] = r
    return {"engine": engine.name, "version": engine.version(), "precision": getattr(engine, "precision", "fp32"),
            "verdict":
            "pass" if all(r["verdict"] == "pass" for r in results.values()) else "fail",
            "k": engine_k(bundle.spec, engine.name), "draws": draws, "level": level,
            "date": datetime.date.today().isoformat(), "machine": machine(), "settings": results}


@torch.inference_mode()
def shape_noise(target, prompts: list[list[int]], continuations: list[list[int]]) -> float:
    """How far the target's logits move with the shape of the pass that computes them, in its own precision: the
    largest |logit| difference between one pass over prompt + continuation (as a verify pass scores K + 1 tokens)
    and the same positions decoded one token at a time. In bf16 it is a good part of a logit (the products round
    differently), so greedy speculative decoding can take the other of two candidates that close: a tie its
    precision decides, not a fault of its speculation. In fp32 it is ~1e-5."""
    from transformers import DynamicCache

    worst = 0.0
    for prompt, cont in zip(prompts, continuations):
        ids = torch.tensor([prompt + cont])
        full = target(input_ids=ids).logits[0, len(prompt) - 1:].float()
        cache = DynamicCache(config=target.config)
        steps = [target(input_ids=ids[:, : len(prompt)], cache=cache, use_cache=True).logits[0, -1:].float()]
        for t in range(len(prompt), ids.shape[1]):
            steps.append(target(input_ids=ids[:, t: t + 1], cache=cache, use_cache=True).logits[0].float())
        worst = max(worst, float((full - torch.cat(steps)).abs().max()))
    return worst


def _judge_greedy(reference, prompts, plain, spec, tie_tol, noise: float = 0.0) -> dict:
    equal = ties = 0
    failures = []
    for prompt, (a,), (b,) in zip(prompts, plain, spec):
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is None and len(a) == len(b):
            equal += 1
            continue
        if i is None:  # one stopped (EOS) where the other went on: compare at the shorter end
            failures.append(f"lengths differ ({len(a)} vs {len(b)} tokens)")
            continue
        with torch.inference_mode():
            logits = reference(torch.tensor([prompt + a[:i]])).logits[0, -1].float()
        gap = abs(float(logits[a[i]] - logits[b[i]]))
        if gap < max(tie_tol, 2 * noise):  # each candidate's logit may move by the noise
            ties += 1
        else:
            failures.append(f"token {i}: plain {a[i]}, speculative {b[i]} (target logits {gap:.3g} apart)")
    verdict = "pass" if not failures else "fail"
    within = f" within the target's shape noise ({noise:.2g})" if noise > tie_tol else ""
    detail = f"{equal}/{len(prompts)} identical" + (f", {ties} near-tie divergence(s){within}" if ties else "")
    if failures:
        detail += "; " + "; ".join(failures[:3])
    return {"verdict": verdict, "detail": detail, "identical": equal, "ties": ties, "prompts": len(prompts)}


def _judge_sampling(reference, draft, chi_prompt, cfg, draws, eos, plain_few, spec_few, prompts, plain_long,
                    spec_long, level) -> dict:
    cells = pair_cells(reference, chi_prompt, cfg, draws, eos)
    c_spec, c_plain = cells.counts(spec_few.tokens[0]), cells.counts(plain_few.tokens[0])
    p_spec, p_plain = cells.pvalue(c_spec), cells.pvalue(c_plain)
    null = list(cells.probs.values())
    alt = list(planted_bug_probs(cells, draft_first_probs(reference, draft, chi_prompt, cfg)).values())
    power = chi2_power(null, alt, draws, level)
    dist = {"draws": draws, "cells": len(cells.probs), "p_speculative": p_spec, "p_plain": p_plain,
            "power_vs_planted_bug": power}
    if p_spec >= level:
        dist_ok, how = True, "matches the target's exact probabilities"
    elif p_plain >= level:
        dist_ok, how = False, "differs from the target's exact probabilities (plain decoding matches them)"
    else:  # the engine's target is not the fp32 one (precision): compare speculative with its own plain samples
        p2 = two_sample_pvalue(c_spec, c_plain)
        dist["p_speculative_vs_plain"] = p2
        dist_ok = p2 >= level
        how = ("plain decoding departs from fp32 probabilities too; speculative " +
               ("matches" if dist_ok else "differs from") + " plain (two-sample)")
    t = cfg.temperature
    lp_s = logprob_per_token(reference, prompts, spec_long.tokens, t)
    lp_p = logprob_per_token(reference, prompts, plain_long.tokens, t)
    p_lp = float(stats.ttest_ind(lp_s, lp_p, equal_var=False).pvalue) if len(lp_s) > 1 and len(lp_p) > 1 else 1.0
    lp_ok = not (p_lp < level)
    pairs = [(x, y) for a, b in zip(spec_long.tokens, plain_long.tokens) for x, y in zip(a, b)]
    logprob = {"speculative": float(lp_s.mean()), "plain": float(lp_p.mean()), "p": p_lp, "samples": len(lp_s),
               # an engine that samples from the target's own sampler and keeps the drafts that match reproduces
               # plain decoding exactly for the same seed (llama.cpp); a rejection sampler does not
               "identical_to_plain": sum(x == y for x, y in pairs) / max(len(pairs), 1)}
    detail = (f"first two tokens: {how} (p {p_spec:.3g}, {len(cells.probs)} cells, {draws} draws"
              f", power {power:.2f} vs planted bug); "
              f"log-prob/token {logprob['speculative']:.3f} vs plain {logprob['plain']:.3f} (p {p_lp:.3g})")
    return {"verdict": "pass" if dist_ok and lp_ok else "fail", "detail": detail, "distribution": dist,
            "logprob": logprob}


# -- the command ----------------------------------------------------------------------------------------------------
def _setting(value: str) -> Setting:
    try:
        t, _, p = value.partition(":")
        return Setting(float(t), float(p) if p else 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a sampling setting is TEMPERATURE[:TOP_P], e.g. 0.8:0.95; got {value!r}")


def _bundle_of(path: Path) -> Path:
    """A bundle as it is; a run directory's bundle, exported into RUN/bundle the first time (what the card records
    and the engines load is a bundle)."""
    if (path / "speculative.json").is_file() or not (path / "best_draft").is_dir():
        return path
    out = path / "bundle"
    if not (out / "speculative.json").is_file():
        from draftsmith.deploy.export import export

        print(f"deploy-check: {path} is a run: exporting it first (draftsmith export {path} --out {out})",
              file=sys.stderr)
        export(path, out)
    return out


def main(argv=None, prog=None) -> int:
    from draftsmith.engines import ENGINES, open_engine

    ap = argparse.ArgumentParser(prog=prog or "draftsmith deploy-check", epilog=examples(__doc__),
                                 description="Judge an engine's speculative decoding of a bundle against its target",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path, help="a bundle (draftsmith export), or a run directory: exported first into "
                    "RUN/bundle (once), and that bundle judged")
    ap.add_argument("--engine", required=True, choices=list(ENGINES))
    ap.add_argument("--target", help="the target's folder or hub id where the bundle does not hold it (the card's "
                    "TARGET; default: the copy inside the bundle, else the name it was exported with)")
    ap.add_argument("--sampling", type=_setting, nargs="+",
                    help="TEMPERATURE[:TOP_P] settings to judge (default: the bundle's own)")
    ap.add_argument("--no-greedy", action="store_true", help="skip the greedy setting")
    ap.add_argument("--draws", type=int, default=2000, help="samples of the fixed prompt for the chi-square")
    ap.add_argument("--n-prompts", type=int, default=4, help="prompts for greedy and the long samples")
    ap.add_argument("--samples", type=int, default=4, help="long samples per prompt (log-probability test)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--no-write", action="store_true", help="do not record the results in the bundle's card")
    ap.add_argument("--dtype", choices=DTYPE_CHOICES, default="fp32",
                    help="in-process engines' precision: fp32 (default: in bf16 the target's probabilities move with "
                         "the shape of the pass, so exactness cannot be judged), auto for the bundle's own")
    args = ap.parse_args(argv)
    try:
        bundle = open_bundle(_bundle_of(args.bundle), args.target)
        engine = open_engine(args.engine, bundle, "bundle" if args.dtype == "auto" else args.dtype)
    except ValueError as e:  # a DraftsmithError (a bad bundle, a missing engine), or bad input
        print(f"error: {e}", file=sys.stderr)
        return 2
    s = bundle.spec.get("sampling", {})
    settings = ([] if args.no_greedy else [Setting(0.0)]) + (
        args.sampling or [Setting(s.get("temperature", 1.0), s.get("top_p", 1.0))])
    try:
        report = check(bundle, engine, settings, draws=args.draws, n_prompts=args.n_prompts, samples=args.samples,
                       max_new_tokens=args.max_new_tokens)
    except DraftsmithError as e:  # the engine ran and failed (its own words), or was stopped
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a crash inside the engine's own code: name the engine, the bundle and the cause
        cause = (str(e).strip().splitlines() or [""])[0][:200]
        print(f"error: {args.engine} failed on {args.bundle}: {type(e).__name__}: {cause} (a bug of that engine "
              "or of draftsmith's adapter for it; please report it with this line)", file=sys.stderr)
        return 2
    print(f"{report['engine']} {report['version']}, K={report['k']}, {report['machine'].get('cpu', '')}")
    for name, r in report["settings"].items():
        acc = "" if r["engine_acceptance"] is None else f", engine acceptance {r['engine_acceptance']:.3f}"
        print(f"  {name:<18} {r['verdict'].upper():<4}  {r['detail']}")
        print(f"  {'':<18}       tokens/s {r['tok_s_plain']:.1f} plain, {r['tok_s_speculative']:.1f} speculative "
              f"({r['speedup']:.2f}x){acc}")
        for label, v in r.get("variants", {}).items():
            same = {True: ", identical to plain", False: ", DIFFERS from plain", None: ""}[v["identical"]]
            acc = "" if v["engine_acceptance"] is None else f", engine acceptance {v['engine_acceptance']:.3f}"
            print(f"  {'':<18}       with the {label}: {v['tok_s_speculative']:.1f} speculative "
                  f"({v['speedup']:.2f}x){acc}{same}")
    if not args.no_write:
        write_card(bundle, report)
        print(f"recorded in {bundle.path / 'speculative.json'} (deployment.{report['engine']}) and README.md")
    failed = [n for n, r in report["settings"].items() if r["verdict"] != "pass"]
    if failed:
        print(f"FAIL: {report['engine']} is not lossless at: {', '.join(failed)}", file=sys.stderr)
        return 3
    return 0
