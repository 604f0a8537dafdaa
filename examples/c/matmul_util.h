/* Helpers the C and MPI matmul examples share: the request header of the
 * `matmul` example function, timing, a median, a local product to check
 * against, and deterministic input. Header-only (static functions). */
#ifndef RFAAS_EXAMPLES_MATMUL_UTIL_H
#define RFAAS_EXAMPLES_MATMUL_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

/* The `matmul` function's input starts with this, then rows×n of A, then
 * n×k of B. */
struct matmul_header {
    uint32_t rows;
    uint32_t n;
    uint32_t k;
    uint32_t reserved;
};

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int count)
{
    qsort(v, (size_t)count, sizeof *v, cmp_double);
    return count % 2 ? v[count / 2] : (v[count / 2 - 1] + v[count / 2]) / 2;
}

/* c[rows×k] = a[rows×n] · b[n×k] */
static void multiply(const double *a, const double *b, double *c, size_t rows, size_t n, size_t k)
{
    for (size_t i = 0; i < rows; i++) {
        double *ci = c + i * k;
        for (size_t j = 0; j < k; j++)
            ci[j] = 0.0;
        for (size_t l = 0; l < n; l++) {
            double ail = a[i * n + l];
            const double *bl = b + l * k;
            for (size_t j = 0; j < k; j++)
                ci[j] += ail * bl[j];
        }
    }
}

/* Deterministic values in [-1, 1). */
static void fill(double *m, size_t count, uint64_t seed)
{
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < count; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        m[i] = (double)(x >> 11) / (double)(1ull << 53) * 2.0 - 1.0;
    }
}

#endif
