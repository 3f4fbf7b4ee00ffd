"""gem-comm: communication strategies for GEM runs, over torch.distributed."""

from gem_comm.__about__ import __version__

__all__ = ["__version__"]
