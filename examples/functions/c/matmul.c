/* Matrix multiplication of a row block: what a job offloads when it sends
 * part of C = A·B to another node's cores.
 *
 * Input (little-endian host): a 16-byte header {u32 rows, u32 n, u32 k,
 * u32 reserved = 0}, then A (rows×n f64, row-major), then B (n×k f64,
 * row-major). Output: C = A·B (rows×k f64, row-major); returns rows*k*8.
 * Returns 0, writing nothing, when in_len does not match the header, when
 * reserved is not 0, when the output would not fit a u32 length, or when in
 * or out is not 8-byte aligned (rfaas always passes aligned buffers). */
#include <stdint.h>
#include <string.h>

uint32_t matmul(void *in, uint32_t in_len, void *out)
{
    uint32_t h[4];
    if (in_len < sizeof h || ((uintptr_t)in | (uintptr_t)out) % sizeof(double))
        return 0;
    memcpy(h, in, sizeof h);
    uint64_t rows = h[0], n = h[1], k = h[2];
    /* Products of two u32 fit a u64; bounding them by u32 first keeps the
     * byte counts below from overflowing. */
    uint64_t a_len = rows * n, b_len = n * k, c_len = rows * k;
    if (h[3] != 0 || a_len > UINT32_MAX || b_len > UINT32_MAX || c_len > UINT32_MAX / 8)
        return 0;
    if ((uint64_t)in_len != sizeof h + 8 * (a_len + b_len))
        return 0;

    const double *a = (const double *)((const char *)in + sizeof h);
    const double *b = a + a_len;
    double *c = out;
    /* i-p-j order streams rows of B; each C[i][j] still sums p in order, so
     * the result is bit-identical to the Rust library's. */
    for (uint64_t i = 0; i < rows; i++) {
        double *ci = c + i * k;
        for (uint64_t j = 0; j < k; j++)
            ci[j] = 0.0;
        for (uint64_t p = 0; p < n; p++) {
            double aip = a[i * n + p];
            const double *bp = b + p * k;
            for (uint64_t j = 0; j < k; j++)
                ci[j] += aip * bp[j];
        }
    }
    return (uint32_t)(c_len * 8);
}
