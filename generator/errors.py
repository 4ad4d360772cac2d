"""Exceptions for user-facing failures; the CLI prints them as one line, no traceback."""


class GeneratorError(Exception):
    """Base class: a problem the user can fix (bad spec, bad filter, missing tool)."""


class SpecError(GeneratorError):
    """The YAML spec is invalid, or its dispatch section does not resolve."""


class FilterError(GeneratorError):
    """An --only/--exclude glob matched nothing, or filtering left nothing to build."""


class ToolchainError(GeneratorError):
    """nvcc, ninja or the CUTLASS headers could not be found or run."""


class BuildError(GeneratorError):
    """ninja (a compile or the link) failed."""
