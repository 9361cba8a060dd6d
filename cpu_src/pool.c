// The kernels' threads: parallel_for(n, chunk, fn, ctx) runs fn(ctx, begin, end) over
// [0, n) in chunks, on the calling thread and `threads - 1` workers.
//
// A thread claims its part of what is left (1 / threads of it), at least `chunk`: large
// claims first, few of them, then smaller ones, so that the threads finish together
// (where the last claims were as large as the first, one waited for the other half a
// claim, 3% of a product). Claims of a quarter of that part, as many again, were slower:
// each claim starts a new stream of weights from memory (SmolLM2's decode on 2 cores
// took 27% longer at batch 1 and 11% at batch 8).
//
// Why not OpenMP: a parallel region ends at a barrier every thread of the team must
// reach. Where the OS has lent a worker's core to another thread (the server's, another
// process's), the region waits a scheduler tick for it, even if it has nothing left to
// do; a step has hundreds of regions. Here a job is done when its chunks are: the caller
// claims chunks too, so a worker that wakes late finds none and nothing waits for it.
// A worker spins a while for the next job, then sleeps; the caller, waiting for the
// chunks others hold, yields its core to them after a while.
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

#include "common.h"

#define MAX_THREADS 256
#define SPINS 20000  // ~10-50 us of pause: longer than the Python between two kernels of a step

static struct {
    // the job, written by the caller before it publishes the job's generation
    task_fn fn;
    void *ctx;
    int n, chunk;
    // (generation << 32) | next unclaimed index: a claim is a compare-and-swap of both,
    // so that a claim can only take a chunk of the job it read
    _Atomic uint64_t state;
    atomic_int done;  // indices finished
    atomic_int sleepers;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    pthread_mutex_t caller;  // held by the thread whose job the pool runs
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER, .caller = PTHREAD_MUTEX_INITIALIZER};

int threads = 1;
static int started = 1;  // threads running, the callers' among them

// Claims and runs chunks of the current job until none are left; false if there was none.
static int work(uint32_t generation) {
    uint64_t s = atomic_load(&pool.state);
    int any = 0;
    while ((uint32_t)(s >> 32) == generation) {
        const int begin = (int)(uint32_t)s;
        if (begin >= pool.n) break;
        const int share = (pool.n - begin) / threads, size = share > pool.chunk ? share : pool.chunk;
        if (!atomic_compare_exchange_weak(&pool.state, &s, s + (uint64_t)size)) continue;
        const int end = begin + size < pool.n ? begin + size : pool.n;
        pool.fn(pool.ctx, begin, end);
        atomic_fetch_add(&pool.done, end - begin);
        any = 1;
        s = atomic_load(&pool.state);
    }
    return any;
}

static void *worker(void *arg) {
    const int index = (int)(intptr_t)arg;  // 1, 2, ...: the caller is 0
    uint32_t seen = 0;
    for (;;) {
        uint32_t generation;
        int spins = 0;
        while ((generation = (uint32_t)(atomic_load(&pool.state) >> 32)) == seen && spins++ < SPINS) _mm_pause();
        if (generation == seen) {
            pthread_mutex_lock(&pool.lock);
            atomic_fetch_add(&pool.sleepers, 1);
            while ((generation = (uint32_t)(atomic_load(&pool.state) >> 32)) == seen)
                pthread_cond_wait(&pool.wake, &pool.lock);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = generation;
        if (index < threads) work(generation);
    }
    return NULL;
}

// The threads parallel_for uses (more start as needed; they are never stopped).
void set_threads(int n) {
    threads = n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : n;
    for (; started < threads; started++) {
        pthread_t t;
        pthread_create(&t, NULL, worker, (void *)(intptr_t)started);
        pthread_detach(t);
    }
}

void parallel_for(int n, int chunk, task_fn fn, void *ctx) {
    // (alone where one thread would do, or where another thread's job holds the pool)
    if (threads == 1 || n <= chunk || pthread_mutex_trylock(&pool.caller) != 0) {
        if (n > 0) fn(ctx, 0, n);
        return;
    }
    pool.fn = fn, pool.ctx = ctx, pool.n = n, pool.chunk = chunk;
    atomic_store(&pool.done, 0);
    const uint32_t generation = (uint32_t)(atomic_load(&pool.state) >> 32) + 1;
    atomic_store(&pool.state, (uint64_t)generation << 32);
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    work(generation);
    for (int spins = 0; atomic_load(&pool.done) < n; spins++) {
        if (spins < SPINS) _mm_pause();
        else sched_yield();
    }
    pthread_mutex_unlock(&pool.caller);
}
