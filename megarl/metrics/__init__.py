"""Metrics: TensorBoard, metrics.jsonl and the console line per step."""
