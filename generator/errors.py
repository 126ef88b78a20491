"""Errors that are the user's to fix: the CLI prints them as one message and exits with status 2,
without a traceback. Anything else escaping the generator is a bug in it."""

from __future__ import annotations


class GeneratorError(Exception):
    """A bad request: a command-line option, or a configuration that cannot be built."""

    def __init__(self, message: str, where: str = "generator", details: str = "") -> None:
        super().__init__(message)
        self.message = message  # one line
        self.where = where  # what the message is prefixed with: an option, or file:line
        self.details = details  # further lines, e.g. the valid choices when they are many

    def __str__(self) -> str:
        return f"{self.where}: {self.message}" + (f"\n{self.details}" if self.details else "")


class ConfigError(GeneratorError):
    """A mistake at one line of the configuration file, reported compiler-style as file:line."""

    def __init__(self, file: str, line: int, message: str, details: str = "") -> None:
        super().__init__(message, where=f"{file}:{line}", details=details)
        self.file = file
        self.line = line
