/*
 * fastload._nvimgcodec: a batch of JPEG regions decoded by nvImageCodec's C API in one call, with
 * the interpreter released from the first image to the last.
 *
 * Through nvImageCodec's Python API a batch costs, per image, a code stream, a sub-code stream, a
 * region and an image object (about 15-20 microseconds of held interpreter per image, measured
 * with nvImageCodec 0.9), taken from the training thread beside it. Here one call does the whole
 * batch in C: each image's code stream, its region's sub-code stream and its output image (planar
 * RGB, in the caller's buffer) are made -- reusing the handles of the previous batch -- and then
 * decoded together; what comes back is one status per image.
 *
 * nvImageCodec is not linked: its library (the wheel's libnvimgcodec.so.0, already loaded by
 * ``nvidia.nvimgcodec``) is opened by path at run time, and only its ABI version 0.9 is used: the
 * declarations below are the layouts of nvImageCodec 0.9's public header for the structures this
 * file fills (tests/test_nvimgcodec_native.py compiles them against the installed header and
 * compares every field's offset). Any other version is refused at open time.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- nvImageCodec 0.9's C ABI: the parts used here ------------------------------------------ */

typedef int32_t fl_nv_status; /* nvimgcodecStatus_t: 0 is success */
typedef void *fl_nv_handle;   /* instance, decoder, code stream, image, future */

enum {
    FL_NV_ST_PROPERTIES = 1,
    FL_NV_ST_INSTANCE_CREATE_INFO = 2,
    FL_NV_ST_DECODE_PARAMS = 5,
    FL_NV_ST_ORIENTATION = 7,
    FL_NV_ST_REGION = 8,
    FL_NV_ST_CODE_STREAM_VIEW = 9,
    FL_NV_ST_IMAGE_INFO = 11,
    FL_NV_ST_IMAGE_PLANE_INFO = 12,
    FL_NV_ST_BACKEND = 17,
    FL_NV_ST_BACKEND_PARAMS = 29,
    FL_NV_ST_EXECUTION_PARAMS = 30,
};

#define FL_NV_COLORSPEC_SRGB 1
#define FL_NV_SAMPLING_NONE 0
#define FL_NV_SAMPLEFORMAT_P_RGB 7
#define FL_NV_SAMPLE_DATA_TYPE_UINT8 0x0802
#define FL_NV_BUFFER_STRIDED_DEVICE 1
#define FL_NV_BUFFER_STRIDED_HOST 2
#define FL_NV_PROCESSING_SUCCESS 1
#define FL_NV_LOAD_HINT_POLICY_FIXED 2
#define FL_NV_MAX_CODEC_NAME_SIZE 256
#define FL_NV_MAX_NUM_DIM 5
#define FL_NV_MAX_ROI_FILL_CHANNELS 5
#define FL_NV_MAX_NUM_PLANES 32

typedef struct {
    int32_t struct_type;
    size_t struct_size;
    void *struct_next;
    uint32_t version;
    uint32_t cudart_version;
} fl_nv_properties;

typedef struct {
    int32_t struct_type;
    size_t struct_size;
    void *struct_next;
    int load_builtin_modules;
    int load_extension_modules;
    const char *extension_modules_path;
    int create_debug_messenger;
    const void *debug_messenger_desc;
    uint32_t message_severity;
    uint32_t message_category;
} fl_nv_instance_create_info;

typedef struct {
    int32_t struct_type;
    size_t struct_size;
    void *struct_next;
    float load_hint;
    int32_t load_hint_policy;
} fl_nv_backend_params;

typedef struct {
    int32_t struct_type;
    size_t struct_size;
    void *struct_next;
    int32_t kind;
    fl_nv_backend_params params;
} fl_nv_backend;

typedef struct {
    int32_t struct_type;
    size_t struct_size;
    void *struct_next;
    void *device_allocator;
    void *pinned_allocator;
    int max_num_cpu_threads;
    void *executor;
    int device_id;
    int pre_init;
    int skip_pre_sync;
    int num_backends;
    const fl_nv_backend *backends;
} fl_nv_execution_params;

typedef struct {
    int32_t struct_type;
    size_t struct_size;
    void *struct_next;
    int rotated;
    int flip_x;
    int flip_y;
} fl_nv_orientation;

typedef struct {
    int32_t struct_type;
    size_t struct_size;
    void *struct_next;
    uint32_t width;
    uint32_t height;
    size_t row_stride;
    uint32_t num_channels;
    int32_t sample_type;
    uint8_t precision;
} fl_nv_plane_info;

typedef struct {
    union {
        uint32_t as_uint;
        int32_t as_int;
        float as_float;
    } value;
    int32_t type;
} fl_nv_out_of_bounds_sample;

typedef struct {
    int32_t struct_type;
    size_t struct_size;
    void *struct_next;
    int ndim;
    int start[FL_NV_MAX_NUM_DIM];
    int end[FL_NV_MAX_NUM_DIM];
    int32_t out_of_bounds_policy;
    fl_nv_out_of_bounds_sample out_of_bounds_samples[FL_NV_MAX_ROI_FILL_CHANNELS];
} fl_nv_region;

typedef struct {
    int32_t struct_type;
    size_t struct_size;
    void *struct_next;
    char codec_name[FL_NV_MAX_CODEC_NAME_SIZE];
    int32_t color_spec;
    int32_t chroma_subsampling;
    int32_t sample_format;
    fl_nv_orientation orientation;
    uint32_t num_planes;
    fl_nv_plane_info plane_info[FL_NV_MAX_NUM_PLANES];
    void *buffer;
    int32_t buffer_kind;
    void *cuda_stream;
} fl_nv_image_info;

typedef struct {
    int32_t struct_type;
    size_t struct_size;
    void *struct_next;
    size_t image_idx;
    fl_nv_region region;
    size_t bitstream_offset;
} fl_nv_code_stream_view;

typedef struct {
    int32_t struct_type;
    size_t struct_size;
    void *struct_next;
    int apply_exif_orientation;
} fl_nv_decode_params;

/* the functions, looked up in the opened library */
typedef struct {
    fl_nv_status (*get_properties)(fl_nv_properties *);
    fl_nv_status (*instance_create)(fl_nv_handle *, const fl_nv_instance_create_info *);
    fl_nv_status (*instance_destroy)(fl_nv_handle);
    fl_nv_status (*decoder_create)(fl_nv_handle, fl_nv_handle *, const fl_nv_execution_params *, const char *);
    fl_nv_status (*decoder_destroy)(fl_nv_handle);
    fl_nv_status (*code_stream_from_host_mem)(fl_nv_handle, fl_nv_handle *, const unsigned char *, size_t,
                                              const fl_nv_code_stream_view *);
    fl_nv_status (*sub_code_stream)(fl_nv_handle, fl_nv_handle *, const fl_nv_code_stream_view *);
    fl_nv_status (*code_stream_destroy)(fl_nv_handle);
    fl_nv_status (*code_stream_image_info)(fl_nv_handle, fl_nv_image_info *);
    fl_nv_status (*image_create)(fl_nv_handle, fl_nv_handle *, const fl_nv_image_info *);
    fl_nv_status (*image_destroy)(fl_nv_handle);
    fl_nv_status (*decode)(fl_nv_handle, const fl_nv_handle *, const fl_nv_handle *, int, const fl_nv_decode_params *,
                           fl_nv_handle *);
    fl_nv_status (*future_wait)(fl_nv_handle);
    fl_nv_status (*future_status)(fl_nv_handle, uint32_t *, size_t *);
    fl_nv_status (*future_destroy)(fl_nv_handle);
} fl_nv_api;

/* ---- the session ------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    void *library;
    fl_nv_api api;
    fl_nv_handle instance;
    fl_nv_handle decoder;
    int device_buffers; /* 1: the images are device memory; 0: host memory */
    /* per slot, kept from batch to batch (nvImageCodec reuses a handle it is given) */
    Py_ssize_t capacity;
    fl_nv_handle *streams;
    fl_nv_handle *subs;
    fl_nv_handle *images;
    /* one batch's compacted arrays (the images made without error) */
    fl_nv_handle *batch_subs;
    fl_nv_handle *batch_images;
    Py_ssize_t *batch_slots;
    uint32_t *statuses;
    pthread_mutex_t lock;
    unsigned int version;
} Session;

/* the table above is filled as an array of pointers, in this order */
_Static_assert(sizeof(fl_nv_api) == 15 * sizeof(void *), "fl_nv_api: one function pointer per symbol");

static const char *const SYMBOLS[] = {
    "nvimgcodecGetProperties",
    "nvimgcodecInstanceCreate",
    "nvimgcodecInstanceDestroy",
    "nvimgcodecDecoderCreate",
    "nvimgcodecDecoderDestroy",
    "nvimgcodecCodeStreamCreateFromHostMem",
    "nvimgcodecCodeStreamGetSubCodeStream",
    "nvimgcodecCodeStreamDestroy",
    "nvimgcodecCodeStreamGetImageInfo",
    "nvimgcodecImageCreate",
    "nvimgcodecImageDestroy",
    "nvimgcodecDecoderDecode",
    "nvimgcodecFutureWaitForAll",
    "nvimgcodecFutureGetProcessingStatus",
    "nvimgcodecFutureDestroy",
};

/* slot i's handles destroyed (after an error: the next batch makes new ones) */
static void forget(Session *self, Py_ssize_t i) {
    if (self->images[i]) self->api.image_destroy(self->images[i]);
    if (self->subs[i]) self->api.code_stream_destroy(self->subs[i]);
    if (self->streams[i]) self->api.code_stream_destroy(self->streams[i]);
    self->images[i] = self->subs[i] = self->streams[i] = NULL;
}

static void release_slots(Session *self) {
    for (Py_ssize_t i = 0; i < self->capacity; i++) forget(self, i);
    free(self->streams);
    free(self->subs);
    free(self->images);
    free(self->batch_subs);
    free(self->batch_images);
    free(self->batch_slots);
    free(self->statuses);
    self->streams = self->subs = self->images = self->batch_subs = self->batch_images = NULL;
    self->batch_slots = NULL;
    self->statuses = NULL;
    self->capacity = 0;
}

static int grow(Session *self, Py_ssize_t n) {
    if (n <= self->capacity) return 0;
    fl_nv_handle *streams = calloc((size_t)n, sizeof(fl_nv_handle));
    fl_nv_handle *subs = calloc((size_t)n, sizeof(fl_nv_handle));
    fl_nv_handle *images = calloc((size_t)n, sizeof(fl_nv_handle));
    fl_nv_handle *batch_subs = calloc((size_t)n, sizeof(fl_nv_handle));
    fl_nv_handle *batch_images = calloc((size_t)n, sizeof(fl_nv_handle));
    Py_ssize_t *batch_slots = calloc((size_t)n, sizeof(Py_ssize_t));
    uint32_t *statuses = calloc((size_t)n, sizeof(uint32_t));
    if (!streams || !subs || !images || !batch_subs || !batch_images || !batch_slots || !statuses) {
        free(streams), free(subs), free(images), free(batch_subs), free(batch_images), free(batch_slots);
        free(statuses);
        return -1; /* (no interpreter here: the caller says so) */
    }
    if (self->capacity) {
        memcpy(streams, self->streams, (size_t)self->capacity * sizeof(fl_nv_handle));
        memcpy(subs, self->subs, (size_t)self->capacity * sizeof(fl_nv_handle));
        memcpy(images, self->images, (size_t)self->capacity * sizeof(fl_nv_handle));
    }
    free(self->streams), free(self->subs), free(self->images), free(self->batch_subs);
    free(self->batch_images), free(self->batch_slots), free(self->statuses);
    self->streams = streams, self->subs = subs, self->images = images;
    self->batch_subs = batch_subs, self->batch_images = batch_images, self->batch_slots = batch_slots;
    self->statuses = statuses;
    self->capacity = n;
    return 0;
}

static void Session_dealloc(Session *self) {
    if (self->library) {
        /* the decoder first: its threads may still hold the images and code streams */
        if (self->decoder) self->api.decoder_destroy(self->decoder);
        release_slots(self);
        if (self->instance) self->api.instance_destroy(self->instance);
        /* the library stays loaded: nvidia.nvimgcodec has it open too */
    }
    pthread_mutex_destroy(&self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Session_init(Session *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"library", "device_id", "backends", "options", "cpu_threads", "device_buffers", NULL};
    const char *path = NULL, *options = "";
    int device_id = 0, cpu_threads = 0, device_buffers = 1;
    PyObject *backends = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "siO|sip", keywords, &path, &device_id, &backends, &options,
                                     &cpu_threads, &device_buffers))
        return -1;
    if (self->library) {
        PyErr_SetString(PyExc_RuntimeError, "Session is already initialised");
        return -1;
    }
    PyObject *seq = PySequence_Fast(backends, "backends should be a sequence of (kind, load_hint) pairs");
    if (!seq) return -1;
    Py_ssize_t num_backends = PySequence_Fast_GET_SIZE(seq);
    if (num_backends > 8) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "at most 8 backends");
        return -1;
    }
    fl_nv_backend list[8];
    memset(list, 0, sizeof(list));
    for (Py_ssize_t i = 0; i < num_backends; i++) {
        int kind;
        float load_hint;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "if", &kind, &load_hint)) {
            Py_DECREF(seq);
            return -1;
        }
        list[i].struct_type = FL_NV_ST_BACKEND;
        list[i].struct_size = sizeof(fl_nv_backend);
        list[i].kind = kind;
        list[i].params.struct_type = FL_NV_ST_BACKEND_PARAMS;
        list[i].params.struct_size = sizeof(fl_nv_backend_params);
        list[i].params.load_hint = load_hint;
        list[i].params.load_hint_policy = FL_NV_LOAD_HINT_POLICY_FIXED;
    }
    Py_DECREF(seq);

    void *library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!library) {
        PyErr_Format(PyExc_OSError, "could not open nvImageCodec's library %s: %s", path, dlerror());
        return -1;
    }
    void **slots = (void **)&self->api;
    for (size_t k = 0; k < sizeof(SYMBOLS) / sizeof(SYMBOLS[0]); k++) {
        slots[k] = dlsym(library, SYMBOLS[k]);
        if (!slots[k]) {
            PyErr_Format(PyExc_OSError, "nvImageCodec's library %s has no %s", path, SYMBOLS[k]);
            dlclose(library);
            return -1;
        }
    }
    fl_nv_properties properties;
    memset(&properties, 0, sizeof(properties));
    properties.struct_type = FL_NV_ST_PROPERTIES;
    properties.struct_size = sizeof(properties);
    if (self->api.get_properties(&properties) != 0 || properties.version / 100 != 9) {
        PyErr_Format(PyExc_OSError,
                     "nvImageCodec's library %s is version %u.%u, not 0.9 (the only C interface fastload "
                     "declares)",
                     path, properties.version / 1000, (properties.version % 1000) / 100);
        dlclose(library);
        return -1;
    }
    self->version = properties.version;

    fl_nv_instance_create_info info;
    memset(&info, 0, sizeof(info));
    info.struct_type = FL_NV_ST_INSTANCE_CREATE_INFO;
    info.struct_size = sizeof(info);
    info.load_builtin_modules = 1;
    info.load_extension_modules = 1;
    fl_nv_status status;
    Py_BEGIN_ALLOW_THREADS /* it loads the extension modules and looks for CUDA */
    status = self->api.instance_create(&self->instance, &info);
    Py_END_ALLOW_THREADS
    if (status != 0) {
        PyErr_Format(PyExc_RuntimeError, "nvImageCodec could not create an instance (status %d)", (int)status);
        self->instance = NULL;
        dlclose(library);
        return -1;
    }
    fl_nv_execution_params exec;
    memset(&exec, 0, sizeof(exec));
    exec.struct_type = FL_NV_ST_EXECUTION_PARAMS;
    exec.struct_size = sizeof(exec);
    exec.max_num_cpu_threads = cpu_threads;
    exec.device_id = device_id;
    exec.num_backends = (int)num_backends;
    exec.backends = num_backends ? list : NULL;
    Py_BEGIN_ALLOW_THREADS
    status = self->api.decoder_create(self->instance, &self->decoder, &exec, options);
    Py_END_ALLOW_THREADS
    if (status != 0) {
        PyErr_Format(PyExc_RuntimeError, "nvImageCodec could not create a decoder (status %d)", (int)status);
        self->decoder = NULL;
        self->api.instance_destroy(self->instance);
        self->instance = NULL;
        dlclose(library);
        return -1;
    }
    self->library = library;
    self->device_buffers = device_id == -99999 ? 0 : device_buffers; /* a CPU-only decoder: host memory */
    return 0;
}

/* a C-contiguous buffer of `count` items of `itemsize` bytes, read-only */
/* whether a buffer's struct format is a 64-bit integer, signed ("q", "l") or not ("Q", "L") */
static int is_int64(const Py_buffer *view, int is_signed) {
    const char *format = view->format ? view->format : "B";
    if (*format == '<' || *format == '=' || *format == '@') format++;
    if (view->itemsize != 8 || format[1] != '\0') return 0;
    return is_signed ? (*format == 'q' || *format == 'l') : (*format == 'Q' || *format == 'L');
}

/* a C-contiguous column of `count` 64-bit integers (int64, or uint64 where not `is_signed`) */
static int get_column(PyObject *object, Py_buffer *view, int is_signed, Py_ssize_t count, const char *name) {
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (!is_int64(view, is_signed) || view->len != 8 * count) {
        PyErr_Format(PyExc_ValueError, "%s should hold %zd %s items, but holds %zd bytes of format '%s'", name,
                     count, is_signed ? "int64" : "uint64", view->len, view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* one batch, without the interpreter: returns nvImageCodec's status of the decode call (0: made) */
static fl_nv_status decode_batch(Session *self, const unsigned char *const *files, const size_t *lengths, Py_ssize_t n,
                                 const int64_t *regions, const uint64_t *destinations, uint64_t cuda_stream,
                                 char *ok) {
    fl_nv_status failed = 0;
    fl_nv_code_stream_view view;
    memset(&view, 0, sizeof(view));
    view.struct_type = FL_NV_ST_CODE_STREAM_VIEW;
    view.struct_size = sizeof(view);
    view.region.struct_type = FL_NV_ST_REGION;
    view.region.struct_size = sizeof(view.region);
    view.region.ndim = 2;
    fl_nv_image_info info;
    memset(&info, 0, sizeof(info));
    info.struct_type = FL_NV_ST_IMAGE_INFO;
    info.struct_size = sizeof(info);
    info.color_spec = FL_NV_COLORSPEC_SRGB;
    info.chroma_subsampling = FL_NV_SAMPLING_NONE;
    info.sample_format = FL_NV_SAMPLEFORMAT_P_RGB;
    info.orientation.struct_type = FL_NV_ST_ORIENTATION;
    info.orientation.struct_size = sizeof(info.orientation);
    info.num_planes = 3;
    info.buffer_kind = self->device_buffers ? FL_NV_BUFFER_STRIDED_DEVICE : FL_NV_BUFFER_STRIDED_HOST;
    info.cuda_stream = (void *)(uintptr_t)cuda_stream;
    for (int c = 0; c < 3; c++) {
        info.plane_info[c].struct_type = FL_NV_ST_IMAGE_PLANE_INFO;
        info.plane_info[c].struct_size = sizeof(fl_nv_plane_info);
        info.plane_info[c].num_channels = 1;
        info.plane_info[c].sample_type = FL_NV_SAMPLE_DATA_TYPE_UINT8;
    }
    fl_nv_image_info header;
    int m = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t *r = regions + 4 * i;
        int64_t height = r[2] - r[0], width = r[3] - r[1];
        ok[i] = 0;
        if (r[0] < 0 || r[1] < 0 || height <= 0 || width <= 0 || r[2] > INT32_MAX || r[3] > INT32_MAX) continue;
        if (!files[i] || self->api.code_stream_from_host_mem(self->instance, &self->streams[i], files[i], lengths[i],
                                                             NULL) != 0) {
            forget(self, i);
            continue;
        }
        /* the header, parsed here: a file nvImageCodec cannot parse would otherwise fail the whole
           batch's decode call; and the region must lie inside the image */
        memset(&header, 0, sizeof(header));
        header.struct_type = FL_NV_ST_IMAGE_INFO;
        header.struct_size = sizeof(header);
        if (self->api.code_stream_image_info(self->streams[i], &header) != 0) {
            forget(self, i);
            continue;
        }
        if (strncmp(header.codec_name, "jpeg", sizeof(header.codec_name)) != 0 || header.num_planes < 1 ||
            r[2] > (int64_t)header.plane_info[0].height || r[3] > (int64_t)header.plane_info[0].width)
            continue;
        view.region.start[0] = (int)r[0], view.region.start[1] = (int)r[1];
        view.region.end[0] = (int)r[2], view.region.end[1] = (int)r[3];
        if (self->api.sub_code_stream(self->streams[i], &self->subs[i], &view) != 0) {
            forget(self, i);
            continue;
        }
        for (int c = 0; c < 3; c++) {
            info.plane_info[c].width = (uint32_t)width;
            info.plane_info[c].height = (uint32_t)height;
            info.plane_info[c].row_stride = (size_t)width;
        }
        info.buffer = (void *)(uintptr_t)destinations[i];
        if (self->api.image_create(self->instance, &self->images[i], &info) != 0) {
            forget(self, i);
            continue;
        }
        self->batch_subs[m] = self->subs[i];
        self->batch_images[m] = self->images[i];
        self->batch_slots[m] = i;
        m++;
    }
    if (m > 0) {
        fl_nv_decode_params params;
        memset(&params, 0, sizeof(params));
        params.struct_type = FL_NV_ST_DECODE_PARAMS;
        params.struct_size = sizeof(params);
        params.apply_exif_orientation = 0;
        fl_nv_handle future = NULL;
        failed = self->api.decode(self->decoder, self->batch_subs, self->batch_images, m, &params, &future);
        if (failed == 0) {
            size_t count = (size_t)m;
            failed = self->api.future_wait(future);
            if (failed == 0) failed = self->api.future_status(future, self->statuses, &count);
            if (failed == 0)
                for (size_t k = 0; k < count && k < (size_t)m; k++)
                    ok[self->batch_slots[k]] = self->statuses[k] == FL_NV_PROCESSING_SUCCESS;
        }
        if (future) self->api.future_destroy(future);
    }
    return failed;
}

/* the batch decoded from `n` files at `files[i]` (`lengths[i]` bytes; NULL: left to the caller),
   with the regions and destinations columns: one status byte per file, or NULL with an error */
static PyObject *run_batch(Session *self, Py_ssize_t n, const unsigned char *const *files, const size_t *lengths,
                           PyObject *regions_object, PyObject *destinations_object, unsigned long long cuda_stream) {
    Py_buffer regions_view, destinations_view;
    if (get_column(regions_object, &regions_view, 1, 4 * n, "regions") < 0) return NULL;
    if (get_column(destinations_object, &destinations_view, 0, n, "destinations") < 0) {
        PyBuffer_Release(&regions_view);
        return NULL;
    }
    PyObject *result = PyBytes_FromStringAndSize(NULL, n);
    fl_nv_status failed = 0;
    if (result) {
        char *ok = PyBytes_AS_STRING(result);
        int grown;
        /* the lock taken without the interpreter: a second caller waits for it without holding
           the interpreter the first needs back */
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&self->lock);
        grown = grow(self, n);
        if (grown == 0)
            failed = decode_batch(self, files, lengths, n, (const int64_t *)regions_view.buf,
                                  (const uint64_t *)destinations_view.buf, (uint64_t)cuda_stream, ok);
        pthread_mutex_unlock(&self->lock);
        Py_END_ALLOW_THREADS
        if (grown < 0) {
            Py_CLEAR(result);
            PyErr_NoMemory();
        }
    }
    PyBuffer_Release(&regions_view);
    PyBuffer_Release(&destinations_view);
    if (result && failed != 0) {
        Py_CLEAR(result);
        PyErr_Format(PyExc_RuntimeError, "nvImageCodec's decode call failed (status %d)", (int)failed);
    }
    return result;
}

static int check_ready(Session *self) {
    if (self->library) return 0;
    PyErr_SetString(PyExc_RuntimeError, "Session is not initialised");
    return -1;
}

PyDoc_STRVAR(Session_decode_doc,
             "decode(encoded, regions, destinations, cuda_stream) -> bytes\n\n"
             "Decodes each JPEG of the sequence ``encoded`` (objects with the buffer protocol) in its region\n"
             "``regions[i] = (y0, x0, y1, x1)`` (int64, (n, 4)) as planar RGB uint8 into the memory at\n"
             "``destinations[i]`` (uint64 addresses, (n,): 3 * (y1 - y0) * (x1 - x0) bytes each), on the CUDA\n"
             "stream ``cuda_stream`` (an address; 0: the default). Returns one byte per image: 1 decoded,\n"
             "0 not (the caller decodes it otherwise). The interpreter is released for the whole batch.");

static PyObject *Session_decode(Session *self, PyObject *args) {
    PyObject *encoded, *regions_object, *destinations_object;
    unsigned long long cuda_stream = 0;
    if (!PyArg_ParseTuple(args, "OOOK", &encoded, &regions_object, &destinations_object, &cuda_stream)) return NULL;
    if (check_ready(self) < 0) return NULL;
    PyObject *seq = PySequence_Fast(encoded, "encoded should be a sequence of buffers");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    size_t count = (size_t)(n ? n : 1);
    Py_buffer *views = calloc(count, sizeof(Py_buffer));
    const unsigned char **files = calloc(count, sizeof(*files));
    size_t *lengths = calloc(count, sizeof(size_t));
    PyObject *result = NULL;
    Py_ssize_t taken = 0;
    if (!views || !files || !lengths) {
        PyErr_NoMemory();
    } else {
        for (; taken < n; taken++) {
            if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, taken), &views[taken], PyBUF_SIMPLE) < 0) break;
            files[taken] = (const unsigned char *)views[taken].buf;
            lengths[taken] = (size_t)views[taken].len;
        }
        if (taken == n)
            result = run_batch(self, n, files, lengths, regions_object, destinations_object, cuda_stream);
    }
    for (Py_ssize_t i = 0; i < taken; i++) PyBuffer_Release(&views[i]);
    free(views);
    free(files);
    free(lengths);
    Py_DECREF(seq);
    return result;
}

PyDoc_STRVAR(Session_decode_slices_doc,
             "decode_slices(buffer, starts, ends, regions, destinations, cuda_stream) -> bytes\n\n"
             "decode() of the files ``buffer[starts[i]:ends[i]]`` (int64 columns): one buffer for the batch,\n"
             "no object per file. A slice outside the buffer is not decoded (its byte is 0).");

static PyObject *Session_decode_slices(Session *self, PyObject *args) {
    PyObject *buffer_object, *starts_object, *ends_object, *regions_object, *destinations_object;
    unsigned long long cuda_stream = 0;
    if (!PyArg_ParseTuple(args, "OOOOOK", &buffer_object, &starts_object, &ends_object, &regions_object,
                          &destinations_object, &cuda_stream))
        return NULL;
    if (check_ready(self) < 0) return NULL;
    Py_buffer buffer, starts_view, ends_view;
    if (PyObject_GetBuffer(buffer_object, &buffer, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(starts_object, &starts_view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&buffer);
        return NULL;
    }
    if (!is_int64(&starts_view, 1)) {
        PyErr_SetString(PyExc_ValueError, "starts should be an int64 column");
        PyBuffer_Release(&starts_view);
        PyBuffer_Release(&buffer);
        return NULL;
    }
    Py_ssize_t n = starts_view.len / 8;
    PyObject *result = NULL;
    if (get_column(ends_object, &ends_view, 1, n, "ends") < 0) {
        PyBuffer_Release(&starts_view);
        PyBuffer_Release(&buffer);
        return NULL;
    }
    size_t count = (size_t)(n ? n : 1);
    const unsigned char **files = calloc(count, sizeof(*files));
    size_t *lengths = calloc(count, sizeof(size_t));
    if (!files || !lengths) {
        PyErr_NoMemory();
    } else {
        const int64_t *starts = (const int64_t *)starts_view.buf, *ends = (const int64_t *)ends_view.buf;
        for (Py_ssize_t i = 0; i < n; i++) {
            int inside = starts[i] >= 0 && starts[i] <= ends[i] && ends[i] <= (int64_t)buffer.len;
            files[i] = inside ? (const unsigned char *)buffer.buf + starts[i] : NULL;
            lengths[i] = inside ? (size_t)(ends[i] - starts[i]) : 0;
        }
        result = run_batch(self, n, files, lengths, regions_object, destinations_object, cuda_stream);
    }
    free(files);
    free(lengths);
    PyBuffer_Release(&ends_view);
    PyBuffer_Release(&starts_view);
    PyBuffer_Release(&buffer);
    return result;
}

static PyObject *Session_version(Session *self, void *closure) {
    (void)closure;
    return PyUnicode_FromFormat("%u.%u.%u", self->version / 1000, (self->version % 1000) / 100, self->version % 100);
}

static PyObject *Session_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    (void)args, (void)kwargs;
    Session *self = (Session *)type->tp_alloc(type, 0);
    if (self) pthread_mutex_init(&self->lock, NULL);
    return (PyObject *)self;
}

static PyMethodDef Session_methods[] = {
    {"decode", (PyCFunction)Session_decode, METH_VARARGS, Session_decode_doc},
    {"decode_slices", (PyCFunction)Session_decode_slices, METH_VARARGS, Session_decode_slices_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Session_getset[] = {
    {"version", (getter)Session_version, NULL, "nvImageCodec's version, as its library reports it", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(Session_doc,
             "Session(library, device_id, backends, options='', cpu_threads=0, device_buffers=True)\n\n"
             "nvImageCodec 0.9's decoder through its C API: ``library`` the path of libnvimgcodec.so.0,\n"
             "``device_id`` its device (-99999: the CPU only), ``backends`` (kind, load_hint) pairs as\n"
             "nvImageCodec's BackendKind numbers, ``options`` its decoder options, ``device_buffers``:\n"
             "whether decode()'s destinations are device memory (else host memory; always so for the CPU only).");

static PyTypeObject SessionType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "fastload._nvimgcodec.Session",
    .tp_basicsize = sizeof(Session),
    .tp_dealloc = (destructor)Session_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Session_doc,
    .tp_methods = Session_methods,
    .tp_getset = Session_getset,
    .tp_init = (initproc)Session_init,
    .tp_new = Session_new,
};

/* the layouts declared above, for the ABI test: {name: {"sizeof": n, field: offset, ...}} */
static int add_layout(PyObject *all, const char *name, Py_ssize_t size, const char *const *fields,
                      const size_t *offsets, size_t count) {
    PyObject *one = PyDict_New();
    if (!one) return -1;
    PyObject *value = PyLong_FromSsize_t(size);
    int bad = !value || PyDict_SetItemString(one, "sizeof", value) < 0;
    Py_XDECREF(value);
    for (size_t k = 0; !bad && k < count; k++) {
        value = PyLong_FromSize_t(offsets[k]);
        bad = !value || PyDict_SetItemString(one, fields[k], value) < 0;
        Py_XDECREF(value);
    }
    if (!bad) bad = PyDict_SetItemString(all, name, one) < 0;
    Py_DECREF(one);
    return bad ? -1 : 0;
}

#define LAYOUT(NAME, T, ...)                                                                          \
    do {                                                                                              \
        static const char *const fields[] = {"struct_type", "struct_size", "struct_next", __VA_ARGS__}; \
        size_t offsets[sizeof(fields) / sizeof(fields[0])];                                           \
        T probe;                                                                                      \
        (void)probe;                                                                                  \
        offsets[0] = offsetof(T, struct_type), offsets[1] = offsetof(T, struct_size);                 \
        offsets[2] = offsetof(T, struct_next);                                                        \
        OFFSETS_##T                                                                                   \
        if (add_layout(all, NAME, (Py_ssize_t)sizeof(T), fields, offsets, sizeof(fields) / sizeof(fields[0])) < 0) \
            goto fail;                                                                                \
    } while (0)

#define OFFSETS_fl_nv_properties offsets[3] = offsetof(fl_nv_properties, version), \
    offsets[4] = offsetof(fl_nv_properties, cudart_version);
#define OFFSETS_fl_nv_instance_create_info offsets[3] = offsetof(fl_nv_instance_create_info, load_builtin_modules), \
    offsets[4] = offsetof(fl_nv_instance_create_info, load_extension_modules), \
    offsets[5] = offsetof(fl_nv_instance_create_info, extension_modules_path), \
    offsets[6] = offsetof(fl_nv_instance_create_info, create_debug_messenger), \
    offsets[7] = offsetof(fl_nv_instance_create_info, debug_messenger_desc), \
    offsets[8] = offsetof(fl_nv_instance_create_info, message_severity), \
    offsets[9] = offsetof(fl_nv_instance_create_info, message_category);
#define OFFSETS_fl_nv_backend_params offsets[3] = offsetof(fl_nv_backend_params, load_hint), \
    offsets[4] = offsetof(fl_nv_backend_params, load_hint_policy);
#define OFFSETS_fl_nv_backend offsets[3] = offsetof(fl_nv_backend, kind), offsets[4] = offsetof(fl_nv_backend, params);
#define OFFSETS_fl_nv_execution_params offsets[3] = offsetof(fl_nv_execution_params, device_allocator), \
    offsets[4] = offsetof(fl_nv_execution_params, pinned_allocator), \
    offsets[5] = offsetof(fl_nv_execution_params, max_num_cpu_threads), \
    offsets[6] = offsetof(fl_nv_execution_params, executor), offsets[7] = offsetof(fl_nv_execution_params, device_id), \
    offsets[8] = offsetof(fl_nv_execution_params, pre_init), \
    offsets[9] = offsetof(fl_nv_execution_params, skip_pre_sync), \
    offsets[10] = offsetof(fl_nv_execution_params, num_backends), \
    offsets[11] = offsetof(fl_nv_execution_params, backends);
#define OFFSETS_fl_nv_orientation offsets[3] = offsetof(fl_nv_orientation, rotated), \
    offsets[4] = offsetof(fl_nv_orientation, flip_x), offsets[5] = offsetof(fl_nv_orientation, flip_y);
#define OFFSETS_fl_nv_plane_info offsets[3] = offsetof(fl_nv_plane_info, width), \
    offsets[4] = offsetof(fl_nv_plane_info, height), offsets[5] = offsetof(fl_nv_plane_info, row_stride), \
    offsets[6] = offsetof(fl_nv_plane_info, num_channels), offsets[7] = offsetof(fl_nv_plane_info, sample_type), \
    offsets[8] = offsetof(fl_nv_plane_info, precision);
#define OFFSETS_fl_nv_region offsets[3] = offsetof(fl_nv_region, ndim), offsets[4] = offsetof(fl_nv_region, start), \
    offsets[5] = offsetof(fl_nv_region, end), offsets[6] = offsetof(fl_nv_region, out_of_bounds_policy), \
    offsets[7] = offsetof(fl_nv_region, out_of_bounds_samples);
#define OFFSETS_fl_nv_image_info offsets[3] = offsetof(fl_nv_image_info, codec_name), \
    offsets[4] = offsetof(fl_nv_image_info, color_spec), offsets[5] = offsetof(fl_nv_image_info, chroma_subsampling), \
    offsets[6] = offsetof(fl_nv_image_info, sample_format), offsets[7] = offsetof(fl_nv_image_info, orientation), \
    offsets[8] = offsetof(fl_nv_image_info, num_planes), offsets[9] = offsetof(fl_nv_image_info, plane_info), \
    offsets[10] = offsetof(fl_nv_image_info, buffer), offsets[11] = offsetof(fl_nv_image_info, buffer_kind), \
    offsets[12] = offsetof(fl_nv_image_info, cuda_stream);
#define OFFSETS_fl_nv_code_stream_view offsets[3] = offsetof(fl_nv_code_stream_view, image_idx), \
    offsets[4] = offsetof(fl_nv_code_stream_view, region), offsets[5] = offsetof(fl_nv_code_stream_view, bitstream_offset);
#define OFFSETS_fl_nv_decode_params offsets[3] = offsetof(fl_nv_decode_params, apply_exif_orientation);

static PyObject *layouts(PyObject *module, PyObject *unused) {
    (void)module, (void)unused;
    PyObject *all = PyDict_New();
    if (!all) return NULL;
    LAYOUT("nvimgcodecProperties_t", fl_nv_properties, "version", "cudart_version");
    LAYOUT("nvimgcodecInstanceCreateInfo_t", fl_nv_instance_create_info, "load_builtin_modules",
           "load_extension_modules", "extension_modules_path", "create_debug_messenger", "debug_messenger_desc",
           "message_severity", "message_category");
    LAYOUT("nvimgcodecBackendParams_t", fl_nv_backend_params, "load_hint", "load_hint_policy");
    LAYOUT("nvimgcodecBackend_t", fl_nv_backend, "kind", "params");
    LAYOUT("nvimgcodecExecutionParams_t", fl_nv_execution_params, "device_allocator", "pinned_allocator",
           "max_num_cpu_threads", "executor", "device_id", "pre_init", "skip_pre_sync", "num_backends", "backends");
    LAYOUT("nvimgcodecOrientation_t", fl_nv_orientation, "rotated", "flip_x", "flip_y");
    LAYOUT("nvimgcodecImagePlaneInfo_t", fl_nv_plane_info, "width", "height", "row_stride", "num_channels",
           "sample_type", "precision");
    LAYOUT("nvimgcodecRegion_t", fl_nv_region, "ndim", "start", "end", "out_of_bounds_policy",
           "out_of_bounds_samples");
    LAYOUT("nvimgcodecImageInfo_t", fl_nv_image_info, "codec_name", "color_spec", "chroma_subsampling",
           "sample_format", "orientation", "num_planes", "plane_info", "buffer", "buffer_kind", "cuda_stream");
    LAYOUT("nvimgcodecCodeStreamView_t", fl_nv_code_stream_view, "image_idx", "region", "bitstream_offset");
    LAYOUT("nvimgcodecDecodeParams_t", fl_nv_decode_params, "apply_exif_orientation");
    return all;
fail:
    Py_DECREF(all);
    return NULL;
}

static PyMethodDef module_methods[] = {
    {"layouts", layouts, METH_NOARGS, "The nvImageCodec structure layouts this module declares (for its ABI test)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "fastload._nvimgcodec",
    "nvImageCodec 0.9's C API for whole batches of JPEG regions (see fastload/_nvimgcodec.c).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__nvimgcodec(void) {
    if (PyType_Ready(&SessionType) < 0) return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (!module) return NULL;
    /* the header's constants this file uses, for the ABI test */
    PyObject *constants = Py_BuildValue(
        "{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i}",
        "NVIMGCODEC_STRUCTURE_TYPE_PROPERTIES", FL_NV_ST_PROPERTIES, "NVIMGCODEC_STRUCTURE_TYPE_INSTANCE_CREATE_INFO",
        FL_NV_ST_INSTANCE_CREATE_INFO, "NVIMGCODEC_STRUCTURE_TYPE_DECODE_PARAMS", FL_NV_ST_DECODE_PARAMS,
        "NVIMGCODEC_STRUCTURE_TYPE_ORIENTATION", FL_NV_ST_ORIENTATION, "NVIMGCODEC_STRUCTURE_TYPE_REGION",
        FL_NV_ST_REGION, "NVIMGCODEC_STRUCTURE_TYPE_CODE_STREAM_VIEW", FL_NV_ST_CODE_STREAM_VIEW,
        "NVIMGCODEC_STRUCTURE_TYPE_IMAGE_INFO", FL_NV_ST_IMAGE_INFO, "NVIMGCODEC_STRUCTURE_TYPE_IMAGE_PLANE_INFO",
        FL_NV_ST_IMAGE_PLANE_INFO, "NVIMGCODEC_STRUCTURE_TYPE_BACKEND", FL_NV_ST_BACKEND,
        "NVIMGCODEC_STRUCTURE_TYPE_BACKEND_PARAMS", FL_NV_ST_BACKEND_PARAMS, "NVIMGCODEC_STRUCTURE_TYPE_EXECUTION_PARAMS",
        FL_NV_ST_EXECUTION_PARAMS, "NVIMGCODEC_COLORSPEC_SRGB", FL_NV_COLORSPEC_SRGB, "NVIMGCODEC_SAMPLING_NONE",
        FL_NV_SAMPLING_NONE, "NVIMGCODEC_SAMPLEFORMAT_P_RGB", FL_NV_SAMPLEFORMAT_P_RGB,
        "NVIMGCODEC_SAMPLE_DATA_TYPE_UINT8", FL_NV_SAMPLE_DATA_TYPE_UINT8, "NVIMGCODEC_IMAGE_BUFFER_KIND_STRIDED_DEVICE",
        FL_NV_BUFFER_STRIDED_DEVICE, "NVIMGCODEC_IMAGE_BUFFER_KIND_STRIDED_HOST", FL_NV_BUFFER_STRIDED_HOST,
        "NVIMGCODEC_PROCESSING_STATUS_SUCCESS", FL_NV_PROCESSING_SUCCESS, "NVIMGCODEC_LOAD_HINT_POLICY_FIXED",
        FL_NV_LOAD_HINT_POLICY_FIXED, "NVIMGCODEC_MAX_CODEC_NAME_SIZE", FL_NV_MAX_CODEC_NAME_SIZE,
        "NVIMGCODEC_MAX_NUM_DIM", FL_NV_MAX_NUM_DIM, "NVIMGCODEC_MAX_NUM_PLANES", FL_NV_MAX_NUM_PLANES);
    if (!constants || PyModule_AddObject(module, "CONSTANTS", constants) < 0) {
        Py_XDECREF(constants);
        Py_DECREF(module);
        return NULL;
    }
    Py_INCREF(&SessionType);
    if (PyModule_AddObject(module, "Session", (PyObject *)&SessionType) < 0) {
        Py_DECREF(&SessionType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
