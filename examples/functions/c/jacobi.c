/* One Jacobi iteration for A x = b, on a block of rows: each node computes
 * its rows of x' from the whole previous x.
 *
 * Input (little-endian host): a 16-byte header {u32 n, u32 rows_begin,
 * u32 rows_end, u32 reserved = 0}, then A (n×n f64, row-major), b (n f64)
 * and x (n f64). Output: for i in [rows_begin, rows_end),
 * x'[i] = (b[i] - sum_{j != i} A[i][j] x[j]) / A[i][i] (f64 each); returns
 * (rows_end - rows_begin)*8. A zero diagonal gives inf or NaN, as the
 * arithmetic does. Returns 0, writing nothing, when in_len does not match
 * the header, when rows_begin > rows_end or rows_end > n, when reserved is
 * not 0, or when in or out is not 8-byte aligned. */
#include <stdint.h>
#include <string.h>

uint32_t jacobi(void *in, uint32_t in_len, void *out)
{
    uint32_t h[4];
    if (in_len < sizeof h || ((uintptr_t)in | (uintptr_t)out) % sizeof(double))
        return 0;
    memcpy(h, in, sizeof h);
    uint64_t n = h[0], begin = h[1], end = h[2];
    /* n*n fits a u64; bounding it by u32 keeps the byte count from
     * overflowing. */
    if (h[3] != 0 || begin > end || end > n || n * n > UINT32_MAX)
        return 0;
    if ((uint64_t)in_len != sizeof h + 8 * (n * n + 2 * n))
        return 0;

    const double *a = (const double *)((const char *)in + sizeof h);
    const double *b = a + n * n;
    const double *x = b + n;
    double *next = out;
    for (uint64_t i = begin; i < end; i++) {
        const double *ai = a + i * n;
        double sum = 0.0;
        for (uint64_t j = 0; j < n; j++)
            if (j != i)
                sum += ai[j] * x[j];
        next[i - begin] = (b[i] - sum) / ai[i];
    }
    return (uint32_t)((end - begin) * 8);
}
