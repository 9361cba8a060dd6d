#include "common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#define TILE 32              // context positions per shared-memory tile: one per lane
#define DIMS_PER_LANE (HEAD_DIM / 32)

// Causal grouped-query attention over the paged KV cache, for decode and for
// (chunked) prefill alike: query token t of sequence s at position p attends to
// positions 0..p of s, whose K/V sit in cache slots block_table[s][j / bs] * bs + j % bs.
//
//   out[t, h, :] = sum_j softmax_j(q[t, h] . k[j, h / group] * scale) v[j, h / group]
//
// Pass 1 (paged_attention_partial): grid (tokens, kv_heads, partitions), one warp per
// query head of the kv head's group, so each K/V tile is read once for the whole
// group. Each block covers `partition` context positions and leaves an unnormalised
// partial result with its running max and sum (online softmax), so long contexts
// spread over many blocks. Pass 2 (paged_attention_merge) rescales and sums them.
extern "C" __global__ void paged_attention_partial(
    float* __restrict__ part_acc,     // [tokens, heads, partitions, HEAD_DIM]
    float* __restrict__ part_max,     // [tokens, heads, partitions]
    float* __restrict__ part_sum,     // [tokens, heads, partitions]
    const bf16* __restrict__ qkv,     // [tokens, (heads + 2 kv_heads) * HEAD_DIM], q rotated
    const bf16* __restrict__ k_cache, // [slots, kv_heads, HEAD_DIM]
    const bf16* __restrict__ v_cache,
    const int* __restrict__ block_tables, int max_blocks,  // [seqs, max_blocks]
    const int* __restrict__ token_seq, const int* __restrict__ positions,
    int heads, int kv_heads, int block_size, int partition, float scale) {
    __shared__ float q_s[8][HEAD_DIM];
    __shared__ bf16 k_s[TILE][HEAD_DIM + 2];  // +2: rows start on different banks
    __shared__ bf16 v_s[TILE][HEAD_DIM];

    const int t = blockIdx.x, kvh = blockIdx.y, part = blockIdx.z;
    const int group = heads / kv_heads;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h = kvh * group + warp;
    const int ctx = positions[t] + 1;
    const int begin = part * partition, end = min(ctx, begin + partition);
    const size_t part_idx = ((size_t)t * heads + h) * gridDim.z + part;
    const int* table = block_tables + (size_t)token_seq[t] * max_blocks;

    const size_t width = (size_t)(heads + 2 * kv_heads) * HEAD_DIM;
    for (int d = lane; d < HEAD_DIM; d += 32) q_s[warp][d] = to_f32(qkv[t * width + (size_t)h * HEAD_DIM + d]) * scale;

    float m = -INFINITY, l = 0.f, acc[DIMS_PER_LANE];
#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; i++) acc[i] = 0.f;

    for (int tile = begin; tile < end; tile += TILE) {
        const int n = min(TILE, end - tile);
        __syncthreads();  // the previous tile is consumed (and q_s written, the first time)
        for (int e = threadIdx.x; e < n * HEAD_DIM; e += blockDim.x) {
            int j = e / HEAD_DIM, d = e % HEAD_DIM, pos = tile + j;
            size_t slot = (size_t)table[pos / block_size] * block_size + pos % block_size;
            size_t idx = (slot * kv_heads + kvh) * HEAD_DIM + d;
            k_s[j][d] = k_cache[idx];
            v_s[j][d] = v_cache[idx];
        }
        __syncthreads();
        float score = -INFINITY;
        if (lane < n) {
            score = 0.f;
#pragma unroll 8
            for (int d = 0; d < HEAD_DIM; d++) score += q_s[warp][d] * to_f32(k_s[lane][d]);
        }
        float m_new = fmaxf(m, warp_max(score));
        float p = lane < n ? __expf(score - m_new) : 0.f;
        float rescale = __expf(m - m_new);  // 0 on the first tile (m = -inf)
        l = l * rescale + warp_sum(p);
#pragma unroll
        for (int i = 0; i < DIMS_PER_LANE; i++) acc[i] *= rescale;
        for (int j = 0; j < n; j++) {
            float pj = __shfl_sync(0xffffffff, p, j);
#pragma unroll
            for (int i = 0; i < DIMS_PER_LANE; i++) acc[i] += pj * to_f32(v_s[j][lane + 32 * i]);
        }
        m = m_new;
    }
#pragma unroll
    for (int i = 0; i < DIMS_PER_LANE; i++) part_acc[part_idx * HEAD_DIM + lane + 32 * i] = acc[i];
    if (lane == 0) {
        part_max[part_idx] = m;  // -inf for a partition past the context: it adds nothing
        part_sum[part_idx] = l;
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
