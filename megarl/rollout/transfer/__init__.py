"""Weight transports, trainer -> engines: one module per route behind one seam.

- `collective`: the trainer's global rank 0 broadcasts packed buckets to every engine worker
  at once through vLLM's weight-transfer API (`gloo`: megarl's backend, `gloo_backend.py`,
  loaded into every vLLM process by the `vllm.general_plugins` entry point; `nccl`: vLLM's).
  Nothing touches a disk.
- `files`: safetensors staged in a folder every engine reads (`reload_weights`), for servers
  started without megarl's weight-transfer config.
`megarl.rollout.weight_sync.push` picks one from `weight_sync.transport`. Pure packing maths in
`packing.py`; the stateless, token-guarded rendezvous both sides use in `group.py`.
"""
