"""Errors a user can act on. The CLI prints them as one clear message, without a traceback."""


class HeadstartError(Exception):
    """Base class: the message says what was wrong, where (file, row, key) and what to do."""


class ConfigError(HeadstartError):
    """A recipe or a command-line override is invalid."""


class AssetError(HeadstartError):
    """An embedded default or a local model/data path cannot be resolved."""


class DataError(HeadstartError):
    """Input data is unreadable, or yields nothing to train on."""


class OutputError(HeadstartError):
    """An output path cannot be written, or would replace something the writer did not create."""
