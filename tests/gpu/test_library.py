"""The loaded library against its own build record: a full build (no --only/--exclude) holds a
variant of every key its spec lists, and the decode (and append) kernels and the fp8 quantizer
exactly when the spec asks for them. The per-feature tests skip where a library lacks a feature (a filtered
build, a spec without it); this is what makes such a skip in a full build a failure."""
import pytest

from fa3gen.contract import key_str

pytestmark = pytest.mark.gpu


def test_a_full_build_holds_every_key_and_kernel_its_spec_lists(lib):
    info = lib.build_info
    filters = info.get("filters") or {}
    if filters.get("only") or filters.get("exclude"):
        pytest.skip(f"a filtered build ({filters}): it holds what the filter kept")
    spec_keys = {tuple(k) for k in info.get("spec_keys") or []}
    assert spec_keys, f"{lib.path}: its build info lists no spec keys (built before the field?)"
    missing = spec_keys - {v.key for v in lib.variants}
    assert not missing, f"keys of the spec without a variant: {sorted(map(key_str, missing))}"
    assert (lib._decode is not None) == bool(info.get("decode")), "decode kernels vs the spec's decode:"
    # the append kernels come with the decode kernels: without them the append tests skip and
    # the others take the PyTorch path, unnoticed
    assert lib.has_append_kernel == lib.has_append_rotary == bool(info.get("decode")), \
        "append kernels vs the spec's decode:"
    assert lib.has_quantizer == any(k[1] == "e4m3" for k in spec_keys), "quantizer vs e4m3 keys"
