"""Every recipe composed with every trainer group, as `draftsmith train recipe=R trainer=T` composes it, against the
table below: which compose, which are refused (and naming what), and the budget each runs for. A recipe added
without a row here fails, so the table stays the recipes' whole story."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from draftsmith.train import budget
from draftsmith.train.draft import RECIPES

TRAINERS = ("cpu", "ddp", "gpu", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3")
CPU_TRAINERS = ("cpu", "ddp")
GPU_BUDGET = {"samples": 500_000, "max_epochs": 3, "max_steps": -1, "max_time": None, "val_check_interval": 2000}
# recipe: (the hardware it is sized for, its budget; None: the trainer group's, as below)
TABLE = {
    "shallow_wide": ("cpu", {"samples": 40960, "max_epochs": None, "max_steps": 100000, "max_time": "00:00:16:00",
                             "val_check_interval": 200}),
    "shallow_wide_long": ("cpu", {"samples": 40960, "max_epochs": None, "max_steps": 100000,
                                  "max_time": "00:01:00:00", "val_check_interval": 500}),
    "feature_head": ("cpu", {"samples": 40960, "max_epochs": None, "max_steps": 100000, "max_time": "00:00:23:00",
                             "val_check_interval": 200}),
    "smoke": ("any", {"samples": None, "max_epochs": None, "max_steps": 6, "max_time": None,
                      "val_check_interval": 3}),
    "distill_kl": ("any", None),
    "paper_ratio_70b": ("gpu", {"samples": 256, "max_epochs": None, "max_steps": 20000, "max_time": None,
                                "val_check_interval": 500}),  # sized for `plan`: the trainer=gpu group's steps
    "gpu_8b": ("gpu", GPU_BUDGET),
    "gpu_8b_feature": ("gpu", GPU_BUDGET),
    "gpu_70b": ("gpu", GPU_BUDGET),
    "gpu_70b_feature": ("gpu", GPU_BUDGET),
}
# the trainer groups' own budget (a recipe that sets none runs for it)
TRAINER_BUDGET = {"cpu": {"samples": None, "max_epochs": None, "max_steps": 800, "max_time": None,
                          "val_check_interval": 100},
                  "gpu": {"samples": None, "max_epochs": None, "max_steps": 20000, "max_time": None,
                          "val_check_interval": 500}}
# composes, but no machine runs it yet (sized_for.refused): train and data refuse it on every trainer, plan prints it
NOT_YET = {"gpu_70b_feature": "every rank holds a replica of the ~70B target"}
DRAFT_KIND = {"gpu_8b": "independent", "gpu_8b_feature": "feature_head", "gpu_70b": "independent",
              "gpu_70b_feature": "feature_head"}


def _budget(cfg) -> dict:
    t = cfg.trainer
    return {"samples": budget.samples(cfg), "max_epochs": t.get("max_epochs"), "max_steps": t.max_steps,
            "max_time": t.max_time, "val_check_interval": t.val_check_interval}


@pytest.fixture(scope="module")
def composed():
    out = {}
    with initialize_config_dir(config_dir=RECIPES, version_base="1.3"):
        for recipe in TABLE:
            for trainer in TRAINERS:
                extra = ["target.name=org/model"] if TABLE[recipe][0] == "gpu" else []
                out[recipe, trainer] = compose("draft", overrides=[f"recipe={recipe}", f"trainer={trainer}", *extra])
    return out


def test_every_recipe_file_has_a_row():
    assert sorted(p.stem for p in (Path(RECIPES) / "recipe").glob("*.yaml")) == sorted(TABLE)


@pytest.mark.parametrize("recipe", TABLE)
def test_each_recipe_with_each_trainer_composes_or_is_refused_as_the_table_says(composed, recipe):
    hardware, expected = TABLE[recipe]
    for trainer in TRAINERS:
        cfg = composed[recipe, trainer]
        on_gpu = trainer not in CPU_TRAINERS
        refused = (hardware == "cpu" and on_gpu) or (hardware == "gpu" and not on_gpu)
        if refused:
            with pytest.raises(ValueError) as e:
                budget.check_recipe(cfg, recipe)
            message = str(e.value)
            assert "\n" not in message and f"recipe={recipe}" in message
            assert f"recipe={cfg.sized_for.instead}" in message  # names the recipe to use instead
            continue
        if recipe in NOT_YET:
            with pytest.raises(ValueError, match=f"recipe={recipe} cannot run yet: {NOT_YET[recipe]}") as e:
                budget.check_recipe(cfg, recipe)
            assert "\n" not in str(e.value)
            cfg.plan = True
        budget.check_recipe(cfg, recipe)
        # the command line's trainer group wins over a recipe's own choice (Hydra: overrides before defaults)
        strategy = cfg.trainer.strategy
        if trainer in ("fsdp", "deepspeed_stage_2", "deepspeed_stage_3"):
            assert trainer.split("_")[0] in str(strategy.get("_target_", "")).lower()
            if trainer.startswith("deepspeed"):
                assert strategy.stage == int(trainer[-1])
        want = expected or TRAINER_BUDGET["cpu" if trainer in CPU_TRAINERS else "gpu"]
        assert _budget(cfg) == want, (recipe, trainer)


def test_gpu_recipes_need_a_target_and_train_their_draft_kind(composed):
    with initialize_config_dir(config_dir=RECIPES, version_base="1.3"):
        for recipe, kind in DRAFT_KIND.items():
            cfg = compose("draft", overrides=[f"recipe={recipe}"])
            assert OmegaConf.is_missing(cfg.target, "name")  # the demo target is no fallback
            with pytest.raises(ValueError, match=f"recipe={recipe} needs the target.*target.name="):
                budget.check_recipe(cfg, recipe)
            cfg = composed[recipe, "gpu"]
            assert cfg.draft.kind == kind and cfg.trainer.accelerator == "gpu"
            assert cfg.data.block_size >= 2048 and cfg.data.generated.max_minutes is None
    # the CPU demo keeps its name, keys and target: the README's main command is unchanged
    assert composed["shallow_wide", "cpu"].target.name == "smollm2-135m"


def test_every_feature_recipe_norms_each_target_state_before_fc(composed):
    """draft.feature_norm=each won its equal-time A/B on two seeds (docs/defaults.md): every recipe that trains a
    feature head carries it, the CPU demo and the GPU recipes alike; an independent draft has no such norm."""
    kinds = {}
    for recipe, (hardware, _) in TABLE.items():
        draft = composed[recipe, "gpu" if hardware == "gpu" else "cpu"].draft
        kinds[recipe] = draft.get("kind", "independent")
        assert draft.get("feature_norm", "none") == ("each" if kinds[recipe] == "feature_head" else "none"), recipe
    assert sorted(r for r, k in kinds.items() if k == "feature_head") == ["feature_head", "gpu_70b_feature",
                                                                          "gpu_8b_feature"]


@pytest.mark.parametrize("chat, items, ranks, batch, accumulate, epochs", [
    (False, 1000, 1, 8, 1, 3), (False, 1000, 8, 8, 1, 2), (False, 1003, 8, 4, 2, 3), (False, 7, 8, 1, 1, 1),
    (True, 7, 2, 4, 1, 2), (True, 10, 3, 4, 2, 3)])
def test_the_steps_of_a_budget_in_epochs_are_what_lightning_runs(chat, items, ranks, batch, accumulate, epochs):
    """`budget.derived_steps` against a real Lightning fit: the loader train/data.py builds (blocks in micro-batches
    of data.batch_size, or data=chat's whole batches, one an item), given rank 0's share of `ranks` as Lightning's
    own distributed sampler gives it, run for the epochs with gradient accumulation; the steps it counts are the
    optimizer steps Lightning takes. A recipe's own max_steps stands."""
    import lightning as L
    import torch
    from lightning.pytorch.trainer.connectors.data_connector import _get_distributed_sampler, _update_dataloader

    from draftsmith.train.data import chat_loaders, loaders

    cfg = OmegaConf.create({"trainer": {"max_steps": -1, "max_epochs": epochs, "accumulate_grad_batches": accumulate},
                            "data": {"batch_size": batch, "num_workers": 0, "val_blocks": 1}, "seed": 0})
    rows = torch.zeros(items, 4, dtype=torch.long)
    if chat:
        train, _ = chat_loaders({"train": list(rows.view(items, 1, 4)), "val": []}, cfg)
    else:
        train, _ = loaders({"train": rows, "val": rows[:1]}, cfg)
    shard = _get_distributed_sampler(train, shuffle=True, overfit_batches=0, num_replicas=ranks, rank=0)
    train = _update_dataloader(train, shard)

    class Step(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, b, i):
            return (self.w - 1).pow(2).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(max_epochs=epochs, accumulate_grad_batches=accumulate, use_distributed_sampler=False,
                        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(Step(), train)
    assert budget.derived_steps(cfg, items, ranks, 1 if chat else batch) == max(1, trainer.global_step)
    cfg.trainer.max_steps = 100
    assert budget.derived_steps(cfg, items, ranks, 1 if chat else batch) is None


def test_train_help_lists_every_recipe_group_and_how_to_print_a_config(capsys):
    from draftsmith.deploy.cli import main

    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for recipe in TABLE:
        line = next((ln for ln in out.splitlines() if ln.split()[:1] == [recipe]), None)
        assert line is not None and len(line.split()) > 3, recipe  # its name and its one line
    for group in ("data", "draft", "loss", "target", "trainer", "logger", "callbacks", "sampler"):
        choices = sorted(p.stem for p in (Path(RECIPES) / group).glob("*.yaml"))
        assert f"  {group:<15}{', '.join(choices)}" in out
    assert "--cfg job" in out


def test_recipes_verb_lists_shows_and_copies_a_recipe(capsys, tmp_path):
    from draftsmith.deploy.cli import main

    assert main(["recipes"]) == 0
    listed = capsys.readouterr().out
    assert all(f"\n  {name} " in listed for name in TABLE)
    assert main(["recipes", "gpu_8b"]) == 0
    assert capsys.readouterr().out.split("\n", 1)[1] == (Path(RECIPES) / "recipe" / "gpu_8b.yaml").read_text()
    dest = tmp_path / "mine" / "recipe" / "big.yaml"
    assert main(["recipes", "gpu_70b", "--copy", str(dest)]) == 0
    assert dest.read_text() == (Path(RECIPES) / "recipe" / "gpu_70b.yaml").read_text()
    assert f"draftsmith train --config-dir {tmp_path / 'mine'} recipe=big" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["recipes", "nope"])
    assert e.value.code == 2


def test_a_gpu_recipe_trains_only_on_a_prepared_corpus(tmp_path):
    """No rank waits while rank 0 samples: a GPU recipe without its corpus is refused in one line naming the data
    command, keyed by the corpus file train itself would read; once that file holds the samples, it trains."""
    from draftsmith.data.prompts import split_prompts
    from draftsmith.sampling.load import load_tokenizer
    from draftsmith.train.launch import detect
    from draftsmith.train.prepare import check_prepared, generated_key

    tok = load_tokenizer("tiny-random")
    small = ["target.name=tiny-random", f"data.cache_dir={tmp_path / 'cache'}", "data.prompts=broad",
             "data.generated.n_prompts=6", "data.generated.engine=draftsmith", "data.chat_template=false"]
    with initialize_config_dir(config_dir=RECIPES, version_base="1.3"):
        gpu = compose("draft", overrides=["recipe=gpu_8b", *small])
        cpu = compose("draft", overrides=["recipe=shallow_wide", *small])
    files, _ = split_prompts(gpu, tok)
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(ValueError, match=r"holds 0 of its 6 samples: prepare it first with `draftsmith data "
                                         r"recipe=\S+") as e:
        check_prepared(gpu, tok, files, run, detect())
    assert "\n" not in str(e.value)
    check_prepared(cpu, tok, files, run, detect())  # the CPU demo samples in the run: one command
    prompts, name = generated_key(gpu, tok, files)
    corpus = tmp_path / "cache" / "generated" / f"{name}.jsonl"
    corpus.parent.mkdir(parents=True)
    corpus.write_text('{"text": "x"}\n' * 5)
    with pytest.raises(ValueError, match="holds 5 of its 6 samples"):
        check_prepared(gpu, tok, files, run, detect())
    corpus.write_text('{"text": "x"}\n' * 6)
    check_prepared(gpu, tok, files, run, detect())
    corpus.unlink()
    (run / "data.json").write_text("{}")  # a resumed run reads the corpus its record names
    check_prepared(gpu, tok, files, run, detect())


def test_the_data_command_prepares_the_corpus_a_gpu_recipe_checks_for(tmp_path):
    """`draftsmith data` (prepare_only) with a GPU recipe's data=generated writes the very file the refusal above
    counts, so the refusal clears; the target samples it (here on the CPU: the sampling is the same code)."""
    from draftsmith.data.prompts import split_prompts
    from draftsmith.sampling.load import load_tokenizer
    from draftsmith.train.launch import detect
    from draftsmith.train.prepare import check_prepared, prepare_only

    tok = load_tokenizer("tiny-random")
    small = ["target.name=tiny-random", f"data.cache_dir={tmp_path / 'cache'}", "data.prompts=broad",
             "data.generated.n_prompts=3", "data.generated.max_new_tokens=8", "data.generated.engine=draftsmith",
             "data.chat_template=false"]
    with initialize_config_dir(config_dir=RECIPES, version_base="1.3"):
        gpu = compose("draft", overrides=["recipe=gpu_8b", *small])
        here = compose("draft", overrides=["recipe=gpu_8b", *small, "trainer.accelerator=cpu"])
    files, _ = split_prompts(gpu, tok)
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(ValueError, match="holds 0 of its 3 samples"):
        check_prepared(gpu, tok, files, run, detect())
    record = prepare_only(here, tok, files, tmp_path / "data_run", detect())
    assert record["rows"] == 3
    check_prepared(gpu, tok, files, run, detect())  # prepared: the GPU run trains


def test_train_refuses_a_gpu_recipe_without_its_corpus_in_one_line(tmp_path):
    from conftest import run_entry

    res = run_entry("recipe=gpu_8b", "target.name=tiny-random", f"data.cache_dir={tmp_path}", "data.prompts=broad",
                    "data.generated.engine=draftsmith", "data.chat_template=false", "trainer.devices=1",
                   f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 2, res.stderr[-2000:]
    (line,) = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert "draftsmith data recipe=gpu_8b target.name=tiny-random" in line and "data.prompts=broad" in line
    assert not (tmp_path / "generated").exists()  # nothing was sampled
