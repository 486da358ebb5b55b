"""Training drafts: Lightning + Hydra, which the `train` extra installs (`pip install "draftsmith[train]"`; the base
install runs the sampler and the deploy path). The entry (`train/draft.py`, `draftsmith train`) checks for that extra
and registers the config schema (`schema.py`) that `recipes/draft.yaml` starts from; importing this package loads
neither, so exporting a finished run and judging engines need no trainer."""

from importlib.util import find_spec

from draftsmith.sampling.errors import DraftsmithError

# The packages of the `train` extra (pyproject.toml) that every run imports, by the module each provides. The extra's
# datasets and wandb are imported where a corpus or the logger needs them: a run with logger=csv on the stdlib
# corpus (the GPU check, on a machine without W&B) has no use for them.
TRAIN_CORE = {"lightning": "lightning", "hydra": "hydra-core", "omegaconf": "omegaconf"}


class MissingExtra(ModuleNotFoundError, DraftsmithError):
    """The packages of an extra are not installed: a DraftsmithError and an ImportError, so that code which tolerates
    a missing module still does; its message is the one line that says which install fixes it, and `extra` names
    the extra."""

    def __init__(self, extra: str, missing: list[str]):
        super().__init__(f"draftsmith's trainer needs the `{extra}` extra ({', '.join(missing)} not installed): "
                         f'pip install "draftsmith[{extra}]"', name=missing[0])
        self.extra = extra


def require_train_extra() -> None:
    """Raise MissingExtra unless the packages every training run imports are installed (found, not imported)."""
    missing = [dist for module, dist in TRAIN_CORE.items() if find_spec(module) is None]
    if missing:
        raise MissingExtra("train", missing)
