"""The source papers' cluster-scale results, predicted by ``gradsync simulate``, beside the published numbers.

    python benchmarks/regenerate/published_scales.py --out docs/published-scales.md

Each experiment replays the paper's cluster shape (workers, GPUs per host, link rate) in the
simulator, with every strategy's own schedule. Compute comes from the models' FLOPs at an
effective rate: the rate at which the shipped V100 profile of that model family matches its
published V100 throughput (docs/profiles.md), scaled by the paper's GPU's peak fp32 FLOPS over the
V100's. That scaling, the link rates and the GPU encoders' speed are assumptions, each printed
with its table; so is every baseline that gradsync stands in for with one of its own strategies.
"""
from __future__ import annotations

import argparse
import sys
import time

from gradsync.simulate import Host, Network, load, simulate

V100_TFLOPS = 15.7
"""Peak fp32 of the GPUs the shipped profiles describe."""
PEAK_TFLOPS = {"V100": 15.7, "P100": 9.3, "P4000": 5.3, "GTX 1080Ti": 11.3, "K80 (one die)": 4.37}
EFFECTIVE_ON_V100 = {  # TFLOPS at which FLOPs give the published V100 throughput (the shipped profiles)
    "resnet50": 7.32397, "resnet101": 7.32397, "mobilenet_v2": 7.32397, "inception_v3": 7.35954,
    "vgg19": 21.4971, "vgg16": 21.4971, "bert-base": 10.2259, "sockeye-rnn": 3.0,
}
STEPS, WARMUP = 6, 2


def workload(model: str, gpu: str, batch: int = 32):
    rate = EFFECTIVE_ON_V100[model] * PEAK_TFLOPS[gpu] / V100_TFLOPS
    return load(model, batch, f"flops:{rate:.4g}tflops")


def run(strategy: str, work, np: int, gbit: float, *, gpus_per_host: int = 1, intra_gbps: float = 12.0,
        options: dict | None = None, codec_speed: float = 1.0, latency_s: float = 50e-6) -> dict:
    net = Network(gbit * 1e9, latency_s, gpus_per_host, intra_gbps * 1e9)
    return simulate(strategy, work, np, net, host=Host(codec_speed=codec_speed), options=options or {},
                    steps=STEPS, warmup=WARMUP)


def p3() -> list[str]:
    """Jayarajan et al., "Priority-based Parameter Propagation for Distributed DNN Training" (MLSys 2019)."""
    rates = [1, 2, 4, 6, 8, 10, 15, 20, 25, 30]
    published = {  # model -> {rate: (what, published gain)}
        "resnet50": {4: ("p3 / ps", "+26 %")},
        "vgg19": {15: ("p3 / ps", "+66 %"), 30: ("ps-sliced / ps", "+49 %")},
        "sockeye-rnn": {None: ("p3 / ps, best rate", "+38 %")},
        "inception_v3": {},
    }
    out = ["## P3: throughput against bandwidth (4 machines)", "",
           "Setup of the paper: 4 machines, one NVIDIA P4000 each, a worker and a parameter server on every "
           "machine (MXNet KVStore), 100 Gbit/s InfiniBand throttled with `tc` to each rate. Simulated: 4 "
           "workers with co-located servers, batch 32, compute at the P4000's share of the V100's peak "
           "(5.3 / 15.7 TFLOPS), gradsync's `ps` (whole tensors to servers) standing for the KVStore baseline. "
           "Gains are each strategy's throughput over `ps` at the same rate.", "",
           "| model | strategy / `ps` | " + " | ".join(f"{r} Gbit/s" for r in rates) + " | published |",
           "|---|---|" + "---|" * len(rates) + "---|"]
    for model, claims in published.items():
        work = workload(model, "P4000")
        rows = {s: [] for s in ("ps", "ps-sliced", "p3")}
        for rate in rates:
            for strategy in rows:
                rows[strategy].append(run(strategy, work, 4, rate)["samples_per_s"])
        for strategy in ("p3", "ps-sliced"):
            gains = [a / b - 1 for a, b in zip(rows[strategy], rows["ps"])]
            said = "; ".join(f"{v} at {r} Gbit/s" if r else v for r, (what, v) in claims.items()
                             if what.startswith(strategy + " "))
            if strategy == "p3" and not said:
                said = "no figure published" if not claims else ""
            out.append(f"| {model} | {strategy} | " + " | ".join(f"{g:+.0%}" for g in gains) + f" | {said} |")
    return out + [""]


def hipress() -> list[str]:
    """Bai et al., "Gradient Compression Supercharged High-Performance Data Parallel DNN Training" (SOSP 2021)."""
    out = ["## HiPress: CaSync against ring and compressed baselines", "",
           "Setup of the paper: 16 machines with 8 V100 each (128 GPUs) on 100 Gbit/s, and 16 machines with "
           "2 GTX 1080Ti each on 56 Gbit/s RDMA; HiPress's CaSync with onebit, against BytePS-onebit and "
           "Ring-DGC: \"17.2 %-69.5 %\" faster across six models. Simulated: the same shapes (NVLink 100 GB/s "
           "between the 8 V100s, PCIe 12 GB/s between the 1080Tis), batch 32, gradsync's `casync-ring` and "
           "`casync-ps` with onebit and `selective=True` (HiPress's cost model picks what to compress), "
           "`compressed-allgather` with DGC standing for Ring-DGC and `casync-ps` with onebit on every "
           "bucket (no cost model) for BytePS-onebit, "
           "`allreduce` for an uncompressed ring. Encoders 100x faster than this machine's CPU on one thread "
           "(an assumption: GPU kernels).", "",
           "| cluster | model | allreduce | casync-ring+onebit (selective) | casync-ps+onebit (selective) | BytePS-onebit stand-in | "
           "Ring-DGC stand-in | best CaSync / best compressed baseline | published |",
           "|---|---|---|---|---|---|---|---|---|"]
    shapes = [("16 x 8 V100, 100 Gbit/s", "V100", 128, 8, 100.0, 100.0),
              ("16 x 2 1080Ti, 56 Gbit/s", "GTX 1080Ti", 32, 2, 56.0, 12.0)]
    for label, gpu, np, per_host, gbit, intra in shapes:
        for model in ("vgg19", "bert-base"):
            work = workload(model, gpu)
            kw = dict(gpus_per_host=per_host, intra_gbps=intra, codec_speed=100.0)
            ring = run("allreduce", work, np, gbit, **kw)["samples_per_s"]
            casync = {"compression": "onebit", "selective": True}
            cring = run("casync-ring", work, np, gbit, options=casync, **kw)["samples_per_s"]
            cps = run("casync-ps", work, np, gbit, options=casync, **kw)["samples_per_s"]
            byteps = run("casync-ps", work, np, gbit, options={"compression": "onebit"}, **kw)["samples_per_s"]
            dgc = run("compressed-allgather", work, np, gbit, options={"compression": "dgc"}, **kw)["samples_per_s"]
            gain = max(cring, cps) / max(byteps, dgc) - 1
            out.append(f"| {label} | {model} | {ring:.0f} | {cring:.0f} | {cps:.0f} | {byteps:.0f} | {dgc:.0f} | "
                       f"{gain:+.0%} | +17.2 % to +69.5 % (six models) |")
    return out + ["", "Throughputs are samples/s of the whole cluster.", ""]


def kungfu() -> list[str]:
    """Mai et al., "KungFu: Making Training in Distributed Machine Learning Adaptive" (OSDI 2020), Fig. 9."""
    out = ["## KungFu: scalability against ideal (Fig. 9)", "",
           "Setup of the artifact: Azure VMs with one K80 GPU each, 8 to 32 VMs, link rate not stated; the one "
           "number found is Horovod's 12.7 img/s per GPU for ResNet-50 on 32 GPUs. Simulated: `allreduce` "
           "(Horovod's design), batch 32, compute at one K80 die's share of the V100's peak (4.37 / 15.7), "
           "at 1 and 10 Gbit/s; \"ideal\" is the throughput without communication, as in the paper.", "",
           "| model | link | workers | img/s per GPU | ideal | actual / ideal | published |",
           "|---|---|---|---|---|---|---|"]
    for model in ("resnet50", "mobilenet_v2"):
        work = workload(model, "K80 (one die)")
        for gbit in (1.0, 10.0):
            for np in (8, 16, 32):
                record = run("allreduce", work, np, gbit)
                per_gpu, ideal = record["samples_per_s"] / np, work.batch_size / work.compute_s
                said = "12.7 img/s per GPU (Horovod)" if (model, np) == ("resnet50", 32) else ""
                out.append(f"| {model} | {gbit:g} Gbit/s | {np} | {per_gpu:.1f} | {ideal:.1f} | "
                           f"{per_gpu / ideal:.0%} | {said} |")
    return out + [""]


def horovod() -> list[str]:
    """Sergeev and Del Balso, "Horovod: fast and easy distributed deep learning in TensorFlow" (2018)."""
    counts = [4, 16, 64, 128, 256, 512]
    out = ["## Horovod: scaling efficiency to 512 GPUs", "",
           "Setup of the paper: 128 servers with 4 Pascal GPUs each on 25 Gbit/s RoCE; at 512 GPUs, 90 % "
           "scaling efficiency for Inception V3 and ResNet-101 and 68 % for VGG-16. Simulated: `allreduce` on "
           "the same shape (4 GPUs per host, PCIe 12 GB/s between them), batch 64, compute at the P100's "
           "share of the V100's peak (9.3 / 15.7). Efficiency is throughput over the GPUs' throughput without "
           "communication.", "",
           "| model | " + " | ".join(f"{n} GPUs" for n in counts) + " | published at 512 |",
           "|---|" + "---|" * len(counts) + "---|"]
    variants = [("", {}, 50e-6), (", 5 us per message", {}, 5e-6),
                (", 5 us, 64 MB buckets", {"bucket_mb": 64.0}, 5e-6)]
    for model, said in (("inception_v3", "90 %"), ("resnet101", "90 %"), ("vgg16", "68 %")):
        work = workload(model, "P100", batch=64)
        for label, options, latency in variants:
            cells = []
            for np in counts:
                record = run("allreduce", work, np, 25.0, gpus_per_host=4, options=options, latency_s=latency)
                cells.append(f"{work.compute_s / record['step_s']:.0%}")
            out.append(f"| {model}{label} | " + " | ".join(cells) + f" | {said} |")
    return out + ["", "The first row of each model is the simulator's default (50 us per message, 25 MB "
                  "buckets); the others try RoCE's few microseconds per message and Horovod's 64 MB fusion "
                  "buffer.", ""]


EXPERIMENTS = {"p3": p3, "hipress": hipress, "kungfu": kungfu, "horovod": horovod}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(EXPERIMENTS), help="experiments to run (default: all)")
    parser.add_argument("--out", help="write the markdown here (default: print it)")
    args = parser.parse_args()
    unknown = [name for name in args.only.split(",") if name not in EXPERIMENTS]
    if unknown:
        parser.error(f"unknown experiment(s) {', '.join(unknown)}; known: {', '.join(EXPERIMENTS)}")
    started = time.monotonic()
    lines = ["# The source papers' cluster-scale results, predicted", "",
             "Made by `python benchmarks/regenerate/published_scales.py --out docs/published-scales.md` (the event "
             "simulator, docs/simulate.md; deterministic but for the compressors' costs, measured on this machine's CPU; under a minute on 2 cores). Each table gives "
             "the paper's setup and what gradsync assumes in its place; docs/simulate.md discusses where "
             "the two disagree.", ""]
    for name in args.only.split(","):
        lines += EXPERIMENTS[name]()
        print(f"{name}: done after {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
