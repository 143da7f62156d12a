#!/usr/bin/env python3
"""Sums an Nsight Compute CSV of one short decode per kernel and grid.

Made on the device with (one GPU, resident K3-dimension synth M):

  ncu --clock-control none --launch-count 400 --csv --print-units base \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size,launch__block_size \
    fathom run --model M --prompt-ids 1,2,3,4,5,6,7,8 --max-new 4 --ignore-eos \
    --experts resident --device cuda --context 4096 --no-cuda-graphs > ncu.csv

then `python3 scripts/ncu-steps.py ncu.csv`. The decode steps are the
kernels after the first launch of the widest grid (the head, once a step);
the table gives each kernel and grid's launches, time and DRAM bytes a step.
ncu serialises kernels and starts each with cold caches: its times are upper
bounds on what the kernels take in a real step.
"""
import collections
import csv
import sys

SCALE = {"nsecond": 1, "usecond": 1e3, "msecond": 1e6, "second": 1e9,
         "byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}


def kernels(path):
    k = collections.OrderedDict()
    with open(path) as f:
        for r in csv.DictReader(line for line in f if line.startswith('"')):
            d = k.setdefault(int(r["ID"]), {"name": r["Kernel Name"].split("(")[0],
                                            "grid": r["Grid Size"], "block": r["Block Size"]})
            try:
                value = float(r["Metric Value"].replace(",", ""))
            except ValueError:
                continue
            d[r["Metric Name"]] = value * SCALE.get(r["Metric Unit"], 1)
    return k


def main(path):
    k = kernels(path)
    ids = sorted(k)
    def blocks(grid):
        n = 1
        for d in grid.strip("()").split(","):
            n *= int(d)
        return n

    widest = max((k[i]["grid"] for i in ids), key=blocks)
    heads = [i for i in ids if k[i]["grid"] == widest]
    steps = len(heads) - 1
    if steps < 1:
        sys.exit(f"{path}: fewer than two launches of the widest grid {widest}: no whole decode step")
    agg = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for i in (i for i in ids if i > heads[0]):
        m = k[i]
        a = agg[(m["name"], m["grid"], m["block"])]
        a[0] += 1
        a[1] += m.get("gpu__time_duration.sum", 0)
        a[2] += m.get("dram__bytes_read.sum", 0)
    t = sum(a[1] for a in agg.values()) / steps
    b = sum(a[2] for a in agg.values()) / steps
    n = sum(a[0] for a in agg.values()) / steps
    print(f"{steps} decode steps: {n:.0f} kernels, {t / 1e3:.1f} us, {b / 1e6:.0f} MB a step ({b / t:.0f} GB/s)")
    for (name, grid, block), (c, ts, bs) in sorted(agg.items(), key=lambda x: -x[1][1]):
        rate = bs / ts if ts else 0
        print(f"{name:16s} {grid:>14s} {block:>12s} {c / steps:4.1f}/step {ts / steps / 1e3:8.1f} us "
              f"{bs / steps / 1e6:8.1f} MB {rate:6.0f} GB/s")


if __name__ == "__main__":
    main(sys.argv[1])
