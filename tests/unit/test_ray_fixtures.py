"""The private Ray head's client settings hold in a test process that imported Ray before the head
set them (tests/ray_fixtures.py): Ray reads RAY_AUTH_MODE and the token once, at ray._raylet's
import, and a module run earlier in the same xdist process may have imported it (CI, stop 50:
every Ray Jobs call of test_ray_jobs refused, "Missing authentication token"), or talked to an
earlier module's head, whose token it kept."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# In a fresh process: this one may have imported Ray already, in either mode.
SCRIPT = """
import os, sys
sys.path.insert(0, sys.argv[1])
for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
    os.environ.pop(k, None)
os.environ["HOME"] = sys.argv[2]  # no ~/.ray/auth_token of anyone's
from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, get_authentication_mode
assert get_authentication_mode() == AuthenticationMode.DISABLED
assert not AuthenticationTokenLoader.instance().has_token()
import ray_fixtures
for token in ("a" * 64, "b" * 64):  # one module's head, then the next one's
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    ray_fixtures._reload_ray_auth()
    assert get_authentication_mode() == AuthenticationMode.TOKEN, get_authentication_mode()
    assert AuthenticationTokenLoader.instance().get_raw_token() == token
"""


def test_client_settings_are_read_again_after_ray_was_imported_without_them(tmp_path):
    tests_dir = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tests_dir), str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
