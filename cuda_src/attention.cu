#include "common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#ifndef GROUP
#define GROUP 4              // query heads per KV head
#endif
#define WARPS 4              // threads per block: 32 * WARPS
#define VEC 8                // bf16 per 16-byte load
#define ROW_LANES (HEAD_DIM / VEC)       // lanes that read one K/V row together
#define ROWS_PER_WARP (32 / ROW_LANES)   // context positions a warp reads per load
#define UNROLL (GROUP <= 4 ? 4 : 2)      // loads in flight per lane
#define MAX_PART_BLOCKS 256  // KV blocks one partition may touch (checked by the host)

// Causal grouped-query attention over the paged KV cache, for decode and for
// (chunked) prefill alike: query token t of sequence s at position p attends to
// positions 0..p of s, whose K/V sit in cache slots block_table[s][j / bs] * bs + j % bs.
//
//   out[t, h, :] = sum_j softmax_j(q[t, h] . k[j, h / GROUP] * scale) v[j, h / GROUP]
//
// Pass 1 (paged_attention_partial): grid (tokens, kv_heads, partitions). A block covers
// `partition` context positions of one KV head. Each K/V row is read once, with 16-byte
// loads by ROW_LANES lanes, into registers, and serves all GROUP query heads of that KV
// head. Every lane row-group keeps its own online softmax (running max m, sum l and
// unnormalised output) over the positions it reads; they are merged across the warp
// and then across warps, always in the same order, so a token's result depends only on
// its own context, not on the rest of the batch. The block leaves a partial result with
// its max and sum; pass 2 (paged_attention_merge) rescales and sums the partitions.
// The numpy backend's paged_attention is the oracle (tests/gpu/test_kernels.py).

struct Softmax {  // online softmax state of one lane for one query head
    float m, l, acc[VEC];
};

// This lane's slice of the K and V rows at positions pos, pos + stride, ... (UNROLL of
// them), as raw bf16; zeros past `end` (no NaN from stale registers).
__device__ __forceinline__ void load_rows(uint4* k, uint4* v, const bf16* __restrict__ k_cache,
                                          const bf16* __restrict__ v_cache, const int* blocks_s, int pos, int stride,
                                          int end, int first_block, int block_size, int kv_heads, int kvh, int col) {
#pragma unroll
    for (int u = 0; u < UNROLL; u++, pos += stride) {
        if (pos < end) {
            const size_t slot = (size_t)blocks_s[pos / block_size - first_block] * block_size + pos % block_size;
            const size_t idx = (slot * kv_heads + kvh) * HEAD_DIM + col;
            k[u] = __ldg(reinterpret_cast<const uint4*>(k_cache + idx));
            v[u] = __ldg(reinterpret_cast<const uint4*>(v_cache + idx));
        } else {
            k[u] = v[u] = make_uint4(0, 0, 0, 0);
        }
    }
}

// Fold state b into a (both over disjoint positions).
__device__ __forceinline__ void merge(Softmax& a, float bm, float bl, const float* bacc) {
    float m = fmaxf(a.m, bm);
    if (m == -INFINITY) return;  // neither has seen a position
    float wa = __expf(a.m - m), wb = __expf(bm - m);
    a.l = a.l * wa + bl * wb;
#pragma unroll
    for (int i = 0; i < VEC; i++) a.acc[i] = a.acc[i] * wa + bacc[i] * wb;
    a.m = m;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) paged_attention_partial(
    float* __restrict__ part_acc,     // [tokens, heads, partitions, HEAD_DIM]
    float* __restrict__ part_max,     // [tokens, heads, partitions]
    float* __restrict__ part_sum,     // [tokens, heads, partitions]
    const bf16* __restrict__ qkv,     // [tokens, (heads + 2 kv_heads) * HEAD_DIM], q rotated
    const bf16* __restrict__ k_cache, // [slots, kv_heads, HEAD_DIM]
    const bf16* __restrict__ v_cache,
    const int* __restrict__ block_tables, int max_blocks,  // [seqs, max_blocks]
    const int* __restrict__ token_seq, const int* __restrict__ positions,
    int heads, int kv_heads, int block_size, int partition, float scale) {
    __shared__ int blocks_s[MAX_PART_BLOCKS];
    __shared__ float m_s[WARPS][GROUP], l_s[WARPS][GROUP];
    __shared__ float acc_s[WARPS][GROUP][HEAD_DIM];

    const int t = blockIdx.x, kvh = blockIdx.y, part = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = lane / ROW_LANES, col = (lane % ROW_LANES) * VEC;
    const int begin = part * partition, end = min(positions[t] + 1, begin + partition);
    const int* table = block_tables + (size_t)token_seq[t] * max_blocks;
    if (begin >= end) {  // a partition past the context adds nothing
        for (int g = threadIdx.x; g < GROUP; g += blockDim.x) {
            const size_t part_idx = ((size_t)t * heads + kvh * GROUP + g) * gridDim.z + part;
            part_max[part_idx] = -INFINITY;
            part_sum[part_idx] = 0.f;
        }
        return;
    }
    const int first_block = begin / block_size;
    for (int i = threadIdx.x; i <= (end - 1) / block_size - first_block; i += blockDim.x)
        blocks_s[i] = table[first_block + i];

    float q[GROUP][VEC];
    const size_t width = (size_t)(heads + 2 * kv_heads) * HEAD_DIM;
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
        load_bf16x8(qkv + t * width + (size_t)(kvh * GROUP + g) * HEAD_DIM + col, q[g]);
#pragma unroll
        for (int i = 0; i < VEC; i++) q[g][i] *= scale;
    }
    Softmax s[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
        s[g].m = -INFINITY;
        s[g].l = 0.f;
#pragma unroll
        for (int i = 0; i < VEC; i++) s[g].acc[i] = 0.f;
    }
    __syncthreads();  // blocks_s is written

    // Warp-uniform loop (the shuffles below need every lane): lanes past `end` mask out.
    // The K/V rows of the next iteration are loaded (as raw bf16) before this
    // iteration's arithmetic, so the memory system always has loads in flight.
    const int stride = WARPS * ROWS_PER_WARP, step = stride * UNROLL;
    const int warp_begin = begin + warp * ROWS_PER_WARP;
    uint4 k_raw[UNROLL], v_raw[UNROLL];
    load_rows(k_raw, v_raw, k_cache, v_cache, blocks_s, warp_begin + row, stride, end, first_block, block_size, kv_heads,
              kvh, col);
    for (int base = warp_begin; base < end; base += step) {
        uint4 k_next[UNROLL], v_next[UNROLL];
        load_rows(k_next, v_next, k_cache, v_cache, blocks_s, base + step + row, stride, end, first_block, block_size,
                  kv_heads, kvh, col);
        float score[GROUP][UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            float k[VEC];
            unpack_bf16x8(k_raw[u], k);
#pragma unroll
            for (int g = 0; g < GROUP; g++) {
                score[g][u] = 0.f;
#pragma unroll
                for (int i = 0; i < VEC; i++) score[g][u] += q[g][i] * k[i];
            }
        }
#pragma unroll
        for (int g = 0; g < GROUP; g++) {
            float m = s[g].m;
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
#pragma unroll
                for (int o = ROW_LANES / 2; o > 0; o >>= 1) score[g][u] += __shfl_xor_sync(0xffffffff, score[g][u], o);
                if (base + u * stride + row >= end) score[g][u] = -INFINITY;
                m = fmaxf(m, score[g][u]);
            }
            // m is -inf only while this lane has seen no position: then p = 0 and
            // nothing changes (without a branch: shuffles follow)
            const float ref = m == -INFINITY ? 0.f : m;
            const float rescale = __expf(s[g].m - ref);
            s[g].l *= rescale;
#pragma unroll
            for (int i = 0; i < VEC; i++) s[g].acc[i] *= rescale;
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
                score[g][u] = __expf(score[g][u] - ref);  // now the weight p: 0 past the end
                s[g].l += score[g][u];
            }
            s[g].m = m;
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            float v[VEC];
            unpack_bf16x8(v_raw[u], v);
#pragma unroll
            for (int g = 0; g < GROUP; g++) {
#pragma unroll
                for (int i = 0; i < VEC; i++) s[g].acc[i] += score[g][u] * v[i];
            }
            k_raw[u] = k_next[u];
            v_raw[u] = v_next[u];
        }
    }

    // Merge the warp's row groups (lanes that hold the same dims), then the warps.
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
#pragma unroll
        for (int o = ROW_LANES; o < 32; o <<= 1) {
            float other_acc[VEC];
#pragma unroll
            for (int i = 0; i < VEC; i++) other_acc[i] = __shfl_xor_sync(0xffffffff, s[g].acc[i], o);
            const float other_m = __shfl_xor_sync(0xffffffff, s[g].m, o);
            const float other_l = __shfl_xor_sync(0xffffffff, s[g].l, o);
            merge(s[g], other_m, other_l, other_acc);
        }
        if (row == 0) {
#pragma unroll
            for (int i = 0; i < VEC; i++) acc_s[warp][g][col + i] = s[g].acc[i];
            if (col == 0) {
                m_s[warp][g] = s[g].m;
                l_s[warp][g] = s[g].l;
            }
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < GROUP * HEAD_DIM; e += blockDim.x) {
        const int g = e / HEAD_DIM, d = e % HEAD_DIM;
        float m = -INFINITY;
#pragma unroll
        for (int w = 0; w < WARPS; w++) m = fmaxf(m, m_s[w][g]);
        float acc = 0.f, l = 0.f;
        if (m != -INFINITY) {
#pragma unroll
            for (int w = 0; w < WARPS; w++) {
                const float weight = __expf(m_s[w][g] - m);  // 0 for a warp that saw nothing
                acc += acc_s[w][g][d] * weight;
                l += l_s[w][g] * weight;
            }
        }
        const size_t part_idx = ((size_t)t * heads + kvh * GROUP + g) * gridDim.z + part;
        part_acc[part_idx * HEAD_DIM + d] = acc;
        if (d == 0) {
            part_max[part_idx] = m;  // -inf for a partition past the context: it adds nothing
            part_sum[part_idx] = l;
        }
    }
}

// Pass 1 for prompt tokens (prefill): the same partial results as
// paged_attention_partial, on tensor cores (mma.sync m16n8k16, bfloat16 in, float32
// accumulate), FlashAttention-2 style. A block takes a query tile of up to Q_POS
// consecutive positions of one sequence with all GROUP query heads of its KV head:
// M_TILE rows (position-major: row m is position m / GROUP, head m % GROUP), 16 per
// warp. It walks the partition's context in KV_TILE-position tiles staged in shared
// memory (V transposed, so that both products read 32-bit pairs), computes
// S = Q K^T * scale, masks positions past the partition's end and the row's own
// position, keeps an online softmax per row and accumulates O += P V with P rounded
// to bfloat16 (as transformers' eager attention rounds its probabilities).
// Every row visits the same positions in the same order whatever its tile, so its
// result does not depend on the batch. grid: (query tiles, kv_heads, partitions);
// tiles[i] = (first row, rows) of query tile i. Rows past the tile shadow its last
// position and write nothing.
#define PREFILL_THREADS 128            // 4 warps
#define M_TILE 64                      // (position, head) rows per block: 16 per warp
#define Q_POS (M_TILE / GROUP)         // query positions per tile (as the host's prefill_query_rows)
#define KV_TILE 64
#define PAD 8                          // bf16 of padding per shared row: conflict-free fragment reads
#define DIM_BLOCKS (HEAD_DIM / 8)      // n8 blocks of the output
#define POS_BLOCKS (KV_TILE / 8)       // n8 blocks of the scores

__device__ __forceinline__ void mma_bf16(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

extern "C" __global__ void __launch_bounds__(PREFILL_THREADS) prefill_attention_partial(
    float* __restrict__ part_acc, float* __restrict__ part_max, float* __restrict__ part_sum,  // as above
    const bf16* __restrict__ qkv, const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
    const int* __restrict__ block_tables, int max_blocks, const int* __restrict__ token_seq,
    const int* __restrict__ positions, const int* __restrict__ tiles,
    int heads, int kv_heads, int block_size, int partition, float scale) {
    __shared__ __align__(16) bf16 k_s[KV_TILE][HEAD_DIM + PAD];   // [position][dim]
    __shared__ __align__(16) bf16 vt_s[HEAD_DIM][KV_TILE + PAD];  // [dim][position]
    const int kvh = blockIdx.y, part = blockIdx.z, first = tiles[2 * blockIdx.x], rows = tiles[2 * blockIdx.x + 1];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, group_id = lane >> 2, quad = lane & 3;
    const int begin = part * partition, end = min(positions[first + rows - 1] + 1, begin + partition);
    const int* table = block_tables + (size_t)token_seq[first] * max_blocks;
    const size_t width = (size_t)(heads + 2 * kv_heads) * HEAD_DIM;

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
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // l: this lane's share of the row

    for (int tile = begin; tile < end; tile += KV_TILE) {
        __syncthreads();  // the previous tile is consumed
        for (int e = threadIdx.x; e < KV_TILE * HEAD_DIM / 8; e += PREFILL_THREADS) {
            const int j = e / (HEAD_DIM / 8), d = e % (HEAD_DIM / 8) * 8, p = tile + j;
            uint4 k = make_uint4(0, 0, 0, 0), v = k;
            if (p < end) {
                const size_t slot = (size_t)table[p / block_size] * block_size + p % block_size;
                const size_t idx = (slot * kv_heads + kvh) * HEAD_DIM + d;
                k = __ldg(reinterpret_cast<const uint4*>(k_cache + idx));
                v = __ldg(reinterpret_cast<const uint4*>(v_cache + idx));
            }
            *reinterpret_cast<uint4*>(&k_s[j][d]) = k;
            const bf16* vb = reinterpret_cast<const bf16*>(&v);
#pragma unroll
            for (int i = 0; i < 8; i++) vt_s[d + i][j] = vb[i];
        }
        __syncthreads();

        float s[POS_BLOCKS][4];  // C fragments: {row, cols 2q, 2q+1}, {row + 8, cols 2q, 2q+1}
#pragma unroll
        for (int jb = 0; jb < POS_BLOCKS; jb++) {
            s[jb][0] = s[jb][1] = s[jb][2] = s[jb][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < HEAD_DIM / 16; kk++) {
                const bf16* k_row = &k_s[jb * 8 + group_id][kk * 16 + 2 * quad];
                mma_bf16(s[jb], q[kk], *reinterpret_cast<const uint32_t*>(k_row),
                         *reinterpret_cast<const uint32_t*>(k_row + 8));
            }
        }
        float m_new[2] = {m_run[0], m_run[1]};
#pragma unroll
        for (int jb = 0; jb < POS_BLOCKS; jb++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int i = c >> 1, p = tile + jb * 8 + 2 * quad + (c & 1);
                s[jb][c] = p < end && p <= row_pos[i] ? s[jb][c] * scale : -INFINITY;  // the partition's end; causal
                m_new[i] = fmaxf(m_new[i], s[jb][c]);
            }
        float ref[2], rescale[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {  // the row's max over the four lanes that hold it
            m_new[i] = fmaxf(m_new[i], __shfl_xor_sync(0xffffffff, m_new[i], 1));
            m_new[i] = fmaxf(m_new[i], __shfl_xor_sync(0xffffffff, m_new[i], 2));
            ref[i] = m_new[i] == -INFINITY ? 0.f : m_new[i];  // as in paged_attention_partial
            rescale[i] = __expf(m_run[i] - ref[i]);
            l_run[i] *= rescale[i];
            m_run[i] = m_new[i];
        }
#pragma unroll
        for (int j = 0; j < DIM_BLOCKS; j++) {
            o[j][0] *= rescale[0]; o[j][1] *= rescale[0];
            o[j][2] *= rescale[1]; o[j][3] *= rescale[1];
        }
        // P as A fragments, one per 16 positions (two score blocks), then O += P V.
#pragma unroll
        for (int kk = 0; kk < KV_TILE / 16; kk++) {
            float p[2][4];
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    p[h][c] = __expf(s[2 * kk + h][c] - ref[c >> 1]);  // 0 where masked
                    l_run[c >> 1] += p[h][c];
                }
            const uint32_t a[4] = {pack_bf16(p[0][0], p[0][1]), pack_bf16(p[0][2], p[0][3]),
                                   pack_bf16(p[1][0], p[1][1]), pack_bf16(p[1][2], p[1][3])};
#pragma unroll
            for (int j = 0; j < DIM_BLOCKS; j++) {
                const bf16* v_col = &vt_s[j * 8 + group_id][kk * 16 + 2 * quad];
                mma_bf16(o[j], a, *reinterpret_cast<const uint32_t*>(v_col), *reinterpret_cast<const uint32_t*>(v_col + 8));
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        float l = l_run[i] + __shfl_xor_sync(0xffffffff, l_run[i], 1);
        l += __shfl_xor_sync(0xffffffff, l, 2);
        if (!row_valid[i]) continue;
        const size_t part_idx = ((size_t)row_t[i] * heads + row_h[i]) * gridDim.z + part;
#pragma unroll
        for (int j = 0; j < DIM_BLOCKS; j++)
            *reinterpret_cast<float2*>(part_acc + part_idx * HEAD_DIM + j * 8 + 2 * quad) =
                make_float2(o[j][2 * i], o[j][2 * i + 1]);
        if (quad == 0) {
            part_max[part_idx] = m_run[i];  // -inf where the partition is past this row's position
            part_sum[part_idx] = l;
        }
    }
}

// out[t, h, :] = sum_p acc_p * exp(max_p - M) / sum_p sum_p * exp(max_p - M), M = max_p max_p
// grid: (tokens, heads); block: HEAD_DIM
extern "C" __global__ void paged_attention_merge(bf16* __restrict__ out, const float* __restrict__ part_acc,
                                                 const float* __restrict__ part_max,
                                                 const float* __restrict__ part_sum, int partitions) {
    const int t = blockIdx.x, h = blockIdx.y, heads = gridDim.y, d = threadIdx.x;
    const size_t base = ((size_t)t * heads + h) * partitions;
    float m = -INFINITY;
    for (int p = 0; p < partitions; p++) m = fmaxf(m, part_max[base + p]);
    float num = 0.f, den = 0.f;
    for (int p = 0; p < partitions; p++) {
        float mp = part_max[base + p];
        if (mp == -INFINITY) continue;
        float w = __expf(mp - m);
        num += w * part_acc[(base + p) * HEAD_DIM + d];
        den += w * part_sum[base + p];
    }
    out[((size_t)t * heads + h) * HEAD_DIM + d] = to_bf16(num / den);
}
