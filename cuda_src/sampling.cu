#include "common.cuh"

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
#define WALK_LOADS 4  // 16-byte loads a thread has in flight while it walks a row

// Calls visit(i, x[i]) for the logits this thread owns, in increasing i: with 16-byte
// loads, WALK_LOADS at a time, when rows are 16-byte aligned (vocab % 4 == 0), one
// float at a time otherwise. A row is 0.5 MB at a 128K vocabulary, and one block walks
// it: at batch 1 one load at a time would leave the walk waiting on each.
template <typename Visit>
__device__ __forceinline__ void walk_row(const float* x, int vocab, Visit visit) {
    if (vocab % 4) {
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) visit(i, x[i]);
        return;
    }
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const int n4 = vocab / 4, stride = blockDim.x;
    for (int i = threadIdx.x; i < n4; i += WALK_LOADS * stride) {
        float4 v[WALK_LOADS];
#pragma unroll
        for (int u = 0; u < WALK_LOADS; u++)
            if (i + u * stride < n4) v[u] = __ldg(x4 + i + u * stride);
#pragma unroll
        for (int u = 0; u < WALK_LOADS; u++) {
            const int j = i + u * stride;
            if (j >= n4) break;
            visit(4 * j, v[u].x);
            visit(4 * j + 1, v[u].y);
            visit(4 * j + 2, v[u].z);
            visit(4 * j + 3, v[u].w);
        }
    }
}

// Count (or mass) of probabilities p_i = exp((logit_i - max) / temperature) >= threshold
// (for one threshold: largest_threshold makes these sums for several at once).
__device__ float kept(const float* x, int vocab, float max, float inv_t, float threshold, bool mass, float* scratch) {
    float acc = 0.f;
    walk_row(x, vocab, [&](int, float logit) {
        float p = __expf((logit - max) * inv_t);
        if (p >= threshold) acc += mass ? p : 1.f;
    });
    return block_sum(acc, scratch);
}

#define SEARCH_WAYS 16  // a threshold search tries SEARCH_WAYS - 1 thresholds per pass over the vocabulary

// The largest threshold whose kept count (or mass) is still >= target, searched on the
// bits of positive floats, which order like the floats themselves. Each pass over the
// vocabulary evaluates kept() at SEARCH_WAYS - 1 evenly spaced thresholds (the same sums
// kept() makes, in the same order) and keeps the sixteenth of the range that holds the
// answer: 8 passes where a bisection makes 31, and at batch 1 this one block is all
// that runs.
__device__ float largest_threshold(const float* x, int vocab, float max, float inv_t, float target, bool mass,
                                   float* scratch) {
    uint32_t lo = 0u, hi = __float_as_uint(1.f);  // p is in (0, 1]: the answer is in [lo, hi], and kept(lo) >= target
    while (lo < hi) {
        const uint32_t step = (hi - lo + SEARCH_WAYS - 1) / SEARCH_WAYS;  // >= 1, and lo + step <= hi
        float threshold[SEARCH_WAYS - 1], acc[SEARCH_WAYS - 1];
#pragma unroll
        for (int j = 0; j < SEARCH_WAYS - 1; j++) {
            threshold[j] = __uint_as_float(lo + step * (j + 1));
            acc[j] = 0.f;
        }
        walk_row(x, vocab, [&](int, float logit) {
            float p = __expf((logit - max) * inv_t);
#pragma unroll
            for (int j = 0; j < SEARCH_WAYS - 1; j++)
                if (p >= threshold[j]) acc[j] += mass ? p : 1.f;
        });
        uint32_t next_lo = lo, next_hi = hi;  // (the same in every thread: block sums are)
#pragma unroll
        for (int j = 0; j < SEARCH_WAYS - 1; j++) {
            const uint32_t candidate = lo + step * (j + 1);
            if (candidate > hi) break;
            if (block_sum(acc[j], scratch) >= target) {
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

// One block per sampling sequence:
//   temperature 0: the first index of the largest logit;
//   else keep tokens with p >= max(top-k threshold, top-p threshold, min_p), where
//   p = exp((logit - max) / temperature), and draw one in proportion to p with
//   u = philox(seed, step).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_tokens(
    int* __restrict__ out, const float* __restrict__ logits, int vocab, const float* __restrict__ temperature,
    const float* __restrict__ top_p, const int* __restrict__ top_k, const float* __restrict__ min_p,
    const uint32_t* __restrict__ seed_lo, const uint32_t* __restrict__ seed_hi, const int* __restrict__ step) {
    await_previous_kernel();
    __shared__ float scratch[32];
    __shared__ float warp_excl[32];
    __shared__ int best_idx[32];
    __shared__ int choice;
    const int row = blockIdx.x;
    const float* x = logits + (size_t)row * vocab;

    // argmax, first index on ties
    float best = -INFINITY;
    int arg = vocab;
    walk_row(x, vocab, [&](int i, float logit) {
        if (logit > best) { best = logit; arg = i; }
    });
    float max = block_max(best, scratch);
    int cand = best == max ? arg : vocab;
    for (int o = 16; o > 0; o >>= 1) cand = min(cand, __shfl_xor_sync(0xffffffff, cand, o));
    if ((threadIdx.x & 31) == 0) best_idx[threadIdx.x >> 5] = cand;
    __syncthreads();
    if (threadIdx.x == 0) {
        int a = vocab;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) a = min(a, best_idx[w]);
        choice = a;
    }
    __syncthreads();
    const float t = temperature[row];
    if (t == 0.f) {
        if (threadIdx.x == 0) out[row] = choice;
        return;
    }
    const float inv_t = 1.f / t;
    float threshold = min_p[row];
    const int k = top_k[row];
    if (k > 0 && k < vocab) threshold = fmaxf(threshold, largest_threshold(x, vocab, max, inv_t, (float)k, false, scratch));
    if (top_p[row] < 1.f) {
        float total = kept(x, vocab, max, inv_t, 0.f, true, scratch);
        threshold = fmaxf(threshold, largest_threshold(x, vocab, max, inv_t, top_p[row] * total, true, scratch));
    }
    // The draw. Warp w owns a contiguous range of the row, which its lanes read 128
    // elements at a time (4 each, one 16-byte load): sum each warp's kept mass, scan
    // the warps' masses, and the warp whose range holds u walks it to the token.
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int span = ((vocab + warps - 1) / warps + 127) / 128 * 128;
    const int lo = min(vocab, warp * span), hi = min(vocab, lo + span);
    float mine = 0.f;
#pragma unroll 4
    for (int i = lo + 4 * lane; i < hi; i += 128) {
        float p[4];
        kept_four(x, i, hi, vocab, max, inv_t, threshold, p);
        mine += (p[0] + p[1]) + (p[2] + p[3]);
    }
    mine = warp_sum(mine);
    if (lane == 0) warp_excl[warp] = mine;
    __syncthreads();
    if (threadIdx.x == 0) {  // exclusive scan over the warps
        float run = 0.f;
        for (int w = 0; w < warps; w++) { float v = warp_excl[w]; warp_excl[w] = run; run += v; }
        uint32_t bits = philox_first_word(seed_lo[row], seed_hi[row], (uint32_t)step[row]);
        scratch[1] = (bits >> 8) * (1.f / 16777216.f) * run;  // u in [0, kept mass)
    }
    __syncthreads();
    const float u = scratch[1], start = warp_excl[warp];
    if (mine > 0.f && u >= start && u < start + mine) {  // one warp: the ranges [start, start + mine) tile [0, kept mass)
        float run = start;
        int pick = -1, last = -1;  // (the same in every lane)
        for (int base = lo; base < hi && pick < 0; base += 128) {
            const int i = base + 4 * lane;
            float p[4];
            kept_four(x, i, hi, vocab, max, inv_t, threshold, p);
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
                float r = run + through - lane_mass;
                for (int k = 0; k < 4; k++) {
                    if (p[k] <= 0.f) continue;
                    r += p[k];
                    if (u < r) { my_pick = i + k; break; }
                }
                pick = __shfl_sync(0xffffffff, my_pick, holder);
            }
            run += __shfl_sync(0xffffffff, through, 31);
        }
        if (lane == 0) choice = pick >= 0 ? pick : last;  // (rounding past the range's end: its last kept token)
    }
    __syncthreads();
    if (threadIdx.x == 0) out[row] = choice;
}
