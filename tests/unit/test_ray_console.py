"""The pieces of `train --ray`'s console that need no cluster (launcher/cluster/ray_console.py):
a worker's stream sends whole lines to the driver's sink in order, and the driver's streams send
what a thread of Ray's writes to the log file. No module of Ray's private API is used there."""

from __future__ import annotations

import io
import sys
import threading

from loomtrain.launcher.cluster import ray_console
from source_tree import ROOT


class FakeSink:
    """Stands for the ConsoleSink actor handle: `sink.write.remote(is_err, text)`."""

    def __init__(self):
        self.got, self.write = [], self

    def remote(self, is_err, text):
        self.got.append((is_err, text))
        return None  # a reference to wait on: none here


def test_a_worker_stream_sends_whole_lines_in_order():
    sink = FakeSink()
    out = ray_console._LinePrefix(ray_console._ToDriver(sink, is_err=False), "[10.0.0.2 rank 3] ")
    for piece in ("step 1", "/12 | loss 5.7\nwarn", "ing: x\n", "last"):
        out.write(piece)
    assert sink.got == [
        (False, "[10.0.0.2 rank 3] step 1/12 | loss 5.7\n"),
        (False, "[10.0.0.2 rank 3] warning: x\n"),
    ]
    out.flush()  # a partial line goes on a flush
    assert sink.got[-1] == (False, "[10.0.0.2 rank 3] last")


def test_the_sink_hands_each_line_over_once():
    sink = ray_console.ConsoleSink()
    sink.write(False, "a\n")
    sink.write(True, "b\n")
    assert sink.drain() == [(False, "a\n"), (True, "b\n")] and sink.drain() == []


def test_the_drivers_streams_send_rays_threads_to_the_log():
    console, log = io.StringIO(), io.StringIO()
    stream = ray_console._ByThread(console, log)
    stream.write("loomtrain: Ray Train: 2 workers\n")
    ray_thread = threading.Thread(target=stream.write, args=("(raylet) node marked dead\n",), name="ray_listen_x")
    ray_thread.start()
    ray_thread.join()
    assert console.getvalue() == "loomtrain: Ray Train: 2 workers\n"
    assert log.getvalue() == "(raylet) node marked dead\n"


def test_what_rays_disconnect_prints_from_the_drivers_thread_goes_to_the_log(tmp_path, capsys):
    with ray_console.DriverConsole(tmp_path) as console:
        print("loomtrain: Ray Train run finished: step 4")
        with console.to_log():  # as ray.shutdown() prints its deduplicator's leftovers
            print("(raylet) Raylet is terminated. Termination is unexpected.")
            print("(raylet) more", file=sys.stderr)
        print("loomtrain: done")
    out = capsys.readouterr()
    assert out.out == "loomtrain: Ray Train run finished: step 4\nloomtrain: done\n" and out.err == ""
    logged = (tmp_path / "logs" / ray_console.DRIVER_LOG).read_text()
    assert "(raylet) Raylet is terminated." in logged and "(raylet) more" in logged


def test_no_launcher_module_reaches_into_rays_private_modules():
    found = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in sorted((ROOT / "launcher").rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if "ray._private" in line or "ray_worker_stdstream" in line
    ]
    assert not found, found
