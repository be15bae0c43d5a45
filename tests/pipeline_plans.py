"""Plans that are wrong about pipeline stages, for tests/test_pipeline.py: the Llama plan
without stages, and the GPT-2 plan whose stages leave the position embedding out.

Load them with: --set model.plugin=tests.pipeline_plans
"""

import dataclasses

import examples.gpt2_plan  # noqa: F401  (registers the gpt2 plan)
from parallel.llama_plan import LLAMA
from parallel.plan import Stages, get_plan, register_plan

register_plan(dataclasses.replace(LLAMA, name="llama_without_stages", stages=None))
register_plan(dataclasses.replace(get_plan("gpt2"), name="gpt2_without_positions",
                                  stages=Stages(first=("wte",), last=("ln_f", "lm_head"))))
