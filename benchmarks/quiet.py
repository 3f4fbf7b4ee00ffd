"""Quiet runs: the warning lines a default big-config run, a 2-process run and `gem-train plan` print.

Issue 33 asks that no third-party warning reach a user's terminal unless it means something for the
run (``gem_model/quiet.py`` lists those kept off, each with its reason). This runs the three
commands as a user would, captures everything they print, and counts the lines that mention a
warning (``warning``, any case, as a word) or torchrun's ``*****`` banner. On a machine with two GPUs
or more the 2-process run is the big config on two GPUs (NCCL); with one GPU or none it is
``configs/tiny-2proc.yaml`` on the CPU (gloo), since two NCCL ranks cannot share one GPU.

    .venv/bin/python benchmarks/quiet.py --out benchmarks/results/raw/quiet-DATE.json

It prints one row per command (exit status, seconds, warning lines) and then every warning line
found, and exits 1 if there is one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARNING = re.compile(r"(?i)\bwarning\b|\*{20}")


def commands(out: Path, steps: int, gpus: int) -> dict[str, list[str]]:
    big = str(ROOT / "configs" / "h200-large.yaml")
    two = (
        ["--nproc", "2", "-c", big]
        if gpus >= 2
        else ["--nproc", "2", "-c", str(ROOT / "configs" / "tiny-2proc.yaml"), "trainer.device=cpu"]
    )
    return {
        "default big-config run": [
            "run", "-c", big if gpus else str(ROOT / "configs" / "tiny.yaml"), f"trainer.steps={steps}",
            f"trainer.output_dir={out}/big",
        ],
        "2-process run": ["run", *two, f"trainer.steps={steps}", f"trainer.output_dir={out}/two"],
        "gem-train plan": ["plan", "-c", big, "--nproc", "8"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="training steps of each run")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    import torch

    gpus = torch.cuda.device_count()
    # GEM_PLUGINS stays: where the packages come on PYTHONPATH (the lent H200) it is how the plugins load
    env = {k: v for k, v in os.environ.items() if k != "GEM_DISABLE_PLUGIN_AUTOLOAD"}
    rows, found = [], {}
    with tempfile.TemporaryDirectory(prefix="gem-quiet-") as scratch:
        for what, argv in commands(Path(scratch), args.steps, gpus).items():
            began = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "gem_model", *argv], capture_output=True, text=True, env=env)
            seconds = time.perf_counter() - began
            lines = [line for line in (proc.stdout + proc.stderr).splitlines() if WARNING.search(line)]
            rows.append({"command": what, "argv": ["gem-train", *argv], "exit": proc.returncode,
                         "seconds": seconds, "warning_lines": len(lines)})  # fmt: skip
            found[what] = lines
            if proc.returncode:
                print(f"{what}: exit {proc.returncode}\n{proc.stderr[-3000:]}", file=sys.stderr)
    print("| command | exit | s | warning lines |\n|---|---|---|---|")
    for r in rows:
        print(f"| `{' '.join(r['argv'][:4])} ...` ({r['command']}) | {r['exit']} | {r['seconds']:.0f} | {r['warning_lines']} |")
    for what, lines in found.items():
        for line in lines:
            print(f"{what}: {line}")
    if args.out is not None:
        record = {
            "date": subprocess.run(["date"], capture_output=True, text=True).stdout.strip(),
            "device": torch.cuda.get_device_name(0) if gpus else "cpu",
            "gpus": gpus,
            "torch": torch.__version__,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "rows": rows,
            "warning_lines": found,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))
    return 1 if any(found.values()) or any(r["exit"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
