"""What ``e2e_ab.py``'s orchestrator makes of its worker's result: each variant's summary (quartiles of
its wall and device time, tokens/s, MFU in both conventions, peak memory, the GPU's power and clock), its
speed-up over the first variant batch by batch and over the steady rounds, and the printed tables."""

from __future__ import annotations

import statistics

from gem_model.profiling.device_power import describe, joules_per_step


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        x = xs[0] if xs else float("nan")
        return x, x, x
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


def summarize(row: dict, peak: float) -> dict:
    wall = quartiles(row["wall_ms"])
    dev = quartiles(row["device_ms"])
    n = len(row["wall_ms"])
    mean_tokens = sum(row["tokens"]) / max(n, 1)
    mean_flops = sum(row["flops"]) / max(n, 1)
    mean_flops_nv = sum(row["flops_nvidia"]) / max(n, 1)
    med_s = wall[1] / 1e3
    return {
        "variant": row["name"], "switches": row["switches"], "steps": n,
        "wall_ms_q1": wall[0], "wall_ms_median": wall[1], "wall_ms_q3": wall[2],
        "device_ms_q1": dev[0], "device_ms_median": dev[1], "device_ms_q3": dev[2],
        "idle_share": 1 - dev[1] / wall[1] if wall[1] else None,
        "tokens_per_s": mean_tokens / med_s if med_s else 0.0,
        "mfu": mean_flops / med_s / peak if med_s else 0.0,
        "mfu_nvidia": mean_flops_nv / med_s / peak if med_s else 0.0,
        "paired": row.get("paired"), "peak_gib": row["peak_gib"],
        "gc_ms_mean": sum(row["gc_ms"]) / max(n, 1), "gc_ms_max": max(row["gc_ms"], default=0.0), "loss_first": row["losses"][0] if row["losses"] else None,
        "loss_last": row["losses"][-1] if row["losses"] else None, "power": row.get("power"),
        "joules_per_step": joules_per_step(row.get("power"), sum(row["wall_ms"]) / n) if n else None,
    }  # fmt: skip


def paired(rows: list[dict]) -> None:
    """Each variant's speed-up over the first, batch by batch (both trained the same batch): the
    median and IQR of ``wall(first) / wall(variant)``. Batches differ in size by 2x, so ratios of the
    same batch resolve far less than the medians of the two rows would."""
    base = rows[0]["wall_ms"]
    for row in rows:
        ratios = [a / b for a, b in zip(base, row["wall_ms"]) if b > 0]
        q1, med, q3 = quartiles(ratios)
        row["paired"] = {"median": med, "q1": q1, "q3": q3, "batches": len(ratios)}


def steady_against_first(steady: dict[str, dict]) -> None:
    """With more than one steady round: each variant's steady wall time against the first variant's,
    round by round (``wall(first) / wall(variant)``, the same batches in the same round): its median,
    min and max, into ``steady[name]["against_first"]``."""
    names = list(steady)
    if not names or len(steady[names[0]]["rounds_wall_ms"]) < 2:
        return
    base = steady[names[0]]["rounds_wall_ms"]
    for name in names[1:]:
        ratios = [a / b for a, b in zip(base, steady[name]["rounds_wall_ms"], strict=True)]
        steady[name]["against_first"] = {"median": statistics.median(ratios), "min": min(ratios),
                                         "max": max(ratios), "rounds": len(ratios)}  # fmt: skip


def steady_energy(steady: dict[str, dict]) -> None:
    """Each sampled variant's energy a step over its steady rounds (mean power x mean step time), into
    ``steady[name]["joules_per_step"]``: at the power cap, what a change must lower."""
    for st in steady.values():
        if st.get("power"):
            st["joules_per_step"] = joules_per_step(st["power"], statistics.fmean(st["rounds_wall_ms"]))


def print_table(summary: list[dict]) -> None:
    print(f"\n{'variant':<12} {'steps':>5} {'wall ms (q1 / med / q3)':>26} {'span ms med':>13} {'idle':>6} "
          f"{'tokens/s':>11} {'MFU':>7} {'MFU nv':>7} {'peak GiB':>8} {'gc ms mean/max':>15}")  # fmt: skip
    for s in summary:
        print(f"{s['variant']:<12} {s['steps']:>5} {s['wall_ms_q1']:>8.1f} / {s['wall_ms_median']:>6.1f} / "
              f"{s['wall_ms_q3']:>6.1f} {s['device_ms_median']:>13.1f} {100 * (s['idle_share'] or 0):>5.1f}% "
              f"{s['tokens_per_s']:>11,.0f} {100 * s['mfu']:>6.2f}% {100 * s['mfu_nvidia']:>6.2f}% {s['peak_gib']:>8.1f} "
              f"{s['gc_ms_mean']:>7.2f} / {s['gc_ms_max']:>5.1f}")  # fmt: skip
    if any(s["power"] for s in summary):
        for s in summary:
            energy = f", {s['joules_per_step']:.1f} J a step" if s.get("joules_per_step") else ""
            print(f"{s['variant']} during its timed steps: {describe(s['power'])}{energy}")
    for s in summary[1:]:
        r = s["paired"]
        print(f"{s['variant']} against {summary[0]['variant']}, batch by batch: speed-up median {r['median']:.3f}x "
              f"(IQR {r['q1']:.3f}-{r['q3']:.3f}) over {r['batches']} batches; > 1 is faster")


def print_steady(steady: dict[str, dict]) -> None:
    """Each variant's steady rounds: wall and device time a step, against the first variant, the GPU's
    power and clock, and the profiled device-busy time where it was taken."""
    for name, st in steady.items():
        rounds = len(st["rounds_wall_ms"])
        print(f"steady {name}: {st['steps']} steps x {rounds} round(s), wall {st['wall_ms_per_step']:.1f} ms/step, "
              f"device {st['device_ms_per_step']:.1f} ms/step, idle "
              f"{100 * (1 - st['device_ms_per_step'] / st['wall_ms_per_step']):.1f} %")  # fmt: skip
        if "against_first" in st:
            a = st["against_first"]
            print(f"steady {name} against the first variant, round by round: speed-up median {a['median']:.3f}x "
                  f"(min {a['min']:.3f}, max {a['max']:.3f}) over {a['rounds']} rounds; > 1 is faster")
        if st.get("power"):
            energy = f", {st['joules_per_step']:.1f} J a step" if st.get("joules_per_step") else ""
            print(f"steady {name} during its rounds: {describe(st['power'])}{energy}")
        if "busy_ms_per_step" in st:
            cats = ", ".join(f"{k} {v:.1f}" for k, v in sorted(st["categories_ms_per_step"].items(), key=lambda kv: -kv[1]))
            print(f"steady {name} profiled again: device busy {st['busy_ms_per_step']:.1f} ms/step ({cats}); "
                  f"idle against the unprofiled wall {100 * st['idle_vs_busy']:.1f} %")
