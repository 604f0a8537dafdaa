/* European option prices by the Black-Scholes formula.
 *
 * Input: options of 5 f64 each {spot, strike, years, rate, volatility}
 * (rate and volatility per year, continuously compounded). Output: 2 f64
 * per option {call, put}; returns 16 bytes per option. With no time or no
 * volatility the price is the discounted intrinsic value. Returns 0,
 * writing nothing, when in_len is not a multiple of 40 or in or out is not
 * 8-byte aligned. */
#include <math.h>
#include <stdint.h>

/* Standard normal CDF; erfc keeps the tails accurate. */
static double norm_cdf(double x)
{
    return 0.5 * erfc(-x / sqrt(2.0));
}

uint32_t black_scholes(void *in, uint32_t in_len, void *out)
{
    if (in_len % (5 * sizeof(double)) != 0 ||
        ((uintptr_t)in | (uintptr_t)out) % sizeof(double))
        return 0;
    uint32_t count = in_len / (5 * sizeof(double));
    const double *opt = in;
    double *price = out;
    for (uint32_t i = 0; i < count; i++, opt += 5, price += 2) {
        double s = opt[0], k = opt[1], t = opt[2], r = opt[3], v = opt[4];
        double discounted = k * exp(-r * t);
        double vt = v * sqrt(t);
        if (!(vt > 0.0)) {
            price[0] = fmax(s - discounted, 0.0);
            price[1] = fmax(discounted - s, 0.0);
            continue;
        }
        double d1 = (log(s / k) + (r + 0.5 * v * v) * t) / vt;
        double d2 = d1 - vt;
        price[0] = s * norm_cdf(d1) - discounted * norm_cdf(d2);
        price[1] = discounted * norm_cdf(-d2) - s * norm_cdf(-d1);
    }
    return count * 16;
}
