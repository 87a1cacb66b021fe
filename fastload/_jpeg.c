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
 *   decode(data, left, top, width, height, scale=1) -> bytearray of height*width*3 RGB bytes
 *       The region is given in the coordinates of the image decoded at 1/scale.
 * Errors raise fastload._jpeg.Error (a ValueError) with libjpeg's message; a libjpeg warning
 * (corrupt data, premature end of file) is an error too, so the caller can fall back to a
 * full decode that decides like the reference decoders do.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
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

static PyObject *jpeg_header(PyObject *self, PyObject *args) {
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*:header", &data)) return NULL;
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
    PyObject *result = Py_BuildValue("(IIis)", (unsigned)cinfo.image_width, (unsigned)cinfo.image_height,
                                     cinfo.num_components, colorspace_name(cinfo.jpeg_color_space));
    jpeg_destroy_decompress(&cinfo);
    PyBuffer_Release(&data);
    return result;
}

/* The decode proper, without the GIL.  Returns 0 on success, -1 on a libjpeg error/warning
 * (message in err), -2 on a region outside the image (message set here). */
static int decode_region(const unsigned char *buf, size_t len, unsigned left, unsigned top, unsigned width,
                         unsigned height, int scale, unsigned char *out, error_mgr *err) {
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
    cinfo.do_fancy_upsampling = TRUE;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned)scale;
    jpeg_start_decompress(&cinfo);
    if (err->failed) longjmp(err->jump, 1);
    const unsigned W = cinfo.output_width, H = cinfo.output_height;
    if (width == 0 || height == 0 || (size_t)left + width > W || (size_t)top + height > H) {
        snprintf(err->message, sizeof(err->message),
                 "region (left=%u, top=%u, width=%u, height=%u) is not inside the %ux%u image decoded at 1/%d", left,
                 top, width, height, W, H, scale);
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
    static char *keywords[] = {"data", "left", "top", "width", "height", "scale", NULL};
    Py_buffer data;
    unsigned int left, top, width, height;
    int scale = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*IIII|i:decode", keywords, &data, &left, &top, &width, &height,
                                     &scale))
        return NULL;
    if (scale != 1 && scale != 2 && scale != 4 && scale != 8) {
        PyBuffer_Release(&data);
        PyErr_Format(PyExc_ValueError, "scale should be 1, 2, 4 or 8, but got %d", scale);
        return NULL;
    }
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
                           (unsigned char *)PyByteArray_AS_STRING(out), &err);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    if (status != 0) {
        Py_DECREF(out);
        PyErr_SetString(status == -2 ? PyExc_ValueError : JpegError, err.message);
        return NULL;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"header", jpeg_header, METH_VARARGS,
     "header(data) -> (width, height, components, colorspace): reads the JPEG header only."},
    {"decode", (PyCFunction)(void (*)(void))jpeg_decode, METH_VARARGS | METH_KEYWORDS,
     "decode(data, left, top, width, height, scale=1) -> bytearray: RGB pixels (HWC) of a region of the image "
     "decoded at 1/scale, decoding only that region."},
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
