/* Functions that misbehave on purpose, for the tests of what rfaas does
 * when user code fails. Not for production libraries. */
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Dereferences a null pointer: the worker dies with SIGSEGV. */
uint32_t fault_segfault(void *in, uint32_t in_len, void *out)
{
    (void)in;
    (void)in_len;
    (void)out;
    volatile int *p = 0;
    *p = 1;
    return 0;
}

/* Crashes (SIGSEGV) the first time it is called with a given marker file:
 * the input is a u32, MiB of heap to touch first, then the file's path
 * (without a NUL). It creates the file, touches the memory, and faults;
 * called again with the same input, on any worker, it echoes it. A
 * function that fails once, for the tests of retrying after a crash (the
 * memory makes its worker take a while to end, as a big one does); the
 * path must be one the lease's user may create. */
uint32_t fault_segfault_once(void *in, uint32_t in_len, void *out)
{
    char path[256];
    uint32_t mib = 0;
    if (in_len <= 4 || in_len - 4 >= sizeof path)
        return 0;
    memcpy(&mib, in, 4);
    memcpy(path, (char *)in + 4, in_len - 4);
    path[in_len - 4] = '\0';
    int fd = open(path, O_CREAT | O_EXCL | O_WRONLY, 0600);
    if (fd >= 0) {
        close(fd);
        size_t bytes = (size_t)mib << 20;
        volatile unsigned char *heap = malloc(bytes);
        for (size_t i = 0; heap != NULL && i < bytes; i += 4096)
            heap[i] = 1;
        volatile int *p = 0;
        *p = 1;
    }
    memcpy(out, in, in_len);
    return in_len;
}

/* One 4 KiB frame deeper per call, with no end before the stack's guard
 * page (UINT32_MAX frames would be 16 TiB). */
static uint32_t deeper(volatile unsigned char *prev, uint32_t depth)
{
    volatile unsigned char frame[4096];
    frame[0] = (unsigned char)(prev[0] + 1);
    frame[sizeof frame - 1] = frame[0];
    if (depth == UINT32_MAX)
        return frame[0];
    return deeper(frame, depth + 1) + frame[sizeof frame - 1];
}

/* Recurses until the stack runs out: the worker dies with SIGSEGV on the
 * stack's guard page (the crash is handled on the thread's alternate
 * signal stack). */
uint32_t fault_stack_overflow(void *in, uint32_t in_len, void *out)
{
    (void)in;
    (void)in_len;
    (void)out;
    volatile unsigned char seed[1] = {0};
    return deeper(seed, 0);
}

/* Calls abort(): the worker dies with SIGABRT. */
uint32_t fault_abort(void *in, uint32_t in_len, void *out)
{
    (void)in;
    (void)in_len;
    (void)out;
    raise(SIGABRT);
    return 0;
}

/* Writes as many bytes as the input's first u32 says, whatever the output
 * capacity: past it, the guard page ends the worker. */
uint32_t fault_overrun(void *in, uint32_t in_len, void *out)
{
    uint32_t n = 0;
    if (in_len >= 4)
        memcpy(&n, in, 4);
    memset(out, 0xab, n);
    return n;
}

/* Claims an output length of the input's first u32 without writing it:
 * the worker answers "output too large" when that exceeds the capacity. */
uint32_t fault_claim(void *in, uint32_t in_len, void *out)
{
    (void)out;
    uint32_t n = 0;
    if (in_len >= 4)
        memcpy(&n, in, 4);
    return n;
}

/* Allocates and touches as many MiB as the input's first u32 says, then
 * frees them and returns nothing; aborts when the allocation fails. Past
 * the allocation's memory limit the worker dies: of SIGKILL from the kernel
 * under a cgroup memory.max, of SIGABRT under RLIMIT_AS. */
uint32_t fault_hog(void *in, uint32_t in_len, void *out)
{
    (void)out;
    uint32_t mib = 0;
    if (in_len >= 4)
        memcpy(&mib, in, 4);
    size_t bytes = (size_t)mib << 20;
    unsigned char *p = malloc(bytes);
    if (p == NULL && bytes > 0)
        abort();
    for (size_t i = 0; i < bytes; i += 4096)
        ((volatile unsigned char *)p)[i] = 1;
    free(p);
    return 0;
}

/* Flips the input's first byte, then echoes it: a function that writes to
 * its input, which faults when the client promised read-only input and
 * the input is read in place (shm). */
uint32_t fault_scribble_input(void *in, uint32_t in_len, void *out)
{
    if (in_len > 0)
        ((volatile unsigned char *)in)[0] ^= 1;
    memcpy(out, in, in_len);
    return in_len;
}

/* Sleeps for the input's first u32 in milliseconds, then echoes the input:
 * the deadline tests. */
uint32_t sleep_ms(void *in, uint32_t in_len, void *out)
{
    uint32_t ms = 0;
    if (in_len >= 4)
        memcpy(&ms, in, 4);
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0) {
    }
    memcpy(out, in, in_len);
    return in_len;
}
