/* mpi_offload: every MPI rank multiplies its own n×n block, offloading
 * half of its rows to a worker of its own on an rfaas executor while it
 * computes the other half, as in the rFaaS paper's MPI experiment.
 *
 *   mpirun -np 2 mpi_offload [n [executor [token [library]]]]
 *
 * Arguments left out come from the environment: RFAAS_EXECUTOR,
 * RFAAS_TOKEN (one lease with at least one core per rank), RFAAS_LIBRARY
 * (a shared object exporting `matmul`); RFAAS_REPS sets the repetitions
 * (default 10).
 *
 * Rank 0 prints every rank's median remote latency, the checksum of all
 * blocks and the largest error against a local product; every rank exits 1
 * when any rank failed or the error exceeds 1e-9. */
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <rfaas.h>

#include "../c/matmul_util.h"

#define MAX_ERROR 1e-9

/* What one rank measured. */
struct rank_result {
    double median_latency_us;
    double median_offload_us;
    double max_error;
    double checksum;
    int failed;
};

static int rfaas_failed(int rank, const char *what, rfaas_status status)
{
    fprintf(stderr, "mpi_offload: rank %d: %s failed: %s (%s)\n", rank, what, rfaas_last_error(),
            rfaas_status_name(status));
    return 1;
}

/* This rank's block: allocate, offload half, compute half, check. Returns
 * 0 and fills `res`, or 1 after printing why. Releases everything it
 * acquired either way. */
static int run_rank(int rank, size_t n, int reps, const char *executor, const char *token,
                    const char *library, struct rank_result *res)
{
    size_t remote_rows = n / 2, local_rows = n - remote_rows;
    size_t in_bytes = sizeof(struct matmul_header) + (remote_rows * n + n * n) * sizeof(double);
    size_t out_bytes = remote_rows * n * sizeof(double);
    int rc = 1;
    rfaas_status st;
    rfaas_client *client = NULL;
    rfaas_allocation *alloc = NULL;
    rfaas_buffer *in = NULL, *out = NULL;

    double *a = malloc(n * n * sizeof *a), *b = malloc(n * n * sizeof *b);
    double *c = malloc(n * n * sizeof *c), *expected = malloc(n * n * sizeof *expected);
    double *latency = malloc((size_t)reps * sizeof *latency);
    double *offload = malloc((size_t)reps * sizeof *offload);
    if (!a || !b || !c || !expected || !latency || !offload) {
        fprintf(stderr, "mpi_offload: rank %d: out of memory for n = %zu\n", rank, n);
        goto done;
    }
    fill(a, n * n, 2 * (uint64_t)rank + 1);
    fill(b, n * n, 2 * (uint64_t)rank + 2);

    if ((st = rfaas_client_new(NULL, &client)) != RFAAS_OK) {
        rfaas_failed(rank, "rfaas_client_new", st);
        goto done;
    }
    rfaas_alloc_options opts = rfaas_alloc_options_default();
    opts.cores = 1;
    opts.mode = RFAAS_MODE_WARM;
    opts.input_capacity = (uint32_t)(in_bytes + 64);
    opts.output_capacity = (uint32_t)out_bytes;
    const char *functions[] = {"matmul"};
    if ((st = rfaas_allocate_file(client, executor, token, &opts, library, functions, 1, &alloc)) !=
        RFAAS_OK) {
        rfaas_failed(rank, "rfaas_allocate_file", st);
        goto done;
    }
    uint32_t matmul;
    if ((st = rfaas_function_index(alloc, "matmul", &matmul)) != RFAAS_OK ||
        (st = rfaas_buffer_new(alloc, in_bytes, &in)) != RFAAS_OK ||
        (st = rfaas_buffer_new(alloc, out_bytes, &out)) != RFAAS_OK) {
        rfaas_failed(rank, "setting up the allocation", st);
        goto done;
    }

    unsigned char *in_data = rfaas_buffer_data(in);
    struct matmul_header header = {(uint32_t)remote_rows, (uint32_t)n, (uint32_t)n, 0};
    memcpy(in_data, &header, sizeof header);
    memcpy(in_data + sizeof header, a, remote_rows * n * sizeof(double));
    memcpy(in_data + sizeof header + remote_rows * n * sizeof(double), b, n * n * sizeof(double));

    for (int r = 0; r < reps; r++) {
        rfaas_invocation *inv = NULL;
        size_t out_len = 0;
        double s = now_us();
        if ((st = rfaas_submit(alloc, matmul, in, in_bytes, out, &inv)) != RFAAS_OK) {
            rfaas_failed(rank, "rfaas_submit", st);
            goto done;
        }
        /* The remote latency is taken when the response is in: poll it
         * between local rows so the clock stops close to its arrival. */
        double remote_done = 0;
        for (size_t i = 0; i < local_rows; i++) {
            multiply(a + (remote_rows + i) * n, b, c + (remote_rows + i) * n, 1, n, n);
            if (remote_done == 0) {
                st = rfaas_test(inv, &out_len);
                if (st == RFAAS_OK)
                    remote_done = now_us();
                else if (st != RFAAS_PENDING)
                    break;
            }
        }
        if (remote_done == 0 && (st == RFAAS_OK || st == RFAAS_PENDING)) {
            st = rfaas_wait(inv, &out_len);
            remote_done = now_us();
        }
        rfaas_invocation_free(inv);
        if (st != RFAAS_OK) {
            rfaas_failed(rank, "waiting for matmul", st);
            goto done;
        }
        if (out_len != out_bytes) {
            fprintf(stderr, "mpi_offload: rank %d: matmul returned %zu bytes, expected %zu\n", rank,
                    out_len, out_bytes);
            goto done;
        }
        latency[r] = remote_done - s;
        offload[r] = now_us() - s;
    }
    memcpy(c, rfaas_buffer_data(out), out_bytes);

    multiply(a, b, expected, n, n, n);
    res->max_error = 0.0;
    res->checksum = 0.0;
    for (size_t i = 0; i < n * n; i++) {
        double e = fabs(c[i] - expected[i]);
        if (!(e <= res->max_error))
            res->max_error = isnan(e) ? INFINITY : e;
        res->checksum += c[i];
    }
    res->median_latency_us = median(latency, reps);
    res->median_offload_us = median(offload, reps);
    rc = 0;

done:
    rfaas_buffer_free(in);
    rfaas_buffer_free(out);
    if (alloc && (st = rfaas_deallocate(alloc)) != RFAAS_OK && rc == 0)
        rc = rfaas_failed(rank, "rfaas_deallocate", st);
    rfaas_client_free(client);
    free(a);
    free(b);
    free(c);
    free(expected);
    free(latency);
    free(offload);
    return rc;
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);

    size_t n = argc > 1 ? strtoul(argv[1], NULL, 10) : 128;
    const char *executor = argc > 2 ? argv[2] : getenv("RFAAS_EXECUTOR");
    const char *token = argc > 3 ? argv[3] : getenv("RFAAS_TOKEN");
    const char *library = argc > 4 ? argv[4] : getenv("RFAAS_LIBRARY");
    int reps = getenv("RFAAS_REPS") ? atoi(getenv("RFAAS_REPS")) : 10;
    if (n < 2 || !executor || !token || !library || reps < 1) {
        if (rank == 0)
            fprintf(stderr,
                    "usage: mpirun -np N mpi_offload [n [executor [token [library]]]]\n"
                    "  (or RFAAS_EXECUTOR, RFAAS_TOKEN, RFAAS_LIBRARY; n >= 2; RFAAS_REPS >= 1)\n");
        MPI_Finalize();
        return 2;
    }

    struct rank_result mine = {0};
    mine.failed = run_rank(rank, n, reps, executor, token, library, &mine);

    /* Every rank reaches the collectives, failed or not. */
    struct rank_result *all = rank == 0 ? calloc((size_t)size, sizeof *all) : NULL;
    MPI_Gather(&mine, (int)sizeof mine, MPI_BYTE, all, (int)sizeof mine, MPI_BYTE, 0,
               MPI_COMM_WORLD);
    int verdict = 0;
    if (rank == 0) {
        double checksum = 0.0, max_error = 0.0;
        int failed = 0;
        for (int r = 0; r < size; r++) {
            if (all[r].failed) {
                printf("rank %d: FAILED (see its message above)\n", r);
                failed++;
                continue;
            }
            printf("rank %d: remote matmul (%zu of %zu rows) median %.1f us, "
                   "offloaded block median %.1f us, max abs error %.3g\n",
                   r, n / 2, n, all[r].median_latency_us, all[r].median_offload_us,
                   all[r].max_error);
            checksum += all[r].checksum;
            if (!(all[r].max_error <= max_error))
                max_error = all[r].max_error;
        }
        printf("%d ranks, n = %zu per rank: checksum %.6f, max abs error %.3g\n", size, n, checksum,
               max_error);
        if (failed) {
            fprintf(stderr, "mpi_offload: %d of %d ranks failed\n", failed, size);
            verdict = 1;
        } else if (!(max_error <= MAX_ERROR)) {
            fprintf(stderr, "mpi_offload: MISMATCH: max abs error %.3g exceeds %.0g\n", max_error,
                    MAX_ERROR);
            verdict = 1;
        } else {
            printf("OK\n");
        }
        free(all);
    }
    MPI_Bcast(&verdict, 1, MPI_INT, 0, MPI_COMM_WORLD);
    MPI_Finalize();
    return verdict;
}
