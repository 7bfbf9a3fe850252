"""A host SIGKILLed under a two-host torchrun (network namespaces, tests/hosts.py): every surviving
rank ends with one line naming the lost host, not a gloo "Connection reset by peer" traceback."""

from __future__ import annotations

import pytest
from test_multihost_torchrun import assert_nothing_left, ours_in_traceback, overrides, start


@pytest.mark.slow  # two hosts, ~60 s
def test_a_killed_host_is_named_in_one_line_by_the_survivors(hosts, tmp_path, data_cache):
    a, b = hosts.add(), hosts.add()
    run_dir = tmp_path / "run"
    args = overrides(run_dir, data_cache, "train.max_steps=1000", "checkpoint.every_steps=0")
    run, b_proc, _ = start(a, b, tmp_path, 1, args)
    with run:
        run.wait_for(lambda line: line.startswith("step 5/"), timeout=300)
        b.kill()  # every process of host B: a host lost
        rc_a = run.finish(timeout=240)
    text = run.text
    lost = [line for line in run.lines if line.startswith("loomtrain: lost a host:")]
    assert rc_a == 1 and len(lost) == 1, text[-3000:]
    # gloo words a killed peer one of two ways, by which side of the socket saw the kill first
    # (launcher/cli/train.py's _PEER_GONE): the line names the host and gloo's own words
    causes = ("Connection reset by peer", "Connection closed by peer")
    assert any(lost[0].startswith(f"loomtrain: lost a host: {b.addr} ({c} in a collective)") for c in causes), lost
    assert f"the ranks' logs are in {run_dir / 'logs'}" in lost[0]
    assert not ours_in_traceback(text), text[-3000:]
    b_proc.wait(timeout=30)
    assert_nothing_left(a, b)
