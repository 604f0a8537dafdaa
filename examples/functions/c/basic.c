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

/* rFaaS's bandwidth benchmark function: copies the first 4 bytes of its
 * input and returns in_len, so in_len bytes of the output buffer travel
 * back without the function touching them. A round trip through it moves
 * the payload both ways at no cost in the function: what is left is the
 * invocation path's own. */
uint32_t empty(void *in, uint32_t in_len, void *out)
{
    if (in_len >= 4)
        memcpy(out, in, 4);
    return in_len;
}
