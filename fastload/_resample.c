/* fastload._resample: the plan of a batch's resize (fastload.gpu.transforms), made on the host in a few
 * calls with the interpreter released.
 *
 *   antialias_taps(xmin, xsize, center, invscale, valid, src0, m0, m1, size, rows, shift, pos, weights)
 *   axis_taps(win0, lo, hi, srclen, reslen, flip, xmin, xsize, center, valid, invscale): one axis's filter
 *       per output pixel, for every image (the numbers antialias_taps takes)
 *   region_rows(offsets, heights, widths, ry, oy, ox, out): the rows of a group's resampling table
 *   fewest_groups(ys, xs, waste, starts): a batch's regions in the fewest groups of bounded padding
 *
 * For image i = rows[j] of a batch, output pixel o (of L) and tap k (of K, the output's last axis):
 * torch's separable antialiased bilinear filter (interpolate(..., antialias=True)), tap k reads
 * position xmin[i, o] + k of the resampled region and weighs max(0, 1 - |(xmin + k - center + 0.5) *
 * invscale[i]|), normalised by the sum of the output's weights taken in order of k (as torch sums
 * them); taps from xsize[i, o] on weigh 0 and read the first tap's position. A tap outside the
 * region's defined rows [m0, m1) or of an output outside its window (valid False) weighs 0.
 * Positions are clipped into the image (0 .. size - 1) and written plus shift[j]; weights as
 * float32 or float64, whichever the output buffer holds.
 *
 * Every weight is the same double arithmetic, one IEEE operation after the other (setup.py builds
 * with -ffp-contract=off), as fastload.gpu.transforms' numpy version of it (tested bit for bit):
 * the interpreter is released for the whole batch, where the numpy version returns to it for
 * each of its few dozen array operations (each a hand-over that a training thread beside it
 * pays for).
 *
 * Arguments are C-contiguous buffers: xmin, xsize int64 (N, L); center float64 (N, L); invscale
 * float64 (N,); valid bool (N, L); src0, m0, m1, size int64 (N,); rows, shift int64 (n,); pos int64
 * (n, L, K) and weights float32 or float64 (n, L, K), written.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A C-contiguous buffer of count items of itemsize bytes, of kind 'i' (int64), 'f' (float32 or float64, by
 * itemsize) or 'b' (bool) ("name" in the error; "of" says where the expected count comes from). */
static int get_buffer(PyObject *obj, Py_buffer *view, int writable, char kind, Py_ssize_t itemsize,
                      Py_ssize_t count, const char *name, const char *of) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) return -1;
    const char *format = view->format != NULL ? view->format : "B";
    while (*format == '@' || *format == '=' || *format == '<') format++;
    int ok = format[0] != '\0' && format[1] == '\0';
    if (kind == 'i') ok = ok && (format[0] == 'l' || format[0] == 'q') && view->itemsize == 8;
    if (kind == 'f') ok = ok && ((format[0] == 'd' && view->itemsize == 8) || (format[0] == 'f' && view->itemsize == 4));
    if (kind == 'b') ok = ok && format[0] == '?';
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s should be %s, but got items of format '%s'", name,
                     kind == 'i' ? "int64" : kind == 'f' ? "float32 or float64" : "bool", view->format);
        PyBuffer_Release(view);
        return -1;
    }
    if ((itemsize && view->itemsize != itemsize) || view->len != view->itemsize * count) {
        PyErr_Format(PyExc_ValueError, "%s should hold %zd items%s, but holds %zd", name, count, of,
                     view->len / view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *antialias_taps(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[13];
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5],
                          &objs[6], &objs[7], &objs[8], &objs[9], &objs[10], &objs[11], &objs[12]))
        return NULL;
    Py_buffer b[13];
    int got = 0;
    PyObject *result = NULL;
    /* sizes from the per-image and per-row arrays, checked against every other */
    Py_buffer probe;
    if (PyObject_GetBuffer(objs[5], &probe, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Py_ssize_t N = probe.len / 8;
    PyBuffer_Release(&probe);
    if (PyObject_GetBuffer(objs[9], &probe, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Py_ssize_t n = probe.len / 8;
    PyBuffer_Release(&probe);
    if (PyObject_GetBuffer(objs[0], &probe, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Py_ssize_t L = N > 0 ? probe.len / 8 / N : 0;
    PyBuffer_Release(&probe);
    if (PyObject_GetBuffer(objs[11], &probe, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Py_ssize_t K = n > 0 && L > 0 ? probe.len / 8 / (n * L) : 0;
    PyBuffer_Release(&probe);
    if (PyObject_GetBuffer(objs[12], &probe, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    int single = probe.itemsize == 4;
    PyBuffer_Release(&probe);

    static const char *names[13] = {"xmin", "xsize", "center", "invscale", "valid", "src0", "m0",
                                    "m1",   "size",  "rows",   "shift",    "pos",   "weights"};
    static const char kinds[13] = {'i', 'i', 'f', 'f', 'b', 'i', 'i', 'i', 'i', 'i', 'i', 'i', 'f'};
    const Py_ssize_t sizes[13] = {8, 8, 8, 8, 1, 8, 8, 8, 8, 8, 8, 8, 0};
    const Py_ssize_t counts[13] = {N * L, N * L, N * L, N, N * L, N, N, N, N, n, n, n * L * K, n * L * K};
    static const char *of[13] = {" (N x L: N from src0, L from xmin)", " (N x L)", " (N x L)", " (N, from src0)",
                                 " (N x L)", "", " (N, from src0)", " (N, from src0)", " (N, from src0)", "",
                                 " (n, from rows)", " (n x L x K)", " (n x L x K: K from pos)"};
    if (N * L > 0 && n > 0) {  /* pos decides K: it must hold whole (n, L) planes */
        if (PyObject_GetBuffer(objs[11], &probe, PyBUF_C_CONTIGUOUS) < 0) return NULL;
        const Py_ssize_t len = probe.len;
        PyBuffer_Release(&probe);
        if (len % (8 * n * L) != 0) {
            PyErr_Format(PyExc_ValueError, "pos should hold n x L x K items (n = %zd from rows, L = %zd from xmin), "
                         "but holds %zd", n, L, len / 8);
            return NULL;
        }
    }
    for (; got < 13; got++)
        if (get_buffer(objs[got], &b[got], got >= 11, kinds[got], sizes[got], counts[got], names[got], of[got]) < 0)
            goto done;
    if (K < 1 && n * L > 0) {
        PyErr_SetString(PyExc_ValueError, "pos should have at least one tap per output pixel");
        goto done;
    }
    const int64_t *xmin = b[0].buf, *xsize = b[1].buf, *src0 = b[5].buf, *m0 = b[6].buf, *m1 = b[7].buf,
                  *size = b[8].buf, *rows = b[9].buf, *shift = b[10].buf;
    const double *center = b[2].buf, *invscale = b[3].buf;
    const unsigned char *valid = b[4].buf;
    int64_t *pos = b[11].buf;
    float *w32 = b[12].buf;
    double *w64 = b[12].buf;
    for (Py_ssize_t j = 0; j < n; j++)
        if (rows[j] < 0 || rows[j] >= N) {
            PyErr_Format(PyExc_IndexError, "rows[%zd] = %lld is outside the batch's %zd images", j, (long long)rows[j], N);
            goto done;
        }

    double *w = PyMem_Malloc(sizeof(double) * (size_t)(K > 0 ? K : 1));
    if (w == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < n; j++) {
        const Py_ssize_t i = (Py_ssize_t)rows[j];
        const double inv = invscale[i];
        const int64_t top = size[i] - 1;
        for (Py_ssize_t o = 0; o < L; o++) {
            const Py_ssize_t p = i * L + o;
            const int64_t first = xmin[p], used = xsize[p];
            const double c = center[p];
            for (Py_ssize_t k = 0; k < K; k++) {
                double v = 0.0;
                if (k < used) {
                    v = 1.0 - fabs(((double)(first + k) - c + 0.5) * inv);
                    if (v < 0.0) v = 0.0;
                }
                w[k] = v;
            }
            double total = w[0];
            for (Py_ssize_t k = 1; k < K; k++) total += w[k];
            const double divisor = total > 0.0 ? total : 1.0;
            const double keep = valid[p] ? 1.0 : 0.0;
            int64_t at0 = 0;
            const Py_ssize_t out = (j * L + o) * K;
            for (Py_ssize_t k = 0; k < K; k++) {
                const int64_t at = src0[i] + first + k;
                const double inside = at >= m0[i] && at < m1[i] ? 1.0 : 0.0;
                const double v = w[k] / divisor * inside * keep;
                int64_t clipped = at < 0 ? 0 : at;
                if (clipped > top) clipped = top;
                if (k == 0) at0 = clipped;
                pos[out + k] = (k < used ? clipped : at0) + shift[j];
                if (single)
                    w32[out + k] = (float)v;
                else
                    w64[out + k] = v;
            }
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(w);
    result = Py_None;
    Py_INCREF(result);
done:
    for (int k = 0; k < got; k++) PyBuffer_Release(&b[k]);
    return result;
}

/* axis_taps(win0, lo, hi, srclen, reslen, flip, xmin, xsize, center, valid, invscale): one axis's antialiased
 * filter per output pixel, for every image of a batch (the numbers antialias_taps takes). Output o of image
 * i (of N; L outputs, L from the lengths of the outputs) is r = win0[i] + o (L - 1 - o where flip[i]) of
 * the resized image, valid where lo[i] <= r < hi[i]; with scale = srclen[i] / reslen[i] (support scale and
 * invscale 1 / scale from a downscale, else 1), center = scale * (clip(r, 0, reslen - 1) + 0.5), taps from
 * xmin = max(trunc(center - support + 0.5), 0) to min(trunc(center + support + 0.5), srclen) (exclusive):
 * fastload.gpu.transforms' numpy arithmetic, operation for operation. win0 .. reslen int64 (N,); flip bool
 * (N,) or None; xmin, xsize int64, center float64, valid bool (N, L); invscale float64 (N,), written. */
static PyObject *axis_taps(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[11];
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5], &objs[6],
                          &objs[7], &objs[8], &objs[9], &objs[10]))
        return NULL;
    Py_buffer probe;
    if (PyObject_GetBuffer(objs[0], &probe, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    const Py_ssize_t N = probe.len / 8;
    PyBuffer_Release(&probe);
    if (PyObject_GetBuffer(objs[6], &probe, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    const Py_ssize_t L = N > 0 ? probe.len / 8 / N : 0;
    PyBuffer_Release(&probe);
    const int flipped = objs[5] != Py_None;
    static const char *names[11] = {"win0",  "lo",    "hi",     "srclen", "reslen",  "flip",
                                    "xmin", "xsize", "center", "valid",  "invscale"};
    const Py_ssize_t sizes[11] = {8, 8, 8, 8, 8, 1, 8, 8, 8, 1, 8};
    static const char kinds[11] = {'i', 'i', 'i', 'i', 'i', 'b', 'i', 'i', 'f', 'b', 'f'};
    const Py_ssize_t counts[11] = {N, N, N, N, N, N, N * L, N * L, N * L, N * L, N};
    Py_buffer b[11];
    int held[11] = {0};
    PyObject *result = NULL;
    for (int k = 0; k < 11; k++) {
        if (k == 5 && !flipped) continue;
        if (get_buffer(objs[k], &b[k], k >= 6, kinds[k], sizes[k], counts[k], names[k],
                       k == 0 ? "" : k < 6 || k == 10 ? " (N, from win0)" : " (N x L: N from win0, L from xmin)") < 0)
            goto done;
        held[k] = 1;
    }
    const int64_t *win0 = b[0].buf, *lo = b[1].buf, *hi = b[2].buf, *srclen = b[3].buf, *reslen = b[4].buf;
    const unsigned char *flip = flipped ? b[5].buf : NULL;
    int64_t *xmin = b[6].buf, *xsize = b[7].buf;
    double *center = b[8].buf, *invscale = b[10].buf;
    unsigned char *valid = b[9].buf;
    for (Py_ssize_t i = 0; i < N; i++)
        if (reslen[i] < 1) {
            PyErr_Format(PyExc_ValueError, "reslen[%zd] = %lld should be at least 1", i, (long long)reslen[i]);
            goto done;
        }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < N; i++) {
        const double scale = (double)srclen[i] / (double)reslen[i];
        const double support = scale >= 1.0 ? scale : 1.0;
        invscale[i] = scale >= 1.0 ? 1.0 / scale : 1.0;
        for (Py_ssize_t o = 0; o < L; o++) {
            const Py_ssize_t p = i * L + o;
            const int64_t r = win0[i] + (flip != NULL && flip[i] ? (int64_t)(L - 1 - o) : (int64_t)o);
            valid[p] = r >= lo[i] && r < hi[i];
            int64_t rc = r < 0 ? 0 : r;
            if (rc > reslen[i] - 1) rc = reslen[i] - 1;
            const double c = scale * ((double)rc + 0.5);
            double first = trunc(c - support + 0.5);
            if (first < 0.0) first = 0.0;
            int64_t last = (int64_t)trunc(c + support + 0.5);
            if (last > srclen[i]) last = srclen[i];
            center[p] = c;
            xmin[p] = (int64_t)first;
            xsize[p] = last - (int64_t)first;
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    for (int k = 0; k < 11; k++)
        if (held[k]) PyBuffer_Release(&b[k]);
    return result;
}

/* region_rows(offsets, heights, widths, ry, oy, ox, out): where each row of a group's resampling table starts
 * in the flat buffer of its images. Image r (channels first from offsets[r], heights[r] x widths[r]) gives its
 * ry[r] rows from (oy[r], ox[r]), each row's channels one after the other: out[(row, c)] = offsets[r] +
 * c * heights[r] * widths[r] + (oy[r] + row) * widths[r] + ox[r]. All int64; out holds sum(ry) * C values
 * (C from its length). */
static PyObject *region_rows(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[7];
    if (!PyArg_ParseTuple(args, "OOOOOOO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5], &objs[6]))
        return NULL;
    Py_buffer probe;
    if (PyObject_GetBuffer(objs[0], &probe, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    const Py_ssize_t n = probe.len / 8;
    PyBuffer_Release(&probe);
    static const char *names[7] = {"offsets", "heights", "widths", "ry", "oy", "ox", "out"};
    Py_buffer b[7];
    int got = 0;
    PyObject *result = NULL;
    for (; got < 6; got++)
        if (get_buffer(objs[got], &b[got], 0, 'i', 8, n, names[got], got ? " (n, from offsets)" : "") < 0) goto done;
    const int64_t *offsets = b[0].buf, *heights = b[1].buf, *widths = b[2].buf, *ry = b[3].buf, *oy = b[4].buf,
                  *ox = b[5].buf;
    Py_ssize_t rows = 0;
    for (Py_ssize_t r = 0; r < n; r++) {
        if (ry[r] < 0) {
            PyErr_Format(PyExc_ValueError, "ry[%zd] = %lld is negative", r, (long long)ry[r]);
            goto done;
        }
        rows += (Py_ssize_t)ry[r];
    }
    if (PyObject_GetBuffer(objs[6], &probe, PyBUF_C_CONTIGUOUS) < 0) goto done;
    const Py_ssize_t out_len = probe.len;
    PyBuffer_Release(&probe);
    const Py_ssize_t channels = rows > 0 ? out_len / 8 / rows : 0;
    if (rows > 0 && out_len % (8 * rows) != 0) {
        PyErr_Format(PyExc_ValueError, "out should hold sum(ry) x C items (sum(ry) = %zd), but holds %zd", rows,
                     out_len / 8);
        goto done;
    }
    if (get_buffer(objs[6], &b[6], 1, 'i', 8, rows * channels, names[6], " (sum(ry) x C)") < 0) goto done;
    got = 7;
    int64_t *out = b[6].buf;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t at = 0;
    for (Py_ssize_t r = 0; r < n; r++) {
        const int64_t plane = heights[r] * widths[r];
        for (int64_t row = 0; row < ry[r]; row++) {
            const int64_t start = offsets[r] + (oy[r] + row) * widths[r] + ox[r];
            for (Py_ssize_t c = 0; c < channels; c++) out[at++] = start + c * plane;
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    for (int k = 0; k < got; k++) PyBuffer_Release(&b[k]);
    return result;
}

/* fewest_groups(ys, xs, waste, starts) -> count: images sorted widest first (rows ys, widths xs, float64 (n,))
 * split into the fewest runs whose rows, each run as wide as its first image, cost at most waste times
 * sum(ys * xs); of those, the cheapest (the first such split found, scanning a run's first image upwards).
 * Each run's first image into starts (int64 (n,)); returns the number of runs. fastload.gpu.transforms'
 * _fewest_groups in numpy, step for step (every sum is of whole numbers, exact in double). */
static PyObject *fewest_groups(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ys_obj, *xs_obj, *starts_obj;
    double waste;
    if (!PyArg_ParseTuple(args, "OOdO", &ys_obj, &xs_obj, &waste, &starts_obj)) return NULL;
    Py_buffer b[3];
    int got = 0;
    PyObject *result = NULL;
    Py_buffer probe;
    if (PyObject_GetBuffer(ys_obj, &probe, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    const Py_ssize_t n = probe.len / 8;
    PyBuffer_Release(&probe);
    PyObject *objs[3] = {ys_obj, xs_obj, starts_obj};
    static const char *names[3] = {"ys", "xs", "starts"};
    static const char kinds[3] = {'f', 'f', 'i'};
    for (; got < 3; got++)
        if (get_buffer(objs[got], &b[got], got == 2, kinds[got], 8, n, names[got], got ? " (n, from ys)" : "") < 0)
            goto done;
    if (!(waste >= 1.0)) {
        PyErr_Format(PyExc_ValueError, "waste should be at least 1, but got %g", waste);
        goto done;
    }
    const double *ys = b[0].buf, *xs = b[1].buf;
    int64_t *starts = b[2].buf;
    if (n == 0) {
        result = PyLong_FromLong(0);
        goto done;
    }
    double *total = PyMem_Malloc(sizeof(double) * (size_t)(n + 1));
    double *cost = PyMem_Malloc(sizeof(double) * (size_t)n);
    double *next = PyMem_Malloc(sizeof(double) * (size_t)n);
    int64_t *picks = NULL; /* (runs - 1) x n: each added run's first image, per last image */
    Py_ssize_t runs = 1, capacity = 0;
    int failed = total == NULL || cost == NULL || next == NULL;
    if (!failed) {
        Py_BEGIN_ALLOW_THREADS
        double own = 0.0;
        total[0] = 0.0;
        for (Py_ssize_t i = 0; i < n; i++) {
            total[i + 1] = total[i] + ys[i];
            own += ys[i] * xs[i];
        }
        const double bound = waste * own;
        for (Py_ssize_t j = 0; j < n; j++) cost[j] = xs[0] * total[j + 1];
        while (cost[n - 1] > bound && runs < n) {
            if (runs > capacity) {
                Py_ssize_t more = capacity ? 2 * capacity : 4;
                int64_t *grown = realloc(picks, sizeof(int64_t) * (size_t)(more * n));
                if (grown == NULL) {
                    failed = 1;
                    break;
                }
                picks = grown, capacity = more;
            }
            int64_t *pick = picks + (runs - 1) * n;
            for (Py_ssize_t j = 0; j < n; j++) {
                double best = INFINITY;
                int64_t at = 1;
                for (Py_ssize_t i = 1; i <= j; i++) {
                    const double c = cost[i - 1] + xs[i] * (total[j + 1] - total[i]);
                    if (c < best) best = c, at = i;
                }
                next[j] = best;
                pick[j] = at;
            }
            double *swap = cost;
            cost = next, next = swap;
            runs++;
        }
        if (!failed) {
            Py_ssize_t end = n - 1;
            for (Py_ssize_t k = runs - 1; k >= 1; k--) {
                const int64_t first = picks[(k - 1) * n + end];
                starts[k] = first;
                end = (Py_ssize_t)first - 1;
            }
            starts[0] = 0;
        }
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(total);
    PyMem_Free(cost);
    PyMem_Free(next);
    free(picks);
    if (failed) {
        PyErr_NoMemory();
        goto done;
    }
    result = PyLong_FromSsize_t(runs);
done:
    for (int k = 0; k < got; k++) PyBuffer_Release(&b[k]);
    return result;
}

static PyMethodDef methods[] = {
    {"fewest_groups", fewest_groups, METH_VARARGS,
     "fewest_groups(ys, xs, waste, starts) -> count: a batch's regions split into the fewest groups of "
     "bounded padding (see the module's source)."},
    {"axis_taps", axis_taps, METH_VARARGS,
     "axis_taps(win0, lo, hi, srclen, reslen, flip, xmin, xsize, center, valid, invscale): one axis's "
     "antialiased filter per output pixel (see the module's source)."},
    {"region_rows", region_rows, METH_VARARGS,
     "region_rows(offsets, heights, widths, ry, oy, ox, out): where each row of a resampling table starts "
     "(see the module's source)."},
    {"antialias_taps", antialias_taps, METH_VARARGS,
     "antialias_taps(xmin, xsize, center, invscale, valid, src0, m0, m1, size, rows, shift, pos, weights): "
     "torch's antialiased bilinear taps of images rows, written into pos (int64) and weights (float32 or "
     "float64), each (n, L, K) (see the module's source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "fastload._resample",
    "A batch's resize plan (taps, table rows, groups), made without the interpreter.", -1, methods,
};

PyMODINIT_FUNC PyInit__resample(void) { return PyModule_Create(&module); }
