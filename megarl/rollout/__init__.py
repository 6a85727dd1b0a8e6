"""Rollout, in three packages, bottom to top (each imports only those below it):
- `engines/`: the engine protocol, megarl's vLLM engines and servers, the pool;
- `weights/`: the weight push from the trainer to the engines (transports, packing, the probe);
- `controller/`: the partial-rollout controller, the rounds the trainer asks for, the sync
  baseline.
`routes.py` (a sample's expert routes, which engines record and the controller carries) sits
below all three. Light on purpose: vLLM loads `rollout.engines.plugin` into every engine process."""
