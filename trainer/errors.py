"""The trainer's errors, on the ground floor: any module may raise or catch them without importing
the module that usually raises them. Each message is one line naming the input and what was expected
(ModelTooLargeError: the memory report), and the command line reports them without a traceback.
"""


class TrainingError(RuntimeError):
    """The run cannot proceed; the message says why and what to do. Reported without a traceback."""


class NonFiniteLossError(TrainingError):
    """A loss or gradient norm was not finite (:meth:`NonFiniteWatch.check`)."""


class ConfigError(ValueError):
    """A bad configuration: unknown key, wrong type or invalid value. The message is one line."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded or saved as asked (missing step, other layout, damaged, failed save); one line."""


class SaveError(RuntimeError):
    """A checkpoint could not be written (disk full, not writable); one line; its .partial is removed."""


class ManifestError(RuntimeError):
    """A checkpoint file does not match its manifest (or the manifest cannot be read); one line."""


class UnverifiedCheckpoint(ManifestError):
    """The step folder has no manifest.json (written before manifests existed, or the file was lost)."""


class HFCheckpointError(ValueError):
    """A folder is not a usable Hugging Face checkpoint of one of our families; the message is one line."""


class RunFolderError(RuntimeError):
    """The dump folder cannot be used (not a folder, read-only, locked by another run); one line."""


class PlotError(ValueError):
    """A folder without metrics, or a metrics file that cannot be read; the message names it."""


class ModelTooLargeError(TrainingError):
    """The flavor does not fit this machine's memory; the message is the memory report (several lines)."""
