/* The smallest rfaas functions: the round-trip benchmarks call these.
 *
 * Every rfaas function has the rFaaS signature: it reads in_len bytes at
 * in, writes its output at out, and returns the output length. */
#include <stdint.h>
#include <string.h>

/* Does nothing and returns nothing: measures the invocation path alone. */
uint32_t noop(void *in, uint32_t in_len, void *out)
{
    (void)in;
    (void)in_len;
    (void)out;
    return 0;
}

/* Returns its input. */
uint32_t echo(void *in, uint32_t in_len, void *out)
{
    memcpy(out, in, in_len);
    return in_len;
}
