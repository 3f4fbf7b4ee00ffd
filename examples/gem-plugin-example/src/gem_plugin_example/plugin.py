"""Hook implementations of the example plugin."""

from gem_model import hookimpl


@hookimpl
def gem_register_precision_schemes():
    from gem_plugin_example.fp16 import Fp16Gemm

    return [Fp16Gemm]
