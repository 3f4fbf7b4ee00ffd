"""gem-parallel: parallel planners for GEM runs (single process; torchrec sharding + DDP)."""

from gem_parallel.__about__ import __version__

__all__ = ["__version__"]
