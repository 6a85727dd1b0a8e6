"""Rollout as a service: outside agents run multi-turn episodes against the policy over an
OpenAI-compatible HTTP API, and every call is recorded token-exactly for training.

`recorder` (one episode's token record, pure logic), `service` (episodes, groups, the engine
calls, on the pool's event loop), `app` (the HTTP routes)."""
from megarl.service.recorder import EpisodeRecorder, ServiceError
from megarl.service.service import AgentService

__all__ = ["AgentService", "EpisodeRecorder", "ServiceError"]
