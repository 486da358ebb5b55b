"""Training drafts: Lightning + Hydra. Importing it registers the config schema (`schema.py`) that
`recipes/draft.yaml` starts from, so any Hydra compose of the recipes finds it."""

from draftsmith.train import schema

schema.register()
