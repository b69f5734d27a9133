/* The channel-last layout ([..., features]): rows read whole, a band of channels at a time.
 * Included once, by _channel_kernel.c: one translation unit, so every function
 * stays static and the compiler can inline across the parts. */

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
