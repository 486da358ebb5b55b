"""`draftsmith bench trainers` at tiny size: our feature-head trainer, speculators' and SpecForge's own trainers
(each in its venv under $DRAFTSMITH_HOME/peers, launched on the CPU by our launchers) train a few steps on one
corpus of the tiny target's samples; each writes a head our loader reads, and one sampler judges them all."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from helpers import missing_resource

from draftsmith.deploy.bench import peers
from draftsmith.deploy.bench.peers import corpus_rows, head_tokens_of, write_vocab
from draftsmith.sampling.errors import DraftsmithError

# our trainer's settings for a 48-sample corpus of a 4-layer target: a 128-token head, feature layers SGLang's
# numbering can name (not the embedding's output), blocks and checks of smoke size; no chat turns among the prompts
# (the tiny target has no chat template, and recipe=feature_head's data.chat_prompts would be refused)
TINY = ["data.chat_prompts=0", "draft.draft_vocab=128", "draft.feature_layers=[1,2,3]", "data.block_size=64",
        "data.val_blocks=4", "data.val_fraction=0.1", "sampler.n_prompts=2", "sampler.on_target_prompts=2",
        "sampler.on_target_tokens=16", "sampler.max_new_tokens=16", "eval.n_prompts=2", "eval.max_new_tokens=16"]


def test_corpus_rows_train_the_sampled_tokens_and_the_vocab_is_one_map(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"ids": [5, 6, 7, 8], "prompt_tokens": 2}) + "\n"
                      + json.dumps({"ids": [1, 2], "prompt_tokens": 2}) + "\n")  # nothing sampled: no row
    assert corpus_rows(corpus) == [{"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}]
    import numpy as np
    import torch

    v = write_vocab([9, 2, 4], 12, tmp_path / "v")
    d2t, t2d = np.load(v["d2t"]), np.load(v["t2d"])
    assert (np.arange(3) + d2t).tolist() == [2, 4, 9] and t2d.nonzero()[0].tolist() == [2, 4, 9]
    m = torch.load(v["map"])
    assert m["d2t"].tolist() == d2t.tolist() and m["t2d"].tolist() == t2d.tolist()


def test_specforge_cannot_name_the_embedding_output(tmp_path):
    from transformers import LlamaConfig

    with pytest.raises(DraftsmithError, match="SGLang's numbering"):
        peers.specforge_draft_config(LlamaConfig(), [0, 2, 3], 128, tmp_path / "d.json")
    cfg = json.loads(peers.specforge_draft_config(LlamaConfig(), [2, 15, 27], 128, tmp_path / "d.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]


@pytest.fixture(scope="module")
def peer_venvs():
    """The peers' venvs, built once and cached under $DRAFTSMITH_HOME/peers (`draftsmith bench trainers
    --install`); a machine that cannot build them skips, or fails where DRAFTSMITH_REQUIRE names `peers`."""
    for name in peers.PEERS:
        try:
            peers.install(name)
        except DraftsmithError as e:
            missing_resource("peers", str(e))


@pytest.mark.slow
def test_each_trainer_writes_a_head_our_loader_reads_and_the_sampler_judges(tmp_path, peer_venvs):
    from draftsmith.sampling.feature import FeatureDraft
    from draftsmith.sampling.load import load_model

    out = tmp_path / "bench"
    # a sampling box too short for the corpus (3 x 48 samples; the box ends after the first batch of 64): no trainer
    # may continue it (ours once sampled another box in its own run, so it trained on more than the peers)
    cmd = [sys.executable, "-m", "draftsmith.deploy.cli", "bench", "trainers", "--target", "tiny-random",
           "--steps", "3", "--n-prompts", "48", "--samples-per-prompt", "3", "--max-new-tokens", "32",
           "--sample-minutes", "0.001", "--seq-len", "256", "--trainers", "ours", "speculators", "specforge",
           "--judge-prompts", "code", "--judge-n", "2", "--judge-tokens", "16", "--out", str(out), "--json",
           str(tmp_path / "t.json"), "--", *TINY, f"data.cache_dir={tmp_path / 'cache'}"]  # a corpus of its own
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    table = json.loads((tmp_path / "t.json").read_text())
    prepared = re.search(r"the corpus is ready: (\d+) samples", (out / "corpus.log").read_text()).group(1)
    with open(table["corpus"]) as f:
        assert sum(1 for _ in f) == int(prepared) < 3 * 48, "a trainer sampled more after the corpus was prepared"
    assert set(table["heads"]) == {"ours", "speculators", "specforge"}
    head_tokens = head_tokens_of(table["heads"]["ours"])
    for name, path in table["heads"].items():
        draft = load_model(path, "fp32")
        assert isinstance(draft, FeatureDraft), name
        assert list(draft.feature_layers) == [1, 2, 3], name
        assert head_tokens_of(path) == head_tokens, f"{name}'s head is not the shared vocabulary"
        for label in ("T", "greedy"):
            alpha = table["judge"][label]["alpha_on_target"][name]["code"]
            assert 0.0 <= alpha <= 1.0, (name, label, alpha)
    for name in ("speculators", "specforge"):
        assert table["runs"][name]["steps"] == 3 and table["runs"][name]["peak_rss_mb"] > 0
