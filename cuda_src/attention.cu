#include <type_traits>

#include "kv_cache.cuh"
#include "wgmma.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#ifndef GROUP
#define GROUP 4              // query heads per KV head
#endif
#define MAX_PART_BLOCKS 512  // KV blocks one partition may touch (checked by the host)

// Causal grouped-query attention over the paged KV cache, for decode and for
// (chunked) prefill alike: query token t of sequence s at position p attends to
// positions 0..p of s, whose K/V sit at offset j % bs of cache block block_table[s][j / bs]
// (bs = 2^block_shift: kv_cache.cuh).
//
//   out[t, h, :] = sum_j softmax_j(q[t, h] . k[j, h / GROUP] * scale) v[j, h / GROUP] * v_scale
//
// (An FP8 cache holds K and V over the layer's scales: `scale` is the softmax's times
// K's, v_scale V's; 1 for a bfloat16 cache. engine/quantization/kv_cache.py.)
//
// Pass 1 splits each token's context into partitions of `partition` positions and
// leaves, per (token, head, partition), the unnormalised output with its softmax max
// and sum; pass 2 (merge_partitions) rescales and sums the partitions. Pass 2 is a
// kernel of its own (paged_attention_merge), except in steps of decode tokens alone,
// where the decode kernel runs it itself, in the block that finishes a token's
// partitions last; a token whose context fits one partition needs none. Decode tokens
// and prompt tokens take different pass-1 kernels (below); both run on tensor cores
// (mma.sync m16n8k16: bfloat16 in, float32 accumulate; decode from an e4m3 cache
// float16 in, kv_cache.cuh says why), round the probabilities to bfloat16 (float16)
// for P V (as transformers' eager attention does), and visit a token's positions in an
// order fixed by its context alone, so that its result does not depend on the rest of
// the batch. The numpy backend's paged_attention is the oracle (tests/gpu/test_kernels.py).

// Pass 2, one output element: sum_p acc_p * exp(max_p - M) / sum_p sum_p * exp(max_p - M),
// M = max_p max_p, over the partitions that hold token t's positions 0..positions[t]:
// the first positions[t] / partition + 1 (`spanned`; pass 1 leaves the others empty).
// `base` indexes (token, head, partition 0) in part_max. (merge_in_block, below, is the
// decode kernel's: the same sums, split over a block's threads.)
__device__ __forceinline__ float merge_partitions(const float* part_acc, const float* part_max, const float* part_sum,
                                                  size_t base, int spanned, int d) {
    float m = -INFINITY;
    for (int p = 0; p < spanned; p++) m = fmaxf(m, __ldcg(part_max + base + p));
    float num = 0.f, den = 0.f;
#pragma unroll 4
    for (int p = 0; p < spanned; p++) {
        const float w = __expf(__ldcg(part_max + base + p) - m);
        num += w * __ldcg(part_acc + (base + p) * HEAD_DIM + d);
        den += w * __ldcg(part_sum + base + p);
    }
    return num / den;
}

// Pass 1 for generated tokens (decode): grid (tokens, kv_heads, partitions), WARPS
// warps. The GROUP query heads of one token are rows 0..GROUP-1 of a 16-row A tile
// (the other rows hold nothing useful and are never written out), so one mma serves
// every head that shares a K/V row, and the cache is read once. Warp w takes the
// partition's 16-position chunks w, w + WARPS, ..., loading each chunk's K and V
// straight from the cache into registers as mma fragments, and keeps an online softmax
// per row; the warps' states are merged at the end in a fixed order. Where blocks are
// many, a warp loads one chunk at a time: at 96 registers or fewer five blocks fit on
// an SM, and their loads hide the latency better than a second chunk in flight per
// warp would (bench/RESULTS.md); where they are few, it loads the next one ahead
// (PREFETCH, below). A warp's first chunk is loaded before the wait for the previous
// kernel, where no kernel of the step writes it.
// A token whose context fits one partition has nothing to merge: its block stores its
// output directly (acc / sum, what the merge computes for one partition), and the merge
// kernel passes it over. Given `arrivals`, pass 2 of the other tokens follows in the
// same launch: each partition's block counts itself in arrivals[t, kvh] once its
// partial results are written, and the last to arrive merges the token's GROUP heads
// and resets the count to 0 for the next launch (so arrivals is zero between
// launches). That block merges with all its threads (merge_in_block): a long context
// has hundreds of partitions, and one thread an element walking them in turn
// (merge_partitions) took 90 µs a layer at 32,768 positions. That saves a step of
// decode tokens the merge kernel, which visits every token: in a large step, whose
// 1,024-position partitions leave few tokens spanning several, the fence and count of
// those few cost less (at 512 positions they cost more: bench/HISTORY.md). Beside
// prompt rows, and with batch invariance (a token's sums the same in any step),
// arrivals is null and paged_attention_merge follows (engine/backends/cuda/forward.py).
//
// Fragments are read with 16-byte loads by permuting the summed-over index, which
// changes no sum: in S = Q K^T, lane quad q's k-step kk covers head dims
// q * QUARTER + 4 kk + 0..3, so a lane reads one contiguous quarter of each Q and K
// row. P V is computed transposed, O^T = V^T P^T, so that the heads are the n8 columns
// (no accumulator rows wasted) and P's A-fragment layout in S is already P^T's B
// layout; its m16 tile mt takes head dims g * DIM_SLICE + 2 mt (row g) and + 1 (row
// g + 8), so lane group g reads dims g * DIM_SLICE.. of each V row.
#define WARPS 4                          // threads per block: 32 * WARPS
#define CHUNK 16                         // context positions per warp step (the k of P V)
#define QUARTER (HEAD_DIM / 4)           // head dims per lane quad in Q K^T
#define K_WORDS (QUARTER / 2)            // 32-bit words of a lane's K (and Q) quarter
#define DIM_SLICE (HEAD_DIM / 8)         // head dims per lane group g in P V
#define V_WORDS (DIM_SLICE / 2)          // 32-bit words of a lane's V slice
#define DIM_TILES (HEAD_DIM / 16)        // m16 tiles of O^T

struct ChunkFragments {  // one lane's share of a chunk's K and V rows
    uint32_t k[2][K_WORDS];  // rows 8 * i + g, dims q * QUARTER..
    uint32_t v[4][V_WORDS];  // rows 2q, 2q + 1, 2q + 8, 2q + 9, dims g * DIM_SLICE..
};

// The same as the cache holds them (kv_cache.cuh: e4m3 codes, or the fragments
// themselves). A chunk's codes are all loaded before any is widened (widen_chunk): an
// e4m3 row widened as it arrived kept the next row's load waiting, and the e4m3 cache's
// attention ran at half the bandwidth of bfloat16's (bench/HISTORY.md); a chunk loaded
// ahead is held so, in half the registers.
struct ChunkCodes {
    uint32_t k[2][kv_code_words(K_WORDS)];
    uint32_t v[4][kv_code_words(V_WORDS)];
};

// Positions past `end` read as zeros (no NaN from cache slots never written).
template <int words>
__device__ __forceinline__ void load_row(uint32_t* codes, const kv_t* __restrict__ cache, const int* blocks_s,
                                         int first_block, int block_shift, int kv_heads, int kvh, int pos, int dim, int end) {
    if (pos < end) {
        const size_t row = kv_row(blocks_s[(pos >> block_shift) - first_block], in_block(pos, block_shift), kvh, kv_heads,
                                  block_shift);
        load_kv_codes<words>(codes, cache + row * HEAD_DIM + dim);
    } else {
#pragma unroll
        for (int i = 0; i < kv_code_words(words); i++) codes[i] = 0u;
    }
}

__device__ __forceinline__ void load_chunk(ChunkCodes& c, const kv_t* __restrict__ k_cache,
                                           const kv_t* __restrict__ v_cache, const int* blocks_s, int first_block,
                                           int block_shift, int kv_heads, int kvh, int chunk, int end, int g, int q) {
#pragma unroll
    for (int i = 0; i < 2; i++)
        load_row<K_WORDS>(c.k[i], k_cache, blocks_s, first_block, block_shift, kv_heads, kvh, chunk + 8 * i + g,
                          q * QUARTER, end);
#pragma unroll
    for (int r = 0; r < 4; r++)
        load_row<V_WORDS>(c.v[r], v_cache, blocks_s, first_block, block_shift, kv_heads, kvh,
                          chunk + 2 * q + (r & 1) + 8 * (r >> 1), g * DIM_SLICE, end);
}

__device__ __forceinline__ ChunkFragments widen_chunk(const ChunkCodes& c) {
    ChunkFragments f;
#pragma unroll
    for (int i = 0; i < 2; i++) widen_kv_codes<K_WORDS>(f.k[i], c.k[i]);
#pragma unroll
    for (int r = 0; r < 4; r++) widen_kv_codes<V_WORDS>(f.v[r], c.v[r]);
    return f;
}

// Pass 2 for the GROUP heads of token t's KV head kvh, by the block's WARPS * 32
// threads, in one pass over the partitions: thread (c, l) takes dims 4c..4c+3 of
// partitions l, l + MERGE_LANES, ... of every head, keeping the largest max so far and
// rescaling its sums when it grows. No load waits for the sums, so two partitions'
// loads of every head are in flight together (more raise the registers past the
// decode kernel's 96); a pass for the max first cost one round trip more (0.6 µs a
// layer at 32,768 positions). The lanes' sums meet in shared memory, in lane order.
// Loads bypass L1: other blocks of the same launch wrote the partitions.
#define MERGE_COLS (HEAD_DIM / 4)                // float4 columns of a partition's row
#define MERGE_LANES (WARPS * 32 / MERGE_COLS)  // threads a column
__device__ __forceinline__ void merge_in_block(bf16* __restrict__ out, const float* part_acc, const float* part_max,
                                               const float* part_sum, int t, int heads, int kvh, int partitions,
                                               int spanned, float v_scale) {
    __shared__ float4 num_s[MERGE_LANES][GROUP][MERGE_COLS];
    __shared__ float max_s[MERGE_LANES][GROUP], den_s[MERGE_LANES][GROUP];
    const size_t base = ((size_t)t * heads + kvh * GROUP) * partitions;  // head kvh * GROUP + h's at base + h * partitions
    const int c = threadIdx.x % MERGE_COLS, l = threadIdx.x / MERGE_COLS;
    float4 num[GROUP];
    float den[GROUP], m[GROUP];
#pragma unroll
    for (int h = 0; h < GROUP; h++) {
        num[h] = make_float4(0.f, 0.f, 0.f, 0.f);
        den[h] = 0.f;
        m[h] = -INFINITY;  // (every partition spanned saw a position: its max is finite)
    }
#pragma unroll 2
    for (int p = l; p < spanned; p += MERGE_LANES) {
#pragma unroll
        for (int h = 0; h < GROUP; h++) {
            const size_t i = base + (size_t)h * partitions + p;
            const float part_m = __ldcg(part_max + i), part_s = __ldcg(part_sum + i);
            const float4 a = __ldcg(reinterpret_cast<const float4*>(part_acc + i * HEAD_DIM) + c);
            const float m_new = fmaxf(m[h], part_m);
            const float old_w = __expf(m[h] - m_new), w = __expf(part_m - m_new);
            num[h].x = num[h].x * old_w + w * a.x;
            num[h].y = num[h].y * old_w + w * a.y;
            num[h].z = num[h].z * old_w + w * a.z;
            num[h].w = num[h].w * old_w + w * a.w;
            den[h] = den[h] * old_w + w * part_s;
            m[h] = m_new;
        }
    }
#pragma unroll
    for (int h = 0; h < GROUP; h++) {
        num_s[l][h][c] = num[h];
        if (c == 0) {
            max_s[l][h] = m[h];
            den_s[l][h] = den[h];
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < GROUP * HEAD_DIM; e += blockDim.x) {
        const int h = e / HEAD_DIM, d = e % HEAD_DIM;
        float mx = -INFINITY;
        for (int k = 0; k < MERGE_LANES; k++) mx = fmaxf(mx, max_s[k][h]);
        float n = 0.f, sum = 0.f;
        for (int k = 0; k < MERGE_LANES; k++) {
            const float w = __expf(max_s[k][h] - mx);  // 0 for a lane that took no partition
            n += w * reinterpret_cast<const float*>(num_s[k][h])[d];
            sum += w * den_s[k][h];
        }
        out[((size_t)t * heads + kvh * GROUP + h) * HEAD_DIM + d] = to_bf16(n / sum * v_scale);
    }
}

// PREFETCH: each warp loads its next chunk while it computes this one, holding two
// chunks (bfloat16: 121 registers against 83 at HEAD_DIM 64, four blocks an SM, not
// five; e4m3, the next chunk's codes unwidened: 86 against 78), for small decodes at
// long contexts (StepShape.decode_prefetch: at 32,768 positions 512 blocks, each warp
// walking 8 chunks in turn). The sums are the same.
template <bool PREFETCH>
__device__ __forceinline__ void decode_attention(
    bf16* __restrict__ out,           // [tokens, heads, HEAD_DIM]
    int* __restrict__ arrivals,       // [tokens, kv_heads], zero; null: paged_attention_merge follows
    float* __restrict__ part_acc,     // [tokens, heads, partitions, HEAD_DIM]
    float* __restrict__ part_max,     // [tokens, heads, partitions]
    float* __restrict__ part_sum,     // [tokens, heads, partitions]
    const bf16* __restrict__ qkv,     // [tokens, (heads + 2 kv_heads) * HEAD_DIM], q rotated
    const kv_t* __restrict__ k_cache, // [blocks, kv_heads, block size, HEAD_DIM] (kv_cache.cuh)
    const kv_t* __restrict__ v_cache,
    const int* __restrict__ block_tables, int max_blocks,  // [seqs, max_blocks]
    const int* __restrict__ token_seq, const int* __restrict__ positions,
    int heads, int kv_heads, int block_shift, int partition, float scale, float v_scale) {
    __shared__ int blocks_s[MAX_PART_BLOCKS];
    __shared__ float m_s[WARPS][GROUP], l_s[WARPS][GROUP];
    __shared__ float acc_s[WARPS][GROUP][HEAD_DIM];

    const int t = blockIdx.x, kvh = blockIdx.y, part = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    // Before the wait for the previous kernel, what no kernel of this step writes: the
    // step's metadata, and the K/V of the positions before the token's own. (Kernels
    // overlap only in CUDA graphs, whose rows are each one sequence's one new token, so
    // only its own k and v are this step's, written by the kernel before.) So the block
    // table, and a warp's first chunk when it ends before the token's position, are read early.
    const int position = positions[t];
    const int begin = part * partition, end = min(position + 1, begin + partition);
    const int first_block = begin >> block_shift, first_chunk = begin + warp * CHUNK;
    if (begin < end) {
        const int* table = block_tables + (size_t)token_seq[t] * max_blocks;
        for (int i = threadIdx.x; i <= ((end - 1) >> block_shift) - first_block; i += blockDim.x)
            blocks_s[i] = table[first_block + i];
    }
    __syncthreads();  // blocks_s is written
    ChunkCodes cur, next;
    const bool first_chunk_early = first_chunk + CHUNK <= position;
    if (first_chunk_early)
        load_chunk(cur, k_cache, v_cache, blocks_s, first_block, block_shift, kv_heads, kvh, first_chunk, end, g, q);
    await_previous_kernel();
    if (begin >= end) return;  // a partition past the context: the merge does not read it
    if (PREFETCH && !first_chunk_early && first_chunk < end)
        load_chunk(cur, k_cache, v_cache, blocks_s, first_block, block_shift, kv_heads, kvh, first_chunk, end, g, q);

    // Q as A fragments: row g (head kvh * GROUP + g; zero past GROUP), this quad's quarter.
    uint32_t q_frag[K_WORDS];
    if (g < GROUP) {
        const uint4* src = reinterpret_cast<const uint4*>(
            qkv + (size_t)t * (heads + 2 * kv_heads) * HEAD_DIM + (size_t)(kvh * GROUP + g) * HEAD_DIM + q * QUARTER);
#pragma unroll
        for (int i = 0; i < K_WORDS / 4; i++) reinterpret_cast<uint4*>(q_frag)[i] = __ldg(src + i);
#pragma unroll
        for (int i = 0; i < K_WORDS; i++) q_frag[i] = bf16x2_to_kv_pair(q_frag[i]);  // (as K's pairs: kv_cache.cuh)
    } else {
#pragma unroll
        for (int i = 0; i < K_WORDS; i++) q_frag[i] = 0u;
    }
    // O^T: o[mt] holds heads 2q, 2q + 1 at dims g * DIM_SLICE + 2 mt ([0], [1]) and + 1 ([2], [3])
    float o[DIM_TILES][4];
#pragma unroll
    for (int j = 0; j < DIM_TILES; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m_run = -INFINITY, l_run = 0.f;  // head g's; l: this lane's share

    for (int chunk = first_chunk; chunk < end; chunk += WARPS * CHUNK) {
        if (PREFETCH) {
            if (chunk + WARPS * CHUNK < end)
                load_chunk(next, k_cache, v_cache, blocks_s, first_block, block_shift, kv_heads, kvh,
                           chunk + WARPS * CHUNK, end, g, q);
        } else if (chunk != first_chunk || !first_chunk_early) {
            load_chunk(cur, k_cache, v_cache, blocks_s, first_block, block_shift, kv_heads, kvh, chunk, end, g, q);
        }
        const ChunkFragments f = widen_chunk(cur);
        // S = Q K^T: s[i] holds row g at positions chunk + 8 i + 2q, + 1 (and row g + 8's, unused)
        float s[2][4];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < HEAD_DIM / 16; kk++) {
                const uint32_t a[4] = {q_frag[2 * kk], 0u, q_frag[2 * kk + 1], 0u};
                mma_kv(s[i], a, f.k[i][2 * kk], f.k[i][2 * kk + 1]);
            }
        }
        float p[4];  // positions chunk + 2q, 2q + 1, 2q + 8, 2q + 9
        float m_new = m_run;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            p[j] = chunk + 2 * q + (j & 1) + 8 * (j >> 1) < end ? s[j >> 1][j & 1] * scale : -INFINITY;
            m_new = fmaxf(m_new, p[j]);
        }
        m_new = fmaxf(m_new, __shfl_xor_sync(0xffffffff, m_new, 1));  // the row's max over its quad
        m_new = fmaxf(m_new, __shfl_xor_sync(0xffffffff, m_new, 2));
        const float ref = m_new == -INFINITY ? 0.f : m_new;  // -inf: nothing seen yet, p = 0
        const float rescale = __expf(m_run - ref);
        l_run *= rescale;
        const float rescale_lo = __shfl_sync(0xffffffff, rescale, 8 * q), rescale_hi = __shfl_sync(0xffffffff, rescale, 8 * q + 4);
#pragma unroll
        for (int j = 0; j < DIM_TILES; j++) {  // (heads 2q and 2q + 1 are rows 2q, 2q + 1 of S, in lane groups 2q, 2q + 1)
            o[j][0] *= rescale_lo;
            o[j][2] *= rescale_lo;
            o[j][1] *= rescale_hi;
            o[j][3] *= rescale_hi;
        }
        m_run = m_new;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            p[j] = __expf(p[j] - ref);
            l_run += p[j];
        }
        // O^T += V^T P^T over the chunk's 16 positions: P^T's B fragment is row g of P
        const uint32_t b0 = pack_kv_pair(p[0], p[1]), b1 = pack_kv_pair(p[2], p[3]);
#pragma unroll
        for (int mt = 0; mt < DIM_TILES; mt++) {  // V^T's A fragment: dims 2 mt (low halves), 2 mt + 1 (high)
            const uint32_t a[4] = {__byte_perm(f.v[0][mt], f.v[1][mt], 0x5410), __byte_perm(f.v[0][mt], f.v[1][mt], 0x7632),
                                   __byte_perm(f.v[2][mt], f.v[3][mt], 0x5410), __byte_perm(f.v[2][mt], f.v[3][mt], 0x7632)};
            mma_kv(o[mt], a, b0, b1);
        }
        if (PREFETCH) cur = next;
    }

    // Merge the warps: row g's sum over its quad, then across warps through shared memory.
    l_run += __shfl_xor_sync(0xffffffff, l_run, 1);
    l_run += __shfl_xor_sync(0xffffffff, l_run, 2);
#pragma unroll
    for (int mt = 0; mt < DIM_TILES; mt++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int h = 2 * q + (c & 1);
            if (h < GROUP) acc_s[warp][h][g * DIM_SLICE + 2 * mt + (c >> 1)] = o[mt][c];
        }
    if (g < GROUP && q == 0) {
        m_s[warp][g] = m_run;
        l_s[warp][g] = l_run;
    }
    __syncthreads();
    const int spanned = min((int)gridDim.z, position / partition + 1);  // (the partitions this launch has)
    for (int e = threadIdx.x; e < GROUP * HEAD_DIM; e += blockDim.x) {
        const int h = e / HEAD_DIM, d = e % HEAD_DIM;
        float m = -INFINITY;
#pragma unroll
        for (int w = 0; w < WARPS; w++) m = fmaxf(m, m_s[w][h]);
        float acc = 0.f, l = 0.f;
        if (m != -INFINITY) {
#pragma unroll
            for (int w = 0; w < WARPS; w++) {
                const float weight = __expf(m_s[w][h] - m);  // 0 for a warp that saw nothing
                acc += acc_s[w][h][d] * weight;
                l += l_s[w][h] * weight;
            }
        }
        if (spanned == 1) {
            out[((size_t)t * heads + kvh * GROUP + h) * HEAD_DIM + d] = to_bf16(acc / l * v_scale);
            continue;
        }
        const size_t part_idx = ((size_t)t * heads + kvh * GROUP + h) * gridDim.z + part;
        part_acc[part_idx * HEAD_DIM + d] = acc;
        if (d == 0) {
            part_max[part_idx] = m;
            part_sum[part_idx] = l;
        }
    }
    if (!arrivals || spanned == 1) return;

    // Pass 2 in the block that completes the token's partitions (the CUDA programming
    // guide's "last block" pattern: fence, count, fence).
    __shared__ bool last_s;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        int* count = arrivals + (size_t)t * kv_heads + kvh;
        last_s = atomicAdd(count, 1) == spanned - 1;
        if (last_s) *count = 0;
    }
    __syncthreads();
    if (!last_s) return;
    __threadfence();
    merge_in_block(out, part_acc, part_max, part_sum, t, heads, kvh, gridDim.z, spanned, v_scale);
}

// The two builds of decode_attention, parameters as there.
extern "C" __global__ void __launch_bounds__(WARPS * 32) paged_attention_partial(
    bf16* __restrict__ out, int* __restrict__ arrivals, float* __restrict__ part_acc, float* __restrict__ part_max,
    float* __restrict__ part_sum, const bf16* __restrict__ qkv, const kv_t* __restrict__ k_cache,
    const kv_t* __restrict__ v_cache, const int* __restrict__ block_tables, int max_blocks,
    const int* __restrict__ token_seq, const int* __restrict__ positions, int heads, int kv_heads, int block_shift,
    int partition, float scale, float v_scale) {
    decode_attention<false>(out, arrivals, part_acc, part_max, part_sum, qkv, k_cache, v_cache, block_tables, max_blocks,
                            token_seq, positions, heads, kv_heads, block_shift, partition, scale, v_scale);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) paged_attention_partial_prefetch(
    bf16* __restrict__ out, int* __restrict__ arrivals, float* __restrict__ part_acc, float* __restrict__ part_max,
    float* __restrict__ part_sum, const bf16* __restrict__ qkv, const kv_t* __restrict__ k_cache,
    const kv_t* __restrict__ v_cache, const int* __restrict__ block_tables, int max_blocks,
    const int* __restrict__ token_seq, const int* __restrict__ positions, int heads, int kv_heads, int block_shift,
    int partition, float scale, float v_scale) {
    decode_attention<true>(out, arrivals, part_acc, part_max, part_sum, qkv, k_cache, v_cache, block_tables, max_blocks,
                           token_seq, positions, heads, kv_heads, block_shift, partition, scale, v_scale);
}

// Pass 1 for prompt tokens (prefill): the same partial results as
// paged_attention_partial, on tensor cores (mma.sync m16n8k16, bfloat16 in, float32
// accumulate), FlashAttention-2 style. A block takes a query tile of up to Q_POS
// consecutive positions of one sequence with all GROUP query heads of its KV head:
// M_TILE rows (position-major: row m is position m / GROUP, head m % GROUP), 16 per
// warp. It walks the partition's context in KV_TILE-position tiles that cp.async
// copies into shared memory, the next tile's copy in flight while this one is used
// (two buffers; an FP8 cache's codes are copied so, each tile then widened to bfloat16
// in one more buffer), so that the block's PREFILL_WARPS warps share each copy; Q K^T
// reads K's fragments with ldmatrix, P V reads V's with ldmatrix.trans. It computes
// S = Q K^T * scale, masks positions past the partition's end and the row's own
// position (only in the tiles that hold such positions for some row of the block: the
// last ones), keeps an online softmax per row in base 2 (the scale times log2(e) folded
// into one multiply-add an element) and accumulates O += P V with P rounded to bfloat16
// (as transformers' eager attention rounds its probabilities).
// On Hopper (PREFILL_WGMMA) the block's two warpgroups take 64 rows each and compute
// S and O with wgmma (wgmma.cuh): the tiles are copied 128-byte swizzled, K read as
// wgmma's B of S, V as its transposed B of O, and P passed in registers, so no fragment
// of K or V passes through a warp's registers (mma.sync's ldmatrix loads took the
// shared memory's bandwidth beside its products).
// Every row visits the same positions in the same order whatever its tile, so its
// result does not depend on the batch. grid: (query tiles, kv_heads, partitions);
// tiles[i] = (first row, rows) of query tile i, taken last first: a sequence's later
// tiles have the longer contexts, and started first they leave the short ones to fill
// the tail. Rows past the tile shadow its last position and write nothing.
// Given `out`, the launch has one partition that holds every context, and a block
// stores its rows' output, acc / sum (what the merge computes for one partition): a
// step of thousands of prompt tokens has blocks enough without splitting contexts, and
// its partial results would be gigabytes to write and merge at long contexts (the
// host's step_metadata.is_whole_context_prompt).
#if defined(HAVE_WGMMA) && HEAD_DIM == 64 && !defined(KV_CACHE_FP8)
#define PREFILL_WGMMA 1  // (an FP8 cache's widening and HEAD_DIM 128 stay on mma.sync)
#endif
#define PREFILL_WARPS 8                // 16 query rows each: 8 warps share a K/V tile's copy
#define PREFILL_THREADS (PREFILL_WARPS * 32)
#define M_TILE (PREFILL_WARPS * 16)    // (position, head) rows per block
#define Q_POS (M_TILE / GROUP)         // query positions per tile (as the host's prefill_query_rows)
#define KV_TILE (HEAD_DIM == 128 ? 32 : 64)  // two buffers of K and V fit 48 KB of shared memory
#define PAD 8                          // bf16 of padding per shared row: conflict-free fragment reads
#define KV_PIECE (16 / (int)sizeof(kv_t))  // cache elements in a 16-byte copy
// Blocks an SM holds (registers): two, 16 warps, at 128 registers a thread; an FP8
// cache's widening, HEAD_DIM 128's accumulators and the rows of a GROUP that is not a
// power of two (SmolLM2's 3: divisions by it) need more, so one.
#if defined(KV_CACHE_FP8) || HEAD_DIM == 128 || (GROUP & (GROUP - 1))
#define PREFILL_MIN_BLOCKS 1
#else
#define PREFILL_MIN_BLOCKS 2
#endif
#define DIM_BLOCKS (HEAD_DIM / 8)      // n8 blocks of the output
#define POS_BLOCKS (KV_TILE / 8)       // n8 blocks of the scores

// 2^x (ex2.approx: -inf gives 0).
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Four 8x8 bfloat16 matrices from shared memory: lanes 8i..8i+7 give the row addresses
// of matrix i, and register i gets this lane's fragment of it (ldmatrix).
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* smem) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

extern "C" __global__ void __launch_bounds__(PREFILL_THREADS, PREFILL_MIN_BLOCKS) prefill_attention_partial(
    bf16* __restrict__ out,  // [tokens, heads, HEAD_DIM], or null: partial results, paged_attention_merge follows
    float* __restrict__ part_acc, float* __restrict__ part_max, float* __restrict__ part_sum,  // as above
    const bf16* __restrict__ qkv, const kv_t* __restrict__ k_cache, const kv_t* __restrict__ v_cache,
    const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ token_seq,
    const int* __restrict__ positions, const int* __restrict__ tiles,
    int heads, int kv_heads, int block_shift, int partition, float scale, float v_scale) {
    await_previous_kernel();
#if defined(PREFILL_WGMMA)  // two buffers of K and of V, swizzled: tile_s(0 or 1, buffer) (the extra KB aligns them)
    __shared__ __align__(16) uint8_t kv_s[4 * KV_TILE * 128 + 1024];
    uint8_t* const kv_base = kv_s + (-static_cast<int>(__cvta_generic_to_shared(kv_s)) & 1023);
    auto tile_s = [&](int v, int buf) { return kv_base + (2 * v + buf) * KV_TILE * 128; };
#elif defined(KV_CACHE_FP8)  // the codes are copied in two buffers, each tile widened into one of bfloat16
    __shared__ __align__(16) kv_t k_codes[2][KV_TILE][HEAD_DIM];
    __shared__ __align__(16) kv_t v_codes[2][KV_TILE][HEAD_DIM];
    __shared__ __align__(16) bf16 k_s[1][KV_TILE][HEAD_DIM + PAD];
    __shared__ __align__(16) bf16 v_s[1][KV_TILE][HEAD_DIM + PAD];
#else
    __shared__ __align__(16) bf16 k_s[2][KV_TILE][HEAD_DIM + PAD];  // [buffer][position][dim]
    __shared__ __align__(16) bf16 v_s[2][KV_TILE][HEAD_DIM + PAD];
    auto& k_codes = k_s;
    auto& v_codes = v_s;
#endif
    const int tile_index = gridDim.x - 1 - blockIdx.x, kvh = blockIdx.y, part = blockIdx.z;
    const int first = tiles[2 * tile_index], rows = tiles[2 * tile_index + 1];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, group_id = lane >> 2, quad = lane & 3;
    const int begin = part * partition, end = min(positions[first + rows - 1] + 1, begin + partition);
    // Positions before this one are in every row's context (the tile's first row has the
    // earliest position): only tiles that reach past it take the mask.
    const int unmasked_end = min(end, positions[first] + 1);
    const int* table = block_tables + (size_t)token_seq[first] * max_blocks;
    const size_t width = (size_t)(heads + 2 * kv_heads) * HEAD_DIM;
    const float scale_log2 = scale * 1.4426950408889634f;  // exp(x * scale) = 2^(x * scale_log2)

    // This thread's two fragment rows: warp * 16 + group_id and 8 below it.
    int row_t[2], row_h[2], row_pos[2];
    bool row_valid[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int m = warp * 16 + group_id + 8 * i, p = m / GROUP;
        row_valid[i] = p < rows && m < Q_POS * GROUP;
        row_t[i] = first + min(p, rows - 1);
        row_h[i] = kvh * GROUP + m % GROUP;
        row_pos[i] = positions[row_t[i]];
    }
    // Q as A fragments, one per 16 dims: {row, dims 2q..}, {row + 8, ..}, {row, dims 2q + 8..}, {row + 8, ..}
    uint32_t q[HEAD_DIM / 16][4];
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; kk++)
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int i = r & 1, d = kk * 16 + 2 * quad + (r >> 1) * 8;
            q[kk][r] = *reinterpret_cast<const uint32_t*>(qkv + row_t[i] * width + (size_t)row_h[i] * HEAD_DIM + d);
        }
    float o[DIM_BLOCKS][4];
#pragma unroll
    for (int j = 0; j < DIM_BLOCKS; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    // Per row: the largest score so far (unscaled) and this lane's share of the sum.
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

    // Copies tile `tile`'s K and V rows into buffer `buf`, zeros past the end (one commit group).
    auto stage = [&](int buf, int tile) {
        for (int e = threadIdx.x; e < KV_TILE * HEAD_DIM / KV_PIECE; e += PREFILL_THREADS) {
            const int j = e / (HEAD_DIM / KV_PIECE), d = e % (HEAD_DIM / KV_PIECE) * KV_PIECE, p = tile + j;
            size_t idx = 0;
            if (p < end)
                idx = kv_row(table[p >> block_shift], in_block(p, block_shift), kvh, kv_heads, block_shift) * HEAD_DIM + d;
#if defined(PREFILL_WGMMA)
            copy16_async(tile_s(0, buf) + swizzled_offset(j, d / 8), k_cache + idx, p < end);
            copy16_async(tile_s(1, buf) + swizzled_offset(j, d / 8), v_cache + idx, p < end);
#else
            copy16_async(&k_codes[buf][j][d], k_cache + idx, p < end);
            copy16_async(&v_codes[buf][j][d], v_cache + idx, p < end);
#endif
        }
        copy_commit();
    };
    if (begin < end) stage(0, begin);
    // One tile's step; `masked` (compile-time: std::true_type) where the tile reaches past
    // a row's own position or the partition's end, which only the last tiles do.
    auto step = [&](int tile, int buf, auto masked) {
        if (tile + KV_TILE < end) {
            stage(buf ^ 1, tile + KV_TILE);
            copy_wait<1>();  // this tile's group is done (the next one may still be in flight)
        } else {
            copy_wait<0>();
        }
#if defined(PREFILL_WGMMA)
        fence_proxy_async();
#endif
        __syncthreads();  // every thread's copies of this tile are visible
#ifdef KV_CACHE_FP8
        for (int e = threadIdx.x; e < KV_TILE * HEAD_DIM / 8; e += PREFILL_THREADS) {  // 8 codes of K and of V a turn
            const int j = e / (HEAD_DIM / 8), d = e % (HEAD_DIM / 8) * 8;
            const uint2 k = *reinterpret_cast<const uint2*>(&k_codes[buf][j][d]);
            const uint2 v = *reinterpret_cast<const uint2*>(&v_codes[buf][j][d]);
            uint4 k16, v16;
            widen_e4m3x4(k.x, k16.x, k16.y);
            widen_e4m3x4(k.y, k16.z, k16.w);
            widen_e4m3x4(v.x, v16.x, v16.y);
            widen_e4m3x4(v.y, v16.z, v16.w);
            *reinterpret_cast<uint4*>(&k_s[0][j][d]) = k16;
            *reinterpret_cast<uint4*>(&v_s[0][j][d]) = v16;
        }
        __syncthreads();  // the tile is in bfloat16
        const int tb = 0;
#elif !defined(PREFILL_WGMMA)
        const int tb = buf;
#endif

        float s[POS_BLOCKS][4];  // S = Q K^T, unscaled: C fragments {row, cols 2q, 2q+1}, {row + 8, cols 2q, 2q+1}
#if defined(PREFILL_WGMMA)
        wgmma_fence(q, s);
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; kk++)  // (a descriptor's address counts 16 bytes)
            wgmma_m64n64k16<0>(s, q[kk], sw128_descriptor(tile_s(0, buf)) + 2 * kk, kk > 0);
        wgmma_commit();
        wgmma_wait(s);
#else
        // K's B fragments for 32 dims at once: lanes 8i..8i+7 address the block's 8
        // positions at dims kk * 16 + 8i.. (i = 0..3: k-steps kk and kk + 1).
#pragma unroll
        for (int jb = 0; jb < POS_BLOCKS; jb++) {
            s[jb][0] = s[jb][1] = s[jb][2] = s[jb][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < HEAD_DIM / 16; kk += 2) {
                uint32_t b[4];
                ldmatrix_x4(b, &k_s[tb][jb * 8 + (lane & 7)][kk * 16 + (lane >> 3) * 8]);
                mma_bf16(s[jb], q[kk], b[0], b[1]);
                mma_bf16(s[jb], q[kk + 1], b[2], b[3]);
            }
        }
#endif
        if constexpr (decltype(masked)::value) {  // the partition's end; causal
#pragma unroll
            for (int jb = 0; jb < POS_BLOCKS; jb++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    const int p = tile + jb * 8 + 2 * quad + (c & 1);
                    if (p >= end || p > row_pos[c >> 1]) s[jb][c] = -INFINITY;
                }
        }
        float m_new[2] = {m_run[0], m_run[1]};
#pragma unroll
        for (int jb = 0; jb < POS_BLOCKS; jb++)
#pragma unroll
            for (int c = 0; c < 4; c++) m_new[c >> 1] = fmaxf(m_new[c >> 1], s[jb][c]);
        float ref[2], rescale[2];  // ref: the row's max in base-2 units
#pragma unroll
        for (int i = 0; i < 2; i++) {  // the row's max over the four lanes that hold it
            m_new[i] = fmaxf(m_new[i], __shfl_xor_sync(0xffffffff, m_new[i], 1));
            m_new[i] = fmaxf(m_new[i], __shfl_xor_sync(0xffffffff, m_new[i], 2));
            ref[i] = m_new[i] == -INFINITY ? 0.f : m_new[i] * scale_log2;  // as in paged_attention_partial
            rescale[i] = exp2_approx(fmaf(m_run[i], scale_log2, -ref[i]));
            l_run[i] *= rescale[i];
            m_run[i] = m_new[i];
        }
#pragma unroll
        for (int j = 0; j < DIM_BLOCKS; j++) {
            o[j][0] *= rescale[0]; o[j][1] *= rescale[0];
            o[j][2] *= rescale[1]; o[j][3] *= rescale[1];
        }
        // P as A fragments, one per 16 positions (two score blocks), then O += P V.
        auto p_fragment = [&](int kk, uint32_t (&a)[4]) {
            float p[2][4];
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    p[h][c] = exp2_approx(fmaf(s[2 * kk + h][c], scale_log2, -ref[c >> 1]));  // 0 where masked
                    l_run[c >> 1] += p[h][c];
                }
            a[0] = pack_bf16(p[0][0], p[0][1]), a[1] = pack_bf16(p[0][2], p[0][3]);
            a[2] = pack_bf16(p[1][0], p[1][1]), a[3] = pack_bf16(p[1][2], p[1][3]);
        };
#if defined(PREFILL_WGMMA)
        uint32_t a[KV_TILE / 16][4];
#pragma unroll
        for (int kk = 0; kk < KV_TILE / 16; kk++) p_fragment(kk, a[kk]);
        wgmma_fence(a, o);
#pragma unroll
        for (int kk = 0; kk < KV_TILE / 16; kk++)  // (16 rows of 128 bytes a k step)
            wgmma_m64n64k16<1>(o, a[kk], sw128_descriptor(tile_s(1, buf)) + 128 * kk, 1);
        wgmma_commit();
        wgmma_wait(o);
#else
#pragma unroll
        for (int kk = 0; kk < KV_TILE / 16; kk++) {
            uint32_t a[4];
            p_fragment(kk, a);
            // V's B fragments for dim blocks j and j + 1: lanes 0-15 address positions kk * 16 + 0..15
            // at dims j * 8.., lanes 16-31 the same positions at dims (j + 1) * 8..
#pragma unroll
            for (int j = 0; j < DIM_BLOCKS; j += 2) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, &v_s[tb][kk * 16 + (lane & 15)][(j + (lane >> 4)) * 8]);
                mma_bf16(o[j], a, b[0], b[1]);
                mma_bf16(o[j + 1], a, b[2], b[3]);
            }
        }
#endif
        __syncthreads();  // every warp is done with this buffer before the next tile but one is copied into it
    };
    int tile = begin, buf = 0;
    for (; tile + KV_TILE <= unmasked_end; tile += KV_TILE, buf ^= 1) step(tile, buf, std::false_type());
    for (; tile < end; tile += KV_TILE, buf ^= 1) step(tile, buf, std::true_type());
#pragma unroll
    for (int i = 0; i < 2; i++) {
        float l = l_run[i] + __shfl_xor_sync(0xffffffff, l_run[i], 1);
        l += __shfl_xor_sync(0xffffffff, l, 2);
        if (!row_valid[i] || begin >= end) continue;  // (past the tile's context: the merge reads none of it)
        if (out) {
            bf16* out_row = out + ((size_t)row_t[i] * heads + row_h[i]) * HEAD_DIM;
#pragma unroll
            for (int j = 0; j < DIM_BLOCKS; j++)
                *reinterpret_cast<uint32_t*>(out_row + j * 8 + 2 * quad) =
                    pack_bf16(o[j][2 * i] / l * v_scale, o[j][2 * i + 1] / l * v_scale);
            continue;
        }
        const size_t part_idx = ((size_t)row_t[i] * heads + row_h[i]) * gridDim.z + part;
#pragma unroll
        for (int j = 0; j < DIM_BLOCKS; j++)
            *reinterpret_cast<float2*>(part_acc + part_idx * HEAD_DIM + j * 8 + 2 * quad) =
                make_float2(o[j][2 * i], o[j][2 * i + 1]);
        if (quad == 0) {
            part_max[part_idx] = m_run[i] * scale;  // (-inf past this row's position: the merge does not read it)
            part_sum[part_idx] = l;
        }
    }
}

// Pass 2: out[t, h, :] over the partitions token t's context spans (merge_partitions),
// for the prompt rows and those of the first `decode_rows` (the decode kernel's) that
// span several: the decode kernel stored the others' output itself.
// A CUDA graph's launch covers its longest context (8 partitions at 4,096), and most
// tokens span one or two. grid: (tokens, KV heads); block: (HEAD_DIM, query heads a KV
// head): a block of HEAD_DIM threads a head made a 1,024-token prompt's merge 40 µs a
// layer, most of it spent starting 32,768 small blocks.
extern "C" __global__ void paged_attention_merge(bf16* __restrict__ out, const float* __restrict__ part_acc,
                                                 const float* __restrict__ part_max,
                                                 const float* __restrict__ part_sum, const int* __restrict__ positions,
                                                 int partition, int partitions, int decode_rows, float v_scale) {
    await_previous_kernel();
    const int t = blockIdx.x, h = blockIdx.y * blockDim.y + threadIdx.y, heads = gridDim.y * blockDim.y;
    const int d = threadIdx.x;
    const int spanned = min(partitions, positions[t] / partition + 1);
    if (t < decode_rows && spanned == 1) return;  // the decode kernel stored it
    const float merged = merge_partitions(part_acc, part_max, part_sum, ((size_t)t * heads + h) * partitions, spanned, d);
    out[((size_t)t * heads + h) * HEAD_DIM + d] = to_bf16(merged * v_scale);
}
