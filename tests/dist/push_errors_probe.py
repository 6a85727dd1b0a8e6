"""Subprocess body of test_push_errors: a collective weight push at TP=2 x PP=2 whose source
fails mid-iteration, on stage 0 (global rank 0's own) and on stage 1 (relayed to rank 0).

This process imports torch and megatron once, then forks 4 gloo ranks (torch.distributed
timeout DIST_TIMEOUT_S). Every rank builds its stage's shard of a random tiny Llama (no
checkpoint: the weights do not matter here) and calls `CollectiveTransport.push` for each
case in turn, in the same world; rank 0's pool is a real SyncPool over one engine that
receives over the real weight group in a thread, as a vLLM worker does. A case's failure is
a KeyError raised by the HF conversion (`ArchMapping.megatron_to_hf`) at one layer's fc1,
on every TP rank of that layer's stage (a deterministic mapping error). Cases:
  clean (v1) | stage0: layer 1 fails (v2) | stage1: layer 3 fails (v3) | clean_again (v4)
Each rank records per case the error its push raised (type and message), rank 0 also the
engine's version and tensor count, and the layers the push's buckets reached it with. A
rank that has not exited HANG_S after the start is killed and reported as hung.
Writes OUT_JSON: {"ranks": {rank: {case: ...}}, "hung": [...], ...}.
usage: push_errors_probe.py OUT_JSON
"""
import asyncio
import json
import os
import sys
from pathlib import Path

import torch

from megarl.bootstrap import bootstrap

bootstrap()   # jit hook + CPU shim before anything imports megatron (megarl/bootstrap.py)

WORLD, TP, PP = 4, 2, 2
DIST_TIMEOUT_S = 60        # the trainer's process-group timeout in this probe
HANG_S = 200               # a rank still running after this is hung (the old code: dist timeouts)
CASES = [("clean", 1, None), ("stage0", 2, 1), ("stage1", 3, 3), ("clean_again", 4, None)]
FAIL = {"layer": None}     # the global layer whose fc1 conversion raises, per case


def tiny_config():
    import transformers
    # 1 MiB buckets: several per stage before and after the failing layer (fc1 alone is 1 MiB)
    return transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                    max_position_embeddings=128, tie_word_embeddings=False,
                                    architectures=["LlamaForCausalLM"])


def inject_failure() -> None:
    """The HF conversion raises at FAIL["layer"]'s fc1 (on whichever stage holds it)."""
    from megarl.formats.mapping import ArchMapping
    original = ArchMapping.megatron_to_hf

    def failing(self, mcore_name, shards, layer_offset=0, expert_offset=0):
        _, local = self.find(mcore_name)
        if local is not None and local + layer_offset == FAIL["layer"] and mcore_name.endswith("linear_fc1.weight"):
            raise KeyError(f"no HF name for {mcore_name} of layer {local + layer_offset}")
        return original(self, mcore_name, shards, layer_offset, expert_offset)
    ArchMapping.megatron_to_hf = failing


def receiving_engine(name: str):
    """An engine that joins the weight group and receives each bucket in a thread, as a vLLM
    worker with megarl's gloo backend does, keeping the unpacked tensors."""
    from megarl.rollout.engines.engine import Engine, EngineError, EngineHealth
    from megarl.rollout.weights import group, packing

    class Receiver(Engine):
        def __init__(self):
            self.name, self.version, self.paused = name, 0, False
            self.group, self.staged, self.weights = None, {}, {}

        async def start(self): pass
        async def generate(self, req): raise EngineError("not for generation")
        async def abort(self, keys=None): pass
        async def pause(self): self.paused = True
        async def resume(self): self.paused = False
        async def reload_weights(self, path, version): raise EngineError("collective only")
        async def transfer_world_size(self): return 1
        async def start_weight_update(self, staged=False): self.staged = {}
        async def close(self): pass

        @property
        def running(self):
            return 0

        async def init_weight_transfer(self, info):
            def join():
                s = group.store(info["master_address"], info["master_port"], info["world_size"],
                                info["timeout_s"], sender=False)
                return group.join(s, info["rank_offset"], info["world_size"], info["token"], info["timeout_s"])
            self.group = await asyncio.to_thread(join)

        async def update_weights(self, info):
            meta = packing.BucketMeta(**info)
            buf = torch.empty(meta.nbytes, dtype=torch.uint8)
            await asyncio.to_thread(group.broadcast, self.group, buf)
            self.staged.update({n: t.clone() for n, t in packing.unpack(meta, buf)})

        async def finish_weight_update(self, version):
            self.weights, self.version = self.staged, version

        async def health(self):
            return EngineHealth(self.name, True, self.paused, 0, self.version)
    return Receiver()


def rank_main(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from megarl.config.schema import WeightSyncConfig
    from megarl.distributed import parallel
    from megarl.distributed.env import init_distributed
    from megarl.models.builders import build_model
    from megarl.models.transformer_config import transformer_config
    from megarl.rollout.engines.engine import EngineError
    from megarl.rollout.engines.pool import EnginePool, LoopThread, SyncPool
    from megarl.rollout.weights.collective import CollectiveTransport
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed(backend="gloo", timeout_s=DIST_TIMEOUT_S)
    parallel.initialize(TP, PP, 0)
    hf = tiny_config()
    model, info = build_model(hf, transformer_config(hf, TP, PP, torch.float32, False), 1, "actor")
    engine = loop = sp = None
    if rank == 0:
        engine, loop = receiving_engine("e0"), LoopThread()
        sp = SyncPool(EnginePool([engine], 30.0), loop, 30)
    # the rank-0 route: its stage relays are what fail here (sharded pushes: test_sharded_push)
    transport = CollectiveTransport(WeightSyncConfig(bucket_mb=1, num_buffers=2, backend="gloo", sharded=False), sp)
    results = {}
    for case, version, layer in CASES:
        FAIL["layer"] = layer
        try:
            transport.push(model, info, version)
            got = {"error": None}
        except Exception as err:  # noqa: BLE001 - recorded: the test names what it wants
            got = {"error": str(err), "type": type(err).__name__, "engine_error": isinstance(err, EngineError)}
        if engine is not None:
            staged = {int(n.split(".")[2]) for n in engine.staged if n.startswith("model.layers.")}
            got.update(engine_version=engine.version, engine_tensors=len(engine.weights),
                       staged_layers=sorted(staged))   # the layers this push's buckets reached
        results[case] = got
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))   # what it got so far
    transport.close()
    if loop is not None:
        loop.stop()
    parallel.destroy()
    dist.destroy_process_group()


def main(out_path: str) -> None:
    from forked_ranks import run_ranks

    from megarl.formats.mapping import mapping_for
    from megarl.models.builders import build_model  # noqa: F401 - megatron imported once, before the fork
    inject_failure()
    out = {**run_ranks(rank_main, WORLD, (), HANG_S), "hf_tensors": len(mapping_for(tiny_config()).hf_names())}
    Path(out_path).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
