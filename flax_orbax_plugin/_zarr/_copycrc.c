/* dst[:] = src and the crc32c (Castagnoli) of the bytes copied, in one pass.
 *
 * An optional extension (setup.py builds it where a compiler exists; without it the
 * package copies with numpy, then checksums with the crc32c package). Python side:
 * flax_orbax_plugin/_zarr/chunks.py (copy_crc). Same convention as the crc32c
 * package's crc32c(data, value): the value passed in is a previous result, so a
 * chunk can be done in pieces; extend_zeros appends zero bytes (edge chunk padding).
 *
 * x86_64 with SSE4.2 (checked at run time): the crc32 instruction on three
 * independent streams of BLOCK (then SMALL) bytes at a time (its latency is three
 * cycles, its throughput one a cycle), combined by shifting a crc over that many
 * bytes (a multiply by x^(8 BLOCK) mod P, by tables of 256 entries). Long streams,
 * as the hardware prefetcher follows them: rounds of 4-8 KiB per stream measured at
 * about 70% of a plain copy's speed from memory, rounds of 64 KiB at about its speed.
 * Cached stores by default; non-temporal ones on request (impl 3: no read of the
 * line first, but measured several times slower, benchmarks/results/
 * onepass_kernel.json). Elsewhere: memcpy of a piece, then a table-driven crc
 * (eight bytes per step) of that piece while it is in cache.
 * The GIL is released for any copy of COPY_NOGIL bytes or more. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FOP_X86 1
#include <immintrin.h>
#endif

#define POLY 0x82F63B78u      /* Castagnoli, bit-reversed */
#define BLOCK 65600           /* bytes per stream per round: long runs for the prefetcher */
#define SMALL 1088            /* then rounds this small (multiples of 64, not of 4096) */
#define PIECE (64 << 10)      /* portable path: copied, then checksummed in cache */
#define COPY_NOGIL (16 << 10) /* smaller copies keep the GIL (releasing costs more) */

enum { IMPL_AUTO = 0, IMPL_PORTABLE = 1, IMPL_SSE42 = 2, IMPL_SSE42_NT = 3 };

static uint32_t byte_table[8][256]; /* [k][b]: crc of byte b followed by k zero bytes */
static uint32_t shift_table[2][4][256]; /* [s][j][b]: (b << 8j) x^(8 BLOCK or SMALL) */
static int have_sse42;

/* a * b mod P, bit-reversed: bit 31 is x^0. */
static uint32_t gf_multiply(uint32_t a, uint32_t b) {
    uint32_t product = 0;
    for (int i = 0; i < 32; i++) {
        if (a & 0x80000000u)
            product ^= b;
        a <<= 1;
        b = (b & 1) ? (b >> 1) ^ POLY : b >> 1; /* b times x */
    }
    return product;
}

/* x^(8 n) mod P: the factor that moves a crc register over n bytes (zeros). */
static uint32_t x_pow_8n(uint64_t n) {
    uint32_t result = 0x80000000u; /* x^0 */
    uint32_t square = 0x00800000u; /* x^8 */
    while (n) {
        if (n & 1)
            result = gf_multiply(result, square);
        square = gf_multiply(square, square);
        n >>= 1;
    }
    return result;
}

static void init_tables(void) {
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t c = b;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ POLY : c >> 1;
        byte_table[0][b] = c;
    }
    for (int k = 1; k < 8; k++)
        for (int b = 0; b < 256; b++) {
            uint32_t c = byte_table[k - 1][b];
            byte_table[k][b] = (c >> 8) ^ byte_table[0][c & 0xff];
        }
    for (int s = 0; s < 2; s++) {
        uint32_t factor = x_pow_8n(s ? SMALL : BLOCK);
        for (int j = 0; j < 4; j++)
            for (uint32_t b = 0; b < 256; b++)
                shift_table[s][j][b] = gf_multiply(b << (8 * j), factor);
    }
}

/* The register moved over BLOCK (s = 0) or SMALL (s = 1) zero bytes. */
static inline uint32_t shift_block(uint32_t r, int s) {
    return shift_table[s][0][r & 0xff] ^ shift_table[s][1][(r >> 8) & 0xff] ^
           shift_table[s][2][(r >> 16) & 0xff] ^ shift_table[s][3][r >> 24];
}

/* The register (not inverted) over n bytes, eight at a time by tables. */
static uint32_t crc_portable(uint32_t r, const unsigned char *p, size_t n) {
    while (n >= 8) {
        uint32_t low = r ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                            (uint32_t)p[3] << 24);
        r = byte_table[7][low & 0xff] ^ byte_table[6][(low >> 8) & 0xff] ^
            byte_table[5][(low >> 16) & 0xff] ^ byte_table[4][low >> 24] ^
            byte_table[3][p[4]] ^ byte_table[2][p[5]] ^ byte_table[1][p[6]] ^
            byte_table[0][p[7]];
        p += 8;
        n -= 8;
    }
    while (n--)
        r = (r >> 8) ^ byte_table[0][(r ^ *p++) & 0xff];
    return r;
}

static uint32_t copy_portable(unsigned char *dst, const unsigned char *src, size_t n,
                              uint32_t r) {
    while (n) {
        size_t step = n < PIECE ? n : PIECE;
        memcpy(dst, src, step);
        r = crc_portable(r, dst, step);
        dst += step;
        src += step;
        n -= step;
    }
    return r;
}

#ifdef FOP_X86
/* Stores 16 bytes at d (16-aligned) and returns the register over them. */
__attribute__((target("sse4.2"))) static inline uint64_t
step16(unsigned char *d, const unsigned char *s, uint64_t r, int nt) {
    __m128i v = _mm_loadu_si128((const __m128i *)s);
    uint64_t low, high;
    memcpy(&low, s, 8);
    memcpy(&high, s + 8, 8);
    if (nt)
        _mm_stream_si128((__m128i *)d, v);
    else
        _mm_store_si128((__m128i *)d, v);
    return _mm_crc32_u64(_mm_crc32_u64(r, low), high);
}

/* Whole rounds of three streams of ``block`` bytes (a constant where inlined: the
 * addresses then immediate offsets, measured faster); returns the bytes done. */
__attribute__((target("sse4.2"), always_inline)) static inline size_t
rounds(unsigned char *dst, const unsigned char *src, size_t n, uint64_t *crc, int nt,
       const size_t block, int s) {
    uint64_t r = *crc;
    size_t done = 0;
    while (n - done >= 3 * block) { /* three streams: r, then b, then c */
        uint64_t b = 0, c = 0;
        unsigned char *d = dst + done;
        const unsigned char *p = src + done;
        for (size_t i = 0; i < block; i += 16) {
            r = step16(d + i, p + i, r, nt);
            b = step16(d + block + i, p + block + i, b, nt);
            c = step16(d + 2 * block + i, p + 2 * block + i, c, nt);
        }
        /* each register is linear in its start: r over two blocks, b over one */
        r = shift_block(shift_block((uint32_t)r, s) ^ (uint32_t)b, s) ^ (uint32_t)c;
        done += 3 * block;
    }
    *crc = r;
    return done;
}

__attribute__((target("sse4.2"))) static inline uint32_t
copy_sse42_body(unsigned char *dst, const unsigned char *src, size_t n, uint32_t crc, int nt) {
    uint64_t r = crc; /* 64 bits wide: no zero extension between crc32 instructions */
    while (n && ((uintptr_t)dst & 15)) { /* to a 16-byte boundary of dst */
        unsigned char b = *src++;
        *dst++ = b;
        r = _mm_crc32_u8((uint32_t)r, b);
        n--;
    }
    size_t done = rounds(dst, src, n, &r, nt, BLOCK, 0);
    done += rounds(dst + done, src + done, n - done, &r, nt, SMALL, 1);
    dst += done;
    src += done;
    n -= done;
    while (n >= 16) {
        r = step16(dst, src, r, nt);
        dst += 16;
        src += 16;
        n -= 16;
    }
    while (n--) {
        unsigned char b = *src++;
        *dst++ = b;
        r = _mm_crc32_u8((uint32_t)r, b);
    }
    if (nt)
        _mm_sfence(); /* the streamed stores seen by any thread that reads dst next */
    return (uint32_t)r;
}

__attribute__((target("sse4.2"))) static uint32_t
copy_sse42(unsigned char *dst, const unsigned char *src, size_t n, uint32_t r) {
    return copy_sse42_body(dst, src, n, r, 0);
}

__attribute__((target("sse4.2"))) static uint32_t
copy_sse42_nt(unsigned char *dst, const unsigned char *src, size_t n, uint32_t r) {
    return copy_sse42_body(dst, src, n, r, 1);
}
#endif

typedef uint32_t (*copier)(unsigned char *, const unsigned char *, size_t, uint32_t);

static copier pick(int impl) {
#ifdef FOP_X86
    if (impl == IMPL_AUTO)
        return have_sse42 ? copy_sse42 : copy_portable; /* cached stores: measured faster */
    if (impl == IMPL_SSE42 || impl == IMPL_SSE42_NT) {
        if (!have_sse42)
            return NULL;
        return impl == IMPL_SSE42 ? copy_sse42 : copy_sse42_nt;
    }
#else
    if (impl == IMPL_AUTO)
        return copy_portable;
    if (impl == IMPL_SSE42 || impl == IMPL_SSE42_NT)
        return NULL;
#endif
    return impl == IMPL_PORTABLE ? copy_portable : NULL;
}

static int crc_argument(PyObject *value, uint32_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(value);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    if (v > 0xFFFFFFFFull) {
        PyErr_SetString(PyExc_ValueError, "crc: expected a value below 2**32");
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

PyDoc_STRVAR(copy_crc_doc,
             "copy_crc(dst, src, crc=0, impl=0) -> int\n\n"
             "Copies the bytes of src into dst (C-contiguous buffers of the same size, dst\n"
             "writable, not overlapping src) and returns the crc32c of those bytes continued\n"
             "from crc (as crc32c.crc32c(src, crc)). impl: 0 the best this CPU has, 1 the\n"
             "portable path, 2 SSE4.2 with cached stores, 3 SSE4.2 with non-temporal stores\n"
             "(2 and 3 raise RuntimeError on a CPU without SSE4.2).");

static PyObject *copy_crc(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"dst", "src", "crc", "impl", NULL};
    PyObject *dst_obj, *src_obj, *crc_obj = NULL;
    int impl = IMPL_AUTO;
    uint32_t crc = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|Oi:copy_crc", names, &dst_obj, &src_obj,
                                     &crc_obj, &impl))
        return NULL;
    if (crc_obj != NULL && crc_argument(crc_obj, &crc) < 0)
        return NULL;
    copier fn = pick(impl);
    if (fn == NULL) {
        PyErr_Format(PyExc_RuntimeError, "copy_crc: impl %d is not available here", impl);
        return NULL;
    }
    Py_buffer dst, src;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy_crc: dst holds %zd bytes, src %zd", dst.len,
                     src.len);
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        return NULL;
    }
    size_t n = (size_t)src.len;
    uint32_t r = ~crc;
    if (n >= COPY_NOGIL) {
        Py_BEGIN_ALLOW_THREADS
        r = fn((unsigned char *)dst.buf, (const unsigned char *)src.buf, n, r);
        Py_END_ALLOW_THREADS
    } else {
        r = fn((unsigned char *)dst.buf, (const unsigned char *)src.buf, n, r);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return PyLong_FromUnsignedLong((unsigned long)(~r));
}

PyDoc_STRVAR(extend_zeros_doc,
             "extend_zeros(crc, n) -> int\n\n"
             "The crc32c continued from crc over n zero bytes (as crc32c.crc32c(bytes(n), "
             "crc)),\nin time logarithmic in n.");

static PyObject *extend_zeros(PyObject *self, PyObject *args) {
    PyObject *crc_obj;
    long long n;
    uint32_t crc;
    if (!PyArg_ParseTuple(args, "OL:extend_zeros", &crc_obj, &n))
        return NULL;
    if (crc_argument(crc_obj, &crc) < 0)
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "extend_zeros: n must not be negative");
        return NULL;
    }
    uint32_t r = gf_multiply(~crc, x_pow_8n((uint64_t)n));
    return PyLong_FromUnsignedLong((unsigned long)(~r));
}

static PyMethodDef methods[] = {
    {"copy_crc", (PyCFunction)(void (*)(void))copy_crc, METH_VARARGS | METH_KEYWORDS,
     copy_crc_doc},
    {"extend_zeros", extend_zeros, METH_VARARGS, extend_zeros_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_copycrc",
    "Copy and crc32c in one pass (see _copycrc.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__copycrc(void) {
    init_tables();
#ifdef FOP_X86
    __builtin_cpu_init();
    have_sse42 = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#endif
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "HARDWARE", have_sse42) < 0 ||
        PyModule_AddIntConstant(m, "AUTO", IMPL_AUTO) < 0 ||
        PyModule_AddIntConstant(m, "PORTABLE", IMPL_PORTABLE) < 0 ||
        PyModule_AddIntConstant(m, "SSE42", IMPL_SSE42) < 0 ||
        PyModule_AddIntConstant(m, "SSE42_NT", IMPL_SSE42_NT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
