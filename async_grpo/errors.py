"""Errors a user can fix. The CLI prints them as one line and exits with code 2."""


class UserError(Exception):
    """Bad input from the user: a config, a data file, a command-line argument.

    The message says what was wrong, where, and what was expected.
    """

    exit_code = 2


class MachineError(UserError):
    """Something this machine refused before any work began (a Ray head that would not
    start): one line as well, exit code 1 (not the user's input, but theirs to fix)."""

    exit_code = 1


# `async-grpo run` gives its torchrun ranks a file to write a user error's exit code to:
# torchrun exits 1 whatever its ranks' codes were
EXIT_FILE_ENV = "ASYNC_GRPO_EXIT_FILE"
