"""The README and its guides run in order: every command of their `bash` blocks, top to bottom,
the README first, then each page of docs/ in the order the README's guide map links them, in a
fresh copy.

A copy of the project (tests/integration/test_lone_clone.py's) stands for a user's fresh clone. What a guide
asks the user to bring is made first, where its commands look for it: a Hugging Face model
directory (tests/hf_fixtures.py's tiny Llama); the own-data guide makes its example corpus with a
command of its own. The mixture config the guide shows as a `yaml` block is written where it
says. Then each command runs as written, in the copy, one after the other, with overrides
appended that only shrink it (fewer steps, a toy model for `dryrun` on a CPU), and must exit 0:
so the examples cannot collide (a later run finding an earlier one's checkpoint) and cannot rot.

Commands that need what a CPU test cannot have (a Ray or Kubernetes cluster, several hosts,
a GPU) are skipped by the rules in CLUSTER and GPU_ONLY; a command that matches no rule and
is neither `loomtrain ...` nor a module of the package run as a program (`python -m
loomtrain.data_pipeline.instructions ...`) fails the test, so a new block is either run here or
skipped on purpose. The Ray guide's own head (`ray start ... &` and what talks to it) is skipped as
a cluster: tests/distributed/test_ray_jobs.py runs submit, status, logs and stop against such a head. The
object-storage guide's set-up runs too: its local S3 server (`python -m moto.server ... -p PORT
&`, started here on a free port that stands for PORT in what follows), its `export`s (the
environment of the commands after them) and its one `python -c` (the bucket).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from launch import child_env
from source_tree import ROOT
from test_plan_dryrun import SHRINK as GPT1B_AT_TOY_SIZE  # gpt-1b's layout at toy size

pytestmark = pytest.mark.slow

# Appended to each `loomtrain VERB ...` (a later key=value wins): fewer steps, less data.
SHRINK = {
    # 150 files: the embedded corpus's validation split (1%) holds at least one document
    "train": ["train.max_steps=4", "data.max_files=150", "eval.num_samples=0", "log.progress=plain"],
    "dryrun": GPT1B_AT_TOY_SIZE,
}
# A command needing a cluster, several hosts or a placeholder filled in by the user.
CLUSTER = re.compile(
    r"\bHEAD\b|JOB_ID|/mnt/|10\.0\.0\.|^kubectl |^ray start |^export RAY_|--ray\b|--nnodes"
    r"|\bRAY_HEAD_PID\b|^loomtrain (submit|status|logs|stop) "
)
# The pages whose commands the test lists below; a page added to the guide map runs as well.
KNOWN = {
    "README.md",
    "docs/install.md",
    "docs/monitoring.md",
    "docs/checkpoints.md",
    "docs/planning.md",
    "docs/data.md",
    "docs/fine-tuning.md",
    "docs/kubernetes.md",
    "docs/object-storage.md",
    "docs/ray.md",
    "docs/multi-host.md",
}
# The README's full-size dryrun: one rank of gpt-1b on a GPU.
GPU_ONLY = "needs ~24 GiB of GPU memory"
# The set-up commands: the environment this test already runs in; their `loomtrain` part runs.
SETUP = re.compile(r"^(python3 -m venv |pip install |uv pip install )")


def guide_pages() -> list[str]:
    """The README, then each docs/ page in the order of the README's guide map (its "## Guides"
    section), then any other page it links (the installation notes)."""
    readme = (ROOT / "README.md").read_text()
    link = r"\]\((docs/[\w.-]+\.md)\)"
    guides = re.findall(link, readme[readme.index("\n## Guides\n") :])
    return ["README.md", *dict.fromkeys(guides + re.findall(link, readme))]


def readme_commands() -> list[tuple[str, str]]:
    """(page, command) for each command of the `bash` blocks of the README and its guides in
    order: continuation lines joined, comment lines dropped, `a && b` split (the set-up lines'
    `loomtrain ...` part runs too)."""
    return [(page, command) for page in guide_pages() for command in page_commands((ROOT / page).read_text())]


def page_commands(text: str) -> list[str]:
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        joined = re.sub(r"\\\n\s*", "", block)
        for line in joined.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                commands += [part.strip() for part in line.split(" && ")]
    return commands


def mixture_config() -> tuple[str, str]:
    """(file name, text) of the guides' `yaml` block that starts `# NAME, in the repository root`."""
    text = "\n".join((ROOT / page).read_text() for page in guide_pages())
    for block in re.findall(r"^```yaml\n(.*?)^```", text, re.S | re.M):
        named = re.match(r"# (\S+\.yaml), in the repository root", block)
        if named:
            return named.group(1), block
    raise AssertionError("the guides: no yaml block named '# NAME.yaml, in the repository root'")


def what_to_do(command: str) -> tuple[str, list[str] | None]:
    """('run', argv after `loomtrain`), ('module', argv after `python -m`), ('s3-server', its
    argv), ('export', its NAME=VALUE words), ('python', its argv), ('skip', None) or ('setup', None)."""
    if SETUP.match(command) or command.startswith(". .venv/"):
        return "setup", None
    if command.startswith("python -m moto.server ") and command.endswith("&"):
        return "s3-server", shlex.split(command.rstrip("&"))[1:]
    if command.startswith("export AWS_"):
        return "export", shlex.split(command)[1:]
    if command.startswith("python -c "):
        return "python", shlex.split(command)[1:]
    if CLUSTER.search(command):
        return "skip", None
    words = shlex.split(command, comments=True)
    if GPU_ONLY in command:
        import torch

        if not torch.cuda.is_available():
            return "skip", None
    if words[:2] == ["python", "-m"] and words[2] == "pytest":
        return "setup", None  # the test suite itself
    if words[:2] == ["python", "-m"] and words[2].startswith("loomtrain."):
        return "module", words[2:]  # a module of the package run as a program (data_pipeline/instructions.py)
    assert words[0] == "loomtrain", f"README.md: {command!r} is neither run nor skipped by {__file__}"
    return "run", [*words[1:], *SHRINK.get(words[1], [])]


def the_users_own_inputs(clone: Path, bpe) -> None:
    """What a guide asks the user to bring: a Hugging Face model (the fine-tuning guide)."""
    from hf_fixtures import tiny_llama

    tiny_llama(clone / "hf" / "tiny-llama", bpe)


def test_every_readme_command_runs_in_order_in_a_fresh_copy(tmp_path, bpe):
    from test_lone_clone import make_lone_clone

    clone = make_lone_clone(tmp_path / "loomtrain")
    the_users_own_inputs(clone, bpe)
    name, text = mixture_config()
    (clone / name).write_text(text)
    env = child_env(PYTHONPATH=str(tmp_path))  # the copy's package first

    ran, skipped, servers, ports = [], [], [], {}
    try:
        for page, command in readme_commands():
            action, argv = what_to_do(command)
            if action == "s3-server":
                servers.append(_local_s3_server(argv, ports))
                continue
            if action == "export":
                env.update(_with_ports(word, ports).split("=", 1) for word in argv)
                continue
            if action not in ("run", "module", "python"):
                skipped += [command] if action == "skip" else []
                continue
            head = {"module": [sys.executable, "-m"], "python": [sys.executable]}.get(
                action, [sys.executable, "-m", "loomtrain"]
            )
            proc = subprocess.run([*head, *argv], cwd=clone, env=env, capture_output=True, text=True, timeout=600)
            output = proc.stdout[-3000:] + proc.stderr[-3000:]
            assert proc.returncode == 0, f"{page}: command {command!r} (as {argv}):\n{output}"
            ran.append((page, argv[0] if action != "python" else "python"))
    finally:
        for server in servers:
            server.kill()
            server.wait()
    print(f"\nran {len(ran)} guide commands ({ran}); skipped {len(skipped)} that need a cluster or GPU")
    # The commands a user on one machine types are all here, in the guides' order (a page this
    # test does not know yet runs too, and its commands must succeed: KNOWN lists what it holds).
    assert [verb for page, verb in ran if page in KNOWN] == [
        "train",
        "loomtrain.data_pipeline.example_corpus",
        "preprocess",
        "preprocess",
        "data-stats",
        "train",
        "plan",
        "dryrun",
        "import",
        "generate",
        "train",
        "export",
        "loomtrain.data_pipeline.instructions",
        "preprocess",
        "train",
        "generate",
        "export",
        "python",  # the object-storage section: a bucket on the local server, then its run
        "preprocess",
        "train",
        "generate",
        "export",
    ], ran
    assert (clone / "runs" / "tiny" / "final").is_dir() and (clone / "runs" / "mix" / "final").is_dir()
    assert (clone / "hf" / "tiny-llama-ft" / "config.json").is_file()
    assert (clone / "hf" / "sft-tiny" / "config.json").is_file()  # the fine-tuned tiny model, exported
    assert not (clone / "s3:").exists() and not (clone / "runs" / "tiny-s3" / "checkpoints").exists()


def _local_s3_server(argv: list[str], ports: dict[str, str]) -> subprocess.Popen:
    """The README's `python -m moto.server -H HOST -p PORT &`, on a free port standing for PORT."""
    from s3_server import free_port

    readme_port = argv[argv.index("-p") + 1]
    ports[readme_port] = str(free_port())
    cmd = [sys.executable, *argv[:-1], ports[readme_port]]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    host = argv[argv.index("-H") + 1]
    import socket
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # ready when it accepts a connection
        with socket.socket() as s:
            if s.connect_ex((host, int(ports[readme_port]))) == 0:
                return server
        time.sleep(0.2)
    server.kill()
    raise AssertionError(f"the README's local S3 server ({cmd}) did not start within 60 s")


def _with_ports(word: str, ports: dict[str, str]) -> str:
    for readme_port, port in ports.items():
        word = word.replace(f":{readme_port}", f":{port}")
    return word
