/*
 * Per-channel summaries of one float32 batch, reading the data once (twice for
 * the first batch of a stream).
 *
 * The batch is a contiguous array viewed as (outer, channels, inner). For each
 * channel in [channel_begin, channel_end) the kernel writes the minimum, the
 * maximum, the sum and the sum of squares (float partial sums over blocks of at
 * most 64 values, accumulated in double), optionally the m-th largest
 * value, exactly, and adds the (sign, exponent) counts of the values it read.
 *
 * Why a compiled kernel: the m-th largest value per channel (the reference
 * quantile of the percentile-ratio statistic) dominated calibration time when
 * built from tensor ops, which need a partition or a gather per candidate.
 *
 * How the m-th largest is found. Each channel has a threshold t and a buffer
 * of candidates: every value above t is appended. Exactness rests on one
 * invariant: t never exceeds the answer. Then no value at or below t can be
 * the answer unless fewer than m values lie above t, in which case the answer
 * is t itself. The threshold comes from one of two places:
 *   - block maxima: cut the channel into disjoint blocks; the m-th largest
 *     block maximum is a lower bound of the answer (those m blocks hold m
 *     distinct values at least that large). This needs the maxima first, so
 *     the values above it are collected in a second read.
 *   - a hint: a guess passed in by the caller (qlint passes a rank-2m value of
 *     the previous batch), used from the start of a single read. A guess is
 *     not a bound: if fewer than m values beat it, that channel alone is
 *     redone from its block maxima, so the result is exact either way and the
 *     hint only decides the cost.
 * When a buffer fills, a selection keeps its m largest values and their
 * minimum becomes the new threshold (still a lower bound of the answer).
 *
 * Layouts:
 *   inner == 1  channel-last ([..., features], a Linear's input): rows are
 *               read whole and in order over a band of at most BAND channels.
 *   inner >  1  channel-major or NCHW: each channel is `outer` contiguous runs.
 *
 * NaN and Inf get no special care: they leave a sum non-finite (Inf also a
 * min or max), which is how the caller detects them and takes its exact
 * general path instead. A NaN never enters a buffer (it compares false).
 *
 * The GIL is released while the kernel runs, so callers may split the
 * channels across threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Hot loops also get AVX2 and AVX-512 versions, picked at run time, where the
 * compiler can build them (GCC or clang on x86-64); elsewhere the baseline only. */
#if defined(__GNUC__) && defined(__x86_64__)
#define HAVE_AVX2_DISPATCH 1
#include <immintrin.h>
#else
#define HAVE_AVX2_DISPATCH 0
#endif

#define BAND 512       /* most channels whose state is kept at once, channel-last layout */
#define MAX_BLOCK 16   /* most values per block */
#define BLOCK_WITHOUT_SELECTION 64  /* values per block (float partial sums) when there is no selection */
#define MODERATE_LOW 1e-15   /* channel magnitudes where float32 partial sums of squares are exact enough */
#define MODERATE_HIGH 1e15
#define HISTOGRAM_KEYS 512  /* (sign, exponent) keys of float32 values */
#define REDO_BY_COLUMN 16  /* more failed hints than this in a band: redo them in reads of its rows */

typedef struct {
    const float *data;
    Py_ssize_t outer, channels, inner, m;
    Py_ssize_t channel_begin, channel_end;
    double *out_min, *out_max, *out_sum, *out_sum_of_squares;
    double *out_kth;       /* NULL: no selection */
    const double *hint;    /* NULL: no guesses; else one per channel */
    double *out_hint;      /* guesses for the next batch (with selection) */
    int64_t *histogram;    /* NULL: no exponent counts */
} Job;

/* ------------------------------------------------------------------------ workspace
 * One work buffer per thread, grown as needed and kept between calls: a
 * calibration run calls the kernel for every observed tensor of every batch,
 * and freeing and re-allocating buffers of up to a few MiB each time leaves
 * glibc's heap fragmented (resident memory grows). Where mmap exists the
 * buffer is mapped directly rather than taken from malloc: a long-lived block
 * allocated mid-forward would sit in the heap among the activations that come
 * and go, and the heap grows around it (measured: +20 to +60 MiB of free but
 * resident heap on the encoder benchmark). release_workspace() frees the
 * calling thread's buffer. */
#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#define WORKSPACE_MAPPED 1
#else
#define WORKSPACE_MAPPED 0
#endif

static _Thread_local char *workspace;
static _Thread_local size_t workspace_bytes;

static void workspace_free(void)
{
#if WORKSPACE_MAPPED
    if (workspace != NULL)
        munmap(workspace, workspace_bytes);
#else
    free(workspace);
#endif
    workspace = NULL;
    workspace_bytes = 0;
}

static void *workspace_get(size_t bytes)
{
    if (bytes <= workspace_bytes)
        return workspace;
    workspace_free();
#if WORKSPACE_MAPPED
    const size_t page = 1 << 16;
    const size_t mapped = (bytes + page - 1) / page * page;
    void *memory = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (memory == MAP_FAILED)
        return NULL;
    workspace = (char *)memory;
    workspace_bytes = mapped;
#else
    workspace = (char *)malloc(bytes);
    workspace_bytes = workspace != NULL ? bytes : 0;
#endif
    return workspace;
}

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

/* --------------------------------------------------------------------- channel-last */
typedef struct {
    float *low, *high, *block_low, *block_high, *block_sum, *block_squares, *threshold, *block_max, *scratch,
        *candidates, *column;
    double *sum, *sum_of_squares;
    Py_ssize_t *kept;
    int32_t *found;  /* work list of append_above (width + 8 entries) */
    Py_ssize_t capacity, m;
    void *memory;  /* the thread's workspace */
} Band;

static int band_allocate(Band *band, Py_ssize_t width, Py_ssize_t rows, Py_ssize_t blocks, Py_ssize_t m)
{
    const int select = m > 0;
    const Py_ssize_t capacity = buffer_capacity(select ? m : 1);
    const size_t floats = (size_t)width * 7 +
                          (select ? (size_t)width * (size_t)(blocks + capacity) + (size_t)blocks + (size_t)rows : 0);
    char *memory = (char *)workspace_get(floats * sizeof(float) +
                                  (size_t)width * (2 * sizeof(double) + sizeof(Py_ssize_t) + sizeof(int32_t)) + 8 * sizeof(int32_t));
    if (memory == NULL)
        return -1;
    band->memory = memory;
    band->capacity = capacity;
    band->m = m;
    band->sum = (double *)memory;
    band->sum_of_squares = band->sum + width;
    band->kept = (Py_ssize_t *)(band->sum_of_squares + width);
    band->found = (int32_t *)(band->kept + width);
    float *next = (float *)(band->found + width + 8);
    float **fields[] = {&band->low, &band->high, &band->block_low, &band->block_high, &band->block_sum,
                        &band->block_squares, &band->threshold};
    for (size_t k = 0; k < sizeof fields / sizeof fields[0]; ++k) {
        *fields[k] = next;
        next += width;
    }
    band->block_max = select ? next : NULL;
    next += select ? blocks * width : 0;
    band->scratch = select ? next : NULL;
    next += select ? blocks : 0;
    band->column = select ? next : NULL;
    next += select ? rows : 0;
    band->candidates = select ? next : NULL;
    return 0;
}

static inline void append_value(const Band *band, Py_ssize_t column, float value)
{
    float *own = band->candidates + column * band->capacity;
    own[band->kept[column]++] = value;
    if (band->kept[column] == band->capacity) {  /* raise the threshold: keep only the m largest */
        band->threshold[column] = keep_top(own, band->capacity, band->m);
        band->kept[column] = band->m;
    }
}

/* Per-row work of the channel-last layout, in versions for the baseline
 * instruction set and for AVX2 (picked once at import, see choose_kernels):
 *   accumulate_row: block statistics of one row, element-wise over channels;
 *   find_above: the columns whose value beats its threshold, gathered without
 *     branches (a branch per value or per vector would be mispredicted at the
 *     densities seen here): a comparison's bit mask picks a row of offsets,
 *     all are stored and the count advances by the set bits. */
typedef void (*RowAccumulator)(const float *, Py_ssize_t, float *, float *, float *, float *);
typedef void (*FourRowAccumulator)(const float *, Py_ssize_t, Py_ssize_t, float *, float *, float *, float *);
typedef Py_ssize_t (*ColumnFinder)(const float *, const float *, Py_ssize_t, int32_t *);

#define DEFINE_ACCUMULATE_ROW(NAME, TARGET)                                                              \
    TARGET static void NAME(const float *restrict values, Py_ssize_t width, float *restrict low,          \
                            float *restrict high, float *restrict sum, float *restrict squares)          \
    {                                                                                                    \
        for (Py_ssize_t j = 0; j < width; ++j) {                                                          \
            const float v = values[j];                                                                   \
            low[j] = v < low[j] ? v : low[j];                                                            \
            high[j] = v > high[j] ? v : high[j];                                                         \
            sum[j] += v;                                                                                 \
            squares[j] += v * v;                                                                         \
        }                                                                                                \
    }

/* Four rows at once (`stride` apart): each accumulator is loaded and stored
 * once per four values instead of once per value. */
#define DEFINE_ACCUMULATE_4_ROWS(NAME, TARGET)                                                           \
    TARGET static void NAME(const float *restrict values, Py_ssize_t stride, Py_ssize_t width,            \
                            float *restrict low, float *restrict high, float *restrict sum,              \
                            float *restrict squares)                                                     \
    {                                                                                                    \
        const float *restrict r0 = values, *restrict r1 = values + stride;                              \
        const float *restrict r2 = values + 2 * stride, *restrict r3 = values + 3 * stride;             \
        for (Py_ssize_t j = 0; j < width; ++j) {                                                          \
            const float a = r0[j], b = r1[j], c = r2[j], d = r3[j];                                      \
            const float ab_low = a < b ? a : b, cd_low = c < d ? c : d;                                  \
            const float ab_high = a > b ? a : b, cd_high = c > d ? c : d;                                \
            const float quad_low = ab_low < cd_low ? ab_low : cd_low;                                    \
            const float quad_high = ab_high > cd_high ? ab_high : cd_high;                               \
            low[j] = quad_low < low[j] ? quad_low : low[j];                                              \
            high[j] = quad_high > high[j] ? quad_high : high[j];                                         \
            sum[j] += (a + b) + (c + d);                                                                 \
            squares[j] += (a * a + b * b) + (c * c + d * d);                                             \
        }                                                                                                \
    }

DEFINE_ACCUMULATE_ROW(accumulate_row_baseline, )
DEFINE_ACCUMULATE_4_ROWS(accumulate_4_rows_baseline, )

static Py_ssize_t find_above_baseline(const float *restrict values, const float *restrict threshold,
                                      Py_ssize_t width, int32_t *restrict found)
{
    Py_ssize_t count = 0, j = 0;
#if defined(__SSE2__)
    static const int32_t offsets4[16][4] = {
        {0, 0, 0, 0}, {0, 0, 0, 0}, {1, 0, 0, 0}, {0, 1, 0, 0}, {2, 0, 0, 0}, {0, 2, 0, 0}, {1, 2, 0, 0},
        {0, 1, 2, 0}, {3, 0, 0, 0}, {0, 3, 0, 0}, {1, 3, 0, 0}, {0, 1, 3, 0}, {2, 3, 0, 0}, {0, 2, 3, 0},
        {1, 2, 3, 0}, {0, 1, 2, 3},
    };
    static const uint8_t bits4[16] = {0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4};
    for (; j + 4 <= width; j += 4) {
        const int mask = _mm_movemask_ps(_mm_cmpgt_ps(_mm_loadu_ps(values + j), _mm_loadu_ps(threshold + j)));
        const __m128i offsets = _mm_loadu_si128((const __m128i *)offsets4[mask]);
        _mm_storeu_si128((__m128i *)(found + count), _mm_add_epi32(offsets, _mm_set1_epi32((int32_t)j)));
        count += bits4[mask];
    }
#endif
    for (; j < width; ++j) {
        found[count] = (int32_t)j;
        count += values[j] > threshold[j];
    }
    return count;
}

#if HAVE_AVX2_DISPATCH
DEFINE_ACCUMULATE_ROW(accumulate_row_avx2, __attribute__((target("avx2"))))
DEFINE_ACCUMULATE_4_ROWS(accumulate_4_rows_avx2, __attribute__((target("avx2"))))

static int32_t offsets8[256][8];  /* row `mask`: the positions of its set bits, packed */
static uint8_t bits8[256];

static void fill_offsets8(void)
{
    for (int mask = 0; mask < 256; ++mask) {
        int count = 0;
        for (int bit = 0; bit < 8; ++bit) {
            if (mask & (1 << bit))
                offsets8[mask][count++] = bit;
        }
        bits8[mask] = (uint8_t)count;
    }
}

__attribute__((target("avx2"))) static Py_ssize_t find_above_avx2(const float *restrict values,
                                                                  const float *restrict threshold,
                                                                  Py_ssize_t width, int32_t *restrict found)
{
    Py_ssize_t count = 0, j = 0;
    for (; j + 8 <= width; j += 8) {
        const __m256 above = _mm256_cmp_ps(_mm256_loadu_ps(values + j), _mm256_loadu_ps(threshold + j), _CMP_GT_OQ);
        const int mask = _mm256_movemask_ps(above);
        const __m256i offsets = _mm256_loadu_si256((const __m256i *)offsets8[mask]);
        _mm256_storeu_si256((__m256i *)(found + count), _mm256_add_epi32(offsets, _mm256_set1_epi32((int32_t)j)));
        count += bits8[mask];
    }
    for (; j < width; ++j) {
        found[count] = (int32_t)j;
        count += values[j] > threshold[j];
    }
    return count;
}
#endif

#if HAVE_AVX2_DISPATCH
#define AVX512 __attribute__((target("avx512f")))
DEFINE_ACCUMULATE_ROW(accumulate_row_avx512, AVX512)
DEFINE_ACCUMULATE_4_ROWS(accumulate_4_rows_avx512, AVX512)

AVX512 static Py_ssize_t find_above_avx512(const float *restrict values, const float *restrict threshold,
                                           Py_ssize_t width, int32_t *restrict found)
{
    Py_ssize_t count = 0, j = 0;
    __m512i columns = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    for (; j + 16 <= width; j += 16) {
        const __mmask16 above = _mm512_cmp_ps_mask(_mm512_loadu_ps(values + j), _mm512_loadu_ps(threshold + j),
                                                   _CMP_GT_OQ);
        _mm512_mask_compressstoreu_epi32(found + count, above, columns);
        count += __builtin_popcount((unsigned)above);
        columns = _mm512_add_epi32(columns, step);
    }
    for (; j < width; ++j) {
        found[count] = (int32_t)j;
        count += values[j] > threshold[j];
    }
    return count;
}
#endif

#if HAVE_AVX2_DISPATCH
AVX512 static void rank_pair_avx512(const float *values, Py_ssize_t count, Py_ssize_t m, Py_ssize_t m2,
                                    float *out_m, float *out_m2)
{
    __m512 vectors[RANK_PAIR_MOST / 16];
    __mmask16 live[RANK_PAIR_MOST / 16];
    const int used = (int)((count + 15) / 16);
    for (int k = 0; k < used; ++k) {
        const Py_ssize_t left = count - 16 * (Py_ssize_t)k;
        live[k] = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
        vectors[k] = _mm512_maskz_loadu_ps(live[k], values + 16 * k);
    }
    int want_m = 1, want_m2 = m2 > 0;
    for (Py_ssize_t i = 0; i < count && (want_m || want_m2); ++i) {
        const __m512 value = _mm512_set1_ps(values[i]);
        Py_ssize_t above = 0, at_least = 0;
        for (int k = 0; k < used; ++k) {
            above += __builtin_popcount((unsigned)_mm512_mask_cmp_ps_mask(live[k], vectors[k], value, _CMP_GT_OQ));
            at_least += __builtin_popcount((unsigned)_mm512_mask_cmp_ps_mask(live[k], vectors[k], value, _CMP_GE_OQ));
        }
        if (want_m && above < m && m <= at_least) {
            *out_m = values[i];
            want_m = 0;
        }
        if (want_m2 && above < m2 && m2 <= at_least) {
            *out_m2 = values[i];
            want_m2 = 0;
        }
    }
}
#endif

static RowAccumulator accumulate_row = accumulate_row_baseline;
static FourRowAccumulator accumulate_4_rows = accumulate_4_rows_baseline;
static ColumnFinder find_above = find_above_baseline;

/* Append each of a row's values that is above its channel's threshold. */
static inline void append_above(const Band *band, const float *restrict values, Py_ssize_t width)
{
    const Py_ssize_t count = find_above(values, band->threshold, width, band->found);
    for (Py_ssize_t k = 0; k < count; ++k)
        append_value(band, band->found[k], values[band->found[k]]);
}

/* Block maxima of the band's rows, element-wise over its channels (one more read). */
static void record_block_maxima(const Job *job, Band *band, Py_ssize_t band_start, Py_ssize_t width,
                                Py_ssize_t block, Py_ssize_t blocks)
{
    const Py_ssize_t rows = job->outer;
    const float *first_column = job->data + band_start;
    for (Py_ssize_t b = 0; b < blocks; ++b) {
        float *restrict block_max = band->block_max + b * width;
        const Py_ssize_t first = b * block, last = first + block < rows ? first + block : rows;
        for (Py_ssize_t j = 0; j < width; ++j)
            block_max[j] = -INFINITY;
        for (Py_ssize_t row = first; row < last; ++row) {
            const float *restrict values = first_column + row * job->channels;
            for (Py_ssize_t j = 0; j < width; ++j)
                block_max[j] = values[j] > block_max[j] ? values[j] : block_max[j];
        }
    }
}

static void threshold_from_block_maxima(Band *band, Py_ssize_t j, Py_ssize_t width, Py_ssize_t blocks)
{
    for (Py_ssize_t b = 0; b < blocks; ++b)
        band->scratch[b] = band->block_max[b * width + j];
    band->threshold[j] = block_threshold(band->scratch, blocks, band->m);
    band->kept[j] = 0;
}

/* One channel again, alone: its column is gathered (a strided read) and its
 * candidates are the values above the m-th largest maximum of its blocks. */
static void redo_column(const Job *job, Band *band, Py_ssize_t band_start, Py_ssize_t j, Py_ssize_t block,
                        Py_ssize_t blocks)
{
    const Py_ssize_t rows = job->outer;
    const float *source = job->data + band_start + j;
    float *restrict column = band->column;
    for (Py_ssize_t row = 0; row < rows; ++row)
        column[row] = source[row * job->channels];
    for (Py_ssize_t b = 0; b < blocks; ++b) {
        const Py_ssize_t first = b * block, last = first + block < rows ? first + block : rows;
        float high = -INFINITY;
        for (Py_ssize_t row = first; row < last; ++row)
            high = column[row] > high ? column[row] : high;
        band->scratch[b] = high;
    }
    band->threshold[j] = block_threshold(band->scratch, blocks, band->m);
    band->kept[j] = 0;
    for (Py_ssize_t row = 0; row < rows; ++row) {
        if (column[row] > band->threshold[j])
            append_value(band, j, column[row]);
    }
}

/* Collect again the channels whose hint failed (the others have threshold
 * +inf) and finish them. Few: each down its own column. Many: the band's
 * block maxima (unless pass one kept them) give every such channel a bound,
 * then one more read of the band's rows collects them all. */
static void redo_channels(const Job *job, Band *band, Py_ssize_t band_start, Py_ssize_t width, Py_ssize_t block,
                          Py_ssize_t blocks, Py_ssize_t count, int maxima_kept, float *next_hint)
{
    const float *first_column = job->data + band_start;
    if (count <= REDO_BY_COLUMN) {
        for (Py_ssize_t j = 0; j < width; ++j) {
            if (band->threshold[j] != INFINITY)
                redo_column(job, band, band_start, j, block, blocks);
        }
    } else {
        if (!maxima_kept)
            record_block_maxima(job, band, band_start, width, block, blocks);
        for (Py_ssize_t j = 0; j < width; ++j) {
            if (band->threshold[j] != INFINITY)
                threshold_from_block_maxima(band, j, width, blocks);
        }
        for (Py_ssize_t row = 0; row < job->outer; ++row)
            append_above(band, first_column + row * job->channels, width);
    }
    for (Py_ssize_t j = 0; j < width; ++j) {
        if (band->threshold[j] != INFINITY)
            finish_channel(band->candidates + j * band->capacity, band->kept[j], band->m, band->threshold[j], 0,
                           0.0f, &job->out_kth[band_start + j], &next_hint[j]);
    }
}

/* Pass one over the band's rows, in blocks of `block` rows: per-channel
 * statistics (float partial sums per block), the values above each channel's
 * threshold, and with `keep_maxima` each block's maxima. */
static void read_band(const Job *job, Band *band, Py_ssize_t band_start, Py_ssize_t width, Py_ssize_t block,
                      int append, int keep_maxima)
{
    const Py_ssize_t rows = job->outer;
    const float *first_column = job->data + band_start;
    for (Py_ssize_t first = 0, b = 0; first < rows; first += block, ++b) {
        const Py_ssize_t last = first + block < rows ? first + block : rows;
        float *restrict block_low = band->block_low, *restrict block_high = band->block_high;
        float *restrict block_sum = band->block_sum, *restrict block_squares = band->block_squares;
        for (Py_ssize_t j = 0; j < width; ++j) {
            block_low[j] = INFINITY;
            block_high[j] = -INFINITY;
            block_sum[j] = 0.0f;
            block_squares[j] = 0.0f;
        }
        Py_ssize_t row = first;
        for (; row + 4 <= last; row += 4)
            accumulate_4_rows(first_column + row * job->channels, job->channels, width, block_low, block_high,
                              block_sum, block_squares);
        for (; row < last; ++row)
            accumulate_row(first_column + row * job->channels, width, block_low, block_high, block_sum,
                           block_squares);
        for (row = first; row < last && (append || job->histogram != NULL); ++row) {  /* rows still in cache */
            const float *values = first_column + row * job->channels;
            if (append)
                append_above(band, values, width);
            if (job->histogram != NULL)
                count_exponents(job->histogram, values, width);
        }
        float *restrict low = band->low, *restrict high = band->high;
        double *restrict sum = band->sum, *restrict squares = band->sum_of_squares;
        for (Py_ssize_t j = 0; j < width; ++j) {  /* restrict: vectorised */
            low[j] = block_low[j] < low[j] ? block_low[j] : low[j];
            high[j] = block_high[j] > high[j] ? block_high[j] : high[j];
            sum[j] += block_sum[j];
            squares[j] += block_squares[j];
        }
        if (keep_maxima)
            memcpy(band->block_max + b * width, block_high, sizeof(float) * (size_t)width);
    }
}

/* A band with a hint per channel reads its rows once, in long blocks (the
 * sums need no more), and keeps no block maxima: the hints rarely fail, and a
 * failed channel is redone on its own. Without hints, pass one keeps the
 * block maxima (`block` rows each) that give every channel its bound, and a
 * second read collects the candidates. */
static void summarize_band(const Job *job, Band *band, Py_ssize_t band_start, Py_ssize_t width,
                           Py_ssize_t block, Py_ssize_t blocks)
{
    const Py_ssize_t rows = job->outer, m = band->m;
    const float *first_column = job->data + band_start;
    const int select = m > 0, hinted = select && job->hint != NULL;
    for (Py_ssize_t j = 0; j < width; ++j) {
        band->low[j] = INFINITY;
        band->high[j] = -INFINITY;
        band->sum[j] = 0.0;
        band->sum_of_squares[j] = 0.0;
        band->kept[j] = 0;
        band->threshold[j] = hinted ? (float)job->hint[band_start + j] : INFINITY;
    }
    const int keep_maxima = select && !hinted;
    read_band(job, band, band_start, width, keep_maxima ? block : BLOCK_WITHOUT_SELECTION, hinted, keep_maxima);
    for (Py_ssize_t j = 0; j < width; ++j) {
        const Py_ssize_t channel = band_start + j;
        job->out_min[channel] = band->low[j];
        job->out_max[channel] = band->high[j];
        job->out_sum[channel] = band->sum[j];
        job->out_sum_of_squares[channel] = band->sum_of_squares[j];
    }
    if (!select)
        return;
    float next_hint[BAND];
    if (!hinted) {  /* thresholds from the block maxima, then a second read (the band may still be cached) */
        for (Py_ssize_t j = 0; j < width; ++j)
            threshold_from_block_maxima(band, j, width, blocks);
        for (Py_ssize_t row = 0; row < rows; ++row)
            append_above(band, first_column + row * job->channels, width);
    }
    Py_ssize_t redo = 0;
    for (Py_ssize_t j = 0; j < width; ++j) {
        float *own = band->candidates + j * band->capacity;
        const float hint = hinted ? (float)job->hint[band_start + j] : 0.0f;
        if (finish_channel(own, band->kept[j], m, band->threshold[j], hinted, hint, &job->out_kth[band_start + j],
                           &next_hint[j]) == 0) {
            band->threshold[j] = INFINITY;  /* done: takes no part in a redo */
            continue;
        }
        band->threshold[j] = -INFINITY;  /* the hint was too high for this channel: redo it */
        redo += 1;
    }
    if (redo > 0)
        redo_channels(job, band, band_start, width, block, blocks, redo, keep_maxima, next_hint);
    for (Py_ssize_t j = 0; j < width; ++j)
        job->out_hint[band_start + j] = next_hint[j];
}

static int summarize_channel_last(const Job *job)
{
    const Py_ssize_t m = job->out_kth ? job->m : 0, rows = job->outer;
    const Py_ssize_t block = block_length(rows, m), blocks = (rows + block - 1) / block;
    const Py_ssize_t span = job->channel_end - job->channel_begin;
    Band band;
    if (band_allocate(&band, span < BAND ? span : BAND, rows, blocks, m) != 0)
        return -1;
    for (Py_ssize_t start = job->channel_begin; start < job->channel_end; start += BAND) {
        const Py_ssize_t width = job->channel_end - start < BAND ? job->channel_end - start : BAND;
        summarize_band(job, &band, start, width, block, blocks);
    }
    return 0;
}

/* -------------------------------------------------------------------- channel-major
 * Each channel is `outer` contiguous runs. A run is read in chunks of LANES x
 * block values, seen as `block` rows of LANES lanes: statistics accumulate per
 * lane (element-wise, so the compiler vectorises without reassociating sums),
 * and each lane of a chunk is one block (`block` values, LANES apart). The
 * values after the last whole chunk of a run are blocks of one value. */
#define LANES 16

typedef struct {
    Py_ssize_t block, chunk, chunks_per_run, tail, blocks_per_run;
} RunLayout;

static RunLayout run_layout(Py_ssize_t inner, Py_ssize_t block)
{
    RunLayout layout;
    layout.block = block;
    layout.chunk = LANES * block;
    layout.chunks_per_run = inner / layout.chunk;
    layout.tail = inner - layout.chunks_per_run * layout.chunk;
    layout.blocks_per_run = layout.chunks_per_run * LANES + layout.tail;
    return layout;
}

/* Append the values above `*threshold`, branch-free; `candidates` has room
 * for `count` more. Raises the threshold when the buffer fills. */
static inline void append_values(float *candidates, Py_ssize_t *kept, Py_ssize_t capacity, Py_ssize_t m,
                                 float *threshold, const float *values, Py_ssize_t count, Py_ssize_t stride)
{
    const float t = *threshold;
    Py_ssize_t k = *kept;
    for (Py_ssize_t i = 0; i < count; ++i) {
        const float v = values[i * stride];
        candidates[k] = v;
        k += v > t;
    }
    if (k >= capacity) {
        *threshold = keep_top(candidates, k, m);
        k = m;
    }
    *kept = k;
}

typedef struct {
    float *block_max, *scratch, *candidates;
    Py_ssize_t capacity, m;
} MajorState;

/* One chunk of `rows` x LANES values: lane-wise running minimum (updated),
 * block maxima, sums and sums of squares (written). Written with vector
 * intrinsics: compilers do not vectorise this loop nest by themselves.
 * min/max keep the running value when v is NaN ((a < b) ? a : b semantics). */
typedef void (*ChunkReader)(const float *, Py_ssize_t, float *, float *, float *, float *);

static void read_chunk_portable(const float *restrict chunk, Py_ssize_t rows, float *restrict lane_low,
                                float *restrict block_high, float *restrict sums, float *restrict squares)
{
    for (int k = 0; k < LANES; ++k) {
        block_high[k] = -INFINITY;
        sums[k] = 0.0f;
        squares[k] = 0.0f;
    }
    for (Py_ssize_t row = 0; row < rows; ++row) {
        for (int k = 0; k < LANES; ++k) {
            const float v = chunk[row * LANES + k];
            lane_low[k] = v < lane_low[k] ? v : lane_low[k];
            block_high[k] = v > block_high[k] ? v : block_high[k];
            sums[k] += v;
            squares[k] += v * v;
        }
    }
}

#if defined(__SSE2__)
static void read_chunk_sse(const float *restrict chunk, Py_ssize_t rows, float *restrict lane_low,
                           float *restrict block_high, float *restrict sums, float *restrict squares)
{
    __m128 low[LANES / 4], high[LANES / 4], sum[LANES / 4], square[LANES / 4];
    for (int k = 0; k < LANES / 4; ++k) {
        low[k] = _mm_loadu_ps(lane_low + 4 * k);
        high[k] = _mm_set1_ps(-INFINITY);
        sum[k] = _mm_setzero_ps();
        square[k] = _mm_setzero_ps();
    }
    for (Py_ssize_t row = 0; row < rows; ++row) {
        for (int k = 0; k < LANES / 4; ++k) {
            const __m128 v = _mm_loadu_ps(chunk + row * LANES + 4 * k);
            low[k] = _mm_min_ps(v, low[k]);
            high[k] = _mm_max_ps(v, high[k]);
            sum[k] = _mm_add_ps(sum[k], v);
            square[k] = _mm_add_ps(square[k], _mm_mul_ps(v, v));
        }
    }
    for (int k = 0; k < LANES / 4; ++k) {
        _mm_storeu_ps(lane_low + 4 * k, low[k]);
        _mm_storeu_ps(block_high + 4 * k, high[k]);
        _mm_storeu_ps(sums + 4 * k, sum[k]);
        _mm_storeu_ps(squares + 4 * k, square[k]);
    }
}
#endif

#if HAVE_AVX2_DISPATCH
__attribute__((target("avx2"))) static void read_chunk_avx2(const float *restrict chunk, Py_ssize_t rows,
                                                            float *restrict lane_low, float *restrict block_high,
                                                            float *restrict sums, float *restrict squares)
{
    __m256 low[LANES / 8], high[LANES / 8], sum[LANES / 8], square[LANES / 8];
    for (int k = 0; k < LANES / 8; ++k) {
        low[k] = _mm256_loadu_ps(lane_low + 8 * k);
        high[k] = _mm256_set1_ps(-INFINITY);
        sum[k] = _mm256_setzero_ps();
        square[k] = _mm256_setzero_ps();
    }
    for (Py_ssize_t row = 0; row < rows; ++row) {
        for (int k = 0; k < LANES / 8; ++k) {
            const __m256 v = _mm256_loadu_ps(chunk + row * LANES + 8 * k);
            low[k] = _mm256_min_ps(v, low[k]);
            high[k] = _mm256_max_ps(v, high[k]);
            sum[k] = _mm256_add_ps(sum[k], v);
            square[k] = _mm256_add_ps(square[k], _mm256_mul_ps(v, v));
        }
    }
    for (int k = 0; k < LANES / 8; ++k) {
        _mm256_storeu_ps(lane_low + 8 * k, low[k]);
        _mm256_storeu_ps(block_high + 8 * k, high[k]);
        _mm256_storeu_ps(sums + 8 * k, sum[k]);
        _mm256_storeu_ps(squares + 8 * k, square[k]);
    }
}
#endif

#if HAVE_AVX2_DISPATCH
AVX512 static void read_chunk_avx512(const float *restrict chunk, Py_ssize_t rows, float *restrict lane_low,
                                     float *restrict block_high, float *restrict sums, float *restrict squares)
{
    __m512 low = _mm512_loadu_ps(lane_low), high = _mm512_set1_ps(-INFINITY);
    __m512 sum = _mm512_setzero_ps(), square = _mm512_setzero_ps();
    for (Py_ssize_t row = 0; row < rows; ++row) {
        const __m512 v = _mm512_loadu_ps(chunk + row * LANES);
        low = _mm512_min_ps(v, low);
        high = _mm512_max_ps(v, high);
        sum = _mm512_add_ps(sum, v);
        square = _mm512_fmadd_ps(v, v, square);
    }
    _mm512_storeu_ps(lane_low, low);
    _mm512_storeu_ps(block_high, high);
    _mm512_storeu_ps(sums, sum);
    _mm512_storeu_ps(squares, square);
}
#endif

static ChunkReader read_chunk = read_chunk_portable;

/* Pick each hot loop's version: the best this CPU runs, up to `limit` (0
 * baseline, 1 AVX2, 2 AVX-512). Run at module import with no limit; tests
 * lower it to check every version on one machine. Returns the level chosen. */
static int choose_kernels(int limit)
{
    int level = 0;
    read_chunk = read_chunk_portable;
    accumulate_row = accumulate_row_baseline;
    accumulate_4_rows = accumulate_4_rows_baseline;
    find_above = find_above_baseline;
    rank_pair = NULL;
#if defined(__SSE2__)
    read_chunk = read_chunk_sse;
#endif
#if HAVE_AVX2_DISPATCH
    __builtin_cpu_init();
    if (limit >= 1 && __builtin_cpu_supports("avx2")) {
        level = 1;
        fill_offsets8();
        read_chunk = read_chunk_avx2;
        accumulate_row = accumulate_row_avx2;
        accumulate_4_rows = accumulate_4_rows_avx2;
        find_above = find_above_avx2;
    }
    if (limit >= 2 && __builtin_cpu_supports("avx512f")) {
        level = 2;
        read_chunk = read_chunk_avx512;
        accumulate_row = accumulate_row_avx512;
        accumulate_4_rows = accumulate_4_rows_avx512;
        find_above = find_above_avx512;
        rank_pair = rank_pair_avx512;
    }
#endif
    (void)limit;
    return level;
}

/* Statistics of one channel; with selection also its block maxima (and, with a
 * hint, its candidates: `*threshold` is the hint). Returns the candidate count. */
static Py_ssize_t read_channel(const Job *job, const RunLayout *layout, Py_ssize_t channel, MajorState *state,
                               int append, float *threshold)
{
    float lane_low[LANES], lane_high[LANES], tail_low = INFINITY, tail_high = -INFINITY;
    double sum = 0.0, sum_of_squares = 0.0;
    Py_ssize_t kept = 0, next_block = 0;
    for (int k = 0; k < LANES; ++k) {
        lane_low[k] = INFINITY;
        lane_high[k] = -INFINITY;
    }
    for (Py_ssize_t run_index = 0; run_index < job->outer; ++run_index) {
        const float *run = job->data + (run_index * job->channels + channel) * job->inner;
        for (Py_ssize_t c = 0; c < layout->chunks_per_run; ++c) {
            const float *chunk = run + c * layout->chunk;
            float block_high[LANES], chunk_sum[LANES], chunk_squares[LANES];
            read_chunk(chunk, layout->block, lane_low, block_high, chunk_sum, chunk_squares);
            float chunk_high = -INFINITY;
            for (int k = 0; k < LANES; ++k) {
                lane_high[k] = block_high[k] > lane_high[k] ? block_high[k] : lane_high[k];
                chunk_high = block_high[k] > chunk_high ? block_high[k] : chunk_high;
                sum += chunk_sum[k];
                sum_of_squares += chunk_squares[k];
            }
            if (state->block_max != NULL) {
                memcpy(state->block_max + next_block, block_high, sizeof block_high);
                next_block += LANES;
            }
            if (append && chunk_high > *threshold)
                append_values(state->candidates, &kept, state->capacity, state->m, threshold, chunk,
                              layout->chunk, 1);
            if (job->histogram != NULL)
                count_exponents(job->histogram, chunk, layout->chunk);
        }
        const float *tail = run + layout->chunks_per_run * layout->chunk;
        for (Py_ssize_t i = 0; i < layout->tail; ++i) {
            const float v = tail[i];
            tail_low = v < tail_low ? v : tail_low;
            tail_high = v > tail_high ? v : tail_high;
            sum += v;
            sum_of_squares += (double)v * v;
            if (state->block_max != NULL)
                state->block_max[next_block++] = v == v ? v : -INFINITY;  /* a NaN is nobody's maximum */
        }
        if (append && layout->tail > 0)
            append_values(state->candidates, &kept, state->capacity, state->m, threshold, tail, layout->tail, 1);
        if (job->histogram != NULL)
            count_exponents(job->histogram, tail, layout->tail);
    }
    float low = tail_low, high = tail_high;
    for (int k = 0; k < LANES; ++k) {
        low = lane_low[k] < low ? lane_low[k] : low;
        high = lane_high[k] > high ? lane_high[k] : high;
    }
    job->out_min[channel] = low;
    job->out_max[channel] = high;
    job->out_sum[channel] = sum;
    job->out_sum_of_squares[channel] = sum_of_squares;
    return kept;
}

/* Candidates of one channel from its block maxima: the threshold is the m-th
 * largest maximum, and only blocks whose maximum beats it are read again. */
static Py_ssize_t collect_from_blocks(const Job *job, const RunLayout *layout, Py_ssize_t channel,
                                      MajorState *state, Py_ssize_t blocks, float *threshold)
{
    memcpy(state->scratch, state->block_max, sizeof(float) * (size_t)blocks);
    *threshold = block_threshold(state->scratch, blocks, state->m);
    Py_ssize_t kept = 0;
    for (Py_ssize_t index = 0; index < blocks; ++index) {
        if (!(state->block_max[index] > *threshold))
            continue;
        const Py_ssize_t run_index = index / layout->blocks_per_run, within = index % layout->blocks_per_run;
        const float *run = job->data + (run_index * job->channels + channel) * job->inner;
        if (within < layout->chunks_per_run * LANES) {  /* lane `within % LANES` of chunk `within / LANES` */
            const float *first = run + (within / LANES) * layout->chunk + within % LANES;
            append_values(state->candidates, &kept, state->capacity, state->m, threshold, first, layout->block,
                          LANES);
        } else {
            const float *value = run + layout->chunks_per_run * layout->chunk + (within - layout->chunks_per_run * LANES);
            append_values(state->candidates, &kept, state->capacity, state->m, threshold, value, 1, 1);
        }
    }
    return kept;
}

static int summarize_channel_major(const Job *job)
{
    const Py_ssize_t m = job->out_kth ? job->m : 0;
    Py_ssize_t block = block_length(job->outer * job->inner, m);
    if (m == 0 && block * LANES > job->inner)  /* keep whole chunks in a run: the tail is read value by value */
        block = job->inner / LANES > 1 ? job->inner / LANES : 1;
    const RunLayout layout = run_layout(job->inner, block);
    const Py_ssize_t blocks = job->outer * layout.blocks_per_run;
    MajorState state = {NULL, NULL, NULL, buffer_capacity(m > 0 ? m : 1), m};
    if (m > 0) {  /* candidates: a chunk of slack, the buffer is checked per chunk */
        const Py_ssize_t slack = layout.chunk > layout.tail ? layout.chunk : layout.tail;
        float *memory = (float *)workspace_get(sizeof(float) * (size_t)(2 * blocks + state.capacity + slack));
        state.block_max = memory;
        state.scratch = memory != NULL ? memory + blocks : NULL;
        state.candidates = memory != NULL ? memory + 2 * blocks : NULL;
        if (memory == NULL)
            return -1;
    }
    for (Py_ssize_t channel = job->channel_begin; channel < job->channel_end; ++channel) {
        const int hinted = m > 0 && job->hint != NULL;
        float threshold = hinted ? (float)job->hint[channel] : INFINITY;
        Py_ssize_t kept = read_channel(job, &layout, channel, &state, hinted, &threshold);
        if (m == 0)
            continue;
        float next_hint;
        if (!hinted || finish_channel(state.candidates, kept, m, threshold, 1, (float)job->hint[channel],
                                      &job->out_kth[channel], &next_hint)) {
            /* no hint, or it was too high for this channel */
            kept = collect_from_blocks(job, &layout, channel, &state, blocks, &threshold);
            finish_channel(state.candidates, kept, m, threshold, 0, 0.0f, &job->out_kth[channel], &next_hint);
        }
        job->out_hint[channel] = next_hint;
    }
    return 0;
}

/* ---------------------------------------------------------------------- Python entry */
/* Runs one job; returns 0, or -1 when out of memory. `*trusted` becomes 0 when
 * some channel of the job's range is not finite or not of moderate magnitude. */
static int run_job(const Job *job, int *trusted)
{
    const int status = job->inner == 1 ? summarize_channel_last(job) : summarize_channel_major(job);
    double *rows = job->out_min;
    const Py_ssize_t channels = job->channels;
    if (job->m == 0) {  /* the selection rows hold NaN: not computed */
        for (Py_ssize_t channel = job->channel_begin; channel < job->channel_end; ++channel)
            rows[4 * channels + channel] = rows[5 * channels + channel] = NAN;
    }
    int ok = 1;
    for (Py_ssize_t channel = job->channel_begin; channel < job->channel_end && ok; ++channel) {
        /* float32 partial sums of squares under- or overflow outside this range of magnitudes */
        const double largest = fmax(fabs(job->out_min[channel]), fabs(job->out_max[channel]));
        ok = isfinite(job->out_sum[channel]) && isfinite(job->out_sum_of_squares[channel]) &&
             largest < MODERATE_HIGH && (largest > MODERATE_LOW || largest == 0.0);
    }
    *trusted = ok;
    return status;
}

/* ---------------------------------------------------------------------- parallel runs
 * A batch's work is cut into parts (channel ranges; value ranges for one
 * channel without a selection) that run at once in the OpenMP team of the
 * process's OpenMP runtime, torch's, entered through its GOMP_parallel entry
 * point. The runtime is found at run time (set_team; this file is not built
 * with OpenMP); without it the parts run one after another in the calling
 * thread. Why not threads of our own: right after each of its parallel
 * regions torch's idle team members keep spinning on their cores for a while,
 * and an observer runs just then, so a thread of ours shared a core with a
 * spinning one (measured on the encoder benchmark: the part on the calling
 * thread took as long as the whole batch alone). The team's members are those
 * very threads, and a spinning member takes new work within microseconds. */
#define MOST_PARTS 64

typedef void (*ParallelEntry)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*TeamQuery)(void);

static ParallelEntry team_parallel;
static TeamQuery team_thread_number, team_size;
static unsigned largest_team;  /* the most members a run asked for: each may hold a workspace */

typedef struct {
    const Job *jobs;
    Py_ssize_t count;
    int status[MOST_PARTS], trusted[MOST_PARTS];
} PartsRun;

static void team_member(void *argument)
{
    PartsRun *run = (PartsRun *)argument;
    const Py_ssize_t size = team_size(), first = team_thread_number();
    for (Py_ssize_t k = first; k < run->count; k += size)
        run->status[k] = run_job(&run->jobs[k], &run->trusted[k]);
}

static void release_in_team(void *argument)
{
    (void)argument;
    workspace_free();
}

/* Runs every job; returns 0 (and whether all are trusted), or -1 when out of memory. */
static int run_parts(const Job *jobs, Py_ssize_t count, int *trusted)
{
    PartsRun run;
    run.jobs = jobs;
    run.count = count;
    if (count > 1 && team_parallel != NULL) {
        largest_team = (unsigned)count > largest_team ? (unsigned)count : largest_team;
        team_parallel(team_member, &run, (unsigned)count, 0);
    } else {
        for (Py_ssize_t k = 0; k < count; ++k)
            run.status[k] = run_job(&jobs[k], &run.trusted[k]);
    }
    *trusted = 1;
    for (Py_ssize_t k = 0; k < count; ++k) {
        if (run.status[k] != 0)
            return -1;
        *trusted = *trusted && run.trusted[k];
    }
    return 0;
}

typedef struct {
    Job job;  /* the whole batch */
    Py_ssize_t parts;
    int64_t *key_counts;  /* `parts` rows of HISTOGRAM_KEYS, or NULL */
} Request;

/* Parses (data, outer, channels, inner, m, parts, out, hint, key_counts); 0, or -1 with an exception set. */
static int parse_request(PyObject *args, Py_ssize_t offset, Request *request)
{
    Py_ssize_t data, outer, channels, inner, m, parts, out, hint, key_counts;
    PyObject *head = PyTuple_GetSlice(args, offset, offset + 9);
    if (head == NULL)
        return -1;
    const int parsed = PyArg_ParseTuple(head, "nnnnnnnnn", &data, &outer, &channels, &inner, &m, &parts, &out,
                                        &hint, &key_counts);
    Py_DECREF(head);
    if (!parsed)
        return -1;
    if (data == 0 || out == 0) {
        PyErr_SetString(PyExc_ValueError, "null data or output address");
        return -1;
    }
    if (outer < 1 || channels < 1 || inner < 1 || m < 0 || m > outer * inner || (m == 0 && hint != 0) ||
        parts < 1 || parts > MOST_PARTS) {
        PyErr_SetString(PyExc_ValueError, "inconsistent shape, m, hint or parts");
        return -1;
    }
    double *rows = (double *)out;
    const Job job = {
        (const float *)data, outer, channels, inner, m, 0, channels,
        rows, rows + channels, rows + 2 * channels, rows + 3 * channels, m > 0 ? rows + 4 * channels : NULL,
        (const double *)hint, m > 0 ? rows + 5 * channels : NULL, NULL,
    };
    request->job = job;
    request->parts = parts;
    request->key_counts = (int64_t *)key_counts;
    return 0;
}

/* Summarizes the request's batch in its parts; 0, or -1 when out of memory. */
static int summarize_request(const Request *request, int *trusted)
{
    const Job *whole = &request->job;
    const Py_ssize_t channels = whole->channels, values = whole->outer * whole->inner;
    Job jobs[MOST_PARTS] = {0};
    if (channels == 1 && whole->m == 0 && whole->outer == 1 && request->parts > 1) {
        /* one channel, no selection: value ranges, each summarized as a channel of its own */
        const Py_ssize_t parts = request->parts < values ? request->parts : values;
        double rows[MOST_PARTS][6];
        for (Py_ssize_t k = 0; k < parts; ++k) {
            const Py_ssize_t first = values * k / parts, last = values * (k + 1) / parts;
            const Job part = {
                whole->data + first, 1, 1, last - first, 0, 0, 1,
                &rows[k][0], &rows[k][1], &rows[k][2], &rows[k][3], NULL, NULL, NULL,
                request->key_counts != NULL ? request->key_counts + k * HISTOGRAM_KEYS : NULL,
            };
            jobs[k] = part;
        }
        if (run_parts(jobs, parts, trusted) != 0)
            return -1;
        double low = INFINITY, high = -INFINITY, sum = 0.0, squares = 0.0;
        for (Py_ssize_t k = 0; k < parts; ++k) {
            low = rows[k][0] < low ? rows[k][0] : low;
            high = rows[k][1] > high ? rows[k][1] : high;
            sum += rows[k][2];
            squares += rows[k][3];
        }
        whole->out_min[0] = low;
        whole->out_max[0] = high;
        whole->out_sum[0] = sum;
        whole->out_sum_of_squares[0] = squares;
        whole->out_min[4] = whole->out_min[5] = NAN;  /* rows of the selection: not computed */
        return 0;
    }
    const Py_ssize_t parts = request->parts < channels ? request->parts : channels;
    for (Py_ssize_t k = 0; k < parts; ++k) {
        jobs[k] = *whole;
        jobs[k].channel_begin = channels * k / parts;
        jobs[k].channel_end = channels * (k + 1) / parts;
        jobs[k].histogram = request->key_counts != NULL ? request->key_counts + k * HISTOGRAM_KEYS : NULL;
    }
    return run_parts(jobs, parts, trusted);
}

static PyObject *summarize(PyObject *self, PyObject *args)
{
    Request request;
    (void)self;
    if (parse_request(args, 0, &request) != 0)
        return NULL;
    int status, trusted;
    Py_BEGIN_ALLOW_THREADS
    status = summarize_request(&request, &trusted);
    Py_END_ALLOW_THREADS
    if (status != 0)
        return PyErr_NoMemory();
    return PyBool_FromLong(trusted);
}

static PyObject *set_team(PyObject *self, PyObject *args)
{
    Py_ssize_t parallel, thread_number, size;
    (void)self;
    if (!PyArg_ParseTuple(args, "nnn", &parallel, &thread_number, &size))
        return NULL;
    if ((parallel == 0) != (thread_number == 0) || (parallel == 0) != (size == 0)) {
        PyErr_SetString(PyExc_ValueError, "give all three entry points, or none");
        return NULL;
    }
    team_parallel = (ParallelEntry)parallel;
    team_thread_number = (TeamQuery)thread_number;
    team_size = (TeamQuery)size;
    Py_RETURN_NONE;
}

static PyObject *release_team_workspaces(PyObject *self, PyObject *args)
{
    (void)self;
    (void)args;
    if (team_parallel != NULL && largest_team > 1) {
        Py_BEGIN_ALLOW_THREADS
        team_parallel(release_in_team, NULL, largest_team, 0);
        Py_END_ALLOW_THREADS
    }
    workspace_free();
    Py_RETURN_NONE;
}

/* Adds one batch's summary (rows as summarize writes them) to a stream's running
 * totals, so a stream needs no per-batch storage and no later fold:
 *   totals, float64 [5, C]: min, max, sum, sum of squares, sum of max / m-th largest
 *   flags, int64 [3, C]: batches in that ratio sum; batches whose m-th largest is 0
 *     while the max is not; batches where the channel was constant
 * The ratio rows are left alone when `with_ratio` is false. Returns the batch's
 * range over all channels (max of maxima - min of minima). Every input is a
 * trusted summary: finite, as summarize reports. */
static double fold_summary(const double *summary, Py_ssize_t channels, double *totals, int64_t *flags,
                           int with_ratio)
{
    const double *low = summary, *high = low + channels, *sum = high + channels;
    const double *squares = sum + channels, *kth = squares + channels;
    double *total_low = totals, *total_high = total_low + channels;
    double *total_sum = total_high + channels, *total_squares = total_sum + channels;
    double *ratio_sum = total_squares + channels;
    int64_t *counted = flags, *zero_denominator = counted + channels;
    int64_t *constant = zero_denominator + channels;
    double batch_low = INFINITY, batch_high = -INFINITY;
    for (Py_ssize_t j = 0; j < channels; ++j) {
        total_low[j] = low[j] < total_low[j] ? low[j] : total_low[j];
        total_high[j] = high[j] > total_high[j] ? high[j] : total_high[j];
        total_sum[j] += sum[j];
        total_squares[j] += squares[j];
        constant[j] += high[j] == low[j];
        batch_low = low[j] < batch_low ? low[j] : batch_low;
        batch_high = high[j] > batch_high ? high[j] : batch_high;
        if (!with_ratio)
            continue;
        if (kth[j] != 0.0) {
            counted[j] += 1;
            ratio_sum[j] += high[j] / kth[j];
        } else {
            zero_denominator[j] += high[j] != 0.0;
        }
    }
    return batch_high - batch_low;
}

static PyObject *fold(PyObject *self, PyObject *args)
{
    Py_ssize_t summary_address, channels, totals_address, flags_address;
    int with_ratio;
    (void)self;
    if (!PyArg_ParseTuple(args, "nnnnp", &summary_address, &channels, &totals_address, &flags_address,
                          &with_ratio))
        return NULL;
    if (summary_address == 0 || totals_address == 0 || flags_address == 0 || channels < 1) {
        PyErr_SetString(PyExc_ValueError, "null address or no channels");
        return NULL;
    }
    return PyFloat_FromDouble(fold_summary((const double *)summary_address, channels, (double *)totals_address,
                                           (int64_t *)flags_address, with_ratio));
}

/* summarize, then, when the batch is trusted, fold: one call per observed batch. */
static PyObject *add_batch(PyObject *self, PyObject *args)
{
    Request request;
    Py_ssize_t totals, flags;
    (void)self;
    if (PyTuple_GET_SIZE(args) != 11) {
        PyErr_SetString(PyExc_TypeError, "add_batch takes 11 arguments");
        return NULL;
    }
    if (parse_request(args, 0, &request) != 0)
        return NULL;
    totals = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, 9));
    flags = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, 10));
    if (PyErr_Occurred())
        return NULL;
    if (totals == 0 || flags == 0) {
        PyErr_SetString(PyExc_ValueError, "null totals or flags address");
        return NULL;
    }
    int status, trusted;
    double range = 0.0;
    Py_BEGIN_ALLOW_THREADS
    status = summarize_request(&request, &trusted);
    if (status == 0 && trusted)
        range = fold_summary(request.job.out_min, request.job.channels, (double *)totals, (int64_t *)flags,
                             request.job.m > 0);
    Py_END_ALLOW_THREADS
    if (status != 0)
        return PyErr_NoMemory();
    if (!trusted)
        Py_RETURN_NONE;
    return PyFloat_FromDouble(range);
}

static PyObject *release_workspace(PyObject *self, PyObject *args)
{
    (void)self;
    (void)args;
    workspace_free();
    Py_RETURN_NONE;
}

static PyObject *use_instruction_set(PyObject *self, PyObject *args)
{
    int limit;
    (void)self;
    if (!PyArg_ParseTuple(args, "i", &limit))
        return NULL;
    return PyLong_FromLong(choose_kernels(limit));
}

static PyMethodDef methods[] = {
    {"release_workspace", release_workspace, METH_NOARGS,
     "release_workspace(): free the calling thread's work buffer (kept between calls otherwise)."},
    {"use_instruction_set", use_instruction_set, METH_VARARGS,
     "use_instruction_set(limit) -> level: use the best versions of the hot loops up to limit (0 baseline, "
     "1 AVX2, 2 AVX-512) that this CPU runs; returns the level in use. For tests; not thread-safe."},
    {"fold", fold, METH_VARARGS,
     "fold(summary, channels, totals, flags, with_ratio) -> batch range: add one trusted summary (as summarize "
     "writes it) to a stream's running float64 [5, C] totals (min, max, sum, sum of squares, ratio sum) and "
     "int64 [3, C] flags (ratio batches, zero-quantile batches, constant batches). Use qlint.stats.stream."},
    {"add_batch", add_batch, METH_VARARGS,
     "add_batch(data, outer, channels, inner, m, parts, out, hint, key_counts, totals, flags) -> batch range "
     "or None: summarize, then fold when the batch is trusted (None: untrusted, totals untouched)."},
    {"set_team", set_team, METH_VARARGS,
     "set_team(parallel, thread_number, team_size): run parts in the OpenMP team entered through these "
     "addresses (GOMP_parallel, omp_get_thread_num, omp_get_num_threads); all 0: in the calling thread."},
    {"release_team_workspaces", release_team_workspaces, METH_NOARGS,
     "release_team_workspaces(): free the work buffers of the calling thread and of its team's members."},
    {"summarize", summarize, METH_VARARGS,
     "summarize(data, outer, channels, inner, m, parts, out, hint, key_counts) -> trusted: "
     "per-channel summaries of a contiguous float32 array into out, float64 rows (min, max, sum, sum of "
     "squares, m-th largest, hint for the next batch; the last two NaN when m = 0 skips the selection), "
     "computed in up to `parts` parts at once. hint: float64 per channel or 0; key_counts: int64 "
     "[parts, 512], added to, or 0. Addresses as ints. "
     "True when every channel in the range is finite and of moderate magnitude. Use qlint.stats.kernel, "
     "which checks every address and size."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_channel_kernel",
    "Compiled per-channel batch summaries for qlint's statistics observer.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__channel_kernel(void)
{
    choose_kernels(2);
    return PyModule_Create(&module);
}
