"""Errors a user can act on: each names the problem and the fix.

The CLI prints them as one line (no stack trace unless --debug)."""


class HeteroSDError(Exception):
    """Base class. `fix` says what the user should do about it."""

    def __init__(self, problem: str, fix: str):
        super().__init__(f"{problem} (fix: {fix})")
        self.problem = problem
        self.fix = fix


class ModelNotFoundError(HeteroSDError):
    pass


class WeightsError(HeteroSDError):
    """Missing, corrupt or incomplete safetensors."""


class ConfigError(HeteroSDError):
    """A config.json that is missing, unreadable or describes an unsupported model."""


class MismatchError(HeteroSDError):
    """The draft was not made for this target."""


class UnknownDeviceError(HeteroSDError):
    pass


class DeviceUnavailableError(HeteroSDError):
    pass


class PromptTooLongError(HeteroSDError):
    pass


class DeviceFailedError(HeteroSDError):
    """A device raised or returned non-finite values where no fallback can finish the job."""


class InvalidArgumentError(HeteroSDError, ValueError):
    """A value the caller passed is of the wrong type or out of range (checked before any model work)."""


class OutputPathError(HeteroSDError):
    """A file we were asked to write cannot be written (checked before the work that fills it)."""


class HomeError(HeteroSDError):
    """hetero-sd's home ($HETERO_SD_HOME or ~/.cache/hetero-sd) cannot be used."""


class RuntimeClosedError(HeteroSDError):
    """The Runtime was closed: its device threads are gone."""
