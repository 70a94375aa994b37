"""The one exception type capt raises for bad input: its message is meant for a person."""


class CaptError(Exception):
    """A problem with the user's input (files, configs, data, options), stated in one line."""


class CaptWarning(UserWarning):
    """Something the user asked for on purpose but should know about (say, capsules used on another base
    model with any_base), stated in one line; the CLI prints it as `capt: warning: ...`."""
