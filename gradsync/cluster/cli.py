"""``gradsync cluster cleanup``: remove emulated clusters that dead gradsync processes left behind."""
from __future__ import annotations

import sys


def add_parser(subparsers) -> None:
    cluster = subparsers.add_parser("cluster", help="manage emulated clusters")
    actions = cluster.add_subparsers(dest="action", required=True, metavar="ACTION")
    cleanup = actions.add_parser("cleanup", help="remove namespaces left behind by gradsync processes that died")
    cleanup.add_argument("--all", action="store_true", help="also those of gradsync processes still running")
    cleanup.set_defaults(handler=cleanup_main)


def cleanup_main(args) -> int:
    from gradsync.cluster import leftovers, remove, require_privileges
    from gradsync.errors import ConfigError

    try:
        require_privileges()
    except ConfigError as exc:
        print(f"gradsync cluster cleanup: {exc}", file=sys.stderr)
        return 1
    names = leftovers(include_live=args.all)
    remove(names)
    print(f"removed {len(names)} namespace(s)" + (": " + ", ".join(names) if names else ""))
    return 0
