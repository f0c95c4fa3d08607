"""`gradsync run` arguments: a thin layer over :func:`gradsync.launch.launch_local`."""
from __future__ import annotations

import argparse
import glob
import os
import sys

from gradsync.argtypes import checked, output_dir, output_file
from gradsync.errors import ConfigError
from gradsync.emulate.slow import ENV as SLOW_ENV
from gradsync.emulate.slow import SlowRanks
from gradsync.launch.forkserver import ENV as FORKSERVER_ENV
from gradsync.launch.hosts import detect_node_rank, parse_hosts, plan_ranks, read_hostfile
from gradsync.launch.processes import launch_local


# --- command line -------------------------------------------------------------------------------

def _int_in(low: int, high: int | None = None):
    def parse(text: str) -> int:
        value = int(text)
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be in {low}..{high}, got {value}" if high
                                             else f"must be >= {low}, got {value}")
        return value
    return parse


def _float_at_least(low: float):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not low <= value < float("inf"):  # NaN fails this too
            raise argparse.ArgumentTypeError(f"must be >= {low:g} and finite, got {text}")
        return value
    return parse


def _per_node(text: str) -> int:
    """torchrun's ``--nproc-per-node``: a count, or ``gpu`` (this machine's GPUs), ``cpu`` (its
    cores), ``auto`` (its GPUs if it has any, else its cores)."""
    if text in ("auto", "gpu", "cpu"):
        gpus = 0
        if text != "cpu":
            import torch

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if text == "gpu" and not gpus:
            raise argparse.ArgumentTypeError("gpu: this machine has no GPU that torch can see")
        return gpus or os.cpu_count() or 1
    return _int_in(1)(text)


def _nnodes(text: str) -> int | tuple[int, int]:
    """A count of machines, or torchrun's elastic range ``MIN:MAX`` (with ``--elastic``)."""
    if ":" in text:
        low, _, high = text.partition(":")
        low, high = _int_in(1)(low), _int_in(1)(high)
        if low > high:
            raise argparse.ArgumentTypeError(f"{text}: MIN:MAX needs MIN <= MAX")
        return (low, high)
    return _int_in(1)(text)


def _max_restarts(text: str) -> int:
    value = _int_in(0)(text)
    if value:
        raise argparse.ArgumentTypeError(f"{value}: gradsync run does not restart a failed job; train through "
                                         "gradsync.adapt.Controller with --checkpoint-dir and start again with "
                                         "--resume, or run --elastic, where workers may die and join")
    return value


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "run", help="start the workers and servers of a job",
        usage="gradsync run -np N [--servers S] [-H h1:n,h2:n | --hostfile F] [options] -- COMMAND ...",
        description="Start ranks 0..N-1 as workers and N..N+S-1 as parameter servers, all running COMMAND. "
                    "torchrun's names work too: --nproc-per-node K [--nnodes M --node-rank R --master-addr A "
                    "--master-port P] runs K workers on each of M machines, and as with torchrun a COMMAND that "
                    "is a .py script (or -m MODULE) runs with this Python.")
    parser.add_argument("-np", "--np", "--num-workers", dest="np", type=_int_in(1),
                        help="workers in the whole job")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=_per_node,
                        help="torchrun's name: workers on each machine (the job has this times --nnodes); "
                             "auto, gpu or cpu: this machine's GPUs or cores, as torchrun counts them")
    parser.add_argument("--nnodes", type=_nnodes,
                        help="torchrun's name: machines, each running --nproc-per-node workers (needs --master-addr); "
                             "with --elastic, MIN:MAX machines, one agent each (needs --rdzv-endpoint)")
    parser.add_argument("--servers", type=_int_in(0), default=0, help="parameter servers (default 0)")
    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", help="host1:slots,host2:slots (workers fill hosts in order)")
    hosts.add_argument("--hostfile", help="lines of 'host slots=N' or 'host:N'; '#' comments")
    hosts.add_argument("--machine", metavar="NAME",
                       help="a registered machine's hosts (gradsync machine add), each started over its ssh from "
                            "this host, its first; with --elastic an agent on each")
    parser.add_argument("--node-rank", "--node_rank", type=_int_in(0), help="this host's index in the host list")
    parser.add_argument("--master-addr", "--master_addr",
                        help="rendezvous address (default: first host, or 127.0.0.1)")
    parser.add_argument("--port", "--master-port", "--master_port", type=_int_in(1, 65535),
                        help="rendezvous port (default: free port; 29500 on several hosts)")
    parser.add_argument("--bind", metavar="ADDR",
                        help="address rank 0's store listens on (default: the rendezvous address, so loopback "
                             "for one machine; 0.0.0.0: every interface, trusted networks only)")
    parser.add_argument("--logdir", "--log-dir", "--log_dir", type=output_dir,
                        help="also write each rank's unprefixed output to DIR/worker-K.log")
    torchrun = parser.add_argument_group("torchrun's other flags, taken as torchrun means them")
    torchrun.add_argument("--standalone", action="store_true", help="one machine, a free rendezvous port (the default)")
    torchrun.add_argument("--rdzv-endpoint", "--rdzv_endpoint", metavar="HOST[:PORT]",
                          help="the rendezvous address and port: --master-addr and --master-port")
    torchrun.add_argument("--rdzv-backend", "--rdzv_backend", choices=["c10d", "static"],
                          help="c10d or static: gradsync's rank 0 serves the rendezvous store either way")
    torchrun.add_argument("--rdzv-id", "--rdzv_id", metavar="ID", help="accepted: each job has its own store")
    torchrun.add_argument("--max-restarts", "--max_restarts", type=_max_restarts, default=0,
                          help="0 only: gradsync run does not restart a failed job (see --resume, --elastic)")
    torchrun.add_argument("-m", "--module", action="store_true", help="COMMAND is a module: python -m COMMAND ...")
    torchrun.add_argument("--no-python", "--no_python", action="store_true",
                          help="run COMMAND as it is, even a .py script")
    parser.add_argument("--grace", type=_float_at_least(0), default=3.0, help="seconds between SIGTERM and SIGKILL (default 3)")
    parser.add_argument("--no-forkserver", action="store_true",
                        help="start every rank with exec; by default a process that imported torch once forks the ranks "
                             "that run a training script with this Python (GRADSYNC_FORKSERVER=0 does the same)")
    parser.add_argument("--net", metavar="RATE[,rankN=RATE...]",
                        help="emulated hosts joined by links of RATE (e.g. 1gbit); rankN=RATE gives the host holding "
                             "rank N a link of its own (1gbit,rank3=250mbit: a slow link); needs root")
    parser.add_argument("--delay", type=_float_at_least(0), default=0.0, metavar="MS", help="with --net: one-way host-to-host delay")
    parser.add_argument("--loss", type=_float_at_least(0), default=0.0, metavar="PCT",
                        help="with --net: percent of the frames each link drops (TCP resends them)")
    parser.add_argument("--ranks-per-host", type=_int_in(1), default=1, help="ranks per emulated host with --net (default 1; with --elastic, "
                        "each host's workers, an agent on each host)")
    parser.add_argument("--trace", metavar="FILE", type=output_file,
                        help="write a Chrome trace of every rank (steps, layers, communication, waits, "
                             "the straggler monitor's readings) to FILE; open in ui.perfetto.dev")
    parser.add_argument("--slow", action="append", default=[], type=checked(SlowRanks.parse), metavar="RANK:FACTOR",
                        help="worker RANK's emulated compute takes FACTOR (>= 1) times as long: a straggler "
                             f"(repeatable, or 3:2,1:1.25); the ranks get it as {SLOW_ENV}, which an emulated model "
                             "(gradsync.emulate) reads")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command every rank runs, after --")
    elastic = parser.add_argument_group("elastic jobs (one machine, or --nnodes MIN:MAX machines)")
    elastic.add_argument("--elastic", action="store_true",
                         help="workers may join, leave or die while the job runs (gradsync resize N; see docs/adaptive.md)")
    elastic.add_argument("--min-np", type=_int_in(1), help="with --elastic: fewest workers (default -np)")
    elastic.add_argument("--max-np", type=_int_in(1), help="with --elastic: most workers (default -np)")
    elastic.add_argument("--standby", type=_int_in(0), default=0, metavar="K",
                         help="with --elastic: keep K extra workers started (torch imported, the script run up to "
                              "where it first needs the job, e.g. distribute) that a grow admits at once; replaced "
                              "in the background")
    durable = parser.add_argument_group("checkpoints (a script that trains through gradsync.adapt.Controller)")
    durable.add_argument("--checkpoint-dir", metavar="DIR", type=output_dir,
                         help="worker 0 writes the Controller's commits to DIR, atomically, off the step's path")
    durable.add_argument("--checkpoint-every", type=_int_in(1), metavar="N",
                         help="write every N-th step's commit (default 10)")
    durable.add_argument("--checkpoint-seconds", type=_float_at_least(0.001), metavar="T",
                         help="also write the first commit T seconds after the last write")
    durable.add_argument("--resume", metavar="DIR",
                         help="start from the newest commit in DIR (after the job or its launcher died); "
                              "the job goes on writing there")
    parser.set_defaults(handler=main, run_parser=parser)
    resize = subparsers.add_parser("resize", help="ask a running elastic job (gradsync run --elastic) for N workers",
                                   description="Ask a running elastic job for N workers; it regroups after its next step.")
    resize.add_argument("size", type=_int_in(1), help="the number of workers wanted")
    resize.add_argument("--port", type=_int_in(1, 65535), required=True,
                        help="the job's store port (gradsync run --elastic prints it)")
    resize.add_argument("--addr", default="127.0.0.1", help="the launcher's address (default 127.0.0.1)")
    resize.add_argument("--secret-file", metavar="FILE",
                        help="the job's secret (default: the file gradsync run --elastic wrote for --port, "
                             "~/.gradsync/jobs/elastic-PORT.key, or GRADSYNC_JOB_SECRET)")
    resize.add_argument("--timeout", type=float, default=120.0,
                        help="seconds to wait for the job's answer (new workers must start and join; default 120)")
    resize.set_defaults(handler=_resize)
    return parser


def _resize(args) -> int:
    from gradsync.launch.elastic import resize

    from gradsync.errors import GradsyncError

    if not args.timeout > 0:
        print(f"gradsync resize: --timeout must be > 0 seconds, got {args.timeout:g}", file=sys.stderr)
        return 2
    try:
        gen = resize(args.size, args.port, args.addr, args.timeout, args.secret_file)
    except GradsyncError as exc:
        print(f"gradsync resize: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - the store's errors are plain RuntimeErrors
        print(f"gradsync resize: no elastic job answered at {args.addr}:{args.port}: {exc}", file=sys.stderr)
        return 1
    print(f"gradsync resize: the job has {args.size} workers from generation {gen}")
    return 0


def _workers(args, parser) -> None:
    """``-np``, or torchrun's ``--nproc-per-node`` (times ``--nnodes``): never both."""
    if args.np is not None and args.nproc_per_node is not None:
        parser.error("give the number of workers once: -np (the whole job) or --nproc-per-node (each machine), "
                     "not both")
    if args.nnodes is not None:
        if args.nproc_per_node is None:
            parser.error("--nnodes needs --nproc-per-node (workers on each machine)")
        if args.hosts is not None or args.hostfile is not None:
            parser.error("--nnodes describes the machines already: drop -H/--hostfile, or use them instead")
        if args.nnodes > 1 and args.master_addr is None:
            parser.error("--nnodes > 1 needs --master-addr: the address of the machine with --node-rank 0")
        if args.nnodes > 1:  # the machines' names are not needed: each launcher is told its --node-rank
            args.hosts = ",".join(f"node{i}:{args.nproc_per_node}" for i in range(args.nnodes))
            args.node_rank = args.node_rank or 0
    if args.nproc_per_node is not None:
        args.np = args.nproc_per_node * (args.nnodes or 1)
    if args.np is None:
        parser.error("the number of workers is required: -np N (or torchrun's --nproc-per-node K)")


def _hosts_and_node_rank(args, parser) -> tuple[list[tuple[str, int]] | None, int]:
    if args.hosts is None and args.hostfile is None:
        if args.node_rank:
            parser.error("--node-rank needs -H or --hostfile")
        return None, 0
    try:
        hosts = parse_hosts(args.hosts) if args.hosts is not None else read_hostfile(args.hostfile)
        if not hosts:
            raise ValueError("-H lists no hosts")
        node_rank = args.node_rank
        if node_rank is None:
            node_rank = 0 if len(hosts) == 1 else detect_node_rank(hosts)
        plan_ranks(args.np, args.servers, hosts, node_rank)  # checks -np against the slots
    except (OSError, ValueError) as err:
        parser.error(str(err))
    return hosts, node_rank


def _command(args, parser) -> list[str]:
    """The command every rank runs: as given, or, as torchrun runs them, a ``.py`` script or a module
    (``-m``) with this Python (``--no-python``: as given)."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("missing the command to run, e.g. gradsync run -np 2 -- python train.py")
    if args.module and args.no_python:
        parser.error("-m runs a module with Python and --no-python runs the command without it: give one")
    if args.module:
        return [sys.executable, "-m", *command]
    if command[0].endswith(".py") and not args.no_python:
        return [sys.executable, *command]
    return command


def _rendezvous(args, parser) -> None:
    """torchrun's ``--rdzv-endpoint`` and ``--standalone`` as gradsync's ``--master-addr``/``--port``."""
    if args.rdzv_endpoint is not None:
        if args.master_addr is not None or args.port is not None:
            parser.error("--rdzv-endpoint names the rendezvous already: drop --master-addr/--master-port")
        host, _, port = args.rdzv_endpoint.rpartition(":") if ":" in args.rdzv_endpoint else (args.rdzv_endpoint, "", "")
        args.master_addr = host.strip("[]") or None
        if port:
            try:
                args.port = _int_in(1, 65535)(port)
            except (ValueError, argparse.ArgumentTypeError) as exc:
                parser.error(f"--rdzv-endpoint {args.rdzv_endpoint}: the port {exc}")
    if args.standalone and (args.nnodes or 1) > 1:
        parser.error("--standalone is one machine: drop it, or --nnodes")


def main(args: argparse.Namespace) -> int:
    if not args.trace:
        return _main(args)
    from gradsync import trace

    path = os.path.abspath(args.trace)
    stale = glob.glob(glob.escape(path) + ".rank-*.json")
    for part in stale:  # a previous job's: not merged into this one
        os.remove(part)
    os.environ[trace.ENV] = path  # every rank traces itself and writes FILE.rank-R.json at shutdown
    try:
        code = _main(args)
    finally:
        os.environ.pop(trace.ENV, None)
    parts = sorted(glob.glob(glob.escape(path) + ".rank-*.json"))
    if parts:
        count = trace.merge(parts, path)
        for part in parts:
            os.remove(part)
        print(f"gradsync run: trace of {len(parts)} rank(s), {count} events: {args.trace} "
              "(open in https://ui.perfetto.dev or chrome://tracing)", file=sys.stderr, flush=True)
    else:
        print(f"gradsync run: no rank wrote a trace (none called gradsync.init(), or none reached "
              f"gradsync.shutdown()): {args.trace} not written", file=sys.stderr, flush=True)
    return code


def _main(args: argparse.Namespace) -> int:
    parser = args.run_parser
    command = _command(args, parser)
    _rendezvous(args, parser)
    if args.no_forkserver:  # read where the ranks start, by this launcher and the agents it starts
        os.environ[FORKSERVER_ENV] = "0"
    if args.machine is not None:
        return _run_machine(args, command, parser)
    if isinstance(args.nnodes, tuple):
        if not args.elastic:
            parser.error(f"--nnodes {args.nnodes[0]}:{args.nnodes[1]}: a range of machines is torchrun's elastic form: "
                         "add --elastic (one agent per machine, --rdzv-endpoint the first's address)")
        _checkpoints(args, parser)  # every host's workers write (and, with --resume, restore) the commits
        return _run_elastic_hosts(args, command, parser)
    _workers(args, parser)
    if args.delay and args.net is None:
        parser.error("--delay needs --net: it is the delay of the emulated links")
    if args.loss and args.net is None:
        parser.error("--loss needs --net: it is the loss of the emulated links")
    if args.loss >= 100:
        parser.error(f"--loss must be below 100 (percent), got {args.loss:g}")
    if args.bind is not None:
        os.environ["GRADSYNC_BIND_ADDR"] = args.bind  # the ranks inherit it; rank 0's store reads it
    hosts, node_rank = _hosts_and_node_rank(args, parser)
    _checkpoints(args, parser)
    if args.elastic:
        return _run_elastic(args, command, parser)
    if args.min_np is not None or args.max_np is not None or args.standby:
        parser.error("--min-np, --max-np and --standby need --elastic")
    env = _slow_env(args, parser)
    if args.net is not None:
        return _run_emulated(args, command, parser, env)
    result = launch_local(command, np=args.np, servers=args.servers, port=args.port,
                          logdir=args.logdir, grace_s=args.grace, hosts=hosts, env=env,
                          node_rank=node_rank, master_addr=args.master_addr, say_threads=True)
    return _reported(result)


def _run_machine(args, command: list[str], parser) -> int:
    """``--machine NAME``: the job over a registered machine's hosts, from its first host; each
    other host's part (its ranks, or with ``--elastic`` its agent) started over the machine's ssh
    (:mod:`gradsync.launch.remote`)."""
    from gradsync import trace
    from gradsync.launch import machines, remote

    if args.nnodes is not None or args.nproc_per_node is not None or args.master_addr or args.net is not None:
        parser.error("--machine names the hosts and their slots: no --nnodes, --nproc-per-node, --master-addr, "
                     "--rdzv-endpoint or --net")
    if args.bind or args.delay or args.loss:
        parser.error("--machine runs on the machine's own network: no --bind, --delay or --loss")
    if not args.elastic and (args.logdir or args.port):
        parser.error("--machine starts each host's launcher on a free port and passes its output through: "
                     "no --logdir or --port (with --elastic, --port is the store's and --logdir each host's folder)")
    if args.elastic and os.environ.get(trace.ENV):
        parser.error("--trace with --elastic --machine: the workers of the other hosts come and go and their "
                     "traces stay there; trace a fixed job (gradsync run --machine NAME -np N --trace FILE)")
    try:
        machine = machines.get(args.machine)
    except ConfigError as exc:
        parser.error(str(exc))
    # The interpreter that runs a .py script is each host's own (the machine's "python").
    command = [remote.PYTHON if word == sys.executable else word for word in command]
    try:
        if args.elastic:
            if args.np is not None or args.max_np is not None or args.servers or args.slow:
                parser.error("--elastic --machine runs every host's slots, growing onto each as its agent registers: "
                             "no -np, --max-np, --servers or --slow (--min-np: the fewest workers it starts with)")
            agent_args = [*(["--checkpoint-dir", os.path.abspath(args.checkpoint_dir)] if args.checkpoint_dir else []),
                          *(["--resume", os.path.abspath(args.resume)] if args.resume else []),
                          *(["--checkpoint-every", str(args.checkpoint_every)] if args.checkpoint_every else []),
                          *(["--checkpoint-seconds", f"{args.checkpoint_seconds:g}"] if args.checkpoint_seconds else []),
                          *(["--no-forkserver"] if args.no_forkserver else [])]
            result = remote.launch_elastic_machine(command, machine=machine, agent_args=agent_args,
                                                   min_np=args.min_np, standby=args.standby, port=args.port,
                                                   logdir=args.logdir and os.path.abspath(args.logdir),
                                                   grace_s=args.grace)
        else:
            _workers(args, parser)
            if args.min_np is not None or args.max_np is not None or args.standby:
                parser.error("--min-np, --max-np and --standby need --elastic")
            from gradsync.adapt import durable

            _checkpoints(args, parser)  # as environment variables, which every host's ranks get
            env = {name: os.environ[name] for name in (durable.DIR_ENV, durable.EVERY_ENV, durable.SECONDS_ENV,
                                                       durable.RESUME_ENV, trace.ENV) if name in os.environ}
            files, collect = {}, None
            if trace.ENV in env:  # each host's ranks write their parts there; they come back to be merged
                path = env[trace.ENV]
                files = {f"{path}.hosts": "gradsync run --machine: the ranks' traces are written beside this file\n"}
                collect = (os.path.dirname(path), glob.escape(os.path.basename(path)) + ".rank-*.json")
            result = remote.launch_hosts(command, machine=machine, np=args.np, servers=args.servers,
                                         env={**env, **_slow_env(args, parser)}, files=files, collect=collect,
                                         grace_s=args.grace)
    except ConfigError as exc:
        print(f"gradsync run: {exc}", file=sys.stderr, flush=True)
        return 2
    return _reported(result)


def _reported(result) -> int:
    """A job's exit status, its message (if any) printed."""
    if result.message:
        print(result.message, file=sys.stderr, flush=True)
    return result.returncode


def _slow_env(args, parser) -> dict[str, str]:
    """``--slow``, checked against the job's workers, as the ranks' :data:`SLOW_ENV` (none without it)."""
    if not args.slow:
        return {}
    try:
        slow = SlowRanks.union(args.slow)
        slow.check(args.np, args.servers)
    except ConfigError as exc:
        parser.error(f"--slow: {exc}")
    return {SLOW_ENV: str(slow)}


def _checkpoints(args, parser) -> None:
    """The checkpoint options, handed to the ranks as environment variables (gradsync.adapt.durable)."""
    from gradsync.adapt import durable

    folder = args.resume or args.checkpoint_dir
    if args.resume and args.checkpoint_dir and os.path.abspath(args.resume) != os.path.abspath(args.checkpoint_dir):
        parser.error("--resume DIR goes on writing to DIR: give --checkpoint-dir the same folder, or leave it out")
    if folder is None:
        if args.checkpoint_every is not None or args.checkpoint_seconds is not None:
            parser.error("--checkpoint-every and --checkpoint-seconds need --checkpoint-dir (or --resume)")
        return
    if args.resume:
        if not os.path.isdir(args.resume):
            parser.error(f"--resume {args.resume}: no such folder")
        found = durable.commits(args.resume)
        print(f"gradsync run: resuming from {found[0][1]} (step {found[0][0]})" if found else
              f"gradsync run: --resume {args.resume} holds no commit yet: the job starts from the beginning",
              file=sys.stderr, flush=True)
        os.environ[durable.RESUME_ENV] = "1"
    os.environ[durable.DIR_ENV] = os.path.abspath(folder)
    if args.checkpoint_every is not None:
        os.environ[durable.EVERY_ENV] = str(args.checkpoint_every)
    if args.checkpoint_seconds is not None:
        os.environ[durable.SECONDS_ENV] = str(args.checkpoint_seconds)


def _run_elastic(args, command: list[str], parser) -> int:
    if args.net is not None:
        return _run_elastic_emulated(args, command, parser)
    if args.hosts or args.hostfile or args.servers:
        parser.error("--elastic runs workers on this machine (or one agent per machine with --nnodes MIN:MAX): "
                     "no -H, --hostfile or --servers")
    if args.slow:
        parser.error("--slow names ranks, and an elastic job's ranks change as workers come and go: not with --elastic")
    from gradsync.launch.elastic import launch_elastic

    try:
        result = launch_elastic(command, np=args.np, min_np=args.min_np or args.np, max_np=args.max_np or args.np,
                                port=args.port, logdir=args.logdir, grace_s=args.grace, standby=args.standby)
    except ConfigError as exc:  # its store cannot listen (a port in use): nothing was started
        print(f"gradsync run --elastic: {exc}", file=sys.stderr, flush=True)
        return 2
    return _reported(result)


def _run_elastic_emulated(args, command: list[str], parser) -> int:
    """``--elastic --net``: -np workers on emulated hosts of ``--ranks-per-host``, an agent on each
    (:func:`gradsync.launch.emulated.launch_elastic_emulated`); the job runs on no fewer hosts than
    --min-np's workers fill."""
    from gradsync.cluster import LinkRates, require_privileges
    from gradsync.launch.emulated import launch_elastic_emulated

    if args.hosts or args.hostfile or args.master_addr or args.servers or args.slow:
        parser.error("--elastic --net emulates the hosts on this machine: no -H, --hostfile, --master-addr, "
                     "--servers or --slow")
    k = args.ranks_per_host
    if args.np % k:
        parser.error(f"--elastic --net: -np {args.np} must be a multiple of --ranks-per-host {k} (hosts of {k} workers)")
    if args.max_np not in (None, args.np):
        parser.error("--elastic --net starts every emulated host's agent at once, and the job grows to -np workers "
                     "as they register: give --max-np equal to -np, or leave it out")
    try:
        rates = LinkRates.parse(args.net)
    except ConfigError as exc:
        parser.error(f"--net {args.net}: {exc}")
    if rates.ranks:
        parser.error(f"--elastic --net {args.net}: one rate for every link (rankN=RATE names ranks, and an elastic "
                     "job's ranks change as workers come and go)")
    try:
        require_privileges()
    except ConfigError as exc:
        parser.error(str(exc))
    return launch_elastic_emulated(command, hosts=args.np // k, nproc=k, min_hosts=-(-(args.min_np or args.np) // k),
                                   rate_bps=rates.default, delay_ms=args.delay, loss=args.loss / 100,
                                   port=args.port or 29500, standby=args.standby, logdir=args.logdir, grace_s=args.grace)


def _run_elastic_hosts(args, command: list[str], parser) -> int:
    """``--elastic --nnodes MIN:MAX``: this host's agent of a job over several hosts. The agent on the
    host that owns the rendezvous address leads (hosts the store, decides who is in the job); the
    others register with it (gradsync.launch.elastic_hosts)."""
    if args.nproc_per_node is None or args.np is not None:
        parser.error("--elastic --nnodes MIN:MAX counts workers per machine: give --nproc-per-node K, not -np")
    if args.master_addr is None or args.port is None:
        parser.error("--elastic --nnodes MIN:MAX needs --rdzv-endpoint HOST:PORT: the address and port of the "
                     "machine whose agent hosts the job's store, the same on every machine")
    if args.min_np is not None or args.max_np is not None:
        parser.error("--nnodes MIN:MAX sets the workers already (MIN and MAX times --nproc-per-node): drop --min-np/--max-np")
    if args.hosts or args.hostfile or args.net or args.servers or args.slow:
        parser.error("--elastic --nnodes runs one agent per machine: no -H, --hostfile, --net, --servers or --slow")
    from gradsync.launch.elastic import launch_elastic, run_host
    from gradsync.launch.elastic_hosts import LEAD_ENV
    from gradsync.launch.hosts import _is_local_address

    low, high = args.nnodes
    k = args.nproc_per_node
    try:
        # This machine owns the endpoint: its agent leads (gradsync run --elastic --machine says which does).
        role = os.environ.pop(LEAD_ENV, None)
        if _is_local_address(args.master_addr) if role is None else role == "1":
            result = launch_elastic(command, np=low * k, min_np=low * k, max_np=high * k, port=args.port,
                                    logdir=args.logdir, grace_s=args.grace, standby=args.standby,
                                    addr=args.master_addr, nproc=k, min_hosts=low)
        else:
            if args.standby:
                parser.error("--standby is the lead's (the agent on the --rdzv-endpoint machine): give it there")
            result = run_host(command, addr=args.master_addr, port=args.port, nproc=k, logdir=args.logdir,
                              grace_s=args.grace)
    except ConfigError as exc:
        print(f"gradsync run --elastic: {exc}", file=sys.stderr, flush=True)
        return 2
    return _reported(result)


def _run_emulated(args, command: list[str], parser, env: dict[str, str]) -> int:
    """``--net``: the job's ranks on emulated hosts (:mod:`gradsync.cluster`), removed afterwards."""
    from gradsync.cluster import LinkRates, require_privileges
    from gradsync.launch.emulated import launch_emulated, placement

    if args.hosts or args.hostfile or args.master_addr:
        parser.error("--net emulates the hosts on this machine: it cannot be combined with -H, --hostfile or --master-addr")
    try:
        rates = LinkRates.parse(args.net)
        rates.per_host(placement(args.np, args.servers, args.ranks_per_host))
    except ConfigError as exc:
        parser.error(f"--net {args.net}: {exc}")
    try:
        require_privileges()
        result = launch_emulated(command, np=args.np, servers=args.servers, rate_bps=rates.default,
                                 rank_rates=rates.ranks, delay_ms=args.delay, loss=args.loss / 100,
                                 ranks_per_host=args.ranks_per_host, env=env,
                                 port=args.port, logdir=args.logdir, grace_s=args.grace)
    except ConfigError as exc:
        parser.error(str(exc))
    return _reported(result)
