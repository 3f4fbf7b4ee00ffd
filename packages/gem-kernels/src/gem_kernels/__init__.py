"""gem-kernels: jagged HSTU attention and the fused norm-gate step for GEM models.

Each op has a pure-torch kernel (``torch``) and a Triton kernel (``triton``), registered through
:mod:`gem_kernels.plugin`; :mod:`gem_kernels.reference` holds the definitions the tests check both
against. Importing the package does not import triton.
"""

from gem_kernels.__about__ import __version__

__all__ = ["__version__"]
