"""gem-precision: precision schemes (fp32, bf16, fp8 tensorwise/rowwise, MXFP8) and activation
memory policies (checkpointing, fp8-compressed saved tensors) for the GEM training framework.

Registered through :mod:`gem_precision.plugin`; nothing here is switched on by being installed.
"""

from gem_precision.__about__ import __version__

__all__ = ["__version__"]
