/* matmul_offload: C = A·B for n×n doubles, with the first half of C's rows
 * computed by the `matmul` function on an rfaas executor while this thread
 * computes the second half.
 *
 *   matmul_offload [n [executor [token [library]]]]
 *
 * Arguments left out come from the environment: RFAAS_EXECUTOR (control
 * address, host:port), RFAAS_TOKEN (a lease token), RFAAS_LIBRARY (the
 * function library, a shared object exporting `matmul`, e.g. the one built
 * from examples/functions/c). RFAAS_REPS sets the repetitions (default 10).
 *
 * The `matmul` input is a 16-byte header {u32 rows, u32 n, u32 k, u32 0},
 * then A (rows×n) and B (n×k), row-major; its output is rows×k.
 *
 * Prints the median remote latency and OK; exits 1 when the offloaded
 * product differs from a local one by more than 1e-9, or on any error. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <rfaas.h>

#include "matmul_util.h"

#define MAX_ERROR 1e-9

static const char *arg_or_env(int argc, char **argv, int i, const char *env)
{
    if (argc > i)
        return argv[i];
    return getenv(env);
}

static int fail(const char *what, rfaas_status status)
{
    fprintf(stderr, "matmul_offload: %s failed: %s (%s)\n", what, rfaas_last_error(),
            rfaas_status_name(status));
    return 1;
}

int main(int argc, char **argv)
{
    size_t n = argc > 1 ? strtoul(argv[1], NULL, 10) : 256;
    const char *executor = arg_or_env(argc, argv, 2, "RFAAS_EXECUTOR");
    const char *token = arg_or_env(argc, argv, 3, "RFAAS_TOKEN");
    const char *library = arg_or_env(argc, argv, 4, "RFAAS_LIBRARY");
    int reps = getenv("RFAAS_REPS") ? atoi(getenv("RFAAS_REPS")) : 10;
    if (n < 2 || !executor || !token || !library || reps < 1) {
        fprintf(stderr,
                "usage: matmul_offload [n [executor [token [library]]]]\n"
                "  (or RFAAS_EXECUTOR, RFAAS_TOKEN, RFAAS_LIBRARY; n >= 2; RFAAS_REPS >= 1)\n");
        return 2;
    }
    size_t remote_rows = n / 2, local_rows = n - remote_rows;

    double *a = malloc(n * n * sizeof *a), *b = malloc(n * n * sizeof *b);
    double *c = malloc(n * n * sizeof *c), *expected = malloc(n * n * sizeof *expected);
    double *latency = malloc((size_t)reps * sizeof *latency);
    double *overlapped = malloc((size_t)reps * sizeof *overlapped);
    if (!a || !b || !c || !expected || !latency || !overlapped) {
        fprintf(stderr, "matmul_offload: out of memory for n = %zu\n", n);
        return 1;
    }
    fill(a, n * n, 1);
    fill(b, n * n, 2);

    size_t in_bytes = sizeof(struct matmul_header) + (remote_rows * n + n * n) * sizeof(double);
    size_t out_bytes = remote_rows * n * sizeof(double);

    rfaas_client *client = NULL;
    rfaas_status st = rfaas_client_new(NULL, &client);
    if (st != RFAAS_OK)
        return fail("rfaas_client_new", st);

    rfaas_alloc_options opts = rfaas_alloc_options_default();
    opts.cores = 1;
    opts.mode = RFAAS_MODE_WARM;
    opts.input_capacity = (uint32_t)(in_bytes + 64);
    opts.output_capacity = (uint32_t)out_bytes;
    const char *functions[] = {"matmul"};
    rfaas_allocation *alloc = NULL;
    double t0 = now_us();
    st = rfaas_allocate_file(client, executor, token, &opts, library, functions, 1, &alloc);
    if (st != RFAAS_OK)
        return fail("rfaas_allocate_file", st);
    printf("allocated on %s in %.0f us\n", executor, now_us() - t0);

    uint32_t matmul;
    rfaas_buffer *in = NULL, *out = NULL;
    if ((st = rfaas_function_index(alloc, "matmul", &matmul)) != RFAAS_OK)
        return fail("rfaas_function_index", st);
    if ((st = rfaas_buffer_new(alloc, in_bytes, &in)) != RFAAS_OK)
        return fail("rfaas_buffer_new (input)", st);
    if ((st = rfaas_buffer_new(alloc, out_bytes, &out)) != RFAAS_OK)
        return fail("rfaas_buffer_new (output)", st);

    unsigned char *in_data = rfaas_buffer_data(in);
    struct matmul_header header = {(uint32_t)remote_rows, (uint32_t)n, (uint32_t)n, 0};
    memcpy(in_data, &header, sizeof header);
    memcpy(in_data + sizeof header, a, remote_rows * n * sizeof(double));
    memcpy(in_data + sizeof header + remote_rows * n * sizeof(double), b, n * n * sizeof(double));

    /* The remote call alone. */
    for (int r = 0; r < reps; r++) {
        size_t out_len = 0;
        double s = now_us();
        st = rfaas_invoke(alloc, matmul, in, in_bytes, out, &out_len);
        latency[r] = now_us() - s;
        if (st != RFAAS_OK)
            return fail("rfaas_invoke", st);
        if (out_len != out_bytes) {
            fprintf(stderr, "matmul_offload: matmul returned %zu bytes, expected %zu\n", out_len,
                    out_bytes);
            return 1;
        }
    }

    /* Offload the first half, compute the second half meanwhile. */
    for (int r = 0; r < reps; r++) {
        rfaas_invocation *inv = NULL;
        size_t out_len = 0;
        double s = now_us();
        if ((st = rfaas_submit(alloc, matmul, in, in_bytes, out, &inv)) != RFAAS_OK)
            return fail("rfaas_submit", st);
        multiply(a + remote_rows * n, b, c + remote_rows * n, local_rows, n, n);
        st = rfaas_wait(inv, &out_len);
        overlapped[r] = now_us() - s;
        rfaas_invocation_free(inv);
        if (st != RFAAS_OK)
            return fail("rfaas_wait", st);
        if (out_len != out_bytes) {
            fprintf(stderr, "matmul_offload: matmul returned %zu bytes, expected %zu\n", out_len,
                    out_bytes);
            return 1;
        }
    }
    memcpy(c, rfaas_buffer_data(out), out_bytes);

    double s = now_us();
    multiply(a, b, expected, n, n, n);
    double local_full = now_us() - s;

    double max_error = 0.0;
    for (size_t i = 0; i < n * n; i++) {
        double e = fabs(c[i] - expected[i]);
        if (!(e <= max_error)) /* also catches NaN */
            max_error = isnan(e) ? INFINITY : e;
    }

    printf("n = %zu: remote rows %zu, local rows %zu, %d repetitions\n", n, remote_rows, local_rows,
           reps);
    printf("remote matmul latency: median %.1f us\n", median(latency, reps));
    printf("offloaded product (remote + local half): median %.1f us; local full product %.1f us\n",
           median(overlapped, reps), local_full);
    printf("max abs error: %.3g\n", max_error);

    rfaas_buffer_free(in);
    rfaas_buffer_free(out);
    st = rfaas_deallocate(alloc);
    rfaas_client_free(client);
    if (st != RFAAS_OK)
        return fail("rfaas_deallocate", st);
    if (max_error > MAX_ERROR) {
        fprintf(stderr, "matmul_offload: MISMATCH: max abs error %.3g exceeds %.0g\n", max_error,
                MAX_ERROR);
        return 1;
    }
    printf("OK\n");
    free(a);
    free(b);
    free(c);
    free(expected);
    free(latency);
    free(overlapped);
    return 0;
}
