"""The exceptions megatron-ucp raises.

Every message names the file or key at fault and what was expected, so that a user can act on
it without reading our code. In a distributed job the same error is raised on every rank.
"""


class UCPError(Exception):
    """Base class of every error megatron-ucp raises on purpose."""


class FormatError(UCPError):
    """A checkpoint file is not in the format we expect (bad manifest, bad header, bad version)."""


class IntegrityError(UCPError):
    """A checkpoint's bytes do not match their recorded checksums or sizes."""


class IncompleteCheckpointError(UCPError):
    """A checkpoint lacks a file or tensor that it should hold."""


class LayoutError(UCPError):
    """A parallel layout cannot hold the model, or a checkpoint does not fit the model."""


class ConfigError(UCPError):
    """A bad combination of command-line arguments or configuration values."""


class SaveError(UCPError):
    """A save failed (disk full, I/O error, another job owns the folder); nothing was committed."""
