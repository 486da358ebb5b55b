"""The Lightning strategy a run trains with: `trainer.strategy` as the recipe gives it, completed by what depends on
the draft. An FSDP strategy is told to wrap each of the draft's decoder layers in its own FSDP unit: without an
auto-wrap policy FSDP makes the whole module one unit, whose weights and gradients are gathered whole on every rank
for the whole pass (no sharding benefit at the peak, full-size all-gathers). The layer class depends on the
target's family, so it is read from the draft built for this target, not written in the recipe."""

from __future__ import annotations

from hydra.utils import get_class, instantiate


def layer_classes(model) -> set[type]:
    """The classes of the draft's repeated decoder layers: FSDP's units. An HF model names them in
    `_no_split_modules` (the blocks that must stay whole on one device, which are its layers). A feature draft names
    none: its one layer is run through its parts (`inputs`, `qkv`, `finish`), never through its forward, and FSDP
    gathers a unit's weights only in that forward, so the layer stays in the root unit with the rest of the head."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return {type(m) for m in model.modules() if type(m).__name__ in names}


def build_strategy(spec, draft):
    """`trainer.strategy` (a `_target_` mapping) instantiated; an FSDP strategy the recipe gives no
    `auto_wrap_policy` wraps each of the draft's decoder layers (`layer_classes`)."""
    from lightning.pytorch.strategies import FSDPStrategy

    extra = {}
    if issubclass(get_class(spec["_target_"]), FSDPStrategy) and spec.get("auto_wrap_policy") is None:
        classes = layer_classes(draft)
        if classes:
            extra["auto_wrap_policy"] = classes
    return instantiate(spec, **extra)
