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
    # two rounds in our sampler (a range to print), one in transformers: the alternation itself is unit-tested
    # (test_the_arms_alternate_with_a_warm_up_and_server_engines_run_abba)
    for engine, sets, rounds in (("draftsmith", ["math"], 2), ("transformers", ["math"], 1)):
        out = tmp_path / f"{engine}.json"
        code = serve.main([str(self_bundle), "--engine", engine, "--prompts", *sets, "--n-prompts", "2",
                           "--max-new-tokens", "13", "-k", "3", "--temperatures", "0", "0.8", "--raw",
                           "--rounds", str(rounds), "--json", str(out), "--plot", str(tmp_path / f"{engine}.png")])
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
                # unconditional, as vLLM gives it: the cut loop drafts 1 token, so positions 2 and 3 are reached in
                # 3 of 4 passes; given that they are reached, every one is accepted
                assert r["acceptance_by_position"] == [1.0, 0.75, 0.75] and r["alpha"] == 1.0
                assert r["native"]["acceptance_by_position_conditional"] == [1.0, 1.0, 1.0]
            else:
                assert r["acceptance_by_position"] is None  # transformers gives none
            # both arms timed over two rounds, both arms' tokens counted; greedy: the outputs are the same
            assert r["rounds"] == rounds and len(r["speedup_by_round"]) == rounds
            assert r["new_tokens_plain"] == rounds * 2 * 13
            if r["temperature"] == 0:
                assert r["drafting_rule"] is None and r["greedy_mismatches"] == 0
                assert r["greedy_compared"] == 2 * rounds
            else:
                assert r["drafting_rule"] == serve.SAMPLED
        assert (tmp_path / f"{engine}.png").read_bytes()[:4] == b"\x89PNG"
        text = capsys.readouterr().out
        assert "acceptance length tau" in text and serve.SOURCE[engine] in text and serve.POSITION in text
        assert f"drafting rule: {serve.SAMPLED}" in text and "tokens plain/spec" in text


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
    """One definition, read from each engine's own counters: tokens per verification pass, the prompt pass and its
    token excluded. vLLM: (tokens - requests) / drafts, its own 1 + accepted / drafts kept beside; per position
    over drafts (unconditional); llama.cpp: (tokens - requests) / (tokens - requests - accepted)."""
    out = Output([[[1] * 31]], 1.0, drafted=40, accepted=20,
                 extra={"spec_decode_num_drafts": 10, "accepted_per_pos": [8, 7, 5, 0]})
    tau, pos, native = serve.tau_of("vllm", out, 4)
    assert (tau, pos) == (3.0, [0.8, 0.7, 0.5, 0.0]) and native["vllm_mean_acceptance_length"] == 3.0
    # vLLM counts drafts accepted past EOS or max_tokens: 29 tokens where its counters say 3 per pass
    tau, _, native = serve.tau_of("vllm", Output([[[1] * 29]], 1.0, 40, 20, {"spec_decode_num_drafts": 10}), 4)
    assert tau == pytest.approx(2.8) and native["vllm_mean_acceptance_length"] == 3.0
    tau, pos, native = serve.tau_of("llamacpp", Output([[[1] * 31]], 1.0, drafted=40, accepted=20), 4)
    assert (tau, pos) == (3.0, None) and native["llamacpp_draft_acceptance_rate"] == 0.5
    assert serve.caveat("vllm", "cpu", 0.8).endswith("(speed-up invalid)") and serve.caveat("vllm", "cpu", 0) is None
    assert serve.caveat("vllm", "cuda", 0.8) is None and serve.caveat("llamacpp", None, 1.0) is None


def _engine_counters(n_tokens: int, k: int, engine: str) -> Output:
    """What each engine's counters record for one request of `n_tokens` when every draft is accepted (draft =
    target, greedy), following each engine's own schedule (bench_serve_audit.md F1, read from their code):
    - vLLM: the prompt pass emits 1 token; each later pass drafts K (not capped at max_tokens) and counts all K
      accepted before the output is cut at max_tokens;
    - llama.cpp: the prompt pass emits 1 token; drafts are capped at n_remaining - 1 (`get_n_draft_max`);
    - our sampler: the prefill emits nothing; every pass drafts max(1, min(K, remaining - 1)) and emits up to K+1;
    - transformers: the first pass is the prompt and the first drafts; counted passes, as ours."""
    if engine == "vllm":
        emitted, drafts, accepted = 1, 0, 0
        while emitted < n_tokens:
            drafts, accepted, emitted = drafts + 1, accepted + k, emitted + k + 1
        return Output([[[7] * n_tokens]], 1.0, k * drafts, accepted,
                      {"spec_decode_num_drafts": drafts, "accepted_per_pos": [drafts] * k})
    if engine == "llamacpp":
        emitted, drafted = 1, 0
        while emitted < n_tokens:
            d = min(k, n_tokens - emitted - 1)
            drafted, emitted = drafted + d, emitted + d + 1
        return Output([[[7] * n_tokens]], 1.0, drafted, drafted)
    emitted, passes, acc, tested = 0, 0, [0] * k, [0] * k
    while emitted < n_tokens:
        d = max(1, min(k, n_tokens - emitted - 1))
        passes, emitted = passes + 1, emitted + d + 1
        for i in range(d):
            acc[i], tested[i] = acc[i] + 1, tested[i] + 1
    extra = {"target_passes": passes}
    if engine == "draftsmith":
        extra.update(accepted_at=acc, tested_at=tested)
    return Output([[[7] * n_tokens]], 1.0, extra=extra)


def test_the_fixed_case_reads_tokens_per_verification_pass_in_every_engine():
    """Draft = target, K 3, 13 tokens (the case the slow serve test runs in our sampler and transformers): each
    engine's counters give tokens per verification pass. vLLM and llama.cpp spend a prompt pass that emits the first
    token (1 + 4 + 4 + 4), ours and transformers a last pass cut to 1 token (4 + 4 + 4 + 1): one definition, two
    schedules, so 4.0 against 3.25. Before the fix llama.cpp read 13 / (13 - 9) = 3.25 (the prompt pass in its
    denominator) and vLLM 4.0; at 12 tokens vLLM read 4.0, its counters holding a draft it cut."""
    taus = {e: serve.tau_of(e, _engine_counters(13, 3, e), 3) for e in ("vllm", "llamacpp", "draftsmith",
                                                                         "transformers")}
    assert {e: t[0] for e, t in taus.items()} == {"vllm": 4.0, "llamacpp": 4.0, "draftsmith": 3.25,
                                                  "transformers": 3.25}
    assert taus["vllm"][2]["vllm_mean_acceptance_length"] == 4.0
    # the schedules' phase flips at 12 tokens: vLLM's prompt token + 4 + 4 + a pass cut to 3 (its counters still
    # hold 3 accepted there: 1 + 9 / 3 = 4.0 natively), ours 4 + 4 + 4
    taus = {e: serve.tau_of(e, _engine_counters(12, 3, e), 3) for e in ("vllm", "llamacpp", "draftsmith",
                                                                         "transformers")}
    assert {e: round(t[0], 4) for e, t in taus.items()} == {"vllm": 3.6667, "llamacpp": 3.6667, "draftsmith": 4.0,
                                                            "transformers": 4.0}
    assert taus["vllm"][2]["vllm_mean_acceptance_length"] == 4.0
    # per position, unconditional in both engines that give it: 1 + their sum is tau where nothing is cut
    assert serve.tau_of("vllm", _engine_counters(13, 3, "vllm"), 3)[1] == [1.0, 1.0, 1.0]
    assert serve.tau_of("draftsmith", _engine_counters(12, 3, "draftsmith"), 3)[1] == [1.0, 1.0, 1.0]


def test_rows_name_their_drafting_rule_and_vllms_cpu_build_from_its_device(monkeypatch):
    """T > 0: our sampler and transformers sample the draft (min(1, p/q)); llama.cpp, and vLLM unless its config
    says probabilistic, draft greedily and keep a draft equal to the target's sample. vLLM's CPU build is found from
    vLLM's platform, not from the package's name (a source build is the distribution `vllm`)."""
    from types import SimpleNamespace

    from draftsmith.engines import vllm

    assert serve.drafting_rule("draftsmith", 0.0) is None and serve.drafting_rule("transformers", 0.8) == serve.SAMPLED
    assert serve.drafting_rule("llamacpp", 0.8) == serve.GREEDY and serve.drafting_rule("vllm", 0.8) == serve.GREEDY
    handle = SimpleNamespace(draft_sampling=lambda: "probabilistic")
    assert serve.drafting_rule("vllm", 0.8, handle) == serve.SAMPLED
    engine = vllm.VllmEngine.__new__(vllm.VllmEngine)
    engine.python, engine._build, engine._version = "python", None, None
    said = "INFO some import log\nbuild: cpu 0.32.0\n"  # a source build: distribution `vllm`, device cpu
    monkeypatch.setattr(vllm.subprocess, "run", lambda *a, **kw: SimpleNamespace(stdout=said, returncode=0))
    assert engine.build() == "cpu" and engine.version() == "0.32.0"
    assert "current_platform.device_type" in vllm.BUILD_PROBE


def test_the_arms_alternate_with_a_warm_up_and_server_engines_run_abba():
    """In this process: an untimed warm-up per arm, then each job plain and speculative, the next job the other
    way round; an engine that starts a server per run: plain, speculative, speculative, plain (ABBA)."""
    class Log:
        name, batches = "draftsmith", True

        def __init__(self, server):
            self.starts_per_run, self.calls = server, []

        def run(self, jobs, speculative):
            self.calls.append(("S" if speculative else "P", len(jobs), jobs[0].max_new_tokens))
            return [Output([[[1, 2]] for _ in j.prompts], 0.1, 1, 1, {"target_passes": 1}) for j in jobs]

    reqs = {("math", 0.0, 1): [(0, [5, 6]), (1, [7, 8])]}
    here = Log(False)
    keys, plain, spec = serve._run(here, reqs, 1.0, 16, 0, rounds=2)
    assert here.calls == [("P", 1, 8), ("S", 1, 8), ("P", 1, 16), ("S", 1, 16), ("S", 1, 16), ("P", 1, 16),
                          ("P", 1, 16), ("S", 1, 16), ("S", 1, 16), ("P", 1, 16)]
    assert len(plain) == len(spec) == 2 and all(len(r) == 2 for r in plain + spec)
    server = Log(True)
    keys, plain, spec = serve._run(server, reqs, 1.0, 16, 0, rounds=2)
    assert [c[0] for c in server.calls] == ["P", "S", "S", "P"] and all(c[1] == 3 for c in server.calls)
    assert all(len(r) == 2 for r in plain + spec)  # the warm-up job is dropped


def test_rows_count_greedy_mismatches_and_say_when_the_range_holds_one():
    keys = [("math", 0.0, 1, [0]), ("math", 0.0, 1, [1])]

    def out(tokens, seconds):
        return Output([[tokens]], seconds, 3, 3, {"target_passes": 2})

    plain = [[out([1, 2, 3], 1.0), out([4, 5], 1.0)], [out([1, 2, 3], 1.0), out([4, 5], 1.0)]]
    spec = [[out([1, 2, 3], 0.8), out([4, 9], 0.8)], [out([1, 2, 3], 1.25), out([4, 9], 1.25)]]
    (row,) = serve._rows("draftsmith", None, None, keys, plain, spec, 1.0, 3, 1)
    assert (row["greedy_mismatches"], row["greedy_compared"]) == (2, 4)
    assert row["greedy_first_mismatch"] == {"prompt": 1, "round": 0, "position": 1, "plain": [5],
                                            "speculative": [9]}
    assert row["speedup_by_round"] == pytest.approx([1.25, 0.8]) and row["speedup_crosses_1"]
    lines = serve.row_notes(row)
    assert any("holds 1.0" in x for x in lines) and any("2 of 4 outputs differ" in x for x in lines)
    assert row["new_tokens_plain"] == row["new_tokens_speculative"] == 10
    (vrow,) = serve._rows("vllm", None, "cpu", [("math", 0.8, 1, [0])], [[plain[0][0]]], [[spec[0][0]]], 1.0, 3, 1)
    assert not vrow["speedup_valid"] and "greedy_mismatches" not in vrow and vrow["drafting_rule"] == serve.GREEDY


def test_the_plot_marks_rows_with_notes(tmp_path):
    row = {"set": "math", "turn": 1, "batch": 1, "temperature": 0.8, "tokens_per_call": 2.0, "speedup": 1.1,
           "speedup_valid": False, "speedup_by_round": [1.0, 1.2], "note": "broken", "drafting_rule": serve.GREEDY}
    serve.plot({"engine": "vllm", "version": "0.32.0", "k": 3, "rows": [row, {**row, "note": None,
                "drafting_rule": None, "speedup_valid": True}]}, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


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
    from draftsmith.sampling.load import load_model, load_tokenizer
    from draftsmith.sampling.names import resolve

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
    from draftsmith.sampling.load import load_model, load_tokenizer
    from draftsmith.sampling.names import resolve

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
    turn2 = [(spec, j) for spec, j in engine.jobs if "And its colour?" in tok.decode(j.prompts[0])]
    assert {spec for spec, _ in turn2} == {False, True}
    (prompt,) = turn2[0][1].prompts
    assert all(j.prompts == [prompt] for _, j in turn2)  # plain and speculative: the same turn-2 prompt
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
                       "--rounds", "1", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["batches"] == [1, 2] and [(r["batch"], r["turn"]) for r in rep["rows"]] == [(1, 1), (2, 1)]
    for r in rep["rows"]:
        assert r["prompts"] == 3 and r["tokens_per_call"] == pytest.approx(3.0) and r["tok_s_speculative"] > 0
        assert r["new_tokens_plain"] == r["new_tokens_speculative"] == 27
    assert " batch" in capsys.readouterr().out
    assert serve.main([str(self_bundle), "--engine", "transformers", "--prompts", "math", "--raw", "--batch",
                       "4"]) == 2
    assert "does not batch" in capsys.readouterr().err
