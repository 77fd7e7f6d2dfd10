"""The `distkv` command."""

from __future__ import annotations

import argparse

from distkv.observability import status
from distkv.demo import runner


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distkv", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="model replicas sharing one prefix cache on a Ray cluster, measured",
        description=runner.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    runner.add_arguments(demo)
    demo.set_defaults(run=runner.run)
    status_command = commands.add_parser(
        "status",
        help="nodes, replicas, Directory shards and recent errors of a running cluster",
        description=status.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    status.add_arguments(status_command)
    status_command.set_defaults(run=status.run)
    args = parser.parse_args(argv)
    return args.run(args)
