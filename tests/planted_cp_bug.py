"""A planted context-parallel bug for the parity tests: a GPT-2 whose forward takes
`positions` and drops them, so that each cp rank adds the learned positions of 0, 1, ...
to its two chunks instead of their own. It runs without error; --parity must FAIL and
the localizer must name the position embedding (tests/test_parity.py).

Load it with:  --set model.plugin=tests.planted_cp_bug --set model.name=gpt2_position_blind --set parallel.plan=gpt2
"""

import examples.gpt2_plan  # noqa: F401  (registers the plan)
from models import register_model
from models.gpt2 import FLAVORS, GPT2


class PositionBlindGPT2(GPT2):
    def forward(self, tokens, positions=None):
        return super().forward(tokens)


register_model("gpt2_position_blind", PositionBlindGPT2, FLAVORS)
