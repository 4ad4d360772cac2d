"""tests/gpu/sass_loops.py's parser (the compile and disassembly need nvcc and nvdisasm): loops
are backward branches, counted with their opcodes, predicates dropped."""
import importlib.util

from generator.paths import REPO_ROOT

_spec = importlib.util.spec_from_file_location("sass_loops", REPO_ROOT / "tests/gpu/sass_loops.py")
sass_loops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_loops)

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   R2UR UR20, R22 ;
        /*0020*/                   HGMMA.64x176x16.F32.BF16 R24, gdesc[UR20], R24 ;
        /*0030*/                   HGMMA.64x176x16.F32.BF16 R24, gdesc[UR20], R24, gsb0 ;
        /*0040*/              @!P0 NANOSLEEP.SYNCS 0x989680 ;
        /*0050*/              @!P0 BRA `(.L_x_1) ;
        /*0060*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*0070*/                   EXIT ;
"""


def test_loops_are_backward_branches_with_their_opcodes():
    (count, ops), = sass_loops.loops(SASS, min_gmma=2)
    assert count == 5 and ops["HGMMA"] == ops["GMMA"] == 2 and ops["R2UR"] == 1
    assert ops["NANOSLEEP"] == 1 and ops["BRA"] == 1   # predicated instructions count too
    assert sass_loops.loops(SASS, min_gmma=3) == []   # too few GEMMs: not a main loop


def test_fp8_gemms_count_too():
    """fp8 WGMMAs disassemble as QGMMA: an e4m3 main loop is found like a 16-bit one."""
    fp8 = SASS.replace("HGMMA.64x176x16.F32.BF16", "QGMMA.64x128x32.F32.E4M3.E4M3")
    (count, ops), = sass_loops.loops(fp8, min_gmma=2)
    assert ops["QGMMA"] == ops["GMMA"] == 2 and ops["HGMMA"] == 0


def test_events_show_where_the_waits_sit():
    """The order of GEMMs, waits and exponentials in a loop: a wait for every GEMM ahead of the
    softmax's exponentials reads "WAIT1 WAIT0 E2"."""
    body = ["HGMMA.64x128x16.F32.BF16 R88, gdesc[UR8], RZ, !UPT",
            "HGMMA.64x128x16.F32.BF16 R24, R180, gdesc[UR8].tnspB, R24, gsb0",
            "BAR.ARV R8, 0x100", "WARPGROUP.DEPBAR.LE gsb0, 0x1", "FMNMX R13, R88, R96, !PT",
            "WARPGROUP.DEPBAR.LE gsb0, 0x0", "MUFU.EX2 R94, R94", "@P0 MUFU.EX2 R93, R93",
            "MUFU.RCP R1, R2"]
    assert sass_loops.events(body) == "G2 BAR WAIT1 WAIT0 E2"
    (ops, loop), = sass_loops._loop_bodies(SASS, min_gmma=2)
    assert sass_loops.events(loop) == "G2"
