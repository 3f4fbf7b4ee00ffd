"""What each precision scheme's linears cost on this device, for a config's own linears: the rates
the precision recommendation of ``gem-train profile`` ranks by (issue 30, requirement 4), without
the numerics probe (which needs a float32 forward of the model: minutes on the big config).

For every dense linear of the config's model (the ones ``precision.*`` applies to) and every
candidate scheme, :func:`gem_precision.gemm_rates.measure_rates` times the scheme's linear, forward
and backward with its quantization, and its three GEMMs alone, on this device (CUDA events after a
warm-up). Rows, for one process: a linear inside an HSTU block gets the real tokens of the first
global batch, any other linear one row per sample of it (the towers see a few rows per sample: their rows
here are a lower bound; they are small). Each linear's candidates are then ranked as the profile
ranks them (:class:`gem_precision.pays.SpeedRanker`): faster than the config's scheme by at least
``MIN_SPEEDUP``, never an emulated backend. Prints the table per scheme and per linear shape, and
writes JSON.

On one H200 (expected: mxfp8 on the Triton MX GEMM, slower than bf16, or emulated: never faster;
fp8_rowwise faster only where its GEMMs and quantization beat bf16)::

    python benchmarks/precision_rates.py -c configs/h200-large.yaml --out precision_rates.json

On the CPU, a smoke run (``tests/test_precision_rates_bench.py`` runs it)::

    python benchmarks/precision_rates.py -c configs/tiny.yaml --out rates.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from gem_model.config_io import load_config
from gem_model.data.loader import ShardedLoader
from gem_model.distributed import pick_device
from gem_model.model.gem import GemModel
from gem_model.plugins import GemPluginManager
from gem_model.precision import precision_plan
from gem_model.resolve import resolve_components
from gem_precision.gemm_rates import AS_IS
from gem_precision.pays import SpeedRanker
from gem_precision.probe import DEFAULT_ORDER, ProbedLinear
from gem_precision.profile import activation_dtype


def linears(config, pm) -> tuple[list[ProbedLinear], int, int]:
    """The config's dense linears with the rows a one-process step gives them, its tokens and samples."""
    c = resolve_components(config, pm)
    batch = ShardedLoader(c.source, c.balancer, global_batch_size=config.data.global_batch_size).batch_at(0)  # one GPU
    samples = batch.batch_size
    mc = config.model  # a block's tokens: the history, the candidate and the context token of each sample
    tokens = int(batch.history_lengths().sum()) + samples * (int(mc.use_candidate) + int(mc.context_token))
    model = GemModel(config.model.model_copy(update={"table_init": "device"}), c.source.feature_spec(),
                     attention=c.attention, norm_gate=c.norm_gate, next_item_loss=c.next_item_loss,
                     sequence_pool=c.sequence_pool, sequence_input=c.sequence_input)  # fmt: skip  # tables on the meta device
    blocks = tuple(f"{b}." for b in model.activation_blocks())
    out = []
    for fqn, current in precision_plan(model, config.precision).items():
        m = model.get_submodule(fqn)
        out.append(ProbedLinear(fqn, m.in_features, m.out_features, tokens if fqn.startswith(blocks) else samples, current))
    return out, tokens, samples


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-c", "--config")
    p.add_argument("--set", action="append", default=[], metavar="key=value", help="a config override (repeatable)")
    p.add_argument("--schemes", help=f"comma-separated candidates (default: every registered scheme; order {DEFAULT_ORDER})")
    p.add_argument("--out", type=Path, help="write the measurements here (JSON)")
    args = p.parse_args(argv)
    pm = GemPluginManager()
    config = load_config(args.config, args.set)
    names = [n.strip() for n in args.schemes.split(",")] if args.schemes else pm.precision_schemes.names()
    configured = resolve_components(config, pm).precision
    schemes = {n: configured.get(n) or pm.precision_schemes.get(n).cls(pm.precision_schemes.get(n).cls.Config())
               for n in names}  # fmt: skip
    device = pick_device(config.trainer.device, 0)
    found, tokens, samples = linears(config, pm)
    ranker = SpeedRanker(device, activation_dtype(config, pm), 1.0, configured=configured)
    start = time.perf_counter()
    orders = ranker(found, schemes)
    seconds = time.perf_counter() - start
    table = ranker.table
    print(f"{config.name} on {table.device}: the first batch has {tokens:,} tokens in {samples} samples; "
          f"timed in {seconds:.1f} s")  # fmt: skip
    print(f"\n{'scheme':<16}{'backend':<18}{'GEMM TFLOP/s':>13}{'with quant':>12}{'outside GEMMs':>15}"
          f"{'ms/step if all':>16}{'faster for':>12}  why this backend")  # fmt: skip
    for name in [*schemes, *(n for n in table.backends if n not in schemes)]:  # then the config's, as is
        b = table.backends[name]
        share = table.quantization_share(name)
        faster = sum(1 for f in orders if ranker.why[f].get(name) is not None and ranker.why[f][name].kind == "faster")
        ms = 1e3 * sum(ranker.seconds(f, None if name == AS_IS else name) or 0.0 for f in ranker.shapes)
        print(f"{name:<16}{b.name:<18}{_num(table.tflops(name, gemm_only=True)):>13}{_num(table.tflops(name)):>12}"
              f"{'-' if share is None else f'{100 * share:.0f} %':>15}{ms:>16.2f}{faster:>7} of {len(orders):<3}  "
              f"{b.error or b.why}")  # fmt: skip
    print("\nper linear: the schemes a recommendation may take for speed, fastest first (then the config's)")
    for lin in found:
        first = [s for s in orders[lin.fqn] if s != lin.current and ranker.why[lin.fqn][s].kind == "faster"]
        now = ranker.seconds(lin.fqn, lin.current)
        print(f"  {lin.fqn:<24}{lin.in_features}x{lin.out_features} @ {lin.rows:,} rows, {lin.current or 'as is'} "
              f"{_ms(now)}: {', '.join(f'{s} {_ms(ranker.seconds(lin.fqn, s))}' for s in first) or 'nothing faster'}")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps({
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "command": shlex.join([sys.executable, *sys.argv]), "config": config.name, "tokens": tokens,
            "samples": samples, "seconds": seconds, "rates": table.to_json(),
            "linears": {lin.fqn: {"in": lin.in_features, "out": lin.out_features, "rows": lin.rows,
                                  "current": lin.current, "order": orders[lin.fqn],
                                  "why": {s: {"kind": w.kind, "text": w.text} for s, w in ranker.why[lin.fqn].items()}}
                        for lin in found},
        }, indent=1))  # fmt: skip
    return 0


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _ms(value: float | None) -> str:
    return "(cannot run)" if value is None else f"{1e3 * value:.3f} ms"


if __name__ == "__main__":
    raise SystemExit(main())
