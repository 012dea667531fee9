/* All-reduce, all-gather and all-to-all among the ranks of one host through a shared memory mapping.
 *
 * gloo costs ~0.5 ms per all-reduce of a decode step's [rows, hidden] tensor here, two per layer;
 * this costs a copy in, one barrier and a read of every rank's copy. Layout of the mapping: one
 * 64-byte flag line per rank, then two buffers (alternate calls use alternate ones) of one slot
 * per rank. A call writes its data into its slot, publishes its sequence number and waits until
 * every rank has published it; the next call uses the other buffer, and the one after that may
 * reuse this one because every rank has by then published the call in between, which it does
 * only after it finished reading. Every rank sums the slots in rank order, so all get the same
 * bits. No SIMD: the compiler vectorises the loops, and this builds on any CPU.
 */
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "shoal_abi.h" /* ShmComm, mirrored by Python (abi.py) */

static volatile uint64_t *flag(const ShmComm *c, int64_t r) { return (volatile uint64_t *)(c->base + 64 * r); }

static char *slot(const ShmComm *c, uint64_t seq, int64_t r) {
    return c->base + 64 * c->world + ((seq & 1) * c->world + r) * c->slot_bytes;
}

int64_t shoal_shm_bytes(int64_t world, int64_t slot_bytes) { return 64 * world + 2 * world * slot_bytes; }

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Publishes this rank's call `seq` and waits for every rank to publish it; 0, or -1 on timeout. */
static int barrier(ShmComm *c, uint64_t seq) {
    __atomic_store_n(flag(c, c->rank), seq, __ATOMIC_RELEASE);
    double start = 0;
    for (int64_t r = 0; r < c->world; r++) {
        uint64_t spins = 0;
        while (__atomic_load_n(flag(c, r), __ATOMIC_ACQUIRE) < seq) {
            if (++spins < 4096) continue;
            /* Ranks may outnumber cores: give the core away rather than spin against a peer. */
            sched_yield();
            if ((spins & 1023) == 0) {
                if (start == 0) start = now_s();
                else if (now_s() - start > c->timeout_s) {
                    c->failed = 1;
                    return -1;
                }
            }
        }
    }
    return 0;
}

/* buf [n] floats: summed across ranks, in place. 0, or -1 when a peer did not arrive in time. */
static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int done(ShmComm *c, int64_t t0, int rc) {
    c->busy_ns += now_ns() - t0;
    c->calls++;
    return rc;
}

int shoal_shm_allreduce(ShmComm *c, float *buf, int64_t n) {
    if (c->failed) return -1;
    const int64_t t0 = now_ns();
    const int64_t per = c->slot_bytes / (int64_t)sizeof(float);
    for (int64_t off = 0; off < n; off += per) {
        const int64_t len = n - off < per ? n - off : per;
        const uint64_t seq = ++c->seq;
        memcpy(slot(c, seq, c->rank), buf + off, sizeof(float) * len);
        if (barrier(c, seq)) return done(c, t0, -1);
        float *out = buf + off;
        const float *first = (const float *)slot(c, seq, 0);
        for (int64_t i = 0; i < len; i++) out[i] = first[i];
        for (int64_t r = 1; r < c->world; r++) {
            const float *part = (const float *)slot(c, seq, r);
            for (int64_t i = 0; i < len; i++) out[i] += part[i];
        }
    }
    return done(c, t0, 0);
}

/* src [nbytes] from every rank into dst [world, nbytes], in rank order. 0, or -1 on timeout. */
int shoal_shm_allgather(ShmComm *c, const char *src, int64_t nbytes, char *dst) {
    if (c->failed) return -1;
    const int64_t t0 = now_ns();
    for (int64_t off = 0; off < nbytes; off += c->slot_bytes) {
        const int64_t len = nbytes - off < c->slot_bytes ? nbytes - off : c->slot_bytes;
        const uint64_t seq = ++c->seq;
        memcpy(slot(c, seq, c->rank), src + off, len);
        if (barrier(c, seq)) return done(c, t0, -1);
        for (int64_t r = 0; r < c->world; r++) memcpy(dst + r * nbytes + off, slot(c, seq, r), len);
    }
    return done(c, t0, 0);
}

/* All-to-all of variable sizes. bytes [world][world] (the same on every rank): bytes[s][d] is what
 * rank s sends rank d; src holds this rank's sends by destination in rank order, dst receives by
 * source in rank order. Every rank copies its whole src through its slot in slices, as many as
 * the largest sender needs, and each reads from every slot only the part addressed to it.
 * 0, or -1 on timeout. */
int shoal_shm_alltoall(ShmComm *c, const char *src, const int64_t *bytes, char *dst) {
    if (c->failed) return -1;
    const int64_t t0 = now_ns(), w = c->world, me = c->rank;
    int64_t longest = 0, mine = 0;
    for (int64_t s = 0; s < w; s++) {
        int64_t total = 0;
        for (int64_t d = 0; d < w; d++) total += bytes[s * w + d];
        if (total > longest) longest = total;
        if (s == me) mine = total;
    }
    for (int64_t off = 0; off < longest; off += c->slot_bytes) {
        const int64_t end = off + c->slot_bytes;
        const uint64_t seq = ++c->seq;
        if (off < mine) memcpy(slot(c, seq, me), src + off, (mine < end ? mine : end) - off);
        if (barrier(c, seq)) return done(c, t0, -1);
        int64_t into = 0; /* where source s's part for this rank starts in dst */
        for (int64_t s = 0; s < w; s++) {
            int64_t from = 0; /* where s's part for this rank starts in s's src */
            for (int64_t d = 0; d < me; d++) from += bytes[s * w + d];
            const int64_t len = bytes[s * w + me];
            const int64_t lo = from > off ? from : off, hi = from + len < end ? from + len : end;
            if (hi > lo) memcpy(dst + into + (lo - from), slot(c, seq, s) + (lo - off), hi - lo);
            into += len;
        }
    }
    return done(c, t0, 0);
}
