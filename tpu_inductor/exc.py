"""Typed errors of tpu_inductor: each names the thing, shows the value and says what to do."""

from __future__ import annotations


class TpuInductorError(Exception):
    """Base class of every error tpu_inductor raises on purpose."""


class OptionError(TpuInductorError, ValueError):
    """An unknown option key or a bad option value."""


class UnsupportedOpError(TpuInductorError):
    """A graph holds ATen ops with no lowering rule and the fallback policy is "error"."""


class LoweringError(TpuInductorError):
    """A lowering rule failed or produced a result that disagrees with the FX node's metadata."""


class SymbolicSizeError(LoweringError):
    """A graph with a symbolic size reached lowering, which takes concrete sizes only."""


class FrontendUnavailableError(TpuInductorError, ImportError):
    """An optional lowering frontend (torch-mlir) was asked for but is not installed."""


class RegistrationError(TpuInductorError):
    """A lowering rule was registered twice, or for something that is not an ATen op."""


class CompileError(TpuInductorError):
    """PJRT failed to compile a lowered module."""


class UnexpectedCompileError(TpuInductorError):
    """A compile was asked for inside `tpu_inductor.no_compiles()`: a size not warmed up."""


class DeviceError(TpuInductorError):
    """The requested PJRT platform or device is not available."""


class InputMismatchError(TpuInductorError, ValueError):
    """A compiled callable was given inputs that do not match what it was compiled for."""


class CacheError(TpuInductorError):
    """The compile cache cannot be used (e.g. an unsafe cache directory)."""


class ArtifactError(TpuInductorError):
    """An AOT artifact is damaged or was built for another version or platform."""


class BenchError(TpuInductorError, ValueError):
    """A benchmark model that cannot be found or built (a bad name or factory)."""


class CheckpointError(TpuInductorError, ValueError):
    """A checkpoint that cannot be saved to or loaded into what was given: not a checkpoint, a
    tensor name one side lacks, a shape or dtype that differs."""


class PlanDoesNotFitError(TpuInductorError):
    """A sharding plan whose per-device bytes exceed the memory stated for the target, refused
    before anything is compiled for it; `figures` holds the bytes by kind (tune/search.py)."""

    def __init__(self, message: str, figures: dict | None = None):
        super().__init__(message)
        self.figures = figures or {}
