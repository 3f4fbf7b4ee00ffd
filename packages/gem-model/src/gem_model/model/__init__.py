"""The GEM model: sparse arch (torchrec tables), HSTU sequence tower, non-sequence tower, cross step, heads."""
