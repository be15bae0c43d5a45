"""A deliberately wrong plan for the parity tests: the Llama plan with sequence parallel,
except that attention_norm was left out of the sequence-parallel styles.

Nothing crashes: RMSNorm works token by token, so on its slice of the sequence it
computes the right output. But its weight is then a plain parameter on each tp rank,
and its gradient sums only that rank's tokens; the all-reduce over tp that
SequenceParallel would have added is missing. Only the weight gradient of every
layers.*.attention_norm is wrong, which is what `--parity` must find.

Load it with: --set model.plugin=tests.planted_bug_plan --set parallel.plan=llama_sp_missing_norm
"""

import dataclasses

from parallel.llama_plan import LLAMA
from parallel.plan import register_plan

register_plan(dataclasses.replace(
    LLAMA, name="llama_sp_missing_norm",
    sequence_parallel={path: style for path, style in LLAMA.sequence_parallel.items()
                       if path != "layers.*.attention_norm"}))
