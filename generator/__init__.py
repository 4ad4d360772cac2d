"""fa3gen generator: YAML spec -> variants -> CUDA sources + build.ninja -> shared library.

Pure Python (no torch): it must run on CPU-only build machines and start fast.
"""

# Part of the build fingerprint: bump when generated sources change meaning.
__version__ = "0.1.0"
