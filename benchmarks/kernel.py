"""The block kernel's arithmetic rate against this machine's own peak; what and how: draftwise/bench/kernel_rates.py.

    .venv/bin/python benchmarks/kernel.py --json benchmarks/results/kernel-<cpu>.json

Pause other work on the cores while it runs (a background job makes both numbers meaningless).
"""

from __future__ import annotations

import os

import torch

from draftwise.atomic import write_json
from draftwise.bench import scripts
from draftwise.bench.harness import machine_description
from draftwise.bench.kernel_rates import kernel_rates, peaks
from draftwise.models import qkernel


def main() -> None:
    parser = scripts.parser(__doc__, threads=os.cpu_count())
    parser.add_argument("--widths", default="1,2,4,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--formats", default="q4_k,q6_k,q5_0,q8_0")
    args = scripts.parse(parser)
    module = qkernel.load()
    if module is None:
        raise SystemExit(f"kernel.py: the kernel is not built ({qkernel.problem()})")
    peak = peaks(args.threads)
    ceiling = peak.get("vnni512", peak.get("avx2-step"))["all_threads"]
    print("peaks (G multiply-adds/s, 1 thread / all): " + ", ".join(
        f"{k} {v['one_thread']:.1f} / {v['all_threads']:.1f}" for k, v in peak.items()), flush=True)
    rows = kernel_rates(module, args.formats.split(","), [int(w) for w in args.widths.split(",")], args.repeats,
                        ceiling, progress=lambda line: print(line, flush=True))
    if args.json:
        write_json({"machine": machine_description(torch.device("cpu")), "peaks": peak,
                    "ceiling": {"kind": "vnni512" if "vnni512" in peak else "avx2-step", "gmacs": ceiling},
                    "vnni_path": bool(module.blocks_vnni()), "rows": rows, "config": vars(args)}, args.json)


if __name__ == "__main__":
    main()
