"""Test driver: `loomtrain preprocess ARGS` pressed Ctrl-C on once input file STOP_AFTER is written.

    python tests/preprocess_ctrl_c_driver.py STOP_AFTER preprocess --input ... --output ...

The command runs as it does from a shell; when the part of input file STOP_AFTER is complete,
SIGINT goes to the whole process group, as a terminal sends it on Ctrl-C (so a worker pool
gets it too), and the driver waits for it to land. The driver must lead a process group of
its own (start it with start_new_session=True): it refuses to signal anyone else's.
"""

from __future__ import annotations

import os
import signal
import sys
import time

if __name__ == "__main__":  # spawned pool workers import this file again: they must not run it
    from loomtrain.data_pipeline import staging
    from loomtrain.launcher.cli import main

    if os.getpgid(0) != os.getpid():
        sys.exit("preprocess_ctrl_c_driver: start me in a session of my own (start_new_session=True)")
    # As a terminal's foreground command has it: a shell's background job (`cmd &`, as a CI
    # script may start the suite) inherits SIGINT ignored, and Python then installs no handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    stop_after = int(sys.argv[1])
    finish = staging.PartWriter.finish

    def finish_then_ctrl_c(self, stats) -> None:
        finish(self, stats)
        if self.i == stop_after:
            os.killpg(0, signal.SIGINT)
            time.sleep(60)  # the KeyboardInterrupt lands here

    staging.PartWriter.finish = finish_then_ctrl_c
    sys.exit(main(sys.argv[2:]))
