"""gem-parallel's hook implementations (nothing else lives here)."""

from __future__ import annotations

from gem_model.api import hookimpl


@hookimpl
def gem_register_parallel_planners():
    from gem_parallel.auto import AutoPlanner
    from gem_parallel.fsdp import FSDPPlanner
    from gem_parallel.sharded import TorchrecDDPPlanner
    from gem_parallel.single import SinglePlanner

    return [SinglePlanner, TorchrecDDPPlanner, FSDPPlanner, AutoPlanner]


@hookimpl
def gem_register_load_balancers():
    from gem_parallel.balance import SeqBalancedBalancer

    return [SeqBalancedBalancer]
