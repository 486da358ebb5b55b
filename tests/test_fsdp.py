"""`trainer=fsdp` shards the draft by decoder layer (issue 44): the strategy built for a draft wraps each of its
layers in an FSDP unit, and real FSDP (2 gloo processes on the CPU) makes one unit per layer plus the root, keeps
half of every unit on each rank and trains."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch.strategies import FSDPStrategy
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from draftsmith.drafts.build import DraftConfig, draft_config_for
from draftsmith.sampling.feature import FeatureConfig, FeatureDraft
from draftsmith.train.draft import RECIPES
from draftsmith.train.strategy import build_strategy, layer_classes

TESTS = Path(__file__).resolve().parent


def _fsdp_spec(*overrides):
    with initialize_config_dir(config_dir=RECIPES, version_base="1.3"):
        return compose("draft", overrides=["out_dir=/tmp/unused", "trainer=fsdp", *overrides]).trainer.strategy


def _draft():
    tc = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=30,
                     num_attention_heads=4, num_key_value_heads=2)
    return AutoModelForCausalLM.from_config(draft_config_for(tc, DraftConfig()))


def test_the_fsdp_strategy_wraps_the_drafts_decoder_layers():
    strategy = build_strategy(_fsdp_spec(), _draft())
    assert isinstance(strategy, FSDPStrategy)
    assert strategy.kwargs["auto_wrap_policy"]._module_classes == {LlamaDecoderLayer}


def test_a_feature_draft_stays_one_fsdp_unit():
    """Its one layer runs through its parts, never its forward, where FSDP gathers a unit: it cannot be a unit."""
    draft = FeatureDraft(FeatureConfig.for_target(LlamaConfig(hidden_size=64, num_hidden_layers=8,
                                                             num_attention_heads=4, vocab_size=256)))
    assert layer_classes(draft) == set()
    assert "auto_wrap_policy" not in build_strategy(_fsdp_spec(), draft).kwargs


def test_fsdp_on_two_processes_makes_one_unit_per_layer_and_shards_each(tmp_path):
    """Real FSDP with the recipe's strategy on 2 gloo processes, the embeddings frozen (draft.freeze_embeddings):
    one unit per decoder layer and the root, half of the parameters on each rank, three steps that lower the loss
    and leave the frozen embeddings as they were."""
    from test_launch import free_port

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(free_port()), str(TESTS / "fsdp_worker.py"), str(tmp_path), "frozen"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        print(r)
        assert r["policy"] == ["LlamaDecoderLayer"]
        assert r["units"] == r["layers"] + 1 == 4  # before issue 44: 1, the whole draft
        assert r["local"] == r["params"] / 2  # what train/plan.py counts as the 4 P / N fp32 shard
        assert r["losses"][-1] < r["losses"][0] and r["embedding_kept"]
    assert torch.tensor(ranks[0]["losses"]).ne(torch.tensor(ranks[1]["losses"])).any()  # their own batches
