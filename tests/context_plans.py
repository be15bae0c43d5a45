"""A plan for examples/plain_model.py that names an attention core, for a model whose
forward takes no positions: context parallelism must refuse it before any process group
(tests/test_cli.py)."""

import dataclasses

import examples.plain_model  # noqa: F401  (registers the model and its plan)
from parallel.plan import get_plan, register_plan

register_plan(dataclasses.replace(get_plan("plain"), name="plain_attention", attention="blocks.*.attention"))
