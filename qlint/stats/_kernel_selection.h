/* Selection among candidates: quickselect, vector rank counts, thresholds.
 * Included once, by _channel_kernel.c: one translation unit, so every function
 * stays static and the compiler can inline across the parts. */

/* ------------------------------------------------------------------------ selection */

/* Moves the values of [low, high) that are above `pivot` (with `or_equal`: at
 * least `pivot`) to the front of the range and returns where they end.
 * Branch-free: every value is swapped, and the write position advances only
 * past kept values (what lies between holds rejected ones, so the swap keeps
 * it so). */
static inline Py_ssize_t partition_front(float *values, Py_ssize_t low, Py_ssize_t high, float pivot,
                                         int or_equal)
{
    Py_ssize_t write = low;
    for (Py_ssize_t i = low; i < high; ++i) {
        const float v = values[i];
        values[i] = values[write];
        values[write] = v;
        write += or_equal ? v >= pivot : v > pivot;
    }
    return write;
}

/* Rearranges values[0, count) so that values[0, m) are the m largest (in no
 * order) and returns the m-th largest; 1 <= m <= count. Callers pass no NaN
 * (a NaN stops the search, which then returns NaN). Quickselect
 * with median-of-three pivots; when the answer is not above the pivot, the
 * pivot's copies are split off whole, so repeated values (the zeros after a
 * ReLU) cannot stall it. */
static float select_top(float *values, Py_ssize_t count, Py_ssize_t m)
{
    Py_ssize_t low = 0, high = count;  /* position m - 1 lies in [low, high) */
    while (high - low > 1) {
        const float a = values[low], b = values[low + (high - low) / 2], c = values[high - 1];
        const float pivot = a < b ? (b < c ? b : (a < c ? c : a)) : (a < c ? a : (b < c ? c : b));
        const Py_ssize_t above = partition_front(values, low, high, pivot, 0);
        if (m - 1 < above) {
            high = above;
            continue;
        }
        const Py_ssize_t at_least = partition_front(values, above, high, pivot, 1);
        if (m - 1 < at_least)
            return pivot;
        if (at_least == low)  /* a NaN pivot compares false with everything: no progress is possible */
            return NAN;
        low = at_least;
    }
    return values[m - 1];
}

/* The values of ranks m and m2 (from the top; m2 = 0: not wanted) among at
 * most RANK_PAIR_MOST values, without moving them: each value's rank is
 * counted against all the others with vector compares, which for a few dozen
 * values beats quickselect's mispredicted branches (measured: ~2x on the
 * candidates of 256-channel batches; past 64 values quickselect wins). Set by choose_kernels where the CPU has
 * such a version; NULL: quickselect only. */
typedef void (*RankPair)(const float *, Py_ssize_t, Py_ssize_t, Py_ssize_t, float *, float *);
static RankPair rank_pair;
#define RANK_PAIR_MOST 64

/* The m-th largest of values[0, count) (which may be reordered). */
static float select_value(float *values, Py_ssize_t count, Py_ssize_t m)
{
    if (rank_pair == NULL || count > RANK_PAIR_MOST)
        return select_top(values, count, m);
    float kth = NAN;
    rank_pair(values, count, m, 0, &kth, NULL);
    return kth;
}

/* As select_top: values[0, m) become the m largest; returns the m-th largest. */
static float keep_top(float *values, Py_ssize_t count, Py_ssize_t m)
{
    if (rank_pair == NULL || count > RANK_PAIR_MOST)
        return select_top(values, count, m);
    float kth = NAN;
    rank_pair(values, count, m, 0, &kth, NULL);
    Py_ssize_t kept = 0;
    for (Py_ssize_t i = 0; i < count; ++i) {
        values[kept] = values[i];
        kept += values[i] > kth;
    }
    while (kept < m)  /* ties at the m-th largest */
        values[kept++] = kth;
    return kth;
}

static inline Py_ssize_t buffer_capacity(Py_ssize_t m)
{
    return 2 * m + 64;
}

/* Values per block: at least 2m blocks, so the m-th largest block maximum is a
 * tight bound and the 2m-th exists for the next hint. */
static inline Py_ssize_t block_length(Py_ssize_t values, Py_ssize_t m)
{
    if (m == 0)  /* no block maxima needed: longer blocks fold partial sums less often */
        return BLOCK_WITHOUT_SELECTION;
    const Py_ssize_t length = values / (2 * m);
    return length < 1 ? 1 : (length > MAX_BLOCK ? MAX_BLOCK : length);
}

/* Threshold from a channel's block maxima (copied into `scratch`, which is
 * reordered): the m-th largest, or -inf with fewer than m blocks. */
static float block_threshold(float *scratch, Py_ssize_t blocks, Py_ssize_t m)
{
    return blocks >= m ? select_value(scratch, blocks, m) : -INFINITY;
}

/* Outcome for one channel whose candidates are the values above `threshold`.
 * `hint` is the threshold the channel started from when `from_hint`. Returns
 * 0 when done; 1 when the hint was too high (fewer than m values beat it), so
 * the channel must be redone from its block maxima.
 *
 * The next hint aims at the value of rank 2m: about 2m values then beat it in
 * a similar batch, comfortably more than m (failures cost a redo) and well
 * under the buffer's capacity (overflows cost a selection). A hint that kept
 * between 1.25m and 3m candidates is kept as it is (no extra selection); with
 * fewer than 2m candidates the guess steps below the threshold by the
 * threshold's distance to the answer, which walks it down the ranks. */
static int finish_channel(float *candidates, Py_ssize_t kept, Py_ssize_t m, float threshold, int from_hint,
                          float hint, double *out_kth, float *out_hint)
{
    if (kept < m) {
        if (from_hint)
            return 1;
        *out_kth = threshold > -INFINITY ? threshold : NAN;  /* -inf: fewer than m values compared (NaN) */
        *out_hint = threshold;
        return 0;
    }
    if (from_hint && threshold == hint && 4 * kept >= 5 * m && kept <= 3 * m) {
        *out_kth = select_value(candidates, kept, m);
        *out_hint = hint;
        return 0;
    }
    float guess = NAN, kth = NAN;
    if (rank_pair != NULL && kept <= RANK_PAIR_MOST) {
        rank_pair(candidates, kept, m, kept >= 2 * m ? 2 * m : 0, &kth, &guess);
    } else {
        if (kept >= 2 * m) {
            guess = select_top(candidates, kept, 2 * m);
            kept = 2 * m;
        }
        kth = select_top(candidates, kept, m);
    }
    *out_kth = kth;
    *out_hint = isnan(guess) ? threshold - (float)((double)kth - threshold) : guess;
    return 0;
}

static inline void count_exponents(int64_t *histogram, const float *values, Py_ssize_t count)
{
    for (Py_ssize_t i = 0; i < count; ++i) {
        int32_t bits;
        memcpy(&bits, &values[i], sizeof bits);
        histogram[(bits >> 23) + 256] += 1;  /* arithmetic shift: sign-extended (sign, exponent) */
    }
}
