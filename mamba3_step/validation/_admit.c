/* The per-call admission check of a CheckedSignature, in C (plan/run host overhead).
 *
 * mamba3_step/validation/cache.py holds the definition: CheckedSignature.admits (Python) answers
 * MISS, ADMIT or RECHECK for a call laid out like StepTensors. This module answers the same
 * question with the same steps in the same order, without the interpreter between them:
 *
 *   1. every argument the signature has as None is None               (else MISS)
 *   2. guard(*given) is true (torch's C++ TensorGuards, or the Python guard)   (else MISS)
 *   3. null_slot_id is the planned object, or of its exact type and equal     (else MISS)
 *   4. outside inference mode, no written tensor is an inference tensor       (else RECHECK)
 *   5. the vector-aligned tensors start on a multiple of vector_bytes, and no written tensor
 *      shares a byte with any other argument (byte extents fixed by the signature)  (else RECHECK)
 *
 * It reads tensors only through the guard object and the methods it is given (data_ptr(),
 * is_inference()), so it needs Python's headers and a C compiler, not torch's: setup.py builds
 * it when it can, and cache.py uses the Python definition when it is absent. The tests compare
 * the two on every verdict (tests/test_validation_cache.py).
 *
 * Data pointers: calling Tensor.data_ptr costs about 80 ns a tensor (16 tensors: 1.3 us, a
 * quarter of the flagship's run). torch exports a C function for exactly this read, for the
 * C++ wrappers inductor generates without torch's headers: torch._C._dynamo.guards.
 * _torchinductor_pyobject_tensor_data_ptr holds its address. cache.py passes that address
 * (data_ptr_fn) after checking, on probe tensors, that it answers what data_ptr() answers;
 * 0 means "call data_ptr". It is called only on objects the guard has just accepted, i.e.
 * tensors of the planned exact type (it throws a C++ exception on anything else).
 *
 * An error raised by the guard or by a tensor method propagates, as it does in Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define MAX_ARGS 32 /* StepTensors has 20 fields */

enum { MISS = 0, ADMIT = 1, RECHECK = 2 };

static PyObject *str_is_nested; /* "is_nested", interned at import */

typedef struct {
    PyObject_HEAD
    Py_ssize_t n_fields;                  /* length a call must have */
    Py_ssize_t n_present, present[MAX_ARGS]; /* call positions of the given tensors */
    Py_ssize_t n_absent, absent[MAX_ARGS];   /* call positions that must hold None */
    Py_ssize_t null_pos;                  /* call position of null_slot_id */
    PyObject *null_slot_id;               /* the planned value */
    PyObject *guard;                      /* guard(*given) -> truthy */
    int check_inference;                  /* the signature was validated outside inference mode */
    Py_ssize_t n_written, written[MAX_ARGS]; /* given indices of the written tensors */
    Py_ssize_t n_addr, addr[MAX_ARGS];       /* given indices of the tensors with a byte extent */
    unsigned long long extent[MAX_ARGS];     /* their extents in bytes (by addr index) */
    Py_ssize_t n_aligned, aligned[MAX_ARGS]; /* addr indices that must be vector aligned */
    Py_ssize_t n_waddr, waddr[MAX_ARGS];     /* addr indices of the written tensors */
    unsigned long long vector_bytes;
    PyObject *data_ptr;                   /* torch.Tensor.data_ptr */
    void *(*data_ptr_fn)(PyObject *);     /* torch's C function for the same read, or NULL */
    PyObject *is_inference;               /* torch.Tensor.is_inference */
} Admitter;

/* Fill out[0..n) from a tuple of ints, each in [0, bound); returns n or -1 with an exception. */
static Py_ssize_t
read_indices(PyObject *seq, const char *name, Py_ssize_t bound, Py_ssize_t *out)
{
    PyObject *fast = PySequence_Fast(seq, name);
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > MAX_ARGS) {
        PyErr_Format(PyExc_ValueError, "%s: at most %d entries, got %zd", name, MAX_ARGS, n);
        Py_DECREF(fast);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t v = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        if (v < 0 || v >= bound) {
            PyErr_Format(PyExc_ValueError, "%s: entry %zd is %zd, expected 0 <= entry < %zd", name, i, v, bound);
            Py_DECREF(fast);
            return -1;
        }
        out[i] = v;
    }
    Py_DECREF(fast);
    return n;
}

static int
Admitter_init(Admitter *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"n_fields", "present", "absent", "null_pos", "null_slot_id", "guard",
                             "check_inference", "written", "addr", "extents", "aligned", "written_addr",
                             "vector_bytes", "data_ptr", "is_inference", "data_ptr_fn", NULL};
    Py_ssize_t n_fields, null_pos;
    PyObject *present, *absent, *null_slot_id, *guard, *written, *addr, *extents, *aligned, *waddr;
    PyObject *data_ptr, *is_inference;
    int check_inference;
    unsigned long long vector_bytes, data_ptr_fn = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nOOnOOpOOOOOKOO|K", kwlist, &n_fields, &present, &absent,
                                     &null_pos, &null_slot_id, &guard, &check_inference, &written, &addr,
                                     &extents, &aligned, &waddr, &vector_bytes, &data_ptr, &is_inference,
                                     &data_ptr_fn))
        return -1;
    if (self->guard != NULL) { /* immutable once built: threads may share it */
        PyErr_SetString(PyExc_TypeError, "Admitter: already initialised");
        return -1;
    }
    /* Everything is read and checked into `s` first: a refused initialisation leaves self as it was. */
    Admitter s;
    memset(&s, 0, sizeof s);
    if (n_fields <= 0 || n_fields > MAX_ARGS || null_pos < 0 || null_pos >= n_fields || vector_bytes == 0) {
        PyErr_SetString(PyExc_ValueError, "Admitter: n_fields, null_pos or vector_bytes out of range");
        return -1;
    }
    s.n_fields = n_fields;
    s.null_pos = null_pos;
    s.check_inference = check_inference;
    s.vector_bytes = vector_bytes;
    s.data_ptr_fn = (void *(*)(PyObject *))(uintptr_t)data_ptr_fn;
    if ((s.n_present = read_indices(present, "present", n_fields, s.present)) < 0 ||
        (s.n_absent = read_indices(absent, "absent", n_fields, s.absent)) < 0 ||
        (s.n_written = read_indices(written, "written", s.n_present, s.written)) < 0 ||
        (s.n_addr = read_indices(addr, "addr", s.n_present, s.addr)) < 0 ||
        (s.n_aligned = read_indices(aligned, "aligned", s.n_addr, s.aligned)) < 0 ||
        (s.n_waddr = read_indices(waddr, "written_addr", s.n_addr, s.waddr)) < 0)
        return -1;
    PyObject *fast = PySequence_Fast(extents, "extents");
    if (fast == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(fast) != s.n_addr) {
        PyErr_SetString(PyExc_ValueError, "Admitter: one extent per addr entry");
        Py_DECREF(fast);
        return -1;
    }
    for (Py_ssize_t i = 0; i < s.n_addr; i++) {
        s.extent[i] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    if (!PyCallable_Check(guard) || !PyCallable_Check(data_ptr) || !PyCallable_Check(is_inference)) {
        PyErr_SetString(PyExc_TypeError, "Admitter: guard, data_ptr and is_inference must be callable");
        return -1;
    }
    /* Commit: the plain fields from s (self's object references are still NULL: guard was), then
     * the references. */
    size_t head = offsetof(Admitter, n_fields);
    memcpy((char *)self + head, (char *)&s + head, sizeof(Admitter) - head);
    Py_INCREF(null_slot_id);
    self->null_slot_id = null_slot_id;
    Py_INCREF(data_ptr);
    self->data_ptr = data_ptr;
    Py_INCREF(is_inference);
    self->is_inference = is_inference;
    Py_INCREF(guard);
    self->guard = guard; /* last: a non-NULL guard marks the object initialised */
    return 0;
}

/* 1 if method(t) is true, 0 if false, -1 on error */
static int
call_truth(PyObject *method, PyObject *t)
{
    PyObject *r = PyObject_CallOneArg(method, t);
    if (r == NULL)
        return -1;
    int truth = PyObject_IsTrue(r);
    Py_DECREF(r);
    return truth;
}

/* A tensor's data pointer: torch's C function where the signature allows it, else data_ptr().
 * 0 on success, -1 with an exception. */
static int
data_ptr_of(Admitter *self, PyObject *t, unsigned long long *out)
{
    if (self->data_ptr_fn != NULL) {
        *out = (unsigned long long)(uintptr_t)self->data_ptr_fn(t);
        return 0;
    }
    PyObject *p = PyObject_CallOneArg(self->data_ptr, t);
    if (p == NULL)
        return -1;
    *out = PyLong_AsUnsignedLongLong(p);
    Py_DECREF(p);
    return (*out == (unsigned long long)-1 && PyErr_Occurred()) ? -1 : 0;
}

/* Step 5: alignment and written-tensor overlap, from the data pointers. */
static int
addresses_verdict(Admitter *self, PyObject *const *given)
{
    unsigned long long start[MAX_ARGS], end[MAX_ARGS];
    for (Py_ssize_t j = 0; j < self->n_addr; j++) {
        if (data_ptr_of(self, given[self->addr[j]], &start[j]) < 0) {
            /* a tensor without a data pointer (e.g. an mkldnn tensor that torch's guard let
             * through): the full validation names it */
            PyErr_Clear();
            return RECHECK;
        }
        if (start[j] == 0) /* a non-empty tensor whose storage was freed: the full validation names it */
            return RECHECK;
        end[j] = start[j] + self->extent[j];
    }
    for (Py_ssize_t a = 0; a < self->n_aligned; a++)
        if (start[self->aligned[a]] % self->vector_bytes)
            return RECHECK;
    for (Py_ssize_t w = 0; w < self->n_waddr; w++) {
        Py_ssize_t j = self->waddr[w];
        for (Py_ssize_t k = 0; k < self->n_addr; k++)
            if (k != j && start[k] < end[j] && start[j] < end[k])
                return RECHECK;
    }
    return ADMIT;
}

static int
verdict(Admitter *self, PyObject *const *call)
{
    PyObject *given[MAX_ARGS];
    for (Py_ssize_t i = 0; i < self->n_absent; i++)
        if (call[self->absent[i]] != Py_None)
            return MISS;
    for (Py_ssize_t i = 0; i < self->n_present; i++) {
        given[i] = call[self->present[i]];
        /* A nested tensor has no sizes: torch's guard would throw a C++ exception through this
         * module and abort the process. MISS sends the call to the full validation, which names it. */
        if (given[i] == Py_None)
            return MISS;
        PyObject *nested = PyObject_GetAttr(given[i], str_is_nested);
        if (nested == NULL) { /* not a tensor: the full validation names it */
            PyErr_Clear();
            return MISS;
        }
        int is = PyObject_IsTrue(nested);
        Py_DECREF(nested);
        if (is != 0) {
            PyErr_Clear();
            return MISS;
        }
    }
    PyObject *ok = PyObject_Vectorcall(self->guard, given, (size_t)self->n_present, NULL);
    if (ok == NULL)
        return -1;
    int pass = PyObject_IsTrue(ok);
    Py_DECREF(ok);
    if (pass <= 0)
        return pass < 0 ? -1 : MISS;
    PyObject *nsi = call[self->null_pos];
    if (nsi != self->null_slot_id) {
        if (Py_TYPE(nsi) != Py_TYPE(self->null_slot_id))
            return MISS;
        int ne = PyObject_RichCompareBool(nsi, self->null_slot_id, Py_NE);
        if (ne != 0)
            return ne < 0 ? -1 : MISS;
    }
    if (self->check_inference) {
        for (Py_ssize_t i = 0; i < self->n_written; i++) {
            int inf = call_truth(self->is_inference, given[self->written[i]]);
            if (inf != 0)
                return inf < 0 ? -1 : RECHECK;
        }
    }
    return addresses_verdict(self, given);
}

static PyObject *
Admitter_admits(Admitter *self, PyObject *call)
{
    if (self->guard == NULL) {
        PyErr_SetString(PyExc_TypeError, "Admitter: not initialised");
        return NULL;
    }
    PyObject *fast = PySequence_Fast(call, "admits: call must be a sequence");
    if (fast == NULL)
        return NULL;
    if (PySequence_Fast_GET_SIZE(fast) != self->n_fields) {
        PyErr_Format(PyExc_ValueError, "admits: call has %zd fields, expected %zd", PySequence_Fast_GET_SIZE(fast),
                     self->n_fields);
        Py_DECREF(fast);
        return NULL;
    }
    int v = verdict(self, PySequence_Fast_ITEMS(fast));
    Py_DECREF(fast);
    return v < 0 ? NULL : PyLong_FromLong(v);
}

static int
Admitter_traverse(Admitter *self, visitproc visit, void *arg)
{
    Py_VISIT(self->null_slot_id);
    Py_VISIT(self->guard);
    Py_VISIT(self->data_ptr);
    Py_VISIT(self->is_inference);
    return 0;
}

static int
Admitter_clear(Admitter *self)
{
    Py_CLEAR(self->null_slot_id);
    Py_CLEAR(self->guard);
    Py_CLEAR(self->data_ptr);
    Py_CLEAR(self->is_inference);
    return 0;
}

static void
Admitter_dealloc(Admitter *self)
{
    PyObject_GC_UnTrack(self);
    Admitter_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Admitter_methods[] = {
    {"admits", (PyCFunction)Admitter_admits, METH_O,
     "admits(call) -> 0 (MISS), 1 (ADMIT) or 2 (RECHECK): CheckedSignature.admits in C."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject AdmitterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mamba3_step.validation._admit.Admitter",
    .tp_basicsize = sizeof(Admitter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The admission check of one CheckedSignature (see the module source).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Admitter_init,
    .tp_dealloc = (destructor)Admitter_dealloc,
    .tp_traverse = (traverseproc)Admitter_traverse,
    .tp_clear = (inquiry)Admitter_clear,
    .tp_methods = Admitter_methods,
};

static struct PyModuleDef admit_module = {
    PyModuleDef_HEAD_INIT, "mamba3_step.validation._admit",
    "CheckedSignature.admits in C (optional; cache.py falls back to Python).", -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC
PyInit__admit(void)
{
    if (PyType_Ready(&AdmitterType) < 0)
        return NULL;
    str_is_nested = PyUnicode_InternFromString("is_nested");
    if (str_is_nested == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&admit_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&AdmitterType);
    if (PyModule_AddObject(m, "Admitter", (PyObject *)&AdmitterType) < 0 ||
        PyModule_AddIntConstant(m, "MISS", MISS) < 0 || PyModule_AddIntConstant(m, "ADMIT", ADMIT) < 0 ||
        PyModule_AddIntConstant(m, "RECHECK", RECHECK) < 0) {
        Py_DECREF(&AdmitterType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
