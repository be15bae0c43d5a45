"""A planted bug of pipeline and context parallelism together, for tests/test_pipeline.py:
the Llama plan whose pipeline stages run each block without the positions that context
parallelism gives them, so every cp rank rotates its chunks as if they began the
sequence. Nothing crashes, and without pp (the plan's stage functions unused) or without
cp (the positions are 0, 1, ... anyway) nothing is wrong: `--parity` at pp x cp must FAIL
and the localizer must name a module of the first stage.

Load it with:  --set model.plugin=tests.planted_pp_cp_bug --set parallel.plan=llama_stages_position_blind
"""

import dataclasses

from parallel.llama_plan import LLAMA, rope_block
from parallel.plan import register_plan


def block_without_positions(model, block, h, positions):
    return rope_block(model, block, h, None)


register_plan(dataclasses.replace(LLAMA, name="llama_stages_position_blind",
                                  stages=dataclasses.replace(LLAMA.stages, block=block_without_positions)))
