"""Compile specs/tiny.yaml (one forward, one backward variant) plus a causal forward with the
real nvcc (no GPU needed): the generated C++ builds, with no spills and setmaxnreg kept, and
the two forwards share a compile unit whose ptxas entries go to each (generator/units.py).

    .venv/bin/python -m pytest -m compile tests/test_compile.py
"""
import json
import shutil
import subprocess

import pytest

from fa3gen.contract import parse_name
from generator.errors import ToolchainError
from generator.paths import KERNELS_DIR, SPECS_DIR
from generator.toolchain import find_nvcc
from generator.units import traits_mangled

pytestmark = pytest.mark.compile


def test_tiny_spec_compiles(tmp_path, monkeypatch):
    try:
        find_nvcc()
    except ToolchainError as e:
        pytest.skip(str(e))
    from generator.build import build

    monkeypatch.setenv("FA3GEN_GENERATED", str(tmp_path))
    monkeypatch.delenv("FA3GEN_ALLOW_SPILLS", raising=False)
    monkeypatch.delenv("FA3GEN_UNIT_SIZE", raising=False)
    tiny = (SPECS_DIR / "tiny.yaml").read_text()
    fwd = "axes: {direction: fwd, tile: [128, 128]}"
    assert fwd in tiny
    spec = tmp_path / "tiny.yaml"
    spec.write_text(tiny.replace(fwd, "axes: {direction: fwd, tile: [128, 128], causal: [false, true]}"))
    res = build(spec)
    names = ["bwd_bf16_d64_nocausal_m128n128_s2_ws1_pp0_ov0",
             "fwd_bf16_d64_causal_m128n128_s2_ws1_pp0_ov0",
             "fwd_bf16_d64_nocausal_m128n128_s2_ws1_pp0_ov0"]
    lib = tmp_path / "tiny" / "lib" / "libfa3gen_tiny.so"
    assert res.library == lib and lib.is_file()

    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("the library built; its exported-symbol checks need nm (binutils) on PATH")
    if nm:
        syms = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True,
                              text=True, check=True).stdout
        for sym in (*(f"fa3gen_launch_{n}" for n in names), "fa3gen_variant",
                    "fa3gen_num_variants", "fa3gen_build_info", "fa3gen_last_error",
                    "fa3gen_abi_version"):
            assert any(line.split()[-1] == sym for line in syms.splitlines()), sym
        # Nothing else: an exported template instance or function-local static (GNU unique)
        # binds across libraries, and a second library's kernels then fail to launch.
        # (libstdc++'s headers give a few of their inline members default visibility.)
        exported = [line.split()[-1] for line in syms.splitlines() if line.strip()]
        ours = [s for s in exported if not s.startswith(("fa3gen_", "_ZNSt", "_ZNKSt", "_ZSt"))]
        assert ours == []

    m = json.loads((tmp_path / "tiny" / "manifest.json").read_text())
    assert sorted(row["name"] for row in m["variants"]) == names
    for row in m["variants"]:
        assert row["is_default"]
        r = row["resources"]
        assert r["registers"] and r["registers"] > 0
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0
        assert not r["setmaxnreg_ignored"]
        assert traits_mangled(parse_name(row["name"])) in r["kernel"]  # its own kernel
    units = {row["resources"]["unit"] for row in m["variants"]}
    assert len(units) == 2  # the forwards together, the backward alone


FAST_DIV_CHECK = r"""
#include <cstdio>
#include <cstdlib>
#include "simt_common.cuh"
using fa3gen::simt::FastDiv;
// x / d for divisors from 1 to 2^31 - 1 (small ones, powers of two and their neighbours, large
// ones) and numerators at the bounds of every quotient step near 0 and near 2^31 - 1.
int main() {
  long long checked = 0;
  auto check = [&](int d, long long x) {
    if (x < 0 || x > 0x7fffffff) return true;
    ++checked;
    return FastDiv(d).div(int(x)) == int(x / d);
  };
  for (long long d = 1; d < 0x7fffffffLL; d = d < 5000 ? d + 1 : d * 3 / 2 + 1) {
    for (long long e : {d, (d & (d - 1)) ? d : d - 1, d + 1}) {
      if (e < 1 || e > 0x7fffffff) continue;
      for (long long q : {0LL, 1LL, 2LL, 0x7fffffffLL / e - 1, 0x7fffffffLL / e}) {
        for (long long x : {q * e - 1, q * e, q * e + e - 1, 0x7fffffffLL}) {
          if (!check(int(e), x)) { std::printf("FastDiv(%lld).div(%lld) wrong\n", e, x); return 1; }
        }
      }
    }
  }
  std::printf("%lld checked\n", checked);
  return 0;
}
"""


def host_check(tmp_path, name: str, source: str, cutlass: bool = False) -> int:
    """Compile `source` (a host program over the kernel headers) with the real nvcc, run it,
    and return the count it prints on success (it prints what failed and exits 1 otherwise)."""
    from generator.toolchain import find_cutlass_include
    try:
        nvcc = find_nvcc()
        includes = [f"-I{KERNELS_DIR}"] + ([f"-I{find_cutlass_include()}"] if cutlass else [])
    except ToolchainError as e:
        pytest.skip(str(e))
    src, exe = tmp_path / f"{name}.cu", tmp_path / name
    src.write_text(source)
    subprocess.run([str(nvcc), "-std=c++17", "-O2", "--expt-relaxed-constexpr", *includes, str(src),
                    "-o", str(exe)], check=True, capture_output=True, text=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout
    return int(run.stdout.split()[0])


def test_fast_div_matches_division(tmp_path):
    """simt_common.cuh's FastDiv (the quantizer's item -> block, head, batch) against `/`."""
    assert host_check(tmp_path, "fast_div", FAST_DIV_CHECK) > 100000


PADDING_CHECK = r"""
#include <cstdio>
#include <vector>
#include "varlen.cuh"
using fa3gen::padding_span;
// For every tensor of up to 12 rows and every pair of first and last offsets in [-3, 15]
// (out of order and out of range included): padding_span's rows are exactly the rows outside
// [clamp(first), max(clamp(last), clamp(first))), each once, in increasing order.
int main() {
  long long checked = 0;
  for (int rows = 0; rows <= 12; ++rows) {
    for (int first = -3; first <= 15; ++first) {
      for (int last = -3; last <= 15; ++last) {
        const int lo = first < 0 ? 0 : first > rows ? rows : first;
        int hi = last < 0 ? 0 : last > rows ? rows : last;
        if (hi < lo) hi = lo;
        std::vector<int> want;
        for (int r = 0; r < rows; ++r) if (r < lo || r >= hi) want.push_back(r);
        const auto s = padding_span(first, last, rows);
        if (s.count != int(want.size())) { std::printf("rows %d first %d last %d: count %d\n", rows, first, last, s.count); return 1; }
        for (int i = 0; i < s.count; ++i) {
          if (s.row(i) != want[i]) { std::printf("rows %d first %d last %d: row(%d) %d\n", rows, first, last, i, s.row(i)); return 1; }
          ++checked;
        }
      }
    }
  }
  // Elements: a (rows, heads, cols) view with a packed-qkv row stride; every padding element
  // (and LSE entry) is hit once, nothing of a sequence row.
  const int rows = 11, heads = 3, cols = 5;
  fa3gen::PaddedRows t{nullptr, nullptr, 3 * heads * cols, cols, rows, heads, cols};
  for (int first = -1; first <= 12; ++first) {
    for (int last = -1; last <= 12; ++last) {
      const auto s = padding_span(first, last, rows);
      std::vector<int> hits(rows * t.row_stride, 0), lse(heads * rows, 0);
      for (long long e = 0; e < (long long)s.count * heads * cols; ++e) ++hits[fa3gen::padding_offset(t, s, e)];
      for (long long e = 0; e < (long long)s.count * heads; ++e) ++lse[fa3gen::padding_lse_offset(t, s, e)];
      for (int r = 0; r < rows; ++r) {
        const bool pad = r < s.lo || r >= s.hi;
        for (int h = 0; h < heads; ++h) {
          if (lse[h * rows + r] != (pad ? 1 : 0)) { std::printf("lse row %d head %d\n", r, h); return 1; }
          for (int c = 0; c < cols; ++c) {
            if (hits[r * t.row_stride + h * t.head_stride + c] != (pad ? 1 : 0)) {
              std::printf("first %d last %d: row %d head %d col %d hit %d\n", first, last, r, h, c,
                          hits[r * t.row_stride + h * t.head_stride + c]);
              return 1;
            }
            ++checked;
          }
        }
      }
      for (int x = 0; x < rows * (int)t.row_stride; ++x) {  // the view's gaps (k and v of qkv)
        if (x % t.row_stride >= heads * cols && hits[x]) { std::printf("gap %d hit\n", x); return 1; }
      }
    }
  }
  std::printf("%lld checked\n", checked);
  return 0;
}
"""


def test_varlen_padding_rows_are_exactly_those_outside_the_sequences(tmp_path):
    """varlen.cuh's padding_span and element offsets (what the list kernel zeroes):
    the rows before cu_seqlens[0] and from cu_seqlens[batch] on, clamped as the kernels clamp
    offsets, every element of them once in a strided view (and each LSE entry), never a row
    of a sequence nor the view's gaps."""
    assert host_check(tmp_path, "padding", PADDING_CHECK, cutlass=True) > 5000


# The start of the host walks below: a grid of n CTAs seen from CTA c (walk_first / walk_next).
WALK_PRELUDE = r"""
#include <cstdio>
#include <map>
#include <tuple>
#include <vector>
#include "varlen.cuh"  // and tile_scheduler.cuh
using namespace fa3gen;
struct HostGrid {
  int c, n;
  int cta() const { return c; }
  int size() const { return n; }
};
"""

SCHEDULE_CHECK = WALK_PRELUDE + r"""
// fwd_tile_schedule's grid walked as the forward kernel walks it (TileScheduler, walk_*):
// every query tile once, none twice, for every grid policy; with clusters (FwdTraits::kClusterM,
// dense non-causal d >= 128) the grid is whole clusters and the CTAs of one walk tiles m, m + 1 of one head
// at every step, the same number of steps (a CTA that stops early leaves its peer waiting).
template <bool Causal>
int check(int m, int heads, int batch, bool long_tiles, int mode, int sms, int cluster, int fit, long long& n,
          long long kv_head_bytes = 0) {
  const TileSchedule s = fwd_tile_schedule(m, heads, batch, Causal, long_tiles, mode, sms, cluster, fit, kv_head_bytes);
  if (s.ctas < 1 || s.ctas % cluster) { std::printf("grid %lld\n", (long long)s.ctas); return 1; }
  const TileScheduler<Causal> sched{s};
  // Causal, one CTA per tile: sections of head_section (head, batch) pairs, as many as L2 holds
  // (a power of two, at most the pairs), each listing its tiles longest first across its heads.
  const int want = Causal && s.ctas == int64_t(m) * heads * batch && cluster == 1
                   ? l2_head_section(kv_head_bytes, int64_t(heads) * batch) : 1;
  if (s.head_section != want || (want & (want - 1)) || want > heads * batch ||
      (want > 1 && want * kv_head_bytes > (50LL << 20))) {
    std::printf("head_section %d (want %d)\n", s.head_section, want); return 1;
  }
  for (int t = 0; Causal && s.ctas == sched.count() && t + 1 < sched.count(); ++t) {
    TileCoord a, b;
    sched.decode(t, a);
    sched.decode(t + 1, b);
    const int sa = (a.batch * heads + a.head) / s.head_section, sb = (b.batch * heads + b.head) / s.head_section;
    if (sb < sa || (sa == sb && b.block > a.block)) { std::printf("tile %d: not longest first in its section\n", t + 1); return 1; }
  }
  std::map<std::tuple<int, int, int>, int> seen;
  std::vector<std::vector<TileCoord>> walks(s.ctas);
  for (int cta = 0; cta < int(s.ctas); ++cta) {
    const HostGrid grid{cta, int(s.ctas)};
    for (int t = walk_first(sched.paired(), grid); t < sched.count(); t = walk_next(t, sched.paired(), grid)) {
      TileCoord tile;
      if (!sched.decode(t, tile)) continue;
      walks[cta].push_back(tile);
      if (tile.head < 0 || tile.head >= heads || tile.batch < 0 || tile.batch >= batch) {
        std::printf("cta %d: head %d batch %d\n", cta, tile.head, tile.batch);
        return 1;
      }
      if (tile.block < m) ++seen[{tile.block, tile.head, tile.batch}];
      else if (cluster == 1 || tile.block >= s.blocks || cta % cluster == 0) {
        std::printf("cta %d: tile %d %d %d past the query blocks\n", cta, tile.block, tile.head, tile.batch);
        return 1;
      }
    }
  }
  if (int(seen.size()) != m * heads * batch) { std::printf("%zu of %d tiles\n", seen.size(), m * heads * batch); return 1; }
  for (auto const& [tile, count] : seen) if (count != 1) { std::printf("a tile %d times\n", count); return 1; }
  for (int c = 0; c + 1 < int(s.ctas) && cluster == 2; c += 2) {
    if (walks[c].size() != walks[c + 1].size()) { std::printf("cluster %d: %zu and %zu steps\n", c / 2, walks[c].size(), walks[c + 1].size()); return 1; }
    for (size_t i = 0; i < walks[c].size(); ++i) {
      const TileCoord a = walks[c][i], b = walks[c + 1][i];
      if (a.head != b.head || a.batch != b.batch || b.block != a.block + 1) { std::printf("cluster %d step %zu apart\n", c / 2, i); return 1; }
    }
  }
  ++n;
  return 0;
}
int main() {
  long long n = 0;
  // Section sizes: pairs of (K and V bytes of a head, head groups) -> section.
  const long long sizes[][3] = {{12LL << 20, 15, 4}, {25LL << 20, 3, 2}, {51LL << 20, 8, 1}, {1, 15, 8},
                                {0, 32, 1}, {4LL << 20, 32, 8}, {4LL << 20, 5, 4}};
  for (auto const& c : sizes)
    if (l2_head_section(c[0], c[1]) != c[2]) { std::printf("l2_head_section(%lld, %lld)\n", c[0], c[1]); return 1; }
  const int modes[] = {FA3GEN_GRID_AUTO, FA3GEN_GRID_TILES, FA3GEN_GRID_PERSISTENT};
  for (int m = 1; m <= 11; ++m)
    for (int heads : {1, 2, 3, 5})
      for (int batch : {1, 2, 3})
        for (bool long_tiles : {false, true})
          for (int mode : modes)
            for (int sms : {1, 2, 3, 7, 131, 132}) {
              for (long long kv : {0LL, 1LL, 12LL << 20, 25LL << 20, 50LL << 20, 51LL << 20})
                if (check<true>(m, heads, batch, long_tiles, mode, sms, 1, 0, n, kv)) {
                  std::printf("m %d heads %d batch %d mode %d sms %d kv %lld\n", m, heads, batch, mode, sms, kv);
                  return 1;
                }
              if (check<false>(m, heads, batch, long_tiles, mode, sms, 1, 0, n)) return 1;
              for (int fit : {0, 1, 3, 66})
                if (check<false>(m, heads, batch, long_tiles, mode, sms, 2, fit, n)) {
                  std::printf("m %d heads %d batch %d mode %d sms %d fit %d\n", m, heads, batch, mode, sms, fit);
                  return 1;
                }
            }
  // The 16k-token grid's causal shapes: 128-row tiles at 512 to 4k keys, 192-row at 2k and 4k.
  const int grid16k[][3] = {{4, 32, 32}, {8, 32, 16}, {16, 32, 8}, {32, 32, 4}, {4, 16, 32}, {8, 16, 16}, {11, 32, 8}, {22, 32, 4}};
  for (auto const& g : grid16k)
    if (check<true>(g[0], g[1], g[2], false, FA3GEN_GRID_AUTO, 132, 1, 0, n)) {
      std::printf("m %d heads %d batch %d\n", g[0], g[1], g[2]);
      return 1;
    }
  std::printf("%lld checked\n", n);
  return 0;
}
"""


LONG_TILES_CHECK = r"""
#include <cstdio>
#include "tile_scheduler.cuh"
using namespace fa3gen;
// fwd_long_tiles at the points measured (docs/BENCHMARKS.md; window_keys = left + right + 1).
int main() {
  struct Case { bool causal, local; int d, seqlen_k; long long window_keys; bool one_cta_per_tile; };
  const Case cases[] = {
      {true, false, 128, 8192, 0, false},    {true, false, 128, 8193, 0, true},
      {false, false, 64, 16384, 0, false},   {false, true, 128, 1025, 1025, false},
      {false, true, 64, 16384, 1025, false}, {false, true, 128, 16384, 2049, true},
      {false, true, 256, 16384, 2049, true}, {false, true, 64, 16384, 2049, false},
      {false, true, 64, 8192, 2049, false},  {false, true, 64, 4096, 2049, true},
      {false, true, 64, 16384, 3073, false}, {false, true, 64, 8192, 3073, true},
      {false, true, 64, 16384, 4097, true},  {false, true, 128, 16384, 4097, true},
  };
  int n = 0;
  for (const Case& c : cases) {
    if (fwd_long_tiles(c.causal, c.local, c.d, c.seqlen_k, c.window_keys) != c.one_cta_per_tile) {
      std::printf("causal %d local %d d %d seqlen_k %d window %lld\n", c.causal, c.local, c.d, c.seqlen_k,
                  c.window_keys);
      return 1;
    }
    ++n;
  }
  std::printf("%d checked\n", n);
  return 0;
}
"""


def test_the_forward_grid_policy_picks_one_cta_per_tile_where_measured(tmp_path):
    """The AUTO grid's long-tile rule (tile_scheduler.cuh fwd_long_tiles) at the measured points:
    d64 windows of 2048-4095 keys walk persistently only over sequences more than three
    windows long (H100, 2026-12-05 (eighteenth): +2-4% at 8k and 16k keys, -11% at 4k)."""
    assert host_check(tmp_path, "long_tiles", LONG_TILES_CHECK) == 14


def test_the_forward_walk_covers_every_tile_once(tmp_path):
    """tile_scheduler.cuh's forward schedule walked on the host as the kernel walks it, over
    grid policies, SM counts, (FwdTraits::kClusterM) clusters of two with residency caps and,
    for causal tiles one CTA each, L2 sections of heads listed longest first across them."""
    assert host_check(tmp_path, "schedule", SCHEDULE_CHECK) > 10000


VARLEN_WALK_CHECK = WALK_PRELUDE + r"""
// The varlen forward's grid (varlen_fwd_schedule) walked as the kernel walks it
// (VarlenTileScheduler, walk_*), over a list laid out as varlen_tiles_kernel lays it out in
// batch order (each sequence's ceil(len / tile) entries per head, head major, then -1 up to
// the FA3GEN_VARLEN_TILES bound): every query tile of every sequence and head once.
int check(std::vector<int> const& lens, int heads, bool persistent, int sms, long long& n) {
  const int tile = 128, batch = int(lens.size());
  int total = 0;
  for (int len : lens) total += len;
  const int64_t entries = FA3GEN_VARLEN_TILES(total, batch, tile) * heads;
  std::vector<int2> list;
  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < heads; ++h)
      for (int j = 0; j < (lens[b] + tile - 1) / tile; ++j) list.push_back(make_int2(b, (h << 16) | j));
  if (int64_t(list.size()) > entries) { std::printf("list %zu over its bound %lld\n", list.size(), (long long)entries); return 1; }
  list.resize(entries, make_int2(-1, 0));
  const TileSchedule s = varlen_fwd_schedule(entries, false, persistent, sms);
  if (s.ctas < 1 || s.paired) { std::printf("grid %lld\n", (long long)s.ctas); return 1; }
  const VarlenTileScheduler sched{s, list.data()};
  std::map<std::tuple<int, int, int>, int> seen;
  for (int cta = 0; cta < int(s.ctas); ++cta) {
    const HostGrid grid{cta, int(s.ctas)};
    for (int t = walk_first(false, grid); t < s.blocks; t = walk_next(t, false, grid)) {
      TileCoord c;
      if (!sched.decode(t, c)) continue;
      if (c.block >= (lens[c.batch] + tile - 1) / tile) {
        std::printf("cta %d: block %d of sequence %d\n", cta, c.block, c.batch);
        return 1;
      }
      ++seen[{c.block, c.head, c.batch}];
    }
  }
  int want = 0;
  for (int len : lens) want += (len + tile - 1) / tile * heads;
  if (int(seen.size()) != want) { std::printf("%zu of %d tiles\n", seen.size(), want); return 1; }
  for (auto const& [c, count] : seen) if (count != 1) { std::printf("a tile %d times\n", count); return 1; }
  ++n;
  return 0;
}
int main() {
  long long n = 0;
  std::vector<std::vector<int>> batches = {{1}, {128}, {129}, {256}, {257, 0, 1000}, {0, 0, 5},
                                           {300, 40, 900, 129, 128, 1}, {4096, 1, 2, 3, 384}};
  batches.push_back(std::vector<int>(200, 0));  // many empty sequences: total below batch
  batches.back().push_back(1);
  batches.push_back(std::vector<int>(299, 0));
  batches.back().push_back(100);
  for (auto const& lens : batches)
    for (int heads : {1, 2, 3})
      for (bool persistent : {false, true})
        for (int sms : {1, 2, 3, 7, 132})
          if (check(lens, heads, persistent, sms, n)) {
            std::printf("heads %d persistent %d sms %d\n", heads, persistent, sms);
            return 1;
          }
  std::printf("%lld checked\n", n);
  return 0;
}
"""


LIST_ENTRY_CHECK = WALK_PRELUDE + r"""
// varlen_tiles_kernel's entries of one sequence (list_entry_tile): every (head, block) once,
// for every order; section 1 is the head-major order; with sections (the causal forward's list)
// the heads go in sections of `section`, each listed longest first across its heads.
int main() {
  int n_checked = 0;
  // list_head_section: (keys, K and V bytes a key, heads, paired) -> section. bf16 d128 (512 B
  // a key): 16k keys are 8 MB a head, 4 heads in 50 MB; d64 (256 B) 8k keys, 2 MB: 16 of 16
  // heads; a head over L2, a list in pairs, no bytes or no keys: 1 (8388609 keys x 512 B wraps to
  // 512 in 32 bits: the product must be 64-bit).
  const int sections[][5] = {{16384, 512, 16, 0, 4}, {8192, 256, 16, 0, 16}, {8192, 256, 64, 0, 16},
                             {102401, 512, 8, 0, 1}, {16384, 512, 16, 1, 1},  {16384, 0, 16, 0, 1},
                             {1, 1024, 5, 0, 4},     {0, 512, 3, 0, 1},      {8388609, 512, 8, 0, 1}};
  // fwd_list_kv_bytes: the causal forward's K and V bytes a key (2-byte and 1-byte elements);
  // none with a window or without causal.
  if (fwd_list_kv_bytes<unsigned short, 128, true, false>() != 512 ||
      fwd_list_kv_bytes<unsigned short, 64, true, false>() != 256 ||
      fwd_list_kv_bytes<unsigned char, 256, true, false>() != 512 ||
      fwd_list_kv_bytes<unsigned short, 128, false, false>() != 0 ||
      fwd_list_kv_bytes<unsigned short, 128, true, true>() != 0) {
    std::printf("fwd_list_kv_bytes\n");
    return 1;
  }
  for (auto const& c : sections)
    if (list_head_section(c[0], c[1], c[2], c[3] != 0) != c[4]) {
      std::printf("list_head_section(%d, %d, %d, %d) = %d\n", c[0], c[1], c[2], c[3],
                  list_head_section(c[0], c[1], c[2], c[3] != 0));
      return 1;
    }
  for (int n = 1; n <= 9; ++n)
    for (int heads = 1; heads <= 7; ++heads)
      for (int section = 1; section <= heads; section *= 2)
        for (int order = 0; order < 3; ++order) {  // ascending, descending, paired
          const bool descending = order > 0, paired = order == 2;
          std::vector<int> seen(heads * n, 0);
          int last_first = -1, last_block = n;
          for (int within = 0; within < heads * n; ++within) {
            int head, block;
            list_entry_tile(within, n, heads, section, descending, paired, head, block);
            if (head < 0 || head >= heads || block < 0 || block >= n || seen[head * n + block]++) {
              std::printf("n %d heads %d section %d order %d: entry %d -> head %d block %d\n", n, heads, section,
                          order, within, head, block);
              return 1;
            }
            if (section == 1 && (head != within / n)) { std::printf("section 1 not head-major\n"); return 1; }
            if (section > 1 && descending && !paired) {
              const int first = head / section * section;
              if (first < last_first || (first == last_first && block > last_block)) {
                std::printf("n %d heads %d section %d: entry %d not longest first\n", n, heads, section, within);
                return 1;
              }
              last_first = first;
              last_block = block;
            }
          }
          ++n_checked;
        }
  std::printf("%d checked\n", n_checked);
  return 0;
}
"""


def test_the_varlen_list_entries_cover_each_sequence_once(tmp_path):
    """varlen.cuh's list_entry_tile: a sequence's heads x blocks each once, head-major without
    sections, longest first across each L2 section of heads with them (the causal forward's
    list); list_head_section's choice of section at known sizes, and fwd_list_kv_bytes (the
    forward launcher's bytes a key: causal only)."""
    assert host_check(tmp_path, "list_entry", LIST_ENTRY_CHECK) > 300


def test_the_varlen_forward_walk_covers_every_tile_once(tmp_path):
    """varlen.cuh's scheduler over the tile list, walked on the host as the forward kernel walks
    it, persistent or not: each real query tile once."""
    assert host_check(tmp_path, "varlen_walk", VARLEN_WALK_CHECK) > 200


SETMAXNREG_UNIT = r"""
// Three kernels that ask for setmaxnreg; only bad<2> has no __launch_bounds__, so ptxas
// cannot know its register count at entry and drops its setmaxnreg (C7508, printed before
// the entries and naming none).
template <int N> __global__ void bad(int* p) {
  if (threadIdx.x < 128) { asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n"); }
  else { asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n"); }
  p[threadIdx.x] = N;
}
template <int N> __global__ void __launch_bounds__(384, 1) good(int* p) {
  if (threadIdx.x < 128) { asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n"); }
  else { asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n"); }
  p[threadIdx.x] = N;
}
template __global__ void good<1>(int*);
template __global__ void bad<2>(int*);
template __global__ void good<3>(int*);
"""


def test_a_dropped_setmaxnreg_is_charged_to_its_own_variant(tmp_path, monkeypatch, capsys):
    """compile_one on a unit of three variants, one of whose kernels loses its setmaxnreg:
    ptxas names no kernel for it, so compile_one asks ptxas entry by entry, and only that
    variant fails (it used to be all three)."""
    from generator import compile_one
    try:
        nvcc = find_nvcc()
    except ToolchainError as e:
        pytest.skip(str(e))
    monkeypatch.delenv("FA3GEN_ALLOW_SPILLS", raising=False)
    src, obj, res = tmp_path / "u.cu", tmp_path / "u.o", tmp_path / "u.resources.json"
    src.write_text(SETMAXNREG_UNIT)
    rc = compile_one.main(["--name", "u", "--out", str(obj), "--resources", str(res),
                           "--kernel", "v1=goodILi1", "--kernel", "v2=badILi2", "--kernel", "v3=goodILi3",
                           "--", str(nvcc), "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a",
                           "-Xptxas", "-v", "-MD", "-MF", f"{obj}.d", "-c", str(src), "-o", str(obj)])
    out = json.loads(res.read_text())
    assert rc == 1 and not obj.exists()
    assert {v: r["setmaxnreg_ignored"] for v, r in out["variants"].items()} == {"v1": False, "v2": True, "v3": False}
    assert all(p.startswith("v2: ") for p in out["problems"]) and out["problems"]
    assert "unit u" in capsys.readouterr().err


APPEND_HOST = r"""
#include "kvcache_append.cuh"
extern "C" void fa3gen_set_error(const char*) {}
// The append kernel's work on host memory: every chunk the grid would copy, in one loop.
extern "C" int host_append(const fa3gen_append_params* p) {
  if (int rc = fa3gen::check_append(*p)) return rc;
  for (int64_t t = 0; t < fa3gen::append::work_items(*p, nullptr); ++t) fa3gen::append::copy_chunk(*p, t);
  return 0;
}
// The same with the rotary embedding (fa3gen_kvcache_append_rotary's work).
extern "C" int host_append_rotary(const fa3gen_append_params* p, const fa3gen_rotary_params* r) {
  if (int rc = fa3gen::check_append(*p)) return rc;
  if (int rc = fa3gen::check_rotary(*p, *r)) return rc;
  for (int64_t t = 0; t < fa3gen::append::work_items(*p, r); ++t) fa3gen::append::rotary_chunk(*p, *r, t);
  return 0;
}
// Its conversions over arrays: 16-bit values to floats and floats to 16-bit (rounded).
extern "C" void host_to_float(const uint16_t* in, float* out, int n, int fp16) {
  for (int i = 0; i < n; ++i) out[i] = fa3gen::append::half_bits_to_float(in[i], fp16);
}
extern "C" void host_from_float(const float* in, uint16_t* out, int n, int fp16) {
  for (int i = 0; i < n; ++i) out[i] = fa3gen::append::float_to_half_bits(in[i], fp16);
}
"""


def _host_append_library(tmp_path):
    """APPEND_HOST compiled for the host (no fused multiply-adds: the kernel's device code
    rounds each product and sum, as PyTorch does), or a skip without nvcc."""
    import ctypes

    try:
        nvcc = find_nvcc()
    except ToolchainError as e:
        pytest.skip(str(e))
    src, so = tmp_path / "append.cu", tmp_path / "libappend.so"
    src.write_text(APPEND_HOST)
    subprocess.run([str(nvcc), "-std=c++17", "-O2", "-shared", "-Xcompiler", "-fPIC,-ffp-contract=off",
                    f"-I{KERNELS_DIR}", str(src), "-o", str(so)], check=True, capture_output=True, text=True)
    return ctypes.CDLL(str(so))


def test_the_append_kernel_writes_what_the_pytorch_path_writes(tmp_path):
    """kvcache_append.cuh's copy (every chunk, run on the host through kvcache.append_params)
    against the PyTorch operations it replaces (kvcache._write_rows), byte for byte on random
    caches: contiguous and paged, int and tensor lengths (negative, past the capacity),
    cache_batch_idx and block table entries out of range, 16-bit and e4m3, strided new rows."""
    import ctypes
    import random

    import torch

    from fa3gen import kvcache

    host_append = _host_append_library(tmp_path).host_append
    rng, g = random.Random(0), torch.Generator().manual_seed(0)

    def distinct_rows(rows: int, count: int) -> torch.Tensor:
        """count distinct cache rows (pages) of rows, the first or last one sometimes given out
        of range (clamped back onto it: sequences sharing a row would race on either path)."""
        chosen = torch.randperm(rows, generator=g)[:count].to(torch.int32)
        chosen[chosen == 0] = rng.choice([0, -1, -5])
        chosen[chosen == rows - 1] = rng.choice([rows - 1, rows, rows + 7])
        return chosen

    checked = 0
    for case in range(300):
        dtype = rng.choice([torch.bfloat16, torch.float16, torch.float8_e4m3fn])
        b, n, h, d = rng.randint(1, 4), rng.randint(1, 5), rng.randint(1, 3), rng.choice([64, 128, 256])
        paged = rng.random() < 0.5
        if paged:
            page, width = rng.choice([1, 3, 16]), rng.randint(1, 4)
            rows = b * width + rng.randint(0, 3)
            shape, capacity, idx = (rows, page, h, d), width * page, None
            table = distinct_rows(rows, b * width).view(b, width)
            if rng.random() < 0.5:  # a column slice of a wider table: stride(0) > width
                table = torch.cat([table, torch.zeros(b, 3, dtype=torch.int32)], 1)[:, :width]
        else:
            rows, capacity = b + rng.randint(0, 3), rng.randint(1, 12)
            shape, page, table = (rows, capacity, h, d), capacity, None
            idx = distinct_rows(rows, b) if rng.random() < 0.5 else None
        lengths = (torch.randint(-2, capacity + 3, (b,), generator=g, dtype=torch.int32)
                   if rng.random() < 0.6 else rng.randint(-2, capacity + 3))
        caches = [torch.randn(shape, generator=g).to(dtype) for _ in range(2)]
        interleaved = rng.random() < 0.5  # v_cache: one half of an interleaved (.., .., 2, h, d) buffer
        if interleaved:
            caches[1] = torch.randn(*shape[:2], 2, h, d, generator=g).to(dtype)
        new_k, new_v = (torch.randn(b, n, h, 2 * d if rng.random() < 0.3 else d, generator=g).to(dtype)[..., :d]
                        for _ in range(2))  # k and v each sometimes with a gap between heads
        geometry = (shape[0], page, capacity)
        def copies():
            k_, v_ = (c.clone() for c in caches)
            return k_, (v_[:, :, 1] if interleaved else v_)
        want_k, want_v = copies()
        kvcache._write_rows(geometry, want_k, want_v, new_k, new_v, lengths, idx, table)
        got_k, got_v = copies()
        p = kvcache.append_params(geometry, got_k, got_v, new_k, new_v, lengths, idx, table)
        assert p is not None
        assert host_append(ctypes.byref(p)) == 0
        for got, want in ((got_k, want_k), (got_v, want_v)):
            if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                diff = (got.view(torch.uint8) != want.view(torch.uint8)).any(-1).nonzero().tolist()
                assert False, (case, dtype, paged, lengths, idx, table, geometry, (b, n, h, d), diff[:8])
        checked += 1
    assert checked == 300


def test_the_rotary_append_writes_what_the_pytorch_path_writes(tmp_path):
    """kvcache_append.cuh's rotary append (every work item, run on the host through
    kvcache.append_params and rotary_params) against the PyTorch path (kvcache._rotate, then
    _write_rows), byte for byte on random calls: bf16 / fp16 rows, some subnormal; cos and sin
    fp32 / bf16 / fp16, strided; pairs interleaved or halves, rotary_dim from 2 to d (not a
    multiple of a chunk too); q rotated per row or at the start; positions past the tables
    (clamped); new rows past the capacity; q with strided heads; cache_batch_idx. (The device's
    rounding, no FMA and no flush to zero, is the GPU test's to check.)"""
    import ctypes
    import random

    import torch

    from fa3gen import kvcache

    host = _host_append_library(tmp_path).host_append_rotary
    rng, g = random.Random(1), torch.Generator().manual_seed(1)
    for case in range(200):
        dtype = rng.choice([torch.bfloat16, torch.float16])
        table_dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
        b, n, sq, h, hq, d = (rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 2),
                              rng.randint(1, 3), rng.choice([64, 128]))
        half = rng.choice([1, 3, 8, 17, d // 4, d // 2])
        rows = rng.randint(1, 24)
        paged = rng.random() < 0.5
        if paged:
            page, width = rng.choice([1, 4]), rng.randint(1, 4)
            pages = b * width
            shape, capacity, idx = (pages, page, h, d), width * page, None
            table = torch.randperm(pages, generator=g).to(torch.int32).view(b, width)
        else:
            capacity, table = rng.randint(1, 12), None
            shape, page = (b + rng.randint(0, 2), capacity, h, d), capacity
            idx = torch.randperm(shape[0], generator=g)[:b].to(torch.int32) if rng.random() < 0.5 else None
        lengths = (torch.randint(-2, capacity + 2, (b,), generator=g, dtype=torch.int32)
                   if rng.random() < 0.6 else rng.randint(0, capacity))
        angles = torch.randn(rows, 2 * half, generator=g)
        angles = angles[:, ::2] if rng.random() < 0.3 else angles[:, :half]  # column stride 2 or 1
        cos, sin = angles.cos().to(table_dtype), angles.sin().to(table_dtype)
        tiny = 1e-39 if dtype == torch.bfloat16 else 1e-6  # subnormal inputs and products

        def values(*shape):
            x = torch.randn(*shape, generator=g) * 4
            return torch.where(torch.rand(*shape, generator=g) < 0.2, x * tiny, x).to(dtype)
        q = values(b, sq, hq, 2 * d)[..., :d]  # strided heads
        new_k = values(b, n, h, d)
        new_v = torch.randn(b, n, h, d, generator=g).to(dtype)
        interleaved, per_row = rng.random() < 0.5, rng.random() < 0.5
        caches = [torch.randn(shape, generator=g).to(dtype) for _ in range(2)]
        geometry = (shape[0], page, capacity)

        want_k, want_v = (c.clone() for c in caches)
        q_want, k_rot = kvcache._rotate(q, new_k, lengths, cos, sin, interleaved, per_row)
        kvcache._write_rows(geometry, want_k, want_v, k_rot, new_v, lengths, idx, table)

        got_k, got_v = (c.clone() for c in caches)
        q_got = torch.full(q.shape, float("nan"), dtype=dtype)
        p = kvcache.append_params(geometry, got_k, got_v, new_k, new_v, lengths, idx, table)
        r = kvcache.rotary_params(kvcache.Rotary(q, q_got, cos, sin, interleaved, per_row), p)
        assert host(ctypes.byref(p), ctypes.byref(r)) == 0
        for got, want in ((q_got, q_want), (got_k, want_k), (got_v, want_v)):
            if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                diff = (got.view(torch.int16) != want.view(torch.int16)).nonzero().tolist()
                assert False, (case, dtype, table_dtype, half, interleaved, per_row, lengths, diff[:8])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_rotary_append_converts_as_pytorch_does(tmp_path, dtype):
    """The rotary append's own 16-bit conversions against PyTorch's: every 16-bit value to
    float, and back from floats at, between (ties to even) and next to every pair of
    neighbouring 16-bit values, subnormals and overflow included (NaN: any NaN)."""
    import ctypes

    import torch

    lib = _host_append_library(tmp_path)
    fp16, tdtype = int(dtype == "float16"), getattr(torch, dtype)
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    values = bits.view(tdtype).float()
    got = torch.empty(bits.numel(), dtype=torch.float32)
    lib.host_to_float(ctypes.c_void_p(bits.data_ptr()), ctypes.c_void_p(got.data_ptr()), bits.numel(), fp16)
    finite = ~values.isnan()
    assert torch.equal(got[finite].view(torch.int32), values[finite].view(torch.int32))
    assert got[~finite].isnan().all()

    ordered = values[finite & ~values.isinf()].unique().double()  # ascending, +-0 as one
    mids = (ordered[1:] + ordered[:-1]) / 2  # exact in fp32: the ties
    mid32 = mids.float()
    nudged = torch.cat([mid32, torch.nextafter(mid32, torch.tensor(float("inf"))),
                        torch.nextafter(mid32, torch.tensor(float("-inf")))])
    extremes = torch.tensor([65504.0, 65519.99, 65520.0, 1e5, 3.4e38, float("inf"), 2.0 ** -25,
                             2.0 ** -24 * 0.49, 1e-30, 0.0, -0.0])
    floats = torch.cat([ordered.float(), nudged, extremes, -extremes, torch.randn(100000) * 1e3])
    got16 = torch.empty(floats.numel(), dtype=torch.int16)
    lib.host_from_float(ctypes.c_void_p(floats.data_ptr()), ctypes.c_void_p(got16.data_ptr()),
                        floats.numel(), fp16)
    assert torch.equal(got16, floats.to(tdtype).view(torch.int16))



@pytest.mark.parametrize("call", ["causal", "nocausal", "window", "int", "paged", "batch_idx"])
def test_a_call_through_the_rotary_append_is_the_pytorch_path(tmp_path, monkeypatch, call):
    """flash_attn_with_kvcache with rotary, whole calls on the CPU (launches stubbed): through a
    library whose append is the kernel's host-run work (kvcache_append.cuh) against the PyTorch
    path, the same caches and the same q handed to the attention, byte for byte (GQA, two query
    rows, halves of rotary_dim 40, some subnormal values)."""
    import ctypes

    import torch

    from fa3gen import contract, kvcache, ops

    host = _host_append_library(tmp_path).host_append_rotary

    class HostLibrary:  # the append kernel's work, run on the host
        has_append_kernel = has_append_rotary = True
        calls = 0

        def kvcache_append_rotary(self, p, r, stream):
            HostLibrary.calls += 1
            ctypes.memset(r.q_out, 0xFF, q.numel() * 2)  # poisoned: the kernel must write it all
            assert host(ctypes.byref(p), ctypes.byref(r)) == 0

    monkeypatch.setattr(ops, "check_device", lambda *a: None)
    monkeypatch.setattr(ops, "_num_sms", lambda index: 132)
    monkeypatch.setattr(ops, "on_current_stream", lambda device, call_: call_(0))
    monkeypatch.setattr(kvcache, "_launch_decode", lambda device, p, lib: None)
    monkeypatch.setattr(kvcache, "_built_decode_pairs", lambda: frozenset(contract.DECODE_PAIRS))
    read = []
    run = kvcache._run
    monkeypatch.setattr(kvcache, "_run",  # the q the attention reads, after the append wrote it
                        lambda plan, q, *a: (run(plan, q, *a), read.append(q.clone()))[0])
    g = torch.Generator().manual_seed(5)
    BF = torch.bfloat16

    def values(*shape):
        x = torch.randn(*shape, generator=g) * 3
        return torch.where(torch.rand(*shape, generator=g) < 0.2, x * 1e-39, x).to(BF)
    b, sq, hq, hkv, d, new = 3, 2, 8, 2, 128, 2
    q, k, v = values(b, sq, hq, d), values(b, new, hkv, d), values(b, new, hkv, d)
    theta = torch.rand(40, 20, generator=g) * 6.3
    kw = {"rotary_cos": theta.cos(), "rotary_sin": theta.sin(), "rotary_interleaved": False,
          "cache_seqlens": torch.tensor([0, 37, 20], dtype=torch.int32), "causal": call != "nocausal"}
    shape = (b, 48, hkv, d)
    if call == "window":
        kw["window_size"] = (5, 0)
    elif call == "int":
        kw["cache_seqlens"] = 30
    elif call == "paged":
        kw["block_table"] = torch.randperm(9, generator=g).to(torch.int32).view(b, 3)
        shape = (9, 16, hkv, d)
    elif call == "batch_idx":
        kw["cache_batch_idx"] = torch.tensor([2, 0, 1], dtype=torch.int32)
    caches = torch.randn((2,) + shape, generator=g).to(BF)
    results = []
    for lib in (None, HostLibrary()):
        monkeypatch.setattr(kvcache, "_append_library", lambda lib_, k_, lib=lib: lib)
        kc, vc = caches[0].clone(), caches[1].clone()
        kvcache.flash_attn_with_kvcache(q, kc, vc, k, v, **kw)
        results.append((kc, vc, read.pop()))
    assert HostLibrary.calls == 1
    for want, got in zip(*results):
        assert torch.equal(want.view(torch.int16), got.view(torch.int16))
