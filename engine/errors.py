"""The one exception type that means "the user asked for something we cannot do".

Anything raised as a `UserError` is printed as a single paragraph and the
process exits with code 2; everything else is a bug and keeps its traceback.
"""

EXIT_USER_ERROR = 2


class UserError(Exception):
    """Bad input from the user: a mesh string, a config key, a plan, a path."""
