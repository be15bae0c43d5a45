"""The exception types that end a run with a message instead of a traceback.

Anything raised as a `UserError` is printed as a single paragraph and the
process exits with code 2; a `NonFiniteLoss` likewise, with code 3; everything
else is a bug and keeps its traceback.
"""

EXIT_OK = 0
EXIT_FAILED = 1  # a parity FAIL, or a crash
EXIT_USER_ERROR = 2
EXIT_NONFINITE_LOSS = 3


class UserError(Exception):
    """Bad input from the user: a mesh string, a config key, a plan, a path."""


class NonFiniteLoss(Exception):
    """The loss became NaN or inf and the config does not ask to skip such steps."""
