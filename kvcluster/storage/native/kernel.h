/* The copy-and-checksum kernel, compiled once per instruction set (kernel_avx2.c, kernel_base.c).
 *
 * The checksum ("fletcher64x4") is four interleaved Fletcher sums over 64-bit
 * little-endian words: word i goes to lane i % 4, where a += w and b += a (mod 2^64).
 * A tail shorter than 32 bytes is zero-padded to one more stripe. The digest folds
 * the byte length and the eight sums a[0..3], b[0..3] into 64 bits (see `digest`).
 *
 * Why not xxh3 over the payload: on these CPUs xxh3 runs at about the speed of a
 * copy, so a checksummed read cost ~1.6x a plain copy. Two vector adds per 32 bytes,
 * done on the registers a copy loads anyway, make the checksum nearly free. `a`
 * catches every change confined to one word (any single-bit error), `b` weighs words
 * by position and so catches swapped or shifted data; both catch torn writes, zeroed
 * pages and stale blocks with probability ~1 - 2^-64. The known blind spot of sums
 * mod 2^64: paired opposite flips of the same high bit (>= 40) in one lane, some
 * 2^(64-bit) stripes apart. ZFS's default data checksum (fletcher4) is of this family.
 *
 * KVC_SUFFIX names the variant; include this header once per translation unit.
 */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>


#ifdef __AVX2__
#include <immintrin.h>
#endif

#define KVC_CAT2(a, b) a##_##b
#define KVC_CAT(a, b) KVC_CAT2(a, b)
#define KVC_FN(name) KVC_CAT(name, KVC_SUFFIX)
#define KVC_STRIPE 32
/* 256 KiB per read syscall: few syscalls, and each chunk is still in L2 when summed.
 * A multiple of 4 KiB, so O_DIRECT descriptors accept it. */
#define KVC_IO_CHUNK ((size_t)256 << 10)

typedef struct {
    uint64_t a[4], b[4];
} kvc_sums;

/* Sums `stripes` whole stripes of src; when dst is not NULL, copies them to dst on the way. */
static void KVC_FN(sum_stripes)(kvc_sums *s, void *dst, const void *src, size_t stripes) {
#ifdef __AVX2__
    __m256i a = _mm256_loadu_si256((const __m256i *)s->a), b = _mm256_loadu_si256((const __m256i *)s->b);
    const __m256i *in = (const __m256i *)src;
    __m256i *out = (__m256i *)dst;
    size_t i = 0;
    if (out != NULL) {
        for (; i + 2 <= stripes; i += 2) {
            __m256i v0 = _mm256_loadu_si256(in + i), v1 = _mm256_loadu_si256(in + i + 1);
            _mm256_storeu_si256(out + i, v0);
            _mm256_storeu_si256(out + i + 1, v1);
            a = _mm256_add_epi64(a, v0);
            b = _mm256_add_epi64(b, a);
            a = _mm256_add_epi64(a, v1);
            b = _mm256_add_epi64(b, a);
        }
    } else {
        for (; i + 2 <= stripes; i += 2) {
            a = _mm256_add_epi64(a, _mm256_loadu_si256(in + i));
            b = _mm256_add_epi64(b, a);
            a = _mm256_add_epi64(a, _mm256_loadu_si256(in + i + 1));
            b = _mm256_add_epi64(b, a);
        }
    }
    for (; i < stripes; i++) {
        __m256i v = _mm256_loadu_si256(in + i);
        if (out != NULL) _mm256_storeu_si256(out + i, v);
        a = _mm256_add_epi64(a, v);
        b = _mm256_add_epi64(b, a);
    }
    _mm256_storeu_si256((__m256i *)s->a, a);
    _mm256_storeu_si256((__m256i *)s->b, b);
#else
    const unsigned char *in = (const unsigned char *)src;
    unsigned char *out = (unsigned char *)dst;
    uint64_t a[4], b[4], w[4];
    memcpy(a, s->a, sizeof a);
    memcpy(b, s->b, sizeof b);
    for (size_t i = 0; i < stripes; i++) {
        memcpy(w, in + i * KVC_STRIPE, KVC_STRIPE);
        if (out != NULL) memcpy(out + i * KVC_STRIPE, w, KVC_STRIPE);
        for (int l = 0; l < 4; l++) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
            w[l] = __builtin_bswap64(w[l]);
#endif
            a[l] += w[l];
            b[l] += a[l];
        }
    }
    memcpy(s->a, a, sizeof a);
    memcpy(s->b, b, sizeof b);
#endif
}

/* Sums (and copies) n bytes; a partial last stripe is zero-padded, so call it once per buffer
 * or with n a multiple of 32 for every call but the last. */
static void KVC_FN(sum_bytes)(kvc_sums *s, void *dst, const void *src, size_t n) {
    size_t whole = n / KVC_STRIPE, tail = n % KVC_STRIPE;
    KVC_FN(sum_stripes)(s, dst, src, whole);
    if (tail) {
        unsigned char last[KVC_STRIPE] = {0};
        memcpy(last, (const unsigned char *)src + whole * KVC_STRIPE, tail);
        if (dst != NULL) memcpy((unsigned char *)dst + whole * KVC_STRIPE, last, tail);
        KVC_FN(sum_stripes)(s, NULL, last, 1);
    }
}

#ifndef KVC_GOLDEN
#define KVC_GOLDEN 0x9E3779B97F4A7C15ULL /* 2^64 / golden ratio: spreads the word indices apart */

/* MurmurHash3's 64-bit finalizer: a bijection whose every output bit depends on every input bit. */
static inline uint64_t kvc_fmix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDULL;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ULL;
    x ^= x >> 33;
    return x;
}
#endif

/* The digest: the byte length, then each of the eight sums (tagged with its place), mixed and
 * chained through the finalizer. Every step is a bijection of the chain value for a fixed word and
 * of the word for a fixed chain value, so a change confined to one sum always changes the digest;
 * changes in several collide with probability ~2^-64. */
static uint64_t KVC_FN(digest)(const kvc_sums *s, size_t n) {
    uint64_t h = kvc_fmix64((uint64_t)n ^ KVC_GOLDEN);
    for (int l = 0; l < 4; l++) h = kvc_fmix64(h ^ kvc_fmix64(s->a[l] + KVC_GOLDEN * (uint64_t)(l + 1)));
    for (int l = 0; l < 4; l++) h = kvc_fmix64(h ^ kvc_fmix64(s->b[l] + KVC_GOLDEN * (uint64_t)(l + 5)));
    return h;
}

uint64_t KVC_FN(kvc_hash)(const void *src, size_t n) {
    kvc_sums s = {{0}, {0}};
    KVC_FN(sum_bytes)(&s, NULL, src, n);
    return KVC_FN(digest)(&s, n);
}

uint64_t KVC_FN(kvc_copy_hash)(void *dst, const void *src, size_t n) {
    kvc_sums s = {{0}, {0}};
    KVC_FN(sum_bytes)(&s, dst, src, n);
    return KVC_FN(digest)(&s, n);
}

/* The digest of `count` buffers as if they were one (srcs[i] of lens[i] bytes, in order): a block whose bytes
 * lie scattered, such as an engine's pages of it, one per layer. A stripe may straddle two buffers. */
uint64_t KVC_FN(kvc_hash_segments)(const void *const *srcs, const size_t *lens, size_t count) {
    kvc_sums s = {{0}, {0}};
    unsigned char carry[KVC_STRIPE];
    size_t held = 0, total = 0;
    for (size_t i = 0; i < count; i++) {
        const unsigned char *p = (const unsigned char *)srcs[i];
        size_t n = lens[i];
        total += n;
        if (held) {  /* finish the stripe the last buffer began */
            size_t take = n < KVC_STRIPE - held ? n : KVC_STRIPE - held;
            memcpy(carry + held, p, take);
            held += take;
            p += take;
            n -= take;
            if (held < KVC_STRIPE) continue;
            KVC_FN(sum_stripes)(&s, NULL, carry, 1);
            held = 0;
        }
        size_t whole = n / KVC_STRIPE;
        KVC_FN(sum_stripes)(&s, NULL, p, whole);
        held = n - whole * KVC_STRIPE;
        memcpy(carry, p + whole * KVC_STRIPE, held);
    }
    if (held) {
        memset(carry + held, 0, KVC_STRIPE - held);
        KVC_FN(sum_stripes)(&s, NULL, carry, 1);
    }
    return KVC_FN(digest)(&s, total);
}

/* Reads up to n bytes at offset into dst, summing each chunk as it lands.
 * Returns the bytes read (short at end of file), or -errno. */
ptrdiff_t KVC_FN(kvc_pread_hash)(int fd, void *dst, size_t n, int64_t offset, uint64_t *digest) {
    kvc_sums s = {{0}, {0}};
    size_t done = 0, summed = 0;
    while (done < n) {
        size_t want = n - done < KVC_IO_CHUNK ? n - done : KVC_IO_CHUNK;
        ssize_t got = pread(fd, (char *)dst + done, want, (off_t)(offset + (int64_t)done));
        if (got < 0) {
            if (errno == EINTR) continue;
            return -(ptrdiff_t)errno;
        }
        if (got == 0) break;
        done += (size_t)got;
        size_t ready = (done - summed) / KVC_STRIPE;  /* whole stripes only; the tail waits for the end */
        KVC_FN(sum_stripes)(&s, NULL, (const char *)dst + summed, ready);
        summed += ready * KVC_STRIPE;
    }
    KVC_FN(sum_bytes)(&s, NULL, (const char *)dst + summed, done - summed);
    *digest = KVC_FN(digest)(&s, done);
    return (ptrdiff_t)done;
}

/* Writes n bytes of src at offset, each chunk summed just before its write: the sum brings the chunk into
 * cache and the write copies it from there, so the file tier's put costs about a plain write, with no
 * second pass over the payload and no thread to hand it to. Returns n, or -errno (nothing about how much of
 * the file was written then: the caller discards it). */
ptrdiff_t KVC_FN(kvc_pwrite_hash)(int fd, const void *src, size_t n, int64_t offset, uint64_t *digest) {
    kvc_sums s = {{0}, {0}};
    size_t done = 0;
    while (done < n) {
        size_t want = n - done < KVC_IO_CHUNK ? n - done : KVC_IO_CHUNK;
        size_t whole = want / KVC_STRIPE;  /* whole stripes; only the buffer's last chunk has a tail */
        KVC_FN(sum_stripes)(&s, NULL, (const char *)src + done, whole);
        if (want % KVC_STRIPE) KVC_FN(sum_bytes)(&s, NULL, (const char *)src + done + whole * KVC_STRIPE,
                                                  want % KVC_STRIPE);
        size_t written = 0;
        while (written < want) {
            ssize_t put = pwrite(fd, (const char *)src + done + written, want - written,
                                 (off_t)(offset + (int64_t)(done + written)));
            if (put < 0) {
                if (errno == EINTR) continue;
                return -(ptrdiff_t)errno;
            }
            if (put == 0) return -(ptrdiff_t)EIO;
            written += (size_t)put;
        }
        done += want;
    }
    *digest = KVC_FN(digest)(&s, n);
    return (ptrdiff_t)n;
}
