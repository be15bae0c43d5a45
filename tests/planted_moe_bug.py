"""A planted mixture-of-experts bug for the parity tests, the one the engine itself had
until the load-balancing work: materialising leaves the sigmoid router's bias buffer as
torch.empty left it, so every copy of the model (each rank's, the reference's) routes by
its own garbage. It runs without error; --parity must FAIL and the localizer must name a
router (tests/test_parity.py).

Here the "garbage" favours one expert per router, a different one in each model built
in the process (the mesh's, then the reference's), so the bug shows whatever the
allocator leaves behind.

Load it with:  --set model.plugin=tests.planted_moe_bug --set model.name=llama_moe_unset_bias
               --set model.flavor=debug-moe-sigmoid --set parallel.plan=llama_moe
"""

from itertools import count

from models import register_model
from models.moe import FLAVORS, MoELlama, Router


BUILT = count()


class UnsetBiasMoE(MoELlama):
    def reset_buffers(self) -> None:
        super().reset_buffers()
        favoured = next(BUILT)
        for module in self.modules():
            if isinstance(module, Router):
                module.expert_bias.zero_()
                module.expert_bias[favoured % len(module.expert_bias)] = 1.0


register_model("llama_moe_unset_bias", UnsetBiasMoE, FLAVORS)
