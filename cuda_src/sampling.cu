#include <cooperative_groups.h>

#include "common.cuh"

namespace cg = cooperative_groups;

// Sampling on the GPU: only the chosen token ids go back to the host.

// Penalties and banned tokens, one thread per (sequence, token) entry the host lists:
//   repetition: logit / r if logit > 0 else logit * r   (tokens of prompt and output)
//   presence and frequency: logit -= frequency * count + presence * (count > 0)  (output)
//   banned (eos and stop tokens before min_tokens): -inf
extern "C" __global__ void apply_penalties(float* __restrict__ logits, int vocab, int entries,
                                           const int* __restrict__ entry_row, const int* __restrict__ entry_token,
                                           const int* __restrict__ entry_count, const int* __restrict__ entry_banned,
                                           const float* __restrict__ repetition, const float* __restrict__ presence,
                                           const float* __restrict__ frequency) {
    await_previous_kernel();
    int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= entries) return;
    int row = entry_row[e];
    float* x = logits + (size_t)row * vocab + entry_token[e];
    if (entry_banned[e]) {
        *x = -INFINITY;
        return;
    }
    float v = *x, r = repetition[row];
    v = v > 0.f ? v / r : v * r;
    int count = entry_count[e];
    v -= frequency[row] * count + presence[row] * (count > 0);
    *x = v;
}

// Structured output: logits[rows[r], t] = -inf for every token t whose bit is clear in
// mask row r (llguidance's bitmask: bit t % 32 of word t / 32), for the n rows listed.
// One thread a word; a word with every bit set (most of them, in a JSON string) is one
// load and no store. Grid (word blocks, n).
extern "C" __global__ void apply_token_bitmask(float* __restrict__ logits, const int* __restrict__ masks,
                                               const int* __restrict__ rows, int words, int vocab) {
    await_previous_kernel();
    const int r = blockIdx.y, w = blockIdx.x * blockDim.x + threadIdx.x;
    if (w >= words) return;
    const unsigned bits = masks[(size_t)r * words + w];
    if (bits == 0xFFFFFFFFu) return;
    float* x = logits + (size_t)rows[r] * vocab + w * 32;
    const int n = min(32, vocab - w * 32);
    for (int i = 0; i < n; i++)
        if (!((bits >> i) & 1u)) x[i] = -INFINITY;
}

// Philox4x32-10 (Salmon et al., 2011): a counter-based generator, so a request's
// draw depends only on its seed and its step, never on the rest of the batch.
__device__ uint32_t philox_first_word(uint32_t k0, uint32_t k1, uint32_t c0) {
    uint32_t c[4] = {c0, 0u, 0u, 0u};
    for (int round = 0; round < 10; round++) {
        uint32_t hi0 = __umulhi(0xD2511F53u, c[0]), lo0 = 0xD2511F53u * c[0];
        uint32_t hi1 = __umulhi(0xCD9E8D57u, c[2]), lo1 = 0xCD9E8D57u * c[2];
        uint32_t n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0; c[1] = lo1; c[2] = n2; c[3] = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c[0];
}

#define SAMPLE_THREADS 1024
#define SAMPLE_CLUSTER 8  // blocks per row, one thread-block cluster: each walks an eighth of the row
#define WALK_LOADS 4      // 16-byte loads a thread has in flight while it walks its slice
#define SEARCH_WAYS 16    // a threshold search tries SEARCH_WAYS - 1 thresholds per pass over the vocabulary

// One row is sampled by a cluster of SAMPLE_CLUSTER blocks (Hopper's thread-block
// clusters): block r walks the r-th contiguous slice of the row, and the blocks combine
// their partial results through distributed shared memory, in block-rank order. With a
// block a row, a batch-1 step walked all 128K logits some 19 times on one SM (a sampled
// step took 0.4 ms more than a greedy one); the cluster spreads the walks over
// SAMPLE_CLUSTER SMs. Every sum is taken in an order
// fixed by the vocabulary size alone (threads, warps, then blocks by rank), so a row's
// token does not depend on the rest of the batch.
struct RowSlice {
    const float* x;  // the row
    int vocab, begin, end;  // this block's part of it: [begin, end)
};

__device__ __forceinline__ RowSlice row_slice(const float* x, int vocab, unsigned rank) {
    const int span = ((vocab + SAMPLE_CLUSTER - 1) / SAMPLE_CLUSTER + 127) / 128 * 128;  // (whole 16-byte loads of warps)
    const int begin = min(vocab, (int)rank * span);
    return {x, vocab, begin, min(vocab, begin + span)};
}

// Calls visit(i, x[i]) for the logits of the slice this thread owns, in increasing i:
// with 16-byte loads, WALK_LOADS at a time, when rows are 16-byte aligned (vocab % 4 ==
// 0), one float at a time otherwise.
template <typename Visit>
__device__ __forceinline__ void walk_row(const RowSlice& r, Visit visit) {
    if (r.vocab % 4) {
        for (int i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) visit(i, r.x[i]);
        return;
    }
    const float4* x4 = reinterpret_cast<const float4*>(r.x);
    const int end4 = r.end / 4, stride = blockDim.x;  // (begin and end are multiples of 4)
    for (int i = r.begin / 4 + threadIdx.x; i < end4; i += WALK_LOADS * stride) {
        float4 v[WALK_LOADS];
#pragma unroll
        for (int u = 0; u < WALK_LOADS; u++)
            if (i + u * stride < end4) v[u] = __ldg(x4 + i + u * stride);
#pragma unroll
        for (int u = 0; u < WALK_LOADS; u++) {
            const int j = i + u * stride;
            if (j >= end4) break;
            visit(4 * j, v[u].x);
            visit(4 * j + 1, v[u].y);
            visit(4 * j + 2, v[u].z);
            visit(4 * j + 3, v[u].w);
        }
    }
}

struct Least { __device__ int operator()(int a, int b) const { return ::min(a, b); } };

// v[j] (the block's values, the same in all its threads) becomes op over the cluster's
// blocks of their v[j], in rank order, in every thread. `turn` alternates the shared
// buffer, so that one cluster barrier a call suffices: a block writes a buffer again
// only two calls later, after every block has passed the barrier between.
template <typename T, int N, typename Op>
__device__ __forceinline__ void cluster_reduce(T (&v)[N], int& turn, Op op) {
    __shared__ T parts[2][SEARCH_WAYS], totals[SEARCH_WAYS];
    static_assert(N <= SEARCH_WAYS, "parts holds SEARCH_WAYS values");
    cg::cluster_group cluster = cg::this_cluster();
    if (threadIdx.x == 0) {
#pragma unroll
        for (int j = 0; j < N; j++) parts[turn][j] = v[j];
    }
    cluster.sync();
    if (threadIdx.x < N) {
        T* mine = &parts[turn][threadIdx.x];
        T acc = *cluster.map_shared_rank(mine, 0);
        for (int r = 1; r < SAMPLE_CLUSTER; r++) acc = op(acc, *cluster.map_shared_rank(mine, r));
        totals[threadIdx.x] = acc;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < N; j++) v[j] = totals[j];
    turn ^= 1;
}

__device__ __forceinline__ float cluster_sum(float v, int& turn, float* scratch) {
    float total[1] = {block_sum(v, scratch)};
    cluster_reduce(total, turn, Add());
    return total[0];
}

// Count (or mass) of probabilities p_i = exp((logit_i - max) / temperature) >= threshold
// over the row (for one threshold: largest_threshold makes these sums for several at once).
__device__ float kept(const RowSlice& r, float max, float inv_t, float threshold, bool mass, int& turn, float* scratch) {
    float acc = 0.f;
    walk_row(r, [&](int, float logit) {
        float p = __expf((logit - max) * inv_t);
        if (p >= threshold) acc += mass ? p : 1.f;
    });
    return cluster_sum(acc, turn, scratch);
}

// The largest threshold whose kept count (or mass) is still >= target, searched on the
// bits of positive floats, which order like the floats themselves. Each pass over the
// vocabulary evaluates kept() at SEARCH_WAYS - 1 evenly spaced thresholds (the same sums
// kept() makes, in the same order) and keeps the sixteenth of the range that holds the
// answer: 8 passes where a bisection makes 31.
__device__ float largest_threshold(const RowSlice& r, float max, float inv_t, float target, bool mass, int& turn,
                                   float* scratch) {
    uint32_t lo = 0u, hi = __float_as_uint(1.f);  // p is in (0, 1]: the answer is in [lo, hi], and kept(lo) >= target
    while (lo < hi) {  // (the same in every thread of the cluster: the sums are)
        const uint32_t step = (hi - lo + SEARCH_WAYS - 1) / SEARCH_WAYS;  // >= 1, and lo + step <= hi
        float threshold[SEARCH_WAYS - 1], acc[SEARCH_WAYS - 1];
#pragma unroll
        for (int j = 0; j < SEARCH_WAYS - 1; j++) {
            threshold[j] = __uint_as_float(lo + step * (j + 1));
            acc[j] = 0.f;
        }
        walk_row(r, [&](int, float logit) {
            float p = __expf((logit - max) * inv_t);
#pragma unroll
            for (int j = 0; j < SEARCH_WAYS - 1; j++)
                if (p >= threshold[j]) acc[j] += mass ? p : 1.f;
        });
#pragma unroll
        for (int j = 0; j < SEARCH_WAYS - 1; j++) acc[j] = block_sum(acc[j], scratch);
        cluster_reduce(acc, turn, Add());
        uint32_t next_lo = lo, next_hi = hi;
#pragma unroll
        for (int j = 0; j < SEARCH_WAYS - 1; j++) {
            const uint32_t candidate = lo + step * (j + 1);
            if (candidate > hi) break;
            if (acc[j] >= target) {
                next_lo = candidate;
            } else {
                next_hi = candidate - 1;
                break;
            }
        }
        lo = next_lo;
        hi = next_hi;
    }
    return __uint_as_float(lo);
}

// p_k = exp((x[i + k] - max) / t) for k < 4 where that token is kept (p_k >= threshold,
// i + k < end), else 0. One 16-byte load when rows are 16-byte aligned.
__device__ __forceinline__ void kept_four(const float* x, int i, int end, int vocab, float max, float inv_t,
                                          float threshold, float p[4]) {
    float v[4];
    if (vocab % 4 == 0 && i + 3 < end) {  // (i is a multiple of 4: see the draw's ranges)
        const float4 q = __ldg(reinterpret_cast<const float4*>(x + i));
        v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
    } else {
        for (int k = 0; k < 4; k++) v[k] = i + k < end ? x[i + k] : -INFINITY;
    }
    for (int k = 0; k < 4; k++) {
        const float e = __expf((v[k] - max) * inv_t);
        p[k] = i + k < end && e >= threshold ? e : 0.f;
    }
}

// The last of the four tokens at i that kept_four kept, or -1.
__device__ __forceinline__ int last_kept(const float p[4], int i) {
    int last = -1;
    for (int k = 0; k < 4; k++)
        if (p[k] > 0.f) last = i + k;
    return last;
}

// The first index of the row's largest logit, in every thread of the cluster.
__device__ int cluster_argmax(const RowSlice& r, float& max, int& turn, float* scratch) {
    __shared__ int best_idx[32];
    float best = -INFINITY;
    int arg = r.vocab;
    walk_row(r, [&](int i, float logit) {
        if (logit > best) { best = logit; arg = i; }
    });
    float m[1] = {block_max(best, scratch)};
    cluster_reduce(m, turn, Max());
    max = m[0];
    int cand = best == max ? arg : r.vocab;
    for (int o = 16; o > 0; o >>= 1) cand = min(cand, __shfl_xor_sync(0xffffffff, cand, o));
    if ((threadIdx.x & 31) == 0) best_idx[threadIdx.x >> 5] = cand;
    __syncthreads();
    int first[1] = {r.vocab};
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) first[0] = ::min(first[0], best_idx[w]);
    cluster_reduce(first, turn, Least());
    return first[0];
}

// One cluster of SAMPLE_CLUSTER blocks per sampling sequence (grid: SAMPLE_CLUSTER x rows):
//   temperature 0: the first index of the largest logit;
//   else keep tokens with p >= max(top-k threshold, top-p threshold, min_p), where
//   p = exp((logit - max) / temperature), and draw one in proportion to p with
//   u = philox(seed, step).
// A block reads another's shared memory only between two cluster barriers, and leaves
// only after the last of them.
extern "C" __global__ void __cluster_dims__(SAMPLE_CLUSTER, 1, 1) __launch_bounds__(SAMPLE_THREADS) sample_tokens(
    int* __restrict__ out, const float* __restrict__ logits, int vocab, const float* __restrict__ temperature,
    const float* __restrict__ top_p, const int* __restrict__ top_k, const float* __restrict__ min_p,
    const uint32_t* __restrict__ seed_lo, const uint32_t* __restrict__ seed_hi, const int* __restrict__ step) {
    await_previous_kernel();
    __shared__ float scratch[32];
    cg::cluster_group cluster = cg::this_cluster();
    const int row = blockIdx.y;
    const int rank = (int)cluster.block_rank();
    const RowSlice r = row_slice(logits + (size_t)row * vocab, vocab, rank);
    int turn = 0;  // (cluster_reduce's buffer)

    float max;
    const int argmax = cluster_argmax(r, max, turn, scratch);
    const float t = temperature[row];
    if (t == 0.f) {
        cluster.sync();
        if (rank == 0 && threadIdx.x == 0) out[row] = argmax;
        return;
    }
    const float inv_t = 1.f / t;
    float threshold = min_p[row];
    const int k = top_k[row];
    if (k > 0 && k < vocab) threshold = fmaxf(threshold, largest_threshold(r, max, inv_t, (float)k, false, turn, scratch));
    if (top_p[row] < 1.f) {
        float total = kept(r, max, inv_t, 0.f, true, turn, scratch);
        threshold = fmaxf(threshold, largest_threshold(r, max, inv_t, top_p[row] * total, true, turn, scratch));
    }

    // The draw. Warp w of each block owns a contiguous range of the block's slice, which
    // its lanes read 128 elements at a time (4 each, one 16-byte load). The running sum
    // of the blocks' kept masses, in rank order, tiles [0, kept mass) with one range a
    // block, and u falls in one of them; in that block the running sum of the warps'
    // masses picks the warp (the last warp with mass also takes what rounding leaves past
    // the sum), and the warp walks its range to the token.
    __shared__ float warp_mass[32], warp_from[32], masses[SAMPLE_CLUSTER];
    __shared__ float kept_mass, block_from, block_until;
    __shared__ int last_warp;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int span = ((r.end - r.begin + warps - 1) / warps + 127) / 128 * 128;
    const int lo = min(r.end, r.begin + warp * span), hi = min(r.end, lo + span);
    float mine = 0.f;
#pragma unroll 4
    for (int i = lo + 4 * lane; i < hi; i += 128) {
        float p[4];
        kept_four(r.x, i, hi, vocab, max, inv_t, threshold, p);
        mine += (p[0] + p[1]) + (p[2] + p[3]);
    }
    mine = warp_sum(mine);
    if (lane == 0) warp_mass[warp] = mine;
    __syncthreads();
    if (threadIdx.x == 0) {
        float block_mass = 0.f;
        for (int w = 0; w < warps; w++) block_mass += warp_mass[w];
        masses[rank] = block_mass;
    }
    cluster.sync();
    if (threadIdx.x == 0) {
        float run = 0.f;
        for (int b = 0; b < SAMPLE_CLUSTER; b++) {
            if (b == rank) block_from = run;
            run += *cluster.map_shared_rank(&masses[b], b);
            if (b == rank) block_until = run;  // (the next block's start: the same sum)
        }
        kept_mass = run;
        float warp_run = block_from;
        int last = -1;
        for (int w = 0; w < warps; w++) {
            warp_from[w] = warp_run;
            warp_run += warp_mass[w];
            if (warp_mass[w] > 0.f) last = w;
        }
        last_warp = last;
    }
    cluster.sync();  // every block's mass is read: from here each block keeps to its own memory
    const uint32_t bits = philox_first_word(seed_lo[row], seed_hi[row], (uint32_t)step[row]);
    const float u = (bits >> 8) * (1.f / 16777216.f) * kept_mass;  // in [0, kept mass)
    if (!(u >= block_from && u < block_until)) return;  // another block's range holds u
    if (!(warp_mass[warp] > 0.f && u >= warp_from[warp] && (warp == last_warp || u < warp_from[warp + 1]))) return;
    float run = warp_from[warp];
    int pick = -1, last = -1;  // (the same in every lane)
    for (int base = lo; base < hi && pick < 0; base += 128) {
        const int i = base + 4 * lane;
        float p[4];
        kept_four(r.x, i, hi, vocab, max, inv_t, threshold, p);
        const float lane_mass = (p[0] + p[1]) + (p[2] + p[3]);
        float through = lane_mass;  // inclusive scan over the lanes
        for (int o = 1; o < 32; o <<= 1) {
            const float before = __shfl_up_sync(0xffffffff, through, o);
            if (lane >= o) through += before;
        }
        const int my_last = last_kept(p, i);
        int step_last = my_last;
        for (int o = 16; o > 0; o >>= 1) step_last = ::max(step_last, __shfl_xor_sync(0xffffffff, step_last, o));
        if (step_last >= 0) last = step_last;
        // the first lane with mass whose slice ends past u holds it, if any does
        const unsigned holders = __ballot_sync(0xffffffff, lane_mass > 0.f && u < run + through);
        if (holders) {
            const int holder = __ffs(holders) - 1;
            int my_pick = my_last;  // (where rounding that runs past u lands)
            float r_run = run + through - lane_mass;
            for (int k4 = 0; k4 < 4; k4++) {
                if (p[k4] <= 0.f) continue;
                r_run += p[k4];
                if (u < r_run) { my_pick = i + k4; break; }
            }
            pick = __shfl_sync(0xffffffff, my_pick, holder);
        }
        run += __shfl_sync(0xffffffff, through, 31);
    }
    if (lane == 0) out[row] = pick >= 0 ? pick : last;  // (rounding past the range's end: its last kept token)
}
