"""The errors pyhet raises on bad input. The CLI prints their message and exits with status 1."""


class PyhetError(Exception):
    """Base of every error that is the user's input, not a bug: the message says it all."""


class DataError(PyhetError):
    """A dataset file is missing, truncated or not in the format its name promises."""


class DeviceError(PyhetError):
    """A device SPEC that cannot be parsed, or a device that is missing or failed."""


class WeightsError(PyhetError):
    """A weight file whose arrays do not match the network."""


class TrainingError(PyhetError):
    """Training cannot go on (a NaN or infinite loss, say)."""
