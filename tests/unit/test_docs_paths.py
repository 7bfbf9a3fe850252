"""Docstrings and comments name only files that exist, and none cites an issue number.

Every path-like name in the docstrings and comments of the project's .py files (and the
comments of its shell scripts and image recipe)
(`launcher/training/engine.py`, `tests/distributed/test_zero.py`, `store.py`, `launcher/checkpoints/`,
`loomtrain.launcher.planning.memory_model`) must resolve in this checkout:
- a path whose first part is a top-level entry of the repository resolves from the root
  (a leading `loomtrain/` is the root itself);
- another path with a folder resolves as the tail of some file's path (`checkpoints/store.py`);
- a bare file name resolves when some file in the tree has that name;
- a dotted `loomtrain` name resolves to a module of the tree, and the first name after the
  module must be defined, imported or listed in `__all__` at that module's top level.
The READMEs (README.md, benchmarks/README.md) and the guides (docs/*.md) are held to the paths
that start at a top-level entry of the repository and to the dotted names: their worked examples
create files of their own (a mixture config, a corpus folder). Every guide is linked from the
README's guide map, and CI's script (.ci/run) runs the README's test command as the README
writes it, read from the README.
Placeholders (`RUN_DIR/final/`, `runs/NAME/config.yaml`), paths under `runs/` (training output),
paths that climb out of the checkout (`../shared/...`) and one-part folders (`final/`, `tb/`:
run-directory layout, not the repository's) are not names of this tree. What remains and is
still not a file here is in ALLOWED, each with its reason.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from functools import cache
from pathlib import Path

from source_tree import ROOT, entries, parse, python_files, source

# Names in docs that are deliberately not files of this checkout.
ALLOWED = {
    "config.yaml": "the copy of the run's config that training writes into its run directory",
    "other.yaml": "the example name in config_loader's description of `extends:`",
    "credentials.py": "the example of a user's secrets file that `submit` refuses to package",
}

SUFFIXES = ("py", "sh", "md", "toml", "yaml", "yml")
_PART = r"[\w.*-]+"
PATH_RE = re.compile(
    rf"(?<![\w./$~:*-])("
    rf"(?:{_PART}/)*{_PART}\.(?:{'|'.join(SUFFIXES)})"  # a file with a source-like suffix
    rf"|(?:{_PART}/)+Dockerfile"  # the image recipe
    rf"|(?:{_PART}/)+"  # a folder
    rf")(?![\w/-])"
)
MODULE_RE = re.compile(r"(?<![\w.])loomtrain(?:\.\w+)+")
# A folder part written as a placeholder: RUN_DIR, OUTPUT.partial, superseded-TIME, NAME.
PLACEHOLDER_RE = re.compile(r"(?:^|[-_.])[A-Z][A-Z0-9]+(?:_[A-Z0-9]+)*(?:$|[-_.])")
# "issue N" narrates this project's history; an upstream reference ("Ray issues #48801") says why.
ISSUE_RE = re.compile(r"\bissues? \d+\b", re.IGNORECASE)


@cache
def tree() -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    """-> (relative file paths, relative folder paths, file names) of the checkout."""
    files, dirs = set(), set()
    for p in entries():
        (dirs if p.is_dir() else files).add(p.relative_to(ROOT).as_posix())
    return frozenset(files), frozenset(dirs), frozenset(f.rsplit("/", 1)[-1] for f in files)


def doc_texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring and comment in a Python file."""
    src = source(path)
    out = []
    for node in ast.walk(parse(path)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((node.body[0].lineno, doc))
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    return out


READMES = ("README.md", "benchmarks/README.md", *sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("docs/*.md")))


def scripts() -> list[Path]:
    """The shell scripts, CI's script and the image recipe."""
    return [p for p in entries() if p.suffix == ".sh" or p.name == "Dockerfile"] + [ROOT / ".ci" / "run"]


@cache
def all_doc_texts() -> list[tuple[str, int, str]]:
    """(file, line, text) for the project's docstrings and comments, the comments of its
    scripts, and the READMEs whole."""
    out = [(p.relative_to(ROOT).as_posix(), line, text) for p in python_files() for line, text in doc_texts(p)]
    for path in scripts():
        lines = path.read_text().splitlines()
        name = path.relative_to(ROOT).as_posix()
        out += [(name, i, line) for i, line in enumerate(lines, 1) if line.lstrip().startswith("#")]
    out += [(name, 1, (ROOT / name).read_text()) for name in READMES]
    return out


def _matches(pattern: str, names, tail: bool = False) -> bool:
    """Some name equals `pattern` (`*` stands for part of one path part), or with `tail`
    ends with `/pattern`."""
    rx = re.compile(("(?:.*/)?" if tail else "") + re.escape(pattern).replace(r"\*", "[^/]*") + "$")
    return any(rx.match(n) for n in names)


def path_exists(name: str) -> bool:
    files, dirs, basenames = tree()
    is_dir = name.endswith("/")
    parts = name.rstrip("/").split("/")
    if parts[0] == "loomtrain":
        parts = parts[1:]
    if not parts:
        return True
    rel = "/".join(parts)
    if len(parts) == 1 and not is_dir:
        return _matches(rel, basenames)
    names = dirs if is_dir else files
    return _matches(rel, names, tail=parts[0] not in top_level())


def top_level() -> set[str]:
    files, dirs, _ = tree()
    return {n.split("/")[0] for n in files | dirs} | {"loomtrain"}


@cache
def _top_level_names(module_file: Path) -> frozenset[str]:
    names, values = set(), {}
    for node in parse(module_file).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
                if isinstance(target, ast.Name):
                    values[target.id] = node.value
                if isinstance(target, ast.Name) and target.id == "__all__" and node.value is not None:
                    # the names a package exports lazily (PEP 562 __getattr__), also as `*_EXPORTS`
                    for sub in ast.walk(node.value):
                        if isinstance(sub, ast.Starred) and isinstance(sub.value, ast.Name):
                            sub = values.get(sub.value.id)
                        for c in ast.walk(sub) if sub is not None else ():
                            if isinstance(c, ast.Constant) and isinstance(c.value, str):
                                names.add(c.value)
    return frozenset(names)


def module_exists(dotted: str) -> bool:
    """A dotted loomtrain name resolves to a module or package of the tree; a following name
    must be defined or imported at the top of that module (a package: its __init__)."""
    here = ROOT
    parts = dotted.split(".")[1:]
    for i, part in enumerate(parts):
        if (here / part / "__init__.py").is_file():
            here = here / part
            continue
        if (here / f"{part}.py").is_file():
            module, rest = here / f"{part}.py", parts[i + 1 :]
        else:
            module, rest = here / "__init__.py", parts[i:]
        return not rest or rest[0] in _top_level_names(module)
    return True


def stale_names(text: str, rooted_only: bool = False) -> list[str]:
    """The path-like and loomtrain.* names in `text` that do not resolve here; with
    `rooted_only`, only the paths that start at a top-level entry of the repository."""
    out = []
    for m in PATH_RE.finditer(text):
        name = m.group(1)
        parts = name.rstrip("/").split("/")
        folders = parts if name.endswith("/") else parts[:-1]
        if name in ALLOWED or any(PLACEHOLDER_RE.search(p) or set(p) == {"."} for p in folders):
            continue
        if parts[0] == "runs" or (name.endswith("/") and len(parts) < 2):
            continue  # training output, or a one-part folder (final/, tb/, logs/) of a run directory
        if rooted_only and (len(parts) < 2 or parts[0] not in top_level()):
            continue
        if not path_exists(name):
            out.append(name)
    out += [m.group(0) for m in MODULE_RE.finditer(text) if not module_exists(m.group(0))]
    return out


def test_every_path_named_in_docstrings_and_comments_exists():
    stale = [
        f"{f}:{line}: {name}"
        for f, line, text in all_doc_texts()
        for name in stale_names(text, rooted_only=f in READMES)
    ]
    assert not stale, "docs name files or modules that do not exist:\n" + "\n".join(stale)


def test_no_docstring_or_comment_cites_an_issue_number():
    cited = [
        f"{f}:{line}: {m.group(0)}"
        for f, line, text in all_doc_texts()
        if f not in READMES
        for m in ISSUE_RE.finditer(text)
    ]
    assert not cited, "a comment says why, not which issue asked for it:\n" + "\n".join(cited)


def test_the_checker_sees_real_names_and_catches_stale_ones():
    """The regexes find the names the tree's docs use, and flag names that are gone."""
    found = [m.group(1) for _, _, text in all_doc_texts() for m in PATH_RE.finditer(text)]
    assert {"launcher/training/engine.py", "k8s/check.py"} <= set(found), found[:20]
    text = (
        "see `checkpoint_store.py`, tests/test_zero_nonfinite.py and launcher/nowhere/; "
        "loomtrain.launcher.planning.nonexistent and loomtrain.data_pipeline.no_such_name; "
        "fine: launcher/training/engine.py, checkpoints/shards.py, launcher/checkpoints/, tests/*/test_k8s_*.py, "
        "RUN_DIR/final/model.safetensors, ../shared/x/, runs/tiny/config.yaml, loomtrain.launcher.config.RunConfig, "
        "loomtrain.data_pipeline.load_tokenizer, loomtrain.parallel.Topology"
    )
    assert stale_names(text) == [
        "checkpoint_store.py",
        "tests/test_zero_nonfinite.py",
        "launcher/nowhere/",
        "loomtrain.launcher.planning.nonexistent",
        "loomtrain.data_pipeline.no_such_name",
    ]
    assert stale_names("mix.yaml, corpus/docs/, launcher/gone.py", rooted_only=True) == ["launcher/gone.py"]
    assert ISSUE_RE.search("(session-scoped Ray head, issue 8)")
    assert not ISSUE_RE.search("an issue with 8 ranks") and not ISSUE_RE.search("(Ray issues #48801)")


def test_every_guide_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    pages = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("docs/*.md"))
    assert pages, "docs/ holds the guides"
    unlinked = [p for p in pages if f"]({p})" not in readme]
    assert not unlinked, f"README.md links no guide page {unlinked}: add a line to its guide map"


CI_MARKER = "<!-- ci: the test command -->"


def test_ci_runs_the_readmes_test_command_as_written():
    """.ci/run reads the bash block after the README's marker and runs it step by step (`&&`): the
    set-up steps first, the pytest step last; it retypes none of them."""
    readme = (ROOT / "README.md").read_text()
    assert readme.count(CI_MARKER) == 1
    block = re.search(re.escape(CI_MARKER) + r"\n```bash\n(.*?)\n```", readme, re.S)
    assert block, f"README.md: a bash block right after {CI_MARKER}"
    steps = [step.strip() for step in block.group(1).strip().split(" && ")]
    assert steps[0] == "python3 -m venv .venv" and steps[-1].startswith("python -m pytest ")
    assert any(step.startswith("pip install -e '.[dev]'") for step in steps), steps
    # the README's tiny-run command installs the same way, without the dev extra
    first = re.search(r"^```bash\n(.*?)\n```", readme, re.S | re.M).group(1).split(" && ")
    assert first[:3] == steps[:3] and first[3] == "pip install -e .", first
    ci = (ROOT / ".ci" / "run").read_text()
    assert CI_MARKER in ci and 'eval "$step"' in ci and 'eval "$TESTS"' in ci
    code = [line.strip() for line in ci.splitlines() if not line.lstrip().startswith("#")]
    retyped = [line for line in code if re.match(r"(uv )?pip install|python -m pytest|python3 -m venv", line)]
    assert not retyped, f".ci/run retypes the README's commands: {retyped}"
