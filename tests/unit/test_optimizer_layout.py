"""checkpoint/optimizer_layout.py: an optimizer checkpoint written at one expert-parallel size
(one optimizer, or megatron's chained dense + expert optimizers) is handed to the other's
load_state_dict in that one's structure, with the writer's param-group values (Adam's step).
The end-to-end resume at another EP: tests/dist/test_moe_layouts.py."""
import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor


def sharded(key):
    return ShardedTensor.from_rank_offsets(key, torch.zeros(2))


def group(wd_mult, expert, step, lr=1e-4):
    return {"wd_mult": wd_mult, "lr_mult": 1.0, "is_expert_parallel": expert, "is_decoupled_lr": False,
            "step": step, "lr": lr, "params": [0]}


def single(step, names):
    return {"optimizer": {"param_groups": [group(1.0, False, step), group(0.0, False, step)]},
            "param_state": {i: {"exp_avg": sharded(f"optimizer.state.exp_avg.{n}")} for i, n in enumerate(names)},
            "param_state_sharding_type": "fully_reshardable"}


def chained(step, dense, experts):
    return {0: single(step, dense),
            1: {"optimizer": {"param_groups": [group(1.0, True, step)]},
                "param_state": {i: {"exp_avg": sharded(f"optimizer.state.exp_avg.{n}")} for i, n in enumerate(experts)},
                "param_state_sharding_type": "fully_reshardable"}}


def loaded(current, saved_common, value):
    """What dist_checkpointing.load returns: the writer's common values, this run's tensors."""
    from megatron.core.dist_checkpointing.dict_utils import merge
    out = {k: v for k, v in saved_common.items()}

    def tensors(node):
        if isinstance(node, ShardedTensor):
            return torch.full((2,), value(node.key))
        if isinstance(node, dict):
            return {k: tensors(v) for k, v in node.items() if not isinstance(v, (str, float))
                    and k != "optimizer"}
        return node
    return merge(out, tensors(current))


def common(sd):
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    return extract_matching_values(sd, lambda x: not isinstance(x, ShardedTensor))[0]


def key_value(key):
    return float(len(key))


@pytest.mark.parametrize("writer,reader", [("chained", "single"), ("single", "chained"), ("single", "single"),
                                           ("chained", "chained")])
def test_state_takes_the_readers_structure_and_the_writers_values(writer, reader):
    from megarl.checkpoint.optimizer_layout import param_groups, to_this_layout
    dense, experts = ["a.weight", "norm.weight"], ["experts.weight"]
    build = {"single": lambda step: single(step, dense + experts),
             "chained": lambda step: chained(step, dense, experts)}
    current = build[reader](0.0)            # the fresh optimizer of this run
    saved = common(build[writer](7.0))      # the writer's param groups: 7 Adam steps
    state = to_this_layout(current, loaded(current, saved, key_value))
    assert [g["step"] for g in param_groups(state)] == [7.0] * len(param_groups(current))
    assert [g["is_expert_parallel"] for g in param_groups(state)] == [g["is_expert_parallel"]
                                                                      for g in param_groups(current)]
    parts = [state] if reader == "single" else [state[0], state[1]]
    names = [dense + experts] if reader == "single" else [dense, experts]
    for part, part_names in zip(parts, names):
        assert set(part) == {"optimizer", "param_state", "param_state_sharding_type"}
        for i, n in enumerate(part_names):
            want = torch.full((2,), key_value(f"optimizer.state.exp_avg.{n}"))
            assert torch.equal(part["param_state"][i]["exp_avg"], want)


def test_a_group_the_checkpoint_lacks_is_named():
    from megarl.checkpoint.optimizer_layout import to_this_layout
    current = single(0.0, ["a.weight"])
    current["optimizer"]["param_groups"].append(group(1.0, False, 0.0) | {"lr_mult": 0.5})
    with pytest.raises(ValueError, match=r"no param group like this run's .*'lr_mult': 0\.5"):
        to_this_layout(current, loaded(current, common(single(3.0, ["a.weight"])), key_value))
