// Host entry point of the backward pass: preprocess (D, LSE in log2), main kernel (dK, dV,
// dQ accumulation), dQ conversion, all on the caller's stream. The per-variant translation
// unit instantiates launch_bwd<...> and exports it through the C ABI (see fa3gen_abi.h).
#pragma once
#include <climits>
#include "bwd_kernel.cuh"
#include "launch_common.cuh"

namespace fa3gen {

template <class Element, int HeadDim, int TileM, int TileN, int Stages, bool Causal, bool Local, bool Softcap,
          bool Varlen>
int launch_bwd(const fa3gen_bwd_params& a, cudaStream_t stream) {
  using Traits = BwdTraits<Element, HeadDim, TileM, TileN, Stages, Causal, Local, Softcap, Varlen>;
  using E = Element;
  if (check_sizes(HeadDim, a.head_dim, a.batch, a.seqlen_q, a.seqlen_k, a.heads_q, a.heads_kv)) return 1;
  Masking masking;
  if (masking_args<Local, Softcap, Varlen>(a, masking)) return 1;
  const int seqlen_q_rounded = (a.seqlen_q + TileM - 1) / TileM * TileM;
  const int m_blocks = seqlen_q_rounded / TileM;
  const int n_blocks = (a.seqlen_k + TileN - 1) / TileN;
  if (a.heads_q > 65535 || a.batch > 65535) {  // grid y/z of the dQ conversion
    fa3gen_set_error("backward grid: heads_q and batch must be at most 65535");
    return 1;
  }
  // Varlen: the workspace's padded rows per head (fa3gen_abi.h), and the packed tensors are one
  // batch of total rows.
  const int64_t q_tiles_padded = (int64_t(a.total_q) + int64_t(a.batch) * TileM + TileM - 1) / TileM;
  const int64_t workspace_rows = Varlen ? q_tiles_padded * TileM * a.heads_q : int64_t(a.batch) * a.heads_q * seqlen_q_rounded;
  if (workspace_rows > INT32_MAX / 32) {
    fa3gen_set_error("backward: batch * heads_q * seqlen_q too large for one launch");
    return 1;
  }
  if constexpr (Varlen) {
    if (check_varlen(a.batch, a.heads_kv, n_blocks, a.total_q, a.total_k, a.cu_seqlens_q, a.cu_seqlens_k,
                     a.tile_list)) {
      return 1;
    }
  }
  const int rows_q = Varlen ? a.total_q : a.seqlen_q, rows_k = Varlen ? a.total_k : a.seqlen_k;
  const int batches = Varlen ? 1 : a.batch;
  cudaError_t err;

  // 1. D = rowsum(dO * O), LSE * log2(e) (padded to whole query blocks); zeroes dq_accum
  //    and, in deterministic mode, the semaphores.
  constexpr int kVec = row_vec_elems<HeadDim>();
  BwdRowParams rows{a.o, a.dout, a.lse, a.lse_log2, a.dsum, a.dq_accum,
                    a.deterministic ? a.dq_semaphore : nullptr,
                    a.o_batch_stride, a.o_row_stride, a.o_head_stride,
                    a.do_batch_stride, a.do_row_stride, a.do_head_stride,
                    a.batch, a.heads_q, a.seqlen_q, seqlen_q_rounded, TileM,
                    vec_aligned<E>(a.o, a.o_batch_stride, a.o_row_stride, a.o_head_stride, kVec) &&
                        vec_aligned<E>(a.dout, a.do_batch_stride, a.do_row_stride, a.do_head_stride, kVec),
                    a.cu_seqlens_q, a.total_q, int(q_tiles_padded)};
  const int64_t row_count = workspace_rows;
  constexpr int kRowsPerCta = kRowThreads / kRowLanes;
  bwd_preprocess_kernel<E, HeadDim, Varlen><<<unsigned((row_count + kRowsPerCta - 1) / kRowsPerCta), kRowThreads, 0, stream>>>(rows);
  err = cudaGetLastError();
  if (err != cudaSuccess) return report("backward preprocess launch", err);

  // 2. Main kernel: one CTA per (key block, kv head, batch).
  auto tensor = [](const void* ptr, int seqlen, int heads, int batch, int64_t rs, int64_t hs, int64_t bs) {
    return make_tensor(make_gmem_ptr(static_cast<E const*>(ptr)),
                       make_layout(make_shape(seqlen, Int<HeadDim>{}, heads, batch), make_stride(rs, _1{}, hs, bs)));
  };
  auto q = tensor(a.q, rows_q, a.heads_q, batches, a.q_row_stride, a.q_head_stride, a.q_batch_stride);
  auto dout = tensor(a.dout, rows_q, a.heads_q, batches, a.do_row_stride, a.do_head_stride, a.do_batch_stride);
  auto k = tensor(a.k, rows_k, a.heads_kv, batches, a.k_row_stride, a.k_head_stride, a.k_batch_stride);
  auto v = tensor(a.v, rows_k, a.heads_kv, batches, a.v_row_stride, a.v_head_stride, a.v_batch_stride);
  TileSchedule schedule = one_cta_per_tile(n_blocks, a.heads_kv, a.batch);
  if constexpr (Varlen) {
    // One CTA per listed key tile (varlen.cuh), the sequences with the most queries first; a
    // sequence's key blocks in order (deterministic mode waits on lower ones).
    const int64_t entries = FA3GEN_VARLEN_TILES(a.total_k, a.batch, TileN) * a.heads_kv;
    schedule = one_cta_per_tile(int(entries), 1, 1);
    PaddingArgs padding;  // dQ, dK, dV rows outside every sequence (varlen.cuh)
    padding.rows[0] = PaddedRows{a.dq, a.cu_seqlens_q, a.dq_row_stride, a.dq_head_stride, a.total_q, a.heads_q, HeadDim};
    padding.rows[1] = PaddedRows{a.dk, a.cu_seqlens_k, a.dk_row_stride, a.dk_head_stride, a.total_k, a.heads_kv, HeadDim};
    padding.rows[2] = PaddedRows{a.dv, a.cu_seqlens_k, a.dv_row_stride, a.dv_head_stride, a.total_k, a.heads_kv, HeadDim};
    padding.batch = a.batch;
    err = launch_varlen_tiles<TileN, false>(a.cu_seqlens_k, a.total_k, a.cu_seqlens_q, a.total_q, a.batch, a.heads_kv,
                                            reinterpret_cast<int2*>(a.tile_list), int(entries), stream, false,
                                            padding);
    if (err != cudaSuccess) return report("varlen tile list launch", err);
  }
  auto smem_q = take<0, 2>(typename Traits::SmemLayoutQ{});
  BwdParams<Traits> p{
      make_tma_copy(SM90_TMA_LOAD{}, q, smem_q),
      make_tma_copy(SM90_TMA_LOAD{}, dout, smem_q),
      make_tma_copy(SM90_TMA_LOAD{}, k, typename Traits::SmemLayoutK{}),
      make_tma_copy(SM90_TMA_LOAD{}, v, typename Traits::SmemLayoutK{}),
      a.lse_log2, a.dsum, a.dq_accum, a.dq_semaphore,
      static_cast<E*>(a.dk), static_cast<E*>(a.dv),
      a.dk_batch_stride, a.dk_row_stride, a.dk_head_stride,
      a.dv_batch_stride, a.dv_row_stride, a.dv_head_stride,
      a.seqlen_q, a.seqlen_k, seqlen_q_rounded, a.heads_q, a.heads_kv, a.batch, a.heads_q / a.heads_kv,
      masking.window_left, masking.window_right, LogitSoftcap{masking.softcap_pre},
      a.softmax_scale, masking.scale_log2, a.deterministic != 0,
      vec_aligned<E>(a.dk, a.dk_batch_stride, a.dk_row_stride, a.dk_head_stride, 8) &&
          vec_aligned<E>(a.dv, a.dv_batch_stride, a.dv_row_stride, a.dv_head_stride, 8),
      schedule,
      VarlenArgs{a.cu_seqlens_q, a.cu_seqlens_k, a.total_q, a.total_k, reinterpret_cast<int2*>(a.tile_list),
                 a.seqused_k},
      int(q_tiles_padded)};
  auto kernel = bwd_kernel<Traits>;
  constexpr int smem_bytes = Traits::kSmemBytes;
  err = set_smem_limit_once(kernel, smem_bytes);
  if (err != cudaSuccess) return report("cudaFuncSetAttribute", err);
  // Key blocks are the fastest tile index: in deterministic mode a CTA waits only for CTAs of
  // lower key blocks of its head, which the hardware has already started (no deadlock).
  // Dense: (key block, kv head, batch), read by bwd_kernel.cuh; heads and batch are at most
  // 65535 (checked above). Varlen: the tile list's entries.
  const dim3 grid = Varlen ? dim3(unsigned(schedule.ctas))
                           : dim3(unsigned(schedule.blocks), unsigned(schedule.heads), unsigned(schedule.batch));
#ifdef FA3GEN_BWD_PDL
  err = launch_programmatic(kernel, grid, dim3(Traits::kThreads), smem_bytes, stream, p);
#else
  kernel<<<grid, Traits::kThreads, smem_bytes, stream>>>(p);
  err = cudaGetLastError();
#endif
  if (err != cudaSuccess) return report("backward kernel launch", err);

  // 3. dQ = scale * dq_accum in the caller's dtype and layout.
  BwdDqParams dq{a.dq_accum, a.dq, a.dq_batch_stride, a.dq_row_stride, a.dq_head_stride,
                 a.heads_q, a.seqlen_q, m_blocks, a.softmax_scale,
                 vec_aligned<E>(a.dq, a.dq_batch_stride, a.dq_row_stride, a.dq_head_stride, 8),
                 a.cu_seqlens_q, a.batch, a.total_q, int(q_tiles_padded)};
  const dim3 dq_grid = Varlen ? dim3(unsigned(q_tiles_padded), a.heads_q, 1) : dim3(m_blocks, a.heads_q, a.batch);
#ifdef FA3GEN_BWD_PDL
  err = launch_programmatic(bwd_convert_dq_kernel<Traits>, dq_grid, dim3(Traits::kConsumerThreads), 0, stream, dq);
#else
  bwd_convert_dq_kernel<Traits><<<dq_grid, Traits::kConsumerThreads, 0, stream>>>(dq);
  err = cudaGetLastError();
#endif
  if (err != cudaSuccess) return report("backward dQ conversion launch", err);
  return 0;
}

}  // namespace fa3gen
