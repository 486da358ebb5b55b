"""Our EAGLE-3 trainer beside the peers' own trainers, on the same samples, judged by one sampler.

    draftsmith bench trainers --steps 300                        # equal optimizer steps, SmolLM2-135M
    draftsmith bench trainers --minutes 20 --json trainers.json  # equal wall time (run it alone on the machine)
    draftsmith bench trainers --install                          # only the peers' venvs (once)

One corpus of the target's own samples (`recipe=feature_head`'s, prepared once by `draftsmith data`) feeds every
trainer: the same rows, the same trained tokens (the sampled ones; the prompt is context), the same pruned head
(our run's `d2t`, handed to each peer). Trainers (`--trainers`):

- `ours`: `python -m draftsmith.train.draft recipe=feature_head` on that corpus, as a subprocess;
- `speculators`: speculators 0.9.0's own trainer (`peers.py`), its own defaults for its own knobs (Muon, the three
  norms, 3 unrolled steps), what a CPU forces aside; `speculators-matched`: the same trainer set to ours where its
  command line allows (AdamW, the norms off, 4 steps);
- `specforge`: SpecForge 0.2.0's own trainer, its own defaults (AdamW 1e-4, 7 unrolled steps), its head exported
  by its own `specforge export`; `specforge-matched`: 4 unrolled steps as ours; a peer that cannot install or
  run here is one line saying why;
- `independent`: our shallow-wide independent draft (`recipe=shallow_wide`) on the same corpus and budget (no peer
  trains one).

Budget: `--steps N` (each trainer N optimizer steps of about the same tokens: ours 4 x 256 positions a step, the
peers one packed sequence of `--seq-len` 1024), or `--minutes M` (ours and the independent draft by their time
box; a peer by the steps its own logged step time fits in M minutes after its start-up, both measured by a short
probe run, with an interrupt at 1.2 M as a backstop).
Each run's wall time and peak RSS (its process tree) are recorded. The judge: `draftsmith bench acceptance` on
every head at once: alpha_on_target per prompt set, on the same continuations, at the deployment T and greedy.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from draftsmith.sampling.cli import examples
from draftsmith.sampling.errors import DraftsmithError

TRAINERS = ("ours", "speculators", "speculators-matched", "specforge", "specforge-matched", "independent")
# the run in a child whose peak RSS (ru_maxrss of its waited children) is this run's alone; a SIGINT backstop
_MEASURE = ("import resource, subprocess, sys, signal; p = subprocess.Popen(sys.argv[2:]); limit = float(sys.argv[1])\n"
            "try:\n    rc = p.wait(timeout=limit if limit > 0 else None)\n"
            "except subprocess.TimeoutExpired:\n    p.send_signal(signal.SIGINT); rc = p.wait()\n"
            "print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, rc, flush=True)")


def measured(cmd: list[str], log: Path, *, env=None, limit_s: float = 0, cwd=None) -> dict:
    """Run `cmd` (its output to `log`), timed, with its peak RSS; interrupted (SIGINT) after `limit_s` if > 0."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        res = subprocess.run([sys.executable, "-c", _MEASURE, str(limit_s), *cmd], stdout=subprocess.PIPE,
                             stderr=f, text=True, env=env, cwd=cwd)
    wall = time.perf_counter() - t0
    lines = res.stdout.strip().splitlines()
    with open(log, "a") as f:
        f.write("\n".join(lines[:-1]))
    tail = lines[-1].split() if lines else []
    if len(tail) != 3 or tail[0] != "MAXRSS_KB":
        raise DraftsmithError(f"{cmd[0]} ... died without a word: see {log}")
    if tail[2] != "0":
        text = log.read_text(errors="replace").strip().splitlines()
        raise DraftsmithError(f"exit {tail[2]}: " + " | ".join(text[-6:]) + f" (all of it: {log})")
    return {"wall_s": wall, "peak_rss_mb": int(tail[1]) / 1024, "stdout": "\n".join(lines[:-1])}


def data_overrides(args, samples: int | None = None) -> list[str]:
    """The corpus every run of ours reads (the same overrides find the same cached file: its name holds neither the
    prompt count nor the samples per prompt). With `samples`, the prepared corpus' count, a training run asks for no
    more than the file holds, so it samples nothing: given the preparing overrides it would continue the file for
    another time box, and train on more samples than the peers were handed."""
    n, per, box = (samples, 1, 0.01) if samples else (args.n_prompts, args.samples_per_prompt, args.sample_minutes)
    return [f"target.name={args.target}", f"data.generated.n_prompts={n}",
            f"data.generated.samples_per_prompt={per}", f"data.generated.max_new_tokens={args.max_new_tokens}",
            f"data.generated.max_minutes={box}", f"seed={args.seed}"]


def ours_command(recipe: str, args, run: Path, steps: int | None, minutes: float | None,
                 samples: int | None = None) -> list[str]:
    budget = ([f"trainer.max_steps={steps}", "trainer.max_time=null",
               f"trainer.val_check_interval={min(steps, 200)}"] if steps else
              [f"trainer.max_time=00:00:{int(minutes):02d}:{int(round(minutes % 1 * 60)):02d}"])
    return [sys.executable, "-m", "draftsmith.train.draft", f"recipe={recipe}", *data_overrides(args, samples),
            *budget, "logger=csv", f"hydra.run.dir={run}", *args.overrides]


def prepare_corpus(args, out: Path) -> tuple[Path, int]:
    """The corpus' file and its sample count, sampled (or continued) once, before any trainer."""
    cmd = [sys.executable, "-m", "draftsmith.train.draft", "recipe=feature_head", "prepare_only=true",
           *data_overrides(args), f"hydra.run.dir={out / 'corpus'}", *args.overrides]
    res = measured(cmd, out / "corpus.log")
    m = re.search(r"the corpus is ready: (\d+) samples in (\S+?);", res["stdout"])
    if not m:
        raise DraftsmithError(f"the corpus step named no file: see {out / 'corpus.log'}")
    return Path(m.group(2)), int(m.group(1))


STEP_TIME = {"speculators": (r"profile/step_ms=([0-9.e+-]+)", 1e-3),
             "specforge": (r"'perf/optimizer_step_time_s': ([0-9.e+-]+)", 1.0)}


def probe(cmd_of, out: Path, name: str, probe_steps: int, seconds: float) -> int:
    """The steps a peer fits in `seconds` here: its own logged step time from a short run, its start-up (the rest
    of that run's wall time) paid once."""
    from draftsmith.deploy.bench import peers

    peer = name.split("-")[0]
    log = out / f"{name}-probe.log"
    r = measured(cmd_of(out / f"{name}-probe", probe_steps), log, env=peers.clean_env(peers.PEERS[peer].env))
    pattern, scale = STEP_TIME[peer]
    step = _logged_mean(log, pattern)
    step = step * scale if step else r["wall_s"] / probe_steps
    start = max(0.0, r["wall_s"] - probe_steps * step)
    return max(1, int((seconds - start) / step))


def main(argv=None, prog=None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0], epilog=examples(__doc__),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--trainers", nargs="+", default=list(TRAINERS), choices=TRAINERS)
    ap.add_argument("--install", action="store_true",
                    help="only install the peers' venvs under $DRAFTSMITH_HOME/peers (once; CI's install phase)")
    budget = ap.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, help="equal optimizer steps")
    budget.add_argument("--minutes", type=float, help="equal wall time per trainer (alone on the machine)")
    ap.add_argument("--n-prompts", type=int, default=1024, help="prompts the target continues for the corpus")
    ap.add_argument("--samples-per-prompt", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--sample-minutes", type=float, default=14, help="time box of the corpus' sampling")
    ap.add_argument("--seq-len", type=int, default=1024, help="a peer's packed sequence a step (ours: 4 x 256)")
    ap.add_argument("--probe-steps", type=int, default=10, help="--minutes: a peer's speed measured on this many")
    ap.add_argument("--judge-prompts", nargs="+", default=["chat", "code", "english"])
    ap.add_argument("--judge-n", type=int, default=32, help="prompts per judged set")
    ap.add_argument("--judge-tokens", type=int, default=64, help="the target's continuation of each judged prompt")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-trainers", help="the runs, logs and heads")
    ap.add_argument("--json", help="write the table here too")
    ap.add_argument("overrides", nargs="*", help="extra overrides for our runs (after --)")
    args = ap.parse_args(argv)
    if not args.install and not (args.steps or args.minutes):
        ap.error("give the budget: --steps N or --minutes M")
    try:
        if args.install:
            from draftsmith.deploy.bench import peers

            for name in peers.PEERS:
                python = peers.install(name)
                print(f"{name} {peers.PEERS[name].version}: {python} ({peers.venv_size(name) / 2**30:.1f} GiB)")
            return 0
        return _run(args)
    except DraftsmithError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    from transformers import AutoConfig

    from draftsmith.deploy.bench import peers
    from draftsmith.sampling.names import resolve
    from draftsmith.sampling.machine import machine

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    minutes = args.minutes
    limit = 1.2 * 60 * minutes if minutes else 0
    results: dict[str, dict] = {}
    heads: dict[str, str] = {}
    wanted = list(dict.fromkeys(args.trainers))
    if "ours" not in wanted and any(t.startswith(("speculators", "specforge")) for t in wanted):
        wanted.insert(0, "ours")  # its head's vocabulary is the one every peer gets
    unable: dict[str, str] = {}
    for name in ("speculators", "specforge"):
        if any(t.startswith(name) for t in wanted):
            try:
                peers.install(name)
            except DraftsmithError as e:
                unable[name] = str(e)
    print(f"draftsmith: the corpus ({args.target}, {args.n_prompts} prompts x {args.samples_per_prompt}, "
          f"{args.max_new_tokens} tokens)", flush=True)
    corpus, samples = prepare_corpus(args, out)
    target_dir = resolve(args.target)
    tc = AutoConfig.from_pretrained(target_dir)

    for recipe, name in (("feature_head", "ours"), ("shallow_wide", "independent")):
        if name not in wanted:
            continue
        print(f"draftsmith: training {name} (recipe={recipe})", flush=True)
        r = measured(ours_command(recipe, args, out / name, args.steps, minutes, samples), out / f"{name}.log")
        report = json.loads((out / name / "report.json").read_text())
        heads[name] = report["best_draft"]
        results[name] = {"wall_s": r["wall_s"], "peak_rss_mb": r["peak_rss_mb"],
                         "tokens_per_s": report.get("train_tokens_per_s"), "steps": args.steps}

    peer_runs = [t for t in wanted if t.startswith(("speculators", "specforge")) and t.split("-")[0] not in unable]
    if peer_runs:
        from draftsmith.sampling.load import load_model

        ours = Path(heads["ours"])
        layers = list(load_model(str(ours), "fp32").feature_layers)  # what our head read: every peer reads it
        vocab = peers.write_vocab(peers.head_tokens_of(ours), tc.vocab_size, out / "vocab")
        names = sorted({t.split("-")[0] for t in peer_runs})
        data = peers.prepare(corpus, target_dir, layers, out / "peer-data", peers=names, max_length=args.seq_len)
        print(f"draftsmith: the peers' data: {data['rows']} rows, {data['trained_tokens']} trained tokens, "
              f"feature layers {layers}, a {vocab['size']}-token head", flush=True)
    for name in peer_runs:
        matched = name.endswith("-matched")
        if name.startswith("speculators"):

            def cmd_of(save, steps, matched=matched):
                return peers.speculators_command(target_dir=target_dir, data=out / "peer-data" / "speculators",
                                                 vocab=vocab, layers=layers, save=save, steps=steps,
                                                 seq_len=args.seq_len, matched=matched)
        else:
            sf_target = peers.specforge_target(target_dir, out / "peer-data" / "specforge" / "target")
            draft_cfg = peers.specforge_draft_config(tc, layers, vocab["size"], out / name / "draft.json")
            lm_head = "lm_head.weight" if not tc.tie_word_embeddings else "model.embed_tokens.weight"

            def cmd_of(save, steps, matched=matched, sf_target=sf_target, draft_cfg=draft_cfg, lm_head=lm_head):
                return peers.specforge_run(target_dir=sf_target, features=out / "peer-data" / "specforge" / "features",
                                           draft_config=draft_cfg, vocab=vocab, out=save, steps=steps,
                                           max_length=args.seq_len, lm_head_key=lm_head, matched=matched)[0]
        steps = args.steps
        if minutes:
            steps = probe(cmd_of, out, name, args.probe_steps, 60 * minutes)
        print(f"draftsmith: training {name} ({steps} steps)", flush=True)
        save = out / name
        env = peers.clean_env(peers.PEERS[name.split("-")[0]].env)
        try:
            r = measured(cmd_of(save, steps), out / f"{name}.log", env=env, limit_s=limit)
            if name.startswith("speculators"):
                heads[name] = str(peers.speculators_checkpoint(save))
                tps = _logged_mean(out / f"{name}.log", r"profile/tokens_per_s=([0-9.e+-]+)")
            else:
                ckpt = sorted((save / "out").glob("specforge-run-step*"), key=lambda p: int(p.name.rsplit("p", 1)[1]))
                if not ckpt:
                    raise DraftsmithError(f"SpecForge left no checkpoint in {save / 'out'}")
                heads[name] = str(peers.specforge_export(ckpt[-1], draft_cfg, vocab, target_dir, save / "export"))
                tps = None  # it logs samples/s, not tokens: tokens/s is left to the row's own wall time
        except DraftsmithError as e:
            unable[name] = str(e)
            continue
        results[name] = {"wall_s": r["wall_s"], "peak_rss_mb": r["peak_rss_mb"], "steps": steps, "tokens_per_s": tps}
    for name, why in unable.items():
        print(f"draftsmith: {name} did not run: {why}", flush=True)
        for t in wanted:
            if t.startswith(name) and t not in results:
                results[t] = {"error": why}

    judged = {}
    for label, temp in (("T", None), ("greedy", 0.0)):
        names = [n for n in heads]
        cmd = [sys.executable, "-m", "draftsmith.deploy.cli", "bench", "acceptance", *[heads[n] for n in names],
               "--target", args.target, "--prompts", *args.judge_prompts, "--n-prompts", str(args.judge_n),
               "--max-new-tokens", str(args.judge_tokens), "-k", str(args.k), "--seed", str(args.seed),
               "--json", str(out / f"judge-{label}.json")]
        if temp is not None:
            cmd += ["--temperature", str(temp)]
        measured(cmd, out / f"judge-{label}.log")
        table = json.loads((out / f"judge-{label}.json").read_text())
        judged[label] = {"temperature": table["temperature"],
                         "alpha_on_target": dict(zip(names, table["alpha_on_target"].values()))}
    m = machine()
    print(f"\n{m['cpu']}, {m['threads']} threads, torch {m['torch']}; target {args.target}; budget "
          + (f"{args.steps} steps" if args.steps else f"{minutes} min") + f"; K={args.k}")
    sets = args.judge_prompts
    cols = [f"{label}/{ps}" for label in judged for ps in sets]
    temps = ", ".join(f"{k}: T={v['temperature']}" for k, v in judged.items())
    print(f"alpha_on_target per set ({temps}), each head on the same continuations")
    print(f"{'trainer':<22}{'steps':>7}{'wall s':>8}{'tok/s':>8}{'RSS MB':>8}" + "".join(f"{c:>16}" for c in cols))
    for name in wanted:
        r = results.get(name, {})
        if "error" in r:
            print(f"{name:<22}  did not run: {r['error'][:100]}")
            continue
        tps = r.get("tokens_per_s")
        row = (f"{name:<22}{r.get('steps') or '-':>7}{r['wall_s']:>8.0f}{(f'{tps:.0f}' if tps else '-'):>8}"
               f"{r['peak_rss_mb']:>8.0f}")
        for label in judged:
            a = judged[label]["alpha_on_target"].get(name, {})
            row += "".join(f"{a.get(ps, float('nan')):>16.3f}" for ps in sets)
        print(row)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": m, "target": args.target, "steps": args.steps, "minutes": minutes, "k": args.k,
            "corpus": str(corpus), "heads": heads, "runs": results, "judge": judged,
            "command": "draftsmith bench trainers " + " ".join(sys.argv[1:])}, indent=1, default=str))
    return 0


def _logged_mean(log: Path, pattern: str) -> float | None:
    """The mean of a figure a trainer logs (speculators' `profile/tokens_per_s`), its first logged step left out."""
    vals = [float(v) for v in re.findall(pattern, log.read_text(errors="replace"))]
    vals = vals[1:] or vals
    return sum(vals) / len(vals) if vals else None


if __name__ == "__main__":
    raise SystemExit(main())
