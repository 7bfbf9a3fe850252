"""launcher/distributed.py: the process group a rank makes is ended at exit, one it adopts is not.

A gloo group left alive into interpreter finalization can abort a finished rank on its way
out (SIGABRT, "terminate called without an active exception"; seen once in CI, a few runs
in a hundred on a loaded 2-core machine), which torchrun reports as a failed job.
"""

from __future__ import annotations

import sys

import pytest
from launch import python_cmd, run_child

# Handlers registered before init_distributed run after its own (atexit is last in, first out).
CHILD = """
import atexit, os, socket, sys
import torch.distributed as dist
from loomtrain.launcher.config import RunConfig
from loomtrain.launcher.distributed import init_distributed

if sys.argv[1] == "adopted":  # a group set up by the launcher, as Ray Train's worker does
    with socket.socket() as s:  # a free port for the stand-in launcher's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo")
    atexit.register(dist.destroy_process_group)  # the launcher's own clean-up, after the check
atexit.register(lambda: print("group alive at exit:", dist.is_initialized()))
cfg = RunConfig()
cfg.train.device = "cpu"
print("launcher:", init_distributed(cfg).launcher)
"""


@pytest.mark.parametrize("how,launcher,alive", [("made", "local", False), ("adopted", "existing", True)])
def test_a_group_made_here_is_destroyed_at_exit_an_adopted_one_is_left(how, launcher, alive):
    # The exit status is this code's only when it made the group: an adopted one is torn down by
    # the stand-in launcher above, whose own gloo teardown can abort on this machine (exit -6).
    proc = run_child([sys.executable, "-c", CHILD, how], rc=0 if how == "made" else None)
    assert f"launcher: {launcher}" in proc.stdout
    assert f"group alive at exit: {alive}" in proc.stdout, proc.stdout + proc.stderr


EXCHANGE = """
import sys

import torch.distributed as dist
from loomtrain.launcher.distributed import all_gather_objects, broadcast_str

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
store = dist.distributed_c10d._get_default_store()
for i in range(6):
    if i == 2:  # counted while no rank is between calls
        dist.barrier()
        keys_after_two = store.num_keys()
        dist.barrier()
    got = all_gather_objects({"rank": rank, "call": i})
    assert got == [{"rank": r, "call": i} for r in range(world)], got
    said = broadcast_str(f"rank 0's word {i}" if rank == 0 else None)
    assert said == f"rank 0's word {i}", said
dist.barrier()
assert store.num_keys() == keys_after_two, (store.num_keys(), keys_after_two)
open(f"{sys.argv[1]}/exchanged.{rank}", "w").close()  # stdout lines of ranks may interleave
dist.destroy_process_group()
"""


def test_objects_are_exchanged_through_the_store_in_call_order_and_their_keys_cleared(tmp_path):
    # No gloo collective on Python-made tensors (those are what aborted finished ranks at exit),
    # and a store whose keys do not grow with each call: a Ray run broadcasts on every log step.
    script = tmp_path / "exchange.py"
    script.write_text(EXCHANGE)
    run_child(python_cmd(script, tmp_path, nproc=3))
    assert sorted(p.name for p in tmp_path.glob("exchanged.*")) == ["exchanged.0", "exchanged.1", "exchanged.2"]
