"""gem-model: the core of the GEM training framework.

Plugin authors need :data:`hookimpl` and the interfaces in :mod:`gem_model.components`.
"""

from gem_model.__about__ import __version__
from gem_model.markers import hookimpl

__all__ = ["__version__", "hookimpl"]
