"""Test driver: several `loomtrain` commands in one launch (one process, or one torchrun of N).

    python -m torch.distributed.run --standalone --nproc_per_node 4 tests/cli_driver.py OUT \
        --variant NAME train CONFIG k=v ... --variant NAME2 train CONFIG2 k=v ...

Each variant is `loomtrain ARGS` (the CLI's main, as `python -m loomtrain ARGS` runs it: config
checks, run-directory claim, the loop) in the same process group, one after the other, so a
test pays for process start-up and the DeepSpeed import once (tests/zero_driver.py does the
same below the CLI). What this rank printed during a variant goes to OUT/NAME.rank{R}.out and
its exit status to OUT/NAME.rank{R}.rc; an exception is written there (its traceback, status
"exception") and the next variant still runs, so that each test fails on its own variant.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from pathlib import Path

from loomtrain.launcher import cli


def parse(argv: list[str]) -> tuple[Path, list[tuple[str, list[str]]]]:
    out, variants = Path(argv[0]), []
    for arg in argv[1:]:
        if arg == "--variant":
            variants.append(None)
        elif variants and variants[-1] is None:
            variants[-1] = (arg, [])
        else:
            variants[-1][1].append(arg)
    return out, variants


def main(argv: list[str]) -> int:
    out, variants = parse(argv)
    out.mkdir(parents=True, exist_ok=True)
    rank = os.environ.get("RANK", "0")
    for name, args in variants:
        with (
            open(out / f"{name}.rank{rank}.out", "w") as stdout,
            open(out / f"{name}.rank{rank}.err", "w") as stderr,
            contextlib.redirect_stdout(stdout),
            contextlib.redirect_stderr(stderr),
        ):
            try:
                rc = str(cli.main(args))
            except (Exception, SystemExit):  # written down for the test; the next variant runs
                traceback.print_exc()
                rc = "exception"
        (out / f"{name}.rank{rank}.rc").write_text(rc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
