"""Errors a user can fix. The CLI prints them as one line and exits with code 2."""


class UserError(Exception):
    """Bad input from the user: a config, a data file, a command-line argument.

    The message says what was wrong, where, and what was expected.
    """

    exit_code = 2
