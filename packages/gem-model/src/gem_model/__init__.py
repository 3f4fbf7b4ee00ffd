"""gem-model: the core of the GEM training framework.

Plugin authors need :mod:`gem_model.api`: the :data:`hookimpl` marker, the interfaces, the run
context, the layout and plan types and the result types (``docs/plugins.md`` describes them).
"""

from gem_model.__about__ import __version__
from gem_model.markers import hookimpl

__all__ = ["__version__", "hookimpl"]
