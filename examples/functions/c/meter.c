/* Functions for the tests of what the executor meters: one that burns a
 * measured amount of CPU, and two that attack their own worker's meter
 * area (rfaas_proto::meter) to change their bill. Not for production
 * libraries.
 *
 * The meter area is the shared mapping named "memfd:rfaas-meter" in
 * /proc/self/maps: a 128-byte header, then one 128-byte record per lane
 * of u64 counters. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#define METER_HEADER 128

static uint64_t thread_cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static uint32_t input_u32(const void *in, uint32_t in_len)
{
    uint32_t v = 0;
    if (in_len >= 4)
        memcpy(&v, in, 4);
    return v;
}

/* Finds this process's writable meter area; 0 when there is none. */
static int find_meter(unsigned char **start, size_t *len)
{
    FILE *maps = fopen("/proc/self/maps", "r");
    if (maps == NULL)
        return 0;
    char line[512];
    int found = 0;
    while (fgets(line, sizeof line, maps) != NULL) {
        unsigned long lo, hi;
        char perms[8];
        if (strstr(line, "memfd:rfaas-meter") == NULL)
            continue;
        if (sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) == 3 && perms[1] == 'w') {
            *start = (unsigned char *)lo;
            *len = hi - lo;
            found = 1;
            break;
        }
    }
    fclose(maps);
    return found;
}

/* Overwrites every lane record of the area with `byte`. */
static void scribble(unsigned char *area, size_t len, int byte)
{
    if (len > METER_HEADER)
        memset(area + METER_HEADER, byte, len - METER_HEADER);
}

/* Output: the thread CPU time the call used, u64 ns, and 1 when it found
 * the meter area (u64), when the output takes them. */
static uint32_t report(void *out, uint64_t used_ns, uint64_t found)
{
    memcpy(out, &used_ns, 8);
    memcpy((unsigned char *)out + 8, &found, 8);
    return 16;
}

/* Burns the input's first u32 in milliseconds of this thread's CPU time. */
uint32_t burn_cpu_ms(void *in, uint32_t in_len, void *out)
{
    uint64_t want = (uint64_t)input_u32(in, in_len) * 1000000u;
    uint64_t start = thread_cpu_ns();
    volatile uint64_t x = 0;
    while (thread_cpu_ns() - start < want)
        for (int i = 0; i < 1000; i++)
            x += (uint64_t)i;
    return report(out, thread_cpu_ns() - start, 0);
}

/* Writes 0xff into every byte of every lane record (odd sequence numbers,
 * unknown states, counters at their largest), then burns the input's ms:
 * an attempt to inflate the bill, or to move it between buckets. */
uint32_t meter_inflate(void *in, uint32_t in_len, void *out)
{
    uint64_t start = thread_cpu_ns();
    unsigned char *area;
    size_t len;
    int found = find_meter(&area, &len);
    if (found)
        scribble(area, len, 0xff);
    uint64_t want = (uint64_t)input_u32(in, in_len) * 1000000u;
    volatile uint64_t x = 0;
    while (thread_cpu_ns() - start < want)
        for (int i = 0; i < 1000; i++)
            x += (uint64_t)i;
    return report(out, thread_cpu_ns() - start, (uint64_t)found);
}

/* Burns the input's ms of CPU while zeroing every lane record every few
 * microseconds: an attempt to make the work invisible. */
uint32_t meter_zero_burn(void *in, uint32_t in_len, void *out)
{
    uint64_t start = thread_cpu_ns();
    unsigned char *area;
    size_t len;
    int found = find_meter(&area, &len);
    uint64_t want = (uint64_t)input_u32(in, in_len) * 1000000u;
    volatile uint64_t x = 0;
    while (thread_cpu_ns() - start < want) {
        if (found)
            scribble(area, len, 0);
        for (int i = 0; i < 1000; i++)
            x += (uint64_t)i;
    }
    return report(out, thread_cpu_ns() - start, (uint64_t)found);
}
