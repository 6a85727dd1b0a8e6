"""Subprocess body of test_moe_layouts' weight-push test: the actor of an MoE checkpoint built at
the launched layout (key=value overrides: parallel.ep, parallel.tp), then the collective
route's sender side (`source.sender_buckets`, small buckets) run as a push runs it; global rank 0
unpacks what it would send and writes {name: [count, bitwise equal to the checkpoint's tensor,
shape]} and the largest bucket's bytes to OUT_JSON. Then the same actor exported as an HF folder
(`hf_export.export_actor`, every rank: the experts' other owners join its gathers) beside
OUT_JSON; rank 0 adds whether the folder's tensors equal the checkpoint's.
usage: moe_push_probe.py MODEL_DIR OUT_JSON BUCKET_BYTES key=value...
"""
import glob
import json
import sys

import torch

from megarl.bootstrap import bootstrap

bootstrap()   # jit hook + CPU shim before anything imports megatron (megarl/bootstrap.py)


def main(model_dir: str, out_path: str, bucket_bytes: int, overrides: list[str]) -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file

    from megarl.config import load_config, validate_world
    from megarl.distributed import parallel
    from megarl.distributed.env import init_distributed
    env = init_distributed()
    torch.set_num_threads(1)
    cfg = load_config(None, [f"model.path={model_dir}", "algo.name=grpo", *overrides])
    validate_world(cfg, env.world_size)
    parallel.initialize(cfg.parallel.tp, cfg.parallel.pp, 0, cfg.parallel.ep)
    from megarl.models.setup import build_all
    from megarl.rollout.weights import packing, source
    models = build_all(cfg, with_tokenizer=False)
    seen: dict[str, list] = {}
    largest = 0
    want = {}
    if env.rank == 0:
        for f in glob.glob(f"{model_dir}/*.safetensors"):
            want.update(load_file(f))
    for meta, buf in source.sender_buckets(models.actor.model, models.actor.info, bucket_bytes):
        largest = max(largest, meta.nbytes)
        for name, t in packing.unpack(meta, buf):
            entry = seen.setdefault(name, [0, True, list(t.shape)])
            entry[0] += 1
            entry[1] = entry[1] and name in want and torch.equal(t, want[name])
    dist.barrier()
    from megarl.checkpoint import hf_export
    folder = hf_export.export_actor(models.actor.model, models.actor.info, f"{out_path}.hf", model_dir, 1)
    if env.rank == 0:
        got = {}
        for f in glob.glob(f"{folder}/*.safetensors"):
            got.update(load_file(f))
        exported = sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
        json.dump({"tensors": seen, "largest_bucket": largest, "expected": sorted(want), "exported": exported},
                  open(out_path, "w"))
    parallel.destroy()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:])
