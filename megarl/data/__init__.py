"""Data: prompt datasets and their sampler, the Sample record, every seed of a run, and the
synthetic countdown task of the demo and the tests."""
