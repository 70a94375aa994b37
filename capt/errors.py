"""The one exception type capt raises for bad input: its message is meant for a person."""


class CaptError(Exception):
    """A problem with the user's input (files, configs, data, options), stated in one line."""
