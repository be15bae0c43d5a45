"""The exception types that end a run with a message instead of a traceback.

Anything raised as a `UserError` is printed as a single paragraph and the
process exits with code 2; a `NonFiniteLoss` likewise, with code 3; everything
else is a bug and keeps its traceback.
"""

EXIT_OK = 0
EXIT_FAILED = 1  # a parity FAIL, or a crash
EXIT_USER_ERROR = 2
EXIT_NONFINITE_LOSS = 3
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports it (128 + SIGINT)


class UserError(Exception):
    """Bad input from the user: a mesh string, a config key, a plan, a path."""


class NonFiniteLoss(Exception):
    """The loss became NaN or inf and the config does not ask to skip such steps."""


def raise_if_any_rank(problem: str | None, group, error: type[UserError] = UserError) -> None:
    """A collective: every rank of `group` passes its own problem (None when it has none)
    and, when any rank has one, every rank raises `error` with the lowest rank's. For bad
    input that only some ranks can see: one rank stopping alone would leave the others
    waiting in their next collective."""
    import torch
    import torch.distributed as dist

    found = torch.tensor([problem is not None], dtype=torch.int32)
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    if found.item():
        problems = [None] * dist.get_world_size(group)
        dist.all_gather_object(problems, problem, group=group)
        raise error(next(p for p in problems if p is not None))

