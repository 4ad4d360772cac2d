"""tests/gpu/sass_same.py's comparison (the compiles need nvcc and a disassembler; here only what
it keeps and drops of a disassembly)."""
import sys

from generator.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tests" / "gpu"))
import sass_same  # noqa: E402

BEFORE = """
        .text._ZN6fa3gen10fwd_kernelI
        /*0000*/                   LDC R1, c[0x0][0x28] ;                      /* 0x00000a00ff017b82 */
        /*0010*/                   FMNMX R2, R3, R4, !PT ;                     /* 0x0000000403027209 */
.L_x_97:
        /*0020*/              @!P0 BRA `(.L_x_97) ;                            /* 0x0000000000008947 */
        // comment
        .dword _ZN78_INTERNAL_eb3e926c_47_fwd_x_cu_5894cuda3std3__480_GLOBAL__N__eb3e926c_47_x6ignoreE
"""


def test_what_does_not_change_the_code_is_ignored():
    moved = (BEFORE.replace("/*0010*/", "/*0110*/").replace("0x0000000403027209", "0x1111")
             .replace("c[0x0][0x28]", "c[0x0][0x30]").replace("eb3e926c", "c581d061")
             .replace(".L_x_97", ".L_x_101"))
    assert sass_same.normalized(moved) == sass_same.normalized(BEFORE)
    assert sass_same.compare("v", sass_same.normalized(BEFORE), sass_same.normalized(moved)) is None


def test_an_instruction_or_a_moved_label_differs():
    code = sass_same.normalized(BEFORE)
    other = sass_same.normalized(BEFORE.replace("FMNMX R2, R3, R4", "FMNMX R2, R3, R5"))
    why = sass_same.compare("v", code, other)
    assert why is not None and "R5" in why and "R4" in why
    lines = BEFORE.splitlines()
    label = lines.index(".L_x_97:")
    moved_label = "\n".join(lines[:label - 1] + [lines[label], lines[label - 1]] + lines[label + 1:])
    assert sass_same.compare("v", code, sass_same.normalized(moved_label)) is not None
    assert not any(line.startswith("//") for line in code)
