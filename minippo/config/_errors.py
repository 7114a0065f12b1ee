"""The one exception type of the config system."""

from __future__ import annotations


class ConfigError(ValueError):
    """A problem with a config: the message names the key path, the value and the fix.

    ``problems`` holds one line per problem when several were collected (``minippo validate``).
    """

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems if problems is not None else [message]
