"""Generate with speculative sampling and print the text and its statistics.

    draftsmith generate bundles/my-draft --prompt "def fib(n):"    # the bundle's target, K and settings
    draftsmith generate outputs/DATE/TIME --prompt "def fib(n):"   # a run's best draft and its target
    draftsmith generate DIR --target smollm2-135m --prompt "def fib(n):" -k 2 --temperature 0.8
    draftsmith generate --target smollm2-135m --prompt "Hello"             # no draft: plain autoregressive

A bundle brings its target, the K it recommends and the temperature / top-p it was measured at; a run directory
its best draft and target; any of them given here wins.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from draftsmith.sampling.cli import Draft, add_artifact, artifact_of, examples, locate_draft, target_of
from draftsmith.sampling.compiled import compile_report
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.feature import is_feature_dir, is_feature_draft
from draftsmith.sampling.load import check_same_tokenizer, load_tokenizer
from draftsmith.sampling.machine import default_device, device_of, seeded
from draftsmith.sampling.probs import SamplingConfig
from draftsmith.sampling.prompts import user_turn
from draftsmith.sampling.pruned import PrunedHeadDraft, prune_from_dir
from draftsmith.sampling.runtime import DTYPE_CHOICES, prepared_model
from draftsmith.sampling.speculative import autoregressive_generate, speculative_generate
from draftsmith.sampling.stats import TAU


def parse_args(argv=None, prog=None):
    ap = argparse.ArgumentParser(prog=prog or "draftsmith generate", description=__doc__.splitlines()[0],
                                 epilog=examples(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_artifact(ap, "a bundle, a run directory or a draft checkpoint (same tokenizer as the target); omit for "
                 "plain sampling")
    ap.add_argument("--target", help="alias, hub id, checkpoint dir or .gguf (default: the bundle's or run's target; "
                    "required otherwise)")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--chat", action="store_true",
                    help="render the prompt as one user turn through the target's chat template, with its generation "
                         "prompt (how a draft trained with data=chat meets its prompts; the template writes the BOS)")
    ap.add_argument("--enable-thinking", choices=("true", "false"),
                    help="with --chat: passed to the template (default: the template's; a bundle's card names the "
                         "value its draft was trained with)")
    ap.add_argument("-k", help="draft tokens per loop, or 'auto': after each drafted token, one more if the draft's "
                    "confidence, the running acceptance and the measured costs say it pays (default: a bundle's "
                    "recommended K, else 4)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, help="default: the bundle's or run's, else 0.8")
    ap.add_argument("--top-k", type=int, help="default: the bundle's or run's, else 0 (off)")
    ap.add_argument("--top-p", type=float, help="default: the bundle's or run's, else 0.95")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="prune the draft head to its corpus' N most frequent tokens (exact; needs the draft dir's "
                         "token_counts.safetensors, written by train/draft.py)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                    help="precision of both models (auto: the faster one for decoding on this machine, measured once)")
    ap.add_argument("--device", default=default_device(),
                    help="where both models run (default: %(default)s, the GPU where there is one)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    ap.add_argument("--compile", action="store_true",
                    help="compiled static-shape decoding steps (torch.compile; each step shape compiles once: "
                         "tens of seconds, ~1.5 min for a bf16 model, whose weights are frozen into the graph; it "
                         "pays on long or repeated generations)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="allow a model whose config asks to run its own Python code (never the default)")
    return ap.parse_args(argv)


def _k(value: str):
    if value == "auto":
        return "auto"
    if not value.isdigit() or int(value) < 1:
        raise DraftsmithError(f"-k must be an integer >= 1 or 'auto', got {value!r}")
    return int(value)


DEFAULTS = {"temperature": 0.8, "top_p": 0.95, "top_k": 0}


def settle(args) -> Draft | None:
    """Fill what the command line left open from what the draft's source says (a bundle: target, K, settings; a
    run: target, settings), else the defaults."""
    args.draft = artifact_of(args)
    draft = locate_draft(args.draft) if args.draft else None
    said = draft.sampling if draft else {}
    args.target = target_of(args.target, draft)
    args.k = args.k or str((draft and draft.k) or 4)
    for key, default in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, said.get(key, default))
    return draft


def encode_prompt(tok, prompt: str, chat: bool = False, enable_thinking: bool | None = None):
    """(the text the target continues, its ids (1, T)): the prompt as given, or with `chat` one user turn through
    the template, tokenized without adding special tokens (the template writes the BOS: adding one more would put
    the draft and target on a prompt neither was trained on)."""
    if not chat:
        return prompt, tok(prompt, return_tensors="pt").input_ids
    text = user_turn(tok, prompt, enable_thinking)
    return text, tok(text, return_tensors="pt", add_special_tokens=False).input_ids


def main(argv=None, prog=None) -> int:
    args = parse_args(argv, prog)
    try:
        source = settle(args)
        SamplingConfig(args.temperature, args.top_k, args.top_p)  # validate before loading anything
        k = _k(args.k)
        if not args.prompt:
            raise DraftsmithError("the prompt is empty: pass --prompt TEXT")
        if args.enable_thinking and not args.chat:
            raise DraftsmithError("--enable-thinking is passed to the chat template: add --chat")
        thinking = None if args.enable_thinking is None else args.enable_thinking == "true"
        if args.threads:
            torch.set_num_threads(args.threads)
        tok = load_tokenizer(args.target)
        target = prepared_model(args.target, args.dtype, device=args.device, trust_remote_code=args.trust_remote_code)
        draft = None
        if source is not None:
            # a peer's EAGLE-3 head ships no tokenizer (it is the target's); its vocabulary is checked against the
            # target's when the pair runs (FeatureConfig.check_target)
            if not is_feature_dir(source.path) or any(Path(source.path).glob("tokenizer*")):
                check_same_tokenizer(tok, load_tokenizer(source.path))
            draft = prepared_model(source.path, args.dtype, device=args.device,
                                   trust_remote_code=args.trust_remote_code)
            if args.draft_vocab and is_feature_draft(draft):
                raise DraftsmithError("--draft-vocab prunes an independent draft; a feature draft's head is chosen in "
                                      "training (draft.draft_vocab)")
            if args.draft_vocab and isinstance(draft, PrunedHeadDraft):
                raise DraftsmithError(f"{args.draft} was trained with a head of {len(draft.token_ids)} tokens and runs "
                                      "with it: drop --draft-vocab")
            if args.draft_vocab:
                try:
                    draft = prune_from_dir(draft, source.path, args.draft_vocab, [tok.eos_token_id])
                except FileNotFoundError as e:
                    raise DraftsmithError(f"--draft-vocab needs token counts: {e}") from None
        text, ids = encode_prompt(tok, args.prompt, args.chat, thinking)
        common = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                      top_p=args.top_p, eos_token_id=tok.eos_token_id, compile=args.compile,
                      generator=seeded(device_of(target), args.seed))
        if draft is None:
            gen = autoregressive_generate(target, ids, **common)
        else:
            extra = {"alpha_prior": min(0.95, source.alpha or 0.5)} if k == "auto" else {}
            gen = speculative_generate(target, draft, ids, k=k, **common, **extra)
    except ValueError as e:  # a DraftsmithError, or bad input
        print(f"error: {e}", file=sys.stderr)
        return 2
    completion = tok.decode(gen.tokens[0], skip_special_tokens=True)
    stats = gen.stats.to_dict()
    if args.json:
        # "compiled": each decoding step shape torch.compile built (model, tokens, rows, seconds); empty when eager
        print(json.dumps({"prompt": args.prompt, "completion": completion, "stats": stats,
                          "compiled": compile_report()}))
        return 0
    print(text + completion)
    print("-" * 60)
    keys = ["k", "new_tokens", "alpha", "alpha_analytic", "tokens_per_call", "acceptance_efficiency", "target_calls",
            "draft_calls", "ms_per_token", "draft_s", "target_s", "overhead_s", "prefill_s"]
    for key in keys:
        v = stats[key]
        if v is None or (draft is None and key in ("alpha", "alpha_analytic", "acceptance_efficiency", "draft_calls")):
            continue
        label = f"{key} ({TAU})" if key == "tokens_per_call" else key
        print(f"{label:>22}: {v:.4f}" if isinstance(v, float) else f"{label:>22}: {v}")
    if draft is not None:
        pos = ", ".join("-" if a is None else f"{a:.2f}" for a in stats["acceptance_by_position"])
        print(f"{'acceptance_by_position':>22}: {pos}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
