"""The host and network of a recorded emulated run, as the simulator's :class:`Host` and :class:`Network`.

Host work in an emulated run is the recording machine's CPU (copies, the optimizer's update, the
compressors), divided by the run's dilation like every other time, and shared by the ranks on its
cores. So a run's host is the recording machine's lone rates (:mod:`gradsync.simulate.calibration`,
kept in the matrix) corrected in turn:

- times the dilation and over the ranks per core (:func:`host_of`);
- at the fraction of a lone process's rates that the memory gave the ranks working at once: the
  one the run's own update met (:func:`memory_met`, :func:`updates_met`), else a probe of every
  core copying at once around the run (``concurrent``, ``concurrent_after``);
- its compressor at the speeds its encodes and decodes met (:func:`codec_speeds`), costed by the
  recording machine's lines (:attr:`Host.codecs`);
- thread handoffs, wakes, message ends, jitter and the network's CPU per byte as measured there
  (``handoff_s``, ``busy_wake_s``, ``message_s``, ``jitter``, ``net_cpu_s``);
- the network: the run's link rate, at the all-to-all's measured share, and its workers per host,
  linked at the rate of Gloo over the recording machine's loopback (:func:`record_network`,
  :func:`intra_rate`); each label in the form it ran (:func:`flat_of`).
"""
from __future__ import annotations

import math
import re
import statistics

from gradsync.errors import ConfigError
from gradsync.simulate.compressed import recorded_line
from gradsync.simulate.worker import ZEROED_PASSES, Host, Network
from gradsync.strategies import resolve

HANDOFF_S = 20e-6
"""A thread handoff where the recording machine measured none (:attr:`Host.handoff_s`'s default)."""
LATENCY_S = 50e-6
"""A message's one-way latency where the matrix gives none (:attr:`Network.latency_s`'s default)."""


FLAT = ":flat"
"""A bench label's suffix for a strategy's flat form on hosts of several workers (``allreduce:flat``)."""


def options_of(label: str) -> tuple[str, dict]:
    """``casync-ring+topk:ratio=0.01`` -> ``("casync-ring", {"compression": "topk:ratio=0.01"})``;
    ``allreduce:flat`` -> ``("allreduce", {})`` (:func:`flat_of` tells the form)."""
    name, _, spec = label.partition("@")[0].partition("+")
    return name.removesuffix(FLAT), ({"compression": spec.removesuffix(FLAT)} if spec else {})


def flat_of(label: str) -> bool:
    """Whether a bench label ran its strategy's flat form on hosts of several workers
    (``STRATEGY:flat``, ``distribute(..., hosts="flat")``); else the topology-aware one."""
    return label.partition("@")[0].endswith(FLAT)


def run_options(record: dict) -> tuple[str, dict]:
    """The strategy and options a recorded run ran with: its label's (:func:`options_of`) and, for
    ``hybrid``, the partition count its probes chose (its ``describe``), by which the model lays
    the rows out over the servers: per server, as the option counts them (the probes' fit may
    choose a count between two multiples of the servers: the nearer); for ``pair-averaging``,
    whether its pull was overlapped with the next step (its ``describe`` says so); for ``local-sgd``
    and ``diloco``, ``H``, fragments and delay (its ``describe``)."""
    name, options = options_of(record["strategy"])
    if name in ("local-sgd", "diloco"):
        for key in ("H", "fragments", "delay"):
            found = re.search(rf"\b{key}=(\d+)", record.get("describe", ""))
            if found and key not in options:
                options[key] = int(found.group(1))
    if name == "pair-averaging" and "overlap" not in options:  # runs before the overlap waited for each pull
        options["overlap"] = "overlapped" in record.get("describe", "")
    if name == "hybrid" and "partitions" not in options:
        found = re.search(r"(\d+) partitions per table", record.get("describe", ""))
        servers = record.get("servers", 0) or record["np"]
        if found:
            options["partitions"] = max(1, round(int(found.group(1)) / servers))
    return name, options


def host_of(record: dict, rates: dict, cores: int, memory: float | None = None, codecs: dict | None = None) -> Host:
    """The host of one recorded run: the recording machine's ``rates``, divided by the dilation
    (which divides every time) and shared by the ranks on its ``cores``; where two or more ranks
    work at once, at the fraction of a lone process's rates that the memory gave them in the run
    (:func:`_memory_fraction`). The compressors' work, a pass or two over each bucket, runs at the
    copies' fraction, unless the run counted its encodes and decodes (``host_work``): then at the
    speeds they met (:func:`codec_speeds`); their cost lines are ``codecs`` (the group's). The
    network's CPU per byte is the one measured nearest the run's real link rate, at the recording
    machine's speed (:func:`_net_cpu`)."""
    ranks, k = _ranks(record), _dilation(record)
    share = max(1.0, ranks / cores)
    batch = _batch_s(record)
    fraction = _memory_fraction(rates, ranks, cores, memory)
    copy, update = (rates[key] * fraction[key] for key in ("copy_Bps", "update_Bps"))
    wake = rates.get("busy_wake_s")
    met = codec_speeds(record, codecs or {})
    encode, decode = met if met is not None else (fraction["copy_Bps"] * k / share, None)
    return Host(copy * k / share, update * k / share, codec_speed=encode, decode_speed=decode,
                handoff_s=rates.get("handoff_s", HANDOFF_S) * share / k, message_s=rates.get("message_s", 0.0) / k,
                busy_wake_s=None if wake is None else wake / k, cores=cores, jitter=_jitter(rates.get("jitter"), ranks),
                net_cpu_s=_net_cpu(rates, record) / k, batch_s=batch, codecs=codecs or {})


def _memory_fraction(rates: dict, ranks: int, cores: int, memory: float | None) -> dict:
    """The fraction of a lone process's copy and update rates the ranks met; 1 where one core works
    at a time. That fraction moves from minute to minute on a cloud VM, so it is taken where the
    run shows it, ``memory`` (:func:`memory_met`), for copies and updates alike; without it, from a
    probe of every core copying at once (``concurrent``), taken just before the group's run (the
    mean of it and ``concurrent_after`` where the group probed once more after its run)."""
    together = [rates[key] for key in ("concurrent", "concurrent_after") if key in rates and min(ranks, cores) > 1]
    fraction = {key: statistics.fmean([t[key] for t in together] or [1.0]) for key in ("copy_Bps", "update_Bps")}
    if memory is not None and min(ranks, cores) > 1:
        fraction = {"copy_Bps": memory, "update_Bps": memory}
    return fraction


def codec_speeds(record: dict, codecs: dict) -> tuple[float, float] | None:
    """How many times faster than its cost lines (``codecs``: spec -> the recording machine's
    :func:`~gradsync.simulate.calibration.calibrate_codecs` line) the run's compressor encoded and
    decoded, in the run's (undilated) time: for each, the lines' time for the calls and bytes of a
    measured step over the seconds they took (the record's ``host_work``, :mod:`gradsync.bench.report`).
    A rank's codec shares its core with the other ranks' threads and the memory with their passes;
    the run shows what that cost, the lines alone do not. None where the record has no such count
    or no line."""
    work = record.get("host_work") or {}
    if not ("encode" in work and "decode" in work):
        return None
    name, options = options_of(record["strategy"])
    strategy = resolve(name, **options)
    line = recorded_line(codecs, strategy.codec_name, strategy.codec_options)
    if line is None:
        return None
    speeds = []
    for kind, (a, b) in (("encode", line[0:2]), ("decode", line[2:4])):
        counted = work[kind] if isinstance(work[kind], dict) else {}
        calls, nbytes, seconds = (counted.get(field) for field in ("calls", "bytes", "seconds"))
        if not all(isinstance(v, (int, float)) for v in (calls, nbytes, seconds)) or not seconds > 0 or calls <= 0:
            raise _bad(record, f"host_work {kind} must have calls and seconds > 0, got {work[kind]!r}")
        speeds.append((a * calls + b * nbytes) / seconds)
    return speeds[0], speeds[1]


def memory_met(record: dict, rates: dict, cores: int, update_bytes: float) -> float | None:
    """The fraction of a lone process's update rate that the ranks' own ``optimizer.step()`` met in
    a recorded run (``optimizer_s``, undilated; every rank updates ``update_bytes`` at once, shared
    by the ranks per core), or None if the record has none. Only for strategies whose step is the
    update alone (:attr:`~gradsync.simulate.worker.StrategyModel.updates_locally`)."""
    seconds = record.get("optimizer_s")
    if seconds is None:
        return None
    if not isinstance(seconds, (int, float)) or seconds <= 0:
        raise _bad(record, f"optimizer_s must be a time > 0 in seconds, got {seconds!r}")
    share = max(1.0, _ranks(record) / cores)
    return update_bytes / seconds * share / (_dilation(record) * rates["update_Bps"])


def updates_met(record: dict, rates: dict, cores: int) -> float | None:
    """The fraction of a lone process's rates that ``hybrid``'s row server met in a recorded run:
    its updates (the record's ``host_work["update"]``: rank 0's server's partition bytes and
    seconds a measured step, undilated) against what the model's update of as many bytes takes at
    the group's lone rates, shared by the ranks per core (a zeroed gradient and the rows added,
    ``ZEROED_PASSES + 1`` copies of the partitions, and the optimizer over them; the rows added,
    about 1 % of the partitions on ``lstm-lm:cpu``, left out), as :func:`memory_met` reads an update
    on the training thread. None if the record has no such count."""
    work = (record.get("host_work") or {}).get("update")
    if work is None:
        return None
    nbytes, seconds = (work.get(key) if isinstance(work, dict) else None for key in ("bytes", "seconds"))
    if not all(isinstance(v, (int, float)) and v > 0 for v in (nbytes, seconds)):
        raise _bad(record, f"host_work update must have bytes and seconds > 0, got {work!r}")
    share = max(1.0, _ranks(record) / cores)
    lone = nbytes * ((ZEROED_PASSES + 1) / rates["copy_Bps"] + 1 / rates["update_Bps"])
    return lone * share / (_dilation(record) * seconds)


def record_network(matrix: dict, record: dict, cores: int | None = None) -> Network:
    """The :class:`~gradsync.simulate.Network` of a recorded run: its link rate, the matrix's
    latency, the all-to-all's share of the rate measured on the recording machine
    (``host_rates.mesh``, benchmarks/regenerate/mesh_exchange.py) for the run's hosts at its link's real rate
    (the emulated rate over the dilation; 1 where none was measured), and its workers per host
    (``ranks_per_host``), linked inside the host at the rate of Gloo over loopback
    (:func:`intra_rate`)."""
    real = record["net_bps"] / _dilation(record)
    per_host = record.get("ranks_per_host", 1)
    mesh = _mesh(matrix.get("host_rates", {}).get("mesh"), -(-_ranks(record) // per_host), real)
    net = Network(record["net_bps"], matrix.get("latency_s", LATENCY_S), mesh=mesh)
    if per_host > 1:
        net.ranks_per_host = per_host
        net.intra_Bps = intra_rate(matrix, record, cores or matrix.get("cores") or 1)
    return net


def intra_rate(matrix: dict, record: dict, cores: int) -> float | None:
    """The intra-host link of a recorded run of several workers to a host: the host's workers reach
    each other through Gloo over the loopback of its network namespace, whose rate is the recording
    machine's CPU's. The matrix's loopback run (``message_run``: two ranks all-reducing ResNet-50 on
    loopback, :func:`~benchmarks.regenerate.simulator_matrix.measure_message_cost`) gives the rate
    ``loopback_bps`` at which a ring of two moves each rank's half both ways; the intra-host link
    carries a host's reduce-scatter and all-gather as one sum of its ranks' bytes, twice that. Times
    the dilation (which divides every time) and over the ranks per core (every host's workers cross
    their loopback at once). None (unlimited) where the matrix has no loopback run."""
    loopback = (matrix.get("message_run") or {}).get("loopback_bps")
    if not loopback:
        return None
    return 2 * loopback / 8 * _dilation(record) / max(1.0, _ranks(record) / cores)


def _net_cpu(rates: dict, record: dict) -> float:
    """Host CPU per byte sent or received in a recorded run (undilated): the one measured nearest its
    link's real rate (``net_cpu_s``, benchmarks/regenerate/mesh_exchange.py), scaled from the speed of the
    machine that measured it to the speed of the one that recorded the run, by their lone copy rates
    (``net_cpu_copy_Bps`` against the group's ``copy_Bps``: the kernel's TCP copies bytes); 0 if none
    was measured."""
    real = (record.get("net_bps") or 0) / _dilation(record)
    seconds = _nearest_rate(rates.get("net_cpu_s"), real, 0.0)
    measured_at = _nearest_rate(rates.get("net_cpu_copy_Bps"), real, 0.0)
    if seconds and measured_at and rates.get("copy_Bps"):
        seconds *= measured_at / rates["copy_Bps"]
    return seconds


def _mesh(measured: dict | None, hosts: int, real_bps: float) -> float:
    """``measured``: host count -> real link rate (bit/s) -> the mesh's share. The largest count
    measured up to ``hosts`` (an all-to-all among more hosts loses at least as much), at the
    measured rate nearest ``real_bps`` (by ratio); 1 if none was."""
    counts = [int(n) for n in (measured or {}) if int(n) <= hosts]
    return _nearest_rate(measured[str(max(counts))], real_bps, 1.0) if counts else 1.0


def _nearest_rate(by_rate: dict | None, real_bps: float, default: float) -> float:
    """``by_rate``: real link rate (bit/s) -> a figure measured at it; the one measured nearest
    ``real_bps`` (by ratio), or ``default`` if none was (or the link has no rate)."""
    if not by_rate or not real_bps:
        return default
    return by_rate[min(by_rate, key=lambda rate: abs(math.log(float(rate) / real_bps)))]


def _jitter(measured: dict | None, ranks: int) -> float:
    """The host's jitter for ``ranks`` ranks on the machine: measured per rank count
    (benchmarks/regenerate/server_jitter.py), the largest count up to ``ranks``; 0 if none was."""
    counts = [int(n) for n in (measured or {}) if int(n) <= ranks]
    return measured[str(max(counts))] if counts else 0.0


def _ranks(record: dict) -> int:
    """The run's ranks: its workers and its servers."""
    return record["np"] + record.get("servers", 0)


def _dilation(record: dict) -> float:
    """How many times slower than real the run's emulated cluster ran (1: real time)."""
    return record.get("dilation", 1.0)


def _batch_s(record: dict) -> float:
    """The host time the run's training thread spent making each step's batch (``batch_s``)."""
    batch = record.get("batch_s", 0.0)
    if not isinstance(batch, (int, float)) or batch < 0:
        raise _bad(record, f"batch_s must be a time >= 0 in seconds, got {batch!r}")
    return batch


def _bad(record: dict, what: str) -> ConfigError:
    """The error for a record with a field out of range: it has to be recorded again."""
    return ConfigError(f"record {record.get('strategy', '?')!r} ({record['np']} workers): {what}; "
                       "record it again with gradsync bench")
