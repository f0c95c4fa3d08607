"""``gradsync strategies``: every registered strategy in one line each, with whether it is exact
(equal to the single-process reference) and which torch.distributed backends it runs on."""
from __future__ import annotations


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("strategies", help="list the strategies: what each does, exact or not, backends",
                              description=__doc__)
    p.set_defaults(handler=main)


def exactness(name: str, exact: bool) -> str:
    """``yes``, ``no``, or, for strategies that take ``compression=``, what it depends on."""
    if name in ("casync-ring", "casync-ps", "compressed-allgather"):
        return "with a lossless codec"
    return "yes" if exact else "no"


def rows() -> list[tuple[str, str, str, str]]:
    from gradsync.strategies import STRATEGIES, resolve

    out = []
    for name in STRATEGIES:
        strategy = resolve(name)
        out.append((name, strategy.summary, exactness(name, strategy.exact), "/".join(b.capitalize() if b == "gloo" else b.upper()
                                                                   for b in strategy.backends)))
    return out


def main(args) -> int:
    table = [("strategy", "what it does", "exact", "backends"), *rows()]
    widths = [max(len(r[c]) for r in table) for c in (0, 2, 3)]
    for name, summary, exact, backends in table:
        print(f"{name:<{widths[0]}}  {exact:<{widths[1]}}  {backends:<{widths[2]}}  {summary}")
    print("\nexact: equal to one process training on every worker's batch (fp32 rounding aside). "
          "NCCL between several GPUs is not tested yet (docs/gpu.md).")
    return 0
