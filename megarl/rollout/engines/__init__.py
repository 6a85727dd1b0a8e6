"""Engines: the engine protocol (`engine.py`), megarl's vLLM engines (in-process `vllm_async.py`,
HTTP servers `vllm_http.py` with its requests in `http_stream.py`, `servers.py`, `serve.py`), the
pool that spreads requests over them (`pool.py`, with its engine faults in `failover.py` and its
weight update sessions in `update_sessions.py`; built by `build.py`), and what runs inside every
vLLM process (`plugin.py`: held tokens, route capture, the CPU MoE reload fix). Light on
purpose: vLLM loads `plugin.py` into every engine process. Imports only `rollout/routes.py` from
the rest of rollout/."""
