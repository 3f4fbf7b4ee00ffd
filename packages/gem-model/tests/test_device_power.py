"""gem_model.profiling.device_power: nvidia-smi's lines parsed, a sampling process run and stopped (a stand-in
Python process printing lines in nvidia-smi's format, since this machine has no GPU), the samples picked
by the steps' time windows (by the time each was taken, not when it arrived) and summarized, and what is
kept when the sampler cannot run."""

from __future__ import annotations

import datetime
import itertools
import statistics
import sys
import time

import pytest

from gem_model.profiling import device_power as dp

# the values as the H100 printed them on 2026-12-06 (power.draw, clocks.sm, sw_power_cap, power.limit; no
# units), each line led by its timestamp
VALUES = ["692.11, 1695, Active, 700.00", "688.64, 1650, Active, 700.00", "704.84, 1740, Active, 700.00",
          "308.90, 1980, Not Active, 700.00", "694.97, 1710, Active, 700.00"]  # fmt: skip


def test_a_line_parses_onto_the_steps_clock_and_what_is_not_one_is_skipped() -> None:
    line = "2026/12/06 09:28:09.285, " + VALUES[0] + "\n"
    taken = datetime.datetime(2026, 12, 6, 9, 28, 9, 285000).timestamp()
    s = dp.parse_line(line, offset=1000.0)
    assert s == dp.Sample(at=pytest.approx(taken - 1000.0), watts=692.11, sm_mhz=1695.0, power_capped=True,
                          limit_watts=700.0)  # fmt: skip
    assert dp.parse_line("2026/12/06 09:28:09.285, " + VALUES[3], 0.0).power_capped is False
    for bad in ("timestamp, power.draw [W], clocks.current.sm [MHz], a, b", "2026/12/06 09:28:09.285, [N/A], 1695, Active, 700",
                "2026/12/06 09:28:09.285, 692.11, 1695, Active", "2026/12/06 09:28:09.285, 692.11, 1695, Unknown, 700",
                "09:28:09, 692.11, 1695, Active, 700.00", ""):  # fmt: skip
        assert dp.parse_line(bad, 0.0) is None, bad


def test_the_command_names_the_gpu_by_uuid() -> None:
    command = dp.nvidia_smi_command("4a6f3e1c-0000-1111-2222-333344445555", 100)
    assert command[0] == "nvidia-smi" and "--loop-ms=100" in command
    assert f"--query-gpu={','.join(dp.FIELDS)}" in command and "--format=csv,noheader,nounits" in command
    assert command[-1] == "--id=GPU-4a6f3e1c-0000-1111-2222-333344445555"
    assert dp.nvidia_smi_command("GPU-abc", 50)[-1] == "--id=GPU-abc"
    assert not any(c.startswith("--id") for c in dp.nvidia_smi_command(None, 50))
    # the instant reading in the power's place, the other fields as they were; a field of no power refused
    instant = dp.nvidia_smi_command(None, 50, "power.draw.instant")[1]
    assert instant == "--query-gpu=timestamp,power.draw.instant,clocks.sm,clocks_event_reasons.sw_power_cap,power.limit"
    with pytest.raises(ValueError, match="power_field must be one of"):
        dp.nvidia_smi_command(None, 50, "clocks.sm")


def test_a_sampler_reads_the_lines_until_stopped_and_the_windows_pick_them() -> None:
    # nvidia-smi's loop: a timestamped line every 50 ms into a pipe, in one block at the end (as a pipe's
    # buffer delivers them), and it never ends by itself
    script = ("import datetime, sys, time\n"
              "lines = []\n"
              f"for values in {VALUES!r}:\n"
              "    lines.append(datetime.datetime.now().strftime('%Y/%m/%d %H:%M:%S.%f')[:-3] + ', ' + values)\n"
              "    time.sleep(0.05)\n"
              "print('\\n'.join(lines), flush=True)\n"
              "time.sleep(60)\n")  # fmt: skip
    sampler = dp.PowerSampler([sys.executable, "-c", script])
    start = time.perf_counter()
    sampler.start()
    deadline = time.monotonic() + 30
    while len(sampler.samples) < len(VALUES) and time.monotonic() < deadline:
        time.sleep(0.02)
    t0 = time.perf_counter()
    sampler.stop()
    assert time.perf_counter() - t0 < 10  # terminated, not waited for
    assert sampler.failure is None and [s.watts for s in sampler.samples] == [692.11, 688.64, 704.84, 308.9, 694.97]
    ats = [s.at for s in sampler.samples]
    # taken ~50 ms apart (not all at once, as they arrived), from about when the process started
    assert ats == sorted(ats) and start - 0.01 <= ats[0] and all(b - a >= 0.04 for a, b in itertools.pairwise(ats))
    assert sampler.within([(start, ats[1]), (ats[4], ats[4])]) == [sampler.samples[i] for i in (0, 1, 4)]
    summary = dp.summarize(sampler.samples)
    watts = [692.11, 688.64, 704.84, 308.9, 694.97]
    assert summary == {"samples": 5, "watts_median": 692.11, "watts_mean": pytest.approx(sum(watts) / 5),
                       "limit_watts": 700.0,
                       "sm_mhz_median": statistics.median([1695, 1650, 1740, 1980, 1710]), "sm_mhz_min": 1650.0,
                       "sm_mhz_max": 1980.0, "power_capped_share": 0.8}  # fmt: skip
    assert dp.describe(summary) == "692 W of 700, SM clock 1710 MHz (1650-1980), power cap in 80 % of 5 samples"
    # a 200 ms step at the mean power: 617.9 W x 0.2 s
    assert dp.joules_per_step(summary, 200.0) == pytest.approx(sum(watts) / 5 * 0.2)
    assert dp.joules_per_step(None, 200.0) is None
    assert not sampler.running
    sampler.stop()  # a second stop does nothing


def test_a_sampler_that_cannot_start_or_fails_says_why(tmp_path) -> None:
    missing = dp.PowerSampler([str(tmp_path / "nvidia-smi"), "--loop-ms=100"])
    missing.start()
    missing.stop()
    assert missing.samples == [] and missing.failure.startswith(f"{tmp_path / 'nvidia-smi'} did not start")
    failing = dp.PowerSampler([sys.executable, "-c", "import sys; sys.stderr.write('NVIDIA-SMI has failed'); sys.exit(9)"])
    failing.start()
    deadline = time.monotonic() + 30
    while failing.running and time.monotonic() < deadline:  # it exits by itself, as a failing nvidia-smi does
        time.sleep(0.02)
    failing.stop()
    assert failing.samples == [] and "gave no sample (exit 9): NVIDIA-SMI has failed" in failing.failure
    assert dp.summarize([]) is None and dp.describe(None) == "not sampled"


def test_only_a_cuda_device_with_an_interval_gets_a_sampler() -> None:
    import torch

    assert dp.sampler_for(torch.device("cpu")) is None
    assert dp.sampler_for(torch.device("cpu"), 0) is None
    assert dp.sampler_for(torch.device("cuda"), 0) is None  # off: decided before the device is asked
