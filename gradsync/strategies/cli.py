"""``gradsync strategies``: every registered strategy in one line each, with whether it is exact
(equal to the single-process reference) and which torch.distributed backends it runs on.
``gradsync strategies NAME``: one strategy, the paper it comes from and its options with their
defaults, as ``distribute(..., strategy=NAME, OPTION=VALUE)`` and ``gradsync bench --set
NAME.OPTION=VALUE`` take them."""
from __future__ import annotations

import functools
import inspect


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("strategies", help="list the strategies: what each does, exact or not, backends",
                              description=__doc__)
    p.add_argument("name", nargs="?", help="one strategy: its paper and its options with their defaults")
    p.set_defaults(handler=main)


def exactness(name: str, exact: bool) -> str:
    """``yes``, ``no``, or, for strategies that take ``compression=``, what it depends on."""
    if name in ("casync-ring", "casync-ps", "compressed-allgather"):
        return "with a lossless codec"
    return "yes" if exact else "no"


def _backends(strategy) -> str:
    return "/".join(b.capitalize() if b == "gloo" else b.upper() for b in strategy.backends)


def rows() -> list[tuple[str, str, str, str]]:
    from gradsync.strategies import STRATEGIES, resolve

    out = []
    for name in STRATEGIES:
        strategy = resolve(name)
        out.append((name, strategy.summary, exactness(name, strategy.exact), _backends(strategy)))
    return out


def options(constructor) -> tuple[list[tuple[str, str, bool]], str | None]:
    """``(option, default, fixed)`` of a strategy's constructor (and of the bases its ``**options``
    reach; ``fixed``: set by the registered name, where it is a ``functools.partial`` of a class),
    and the name of a catch-all that passes the rest on (a compressed strategy's compressor options)."""
    from gradsync.errors import accepted_options

    fixed = constructor.keywords if isinstance(constructor, functools.partial) else {}
    found, rest = accepted_options(constructor)
    return [(p.name, "(required)" if p.default is p.empty else repr(p.default), p.name in fixed) for p in found], rest


def describe(name: str) -> str:
    """One strategy: its line, the first paragraph of its module's docstring (the paper), its options."""
    from gradsync.argtypes import plain
    from gradsync.strategies import STRATEGIES, resolve

    constructor = STRATEGIES[name]
    strategy = resolve(name)
    cls = constructor.func if isinstance(constructor, functools.partial) else constructor
    module = inspect.getmodule(cls)
    paper = (inspect.getdoc(module) or "").split("\n\n")[0] if module is not None else ""
    lines = [f"{name}: {strategy.summary}", f"exact: {exactness(name, strategy.exact)}; backends: {_backends(strategy)}"]
    if paper:
        lines += ["", plain(paper)]
    found, rest = options(constructor)
    lines += ["", f"options (distribute(model, optimizer, strategy={name!r}, OPTION=VALUE); "
                  f"gradsync bench --set {name}.OPTION=VALUE):"]
    width = max((len(option) for option, _, _ in found), default=0)
    for option, default, fixed in found:
        lines.append(f"  {option:<{width}}  {default}" + ("  (fixed by this name)" if fixed else ""))
    if rest == "compressor_options":
        lines.append("  and the compressor's own options (gradsync codecs; e.g. compression='topk:ratio=0.01')")
    elif rest is not None:
        lines.append(f"  and any the constructor passes on (**{rest})")
    if not found and rest is None:
        lines.append("  none")
    return "\n".join(lines)


def main(args) -> int:
    import argparse

    from gradsync.strategies import STRATEGIES
    from gradsync.strategies import names as strategy_names

    if args.name is not None:
        if args.name not in STRATEGIES:
            argparse.ArgumentParser(prog="gradsync strategies").error(
                f"unknown strategy {args.name!r}; valid strategies: {', '.join(strategy_names())}")
        print(describe(args.name))
        return 0
    table = [("strategy", "what it does", "exact", "backends"), *rows()]
    widths = [max(len(r[c]) for r in table) for c in (0, 2, 3)]
    for name, summary, exact, backends in table:
        print(f"{name:<{widths[0]}}  {exact:<{widths[1]}}  {backends:<{widths[2]}}  {summary}")
    print("\nexact: equal to one process training on every worker's batch (fp32 rounding aside). "
          "NCCL between several GPUs is not tested yet (docs/gpu.md). `gradsync strategies NAME`: one "
          "strategy's paper and options.")
    return 0
