"""HF <-> megatron-core parameter names and layouts.

`ops` holds pure shard/merge tensor functions (no process groups, no megatron imports);
`mapping` holds one declarative table per architecture and applies the ops. Both the
trainer -> vLLM weight sync and the checkpoint conversion tools use them.
"""
