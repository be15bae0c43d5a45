"""Imports the user's modules named by model.plugin, so that they can register their
own models (models.register_model) and plans (parallel.plan.register_plan)."""

from __future__ import annotations

import importlib
import os
import sys

from common.errors import UserError


def load_plugins(names: str) -> None:
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # a user's module beside where they run
    for name in filter(None, (n.strip() for n in names.split(","))):
        if name.startswith("."):  # importlib would need a package to be relative to
            raise UserError(f"model.plugin {name!r} is a relative module name. Give a module path importable "
                            f"from the working directory, e.g. my_project.my_plan.")
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise UserError(f"model.plugin {name!r} cannot be imported ({err}). Give a module path "
                            f"importable from the working directory, e.g. my_project.my_plan.") from None
