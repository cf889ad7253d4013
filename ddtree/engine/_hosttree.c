/* ddtree.engine.tree's host tree build in C: one call a round instead of a few hundred Python steps.

   best_first(vals, toks, L, k, budget, root, ints, scores, aidx, anc) -> (n, bound)

   The tree of tree._best_first_heap, and so of the per-depth builds: a best-first search over the candidates
   (depth d, parent, child rank r), keyed (-score, d, parent, r) with float32 scores. The heap build keys on the
   parent's rank within its depth; ranks of one depth are handed out in pop order, so the parent's pop index
   orders the same way. Every key is distinct: the pop order does not depend on how the heap breaks ties.
   Then the flat layout (depth-major, pop order within a depth), the ancestor index and matrix, and each node's
   children as lists (first child, next sibling) for the greedy walk.

   vals   float32 [L, k]  per position, the top-k log-probabilities sorted descending (torch.topk); read only
   toks   int64   [L, k]  their tokens; read only
   ints   int64   [5, budget + 1]  out: tokens, parents, depths, first child, next sibling (-1: none)
   scores float32 [budget + 1]     out: cumulative scores (0 for the root)
   aidx   int64   out, n * (bound + 1) of at least (budget + 1) * (L + 1): [i, h] = the h-th ancestor of i (the root
          repeats past it)
   anc    bool    out, n * n of at least (budget + 1) ** 2: [i, j] = j is i or an ancestor of i
   n = 1 + the number of selected nodes (the root first), bound = the largest depth. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    float neg; /* minus the score */
    int32_t d, parent, r; /* parent: its pop index, -1 for the root */
} Cand;

static inline int before(const Cand *a, const Cand *b) {
    if (a->neg != b->neg) return a->neg < b->neg;
    if (a->d != b->d) return a->d < b->d;
    if (a->parent != b->parent) return a->parent < b->parent;
    return a->r < b->r;
}

static void push(Cand *heap, Py_ssize_t *size, Cand c) {
    Py_ssize_t i = (*size)++;
    while (i > 0) {
        Py_ssize_t up = (i - 1) / 2;
        if (!before(&c, &heap[up])) break;
        heap[i] = heap[up];
        i = up;
    }
    heap[i] = c;
}

static Cand pop(Cand *heap, Py_ssize_t *size) {
    Cand top = heap[0], last = heap[--(*size)];
    Py_ssize_t i = 0, n = *size;
    if (n == 0) return top;
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && before(&heap[c + 1], &heap[c])) c++;
        if (!before(&heap[c], &last)) break;
        heap[i] = heap[c];
        i = c;
    }
    heap[i] = last;
    return top;
}

static int enough(const Py_buffer *b, Py_ssize_t need, const char *name) {
    if (b->len >= need) return 1;
    PyErr_Format(PyExc_ValueError, "best_first: '%s' holds %zd bytes, needs %zd", name, b->len, need);
    return 0;
}

static PyObject *best_first(PyObject *self, PyObject *args) {
    Py_buffer bv, bt, bi, bs, ba, bm;
    Py_ssize_t L, k, budget;
    long long root;
    if (!PyArg_ParseTuple(args, "y*y*nnnLw*w*w*w*", &bv, &bt, &L, &k, &budget, &root, &bi, &bs, &ba, &bm))
        return NULL;
    PyObject *result = NULL;
    /* per selected node, in pop order */
    int32_t *count = NULL, *rank = NULL, *parent_of = NULL, *depth_of = NULL, *child_rank = NULL, *flat = NULL;
    float *score_of = NULL;
    Cand *heap = NULL;
    if (L < 1 || k < 1 || budget < 1 || L > (1 << 20) || k > (1 << 24) || budget > (1 << 24)) {
        PyErr_SetString(PyExc_ValueError, "best_first: L, k and budget must be in [1, 2**20], [1, 2**24], [1, 2**24]");
        goto done;
    }
    Py_ssize_t cap = budget + 1;
    if (!enough(&bv, L * k * 4, "vals") || !enough(&bt, L * k * 8, "toks") || !enough(&bi, 5 * cap * 8, "ints")
        || !enough(&bs, cap * 4, "scores") || !enough(&ba, cap * (L + 1) * 8, "aidx")
        || !enough(&bm, cap * cap, "anc"))
        goto done;
    const float *vals = (const float *)bv.buf;
    const int64_t *toks = (const int64_t *)bt.buf;
    int64_t *ints = (int64_t *)bi.buf;
    int64_t *tok = ints, *par = ints + cap, *dep = ints + 2 * cap, *first = ints + 3 * cap, *next = ints + 4 * cap;
    float *score = (float *)bs.buf;
    int64_t *aidx = (int64_t *)ba.buf;
    unsigned char *anc = (unsigned char *)bm.buf;

    heap = malloc(sizeof(Cand) * (budget + 2)); /* a pop pushes at most two: budget + 1 entries at most */
    count = calloc(L + 2, sizeof(int32_t));     /* per depth: nodes selected so far, then the flat offsets */
    rank = malloc(sizeof(int32_t) * budget);    /* its rank within its depth */
    parent_of = malloc(sizeof(int32_t) * budget);
    depth_of = malloc(sizeof(int32_t) * budget);
    child_rank = malloc(sizeof(int32_t) * budget); /* r: its token is toks[d - 1, r] */
    flat = malloc(sizeof(int32_t) * budget);
    score_of = malloc(sizeof(float) * budget);
    if (!heap || !count || !rank || !parent_of || !depth_of || !child_rank || !flat || !score_of) {
        PyErr_NoMemory();
        goto done;
    }

    Py_ssize_t size = 0, sel = 0;
    push(heap, &size, (Cand){-vals[0], 1, -1, 0});
    while (size > 0 && sel < budget) {
        Cand c = pop(heap, &size);
        int32_t v = (int32_t)sel++;
        float s = -c.neg;
        rank[v] = count[c.d]++;
        parent_of[v] = c.parent, depth_of[v] = c.d, child_rank[v] = c.r, score_of[v] = s;
        if (c.r + 1 < k) { /* the next sibling: float32 sums, as the other builds */
            float base = c.parent >= 0 ? score_of[c.parent] : 0.0f;
            push(heap, &size, (Cand){-(base + vals[(size_t)(c.d - 1) * k + c.r + 1]), c.d, c.parent, c.r + 1});
        }
        if (c.d < L) /* the first child */
            push(heap, &size, (Cand){-(s + vals[(size_t)c.d * k]), c.d + 1, v, 0});
    }

    Py_ssize_t n = sel + 1;
    int32_t bound = 0;
    int32_t offset = 1; /* the root takes index 0 */
    for (Py_ssize_t d = 1; d <= L; d++) {
        int32_t c = count[d];
        count[d] = offset;
        offset += c;
        if (c) bound = (int32_t)d;
    }
    for (int32_t v = 0; v < sel; v++) flat[v] = count[depth_of[v]] + rank[v];
    tok[0] = root, par[0] = -1, dep[0] = 0, score[0] = 0.0f;
    for (int32_t v = 0; v < sel; v++) {
        int32_t i = flat[v], d = depth_of[v];
        tok[i] = toks[(size_t)(d - 1) * k + child_rank[v]];
        par[i] = parent_of[v] >= 0 ? flat[parent_of[v]] : 0;
        dep[i] = d;
        score[i] = score_of[v];
    }
    for (Py_ssize_t i = 0; i < n; i++) first[i] = next[i] = -1;
    for (Py_ssize_t i = n - 1; i >= 1; i--) { /* backwards: children in flat order */
        next[i] = first[par[i]];
        first[par[i]] = i;
    }
    /* parents precede children: row i is i, then its parent's row */
    Py_ssize_t w = bound + 1;
    memset(anc, 0, (size_t)n * n);
    memset(aidx, 0, sizeof(int64_t) * w);
    anc[0] = 1;
    for (Py_ssize_t i = 1; i < n; i++) {
        int64_t *row = aidx + i * w;
        const int64_t *up = aidx + par[i] * w;
        row[0] = i;
        memcpy(row + 1, up, sizeof(int64_t) * (w - 1));
        for (Py_ssize_t h = 0; h <= dep[i]; h++) anc[i * n + row[h]] = 1;
    }
    result = Py_BuildValue("nn", n, (Py_ssize_t)bound);

done:
    free(heap), free(count), free(rank), free(parent_of), free(depth_of), free(child_rank), free(flat), free(score_of);
    PyBuffer_Release(&bv), PyBuffer_Release(&bt), PyBuffer_Release(&bi), PyBuffer_Release(&bs);
    PyBuffer_Release(&ba), PyBuffer_Release(&bm);
    return result;
}

static PyMethodDef methods[] = {
    {"best_first", best_first, METH_VARARGS, "The best-first draft tree, its ancestry and child lists (see the source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hosttree", "ddtree's host tree build in C.", -1, methods};

PyMODINIT_FUNC PyInit__hosttree(void) { return PyModule_Create(&module); }
