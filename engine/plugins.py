"""Imports the user's modules named by model.plugin, so that they can register their
own models (models.register_model) and plans (parallel.plan.register_plan), and registers
the flavor of a Hugging Face checkpoint being imported: what a process must do before it
builds the configured model (the launcher, and each --plan-for search worker)."""

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
        if not all(part.isidentifier() for part in name.split(".")):  # a file path, say: import hooks differ
            raise UserError(f"model.plugin {name!r} is not a module name (Python names joined by dots, not a "
                            f"file path). Give a module path importable from the working directory, "
                            f"e.g. my_project.my_plan.")
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise UserError(f"model.plugin {name!r} cannot be imported ({err}). Give a module path "
                            f"importable from the working directory, e.g. my_project.my_plan.") from None


def register_model_sources(cfg) -> None:
    """What the model and plan names may refer to: the built-in plans, the plugins, and
    the flavor of an HF checkpoint being imported (its config.json's shapes)."""
    import parallel  # noqa: F401  (registers the built-in plans)
    load_plugins(cfg.model.plugin)
    hf_import = cfg.checkpoint.hf_import
    if hf_import:
        from engine.checkpoint.hf import register_hf_flavor
        if cfg.checkpoint.init_from:
            raise UserError(f"checkpoint.hf_import and checkpoint.init_from both give the starting "
                            f"weights ({hf_import!r}, {cfg.checkpoint.init_from!r}). Keep one.")
        cfg.model.flavor = register_hf_flavor(cfg.model.name, hf_import)
