"""`draftsmith`: one command, a verb for each step of making, measuring and shipping a draft.

Each verb takes what the one before it made: `train` writes a run directory, `export` turns it into a bundle, and
`generate`, `bench` and `deploy-check` take either (a bundle's draft, target and recommended K; a run's best draft
and target). argparse subcommands, not Typer: no dependency, and `draftsmith --help` imports nothing heavy (each
verb imports its module when it runs).
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import import_module

# verb: (module, one line, example). The modules' own parsers hold each verb's options.
VERBS = {
    "train": ("draftsmith.train.draft", "train a draft against a target (Hydra overrides, as python train/draft.py)",
              "draftsmith train recipe=shallow_wide"),
    "plan": ("draftsmith.train.draft", "what each rank would hold under each strategy, from the target's config alone",
             "draftsmith plan recipe=paper_ratio_70b trainer.devices=8"),
    "recipes": ("draftsmith.deploy.recipes", "the recipes there are, one line each, or one recipe's file to read or copy",
                "draftsmith recipes gpu_8b"),
    "generate": ("draftsmith.sampling.generate", "speculative sampling with a draft, a bundle or a run; prints "
                 "the text and its statistics", 'draftsmith generate BUNDLE --prompt "def fib(n):"'),
    "export": ("draftsmith.deploy.export", "a bundle that transformers, vLLM, llama.cpp and our sampler load as is",
               "draftsmith export outputs/DATE/TIME --out bundles/my-draft"),
    "deploy-check": ("draftsmith.deploy.conformance", "is an engine's speculative decoding of a bundle lossless?",
                     "draftsmith deploy-check bundles/my-draft --engine vllm"),
    "engines": ("draftsmith.engines", "which engines are installed; install vLLM (its own venv) or llama.cpp",
                "draftsmith engines install vllm"),
    "bench": ("draftsmith.deploy.bench", "benchmarks: paper, sampler, corpus, memory, store, train-memory, ablation",
              "draftsmith bench paper bundles/my-draft"),
}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="draftsmith", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="examples:\n" + "\n".join(f"  {ex}" for _, _, ex in VERBS.values())
                                 + "\n\n`draftsmith VERB --help` for a verb's options.")
    sub = ap.add_subparsers(dest="verb", metavar="VERB", title="verbs")
    for name, (_, summary, _) in VERBS.items():
        sub.add_parser(name, help=summary, add_help=False)
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = _parser()
    if not argv or argv[0] in ("-h", "--help"):
        ap.print_help()
        return 0
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        ap.error(f"unknown verb {verb!r}: choose one of {', '.join(VERBS)}")
    module, summary, example = VERBS[verb]
    prog = f"draftsmith {verb}"
    if verb in ("train", "plan"):
        return _hydra(verb, rest, summary, example)
    if verb == "bench":
        return _bench(rest)
    return import_module(module).main(rest, prog=prog) or 0


def _hydra(verb: str, overrides: list[str], summary: str, example: str) -> int:
    """`train` and `plan` hand their overrides to the training entry's Hydra app, as `python train/draft.py` does."""
    if any(a in ("-h", "--help") for a in overrides):
        from draftsmith.deploy.recipes import overview

        print(f"usage: draftsmith {verb} [OVERRIDE ...]\n\n{summary}.\n\nexamples:\n  {example}\n  draftsmith {verb} "
              f"recipe=smoke    # a tiny end-to-end check\n\n{overview()}\n\nOverrides are Hydra's (group=choice, "
              f"key=value; docs/training.md). The whole config a command line composes, without running it: "
              f"draftsmith {verb} recipe=NAME [OVERRIDE ...] --cfg job. Hydra's own help: draftsmith {verb} "
              "--hydra-help")
        return 0
    if verb == "plan":
        overrides = [*overrides, "plan=true"]
    from importlib.util import find_spec

    entry = find_spec("draftsmith.train.draft").origin
    # this process becomes `python train/draft.py OVERRIDES` itself: Lightning's own launcher starts a run's other
    # ranks by running this process' script again (a console script, or `-m draftsmith.deploy.cli`, would start them
    # as another verb), and Hydra names the job after it
    os.execv(sys.executable, [sys.executable, entry, *overrides])


def _bench(argv: list[str]) -> int:
    from draftsmith.deploy.bench import BENCHES

    if not argv or argv[0] in ("-h", "--help"):
        print("usage: draftsmith bench NAME [options]\n\nbenchmarks:")
        for name, (_, summary) in BENCHES.items():
            print(f"  {name:<14}{summary}")
        print("\nexample:\n  draftsmith bench paper bundles/my-draft\n\n`draftsmith bench NAME --help` for its "
              "options.")
        return 0
    if argv[0] not in BENCHES:
        print(f"error: unknown benchmark {argv[0]!r}: choose one of {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    module, _ = BENCHES[argv[0]]
    return import_module(f"draftsmith.deploy.bench.{module}").main(argv[1:], prog=f"draftsmith bench {argv[0]}") or 0


if __name__ == "__main__":
    sys.exit(main())
