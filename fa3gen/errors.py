"""Exceptions raised by the fa3gen runtime.

No torch or ctypes imports here: the CLI and the error tests import this module alone.
Every message says what went wrong and what to do about it.
"""

from __future__ import annotations

from collections.abc import Sequence

# Long variant lists (the ablation library has hundreds) are cut so messages stay readable.
_MAX_LISTED = 40


class Fa3genError(Exception):
    """Base class of every fa3gen error."""


class InvalidInputError(Fa3genError, ValueError):
    """The tensors passed to an fa3gen op break a documented requirement (shape, dtype, stride)."""


class TraceError(Fa3genError, ValueError):
    """A trace file (fa3gen.trace) that cannot be read or turned into a spec."""


class LibraryNotBuiltError(Fa3genError):
    """The generated shared library is not where the runtime looks for it."""

    def __init__(self, path, spec_name: str | None = None, spec_file: str | None = None):
        self.path = str(path)
        self.spec_name = spec_name
        build = build_command(spec_name, spec_file)
        super().__init__(
            f"fa3gen library not found: {self.path}\n"
            f"Build it with: {build}\n"
            "(or point FA3GEN_LIB at a built libfa3gen_<spec>.so, "
            "or FA3GEN_GENERATED at the generated/ root that holds it)"
        )


class AbiMismatchError(Fa3genError):
    """The library was built against another version of templates/kernels/fa3gen_abi.h."""

    def __init__(self, path, found, expected: int, spec_name: str | None = None):
        self.path, self.found, self.expected = str(path), found, expected
        super().__init__(
            f"fa3gen library {self.path} has C ABI version {found}, this fa3gen package expects "
            f"{expected}. Rebuild it with: {build_command(spec_name)}"
        )


class VariantNotBuiltError(Fa3genError):
    """No variant of the loaded library serves the call (never silently fall back)."""

    def __init__(self, requested: str, available: Sequence[str], hint: str, library: str = "",
                 lead: str = "To build it: ", *, no_default: bool = False, left_out_by: str = ""):
        self.requested = requested
        self.available = list(available)
        self.hint = hint
        # The build filter flags (e.g. "--only 'fwd_*'") that left the spec's default for this
        # key out of the library, when the library records them; "" otherwise.
        self.left_out_by = left_out_by
        where = f" in {library}" if library else ""
        # no_default: variants of the key are built, none is its default (a candidates' spec)
        what = "no default fa3gen variant" if no_default else "no fa3gen variant built"
        super().__init__(
            f"{what} for {requested}{where}.\n"
            f"{format_variant_list(self.available)}\n"
            f"{lead}{hint}"
        )


def left_out_by_filter(exc: BaseException | None) -> str:
    """The build filter behind a VariantNotBuiltError that exc is or was raised from, else "": a
    partial build's GPU tests skip such misses, a full build's fail. It follows what a re-raise
    keeps (torch.compile re-raises the miss `from None` or as an inner exception), not the
    implicit context of an error raised while handling one (a failed assert in an except)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, VariantNotBuiltError) and exc.left_out_by:
            return exc.left_out_by
        exc = (exc.__cause__ or (exc.__context__ if exc.__suppress_context__ else None)
               or getattr(exc, "inner_exception", None))
    return ""


def spec_file_of(spec_name: str | None) -> str:
    """Where a spec of that name lives in a checkout (the hint when nothing records its file)."""
    return f"specs/{spec_name or '<spec>'}.yaml"


def build_command(spec_name: str | None, spec_file: str | None = None) -> str:
    """The build of a spec: the file the caller named when it did (it need not live in specs/)."""
    return f"fa3gen build --spec {spec_file or spec_file_of(spec_name)}"


def yaml_error_place(e) -> tuple[str, str]:
    """(":line:column" or "", what) of a YAML error, for one-line messages (specs, traces)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
    return where, getattr(e, "problem", None) or getattr(e, "context", None) or str(e)


def format_variant_list(names: Sequence[str]) -> str:
    if not names:
        return "The loaded library has no variants."
    shown = list(names[:_MAX_LISTED])
    more = len(names) - len(shown)
    lines = [f"The loaded library has {len(names)} variant(s):"]
    lines += [f"  {n}" for n in shown]
    if more:
        lines.append(f"  ... and {more} more (fa3gen list shows all)")
    return "\n".join(lines)
