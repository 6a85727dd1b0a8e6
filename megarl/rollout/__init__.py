"""Rollout: the engine protocol and its vLLM engines, the pool, the partial-rollout controller
and the sync baseline, the rounds the trainer asks for, and the weight sync to the engines.
Light on purpose: vLLM loads `rollout.transfer.plugin` into every engine process."""
