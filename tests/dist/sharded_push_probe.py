"""Subprocess body of test_sharded_push: a staged push by rank 0's route and by the sharded route
(every trainer rank sends its own shards) into the same engines, at one trainer layout.

This process imports torch and megatron once, then forks WORLD gloo ranks. Every rank builds
its shard of a random tiny model (Llama; Qwen3-MoE with LAYOUT ep2) with the same seed. Rank 0's
pool holds two engines whose workers are megarl's real engine-side backend
(`gloo_backend.GlooWeightTransferEngine`, one per worker: engine "tp1" has one, "tp2" two),
each over a stand-in model whose `load_weights` keeps what it is given, as vLLM's does with the
layerwise reload. Cases, in order:
  rank0 (v1): weight_sync.sharded=false | sharded (v2) | fails (v3): trainer rank FAIL_RANK's
  conversion raises | silent (v4): it returns no piece, as a rank wrongly left out of the senders
  would | sharded_again (v5)
Rank 0 records per case the error, the digest of every tensor each worker loaded in that
case's push, the versions, and the push's stats. Writes OUT_JSON: {"ranks": {rank: {case: ...}}, "hung": [...], "exitcodes": ...}.
usage: sharded_push_probe.py OUT_JSON LAYOUT   (LAYOUT: tp2pp2 | pp2 | tp2ep2)
"""
import asyncio
import hashlib
import json
import os
import sys
import types
from pathlib import Path

import torch

from megarl.bootstrap import bootstrap

bootstrap()   # jit hook + CPU shim before anything imports megatron (megarl/bootstrap.py)

LAYOUTS = {"tp2pp2": (2, 2, 1, 4), "pp2": (1, 2, 1, 2), "tp2ep2": (2, 1, 2, 4)}   # tp, pp, ep, world
DIST_TIMEOUT_S = 60
HANG_S = 300
FAIL_RANK = 1
CASES = [("rank0", 1), ("sharded", 2), ("fails", 3), ("silent", 4), ("sharded_again", 5)]


def tiny_config(moe: bool):
    import transformers
    if moe:
        return transformers.Qwen3MoeConfig(
            hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300, num_experts=4,
            num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False,
            norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"])
    return transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=301,
                                    max_position_embeddings=64, tie_word_embeddings=False,
                                    architectures=["LlamaForCausalLM"])


class Model:
    """The worker's model as megarl's backend sees it: `load_weights` keeps what it gets."""

    def __init__(self):
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights):
        self.loaded.update({n: t.clone() for n, t in weights})


def worker_engine(name: str, tp: int):
    """An Engine whose `tp` workers are megarl's real gloo backend, driven as vLLM's worker
    drives it (parse_init_info / parse_update_info, then the backend's calls)."""
    from vllm.model_executor.model_loader import reload

    from megarl.rollout.engines.engine import Engine, EngineError, EngineHealth
    from megarl.rollout.weights import gloo_backend
    reload.initialize_layerwise_reload = lambda model: None
    reload.finalize_layerwise_reload = lambda model, cfg: None

    def worker(rank):
        cfg = types.SimpleNamespace(parallel_config=types.SimpleNamespace(
            data_parallel_index=0, world_size=tp, rank=rank), model_config=None)
        return gloo_backend.GlooWeightTransferEngine(None, cfg, torch.device("cpu"), Model())

    class Workers(Engine):
        def __init__(self):
            self.name, self.version, self.paused = name, 0, False
            self.workers = [worker(r) for r in range(tp)]

        async def start(self): pass
        async def generate(self, req): raise EngineError("not for generation")
        async def abort(self, keys=None): pass
        async def pause(self): self.paused = True
        async def resume(self): self.paused = False
        async def reload_weights(self, path, version): raise EngineError("collective only")
        async def transfer_world_size(self): return tp
        async def close(self): pass

        @property
        def running(self):
            return 0

        async def _each(self, fn):
            await asyncio.gather(*(asyncio.to_thread(fn, w) for w in self.workers))

        async def init_weight_transfer(self, info):
            await self._each(lambda w: w.init_transfer_engine(w.parse_init_info(dict(info))))

        async def start_weight_update(self, staged=False):
            await self._each(lambda w: w.start_weight_update())

        async def update_weights(self, info):
            await self._each(lambda w: w.update_weights(dict(info)))

        async def finish_weight_update(self, version):
            assert self.paused
            await self._each(lambda w: w.finish_weight_update())
            self.version = version

        async def health(self):
            return EngineHealth(self.name, True, self.paused, 0, self.version)
    return Workers()


def digest(loaded: dict) -> dict:
    return {n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
            for n, t in sorted(loaded.items())}


def rank_main(rank: int, port: int, out_dir: str, layout: str) -> None:
    import torch.distributed as dist

    from megarl.config.schema import WeightSyncConfig
    from megarl.distributed import parallel
    from megarl.distributed.env import init_distributed
    from megarl.models.builders import build_model
    from megarl.models.transformer_config import transformer_config
    from megarl.rollout.engines.engine import EngineError
    from megarl.rollout.engines.pool import EnginePool, LoopThread, SyncPool
    from megarl.rollout.weights import sharded
    from megarl.rollout.weights.collective import CollectiveTransport
    tp, pp, ep, world = LAYOUTS[layout]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed(backend="gloo", timeout_s=DIST_TIMEOUT_S)
    parallel.initialize(tp, pp, 0, ep)
    hf = tiny_config(ep > 1)
    model, info = build_model(hf, transformer_config(hf, tp, pp, torch.float32, False, ep=ep), 1, "actor")
    fail = {"case": None}
    own = sharded.own_pieces

    def maybe_failing(model, info, timers):     # a trainer rank whose conversion fails mid-push
        if fail["case"] == "fails" and dist.get_rank() == FAIL_RANK:
            raise RuntimeError(f"injected conversion failure on rank {FAIL_RANK}")
        if fail["case"] == "silent" and dist.get_rank() == FAIL_RANK:
            return []
        return own(model, info, timers)
    sharded.own_pieces = maybe_failing
    engines = loop = sp = None
    if rank == 0:
        engines, loop = [worker_engine("tp1", 1), worker_engine("tp2", 2)], LoopThread()
        sp = SyncPool(EnginePool(engines, 30.0), loop, 30)
    results = {}
    transport = None
    for case, version in CASES:
        if case in ("rank0", "sharded"):
            if transport is not None:
                transport.close()
            transport = CollectiveTransport(WeightSyncConfig(bucket_mb=1, backend="gloo", staged=True,
                                                             sharded=case != "rank0"), sp)
        fail["case"] = case
        for w in [w for e in engines or [] for w in e.workers]:
            w.model.loaded = {}          # what each case's push loads, alone
        try:
            stats = transport.push(model, info, version)
            got = {"error": None, "stats": {k: v for k, v in stats.items() if k.startswith("sync_")}}
        except Exception as err:  # noqa: BLE001 - recorded: the test names what it wants
            got = {"error": str(err), "engine_error": isinstance(err, EngineError)}
        if engines is not None:
            got["versions"] = [e.version for e in engines]
            got["workers"] = [digest(w.model.loaded) for e in engines for w in e.workers]
        results[case] = got
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    transport.close()
    if loop is not None:
        loop.stop()
    parallel.destroy()
    dist.destroy_process_group()


def main(out_path: str, layout: str) -> None:
    from forked_ranks import run_ranks

    from megarl.models.builders import build_model  # noqa: F401 - megatron imported once, before the fork
    out = run_ranks(rank_main, LAYOUTS[layout][3], (layout,), HANG_S)
    Path(out_path).write_text(json.dumps(out, indent=1))

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
