"""The distributed optimizer's checkpoint across expert-parallel sizes.

megatron gives a Mixture-of-Experts model at EP > 1 two optimizers (a ChainedOptimizer: the
dense parameters, reduced over DP; the experts', reduced over the ranks holding the same
experts, in a param group marked `is_expert_parallel`), and at EP = 1 one optimizer with every
parameter. Its sharded state dict differs accordingly: the per-parameter tensors under
`chained_<i>.` prefixes and the param groups (hyperparameters and Adam's step) nested per
optimizer. A checkpoint written at one EP then does not load at another.

The tensors: the save and the load ask megatron for unprefixed keys (`chained_optim_avoid_prefix`,
which its fully reshardable format allows), so each parameter's Adam moments are found by the
parameter's own name at any layout. The param groups (not sharded: what dist_checkpointing
returns is the writer's structure) are put back into this layout's structure here: each group
of this optimizer takes the values of the saved group with the same identity (megatron's
`param_group_identifier_keys`), else of the one differing only in `is_expert_parallel`.
"""
from __future__ import annotations

from megatron.core.dist_checkpointing.mapping import ShardedBase
from megatron.core.optimizer.optimizer import param_group_identifier_keys

# fully reshardable per-parameter state, keys without the chained optimizer's index
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
_IDENTITY = tuple(param_group_identifier_keys)


def _holds_sharded(node) -> bool:
    if isinstance(node, ShardedBase):
        return True
    if isinstance(node, dict):
        return any(_holds_sharded(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return any(_holds_sharded(v) for v in node)
    return False


def _rebuild(current, loaded):
    """`current`'s structure with each sharded leaf replaced by `loaded`'s value at its path
    and every other leaf kept (the loaded dict holds the writer's structure around them)."""
    if isinstance(current, ShardedBase):
        return loaded
    if not _holds_sharded(current):
        return current
    if isinstance(current, dict):
        return {k: _rebuild(v, loaded[k]) if _holds_sharded(v) else v for k, v in current.items()}
    return type(current)(_rebuild(v, loaded[i]) if _holds_sharded(v) else v for i, v in enumerate(current))


def param_groups(node) -> list[dict]:
    """Every param group under `node` (one optimizer's list, or each chained optimizer's)."""
    if isinstance(node, dict):
        found = list(node["param_groups"]) if isinstance(node.get("param_groups"), list) else []
        return found + [g for k, v in node.items() if k != "param_groups" for g in param_groups(v)]
    if isinstance(node, (list, tuple)):
        return [g for v in node for g in param_groups(v)]
    return []


def _source(group: dict, saved: list[dict]) -> dict:
    def identity(g, keys):
        return tuple(g.get(k, g.get(f"pre_{k}")) for k in keys)
    for keys in (_IDENTITY, tuple(k for k in _IDENTITY if k != "is_expert_parallel")):
        for candidate in saved:
            if identity(candidate, keys) == identity(group, keys):
                return candidate
    raise ValueError(f"the checkpoint's optimizer has no param group like this run's "
                     f"{dict(zip(_IDENTITY, identity(group, _IDENTITY)))}: it was written with other "
                     f"train.weight_decay / learning-rate settings")


def to_this_layout(current: dict, loaded: dict) -> dict:
    """The optimizer state dict to load into this run's optimizer.

    current: this optimizer's sharded state dict (as built for the load); loaded: what
    dist_checkpointing.load returned for it (tensors at current's paths, param groups in the
    writer's structure)."""
    state = _rebuild(current, loaded)
    saved = param_groups(loaded)
    for group in param_groups(state):
        source = _source(group, saved)
        group.update({k: v for k, v in source.items() if k not in _IDENTITY and k != "params"})
    return state
