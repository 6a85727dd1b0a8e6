"""Scale on paper: the real partial-rollout controller and engine pool against simulated
engines and a simulated trainer, on a virtual clock.

- `clock.py`: an asyncio event loop whose time is virtual (sleeping costs nothing).
- `engine.py`: `SimEngine`, the engine protocol with continuous batching and a cost model.
- `costs.py`: cost models: measured on CPU (the rollout benchmark's probes) or a roofline
  for GPUs (weights and KV bytes per decode step against HBM bandwidth, FLOPs against peak).
- `workload.py`: response-length distributions and forced per-sample budgets.
- `run.py`: `simulate(...)`: sync, partial and async training loops, step by step.
See docs/simulator.md.
"""
