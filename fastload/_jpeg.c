/*
 * fastload._jpeg: region-of-interest JPEG decoding with libjpeg-turbo (optional extension).
 *
 * A training crop (RandomResizedCrop) covers on average about half of an image, and only that
 * region has to be decoded: libjpeg-turbo can skip the inverse DCT, upsampling and colour
 * conversion of every row above the crop (jpeg_skip_scanlines), of every column outside it
 * (jpeg_crop_scanline), and stop decoding below it.  Combined with DCT scaling (1/2, 1/4, 1/8)
 * this is the "fused region-of-interest decode" DALI's CPU pipeline uses, here callable from a
 * DataLoader worker with the crop box fastload's own RNG drew.
 *
 * The pixels are libjpeg-turbo's (islow IDCT, fancy upsampling): identical to a full decode by
 * PIL or torchvision.io followed by a crop.  To keep them identical at the region's edges, the
 * region is widened by one pixel on each side before decoding (fancy upsampling replicates the
 * edge pixel of whatever it decodes) and the requested pixels are copied out of the middle.
 *
 * Functions (all take any contiguous bytes-like object and release the GIL while decoding):
 *   header(data) -> (width, height, components, colorspace)
 *   header_info(data) -> (width, height, components, colorspace, progressive, subsampling)
 *   decode(data, left, top, width, height, scale=1, eighths=0, fancy=True) -> bytearray of height*width*3
 *       RGB bytes. The region is given in the coordinates of the image decoded at 1/scale; fancy=False
 *       upsamples chroma by replication, as GPU decoders (nvJPEG) do.
 *   resample(src, width, height, box, dst, out_width, out_height, bicubic, flip, pillow13): PIL's
 *       bilinear or bicubic Image.resize with a box, bit for bit, on RGB bytes (see below).
 *   hwc_lut(src, dst, lut[, affine]): interleaved RGB bytes -> channels-first float32 through per-channel
 *       tables (the uint8 -> normalized float conversion of a torchvision pipeline, in one pass), or by the
 *       same arithmetic in AVX2 where the caller checked that it gives the table's bits.
 * Errors raise fastload._jpeg.Error (a ValueError) with libjpeg's message; a libjpeg warning
 * (corrupt data, premature end of file) is an error too, so the caller can fall back to a
 * full decode that decides like the reference decoders do.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <setjmp.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>

static PyObject *JpegError;

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
    int failed;
} error_mgr;

static void on_error_exit(j_common_ptr cinfo) {
    error_mgr *err = (error_mgr *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    err->failed = 1;
    longjmp(err->jump, 1);
}

static void on_emit_message(j_common_ptr cinfo, int msg_level) {
    error_mgr *err = (error_mgr *)cinfo->err;
    if (msg_level < 0 && !err->failed) { /* a warning: corrupt or truncated data */
        (*cinfo->err->format_message)(cinfo, err->message);
        err->failed = 1;
    }
}

static void init_errors(struct jpeg_decompress_struct *cinfo, error_mgr *err) {
    cinfo->err = jpeg_std_error(&err->pub);
    err->pub.error_exit = on_error_exit;
    err->pub.emit_message = on_emit_message;
    err->message[0] = '\0';
    err->failed = 0;
}

static const char *colorspace_name(J_COLOR_SPACE cs) {
    switch (cs) {
        case JCS_GRAYSCALE: return "L";
        case JCS_YCbCr: return "YCbCr";
        case JCS_RGB: return "RGB";
        case JCS_CMYK: return "CMYK";
        case JCS_YCCK: return "YCCK";
        default: return "unknown";
    }
}

/* Chroma subsampling of a 3-component JPEG as "4:4:4", "4:2:2", ...: luma's sampling factors over
 * the chroma components' (both chroma components alike); "gray" for one component. */
static const char *subsampling_name(const struct jpeg_decompress_struct *cinfo) {
    if (cinfo->num_components == 1) return "gray";
    if (cinfo->num_components != 3) return "other";
    const jpeg_component_info *c = cinfo->comp_info;
    if (c[1].h_samp_factor != c[2].h_samp_factor || c[1].v_samp_factor != c[2].v_samp_factor) return "other";
    if (c[0].h_samp_factor % c[1].h_samp_factor || c[0].v_samp_factor % c[1].v_samp_factor) return "other";
    const int h = c[0].h_samp_factor / c[1].h_samp_factor, v = c[0].v_samp_factor / c[1].v_samp_factor;
    if (h == 1 && v == 1) return "4:4:4";
    if (h == 2 && v == 1) return "4:2:2";
    if (h == 2 && v == 2) return "4:2:0";
    if (h == 1 && v == 2) return "4:4:0";
    if (h == 4 && v == 1) return "4:1:1";
    return "other";
}

/* header() and header_info(): the header read, its fields as a tuple (full: with the coding). */
static PyObject *read_header(PyObject *args, const char *format, int full) {
    Py_buffer data;
    if (!PyArg_ParseTuple(args, format, &data)) return NULL;
    struct jpeg_decompress_struct cinfo;
    error_mgr err;
    init_errors(&cinfo, &err);
    jpeg_create_decompress(&cinfo);
    if (setjmp(err.jump)) {
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&data);
        PyErr_SetString(JpegError, err.message);
        return NULL;
    }
    jpeg_mem_src(&cinfo, (const unsigned char *)data.buf, (unsigned long)data.len);
    jpeg_read_header(&cinfo, TRUE);
    PyObject *result =
        full ? Py_BuildValue("(IIisOs)", (unsigned)cinfo.image_width, (unsigned)cinfo.image_height,
                             cinfo.num_components, colorspace_name(cinfo.jpeg_color_space),
                             cinfo.progressive_mode ? Py_True : Py_False, subsampling_name(&cinfo))
             : Py_BuildValue("(IIis)", (unsigned)cinfo.image_width, (unsigned)cinfo.image_height,
                             cinfo.num_components, colorspace_name(cinfo.jpeg_color_space));
    jpeg_destroy_decompress(&cinfo);
    PyBuffer_Release(&data);
    return result;
}

static PyObject *jpeg_header(PyObject *self, PyObject *args) { return read_header(args, "y*:header", 0); }

static PyObject *jpeg_header_info(PyObject *self, PyObject *args) {
    return read_header(args, "y*:header_info", 1);
}

/* The decode proper, without the GIL.  Returns 0 on success, -1 on a libjpeg error/warning
 * (message in err), -2 on a region outside the image (message set here). */
static int decode_region(const unsigned char *buf, size_t len, unsigned left, unsigned top, unsigned width,
                         unsigned height, int scale, int fancy, unsigned char *out, error_mgr *err) {
    struct jpeg_decompress_struct cinfo;
    JSAMPARRAY rows;
    init_errors(&cinfo, err);
    jpeg_create_decompress(&cinfo);
    if (setjmp(err->jump)) {
        jpeg_destroy_decompress(&cinfo); /* frees the row buffer too (libjpeg's image pool) */
        return -1;
    }
    jpeg_mem_src(&cinfo, buf, (unsigned long)len);
    jpeg_read_header(&cinfo, TRUE);
    if (err->failed) longjmp(err->jump, 1);
    if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
        snprintf(err->message, sizeof(err->message), "CMYK/YCCK JPEGs are not decoded here (decode them with PIL)");
        jpeg_destroy_decompress(&cinfo);
        return -2;
    }
    cinfo.out_color_space = JCS_RGB;
    cinfo.dct_method = JDCT_ISLOW;
    cinfo.do_fancy_upsampling = fancy ? TRUE : FALSE;
    cinfo.scale_num = scale > 0 ? 1 : (unsigned)-scale;
    cinfo.scale_denom = scale > 0 ? (unsigned)scale : 8;
    jpeg_start_decompress(&cinfo);
    if (err->failed) longjmp(err->jump, 1);
    const unsigned W = cinfo.output_width, H = cinfo.output_height;
    if (width == 0 || height == 0 || (size_t)left + width > W || (size_t)top + height > H) {
        snprintf(err->message, sizeof(err->message),
                 "region (left=%u, top=%u, width=%u, height=%u) is not inside the %ux%u image decoded at %d/%d",
                 left, top, width, height, W, H, scale > 0 ? 1 : -scale, scale > 0 ? scale : 8);
        jpeg_abort_decompress(&cinfo);
        jpeg_destroy_decompress(&cinfo);
        return -2;
    }
    /* Widen by one pixel on each side so the requested pixels are never an edge of the decode. */
    JDIMENSION x0 = left > 0 ? left - 1 : 0;
    JDIMENSION x1 = left + width < W ? left + width + 1 : W;
    /* And to at least 64 pixels: libjpeg-turbo 2.1's fancy upsampling mis-handles a cropped
     * window whose chroma is a single sample wide (e.g. a 2-pixel window of a 4:2:0 image). */
    if (x1 - x0 < 64) x1 = x0 + 64 < W ? x0 + 64 : W;
    if (x1 - x0 < 64) x0 = x1 > 64 ? x1 - 64 : 0;
    JDIMENSION xoff = x0, xwidth = x1 - x0;
    /* Only at full scale: libjpeg-turbo 2.1.5 crops DCT-scaled images with 4x2/2x4 luma sampling
     * wrongly; a reduced image is small anyway, so it is decoded whole and the region copied. */
    const int partial = scale == 1;
    if (partial && xwidth < W) jpeg_crop_scanline(&cinfo, &xoff, &xwidth); /* rounds to iMCU boundaries */
    else { xoff = 0; xwidth = W; }
    const unsigned skip_rows = partial && top > 0 ? top - 1 : 0;
    if (skip_rows > 0 && jpeg_skip_scanlines(&cinfo, skip_rows) != skip_rows) {
        snprintf(err->message, sizeof(err->message), "could not skip %u rows", skip_rows);
        longjmp(err->jump, 1);
    }
    const size_t col = (size_t)(left - xoff) * 3, row_bytes = (size_t)width * 3;
    const int direct = col == 0 && xwidth == width; /* decoded rows are the output rows */
    rows = (*cinfo.mem->alloc_sarray)((j_common_ptr)&cinfo, JPOOL_IMAGE, xwidth * 3, 16);
    unsigned y = skip_rows;
    while (y < top + height) {
        JSAMPROW target[16];
        JDIMENSION want = 1, got;
        if (direct && y >= top) { /* several rows at a time, straight into the output */
            want = top + height - y < 16 ? top + height - y : 16;
            for (JDIMENSION k = 0; k < want; k++) target[k] = out + (size_t)(y - top + k) * row_bytes;
            got = jpeg_read_scanlines(&cinfo, target, want);
        } else {
            want = top + height - y < 16 ? top + height - y : 16;
            got = jpeg_read_scanlines(&cinfo, rows, want);
            for (JDIMENSION k = 0; k < got; k++)
                if (y + k >= top) memcpy(out + (size_t)(y + k - top) * row_bytes, rows[k] + col, row_bytes);
        }
        if (got == 0) {
            snprintf(err->message, sizeof(err->message), "decoder returned no row at %u", y);
            longjmp(err->jump, 1);
        }
        if (err->failed) longjmp(err->jump, 1);
        y += got;
    }
    jpeg_abort_decompress(&cinfo);
    jpeg_destroy_decompress(&cinfo);
    return 0;
}

static PyObject *jpeg_decode(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"data", "left", "top", "width", "height", "scale", "eighths", "fancy", NULL};
    Py_buffer data;
    unsigned int left, top, width, height;
    int scale = 1, eighths = 0, fancy = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*IIII|iip:decode", keywords, &data, &left, &top, &width,
                                     &height, &scale, &eighths, &fancy))
        return NULL;
    if (scale != 1 && scale != 2 && scale != 4 && scale != 8) {
        PyBuffer_Release(&data);
        PyErr_Format(PyExc_ValueError, "scale should be 1, 2, 4 or 8, but got %d", scale);
        return NULL;
    }
    if (eighths < 0 || eighths > 8 || (eighths && scale != 1)) {
        PyBuffer_Release(&data);
        PyErr_Format(PyExc_ValueError, "eighths should be 1..8 (with scale=1), but got %d", eighths);
        return NULL;
    }
    if (eighths) scale = -eighths; /* decode_region: a negative scale is -M for a decode at M/8 */
    if (width == 0 || height == 0 || (size_t)width * height > ((size_t)1 << 31)) {
        PyBuffer_Release(&data);
        PyErr_Format(PyExc_ValueError, "region size %ux%u is empty or too large", width, height);
        return NULL;
    }
    PyObject *out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)width * height * 3);
    if (out == NULL) {
        PyBuffer_Release(&data);
        return NULL;
    }
    error_mgr err;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = decode_region((const unsigned char *)data.buf, (size_t)data.len, left, top, width, height, scale,
                           fancy, (unsigned char *)PyByteArray_AS_STRING(out), &err);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    if (status != 0) {
        Py_DECREF(out);
        PyErr_SetString(status == -2 ? PyExc_ValueError : JpegError, err.message);
        return NULL;
    }
    return out;
}

/* ---- resample: PIL's Image.resize(size, BILINEAR | BICUBIC, box) of an RGB image, bit for bit ----
 *
 * The same coefficients (computed in double from the box in float, as Pillow's Resample.c does), the same
 * fixed-point rounding (22 fraction bits) and the same two passes in the same order (each rounded to uint8)
 * give the same bytes as Pillow's resample; it reads and writes 3-byte pixels in place of PIL's 4-byte ones
 * and sums a whole row at a time (integer sums: the order does not change them), which the compiler
 * vectorizes. */

#define RS_PRECISION_BITS (32 - 8 - 2)

static double rs_bilinear(double x) {
    if (x < 0.0) x = -x;
    if (x < 1.0) return 1.0 - x;
    return 0.0;
}

static double rs_bicubic(double x) {
    const double a = -0.5;
    if (x < 0.0) x = -x;
    if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
    if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
    return 0.0;
}

/* Pillow's precompute_coeffs + normalize_coeffs_8bpc: ksize, or 0 when out of memory. */
static int rs_coeffs(int in_size, float in0, float in1, int out_size, int bicubic, int **bounds_out,
                     int **kk_out) {
    double (*filter)(double) = bicubic ? rs_bicubic : rs_bilinear;
    double support, scale, filterscale;
    filterscale = scale = (double)(in1 - in0) / out_size;
    if (filterscale < 1.0) filterscale = 1.0;
    support = (bicubic ? 2.0 : 1.0) * filterscale;
    int ksize = (int)ceil(support) * 2 + 1;
    double *pre = malloc((size_t)out_size * ksize * sizeof(double));
    int *kk = malloc((size_t)out_size * ksize * sizeof(int));
    int *bounds = malloc((size_t)out_size * 2 * sizeof(int));
    if (pre == NULL || kk == NULL || bounds == NULL) {
        free(pre);
        free(kk);
        free(bounds);
        return 0;
    }
    double inv_filterscale = 1.0 / filterscale;
    for (int xx = 0; xx < out_size; xx++) {
        double center = in0 + (xx + 0.5) * scale;
        double ww = 0.0;
        int xmin = (int)(center - support + 0.5);
        if (xmin < 0) xmin = 0;
        int xmax = (int)(center + support + 0.5);
        if (xmax > in_size) xmax = in_size;
        xmax -= xmin;
        double *k = &pre[xx * ksize];
        int x;
        for (x = 0; x < xmax; x++) {
            double w = filter((x + xmin - center + 0.5) * inv_filterscale);
            k[x] = w;
            ww += w;
        }
        if (ww != 0.0) {
            for (x = 0; x < xmax; x++) k[x] /= ww;
        }
        for (; x < ksize; x++) k[x] = 0;
        bounds[xx * 2 + 0] = xmin;
        bounds[xx * 2 + 1] = xmax;
    }
    for (Py_ssize_t i = 0; i < (Py_ssize_t)out_size * ksize; i++) {
        kk[i] = pre[i] < 0 ? (int)(-0.5 + pre[i] * (1 << RS_PRECISION_BITS))
                           : (int)(0.5 + pre[i] * (1 << RS_PRECISION_BITS));
    }
    free(pre);
    *bounds_out = bounds;
    *kk_out = kk;
    return ksize;
}

static inline unsigned char rs_clip8(int v) {
    v >>= RS_PRECISION_BITS; /* arithmetic shift, as Pillow's table lookup indexes */
    return v < 0 ? 0 : v > 255 ? 255 : (unsigned char)v;
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define RS_HAVE_AVX2_KERNEL 1
/* rs_vertical's lanes [0, width3 rounded down to 32) with AVX2: 32 byte lanes a step, their sums in four
 * registers across the taps, then shifted, clamped to 0..255 by saturating packs (what rs_clip8 does) and
 * stored in order. Returns the first lane it did not write. */
__attribute__((target("avx2"))) static size_t rs_vertical_avx2(const unsigned char *src, size_t w3,
                                                                unsigned char *dst, int out_h, int ksize,
                                                                const int *bounds, const int *kk) {
    const __m256i half = _mm256_set1_epi32(1 << (RS_PRECISION_BITS - 1));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const size_t end = w3 & ~(size_t)31;
    for (int yy = 0; yy < out_h; yy++) {
        const int ymin = bounds[yy * 2], ymax = bounds[yy * 2 + 1];
        const int *k = &kk[yy * ksize];
        const unsigned char *base = src + (size_t)ymin * w3;
        unsigned char *o = dst + (size_t)yy * w3;
        for (size_t i = 0; i < end; i += 32) {
            __m256i a0 = half, a1 = half, a2 = half, a3 = half;
            const unsigned char *p = base + i;
            for (int y = 0; y < ymax; y++, p += w3) {
                const __m256i w = _mm256_set1_epi32(k[y]);
                const __m128i lo = _mm_loadu_si128((const __m128i *)p);
                const __m128i hi = _mm_loadu_si128((const __m128i *)(p + 16));
                a0 = _mm256_add_epi32(a0, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(lo), w));
                a1 = _mm256_add_epi32(a1, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)), w));
                a2 = _mm256_add_epi32(a2, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(hi), w));
                a3 = _mm256_add_epi32(a3, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)), w));
            }
            a0 = _mm256_srai_epi32(a0, RS_PRECISION_BITS);
            a1 = _mm256_srai_epi32(a1, RS_PRECISION_BITS);
            a2 = _mm256_srai_epi32(a2, RS_PRECISION_BITS);
            a3 = _mm256_srai_epi32(a3, RS_PRECISION_BITS);
            /* per 128-bit half: a0[0..3] a1[0..3] a2[0..3] a3[0..3] | a0[4..7] a1[4..7] a2[4..7] a3[4..7] */
            const __m256i b = _mm256_packus_epi16(_mm256_packs_epi32(a0, a1), _mm256_packs_epi32(a2, a3));
            _mm256_storeu_si256((__m256i *)(o + i), _mm256_permutevar8x32_epi32(b, order));
        }
    }
    return end;
}
#endif

/* One output row's lanes [i, i + n) of the vertical pass, the sums held in registers across the taps. */
static inline __attribute__((always_inline)) void rs_lanes(const unsigned char *src, size_t width3, size_t i,
                                                          int n, int ymin, int ymax, const int *k,
                                                          unsigned char *o) {
    int a[32];
    for (int j = 0; j < n; j++) a[j] = 1 << (RS_PRECISION_BITS - 1);
    for (int y = 0; y < ymax; y++) {
        const unsigned char *line = src + (size_t)(y + ymin) * width3 + i;
        const int w = k[y];
        for (int j = 0; j < n; j++) a[j] += line[j] * w;
    }
    for (int j = 0; j < n; j++) o[i + j] = rs_clip8(a[j]);
}

/* Whether the AVX2 kernel runs: the CPU has AVX2 and FASTLOAD_NO_SIMD is not set in the environment (then
 * only the portable loop runs; the tests check that both give Pillow's bytes). Decided once. */
static int rs_simd(void) {
    static int avx2 = -1;
    if (avx2 < 0) {
#ifdef RS_HAVE_AVX2_KERNEL
        avx2 = __builtin_cpu_supports("avx2") && getenv("FASTLOAD_NO_SIMD") == NULL ? 1 : 0;
#else
        avx2 = 0;
#endif
    }
    return avx2;
}

/* The vertical pass: out_h rows of width3 bytes, each the weighted sum of its taps' source rows. */
static void rs_vertical(const unsigned char *src, int width3, unsigned char *dst, int out_h, int ksize,
                        const int *bounds, const int *kk) {
    const size_t w3 = (size_t)width3;
    size_t start = 0;
#ifdef RS_HAVE_AVX2_KERNEL
    if (rs_simd()) start = rs_vertical_avx2(src, w3, dst, out_h, ksize, bounds, kk);
#endif
    for (int yy = 0; yy < out_h; yy++) {
        const int ymin = bounds[yy * 2], ymax = bounds[yy * 2 + 1];
        const int *k = &kk[yy * ksize];
        unsigned char *o = dst + (size_t)yy * w3;
        size_t i = start;
        for (; i + 32 <= w3; i += 32) rs_lanes(src, w3, i, 32, ymin, ymax, k, o);
        for (; i + 8 <= w3; i += 8) rs_lanes(src, w3, i, 8, ymin, ymax, k, o);
        for (; i < w3; i++) rs_lanes(src, w3, i, 1, ymin, ymax, k, o);
    }
}

#define RS_BLOCK 32

#ifdef RS_HAVE_AVX2_KERNEL
/* The 8x8 transpose of 32-bit elements held in r[0..7]. */
__attribute__((target("avx2"))) static inline void rs_transpose8(__m256i r[8]) {
    __m256i a[8], b[8];
    for (int i = 0; i < 8; i += 2) {
        a[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        a[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        b[i] = _mm256_unpacklo_epi64(a[i], a[i + 2]);
        b[i + 1] = _mm256_unpackhi_epi64(a[i], a[i + 2]);
        b[i + 2] = _mm256_unpacklo_epi64(a[i + 1], a[i + 3]);
        b[i + 3] = _mm256_unpackhi_epi64(a[i + 1], a[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2x128_si256(b[i], b[i + 4], 0x20);
        r[i + 4] = _mm256_permute2x128_si256(b[i], b[i + 4], 0x31);
    }
}

/* rs_horizontal with AVX2: the same scheme with each pixel widened to 4 bytes in the transposed block (its
 * 4th byte is summed too, and dropped), so both transposes are 8x8 transposes of 32-bit words: a 3-byte
 * pixel moved one at a time cost more than the sums (measured: 4-5x the vertical pass). Same sums per
 * byte, so the same bytes. Loads and stores never reach past the rows read or the rows written. */
__attribute__((target("avx2"))) static int rs_horizontal_avx2(const unsigned char *src, int in_w, int first,
                                                               int rows, unsigned char *dst, int out_w, int ksize,
                                                               const int *bounds, const int *kk, int x0,
                                                               int span, const int *local) {
    const size_t col = (size_t)RS_BLOCK * 4; /* bytes per transposed column: RS_BLOCK pixels of 4 bytes */
    unsigned char *t = aligned_alloc(32, (size_t)(span > 0 ? span : 1) * col);
    unsigned char *o = aligned_alloc(32, (size_t)out_w * col);
    if (t == NULL || o == NULL) {
        free(t);
        free(o);
        return -1;
    }
    memset(t, 0, (size_t)(span > 0 ? span : 1) * col); /* rows past the last block's end: summed, dropped */
    const size_t stride = (size_t)in_w * 3;
    const unsigned char *src_end = src + (size_t)(first + rows) * stride;
    const __m256i widen = _mm256_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1, 0, 1, 2, -1, 3, 4,
                                           5, -1, 6, 7, 8, -1, 9, 10, 11, -1);
    const __m256i narrow = _mm256_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1, 0, 1, 2, 4, 5,
                                            6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
    for (int r0 = 0; r0 < rows; r0 += RS_BLOCK) {
        const int nb = rows - r0 < RS_BLOCK ? rows - r0 : RS_BLOCK;
        const int nb8 = (nb + 7) & ~7;
        const size_t tcol = (size_t)nb8 * 4; /* this block's transposed columns: nb8 pixels of 4 bytes */
        const unsigned char *base = src + (size_t)(first + r0) * stride + (size_t)x0 * 3;
        for (int r = 0; r < nb; r += 8) {
            const int n = nb - r < 8 ? nb - r : 8;
            int x = 0;
            /* 8 pixels of 8 rows: two 16-byte loads a row (12 bytes used each; the last reads 4 past the 8th
             * pixel, so only where that stays inside the rows read) */
            for (; x + 8 <= span && n == 8 && base + (size_t)(r + 7) * stride + (size_t)x * 3 + 28 <= src_end;
                 x += 8) {
                __m256i v[8];
                for (int i = 0; i < 8; i++) {
                    const unsigned char *q = base + (size_t)(r + i) * stride + (size_t)x * 3;
                    const __m128i lo = _mm_loadu_si128((const __m128i *)q);
                    const __m128i hi = _mm_loadu_si128((const __m128i *)(q + 12));
                    v[i] = _mm256_shuffle_epi8(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1), widen);
                }
                rs_transpose8(v);
                for (int j = 0; j < 8; j++) _mm256_store_si256((__m256i *)(t + (size_t)(x + j) * tcol + r * 4), v[j]);
            }
            for (; x < span; x++) {
                unsigned char *p = t + (size_t)x * tcol + (size_t)r * 4;
                const unsigned char *q = base + (size_t)r * stride + (size_t)x * 3;
                for (int i = 0; i < n; i++, p += 4, q += stride) {
                    p[0] = q[0];
                    p[1] = q[1];
                    p[2] = q[2];
                }
            }
        }
        rs_vertical(t, (int)tcol, o, out_w, ksize, local, kk);
        const size_t ocol = tcol; /* o: for each output column, nb8 pixels of 4 bytes */
        for (int r = 0; r < nb; r += 8) {
            const int n = nb - r < 8 ? nb - r : 8;
            int x = 0;
            for (; x + 8 <= out_w; x += 8) {
                __m256i v[8];
                for (int j = 0; j < 8; j++) v[j] = _mm256_loadu_si256((const __m256i *)(o + (size_t)(x + j) * ocol + r * 4));
                rs_transpose8(v);
                for (int i = 0; i < n; i++) { /* row r + i, pixels x..x+7: exactly 24 bytes */
                    unsigned char *d = dst + ((size_t)(r0 + r + i) * out_w + x) * 3;
                    const __m256i w = _mm256_shuffle_epi8(v[i], narrow);
                    const __m128i lo = _mm256_castsi256_si128(w), hi = _mm256_extracti128_si256(w, 1);
                    _mm_storel_epi64((__m128i *)d, lo);
                    const int mid = _mm_extract_epi32(lo, 2);
                    memcpy(d + 8, &mid, 4);
                    _mm_storel_epi64((__m128i *)(d + 12), hi);
                    const int last = _mm_extract_epi32(hi, 2);
                    memcpy(d + 20, &last, 4);
                }
            }
            for (; x < out_w; x++) {
                const unsigned char *p = o + (size_t)x * ocol + (size_t)r * 4;
                for (int i = 0; i < n; i++, p += 4) {
                    unsigned char *d = dst + ((size_t)(r0 + r + i) * out_w + x) * 3;
                    d[0] = p[0];
                    d[1] = p[1];
                    d[2] = p[2];
                }
            }
        }
    }
    free(t);
    free(o);
    (void)bounds;
    return 0;
}
#endif

/* Rows [first, first + rows) of src (in_w pixels wide) -> dst (rows x out_w), resampled along the rows.
 * By way of rs_vertical, in blocks of RS_BLOCK rows: a block's columns that the taps read are transposed
 * into rows (pixels stay 3 bytes), the taps of every output pixel of the block are summed by the
 * vectorized vertical pass, and the result is transposed back. Both small buffers stay in the L1 cache.
 * The same integer sums as Pillow's pixel-by-pixel loop, so the same bytes. 0, or -1 when out of memory. */
static int rs_horizontal(const unsigned char *src, int in_w, int first, int rows, unsigned char *dst, int out_w,
                         int ksize, const int *bounds, const int *kk) {
    int x0 = in_w, x1 = 0;
    for (int xx = 0; xx < out_w; xx++) { /* the columns any tap reads */
        if (bounds[xx * 2 + 1] <= 0) continue;
        if (bounds[xx * 2] < x0) x0 = bounds[xx * 2];
        if (bounds[xx * 2] + bounds[xx * 2 + 1] > x1) x1 = bounds[xx * 2] + bounds[xx * 2 + 1];
    }
    if (x1 <= x0) x0 = x1 = 0;
    const int span = x1 - x0;
    unsigned char *t = malloc((size_t)(span > 0 ? span : 1) * RS_BLOCK * 3 + 1);
    unsigned char *o = malloc((size_t)out_w * RS_BLOCK * 3 + 1);
    int *local = malloc((size_t)out_w * 2 * sizeof(int)); /* bounds relative to x0 */
    if (t == NULL || o == NULL || local == NULL) {
        free(t);
        free(o);
        free(local);
        return -1;
    }
    for (int xx = 0; xx < out_w; xx++) {
        local[xx * 2] = bounds[xx * 2 + 1] > 0 ? bounds[xx * 2] - x0 : 0;
        local[xx * 2 + 1] = bounds[xx * 2 + 1];
    }
#ifdef RS_HAVE_AVX2_KERNEL
    if (rs_simd()) {
        free(t);
        free(o);
        const int status = rs_horizontal_avx2(src, in_w, first, rows, dst, out_w, ksize, bounds, kk, x0, span, local);
        free(local);
        return status;
    }
#endif
    for (int r0 = 0; r0 < rows; r0 += RS_BLOCK) {
        const int nb = rows - r0 < RS_BLOCK ? rows - r0 : RS_BLOCK;
        const size_t col = (size_t)nb * 3;
        /* Pixels are moved as 4-byte words (3 bytes and the next one): the extra byte lands on the slot
         * written next (t has one spare byte at its end); the last column is read 3 bytes at a time
         * where its 4th byte would lie past the source. */
        const unsigned char *base = src + ((size_t)(first + r0) * in_w + x0) * 3;
        const size_t stride = (size_t)in_w * 3;
        const int wide = x1 < in_w ? span : span - 1;
        for (int x = 0; x < span; x++) {
            unsigned char *p = t + (size_t)x * col;
            const unsigned char *q = base + (size_t)x * 3;
            if (x < wide) {
                for (int r = 0; r < nb; r++, p += 3, q += stride) memcpy(p, q, 4);
            } else {
                for (int r = 0; r < nb; r++, p += 3, q += stride) {
                    p[0] = q[0];
                    p[1] = q[1];
                    p[2] = q[2];
                }
            }
        }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized" /* t is filled above: every row, every column */
#endif
        rs_vertical(t, (int)col, o, out_w, ksize, local, kk);
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
        for (int r = 0; r < nb; r++) { /* 4-byte words again; each row's last pixel 3 bytes (o: 1 spare) */
            unsigned char *line = dst + (size_t)(r0 + r) * out_w * 3;
            const unsigned char *p = o + (size_t)r * 3;
            int x = 0;
            for (; x < out_w - 1; x++, p += col) memcpy(line + x * 3, p, 4);
            line[x * 3] = p[0];
            line[x * 3 + 1] = p[1];
            line[x * 3 + 2] = p[2];
        }
    }
    free(t);
    free(o);
    free(local);
    return 0;
}

static void rs_flip(unsigned char *img, int w, int h) {
    for (int y = 0; y < h; y++) {
        unsigned char *row = img + (size_t)y * w * 3;
        for (int a = 0, b = w - 1; a < b; a++, b--) {
            for (int c = 0; c < 3; c++) {
                unsigned char t = row[a * 3 + c];
                row[a * 3 + c] = row[b * 3 + c];
                row[b * 3 + c] = t;
            }
        }
    }
}

/* Both passes of a resample whose coefficients are made: the horizontal pass first (into the rows the vertical
 * pass reads) or the vertical one (every column). bv's row starts are changed. 0, -1 (out of memory). */
static int rs_two_pass(const unsigned char *src, int src_w, unsigned char *dst, int out_w, int out_h,
                       int horizontal_first, int ks_v, int *bv, const int *kv, int ks_h, const int *bh,
                       const int *kh) {
    int rows = out_h, cols = src_w, first = 0; /* the intermediate image: vertical first */
    if (horizontal_first) {
        first = bv[0];
        rows = bv[out_h * 2 - 2] + bv[out_h * 2 - 1] - first;
        cols = out_w;
        for (int i = 0; i < out_h; i++) bv[i * 2] -= first;
    }
    unsigned char *tmp = malloc((size_t)rows * cols * 3);
    if (tmp == NULL) return -1;
    int status = 0;
    if (horizontal_first) {
        status = rs_horizontal(src, src_w, first, rows, tmp, out_w, ks_h, bh, kh);
        if (!status) rs_vertical(tmp, out_w * 3, dst, out_h, ks_v, bv, kv);
    } else {
        rs_vertical(src, src_w * 3, tmp, out_h, ks_v, bv, kv);
        status = rs_horizontal(tmp, src_w, 0, out_h, dst, out_w, ks_h, bh, kh);
    }
    free(tmp);
    return status ? -1 : 0;
}

/* 0, -1 (out of memory). pillow13: the pass order of Pillow >= 13, which runs the vertical pass first when
 * the height shrinks by more than twice as many pixels as the width (earlier Pillows: horizontal first). */
static int rs_resample(const unsigned char *src, int in_w, int in_h, const float box[4], unsigned char *dst,
                       int out_w, int out_h, int bicubic, int flip, int pillow13) {
    int need_h = out_w != in_w || box[0] != 0 || box[2] != out_w;
    int need_v = out_h != in_h || box[1] != 0 || box[3] != out_h;
    int horizontal_first = !pillow13 || !((in_h - out_h) > 0 && (in_h - out_h) > (in_w - out_w) * 2);
    int *bv = NULL, *kv = NULL, *bh = NULL, *kh = NULL;
    int ks_v = 0, ks_h = 0;
    int status = -1;
    if ((need_h && horizontal_first) || need_v) {
        ks_v = rs_coeffs(in_h, box[1], box[3], out_h, bicubic, &bv, &kv);
        if (!ks_v) goto done;
    }
    if (need_h) {
        ks_h = rs_coeffs(in_w, box[0], box[2], out_w, bicubic, &bh, &kh);
        if (!ks_h) goto done;
    }
    if (need_h && need_v) {
        if (rs_two_pass(src, in_w, dst, out_w, out_h, horizontal_first, ks_v, bv, kv, ks_h, bh, kh)) goto done;
    } else if (need_h) {
        if (rs_horizontal(src, in_w, 0, out_h, dst, out_w, ks_h, bh, kh)) goto done;
    } else if (need_v) {
        rs_vertical(src, out_w * 3, dst, out_h, ks_v, bv, kv);
    } else {
        memcpy(dst, src, (size_t)out_w * out_h * 3);
    }
    if (flip) rs_flip(dst, out_w, out_h);
    status = 0;
done:
    free(bv);
    free(kv);
    free(bh);
    free(kh);
    return status;
}

/* PIL's Image.resize((full_w, full_h)) of a whole image of full_in_w x full_in_h, then a crop of out_w x out_h at
 * (win_x, win_y), computed for the window's pixels only: Pillow's coefficients of the full resize, so the bytes
 * are those of resizing and then cropping (torchvision's Resize + CenterCrop), which one resample of the
 * crop's box reproduces only within a level (its centres are computed from the box). src is a region of the
 * decoded image, region_w x region_h at (origin_x, origin_y); every tap must lie in it. 0, -1 (out of
 * memory), -2 (a tap outside the region: the caller resizes another way). */
static int rs_resample_window(const unsigned char *src, int region_w, int region_h, int origin_x, int origin_y,
                              int full_in_w, int full_in_h, int full_w, int full_h, int win_x, int win_y,
                              unsigned char *dst, int out_w, int out_h, int bicubic, int flip, int pillow13) {
    if (win_x < 0 || win_y < 0 || win_x + out_w > full_w || win_y + out_h > full_h) return -2;
    int horizontal_first = !pillow13 || !((full_in_h - full_h) > 0 && (full_in_h - full_h) > (full_in_w - full_w) * 2);
    int *bv = NULL, *kv = NULL, *bh = NULL, *kh = NULL;
    unsigned char *tmp = NULL;
    int status = -1;
    if (full_w == full_in_w) { /* the width stays: Pillow runs the vertical pass alone, on every column */
        int ks = rs_coeffs(full_in_h, 0.0f, (float)full_in_h, full_h, bicubic, &bv, &kv);
        if (!ks) goto done;
        int *wv = bv + (size_t)win_y * 2;
        status = -2;
        const int x0 = win_x - origin_x;
        if (x0 < 0 || x0 + out_w > region_w) goto done;
        for (int i = 0; i < out_h; i++) {
            wv[i * 2] -= origin_y;
            if (wv[i * 2 + 1] > 0 && (wv[i * 2] < 0 || wv[i * 2] + wv[i * 2 + 1] > region_h)) goto done;
            if (wv[i * 2] < 0) wv[i * 2] = 0;
        }
        status = -1;
        tmp = malloc((size_t)out_h * region_w * 3);
        if (tmp == NULL) goto done;
        rs_vertical(src, region_w * 3, tmp, out_h, ks, wv, kv + (size_t)win_y * ks);
        for (int y = 0; y < out_h; y++)
            memcpy(dst + (size_t)y * out_w * 3, tmp + ((size_t)y * region_w + x0) * 3, (size_t)out_w * 3);
        if (flip) rs_flip(dst, out_w, out_h);
        status = 0;
        goto done;
    }
    int ks_h = rs_coeffs(full_in_w, 0.0f, (float)full_in_w, full_w, bicubic, &bh, &kh);
    if (!ks_h) goto done;
    int *wh = bh + (size_t)win_x * 2;
    const int *qh = kh + (size_t)win_x * ks_h;
    if (full_h == full_in_h) { /* the height stays: Pillow runs the horizontal pass alone, on every row */
        status = -2;
        const int first = win_y - origin_y;
        if (first < 0 || first + out_h > region_h) goto done;
        for (int i = 0; i < out_w; i++) {
            wh[i * 2] -= origin_x;
            if (wh[i * 2 + 1] > 0 && (wh[i * 2] < 0 || wh[i * 2] + wh[i * 2 + 1] > region_w)) goto done;
            if (wh[i * 2] < 0) wh[i * 2] = 0;
        }
        status = -1;
        if (rs_horizontal(src, region_w, first, out_h, dst, out_w, ks_h, wh, qh)) goto done;
        if (flip) rs_flip(dst, out_w, out_h);
        status = 0;
        goto done;
    }
    int ks_v = rs_coeffs(full_in_h, 0.0f, (float)full_in_h, full_h, bicubic, &bv, &kv);
    if (!ks_v) goto done;
    int *wv = bv + (size_t)win_y * 2;
    const int *qv = kv + (size_t)win_y * ks_v;
    status = -2;
    for (int i = 0; i < out_h; i++) { /* the taps, in the region's coordinates */
        wv[i * 2] -= origin_y;
        if (wv[i * 2 + 1] > 0 && (wv[i * 2] < 0 || wv[i * 2] + wv[i * 2 + 1] > region_h)) goto done;
        if (wv[i * 2] < 0) wv[i * 2] = 0;
    }
    for (int i = 0; i < out_w; i++) {
        wh[i * 2] -= origin_x;
        if (wh[i * 2 + 1] > 0 && (wh[i * 2] < 0 || wh[i * 2] + wh[i * 2 + 1] > region_w)) goto done;
        if (wh[i * 2] < 0) wh[i * 2] = 0;
    }
    status = -1;
    if (rs_two_pass(src, region_w, dst, out_w, out_h, horizontal_first, ks_v, wv, qv, ks_h, wh, qh)) goto done;
    if (flip) rs_flip(dst, out_w, out_h);
    status = 0;
done:
    free(bv);
    free(kv);
    free(bh);
    free(kh);
    free(tmp);
    return status;
}

/* resample_window(src, region_w, region_h, origin_x, origin_y, full_in_w, full_in_h, full_w, full_h, win_x, win_y,
 *                 dst, out_w, out_h, bicubic, flip, pillow13) -> bool: see rs_resample_window (False: -2) */
static PyObject *jpeg_resample_window(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    int rw, rh, ox, oy, fiw, fih, fw, fh, wx, wy, out_w, out_h, bicubic, flip, pillow13;
    if (!PyArg_ParseTuple(args, "y*iiiiiiiiiiw*iippp:resample_window", &src, &rw, &rh, &ox, &oy, &fiw, &fih, &fw,
                          &fh, &wx, &wy, &dst, &out_w, &out_h, &bicubic, &flip, &pillow13))
        return NULL;
    PyObject *result = NULL;
    if (rw < 1 || rh < 1 || out_w < 1 || out_h < 1 || fiw < 1 || fih < 1 || fw < 1 || fh < 1 ||
        src.len != (Py_ssize_t)rw * rh * 3 || dst.len != (Py_ssize_t)out_w * out_h * 3 ||
        !PyBuffer_IsContiguous(&src, 'C') || !PyBuffer_IsContiguous(&dst, 'C')) {
        PyErr_Format(PyExc_ValueError,
                     "resample_window: need contiguous RGB buffers of %dx%d and %dx%d pixels (got %zd and %zd bytes)",
                     rw, rh, out_w, out_h, src.len, dst.len);
        goto done;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = rs_resample_window((const unsigned char *)src.buf, rw, rh, ox, oy, fiw, fih, fw, fh, wx, wy,
                                (unsigned char *)dst.buf, out_w, out_h, bicubic, flip, pillow13);
    Py_END_ALLOW_THREADS
    if (status == -1) {
        PyErr_NoMemory();
        goto done;
    }
    result = status == 0 ? Py_True : Py_False;
    Py_INCREF(result);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

/* resample(src, width, height, box, dst, out_width, out_height, bicubic, flip, pillow13) */
static PyObject *jpeg_resample(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    int in_w, in_h, out_w, out_h, bicubic, flip, pillow13;
    float box[4];
    if (!PyArg_ParseTuple(args, "y*ii(ffff)w*iippp:resample", &src, &in_w, &in_h, &box[0], &box[1], &box[2],
                          &box[3], &dst, &out_w, &out_h, &bicubic, &flip, &pillow13))
        return NULL;
    PyObject *result = NULL;
    if (in_w < 1 || in_h < 1 || out_w < 1 || out_h < 1 || src.len != (Py_ssize_t)in_w * in_h * 3 ||
        dst.len != (Py_ssize_t)out_w * out_h * 3 || !PyBuffer_IsContiguous(&src, 'C') ||
        !PyBuffer_IsContiguous(&dst, 'C')) {
        PyErr_Format(PyExc_ValueError,
                     "resample: need contiguous RGB buffers of %dx%d and %dx%d pixels (got %zd and %zd bytes)",
                     in_w, in_h, out_w, out_h, src.len, dst.len);
        goto done;
    }
    if (box[0] < 0 || box[1] < 0 || box[2] > in_w || box[3] > in_h || box[2] - box[0] < 0 || box[3] - box[1] < 0) {
        PyErr_SetString(PyExc_ValueError, "resample: the box must lie inside the image and not be empty");
        goto done;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = rs_resample((const unsigned char *)src.buf, in_w, in_h, box, (unsigned char *)dst.buf, out_w, out_h,
                         bicubic, flip, pillow13);
    Py_END_ALLOW_THREADS
    if (status != 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

/* hwc_lut(src, dst, lut[, affine]): dst[c][i] = lut[c][src[i][c]] for an interleaved RGB image and 3 tables of
 * 256 floats: the uint8 -> float conversion and normalization of one image (a pure function of each value and
 * channel, so the table holds exactly the floats the per-pixel arithmetic gives) in one pass that also moves
 * the channels first.
 *
 * affine (8 float32: k, divide, mean[3], std[3]), optional: with AVX2, blocks of 16 pixels are computed as
 * (x * k - mean[c]) / std[c] (x / k when divide is not 0) in float32, one IEEE operation after the other (no
 * fused multiply-add: setup.py builds with -ffp-contract=off, else CFLAGS such as -march=native let the
 * compiler fuse x * k - mean and the check below rejects it), 2.5x faster than the lookups (which stay for the tail and
 * without AVX2). Same bits only when the table was made by that arithmetic: the caller checks that once, on
 * all 256 values, against its table (decode.affine_for_table), and passes affine only then. */
#ifdef RS_HAVE_AVX2_KERNEL
__attribute__((target("avx2"))) static Py_ssize_t hwc_affine_avx2(const unsigned char *s, float *d0, Py_ssize_t n,
                                                                   const float *affine) {
    float *d1 = d0 + n, *d2 = d1 + n;
    float *dst[3] = {d0, d1, d2};
    const __m256 k = _mm256_set1_ps(affine[0]);
    const int divide = affine[1] != 0.0f;
    __m256 mean[3], std[3];
    for (int c = 0; c < 3; c++) {
        mean[c] = _mm256_set1_ps(affine[2 + c]);
        std[c] = _mm256_set1_ps(affine[5 + c]);
    }
    /* byte j of channel c sits at 3j + c in 48 interleaved bytes: gather each channel's 16 bytes from the three
     * 16-byte loads (-1: a zero byte) */
    const __m128i pick[3][3] = {
        {_mm_setr_epi8(0, 3, 6, 9, 12, 15, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1),
         _mm_setr_epi8(-1, -1, -1, -1, -1, -1, 2, 5, 8, 11, 14, -1, -1, -1, -1, -1),
         _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 1, 4, 7, 10, 13)},
        {_mm_setr_epi8(1, 4, 7, 10, 13, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1),
         _mm_setr_epi8(-1, -1, -1, -1, -1, 0, 3, 6, 9, 12, 15, -1, -1, -1, -1, -1),
         _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 2, 5, 8, 11, 14)},
        {_mm_setr_epi8(2, 5, 8, 11, 14, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1),
         _mm_setr_epi8(-1, -1, -1, -1, -1, 1, 4, 7, 10, 13, -1, -1, -1, -1, -1, -1),
         _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 3, 6, 9, 12, 15)},
    };
    Py_ssize_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const unsigned char *p = s + 3 * i;
        const __m128i x0 = _mm_loadu_si128((const __m128i *)p);
        const __m128i x1 = _mm_loadu_si128((const __m128i *)(p + 16));
        const __m128i x2 = _mm_loadu_si128((const __m128i *)(p + 32));
        for (int c = 0; c < 3; c++) {
            const __m128i v = _mm_or_si128(_mm_or_si128(_mm_shuffle_epi8(x0, pick[c][0]), _mm_shuffle_epi8(x1, pick[c][1])),
                                           _mm_shuffle_epi8(x2, pick[c][2]));
            __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
            __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
            lo = divide ? _mm256_div_ps(lo, k) : _mm256_mul_ps(lo, k);
            hi = divide ? _mm256_div_ps(hi, k) : _mm256_mul_ps(hi, k);
            lo = _mm256_sub_ps(lo, mean[c]);
            hi = _mm256_sub_ps(hi, mean[c]);
            lo = _mm256_div_ps(lo, std[c]);
            hi = _mm256_div_ps(hi, std[c]);
            _mm256_storeu_ps(dst[c] + i, lo);
            _mm256_storeu_ps(dst[c] + i + 8, hi);
        }
    }
    return i;
}
#endif

static PyObject *hwc_lut(PyObject *self, PyObject *args) {
    Py_buffer src, dst, lut, affine = {0};
    if (!PyArg_ParseTuple(args, "y*w*y*|y*:hwc_lut", &src, &dst, &lut, &affine)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = src.len / 3;
    if (src.len % 3 != 0 || dst.len != n * 3 * (Py_ssize_t)sizeof(float) ||
        lut.len != 3 * 256 * (Py_ssize_t)sizeof(float) || !PyBuffer_IsContiguous(&dst, 'C')) {
        PyErr_Format(PyExc_ValueError,
                     "hwc_lut: need 3*n source bytes, a contiguous destination of 3*n float32 and 3*256 float32 "
                     "tables (got %zd, %zd and %zd bytes)",
                     src.len, dst.len, lut.len);
        goto done;
    }
    if (affine.buf != NULL && affine.len != 8 * (Py_ssize_t)sizeof(float)) {
        PyErr_Format(PyExc_ValueError,
                     "hwc_lut: affine should be 8 float32 (k, divide, 3 means, 3 stds), got %zd bytes", affine.len);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *s = (const unsigned char *)src.buf;
    const float *t = (const float *)lut.buf;
    float *d0 = (float *)dst.buf, *d1 = d0 + n, *d2 = d1 + n;
    Py_ssize_t i = 0;
#ifdef RS_HAVE_AVX2_KERNEL
    if (affine.buf != NULL && rs_simd()) i = hwc_affine_avx2(s, d0, n, (const float *)affine.buf);
#endif
    for (s += 3 * i; i < n; i++, s += 3) {
        d0[i] = t[s[0]];
        d1[i] = t[256 + s[1]];
        d2[i] = t[512 + s[2]];
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&lut);
    if (affine.buf != NULL) PyBuffer_Release(&affine);
    return result;
}

/* enhance(image, factor, kind): PIL's ImageEnhance (Brightness: kind 0, Contrast: 1, Color: 2) .enhance(factor)
 * of interleaved RGB bytes, in place, in Pillow's arithmetic: Image.blend(degenerate, image, factor) is
 * (UINT8) clip(d + factor * (x - d)) in float32 (no fused multiply-add: -ffp-contract=off), d = 0, the image's
 * mean grey rounded (ImageStat's double mean, int(mean + 0.5)), or the pixel's grey; grey is Pillow's RGB -> L,
 * (19595 R + 38470 G + 7471 B + 0x8000) >> 16. fastload._jitter checks it against the installed Pillow once. */
static inline int rgb_grey(const unsigned char *p) { return (p[0] * 19595 + p[1] * 38470 + p[2] * 7471 + 0x8000) >> 16; }

static PyObject *enhance(PyObject *self, PyObject *args) {
    Py_buffer buf;
    float factor;
    int kind;
    if (!PyArg_ParseTuple(args, "w*fi:enhance", &buf, &factor, &kind)) return NULL;
    if (buf.len % 3 != 0 || kind < 0 || kind > 2 || !PyBuffer_IsContiguous(&buf, 'C')) {
        PyErr_Format(PyExc_ValueError, "enhance: need contiguous RGB bytes and kind 0, 1 or 2 (got %zd bytes, kind %d)",
                     buf.len, kind);
        PyBuffer_Release(&buf);
        return NULL;
    }
    unsigned char *grey = kind == 2 ? (unsigned char *)PyMem_RawMalloc(buf.len ? buf.len : 1) : NULL;
    if (kind == 2 && grey == NULL) {
        PyBuffer_Release(&buf);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    unsigned char *p = (unsigned char *)buf.buf;
    const Py_ssize_t n = buf.len / 3;
    float d = 0.0f;
    if (kind == 1 && n > 0) {
        long long sum = 0;
        for (Py_ssize_t i = 0; i < n; i++) sum += rgb_grey(p + 3 * i);
        d = (float)(int)((double)sum / (double)n + 0.5);
    }
    if (kind == 2) /* each pixel's grey for each of its channels: then one flat, vectorised loop */
        for (Py_ssize_t i = 0; i < n; i++) grey[3 * i] = grey[3 * i + 1] = grey[3 * i + 2] = (unsigned char)rgb_grey(p + 3 * i);
    for (Py_ssize_t i = 0; i < 3 * n; i++) {
        const float di = grey != NULL ? (float)grey[i] : d;
        float t = di + factor * ((float)p[i] - di);
        t = t < 0.0f ? 0.0f : t > 255.0f ? 255.0f : t;
        p[i] = (unsigned char)(int)t;
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(grey);
    PyBuffer_Release(&buf);
    Py_RETURN_NONE;
}

static PyObject *jpeg_simd(PyObject *self, PyObject *args) { return PyBool_FromLong(rs_simd()); }

static PyMethodDef methods[] = {
    {"header", jpeg_header, METH_VARARGS,
     "header(data) -> (width, height, components, colorspace): reads the JPEG header only."},
    {"header_info", jpeg_header_info, METH_VARARGS,
     "header_info(data) -> (width, height, components, colorspace, progressive, subsampling): the header "
     "only; subsampling is \"4:4:4\", \"4:2:2\", \"4:2:0\", \"4:4:0\", \"4:1:1\", \"gray\" or \"other\"."},
    {"decode", (PyCFunction)(void (*)(void))jpeg_decode, METH_VARARGS | METH_KEYWORDS,
     "decode(data, left, top, width, height, scale=1, eighths=0, fancy=True) -> bytearray: RGB pixels (HWC) of a "
     "region of the image decoded at 1/scale (or at eighths/8: libjpeg-turbo's other DCT scales), decoding only "
     "that region at full scale; fancy=False: chroma upsampled by replication (nvJPEG's way) instead of "
     "libjpeg-turbo's default smooth (\"fancy\") upsampling."},
    {"resample", jpeg_resample, METH_VARARGS,
     "resample(src, width, height, box, dst, out_width, out_height, bicubic, flip, pillow13): PIL's "
     "Image.resize((out_width, out_height), BICUBIC if bicubic else BILINEAR, box) of RGB bytes, bit for bit, "
     "written into dst (mirrored when flip); pillow13: Pillow >= 13's order of the two passes."},
    {"resample_window", jpeg_resample_window, METH_VARARGS,
     "resample_window(src, region_w, region_h, origin_x, origin_y, full_in_w, full_in_h, full_w, full_h, win_x, "
     "win_y, dst, out_w, out_h, bicubic, flip, pillow13) -> bool: PIL's resize of the whole image to full_w x "
     "full_h, then the crop of out_w x out_h at (win_x, win_y), bit for bit, computed for the crop only, from a "
     "region of the decoded image at (origin_x, origin_y); False where it cannot (see the source)."},
    {"enhance", enhance, METH_VARARGS,
     "enhance(image, factor, kind): PIL's ImageEnhance Brightness (kind 0), Contrast (1) or Color (2) enhance(factor) "
     "of interleaved RGB bytes, in place, bit for bit."},
    {"simd", jpeg_simd, METH_NOARGS, "simd() -> bool: whether resample runs its AVX2 kernel."},
    {"hwc_lut", hwc_lut, METH_VARARGS,
     "hwc_lut(src, dst, lut[, affine]): dst[c][i] = lut[c][src[i][c]] for interleaved RGB bytes, a float32 "
     "(3, n) destination and 3 tables of 256 float32; affine (k, divide, 3 means, 3 stds as float32): the same "
     "values computed as (x * k - mean) / std (x / k if divide) with AVX2, for a table made by that arithmetic."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "fastload._jpeg", "Region-of-interest JPEG decoding with libjpeg-turbo.", -1, methods,
};

PyMODINIT_FUNC PyInit__jpeg(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    JpegError = PyErr_NewException("fastload._jpeg.Error", PyExc_ValueError, NULL);
    if (JpegError == NULL || PyModule_AddObject(m, "Error", JpegError) < 0) {
        Py_XDECREF(JpegError);
        Py_DECREF(m);
        return NULL;
    }
#ifdef LIBJPEG_TURBO_VERSION_NUMBER
    PyModule_AddIntConstant(m, "LIBJPEG_TURBO_VERSION", LIBJPEG_TURBO_VERSION_NUMBER);
#else
    PyModule_AddIntConstant(m, "LIBJPEG_TURBO_VERSION", 0);
#endif
    return m;
}
