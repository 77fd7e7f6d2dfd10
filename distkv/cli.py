"""The `distkv` command."""

from __future__ import annotations

import argparse

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
    args = parser.parse_args(argv)
    return args.run(args)
