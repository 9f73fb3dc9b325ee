/* Calls from Python without ctypes. A decode step of a small model makes about 400 kernel calls, and through ctypes
 * each cost 3-6 us of Python (an address per array, seven converted arguments): a fifth of SmolLM2's step on two
 * cores. call(function, signature, *args) runs the kernel at address `function` with the arguments its signature's
 * letters say: p a pointer (an int, None for NULL, or an object with a C-contiguous buffer, such as a numpy array: its
 * data), l int64, i int, f float. The GIL is released while the kernel runs. native.py appends this file to cpu.c
 * when Python's headers are there, and calls through ctypes otherwise. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef union {
    void *p;
    int64_t l;
    int i;
    float f;
} argument;

static int convert(PyObject *object, char kind, argument *out) {
    if (kind == 'p') {
        if (object == Py_None) {
            out->p = NULL;
            return 0;
        }
        if (PyLong_Check(object)) {
            out->p = PyLong_AsVoidPtr(object);
            return PyErr_Occurred() ? -1 : 0;
        }
        Py_buffer view; /* the caller keeps the object alive for the call */
        if (PyObject_GetBuffer(object, &view, PyBUF_C_CONTIGUOUS) != 0) return -1;
        out->p = view.buf;
        PyBuffer_Release(&view);
        return 0;
    }
    if (kind == 'l') out->l = PyLong_AsLongLong(object);
    else if (kind == 'i') out->i = (int)PyLong_AsLong(object);
    else out->f = (float)PyFloat_AsDouble(object);
    return PyErr_Occurred() ? -1 : 0;
}

typedef void *P;
typedef int64_t L;
/* the signatures of cpu.c's entry points: gemv, gemm, dequant, attend, rms_norm, gated, rope */
enum { GEMV, GEMM_, DEQUANT, ATTEND, RMS_NORM, GATED, ROPE, SIGNATURES };
static const char *signatures[SIGNATURES] = {"pllplpi", "pllplpfi", "ppllpi", "pppppppplllllllllffi",
                                             "pppllf",  "pppli",    "pppplllli"};

static PyObject *call(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    const char *signature = nargs >= 2 ? PyUnicode_AsUTF8(args[1]) : NULL;
    int which = 0;
    while (signature && which < SIGNATURES && strcmp(signature, signatures[which]) != 0) which++;
    if (!signature || which == SIGNATURES || (Py_ssize_t)strlen(signature) != nargs - 2) {
        PyErr_SetString(PyExc_TypeError, "call(function, signature, *args): unknown signature or wrong arguments");
        return NULL;
    }
    void *function = PyLong_AsVoidPtr(args[0]);
    argument a[24];
    if (PyErr_Occurred()) return NULL;
    for (Py_ssize_t i = 0; i < nargs - 2; i++)
        if (convert(args[i + 2], signature[i], &a[i]) != 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    switch (which) {
    case GEMV:
        ((void (*)(P, L, L, P, L, P, int))function)(a[0].p, a[1].l, a[2].l, a[3].p, a[4].l, a[5].p, a[6].i);
        break;
    case GEMM_:
        ((void (*)(P, L, L, P, L, P, float, int))function)(a[0].p, a[1].l, a[2].l, a[3].p, a[4].l, a[5].p, a[6].f,
                                                             a[7].i);
        break;
    case DEQUANT: ((void (*)(P, P, L, L, P, int))function)(a[0].p, a[1].p, a[2].l, a[3].l, a[4].p, a[5].i); break;
    case ATTEND:
        ((void (*)(P, P, P, P, P, P, P, P, L, L, L, L, L, L, L, L, L, float, float, int))function)(
            a[0].p, a[1].p, a[2].p, a[3].p, a[4].p, a[5].p, a[6].p, a[7].p, a[8].l, a[9].l, a[10].l, a[11].l,
            a[12].l, a[13].l, a[14].l, a[15].l, a[16].l, a[17].f, a[18].f, a[19].i);
        break;
    case RMS_NORM: ((void (*)(P, P, P, L, L, float))function)(a[0].p, a[1].p, a[2].p, a[3].l, a[4].l, a[5].f); break;
    case GATED: ((void (*)(P, P, P, L, int))function)(a[0].p, a[1].p, a[2].p, a[3].l, a[4].i); break;
    default:
        ((void (*)(P, P, P, P, L, L, L, L, int))function)(a[0].p, a[1].p, a[2].p, a[3].p, a[4].l, a[5].l, a[6].l,
                                                            a[7].l, a[8].i);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {{"call", (PyCFunction)(void (*)(void))call, METH_FASTCALL, "run a kernel"}, {0}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "leat_cpu_kernels", NULL, -1, methods};
PyMODINIT_FUNC PyInit_leat_cpu_kernels(void) { return PyModule_Create(&module); }
