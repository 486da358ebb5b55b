"""Train a draft model for speculative sampling against a target, and keep the one the target accepts most.

    python train/draft.py recipe=shallow_wide                 # demo: SmolLM2-135M, stdlib corpus, ~40 min on 2 cores
    python train/draft.py recipe=smoke                        # tiny end-to-end check, < 2 min
    python train/draft.py recipe=shallow_wide target.name=DIR data.source=corpus.jsonl trainer=gpu
"""

from __future__ import annotations

import logging
import sys
import time

import hydra
import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from sampling.models import ModelNotFound, cache_home, load_model, load_tokenizer
from train.callbacks import AcceptanceCallback
from train.corpus import CorpusError, generate_corpus, load_blocks
from train.models import DraftConfig, build_draft
from train.module import DraftModule
from train.report import final_report, print_report
from train.setup import SetupError, check_writable, loaders, loggers, validation_prompts

log = logging.getLogger("draftsmith")


def train(cfg: DictConfig) -> dict:
    t0 = time.time()
    L.seed_everything(cfg.seed, verbose=False)
    out_dir = check_writable(cfg.out_dir)

    # 1. The frozen target and its tokenizer.
    target = load_model(cfg.target.name, cfg.target.dtype)
    tok = load_tokenizer(cfg.target.name)

    # 2. The corpus, tokenized with the target's tokenizer (optionally sampled from the target itself).
    source = cfg.data.source
    if cfg.data.generated.enabled:
        source = str(_generated_corpus(cfg, target, tok, out_dir))
    blocks = load_blocks(source, tok, cfg.data.block_size, cfg.data.val_fraction, cfg.seed, cfg.data.text_field,
                         cfg.data.max_documents)
    train_dl, val_dl = loaders(blocks, cfg)

    # 3. The draft: shallow and wide, of the target's family, sharing its vocabulary.
    draft = build_draft(target, DraftConfig(**OmegaConf.to_container(cfg.draft)))
    if draft.config.vocab_size != target.config.vocab_size:
        raise SetupError(f"draft vocabulary ({draft.config.vocab_size}) differs from the target's "
                         f"({target.config.vocab_size}); drafts must share the target's tokenizer")

    # 4. Lightning: module, acceptance validation, best-by-acceptance checkpoints, loggers.
    module = DraftModule(draft, target, loss=OmegaConf.to_container(cfg.loss), optim=OmegaConf.to_container(cfg.optim),
                         sampler=OmegaConf.to_container(cfg.sampler), max_steps=cfg.trainer.max_steps)
    s = cfg.sampler
    ids, mask = validation_prompts(blocks, s.n_prompts, s.prompt_tokens)
    acceptance_cb = AcceptanceCallback(ids, mask, tok, k=s.k, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                       max_new_tokens=s.max_new_tokens, seed=cfg.seed)
    metric = cfg.checkpoint.monitor
    checkpoint_cb = ModelCheckpoint(dirpath=out_dir / "checkpoints", monitor=metric, mode=cfg.checkpoint.mode,
                                    save_last=True, save_top_k=1, auto_insert_metric_name=False,
                                    filename=f"step{{step}}-{metric.split('/')[-1]}{{{metric}:.4f}}")
    trainer_kwargs = OmegaConf.to_container(cfg.trainer)
    if isinstance(trainer_kwargs.get("strategy"), dict):
        trainer_kwargs["strategy"] = instantiate(cfg.trainer.strategy)
    trainer = L.Trainer(**trainer_kwargs, default_root_dir=str(out_dir), callbacks=[acceptance_cb, checkpoint_cb],
                        logger=loggers(cfg, out_dir))

    # 5. Train (ckpt_path=last resumes with optimizer, loops and best-checkpoint state).
    trainer.fit(module, train_dl, val_dl, ckpt_path=cfg.ckpt_path, weights_only=True)

    # 6. Report: save the best draft as a HF checkpoint, measure it and the cut-target baseline.
    if not trainer.is_global_zero:
        return {}
    tps = trainer.callback_metrics.get("train/tokens_per_s")
    report = final_report(target=target, module=module, tokenizer=tok, cfg=cfg, out_dir=out_dir,
                          checkpoint_cb=checkpoint_cb, acceptance_cb=acceptance_cb, wall_s=time.time() - t0,
                          tokens_per_s=float(tps) if tps is not None else None,
                          token_counts=torch.bincount(blocks["train"].flatten(), minlength=target.config.vocab_size))
    print_report(report)
    return report


def _generated_corpus(cfg, target, tok, out_dir):
    g = cfg.data.generated
    base = load_blocks(cfg.data.source, tok, cfg.data.block_size, cfg.data.val_fraction, cfg.seed,
                       cfg.data.text_field, cfg.data.max_documents)["train"]
    idx = torch.linspace(0, len(base) - 1, min(g.n_prompts, len(base))).long()
    prompts = [tok.decode(b[: cfg.sampler.prompt_tokens], skip_special_tokens=True) for b in base[idx]]
    s = cfg.sampler  # the file name holds every setting but the prompt count, which may grow (resumable)
    name = f"{cfg.target.name.replace('/', '_')}-T{s.temperature}-p{s.top_p}-n{g.max_new_tokens}-seed{cfg.seed}"
    path = cache_home() / "generated" / f"{name}.jsonl"
    return generate_corpus(target, tok, prompts, path, samples_per_prompt=g.samples_per_prompt,
                           max_new_tokens=g.max_new_tokens, temperature=cfg.sampler.temperature,
                           top_p=cfg.sampler.top_p, seed=cfg.seed)


@hydra.main(version_base="1.3", config_path="../recipes", config_name="draft")
def main(cfg: DictConfig) -> None:
    logging.getLogger("lightning.pytorch").propagate = False  # Hydra's job logging would print each line twice
    try:
        train(cfg)
    except (ModelNotFound, CorpusError, SetupError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
