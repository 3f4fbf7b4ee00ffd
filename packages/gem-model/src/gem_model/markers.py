"""The pluggy markers of the ``gem`` project.

A plugin is any module (or object) with functions marked ``@hookimpl`` whose names match a hook in
:mod:`gem_model.hookspecs`. Installed packages announce their plugin module through the entry-point
group ``gem``::

    [project.entry-points.gem]
    my_area = "my_package.plugin"

A minimal plugin that adds a precision scheme::

    from gem_model import hookimpl
    from gem_model.components import PrecisionScheme

    class HalfScheme(PrecisionScheme):
        name = "my_half"

        def convert_linear(self, linear, fqn):
            return linear.half()

    @hookimpl
    def gem_register_precision_schemes():
        return [HalfScheme]

Nothing is switched on by being installed: the run config has to name ``my_half``.
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "gem"
ENTRY_POINT_GROUP = "gem"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
