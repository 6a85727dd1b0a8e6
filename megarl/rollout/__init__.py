"""Rollout: sample records, the vLLM engine, synchronous generation and weight sync."""
