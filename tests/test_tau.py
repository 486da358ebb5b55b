"""tau read from each real engine's own counters on one fixed case: the demo target as its own draft, greedy, K 3,
13 new tokens of one request, every draft accepted. tau is tokens per verification pass, the prompt pass and its
token excluded (deploy/bench/serve.py `tau_of`): vLLM and llama.cpp spend a prompt pass that emits the first token,
then 3 passes of 4 (4.0); our sampler and transformers 3 passes of 4 and a last pass cut to 1 token (3.25). The
pure-function version of this case, over each engine's counters as its schedule records them, is in
tests/test_serve.py (`test_the_fixed_case_reads_tokens_per_verification_pass_in_every_engine`), and our sampler and
transformers run the case in the default suite (`test_serve_counts_tau_in_our_sampler_and_in_transformers`: 3.25);
here the two engines that run outside this process count it themselves. One speculative run each, no plain arm: a
vLLM start is the cost (CI's slow suite, beside tests/test_engines.py's)."""

import json

import pytest
from helpers import missing_resource

from draftsmith.deploy.bench import serve
from draftsmith.deploy.bundle import Bundle
from draftsmith.engines.base import Job

pytestmark = [pytest.mark.demo, pytest.mark.slow, pytest.mark.engine]

K, TOKENS = 3, 13
EXPECTED = {"vllm": 4.0, "llamacpp": 4.0}  # ours and transformers: 3.25 (tests/test_serve.py)


@pytest.fixture(scope="module")
def self_bundle(demo_target, tmp_path_factory):
    """The demo target as its own draft, as a bundle the engines open: no export (its measurements cost minutes and
    say nothing here), the draft the target's own folder, vLLM's config a draft_model one at K."""
    from pathlib import Path

    target_dir = Path(demo_target[1].name_or_path)  # the converted target's folder (the tokenizer was read there)
    assert (target_dir / "config.json").is_file()
    root = tmp_path_factory.mktemp("tau")
    (root / "vllm_speculative_config.json").write_text(json.dumps(
        {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": K}))
    return Bundle(root, {"recommended_k": K}, target_dir, target_dir)


@pytest.fixture(scope="module")
def prompt(demo_target):
    _, tok = demo_target
    return serve.encode(tok, serve.load_set("math", 1), raw=False)[0]


def _tau(name: str, engine, prompt) -> tuple[float, dict]:
    serve.set_k(engine, K)
    (out,) = engine.run([Job([prompt], 1, TOKENS, 0.0)], speculative=True)
    assert out.new_tokens == TOKENS, f"{name}: {out.new_tokens} tokens (an EOS?): the case needs {TOKENS}"
    tau, _, native = serve.tau_of(name, out, K)
    print(name, tau, native)
    return tau, native


def test_tau_in_vllm(self_bundle, prompt):
    from draftsmith.engines.vllm import VllmEngine, missing

    if why := missing():
        missing_resource("vllm", why)
    tau, native = _tau("vllm", VllmEngine(self_bundle), prompt)
    assert tau == pytest.approx(EXPECTED["vllm"]) and native["vllm_mean_acceptance_length"] == pytest.approx(4.0)


def test_tau_in_llamacpp(self_bundle, prompt):
    from draftsmith.engines.llamacpp import LlamaCppEngine, missing

    if why := missing():
        missing_resource("llamacpp", why)
    tau, native = _tau("llamacpp", LlamaCppEngine(self_bundle), prompt)
    # before: tokens / (tokens - accepted) = 13 / 4 = 3.25, the prompt pass in the denominator
    assert tau == pytest.approx(EXPECTED["llamacpp"]) and native["llamacpp_draft_n_accepted"] == 9
