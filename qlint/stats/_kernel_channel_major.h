/* The channel-major layout ([N, C, ...]): each channel is `outer` contiguous runs.
 * Included once, by _channel_kernel.c: one translation unit, so every function
 * stays static and the compiler can inline across the parts. */

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
