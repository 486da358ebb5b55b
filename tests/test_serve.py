"""`draftsmith bench serve` and the bundles it serves: tau read or counted per engine as the engine table says, the
speed-up measured plain and speculative in the same engine, and bundles that load wherever they are copied."""

import json
import shutil

import pytest
import torch

from draftsmith.deploy.bench import serve
from draftsmith.deploy.bundle import open_bundle
from draftsmith.deploy.export import SGLANG_CONFIG, sglang_flags, verifier_name
from draftsmith.engines.base import Output
from draftsmith.sampling.errors import DraftsmithError


@pytest.fixture(scope="module")
def self_bundle(tmp_path_factory):
    """The tiny random target as its own draft, exported against the target by its alias (not copied): greedy,
    every draft token is accepted, so tau is K+1 at every loop but a cut last one."""
    from draftsmith.deploy.export import export
    from draftsmith.sampling.load import load_model, load_tokenizer

    root = tmp_path_factory.mktemp("serve")
    load_model("tiny-random", "fp32").save_pretrained(root / "draft")
    load_tokenizer("tiny-random").save_pretrained(root / "draft")
    return export(root / "draft", root / "bundle", target_arg="tiny-random", n_prompts=1, max_new_tokens=8,
                  dtype="fp32", ks=(1, 2, 3))


def test_serve_counts_tau_in_our_sampler_and_in_transformers(self_bundle, tmp_path, capsys):
    for engine, sets in (("draftsmith", ["code", "math"]), ("transformers", ["math"])):
        out = tmp_path / f"{engine}.json"
        code = serve.main([str(self_bundle), "--engine", engine, "--prompts", *sets, "--n-prompts", "2",
                           "--max-new-tokens", "13", "-k", "3", "--temperatures", "0", "0.8", "--raw",
                           "--json", str(out), "--plot", str(tmp_path / f"{engine}.png")])
        assert code == 0
        rep = json.loads(out.read_text())
        assert rep["k"] == 3 and rep["temperatures"] == [0.0, 0.8] and rep["template"].startswith("none")
        assert rep["flags"][:3] == [str(self_bundle), "--engine", engine] and rep["version"]
        assert [(r["set"], r["temperature"]) for r in rep["rows"]] == [(s, t) for s in sets for t in (0, 0.8)]
        for r in rep["rows"]:
            assert r["prompts"] == 2 and r["tok_s_plain"] > 0 and r["tok_s_speculative"] > 0
            assert r["speedup"] == pytest.approx(r["tok_s_speculative"] / r["tok_s_plain"])
            assert r["ms_per_token_speculative"]["p90"] >= r["ms_per_token_speculative"]["p50"] > 0
            # the draft is the target: 13 tokens = 3 full loops of 4 and a cut one; in our sampler at T > 0 too
            # (transformers' assisted sampling draws its draft tokens under the draft's own settings: fewer there)
            if engine == "draftsmith" or r["temperature"] == 0:
                assert r["tokens_per_call"] == pytest.approx(13 / 4), (engine, r)
            assert 1 <= r["tokens_per_call"] <= 4
            if engine == "draftsmith":
                assert r["acceptance_by_position"] == [1.0, 1.0, 1.0] and r["alpha"] == 1.0
            else:
                assert r["acceptance_by_position"] is None  # transformers gives none
        assert (tmp_path / f"{engine}.png").read_bytes()[:4] == b"\x89PNG"
        text = capsys.readouterr().out
        assert "acceptance length tau" in text and serve.SOURCE[engine] in text


def test_each_engine_runs_at_the_k_the_bundle_measured_fastest_there(self_bundle):
    """`export --engines` records each engine's fastest K (and writes it into vLLM's and transformers' configs):
    the engines, and so `bench serve` and `deploy-check`, run at that K by default, the recommended K elsewhere
    (first seen: bench serve ran transformers at the recommended K 1 while its config held the measured 2)."""
    from draftsmith.deploy.bundle import Bundle, open_bundle
    from draftsmith.engines.draftsmith import DraftsmithEngine
    from draftsmith.engines.transformers import TransformersEngine
    from draftsmith.sampling.cli import engine_k

    b = open_bundle(self_bundle)
    measured = Bundle(b.path, {**b.spec, "recommended_k": 1, "engine_k": {"draftsmith": {"best_k": 3}}},
                      b.target_dir, b.draft_dir)
    assert DraftsmithEngine(measured).k == 3 and TransformersEngine(measured).k == 1
    assert engine_k(measured.spec, "draftsmith") == 3 and engine_k(measured.spec, "vllm") == 1


def test_vllms_measured_k_reaches_both_configs_vllm_reads(tmp_path):
    """A feature bundle is served by `vllm serve "$TARGET" --speculative-config ...` and by `vllm serve BUNDLE/draft`
    (its speculators config): both must carry the K measured fastest in vLLM."""
    from draftsmith.deploy.ksweep import write_engine_k

    (tmp_path / "draft").mkdir()
    (tmp_path / "vllm_speculative_config.json").write_text(json.dumps({"method": "eagle3", "model": "draft",
                                                                       "num_speculative_tokens": 1}))
    cfg = {"speculators_model_type": "eagle3", "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
        {"proposal_type": "greedy", "speculative_tokens": 1}]}}  # as export writes it (speculators_fields)
    (tmp_path / "draft" / "config.json").write_text(json.dumps(cfg))
    write_engine_k(tmp_path, {"vllm": {"best_k": 3}})
    assert json.loads((tmp_path / "vllm_speculative_config.json").read_text())["num_speculative_tokens"] == 3
    spec = json.loads((tmp_path / "draft" / "config.json").read_text())["speculators_config"]
    assert [m["speculative_tokens"] for m in spec["proposal_methods"]] == [3]


def test_tau_is_read_from_each_engines_counters():
    """vLLM: 1 + accepted / drafts, per position over drafts; llama.cpp: its totals, tokens / (tokens - accepted)."""
    out = Output([[[1] * 30]], 1.0, drafted=40, accepted=20,
                 extra={"spec_decode_num_drafts": 10, "accepted_per_pos": [8, 7, 5, 0]})
    assert serve.tau_of("vllm", out, 4) == (3.0, [0.8, 0.7, 0.5, 0.0])
    assert serve.tau_of("llamacpp", Output([[[1] * 30]], 1.0, drafted=40, accepted=20), 4) == (3.0, None)
    assert serve.caveat("vllm", "cpu", 0.8).endswith("(vLLM issue 55005)") and serve.caveat("vllm", "cpu", 0) is None
    assert serve.caveat("vllm", "cuda", 0.8) is None and "exact match" in serve.caveat("llamacpp", None, 1.0)


def test_serve_refuses_a_target_without_a_chat_template_unless_raw(self_bundle, capsys):
    assert serve.main([str(self_bundle), "--engine", "draftsmith", "--prompts", "math", "--n-prompts", "1"]) == 2
    assert "no chat template: pass --raw" in capsys.readouterr().err


def test_a_copied_bundle_loads_and_names_no_path_of_the_exporting_host(self_bundle, tmp_path):
    moved = tmp_path / "elsewhere" / "bundle"
    shutil.copytree(self_bundle, moved)
    for f in moved.rglob("*"):
        if f.is_file() and f.suffix in (".json", ".md"):
            assert str(self_bundle.parent) not in f.read_text(), f"{f.name} names the exporting host's folder"
    b = open_bundle(moved)
    assert b.draft_dir == moved / "draft" and json.loads((moved / "target.json").read_text())["path"] is None
    vllm = json.loads((moved / "vllm_speculative_config.json").read_text())
    assert vllm["model"] == "draft" and (moved / vllm["model"] / "config.json").is_file()
    from draftsmith.engines.draftsmith import DraftsmithEngine

    engine = DraftsmithEngine(b)  # the copy's draft loads, against the target found by its name
    assert engine.k == b.spec["recommended_k"]
    card = (moved / "README.md").read_text()
    assert 'export TARGET=' in card and 'vllm serve "$TARGET"' in card and "generate draft --target \"$TARGET\"" in card
    from conftest import tiny_llama

    tiny_llama(vocab=16).save_pretrained(tmp_path / "other")
    with pytest.raises(DraftsmithError, match="not the one exported with this bundle"):
        open_bundle(moved, target=str(tmp_path / "other"))  # a target swapped in is refused


def test_a_bundle_with_its_target_travels_whole(tmp_path):
    from draftsmith.deploy.export import export
    from draftsmith.sampling.load import load_model, load_tokenizer, resolve

    load_model("tiny-random", "fp32").save_pretrained(tmp_path / "draft")
    load_tokenizer("tiny-random").save_pretrained(tmp_path / "draft")
    shutil.copytree(resolve("tiny-random"), tmp_path / "t")
    out = export(tmp_path / "draft", tmp_path / "b", target_arg=str(tmp_path / "t"), copy_target=True, n_prompts=1,
                 max_new_tokens=4, dtype="fp32", ks=(1, 2))
    moved = tmp_path / "far" / "b"
    shutil.move(out, moved)
    shutil.rmtree(tmp_path / "t")  # the exporting host's copy is gone
    b = open_bundle(moved)
    assert b.target_dir == moved / "target" and "export TARGET=target" in (moved / "README.md").read_text()


def test_sglang_configs_for_both_draft_kinds(self_bundle):
    cfg = json.loads((self_bundle / SGLANG_CONFIG).read_text())
    k = json.loads((self_bundle / "speculative.json").read_text())["recommended_k"]
    # SGLang's server arguments (sglang.srt.server_args.ServerArgs): an independent draft runs as STANDALONE
    assert cfg == {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "draft",
                   "speculative_num_steps": k, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": k + 1}
    assert sglang_flags(cfg) in (self_bundle / "README.md").read_text()
    assert sglang_flags(cfg).startswith("--speculative-algorithm STANDALONE --speculative-draft-model-path draft")
    assert verifier_name("smollm2-135m", False) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert verifier_name("smollm2-135m", True) == "target"


SGLANG = ("sglang", "0.5.23")


@pytest.mark.slow
def test_sglang_configs_and_layer_ids_match_sglangs_own_source():
    """SGLang does not run here (its wheels need CUDA), so its own source, from its PyPI wheel, judges what we
    write for it: every key of both kinds' configs is a field of its `spec` arguments, both algorithms are its
    own, and its Llama target adds 1 to every `eagle_config` layer id and captures the state entering that layer,
    the rule `sglang_layer_ids` inverts."""
    import ast
    import zipfile

    from helpers import pypi_wheel

    from draftsmith.deploy.export import sglang_config

    with zipfile.ZipFile(pypi_wheel(*SGLANG)) as z:
        spec, algos, llama = (ast.parse(z.read(f"sglang/srt/{f}.py")) for f in
                              ("arg_groups/fields/spec", "speculative/spec_info", "models/llama"))
    fields = {n.target.id for c in spec.body if isinstance(c, ast.ClassDef) and c.name == "Spec"
              for n in c.body if isinstance(n, ast.AnnAssign)}
    members = {n.targets[0].id for c in algos.body if isinstance(c, ast.ClassDef) and c.name == "SpeculativeAlgorithm"
               for n in c.body if isinstance(n, ast.Assign)}
    (capture,) = [f for c in llama.body if isinstance(c, ast.ClassDef) and c.name == "LlamaForCausalLM"
                  for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "set_eagle3_layers_to_capture"]
    for feature in (False, True):
        cfg = sglang_config(feature, 3)
        assert set(cfg) <= fields, set(cfg) - fields
        assert cfg["speculative_algorithm"] in members
    # what test_feature's sglang_captures models: every id shifted, no rule on the first id (DeepSeek-V2's)
    src = ast.unparse(capture)
    assert "[val + 1 for val in layer_ids]" in src and "layer_ids[0]" not in src, src
    # and the shifted id is the layer whose entering state is captured: layer i is handed the capture
    (forward,) = [f for c in llama.body if isinstance(c, ast.ClassDef) and c.name == "LlamaModel"
                  for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "forward"]
    assert "self.layers[i](" in ast.unparse(forward)
    assert "capture_output=aux_hidden_states.capture if i in self.layers_to_capture" in ast.unparse(forward)


def test_a_feature_bundle_keeps_its_d2t_map_and_names_its_verifier_relative(tmp_path):
    """vLLM maps a pruned EAGLE-3 head's ids through `d2t` and, where a checkpoint lacks it, silently maps them as
    if the head were the vocabulary's first ids: the exported weights must keep it, right. The head here holds the
    vocabulary's last ids, so a lost or zeroed map is seen."""
    from safetensors.torch import load_file

    from draftsmith.deploy.export import export
    from draftsmith.drafts.feature import build_feature_draft
    from draftsmith.sampling.load import load_model, load_tokenizer, resolve

    target = load_model("tiny-random", "fp32")
    vocab = target.config.vocab_size
    counts = torch.arange(vocab, dtype=torch.float)  # the last ids are the most frequent
    draft = build_feature_draft(target, None, 64, counts)
    draft.save_pretrained(tmp_path / "draft")
    load_tokenizer("tiny-random").save_pretrained(tmp_path / "draft")
    shutil.copytree(resolve("tiny-random"), tmp_path / "t")
    out = export(tmp_path / "draft", tmp_path / "b", target_arg=str(tmp_path / "t"), copy_target=True, n_prompts=1,
                 max_new_tokens=4, dtype="fp32", ks=(1, 2))
    weights = {}
    for f in (out / "draft").glob("*.safetensors"):
        weights.update(load_file(str(f)))
    head = torch.arange(len(weights["d2t"])) + weights["d2t"]
    assert len(head) == 64 and set(head.tolist()) >= set(range(vocab - 63, vocab)), head.tolist()
    assert weights["t2d"].sum() == 64 and bool(weights["t2d"][head].all())
    cfg = json.loads((out / "draft" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "target"
    assert json.loads((out / SGLANG_CONFIG).read_text())["speculative_algorithm"] == "EAGLE3"
    assert json.loads((out / "vllm_speculative_config.json").read_text())["model"] == "draft"


@pytest.mark.slow  # two engines timed at four Ks, after an export's own measurements: minutes on 2 busy cores
def test_export_times_each_named_engine_at_each_k_and_writes_the_fastest(tmp_path):
    """`draftsmith export --engines`: K 1..4 timed in each engine, the fastest written where that engine reads K
    (transformers: the draft's generation config), and the card's table beside the predicted speed-up."""
    from draftsmith.deploy.export import export
    from draftsmith.sampling.load import load_model, load_tokenizer

    load_model("tiny-random", "fp32").save_pretrained(tmp_path / "draft")
    load_tokenizer("tiny-random").save_pretrained(tmp_path / "draft")
    out = export(tmp_path / "draft", tmp_path / "b", target_arg="tiny-random", n_prompts=1, max_new_tokens=4,
                 dtype="fp32", ks=(1, 2), engines=("draftsmith", "transformers"), sweep_prompts=1, sweep_tokens=9)
    spec = json.loads((out / "speculative.json").read_text())
    for name in ("draftsmith", "transformers"):
        r = spec["engine_k"][name]
        assert set(r["by_k"]) == {"1", "2", "3", "4"} and r["temperature"] == 0
        assert r["best_k"] == int(max(r["by_k"], key=lambda k: r["by_k"][k]["tok_s"]))
    # the draft is the target: greedy, every draft accepted (9 tokens at K=2: 3 passes of 3)
    assert spec["engine_k"]["draftsmith"]["by_k"]["2"]["tokens_per_call"] == pytest.approx(3.0)
    gen = json.loads((out / "draft" / "generation_config.json").read_text())
    assert gen["num_assistant_tokens"] == spec["engine_k"]["transformers"]["best_k"]
    card = (out / "README.md").read_text()
    assert "## K per engine" in card and card.index("## K per engine") < card.index("## Use")
    open_bundle(out)  # the rewritten configs are the hashed ones


def test_the_card_says_where_speculation_does_not_pay(tmp_path):
    from draftsmith.deploy.ksweep import card_section, write_engine_k

    r = {"version": "0.32.0", "temperature": 0.0, "tok_s_plain": 10.0, "best_k": 2, "speedup": 0.8,
         "by_k": {"1": {"tok_s": 7.0, "speedup": 0.7, "tokens_per_call": 1.6},
                  "2": {"tok_s": 8.0, "speedup": 0.8, "tokens_per_call": 2.1}}}
    text = card_section({"vllm": r}, {"2": 1.3})
    assert "| vllm | 0.32.0 | 0 | 2 | 2.10 | 10.0 | 8.0 | 0.80x | 1.30x |" in text
    assert "does not pay in vllm" in text
    assert "does not pay" not in card_section({"vllm": {**r, "by_k": {"2": {**r["by_k"]["2"], "speedup": 1.2}}}}, {})
    (tmp_path / "vllm_speculative_config.json").write_text(json.dumps({"model": "draft", "num_speculative_tokens": 4}))
    write_engine_k(tmp_path, {"vllm": r})
    assert json.loads((tmp_path / "vllm_speculative_config.json").read_text())["num_speculative_tokens"] == 2


class _Echo:
    """An engine that answers every request with fixed words, the speculative run other words than the plain one,
    and keeps every job it was given: what bench serve then builds turn 2 from is seen."""

    name = "draftsmith"
    batches = True

    def __init__(self, tok):
        self.tok, self.jobs = tok, []
        self.said = {True: tok("PINEAPPLE SPEC ANSWER", add_special_tokens=False)["input_ids"],
                     False: tok("MANGO PLAIN ANSWER", add_special_tokens=False)["input_ids"]}

    def run(self, jobs, speculative):
        self.jobs += [(speculative, j) for j in jobs]
        return [Output([[self.said[speculative] + [self.tok.eos_token_id]] for _ in j.prompts], 0.5, 4, 2,
                       {"target_passes": 3}) for j in jobs]


def test_chat_turn_two_holds_the_engines_own_turn_one_answer(tmp_path):
    """Turn 2 is turn 1, the engine's own (speculative) answer, then the conversation's next user message, through
    the chat template; never the dataset's answer. Both modes run turn 2 on that same prompt."""
    from draftsmith.deploy.bench.sets import load_set, second_turns
    from draftsmith.sampling.load import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    convs = tmp_path / "chat.jsonl"
    convs.write_text("\n".join(json.dumps({"messages": m}) for m in [
        [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "DATASET BANANA"},
         {"role": "user", "content": "And its colour?"}, {"role": "assistant", "content": "yellow"}],
        [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]]) + "\n")
    first = load_set(str(convs), 2)
    follow = {"c": serve.follow_up(tok, first, second_turns(str(convs), 2), raw=False)}
    engine = _Echo(tok)
    rows = serve.measure(engine, "draftsmith", {"c": serve.encode(tok, first, False)}, [0.0], 1.0, 8, 2, 0,
                         follow=follow)
    assert [(r["set"], r["turn"], r["prompts"]) for r in rows] == [("c", 1, 2), ("c", 2, 1)]  # one has a turn 2
    turn2 = [(spec, j) for spec, j in engine.jobs[4:]]
    assert len(turn2) == 2 and {spec for spec, _ in turn2} == {False, True}
    (prompt,) = turn2[0][1].prompts
    assert turn2[1][1].prompts == [prompt]  # plain and speculative: the same turn-2 prompt
    expected = tok.apply_chat_template(
        [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "PINEAPPLE SPEC ANSWER"},
         {"role": "user", "content": "And its colour?"}], tokenize=False, add_generation_prompt=True)
    assert tok.decode(prompt) == expected
    assert "DATASET BANANA" not in tok.decode(prompt) and "MANGO" not in tok.decode(prompt)


def test_the_chat_set_has_a_second_turn_for_every_conversation():
    from draftsmith.deploy.bench.sets import load_set, second_turns

    first, nexts = load_set("chat", 2), second_turns("chat", 2)
    assert len(first) == len(nexts) == 2 and all(n and n["role"] == "user" and n["content"] for n in nexts)
    assert all(c[-1]["role"] == "user" for c in first) and second_turns("math", 2) is None


def test_serve_at_batch_sizes_in_our_sampler_and_refused_by_transformers(self_bundle, tmp_path, capsys):
    """--batch 1 2: a row per size; our sampler serves two requests as one left-padded batch (three prompts: a
    batch of two, then one), and with the target as its own draft tau is still K+1 per loop (9 tokens at K=2: three
    full loops of 3, each row), padding or not."""
    out = tmp_path / "b.json"
    assert serve.main([str(self_bundle), "--engine", "draftsmith", "--prompts", "math", "--n-prompts", "3",
                       "--max-new-tokens", "9", "-k", "2", "--temperatures", "0", "--raw", "--batch", "1", "2",
                       "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["batches"] == [1, 2] and [(r["batch"], r["turn"]) for r in rep["rows"]] == [(1, 1), (2, 1)]
    for r in rep["rows"]:
        assert r["prompts"] == 3 and r["tokens_per_call"] == pytest.approx(3.0) and r["tok_s_speculative"] > 0
        assert r["new_tokens_plain"] == r["new_tokens_speculative"] == 27
    assert " batch" in capsys.readouterr().out
    assert serve.main([str(self_bundle), "--engine", "transformers", "--prompts", "math", "--raw", "--batch",
                       "4"]) == 2
    assert "does not batch" in capsys.readouterr().err
