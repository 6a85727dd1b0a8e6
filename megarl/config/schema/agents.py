"""Multi-turn environments and the rollout service for outside agents."""
from __future__ import annotations

from dataclasses import dataclass, field

from megarl.config.registry import ENVIRONMENTS
from megarl.config.schema.checks import changed, one_of, require


@dataclass
class EnvConfig:
    """`env.*`: multi-turn episodes (docs/agents.md). Empty name: single-turn samples."""
    name: str = ""                     # a registered environment (megarl/envs): guess | python_tool | ...
    max_turns: int = 4                 # model turns per episode at most (then it ends, cut)
    timeout_s: float = 10.0            # one reset / step call longer than this ends the episode, reward 0
    # how observations become tokens: auto (the chat template if the tokenizer has one, else
    # text) | chat (the template's delta for one user message) | text (encoded as is)
    template: str = "auto"
    options: dict = field(default_factory=dict)   # keyword arguments of the environment's constructor

    def __post_init__(self):
        if self.name:
            ENVIRONMENTS.check(self.name)
        require(self.max_turns >= 1, "env.max_turns", self.max_turns, "must be >= 1")
        require(self.timeout_s > 0, "env.timeout_s", self.timeout_s, "must be > 0 (seconds per environment call)")
        one_of("env.template", self.template, {"auto", "chat", "text"})
        require(self.name or not changed(self, {"max_turns", "timeout_s", "template", "options"}),
                 "env.name", self.name, "is empty, so the other env.* settings are unused: name an "
                 "environment, or remove them")


@dataclass
class ServiceConfig:
    """`service.*`: rollout.mode=service, the policy as an OpenAI-compatible endpoint for outside
    agents (docs/agents.md, "Rollout as a service")."""
    host: str = "127.0.0.1"            # bind address: the node's cluster address only when asked, never 0.0.0.0
    port: int = 0                      # 0: a free port (written to <run.dir>/service.json)
    # empty: read from api_key_file, else $MEGARL_SERVICE_API_KEY, else a new one; the key goes
    # to <run.dir>/service.json (0600) for the agents' launcher, and is written nowhere else
    # (saved configs and W&B hold <redacted>: config/secrets.py)
    api_key: str = ""
    api_key_file: str = ""             # a file holding the key, readable by you only (chmod 600)
    max_episodes: int = 64             # open episodes at once; more are refused (HTTP 429)
    episode_timeout_s: float = 600.0   # an episode with no call for this long is cancelled (counted)
    wait_s: float = 3600.0             # a step waits this long for its groups, then fails naming the service
    max_request_mb: float = 16.0       # a request body larger than this is refused (HTTP 413)
    # requests with the key served at once; more are answered 503 (OpenAI's clients send them
    # again). Bounds the bodies held at once to max_requests x max_request_mb. A request without
    # the key is refused on its headers, its body unread, and counts for nothing here.
    # 0: 2 x max_episodes (a chat call and a reward or cancel per open episode)
    max_requests: int = 0
    # complete groups waiting for the trainer at most; past it new episodes are refused (HTTP 429)
    # until a step takes some. At least train.groups_per_step
    max_ready_groups: int = 64

    def __post_init__(self):
        require(self.max_request_mb >= 0.001, "service.max_request_mb", self.max_request_mb, "must be >= 0.001")
        require(self.max_ready_groups >= 1, "service.max_ready_groups", self.max_ready_groups, "must be >= 1")
        require(self.max_requests >= 0, "service.max_requests", self.max_requests,
                 "must be >= 0 (0: 2 x service.max_episodes)")
        require(self.host not in ("0.0.0.0", "::", ""), "service.host", self.host,
                 "bind to 127.0.0.1 or the node's cluster-internal address, not every interface")
        require(0 <= self.port < 65536, "service.port", self.port, "must be a TCP port (0: a free one)")
        require(self.max_episodes >= 1, "service.max_episodes", self.max_episodes, "must be >= 1")
        require(self.episode_timeout_s > 0, "service.episode_timeout_s", self.episode_timeout_s, "must be > 0")
        require(self.wait_s > 0, "service.wait_s", self.wait_s, "must be > 0")

    @property
    def requests_bound(self) -> int:
        """Requests served at once: max_requests, or 2 x max_episodes when it is 0."""
        return self.max_requests or 2 * self.max_episodes
