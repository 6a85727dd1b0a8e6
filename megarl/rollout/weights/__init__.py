"""The weight push, trainer -> engines: `sync.py` (the transport chosen, the verify probe) and one
module per route behind one seam.

- `collective`: the trainer's global rank 0 broadcasts packed buckets to every engine worker
  at once through vLLM's weight-transfer API (`gloo`: megarl's backend, `gloo_backend.py`,
  loaded into every vLLM process by megarl's vLLM plugin, `rollout/engines/plugin.py`; `nccl` and `ipc`:
  vLLM's, see wires.py).
  Nothing touches a disk.
- `files`: safetensors staged in a folder every engine reads (`reload_weights`), for servers
  started without megarl's weight-transfer config.
`megarl.rollout.weights.sync.open_transport` picks one from `weight_sync.transport`. The
trainer-side source (TP gather, HF names, buckets, PP relay) is `source.py`; pure packing maths
`packing.py`; the stateless, token-guarded rendezvous both sides use `group.py`.
"""
