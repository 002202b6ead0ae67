"""The error type of the `trl-lopti` command line."""


class CliError(ValueError):
    """A user error on the command line or in a config file: `trl-lopti` prints it, without a traceback, and exits 2."""
