// Host entry point of the forward kernel: the per-variant translation unit instantiates
// launch_fwd<...> and exports it through the C ABI (see fa3gen_abi.h).
#pragma once
#include <climits>
#include "fwd_kernel.cuh"
#include "launch_common.cuh"

namespace fa3gen {

template <class Element, int HeadDim, int TileM, int TileN, int Stages, bool Causal, bool Local, bool Softcap,
          bool Varlen, bool Paged, bool WarpSpecialized, bool Pingpong, bool IntraWgOverlap, bool PeelMasked,
          bool PInSmem, bool OTmaStore>
int launch_fwd(const fa3gen_fwd_params& a, cudaStream_t stream) {
  using Traits = FwdTraits<Element, HeadDim, TileM, TileN, Stages, Causal, Local, Softcap, Varlen, Paged,
                           WarpSpecialized, Pingpong, IntraWgOverlap, PeelMasked, PInSmem, OTmaStore>;
  if (check_sizes(HeadDim, a.head_dim, a.batch, a.seqlen_q, a.seqlen_k, a.heads_q, a.heads_kv)) return 1;
  Masking masking;
  if (masking_args<Local, Softcap, Varlen>(a, masking)) return 1;
  using E = Element;
  // A (seqlen, head_dim, heads, batch) tensor at ptr: E const* for the loads, E* for O's store.
  auto rows = [](auto* ptr, int seqlen, int heads, int batch, int64_t rs, int64_t hs, int64_t bs) {
    return make_tensor(make_gmem_ptr(ptr),
                       make_layout(make_shape(seqlen, Int<HeadDim>{}, heads, batch), make_stride(rs, _1{}, hs, bs)));
  };
  if constexpr (Paged) {
    if (a.block_table == nullptr || a.page_size <= 0 || a.page_size % Traits::kPageChunk != 0 || a.num_pages <= 0 ||
        a.block_table_cols <= 0) {
      fa3gen_set_error("paged: block_table must be set, page_size a positive multiple of 64, num_pages and "
                       "block_table_cols positive");
      return 1;
    }
  }
  // Varlen: the packed tensors are one batch of total rows; seqlen_q/k are the longest sequences.
  // Paged: K and V are (page_size rows, head_dim, heads, pages) tensors, a page in the batch mode.
  const int rows_q = Varlen ? a.total_q : a.seqlen_q;
  const int rows_k = Paged ? a.page_size : Varlen ? a.total_k : a.seqlen_k;
  const int batches = Varlen ? 1 : a.batch, batches_k = Paged ? a.num_pages : batches;
  auto q = rows(static_cast<E const*>(a.q), rows_q, a.heads_q, batches, a.q_row_stride, a.q_head_stride, a.q_batch_stride);
  auto k = rows(static_cast<E const*>(a.k), rows_k, a.heads_kv, batches_k, a.k_row_stride, a.k_head_stride, a.k_batch_stride);
  // V as TMA loads it: V^T straight into the MN-major B operand (16-bit), or rows like K into
  // the raw slots the fp8 kernel transposes.
  auto v = [&]() {
    if constexpr (Traits::kFp8) {
      return rows(static_cast<E const*>(a.v), rows_k, a.heads_kv, batches, a.v_row_stride, a.v_head_stride, a.v_batch_stride);
    } else {
      return make_tensor(make_gmem_ptr(static_cast<E const*>(a.v)),
                         make_layout(make_shape(Int<HeadDim>{}, rows_k, a.heads_kv, batches_k),
                                     make_stride(_1{}, a.v_row_stride, a.v_head_stride, a.v_batch_stride)));
    }
  }();

  const int m_blocks = (a.seqlen_q + TileM - 1) / TileM;
  // Tile indices (pairs round up, plus 2 * grid) are ints; clusters walk m_blocks rounded up to
  // them. Varlen walks its tile list, bounded by total_q rather than by max_seqlen_q's tiles
  // for every sequence.
  const int64_t walked_blocks = (m_blocks + Traits::kClusterM - 1) / Traits::kClusterM * Traits::kClusterM;
  const int64_t query_tiles = Varlen ? FA3GEN_VARLEN_TILES(a.total_q, a.batch, TileM) * a.heads_q
                                     : walked_blocks * a.heads_q * a.batch;
  if (query_tiles > INT32_MAX / 2) {
    fa3gen_set_error("too many query tiles for one launch (more than 2^30 - 1 tiles times heads)");
    return 1;
  }
  TileSchedule schedule;
  int cluster_fit = 0;  // kClusterM > 1: clusters resident at once (the query needs the smem limit set)
  if constexpr (Traits::kClusterM > 1) {
    cudaError_t err = set_smem_limit_once(fwd_kernel<Traits>, Traits::kSmemBytes);
    if (err != cudaSuccess) return report("cudaFuncSetAttribute", err);
    cluster_fit = max_active_clusters_once(fwd_kernel<Traits>, Traits::kThreads, Traits::kSmemBytes,
                                           Traits::kClusterM);
  }
  VarlenArgs varlen{a.cu_seqlens_q, a.cu_seqlens_k, a.total_q, a.total_k, reinterpret_cast<int2*>(a.tile_list),
                    a.seqused_k};
  if constexpr (Varlen) {
    if (check_varlen(a.batch, a.heads_q, m_blocks, a.total_q, a.total_k, a.cu_seqlens_q, a.cu_seqlens_k, a.tile_list)) {
      return 1;
    }
    // The tile list (varlen.cuh) holds the longest sequences' tiles first. Persistent (one CTA
    // per multiprocessor walking the list: the prologue and pipeline fill are paid once per SM,
    // not once per tile) where tiles are short or alike: non-causal without a window, and
    // causal sequences of at most 512 keys on average, whose heads' tiles go in pairs of about
    // equal cost (longest with shortest). H200, 2026-12-02, against one CTA per tile:
    // non-causal 1.00-1.32x at mean lengths 256-2048, 1.00-1.02x at 8192; causal pairs
    // 1.04-1.28x at mean 256, 0.99-1.15x at 512, 0.94-1.01x from 1024, where the hardware's
    // dispatch of one CTA per tile balances sequences of unequal length better than the static
    // walk (docs/BENCHMARKS.md). A window of fewer than 2048 keys over sequences at least twice
    // as long on average: every tile costs about the window, so they are alike (window 1024:
    // 1.02-1.09x at mean lengths 2k-8k, 0.85-0.96x at 512; window 4096 0.84-1.00x). Paged calls
    // were not measured and keep one CTA per tile. FA3GEN_GRID_PERSISTENT / _TILES force either.
    const int64_t entries = FA3GEN_VARLEN_TILES(a.total_q, a.batch, TileM) * a.heads_q;
    const bool short_seqs = int64_t(a.total_k) <= 512 * int64_t(a.batch);
    const bool alike_windows =
        masking.window_keys < 2048 && int64_t(a.total_k) >= 2 * masking.window_keys * a.batch;
    const bool walk = !Paged && (Local ? alike_windows : !Causal || short_seqs);
    schedule = varlen_fwd_schedule(entries, Causal && !Local,
                                   a.grid_mode == FA3GEN_GRID_PERSISTENT || (a.grid_mode == FA3GEN_GRID_AUTO && walk),
                                   a.num_sms);
    PaddingArgs padding;  // O's rows outside every sequence, and their LSE (varlen.cuh)
    padding.rows[0] = PaddedRows{a.o, a.cu_seqlens_q, a.o_row_stride, a.o_head_stride, a.total_q, a.heads_q, HeadDim};
    padding.lse = a.lse;
    padding.batch = a.batch;
    // Causal: a sequence's heads listed in L2 sections of their K and V (varlen.cuh).
    constexpr int kListKvBytes = fwd_list_kv_bytes<Element, HeadDim, Causal, Local>();
    cudaError_t err = launch_varlen_tiles<TileM, Causal, kListKvBytes>(a.cu_seqlens_q, a.total_q, a.cu_seqlens_k, a.total_k,
                                                         a.batch, a.heads_q, reinterpret_cast<int2*>(a.tile_list),
                                                         int(entries), stream, schedule.paired, padding);
    if (err != cudaSuccess) return report("varlen tile list launch", err);
  } else {
    const bool long_tiles = fwd_long_tiles(Causal, Local, HeadDim, a.seqlen_k, masking.window_keys);
    const int64_t kv_head_bytes = int64_t(a.seqlen_k) * kv_bytes_per_key<Element, HeadDim>();
    schedule = fwd_tile_schedule(m_blocks, a.heads_q, a.batch, Causal, long_tiles, a.grid_mode, a.num_sms,
                                 Traits::kClusterM, cluster_fit, kv_head_bytes);
  }

  FwdParams<Traits> p{
      make_tma_copy(SM90_TMA_LOAD{}, q, typename Traits::SmemLayoutQPart{}),
      make_tma_copy(typename Traits::TmaLoadKV{}, k, typename Traits::SmemLayoutKBox{}, Int<Traits::kClusterM>{}),
      make_tma_copy(typename Traits::TmaLoadKV{}, v, typename Traits::SmemLayoutVBox{}, Int<Traits::kClusterM>{}),
      a.o, a.lse,
      a.o_batch_stride, a.o_row_stride, a.o_head_stride,
      a.seqlen_q, a.seqlen_k, a.heads_q, a.heads_kv, a.batch, a.heads_q / a.heads_kv,
      masking.window_left, masking.window_right, LogitSoftcap{masking.softcap_pre},
      masking.lse_scale, masking.scale_log2,
      vec_aligned<typename Traits::ElementOut>(a.o, a.o_batch_stride, a.o_row_stride, a.o_head_stride, 8), schedule,
      varlen,
      Descales{a.q_descale, a.k_descale, a.v_descale, a.q_descale_batch_stride, a.q_descale_head_stride,
               a.q_descale_block_stride, a.k_descale_batch_stride, a.k_descale_head_stride,
               a.k_descale_block_stride, a.v_descale_batch_stride, a.v_descale_head_stride,
               a.v_descale_block_stride, a.q_descale_head_div > 0 ? a.q_descale_head_div : 1},
      a.o_fp16 != 0,
      PagedArgs{a.block_table, a.block_table_batch_stride, a.page_size, a.num_pages, a.block_table_cols},
      FwdOTmaArgs<Traits>{}  // set below
  };

  if constexpr (Traits::kOTmaStore) {
    // TMA wants a 16-byte aligned base and strides; otherwise the epilogue's own stores.
    p.o_tma.enabled = vec_aligned<E>(a.o, a.o_batch_stride, a.o_row_stride, a.o_head_stride, 8);
    if (p.o_tma.enabled) {
      auto o = rows(static_cast<E*>(a.o), a.seqlen_q, a.heads_q, a.batch, a.o_row_stride, a.o_head_stride,
                    a.o_batch_stride);
      p.o_tma.tma = make_tma_copy(SM90_TMA_STORE{}, o, typename Traits::SmemLayoutOPart{});
    }
  }
  auto kernel = fwd_kernel<Traits>;
  constexpr int smem_bytes = Traits::kSmemBytes;
  cudaError_t err = set_smem_limit_once(kernel, smem_bytes);
  if (err != cudaSuccess) return report("cudaFuncSetAttribute", err);
  const dim3 grid(static_cast<unsigned>(schedule.ctas));
  if constexpr (Traits::kClusterM > 1) {
    err = launch_clustered(kernel, grid, dim3(Traits::kThreads), smem_bytes, stream, Traits::kClusterM, p);
  } else {
    kernel<<<grid, Traits::kThreads, smem_bytes, stream>>>(p);
    err = cudaGetLastError();
  }
  if (err != cudaSuccess) return report("kernel launch", err);
  return 0;
}

}  // namespace fa3gen
