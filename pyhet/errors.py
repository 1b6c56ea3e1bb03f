"""The errors pyhet raises on bad input. The CLI prints their message and exits with the
error's ``exit_status``: 2 for a usage error (a bad option value), 1 for the rest."""


class PyhetError(Exception):
    """Base of every error that is the user's input, not a bug: the message says it all."""

    exit_status = 1


class ArchitectureError(PyhetError, ValueError):
    """A network description that cannot be parsed, or whose shapes cannot work (a map that
    shrinks below 1x1, a kernel larger than its padded input). The command line reports a
    description that cannot be parsed as a usage error (exit status 2)."""


class DataError(PyhetError):
    """A dataset file is missing, truncated or not in the format its name promises."""


class DeviceError(PyhetError):
    """A device SPEC that cannot be parsed, or a device that is missing or failed."""


class NoDeviceLeftError(DeviceError):
    """Every device of a run failed (pyhet.failover); the network keeps the state it had
    before the step that failed."""


class WeightsError(PyhetError):
    """A weight file whose arrays do not match the network."""


class TrainingError(PyhetError):
    """Training cannot go on (a NaN or infinite loss, say)."""
