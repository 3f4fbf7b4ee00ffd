"""gem-parallel: parallel planners for GEM runs (single, torchrec_ddp, fsdp, auto) and the seq_balanced balancer."""

from gem_parallel.__about__ import __version__

__all__ = ["__version__"]
