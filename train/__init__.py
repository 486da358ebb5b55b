"""Training drafts: Lightning + Hydra. The entry (`train/draft.py`, `draftsmith train`) registers the config schema
(`schema.py`) that `recipes/draft.yaml` starts from; importing this package loads neither, so the deploy path (export,
deploy-check) needs no trainer."""
