// fa3gen C ABI: the only interface between the generated library and Python (ctypes).
// Plain C so that the library needs no torch headers and loads under any torch version.
// Bump FA3GEN_ABI_VERSION whenever a struct below changes. A new optional entry point (looked
// up by name, absent from older libraries) with a struct of its own needs no bump.
// fa3gen/contract.py mirrors this header (tests/test_contract.py pins the two together); the
// runtime checks the version.
#pragma once
#include <stdint.h>

#define FA3GEN_ABI_VERSION 16

// The library is compiled with hidden visibility (generator/toolchain.py) and exports only
// what carries FA3GEN_API: two libraries in one process (two specs, an A/B) must not bind
// each other's template instances or function-local statics.
#define FA3GEN_API __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C" {
#endif

// Forward attention. Layout (batch, seqlen, heads, head_dim); strides in elements; the
// head_dim stride is 1. LSE is fp32, contiguous (batch, heads_q, seqlen_q); null: none is
// written (the dense 16-bit forward, since ABI 16).
typedef struct fa3gen_fwd_params {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int32_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim;
  float softmax_scale;
  // Sliding window (local variants): query i sees key j iff
  //   i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k - seqlen_q + window_right,
  // -1 meaning unbounded on that side. Other variants ignore both.
  int32_t window_left, window_right;
  float softcap;      // softcap variants: scores become softcap * tanh(scores / softcap), > 0
  int32_t num_sms;    // multiprocessors of the launch device (persistent scheduling)
  int32_t grid_mode;  // FA3GEN_GRID_*: how many CTAs the forward launches
  // Varlen variants: sequences packed along the rows of (total, heads, head_dim) tensors
  // (batch strides unused), batch = number of sequences, seqlen_q / seqlen_k = the longest
  // ones (max_seqlen). Sequence b is rows [cu_seqlens[b], cu_seqlens[b + 1]) (batch + 1 int32
  // on the device, nondecreasing, last <= total). LSE is (heads_q, total_q). tile_list: int32
  // workspace of 2 * FA3GEN_VARLEN_TILES(total_q, batch, tile_m) * heads_q entries,
  // uninitialised. Other variants ignore all five.
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;
  int32_t* tile_list;
  int32_t total_q, total_k;
  // Varlen, optional (null: unused): sequence b uses only its first seqused_k[b] keys of
  // [cu_seqlens_k[b], cu_seqlens_k[b + 1]) (FA3's seqused_k; batch int32 on the device).
  const int32_t* seqused_k;
  // fp8 (e4m3) variants: fp32 descale factors of q, k and v (null reads 1), read at
  // [b * batch_stride + head * head_stride + block * block_stride] (strides in floats; 0
  // broadcasts). Blocks are the variant's tiles: query rows [tile_m * block, + tile_m) for q,
  // keys [tile_n * block, + tile_n) for k and v (block quantization); a block stride of 0 is
  // one factor per (batch, head). head is the kv head for k and v, and for q the query head
  // divided by q_descale_head_div (heads_q / heads_kv for FA3's (batch, heads_kv) q_descale,
  // else 1). Scores are scaled by q_descale * k_descale, O by v_descale. O is bf16, or fp16
  // when o_fp16 is 1. Other variants ignore these fields (their O has the inputs' dtype).
  const float* q_descale;
  const float* k_descale;
  const float* v_descale;
  int64_t q_descale_batch_stride, q_descale_head_stride, q_descale_block_stride;
  int64_t k_descale_batch_stride, k_descale_head_stride, k_descale_block_stride;
  int64_t v_descale_batch_stride, v_descale_head_stride, v_descale_block_stride;
  int32_t q_descale_head_div;
  int32_t o_fp16;
  // Paged variants (varlen over a paged KV cache): k and v are (num_pages, page_size,
  // heads_kv, head_dim), the batch strides per page; key j of sequence b lies in page
  // block_table[b * block_table_batch_stride + j / page_size] (int32 on the device, clamped to
  // [0, num_pages)) at row j % page_size. Sequence lengths come from cu_seqlens_k and seqused_k
  // as for varlen (at most block_table_cols * page_size keys); the rows cu_seqlens_k offsets
  // point at are not read, total_k only clamps them. page_size is a multiple of 64. Other
  // variants ignore these fields.
  const int32_t* block_table;
  int64_t block_table_batch_stride;
  int32_t page_size, num_pages, block_table_cols;
} fa3gen_fwd_params;

// Varlen limits: the tile list holds the batch in one CTA's shared memory and packs
// head << 16 | block into one int32 (templates/kernels/varlen.cuh).
#define FA3GEN_VARLEN_MAX_BATCH 16384
#define FA3GEN_VARLEN_MAX_HEADS 32767
#define FA3GEN_VARLEN_MAX_TILES_PER_SEQ 65535

// A bound of the tiles of `tile` rows over `batch` sequences of `total` rows in all
// (sum of ceil(len_b / tile) <= (total + batch * (tile - 1)) / tile). It does not depend on
// max_seqlen, so a max_seqlen below the longest sequence cannot make the list drop tiles.
#define FA3GEN_VARLEN_TILES(total, batch, tile) \
  (((int64_t)(total) + (int64_t)(batch) * ((tile) - 1)) / (tile))

// Forward grid: AUTO is persistent (one CTA per SM, walking several tiles; causal tiles in
// long/short pairs) except for causal attention over more than 8192 keys, where one CTA per
// query tile lets the hardware block scheduler balance the long, unequal tiles. The other two
// force one policy (for measurements).
#define FA3GEN_GRID_AUTO 0
#define FA3GEN_GRID_PERSISTENT 1
#define FA3GEN_GRID_TILES 2

// Backward attention: dq, dk, dv from dout and the forward's q, k, v, out, lse. Same layout
// rules as the forward. The caller provides workspace sized with tile_m of the variant
// (seqlen_q_rounded = seqlen_q rounded up to a multiple of tile_m); it need not be
// initialised: the backward's first kernel zeroes dq_accum and dq_semaphore (ABI 3; ABI 2
// required the caller to zero them):
//   dq_accum     fp32 batch * heads_q * seqlen_q_rounded * head_dim (order private to the kernel)
//   lse_log2     fp32 (batch, heads_q, seqlen_q_rounded)
//   dsum         fp32 (batch, heads_q, seqlen_q_rounded)
//   dq_semaphore int32 (batch, heads_q, seqlen_q_rounded / tile_m) (deterministic only)
typedef struct fa3gen_bwd_params {
  const void* q;
  const void* k;
  const void* v;
  const void* o;
  const void* dout;
  const float* lse;
  void* dq;
  void* dk;
  void* dv;
  float* dq_accum;
  float* lse_log2;
  float* dsum;
  int32_t* dq_semaphore;
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t do_batch_stride, do_row_stride, do_head_stride;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
  int32_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim;
  float softmax_scale;
  int32_t window_left, window_right;  // as in fa3gen_fwd_params
  float softcap;
  int32_t deterministic;  // 1: dq is bitwise reproducible (ordered accumulation, slower)
  // Varlen variants, as in fa3gen_fwd_params, with padded workspace: the rows of sequence b
  // start at the multiple of tile_m floor((cu_seqlens_q[b] + b * tile_m) / tile_m) * tile_m
  // of the (heads_q, rows) stats and dq_accum, rows = (total_q + batch * tile_m) rounded up
  // to tile_m (that replaces batch * seqlen_q_rounded above). tile_list: 2 *
  // FA3GEN_VARLEN_TILES(total_k, batch, tile_n) * heads_kv int32.
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;
  int32_t* tile_list;
  int32_t total_q, total_k;
  // Varlen, optional, as in fa3gen_fwd_params (the forward's): keys past seqused_k[b] get no
  // gradient and their dk, dv rows are not written.
  const int32_t* seqused_k;
} fa3gen_bwd_params;

// FP8 quantization (libraries of specs with e4m3 variants export fa3gen_quantize_fp8): x
// (batch, seqlen, heads, head_dim 64/128/256) bf16 (x_fp16 = 0) or fp16, strides in elements,
// multiples of 8, head_dim contiguous, 16-byte aligned -> out, e4m3, contiguous, and descale
// fp32: (batch, heads, ceil(seqlen / block_rows)) contiguous when block_rows > 0, else one
// value (amax_workspace: one float of scratch). signs (head_dim floats, exactly +-1) or null: rows
// are multiplied by diag(signs) H / sqrt(head_dim) first (incoherent processing).
typedef struct fa3gen_quantize_params {
  const void* x;
  void* out;
  float* descale;
  const float* signs;
  float* amax_workspace;
  int64_t x_batch_stride, x_row_stride, x_head_stride;
  int32_t batch, seqlen, heads, head_dim;
  int32_t block_rows;
  int32_t x_fp16;
  // Rotary embedding of each row first (rotary_half > 0; block scales only): rotary_cos and
  // rotary_sin fp32 (>= seqlen, rotary_half) contiguous, positions 0, 1, ...; the first
  // 2 * rotary_half values of a row rotate in adjacent pairs (rotary_interleaved = 1) or as two
  // halves (rotary_half head_dim / 4 or head_dim / 2), in fp32 before the signs.
  const float* rotary_cos;
  const float* rotary_sin;
  int32_t rotary_half;
  int32_t rotary_interleaved;
} fa3gen_quantize_params;
// Decode attention over a KV cache (fa3gen_decode_fwd): q (batch, seqlen_q, heads_q,
// head_dim 64/128/256) bf16 (fp16 = 0) or fp16, rows = heads_q / heads_kv * seqlen_q <= 16;
// k_cache/v_cache contiguous (cache batch, seqlen_k = capacity, heads_kv, head_dim) or, with a
// block_table (batch, max pages) int32, paged (pages, page_size, heads_kv, head_dim) (the
// batch strides are then per page). cache_seqlens (batch) int32 or null (every sequence is
// seqlen_k long); cache_batch_idx (batch) int32 or null (cache batch = batch). Causal is
// bottom-right aligned to each sequence's length. Strides in elements, multiples of 8, head_dim
// contiguous. out like q; lse fp32 (batch, heads_q, seqlen_q). Bad cache_seqlens, block_table
// or cache_batch_idx values give wrong numbers, never out-of-bounds reads: lengths are clamped
// to the capacity, page and cache row indices into [0, cache_rows). num_splits > 1: the key range is
// split across CTAs, with workspace o_accum (batch * heads_q * seqlen_q * num_splits *
// head_dim) and lse_accum (batch * heads_q * seqlen_q * num_splits) fp32.
typedef struct fa3gen_decode_params {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  void* out;
  float* lse;
  const int32_t* cache_seqlens;
  const int32_t* cache_batch_idx;
  const int32_t* block_table;
  float* o_accum;
  float* lse_accum;
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t out_batch_stride, out_row_stride, out_head_stride;
  int64_t block_table_batch_stride;
  int32_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim;
  int32_t page_size, num_splits, causal, fp16;
  int32_t cache_rows;  // pages (paged) or cache batch rows: indices are clamped into range
  int32_t window_left, window_right;  // query at position i sees keys [i - left, i + right]; -1: unbounded
  float softmax_scale;
  float softcap;  // > 0: scores (scaled) become softcap * tanh(score / softcap); 0: none
  // kv_fp8 = 1: k_cache and v_cache hold e4m3 (strides multiples of 16), dequantized as
  // value * factor: k_scale/v_scale[b * batch stride + kv head * head stride] (fp32; the batch
  // stride 0 for one factor per head), or k_scale_value/v_scale_value when the pointer is null.
  const float* k_scale;
  const float* v_scale;
  int64_t kv_scale_batch_stride, kv_scale_head_stride;
  float k_scale_value, v_scale_value;
  int32_t kv_fp8;
} fa3gen_decode_params;

// New keys and values written into a KV cache (fa3gen_kvcache_append: flash_attn_with_kvcache's
// k, v in one kernel): row i of sequence b, kv head h of k_new/v_new (batch, seqlen_new,
// heads_kv, head_dim) goes to cache position start_b + i, start_b = cache_seqlens[b] (or
// seqlen when null; negative values read as 0), of the cache laid out as in
// fa3gen_decode_params (contiguous rows cache_batch_idx[b] or b, or paged through block_table).
// Positions at or past capacity are not written. The bytes are copied as they are:
// element_bytes 2 (bf16/fp16) or 1 (e4m3, already quantized); strides in elements, rows and
// strides 16-byte aligned.
typedef struct fa3gen_append_params {
  const void* k_new;
  const void* v_new;
  void* k_cache;
  void* v_cache;
  const int32_t* cache_seqlens;
  const int32_t* cache_batch_idx;
  const int32_t* block_table;
  int64_t k_new_batch_stride, k_new_row_stride, k_new_head_stride;
  int64_t v_new_batch_stride, v_new_row_stride, v_new_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t block_table_batch_stride;
  int32_t batch, seqlen_new, heads_kv, head_dim, element_bytes;
  int32_t seqlen;      // every sequence's start when cache_seqlens is null
  int32_t capacity;    // positions a sequence holds (paged: block_table width x page_size)
  int32_t page_size;   // paged only
  int32_t cache_rows;  // pages (paged) or cache batch rows: indices are clamped into range
} fa3gen_append_params;

// The rotary embedding of flash_attn_with_kvcache (rotary_cos, rotary_sin) applied as the append
// copies (fa3gen_kvcache_append_rotary, beside fa3gen_append_params): new key row i of sequence
// b is rotated at position start_b + i, query row i at start_b + i (q_per_row) or start_b, each
// clamped into the table's rows, and q is written rotated to q_out (contiguous, q's shape).
// Pairs (e, e + 1) for even e (interleaved) or (e, e + rotary_half) for e < rotary_half, as
// fa3gen.reference.rotary_at computes them: fp32 products and sums each rounded, one rounding to
// the 16-bit dtype. cos and sin: (rows, rotary_half), strides in elements; cos_type 0 fp32,
// 1 bf16, 2 fp16. q, k_new and the caches are 16-bit (fp16 1: __half, else bf16).
typedef struct fa3gen_rotary_params {
  const void* q;
  void* q_out;
  const void* cos;
  const void* sin;
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t cos_row_stride, cos_col_stride, sin_row_stride, sin_col_stride;
  int32_t seqlen_q, heads_q;
  int32_t rotary_half;  // rotary_dim / 2: the pairs rotated; the rest is copied
  int32_t rows;         // cos and sin rows (positions)
  int32_t interleaved, q_per_row, cos_type, fp16;
} fa3gen_rotary_params;

// Returns 0 on success; otherwise nonzero and fa3gen_last_error() says why.
typedef int (*fa3gen_quantize_fn)(const fa3gen_quantize_params* params, void* cuda_stream);
typedef int (*fa3gen_fwd_launch_fn)(const fa3gen_fwd_params* params, void* cuda_stream);
typedef int (*fa3gen_bwd_launch_fn)(const fa3gen_bwd_params* params, void* cuda_stream);

typedef struct fa3gen_variant_info {
  const char* name;       // canonical variant name, e.g. fwd_bf16_d128_nocausal_m128n176_s2_ws1_pp1_ov1
  const char* direction;  // "fwd" | "bwd"
  const char* dtype;      // "bf16" | "fp16"
  int32_t head_dim;
  int32_t causal;
  int32_t local;          // sliding window (window_left/right of the params)
  int32_t softcap;        // logit softcapping (softcap of the params)
  int32_t varlen;         // packed variable-length sequences (cu_seqlens of the params)
  int32_t tile_m, tile_n, stages;
  int32_t warp_specialized, pingpong, intra_wg_overlap;
  int32_t peel_masked;    // forward: masked key blocks peeled out of the steady-state loop
  int32_t p_in_smem;      // forward: P reaches the PV GEMM through shared memory
  int32_t paged;          // varlen forward over a paged KV cache (block_table of the params)
  int32_t o_tma_store;    // forward: O through shared memory and TMA stores
  int32_t is_default;     // the spec's dispatch section picked it for its (direction, dtype, head_dim, causal)
  fa3gen_fwd_launch_fn launch_fwd;  // NULL for a backward variant
  fa3gen_bwd_launch_fn launch_bwd;  // NULL for a forward variant
} fa3gen_variant_info;

FA3GEN_API int32_t fa3gen_abi_version(void);
FA3GEN_API int32_t fa3gen_num_variants(void);
FA3GEN_API const fa3gen_variant_info* fa3gen_variant(int32_t index);
FA3GEN_API const char* fa3gen_build_info(void);   // JSON: spec name, fingerprint
FA3GEN_API const char* fa3gen_last_error(void);   // thread-local message of the last failed call
FA3GEN_API void fa3gen_set_error(const char* message);
// Only in libraries of specs with e4m3 variants (look it up as an optional symbol).
FA3GEN_API int fa3gen_quantize_fp8(const fa3gen_quantize_params* params, void* cuda_stream);
// Only in libraries of specs with `decode: true` (no CuTe: a few seconds to compile).
FA3GEN_API int fa3gen_decode_fwd(const fa3gen_decode_params* params, void* cuda_stream);
// Beside it (libraries built before it lack the symbol: look it up as an optional one).
FA3GEN_API int fa3gen_kvcache_append(const fa3gen_append_params* params, void* cuda_stream);
// With the rotary embedding (look it up as an optional symbol too).
FA3GEN_API int fa3gen_kvcache_append_rotary(const fa3gen_append_params* params,
                                             const fa3gen_rotary_params* rotary, void* cuda_stream);

#ifdef __cplusplus
}
#endif
