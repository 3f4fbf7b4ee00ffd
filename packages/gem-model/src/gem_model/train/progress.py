"""Live progress on rank 0: a tqdm bar on a terminal, one line per log interval otherwise."""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


class Progress:
    def __init__(self, total: int, initial: int, enabled: bool, name: str):
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.total = total
        self.name = name
        self._bar: Any = None
        if enabled and self.tty:
            self._bar = tqdm(total=total, initial=initial, desc=name, unit="step", dynamic_ncols=True)

    @staticmethod
    def _fields(metrics: dict[str, float]) -> dict[str, str]:
        return {
            "loss": f"{metrics['loss']:.4f}",
            "samples/s": f"{metrics['samples_per_s']:,.0f}",
            "tokens/s": f"{metrics['tokens_per_s']:,.0f}",
            "MFU": f"{100 * metrics['mfu']:.2f}%",
        }

    def update(self, step: int, metrics: dict[str, float] | None) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
            if metrics is not None:
                self._bar.set_postfix(self._fields(metrics), refresh=False)
        elif metrics is not None:
            fields = "  ".join(f"{k} {v}" for k, v in self._fields(metrics).items())
            print(f"[{self.name}] step {step + 1}/{self.total}  {fields}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
