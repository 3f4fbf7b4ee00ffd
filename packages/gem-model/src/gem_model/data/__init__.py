"""Batches, data sources, sample-to-rank assignment and the rank-sharded loader."""
