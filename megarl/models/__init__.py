"""Models: HF config -> megatron TransformerConfig, actor / critic / reference builders."""
