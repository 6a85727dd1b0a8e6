"""Synthetic datasets and tokenizers for megarl demos and tests."""
