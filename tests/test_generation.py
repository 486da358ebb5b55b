"""Which engine samples the corpus (data/generation.py): `auto` measures once and remembers, an engine that is
not installed is refused in one line before any sample is written. vLLM itself: tests/test_engines.py."""

import json

import pytest
import torch
from conftest import ROOT, run_entry, tiny_llama

from draftsmith.data.generation import choose_engine, own_batches
from draftsmith.engines.vllm import batches as vllm_batches
from draftsmith.sampling.errors import DraftsmithError


def test_auto_picks_the_measured_faster_engine_once_and_remembers(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))
    fake = tmp_path / "python"
    fake.write_text("")
    target = tiny_llama(vocab=16, layers=1, hidden=16)
    monkeypatch.setenv("DRAFTSMITH_VLLM_PYTHON", str(tmp_path / "none"))
    assert choose_engine("auto", target, "t") == "draftsmith"  # not installed: no measurement at all
    assert "vLLM is not installed" in capsys.readouterr().err
    monkeypatch.setenv("DRAFTSMITH_VLLM_PYTHON", str(fake))
    calls = []
    rates = {"draftsmith": 170.0, "vllm": 98.0}
    assert choose_engine("auto", target, "t", lambda: calls.append(1) or rates) == "draftsmith"
    assert "draftsmith 170 tokens/s, vllm 98 tokens/s" in capsys.readouterr().err
    assert choose_engine("auto", target, "t", lambda: pytest.fail("measured twice")) == "draftsmith"
    assert calls == [1]
    assert choose_engine("auto", target, "u", lambda: {"draftsmith": 50.0, "vllm": 900.0}) == "vllm"
    saved = json.loads(next((tmp_path / "home" / "corpus_engine").glob("*.json")).read_text())
    assert set(saved) == {f"t|{target.dtype}|cpu", f"u|{target.dtype}|cpu"}
    assert choose_engine("vllm", target, "t") == "vllm" and choose_engine("draftsmith", target, "t") == "draftsmith"


def test_a_missing_vllm_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_VLLM_PYTHON", str(tmp_path / "none"))
    with pytest.raises(DraftsmithError,
                       match=r"engine=vllm: vLLM is not installed .* run `draftsmith engines install vllm`"):
        next(vllm_batches("tiny-random", torch.float32, [[1, 2]], 1, seed=0, first_row=0, max_new_tokens=2,
                          temperature=1.0, top_p=1.0, eos=0))


def test_own_batches_are_the_loop_with_its_kept_record():
    """Our loop's batches: each row's tokens, and the record's steps, tokens and row-major top-k agree with them."""
    target = tiny_llama(vocab=32, layers=1, hidden=16, seed=3)
    rows = [[1, 2, 3], [4], [5, 6]]
    out = list(own_batches(target, rows, 2, seed=0, first_row=0, max_new_tokens=5, temperature=1.0, top_p=1.0,
                           eos=31, keep_logits=4))
    assert [b[0] for b in out] == [0, 2] and [b[1] for b in out] == [rows[:2], rows[2:]]
    for _, _, tokens, record, seconds in out:
        assert record["steps"].tolist() == [len(t) for t in tokens] and seconds > 0
        assert record["tokens"].tolist() == [x for t in tokens for x in t]
        assert record["values"].shape == (sum(map(len, tokens)), 4) and record["index"].shape == record["values"].shape


def test_entry_refuses_vllm_when_it_is_not_installed(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_VLLM_PYTHON", str(tmp_path / "none"))
    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))
    res = run_entry("recipe=smoke", "data=generated", "data.generated.engine=vllm", f"hydra.run.dir={tmp_path}/run",
                    "logger=csv")
    assert res.returncode != 0
    assert res.stderr.strip().splitlines()[-1].startswith("error: data.generated.engine=vllm: vLLM is not installed")
    assert not (tmp_path / "run" / "best_draft").exists()



def test_entry_refuses_a_target_vllms_cpu_build_cannot_run_before_it_starts(tmp_path, monkeypatch, fake_vllm):
    """The tiny smoke target's head_dim 16 is one vLLM's CPU attention refuses (after its minute-long start): refused
    up front in one line naming it and what the CPU build needs; vLLM is never started, nothing is sampled."""
    monkeypatch.setenv("DRAFTSMITH_VLLM_PYTHON", str(fake_vllm.python))
    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FAKE_VLLM_REQUEST", str(tmp_path / "request.json"))
    res = run_entry("recipe=smoke", "data=generated", "data.generated.engine=vllm", f"hydra.run.dir={tmp_path}/run",
                    "logger=csv")
    assert res.returncode != 0
    assert res.stderr.strip().splitlines()[-1] == (
        "error: data.generated.engine=vllm: vLLM's CPU attention cannot run tiny-random (head_dim 16); its CPU build "
        "needs head_dim in 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512: use data.generated.engine=draftsmith "
        "for this target")
    assert not (tmp_path / "request.json").exists() and not (tmp_path / "home" / "generated").exists()

def _pairs_file(path, n=40):
    """Prompt + completion pairs as another engine's log would hold them: openings of stdlib files and what follows."""
    from draftsmith.sampling.names import stdlib_sources

    texts = [f.read_text(errors="ignore") for f in sorted(stdlib_sources())[:n]]
    rows = [{"prompt": t[:120], "completion": t[120:900]} for t in texts if len(t) > 900]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_a_corpus_sampled_elsewhere_gets_the_kept_logits_of_one_teacher_pass(tmp_path):
    """Prompt + completion pairs go through one batched (left-padded) teacher pass into the same store as our own
    samples: the trainer's index finds every row's kept values, and they are the target's top-k log-probabilities
    of each completion token's position, as a forward over that row alone gives them."""
    from draftsmith.data.corpus import generate_corpus, pair_rows, sampled_logits
    from draftsmith.sampling.load import load_model, load_tokenizer

    target, tok = load_model("tiny-random", "fp32"), load_tokenizer("tiny-random")
    rows = _pairs_file(tmp_path / "pairs.jsonl", 12)
    prompts, completions = pair_rows(str(tmp_path / "pairs.jsonl"))
    assert prompts == [r["prompt"] for r in rows]
    out = generate_corpus(target, tok, prompts, tmp_path / "store.jsonl", batch_size=4, keep_logits=8,
                          completions=completions, progress=False)
    stored = [json.loads(line) for line in out.read_text().splitlines()]
    kept = sampled_logits(out, stored)
    assert len(stored) == len(rows) and bool((kept.start[: len(stored)] >= 0).all())
    for r, row in enumerate(stored):
        P, ids = row["prompt_tokens"], row["ids"]
        with torch.no_grad():
            ours = torch.log_softmax(target(input_ids=torch.tensor([ids])).logits[0, P - 1: -1].float(), -1)
        values, index = kept.take(kept.start[r] + torch.arange(len(ids) - P), ("values", "index"))
        top = ours.topk(8)
        torch.testing.assert_close(values.float(), top.values, atol=2e-3, rtol=0)
        assert bool((ours.gather(-1, index.long()) - values.float()).abs().max() < 2e-3)
    assert pair_rows(str(out)) is None  # our own store is read as samples, not as pairs


@pytest.mark.slow
def test_entry_trains_on_pairs_sampled_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))
    _pairs_file(tmp_path / "pairs.jsonl")
    res = run_entry("recipe=smoke", f"data.source={tmp_path}/pairs.jsonl", f"hydra.run.dir={tmp_path}/run",
                    "logger=csv")
    assert res.returncode == 0, res.stderr[-2000:]
    line = next(x for x in res.stdout.splitlines() if "training blocks take the target's logits kept" in x)
    filled, total = (int(w) for w in line.split()[1:4:2])
    assert total > 0 and filled >= 0.8 * total, line  # the rest hold prompt tokens only (no teacher to keep there)
    assert (tmp_path / "run" / "best_draft").is_dir()


def test_the_store_estimate_counts_logits_and_features():
    """What a corpus' kept store will take, said before sampling: 6 bytes a kept log-probability (fp16 value, int32
    id), 2 a feature value at every position the target ran on (an 8B target's features: 3 x 4096 a position)."""
    from draftsmith.data.corpus import store_estimate

    line = store_estimate(1000, 192, 128)
    assert "top-128 logits" in line and "0.137 GiB for 1000 samples" in line and "(0.141 MiB a sample)" in line
    line = store_estimate(100_000, 256, 128, features=3 * 4096, prompt_tokens=64)
    per = 256 * 128 * 6 + 320 * 3 * 4096 * 2
    assert f"{100_000 * per / 2**30:.3g} GiB" in line and "12288 feature values" in line


@pytest.mark.slow
def test_a_feature_draft_trains_with_features_computed_online(tmp_path, monkeypatch):
    """data.features=online: nothing is stored (no kept features, no teacher store); the target's pass in each step
    gives the feature draft what it reads, and the run ends with its report."""
    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))
    res = run_entry("recipe=smoke", "draft=feature_head", "data=generated", "data.features=online",
                    "data.generated.n_prompts=60", "data.generated.max_new_tokens=48", f"hydra.run.dir={tmp_path}/run",
                    "logger=csv")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "training blocks take" not in res.stdout and (tmp_path / "run" / "report.json").is_file()
    metrics = (tmp_path / "run" / "csv" / "metrics.csv").read_text()
    assert "train/loss" in metrics and "train/teacher_cache_hit_rate" not in metrics  # no store was read
    logits = next((tmp_path / "home" / "generated").glob("*.jsonl.logits"))
    assert not any("features" in f.name for f in logits.iterdir())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_engine_check_passes_our_loop_and_refuses_a_planted_wrong_sampler(demo_target, tmp_path, monkeypatch,
                                                                              dtype):
    """EngineCheck (what judges vLLM before its samples are kept) on our own loop's plain samples, in each dtype
    this CPU runs: they pass; the same loop with the temperature applied twice (a planted bug of the kind an engine
    could have) is refused, in bf16 too, where the check allows the precision's own noise. The reference is the
    target itself, loaded only when samples are judged."""
    from draftsmith.data.generation import EngineCheck
    from draftsmith.sampling import autoregressive_generate
    from draftsmith.sampling.load import load_model
    from draftsmith.sampling.probs import SamplingConfig

    monkeypatch.setattr(EngineCheck, "path", staticmethod(lambda: tmp_path / "checks.json"))
    tok = demo_target[1]  # a real model's peaked distributions (a random one's are near uniform at any T)
    target = demo_target[0] if dtype == "fp32" else load_model("smollm2-135m", dtype)
    loads = []
    check = EngineCheck("draftsmith", lambda: loads.append(1) or target, tok, SamplingConfig(0.8, 0, 0.95),
                        "smollm2-135m", target.dtype, draws=1000)
    assert loads == []

    def samples(temperature):
        ids = torch.tensor([check.prompt] * check.draws)
        gen = autoregressive_generate(target, ids, max_new_tokens=2, temperature=temperature, top_p=0.95,
                                      eos_token_id=tok.eos_token_id,
                                      generator=torch.Generator(device="cpu").manual_seed(0))
        return [t.tolist() for t in gen.tokens]

    assert check(samples(0.8), "ours") >= 1e-3
    with pytest.raises(DraftsmithError, match=r"engine=draftsmith \(planted\) samples the wrong distribution"):
        check(samples(0.8 * 0.8), "planted")
    verdicts = json.loads((tmp_path / "checks.json").read_text())
    assert [v["pass"] for v in verdicts.values()] == [True, False]
    assert all(f"|{dtype}|" in key for key in verdicts)  # a verdict in one dtype is not taken for another
    assert (next(iter(verdicts.values()))["noise"] > 0) == (dtype == "bf16") and loads


def test_vllm_starts_before_the_target_loads_and_is_judged_in_the_targets_dtype(fake_vllm, tmp_path, monkeypatch):
    """data.generated.engine=vllm through the trainer's own code (`prepare.generated_corpus`): vLLM starts before the target
    loads (on a GPU it takes data.generated.gpu_memory_utilization of it first, and the target fits beside it), runs
    the dtype the target loads in (bf16 wherever precision=auto picks it) and is judged against that target itself:
    one load of the target, in its own dtype, after vLLM's start; no fp32 copy. The stand-in engine samples wrongly:
    its check refuses it, and none of its processes is left."""
    from helpers import processes_after
    from hydra import compose, initialize_config_dir
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftsmith.drafts.build import TargetWeights
    from draftsmith.sampling.load import load_tokenizer
    from draftsmith.sampling.names import resolve
    from draftsmith.train import prepare, schema, target

    target_dir = tmp_path / "target-hd64"  # tiny-random's tokenizer, a head_dim vLLM's CPU attention takes
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, num_attention_heads=2, num_key_value_heads=2,
                                 head_dim=64, num_hidden_layers=2, intermediate_size=256, eos_token_id=0,
                                 pad_token_id=0, bos_token_id=1)).save_pretrained(target_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (target_dir / name).write_bytes((resolve("tiny-random") / name).read_bytes())
    for key, value in fake_vllm.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("FAKE_VLLM", "exit")
    monkeypatch.setenv("FAKE_VLLM_REQUEST", str(tmp_path / "request.json"))
    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))
    loads, prepared_model = [], target.prepared_model

    def counting(name, dtype="auto", **kw):
        loads.append((dtype, (tmp_path / "request.json").exists()))  # the worker writes it as vLLM starts
        return prepared_model(name, dtype, **kw)

    monkeypatch.setattr(target, "prepared_model", counting)
    schema.register()  # recipes/draft.yaml starts from it (the entry registers it; this test composes without it)
    with initialize_config_dir(config_dir=str(ROOT / "recipes"), version_base="1.3"):
        cfg = compose("draft", ["recipe=smoke", f"target.name={target_dir}", "data=generated",
                                "data.generated.engine=vllm", "data.generated.gpu_memory_utilization=0.4",
                                "data.generated.n_prompts=4", "data.generated.batch_size=2",
                                "data.generated.max_new_tokens=4", f"out_dir={tmp_path / 'run'}"])
    held = []

    def teacher():
        held.append(held[0] if held else target.load_target(cfg))
        return held[0]

    with pytest.raises(DraftsmithError, match=r"engine=vllm \(fake\) samples the wrong distribution"):
        prepare.generated_corpus(cfg, teacher, load_tokenizer(str(target_dir)), ["def f", "x = 1", "import", "class"],
                                 TargetWeights.of(str(target_dir)).config, tmp_path / "home")
    request = json.loads((tmp_path / "request.json").read_text())
    assert loads == [("auto", True)]  # once, as the trainer loads it, after vLLM's start
    assert request["dtype"] == {torch.bfloat16: "bfloat16", torch.float32: "float32"}[held[0].dtype]
    assert request["gpu_memory_utilization"] == 0.4
    assert processes_after(fake_vllm.marker) == []


def test_auto_measures_both_engines_on_one_batch(fake_vllm, monkeypatch):
    """data.generated.engine=auto with vLLM installed: one batch in each engine, tokens/s of each (vLLM's start not
    counted; the stand-in reports 0.1 s for its batch of 2 rows x 2 tokens), and vLLM's processes gone after."""
    from helpers import processes_after

    from draftsmith.data.generation import measure_engines
    from draftsmith.sampling.load import load_model

    for key, value in fake_vllm.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("FAKE_VLLM", "exit")
    rates = measure_engines(load_model("tiny-random", "fp32"), str(fake_vllm.target), [[1, 2], [3, 4]], 2,
                            temperature=1.0, top_p=1.0, eos=0, pad=0, max_new_tokens=4, gpu_memory_utilization=0.5)
    assert set(rates) == {"draftsmith", "vllm"} and rates["vllm"] == pytest.approx(40.0) and rates["draftsmith"] > 0
    assert processes_after(fake_vllm.marker) == []
