"""gem-comm's hook implementations (nothing else lives here)."""

from __future__ import annotations

from gem_model import hookimpl


@hookimpl
def gem_register_comm_strategies():
    from gem_comm.default import DefaultComm

    return [DefaultComm]
