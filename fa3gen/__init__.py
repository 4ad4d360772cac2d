"""fa3gen: generated FlashAttention-3-style attention kernels for Hopper.

Kept light on purpose: `import fa3gen` imports neither torch nor the generated library (the CLI
runs on machines without torch); flash_attn_func and the torch-side modules load on first use.
"""

import importlib

from fa3gen.errors import (
    AbiMismatchError,
    Fa3genError,
    InvalidInputError,
    LibraryNotBuiltError,
    TraceError,
    VariantNotBuiltError,
)

__version__ = "0.1.0"

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "quantize_fp8",
    "trace",
    "Fa3genError",
    "InvalidInputError",
    "LibraryNotBuiltError",
    "VariantNotBuiltError",
    "AbiMismatchError",
    "TraceError",
    "__version__",
]

_LAZY_ATTRS = {"flash_attn_func": "fa3gen.ops", "flash_attn_varlen_func": "fa3gen.varlen",
               "flash_attn_with_kvcache": "fa3gen.kvcache",
               "flash_attn_qkvpacked_func": "fa3gen.packed",
               "flash_attn_kvpacked_func": "fa3gen.packed",
               "flash_attn_varlen_qkvpacked_func": "fa3gen.packed",
               "flash_attn_varlen_kvpacked_func": "fa3gen.packed",
               "quantize_fp8": "fa3gen.fp8", "trace": "fa3gen.tracing"}
_LAZY_MODULES = {"ops", "runtime", "reference", "bench", "timing", "checks", "tracing", "varlen",
                 "fp8", "kvcache", "packed"}


def __getattr__(name):
    if name in _LAZY_ATTRS:  # kept once loaded: later lookups skip this hook (1.3 us a call)
        value = globals()[name] = getattr(importlib.import_module(_LAZY_ATTRS[name]), name)
        return value
    if name in _LAZY_MODULES:
        return importlib.import_module(f"fa3gen.{name}")
    raise AttributeError(f"module 'fa3gen' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_ATTRS) | _LAZY_MODULES)
