"""Hook implementations of the example plugin."""

from gem_model.api import hookimpl


@hookimpl
def gem_register_precision_schemes():
    from gem_plugin_example.fp16 import Fp16Gemm

    return [Fp16Gemm]


@hookimpl
def gem_register_callbacks():
    from gem_plugin_example.timer import StepTimer

    return [StepTimer]
