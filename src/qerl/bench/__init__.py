"""Benchmarks; each appends measured figures to benchmarks/results/<bench>.jsonl."""
