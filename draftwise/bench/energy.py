"""Energy counters for the benchmark (the MTAD paper §4): joules per token where the machine exposes them.

Two sources, read before and after each timed run:

- NVML (`nvmlDeviceGetTotalEnergyConsumption`, millijoules since the driver loaded) for a
  CUDA device; needs the `nvidia-ml-py` package (a dependency) and a Volta or newer GPU.
- Intel RAPL under `/sys/class/powercap`: the `energy_uj` counter of every package domain
  (`intel-rapl:N`, not its sub-domains, which it already contains), summed; a counter that
  wrapped around is corrected with its `max_energy_range_uj`. It measures the whole CPU
  package, so other work on the machine counts too: run benchmarks on an idle machine.

Where neither can be read (no counter, or `energy_uj` readable only by root, as on most
Linux systems since 2020), `find_meter` returns no meter and the reason; the benchmark then
reports energy as unavailable with that reason, never a number.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

POWERCAP = Path("/sys/class/powercap")


@dataclass
class EnergyMeter:
    source: str  # "rapl" | "nvml"
    read: Callable[[], float]  # cumulative joules (monotonic, wrap-corrected by `joules_between`)
    wrap_j: float | None = None  # the counter's range: a reading below the previous one wrapped once

    def joules_between(self, before: float, after: float) -> float:
        delta = after - before
        if delta < 0 and self.wrap_j:
            delta += self.wrap_j
        return max(delta, 0.0)


def rapl_meter(root: Path = POWERCAP) -> tuple[EnergyMeter | None, str]:
    """A meter summing every readable RAPL package counter, or None and why not."""
    if not root.is_dir():
        return None, f"no RAPL counters ({root} does not exist)"
    domains = sorted(p for p in root.glob("intel-rapl:*") if p.name.count(":") == 1)
    if not domains:
        return None, f"no RAPL package domain under {root}"
    files, ranges = [], []
    for domain in domains:
        counter = domain / "energy_uj"
        try:
            int(counter.read_text())
        except PermissionError:
            return None, f"{counter} is not readable by this user (RAPL counters are usually root-only)"
        except (OSError, ValueError) as error:
            return None, f"{counter} cannot be read: {error}"
        files.append(counter)
        try:
            ranges.append(int((domain / "max_energy_range_uj").read_text()))
        except (OSError, ValueError):
            ranges.append(0)

    def read() -> float:
        return sum(int(f.read_text()) for f in files) / 1e6

    # Wrap correction is exact for one package; with several, a wrap of one shows as its own range.
    wrap = ranges[0] / 1e6 if len(ranges) == 1 and ranges[0] else None
    return EnergyMeter("rapl", read, wrap), ""


def nvml_meter(device: torch.device) -> tuple[EnergyMeter | None, str]:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None, "NVML is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    except Exception as error:  # NVMLError subclasses: no driver, no GPU, counter not supported
        return None, f"NVML energy counter unavailable: {error}"

    def read() -> float:
        return pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3  # millijoules -> joules

    return EnergyMeter("nvml", read), ""


def find_meter(device: torch.device, *, powercap: Path = POWERCAP) -> tuple[EnergyMeter | None, str]:
    """The energy counter for the device the models run on: NVML for CUDA, RAPL for CPU."""
    if device.type == "cuda":
        return nvml_meter(device)
    if device.type == "cpu":
        return rapl_meter(powercap)
    return None, f"no energy counter for device type {device.type!r}"
