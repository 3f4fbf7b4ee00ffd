"""gem-comm's hook implementations (nothing else lives here)."""

from __future__ import annotations

from gem_model.api import hookimpl


@hookimpl
def gem_register_comm_strategies():
    from gem_comm.default import DefaultComm
    from gem_comm.hierarchical import HierarchicalComm
    from gem_comm.overlap import OverlapComm
    from gem_comm.quantized import QuantizedComm
    from gem_comm.sm_free import SmFreeComm

    return [DefaultComm, OverlapComm, QuantizedComm, HierarchicalComm, SmFreeComm]


@hookimpl
def gem_register_callbacks():
    from gem_comm.measure import CommReport

    return [CommReport]


@hookimpl
def gem_register_train_pipelines():
    from gem_comm.sparse_dist import SparseDistPipeline

    return [SparseDistPipeline]


@hookimpl
def gem_profile_sections(profile):
    from gem_comm.profile import comm_measured_section

    return comm_measured_section(profile)


@hookimpl
def gem_profile_section_names():
    return ["comm_measured"]
