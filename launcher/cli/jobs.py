"""`loomtrain submit | status | logs | stop`: a config as a Ray job, and the job afterwards.

    loomtrain submit CONFIG [key=value ...] [--address URL] [--submission-id ID]
                     [--env KEY=VALUE ...] [--follow] [--dry-run]
    loomtrain status JOB [--address URL]
    loomtrain logs   JOB [--address URL] [--follow]
    loomtrain stop   JOB [--address URL] [--wait]

What each one does, what `submit` ships and how it authenticates: launcher/cluster/jobs.py.
"""

from __future__ import annotations

import argparse
import sys

from loomtrain.launcher.cli import HelpFormatter
from loomtrain.launcher.cluster import jobs


def _parser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"loomtrain {command}", formatter_class=HelpFormatter)
    p.add_argument(
        "--address", default=None, help="Ray dashboard address, e.g. http://HEAD:8265 (default: $RAY_ADDRESS)"
    )
    if command == "submit":
        p.add_argument("config", help="YAML config (paths inside this project ship as they are)")
        p.add_argument("overrides", nargs="*", help="key=value config overrides")
        p.add_argument("--submission-id", default=None, help="job id to use (default: Ray picks)")
        p.add_argument(
            "--env",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="environment variable for the job (repeatable)",
        )
        p.add_argument("--follow", action="store_true", help="stream the logs until the job ends")
        p.add_argument(
            "--dry-run", action="store_true", help="list the files that would be shipped, with sizes; submit nothing"
        )
    else:
        p.add_argument("job", help="job (submission) id printed by `loomtrain submit`")
    if command == "logs":
        p.add_argument("--follow", "-f", action="store_true", help="stream until the job ends")
    if command == "stop":
        p.add_argument("--wait", action="store_true", help="wait until the job has stopped")
        p.add_argument("--wait-timeout", type=float, default=60.0, help="seconds --wait waits for the job to stop")
    return p


# Each parser's destinations are the keyword parameters of the function it calls.
COMMANDS = {"submit": jobs.submit, "status": jobs.status, "logs": jobs.logs, "stop": jobs.stop}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: loomtrain {{{'|'.join(COMMANDS)}}} ...", file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    args = _parser(command).parse_intermixed_args(rest)
    try:
        return COMMANDS[command](**vars(args))
    except jobs.JobsError as e:
        print(f"loomtrain {command}: error: {e}", file=sys.stderr)
        return 1
