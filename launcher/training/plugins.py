"""Plug-in hooks from outside the package: LOOMTRAIN_PLUGIN names what to load.

    LOOMTRAIN_PLUGIN=/path/to/my_plugin.py loomtrain train ...     # a file
    LOOMTRAIN_PLUGIN=my_package.my_plugin loomtrain train ...      # or an importable module

The module's `hooks(cfg) -> list[Hooks]` (loomtrain.launcher.hooks) is called once when a
run starts (`run_training`); its hooks run after the checkpoint hook and before a launcher's
own (Ray's report hook), on every rank. A file is imported as the module named after it, as
`import NAME` would with its folder on sys.path, so a process that imported it already (a
test) shares that module. A plugin's own settings go in variables named LOOMTRAIN_PLUGIN_*:
a Ray driver hands those and LOOMTRAIN_PLUGIN to its workers, whose environment is not its
own. The test suite's fault injection is such a plugin (tests/fault_plugin.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from loomtrain.launcher.config_loader import ConfigError

if TYPE_CHECKING:
    from loomtrain.launcher.config import RunConfig
    from loomtrain.launcher.hooks import Hooks

ENV = "LOOMTRAIN_PLUGIN"


def hooks(cfg: RunConfig) -> list[Hooks]:
    """The hooks of the plugin LOOMTRAIN_PLUGIN names (none when it is unset)."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return []
    module = load(value)
    make = getattr(module, "hooks", None)
    if not callable(make):
        raise ConfigError(f"{ENV}={value}: {module.__name__} has no hooks(cfg) function")
    return list(make(cfg))


def load(value: str) -> ModuleType:
    """The module `value` names: a .py file, or an importable module's dotted name."""
    if not value.endswith(".py"):
        try:
            return importlib.import_module(value)
        except ModuleNotFoundError as exc:
            if exc.name is None or not (value == exc.name or value.startswith(exc.name + ".")):
                raise  # a module the plugin itself imports
            raise ConfigError(f"{ENV}={value}: no such file or module (give a .py file or a module name)") from None
    path = Path(value).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"{ENV}={value}: no such file")
    name = path.stem
    known = sys.modules.get(name)
    if known is not None:
        if getattr(known, "__file__", None) and Path(known.__file__).resolve() == path:
            return known
        raise ConfigError(
            f"{ENV}={value}: a module named {name} is already imported (from {known.__file__}); rename the file"
        )
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def forwarded_env() -> dict[str, str]:
    """LOOMTRAIN_PLUGIN and LOOMTRAIN_PLUGIN_* as this process has them (a Ray driver's, for its workers)."""
    return {k: v for k, v in os.environ.items() if k == ENV or k.startswith(ENV + "_")}


def adopt_env(forwarded: dict[str, str]) -> None:
    """Set what a driver forwarded, and drop any plugin variable it did not (a Ray worker, before the run)."""
    for k in [k for k in os.environ if (k == ENV or k.startswith(ENV + "_")) and k not in forwarded]:
        del os.environ[k]
    os.environ.update(forwarded)
