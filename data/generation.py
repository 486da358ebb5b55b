"""The engines that sample the target's corpus (`data.generated.engine`), behind one interface: each yields the
work in batches of (first row, prompt ids, sampled tokens per row, the kept-logits record or None), and
`data/corpus.py` writes every batch to the same store, whichever engine drew it (and the seconds it took).

- `draftsmith`: our sampler's plain loop (`autoregressive_generate`), in this process; it also keeps a feature
  draft's features (the hidden states it reads), which no serving engine hands out.
- `vllm`: offline `LLM.generate` in vLLM's own venv (`engines/vllm.py` `batches`), batched, with the recipe's
  temperature and top-p, its raw top-k log-probabilities kept. Before any sample is kept, its plain sampling is
  judged against the target's probabilities in the dtype it runs (`EngineCheck`): an engine that samples the wrong
  distribution would teach the draft the wrong target. Its whole process tree ends with the run (`process_tree`).
- `auto`: the faster of the two on this machine, measured once and cached (`choose_engine`).
A corpus sampled elsewhere (`data.source=` prompt + completion pairs) comes in through `teacher_batches`: one
teacher pass writes what the loop would have kept. Work whose next rows depend on the last ones' samples (a
conversation's next turn holds the target's answer to the last: `data/chatcorpus.py` `regenerate`) asks for them
through `row_sampler`: the same batches, from our loop or from one vLLM started for all of them.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import closing, contextmanager, nullcontext
from pathlib import Path

import torch

from draftsmith.data.teacher import half_features, top_logprobs
from draftsmith.engines import vllm
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.exactness import CHI_PROMPT, LEVEL, pair_cells
from draftsmith.sampling.machine import cache_home, machine_key, read_json, write_json
from draftsmith.sampling.precision import dtype_name
from draftsmith.sampling.probs import SamplingConfig

CORPUS_ENGINES = ("draftsmith", "vllm", "auto")  # data.generated.engine
def own_batches(target, rows: list[list[int]], batch_size: int, *, seed: int, first_row: int, max_new_tokens: int,
                temperature: float, top_p: float, eos: int, pad: int = 0, keep_logits: int = 0,
                keep_features: list[int] | None = None):
    """Our sampler's plain loop over `rows` (prompt token ids), `batch_size` at a time."""
    from draftsmith.sampling import autoregressive_generate
    from draftsmith.sampling.feature import FeatureTap

    for start in range(0, len(rows), batch_size):
        chunk = rows[start: start + batch_size]
        width = max(len(r) for r in chunk)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in chunk])  # left-padded, masked
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in chunk])
        # cpu: one seed stream for any device (probs.uniform moves each draw to the target's device), so a
        # corpus cached on one machine is the corpus another would sample
        g = torch.Generator(device="cpu").manual_seed(seed + first_row + start)
        kept, prompt_features = [], []  # per step: (rows still decoding, top-k log-probs, ids[, features])

        def keep(step_rows, logits):
            # the top-k on the device: only (rows, k) values cross to the host, not the (rows, V) logits
            step = (step_rows, *(t.cpu() for t in top_logprobs(logits, keep_logits)))
            if tap is not None:
                feats = tap.take()
                if not prompt_features:  # the prefill: every prompt position; its last is step 0's
                    prompt_features.append(feats[:, :-1].cpu())
                step += (half_features(feats[:, -1]),)
            kept.append(step)

        t0 = time.perf_counter()
        with FeatureTap(target, keep_features) if keep_features else nullcontext() as tap:
            gen = autoregressive_generate(target, ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                          temperature=temperature, top_p=top_p, eos_token_id=eos, generator=g,
                                          on_logits=keep if keep_logits else None)
        record = None
        if keep_logits:
            prefill = None if tap is None else (prompt_features[0], mask, keep_features)
            record = _own_record(gen.tokens, kept, prefill)
        yield start, chunk, [t.tolist() for t in gen.tokens], record, time.perf_counter() - t0


@contextmanager
def row_sampler(engine: str, target, *, batch_size: int, max_new_tokens: int, temperature: float, top_p: float,
                eos: int, pad: int = 0, seed: int = 0, target_name: str | None = None,
                dtype: torch.dtype | None = None, check=None, max_model_len: int | None = None, **vllm_kw):
    """`sample(rows, seed, first_row)`: the engine's batches of `rows` (prompt ids), as above, for a caller that
    decides each call's rows from the last call's samples. `draftsmith`: our loop on `target`; `vllm`: one vLLM
    (`target_name` in `dtype`; `max_model_len`, the longest prompt plus its new tokens it will be given) started
    on entry, judged by `check` before the first row is sampled, and stopped, its whole process tree, on leaving."""
    common = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, eos=eos)
    if engine != "vllm":
        yield lambda rows, seed, first_row: own_batches(target, rows, batch_size, seed=seed, first_row=first_row,
                                                        pad=pad, **common)
        return
    with vllm.Session(target_name, dtype, seed=seed, check=check, max_model_len=max_model_len, **common,
                      **vllm_kw) as session:
        yield lambda rows, seed, first_row: session.batches(rows, batch_size, seed=seed, first_row=first_row)


def teacher_batches(target, rows: list[list[int]], completions: list[list[int]], batch_size: int, *, first_row: int,
                    pad: int = 0, keep_logits: int = 0, keep_features: list[int] | None = None, **_):
    """A corpus generated elsewhere (prompt + completion pairs: SGLang, TensorRT-LLM, an API log of the same model)
    through one batched teacher pass: what our loop would have kept had it sampled those completions, the target's
    top-k log-probabilities at each completion token (and a feature draft's features), in the same record."""
    from draftsmith.sampling.feature import FeatureTap

    for start in range(0, len(rows), batch_size):
        chunk, comp = rows[start: start + batch_size], completions[start: start + batch_size]
        seqs = [p + c for p, c in zip(chunk, comp)]
        width = max(len(x) for x in seqs)
        ids = torch.tensor([[pad] * (width - len(x)) + x for x in seqs])  # left-padded, as the loop pads
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in seqs])
        pos = (mask.cumsum(-1) - 1).clamp_min(0)  # a left-padded row starts at position 0, as in the loop
        t0 = time.perf_counter()
        dev = next(target.parameters()).device
        with torch.no_grad(), FeatureTap(target, keep_features) if keep_features else nullcontext() as tap:
            logits = target(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev)).logits
            feats = tap.take() if tap is not None else None
        # completion token t of a row is drawn from the logits at the position before it
        at = [torch.arange(width - len(c) - 1, width - 1) for c in comp]
        values, index = (t.cpu() for t in top_logprobs(torch.cat([logits[r, a.to(dev)] for r, a in enumerate(at)]),
                                                        keep_logits))  # the top-k on the device: k of V cross
        record = {"values": values, "index": index, "steps": torch.tensor([len(c) for c in comp]),
                  "tokens": torch.tensor([t for c in comp for t in c], dtype=torch.long)}
        if feats is not None:  # each row's positions but its last: the prompt's, then one per completion token
            per_row = [half_features(feats[r, width - len(x): width - 1]) for r, x in enumerate(seqs)]
            record["features"], record["layers"] = torch.cat(per_row), torch.tensor(keep_features)
            record["positions"] = torch.tensor([len(f) for f in per_row])
        yield start, chunk, comp, record if keep_logits else None, time.perf_counter() - t0


def label_batches(target, rows: list[list[int]], at: list[list[int]], batch_size: int, *, keep_logits: int,
                  pad: int = 0):
    """Token rows the target did not sample (a conversation, data=chat) through one batched teacher pass: the
    target's top-k log-probabilities at the positions `at` of each row (a position's logits are those its next
    token, the label trained on, is drawn from), in the record our loop keeps (`values`, `index` row-major, `steps`:
    len(at) a row, `tokens`: the labels), so `data/corpus.py` writes them to the same store. Right-padded: a row
    from position 0, as training feeds it; causal attention keeps the padding out of every real position."""
    for start in range(0, len(rows), batch_size):
        chunk, where = rows[start: start + batch_size], at[start: start + batch_size]
        width = max(len(r) for r in chunk)
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in chunk])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in chunk])
        t0 = time.perf_counter()
        dev = next(target.parameters()).device
        with torch.no_grad():
            logits = target(input_ids=ids.to(dev), attention_mask=mask.to(dev), use_cache=False).logits
        picked = torch.cat([logits[r, torch.tensor(a, dtype=torch.long, device=dev)] for r, a in enumerate(where)])
        values, index = (t.cpu() for t in top_logprobs(picked, keep_logits))  # the top-k on the device: k of V cross
        record = {"values": values, "index": index, "steps": torch.tensor([len(a) for a in where]),
                  "tokens": torch.tensor([r[p + 1] for r, a in zip(chunk, where) for p in a], dtype=torch.long)}
        yield start, record, time.perf_counter() - t0


def _own_record(tokens: list[torch.Tensor], kept: list, prefill=None) -> dict:
    """The batch's kept logits, row-major: row r's steps are its sampled tokens, in order (a stable sort by row keeps
    each row's steps in the order they were drawn). With `prefill` = (the prefill's features (B, P - 1, F), the
    left-padded prompt mask, the layers), `features` holds each row's features by position: its prompt's but the
    last, then one per step."""
    rows = torch.cat([r for r, *_ in kept])
    order = torch.sort(rows, stable=True).indices
    out = {"values": torch.cat([v for _, v, *_ in kept])[order], "index": torch.cat([i for _, _, i, *_ in kept])[order],
           "steps": torch.tensor([len(t) for t in tokens]), "tokens": torch.cat([t.cpu() for t in tokens])}
    if prefill is not None:
        feats, mask, layers = prefill
        steps = torch.cat([f for *_, f in kept])[order].split(out["steps"].tolist())
        lens = mask.sum(1).tolist()
        per_row = [torch.cat([half_features(p[p.shape[0] - n + 1:]), s]) for p, n, s in zip(feats, lens, steps)]
        out["features"], out["positions"] = torch.cat(per_row), torch.tensor([len(f) for f in per_row])
        out["layers"] = torch.tensor(layers)
    return out


class EngineCheck:
    """The plain-decoding half of `deploy_check`'s chi-square, on a generation engine: the first two tokens of
    `draws` samples of CHI_PROMPT against the target's probabilities (`pair_cells`), in the engine's dtype: the
    reference is the target itself, as the engine holds it (`dtype`: its weights in that dtype, fp32 arithmetic on
    them, and in bf16/fp16 that precision's own noise allowed; see `pair_cells`), on its own device, never an fp32
    copy. `reference()` returns it, called only when samples are to be judged: after the engine has started, so that
    on a GPU vLLM takes its share of memory first. Cached per engine, version, target, dtype and sampling settings,
    so a corpus grown over several runs is judged once."""

    def __init__(self, engine: str, reference, tokenizer, cfg: SamplingConfig, target_name: str,
                 dtype: torch.dtype, draws: int = 2000, seed: int = 0):
        self.engine, self.reference, self.cfg, self.draws, self.dtype = engine, reference, cfg, draws, dtype
        self.prompt = tokenizer(CHI_PROMPT).input_ids
        self.eos = tokenizer.eos_token_id
        self.key = f"{engine}|{target_name}|{dtype_name(dtype)}|T{cfg.temperature}|p{cfg.top_p}|k{cfg.top_k}"
        self.request = {"prompt": self.prompt, "n": draws, "seed": seed}

    @staticmethod
    def path() -> Path:
        return cache_home() / "engine_checks.json"

    def passed_before(self, version: str) -> bool:
        return bool((read_json(self.path()) or {}).get(f"{self.key}|{version}", {}).get("pass"))

    def __call__(self, samples: list[list[int]], version: str) -> float:
        if self.passed_before(version):
            return 1.0
        target = self.reference()
        if target.dtype != self.dtype:  # the engine would be judged against another precision's distribution
            raise DraftsmithError(f"data.generated.engine={self.engine} runs the target in {self.dtype} but its "
                                  f"check's reference is in {target.dtype}: both must be the target's dtype "
                                  "(target.dtype)")
        cells = pair_cells(target, self.prompt, self.cfg, self.draws, self.eos)
        p = cells.pvalue(cells.counts(samples))
        seen = read_json(self.path()) or {}
        seen[f"{self.key}|{version}"] = {"pass": p >= LEVEL, "p": p, "draws": self.draws, "noise": cells.noise}
        write_json(self.path(), seen)
        where = dtype_name(self.dtype) + (", its own rounding noise allowed" if cells.noise else "")
        if p < LEVEL:
            raise DraftsmithError(
                f"data.generated.engine={self.engine} ({version}) samples the wrong distribution: chi-square p "
                f"{p:.2g} < {LEVEL:g} on the first two tokens of {self.draws} plain samples against the target's "
                f"probabilities ({where}); no sample was kept. Reproduce: draftsmith deploy-check BUNDLE --engine "
                f"{self.engine}; use data.generated.engine=draftsmith meanwhile")
        print(f"draftsmith: {self.engine} {version} samples the target's distribution (chi-square p {p:.3g}, "
              f"{self.draws} draws, {where}); its samples are kept", file=sys.stderr)
        return p


def choose_engine(requested: str, target, target_name: str, tokens_per_s=None) -> str:
    """`auto` -> the engine that sampled faster on this machine and target, measured once (`tokens_per_s()`:
    {engine: tokens/s}) and cached like the precision probe; says which in one line. Without vLLM: draftsmith."""
    if requested != "auto":
        return requested
    if vllm.missing():
        print("draftsmith: data.generated.engine=auto: draftsmith (vLLM is not installed)", file=sys.stderr)
        return "draftsmith"
    path = cache_home() / "corpus_engine" / f"{machine_key()}.json"
    seen = read_json(path) or {}
    key = f"{target_name}|{target.dtype}|{target.device.type}"
    if key not in seen and tokens_per_s is not None:
        seen[key] = tokens_per_s()
        write_json(path, seen)
    rates = seen.get(key)
    if not rates:
        return "draftsmith"
    best = max(rates, key=rates.get)
    print("draftsmith: data.generated.engine=auto: " + best + " (" + ", ".join(
        f"{e} {r:.0f} tokens/s" for e, r in rates.items()) + f", measured once on this machine: {path})",
        file=sys.stderr)
    return best


def measure_engines(target, target_name: str, rows: list[list[int]], batch_size: int, *, temperature: float,
                    top_p: float, eos: int, pad: int, max_new_tokens: int = 64, **vllm_kw) -> dict:
    """{engine: tokens/s} of one batch of `rows` in each engine (vLLM's start excluded: it is paid once a run);
    `vllm_kw`: `engines.vllm.batches`' settings (gpu_memory_utilization, tensor_parallel_size)."""
    rows, rates = rows[:batch_size], {}
    common = dict(seed=0, first_row=0, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, eos=eos)
    for engine in ("draftsmith", "vllm"):
        if engine == "draftsmith":
            batches = own_batches(target, rows, batch_size, pad=pad, **common)
        else:
            batches = vllm.batches(target_name, target.dtype, rows, batch_size, **common, **vllm_kw)
        with closing(batches):
            _, _, tokens, _, seconds = next(batches)
        rates[engine] = sum(len(x) for x in tokens) / seconds
    return rates


def repetitive(tokens: list[int], n: int = 4, min_distinct: float = 0.5) -> bool:
    """A continuation caught in a loop: fewer than `min_distinct` of its n-grams are distinct. A small draft
    sampling at T 0.8 falls into such loops where its target would not; the target's kept logits on them would
    teach the draft its own failure (issue 61, lever 2: the draft writes, the target labels)."""
    grams = [tuple(tokens[i: i + n]) for i in range(len(tokens) - n + 1)]
    return bool(grams) and len(set(grams)) < min_distinct * len(grams)


def draft_pairs(draft, tokenizer, prompts: list[str], out_path: str | Path, *, batch_size: int = 64,
                max_new_tokens: int = 192, temperature: float = 0.8, top_p: float = 0.95, seed: int = 0,
                max_seconds: float | None = None, max_rows: int | None = None, progress: bool = True) -> dict:
    """A warm draft writes continuations of `prompts` (cycled, each pass with new seeds) in batches of
    `batch_size`, repetition-filtered (`repetitive`), into a JSONL of {prompt, completion}: what `data.source=`
    reads as pairs sampled elsewhere, labelled by one batched teacher pass of the target (the kept top-k), several
    times faster a token than the target's own sampling loop. Stops after the batch that crosses `max_seconds` (or
    at `max_rows`). Returns {written, dropped, tokens, seconds}. A cold draft must not write: trained on its own
    text from the start it collapses (docs/results.md); warm it on the target's samples first."""
    from draftsmith.sampling import autoregressive_generate
    from draftsmith.sampling.prompts import pad_id, prompt_rows

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    rows, pad, eos = prompt_rows(tokenizer, prompts), pad_id(tokenizer), tokenizer.eos_token_id
    stats = {"written": 0, "dropped": 0, "tokens": 0, "seconds": 0.0}
    t0, start = time.perf_counter(), 0
    with out_path.open("w") as f:
        while (max_seconds is None or time.perf_counter() - t0 < max_seconds) and \
                (max_rows is None or stats["written"] < max_rows):
            idx = [(start + j) % len(rows) for j in range(batch_size)]
            chunk = [rows[i] for i in idx]
            width = max(len(r) for r in chunk)
            ids = torch.tensor([[pad] * (width - len(r)) + r for r in chunk])
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in chunk])
            gen = autoregressive_generate(draft, ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                          temperature=temperature, top_p=top_p, eos_token_id=eos,
                                          generator=torch.Generator(device="cpu").manual_seed(seed + start))
            for i, toks in zip(idx, gen.tokens):
                toks = [int(t) for t in toks if int(t) != eos]
                stats["tokens"] += len(toks)
                if not toks or repetitive(toks):
                    stats["dropped"] += 1
                    continue
                f.write(json.dumps({"prompt": prompts[i], "completion": tokenizer.decode(toks)}) + "\n")
                stats["written"] += 1
            f.flush()
            start += batch_size
            stats["seconds"] = time.perf_counter() - t0
            if progress:
                print(f"draft pairs: {stats['written']} written, {stats['dropped']} dropped as loops, "
                      f"{stats['tokens'] / stats['seconds']:.0f} tokens/s", file=sys.stderr, flush=True)
    return stats


def _main(argv: list[str] | None = None) -> None:
    """`python -m draftsmith.data.generation --draft RUN/best_draft --out pairs.jsonl --minutes 8`: the warm
    draft's continuations of the prompt set, its held-out prompts left out as training leaves them out."""
    import argparse

    from draftsmith.sampling.load import load_model, load_tokenizer
    from draftsmith.sampling.prompts import load_prompts

    ap = argparse.ArgumentParser(prog="python -m draftsmith.data.generation", description=_main.__doc__)
    ap.add_argument("--draft", required=True, help="a trained draft (a run's best_draft dir)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", default="broad", help="a shipped prompt set or a JSONL with `prompt`")
    ap.add_argument("--heldout", type=int, default=16, help="every k-th prompt left out, as training's "
                    "split_prompts does with sampler.on_target_prompts (default 16)")
    ap.add_argument("--minutes", type=float, default=None)
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="fp32")
    a = ap.parse_args(argv)
    texts = [r["prompt"] for r in load_prompts(a.prompts)]
    if a.heldout and len(texts) >= 4:
        n = min(a.heldout, len(texts) // 2)
        held = set(torch.linspace(0, len(texts) - 1, n).long().tolist())
        texts = [t for i, t in enumerate(texts) if i not in held]
    draft = load_model(a.draft, a.dtype)
    stats = draft_pairs(draft, load_tokenizer(a.draft), texts, a.out, batch_size=a.batch_size,
                        max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, seed=a.seed,
                        max_seconds=None if a.minutes is None else 60 * a.minutes, max_rows=a.rows)
    print(json.dumps(stats))


if __name__ == "__main__":
    _main()
