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
 *     redone (its column gathered and bounded by its own block maxima; with
 *     many such channels, from the band's block maxima in further reads of its
 *     rows), so the result is exact either way and the hint only decides the
 *     cost.
 * When a buffer fills, a selection keeps its m largest values and their
 * minimum becomes the new threshold (still a lower bound of the answer).
 * A batch's channels (or, for one channel, its values) are cut into parts that
 * run at once in torch's OpenMP team: see "parallel runs".
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
 * The GIL is released while the kernel runs.
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
 * resident heap on the encoder benchmark). release_team_workspaces() frees the
 * calling thread's buffer and those of its team's members. */
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

#include "_kernel_selection.h"
#include "_kernel_channel_last.h"
#include "_kernel_channel_major.h"

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

/* The request for summarize's arguments (data, outer, channels, inner, m, parts, out,
 * hint, key_counts: `address` holds them in that order); 0, or -1 with an exception set. */
static int make_request(const Py_ssize_t address[9], Request *request)
{
    const Py_ssize_t data = address[0], outer = address[1], channels = address[2], inner = address[3];
    const Py_ssize_t m = address[4], parts = address[5], out = address[6], hint = address[7];
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
    request->key_counts = (int64_t *)address[8];
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
    Py_ssize_t a[9];
    Request request;
    (void)self;
    if (!PyArg_ParseTuple(args, "nnnnnnnnn", &a[0], &a[1], &a[2], &a[3], &a[4], &a[5], &a[6], &a[7], &a[8]) ||
        make_request(a, &request) != 0)
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
    Py_ssize_t a[9], totals, flags;
    Request request;
    (void)self;
    if (!PyArg_ParseTuple(args, "nnnnnnnnnnn", &a[0], &a[1], &a[2], &a[3], &a[4], &a[5], &a[6], &a[7], &a[8],
                          &totals, &flags) ||
        make_request(a, &request) != 0)
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

static PyObject *use_instruction_set(PyObject *self, PyObject *args)
{
    int limit;
    (void)self;
    if (!PyArg_ParseTuple(args, "i", &limit))
        return NULL;
    return PyLong_FromLong(choose_kernels(limit));
}

static PyMethodDef methods[] = {
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
