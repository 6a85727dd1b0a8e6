"""Weight formats: what an HF folder and a megatron dist checkpoint hold, and how their
parameters map onto each other. Below both the trainer's models (`megarl.models`) and the
checkpoint conversion tools (`megarl.conversion`), so imports between those run one way.

`ops` holds pure shard/merge tensor functions (no process groups, no megatron imports);
`mapping` holds one declarative table per architecture and applies the ops (used by the
trainer -> vLLM weight sync, the trainer's loading and the converters). `hf_reader` is the
project's one HF safetensors reader (lazy, per tensor or slice); `dist_reader` reads a megatron
dist checkpoint's global tensors and names a converted folder's parts (HF_CONFIG_DIR). None of
them imports megatron.
"""
