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
   n = 1 + the number of selected nodes (the root first), bound = the largest depth.

   best_first_rows(logp, L, V, budget, root, ints, scores, aidx, anc) -> (n, bound) or None

   The same from the log-probability rows logp float32 [L, V], each row's largest values taken here as the search
   reaches them (a search of budget B reads about 2B ranks in all, most rows only a few): a row is split in blocks of
   32 whose maxima sit in a heap, and each rank pops a block and rescans it. torch.topk's output is unique where
   the values read, and the one after them, are distinct and none is NaN: these ranks are then exactly its. Where
   not (a tie, a NaN in a row read, a read reaching -inf values), None: the caller takes torch.topk, whose order among
   equal values is its own, and best_first. A selection pass over every row costs about torch.topk's: the branches
   of a selection on fresh data mispredict, and reading few ranks is what saves.
   */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
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

/* Where the search reads each row's ranks: top-k lists given whole (rows == NULL), or taken from the log-probability
   rows as they are read (Rows). */
typedef struct Rows Rows;
static int reach(Rows *rows, Py_ssize_t d, Py_ssize_t r);

typedef struct {
    const float *vals; /* [L, stride]: rank r of row d at d * stride + r */
    const int64_t *toks;
    Py_ssize_t stride;
    Rows *rows;
} Source;

/* The value of rank r in row d into *out; 0 where a Rows source cannot give it exactly (the caller falls back). */
static inline int value_at(Source *src, Py_ssize_t d, Py_ssize_t r, float *out) {
    if (src->rows && !reach(src->rows, d, r)) return 0;
    *out = src->vals[(size_t)d * src->stride + r];
    return 1;
}

/* The tree (see the top) from `src` into the outputs: (n, bound); None where `src` fell back; NULL with an error. */
static PyObject *build(Source *src, Py_ssize_t L, Py_ssize_t k, Py_ssize_t budget, long long root, int64_t *ints,
                       float *score, int64_t *aidx, unsigned char *anc) {
    PyObject *result = NULL;
    Py_ssize_t cap = budget + 1;
    int64_t *tok = ints, *par = ints + cap, *dep = ints + 2 * cap, *first = ints + 3 * cap, *next = ints + 4 * cap;
    /* per selected node, in pop order */
    int32_t *count = calloc(L + 2, sizeof(int32_t)); /* per depth: nodes selected so far, then the flat offsets */
    int32_t *rank = malloc(sizeof(int32_t) * budget); /* its rank within its depth */
    int32_t *parent_of = malloc(sizeof(int32_t) * budget);
    int32_t *depth_of = malloc(sizeof(int32_t) * budget);
    int32_t *child_rank = malloc(sizeof(int32_t) * budget); /* r: its token is toks[d - 1, r] */
    int32_t *flat = malloc(sizeof(int32_t) * budget);
    float *score_of = malloc(sizeof(float) * budget);
    Cand *heap = malloc(sizeof(Cand) * (budget + 2)); /* a pop pushes at most two: budget + 1 entries at most */
    if (!heap || !count || !rank || !parent_of || !depth_of || !child_rank || !flat || !score_of) {
        PyErr_NoMemory();
        goto done;
    }

    Py_ssize_t size = 0, sel = 0;
    float x;
    if (!value_at(src, 0, 0, &x)) goto fell_back;
    push(heap, &size, (Cand){-x, 1, -1, 0});
    while (size > 0 && sel < budget) {
        Cand c = pop(heap, &size);
        int32_t v = (int32_t)sel++;
        float s = -c.neg;
        rank[v] = count[c.d]++;
        parent_of[v] = c.parent, depth_of[v] = c.d, child_rank[v] = c.r, score_of[v] = s;
        if (c.r + 1 < k) { /* the next sibling: float32 sums, as the other builds */
            float base = c.parent >= 0 ? score_of[c.parent] : 0.0f;
            if (!value_at(src, c.d - 1, c.r + 1, &x)) goto fell_back;
            push(heap, &size, (Cand){-(base + x), c.d, c.parent, c.r + 1});
        }
        if (c.d < L) { /* the first child */
            if (!value_at(src, c.d, 0, &x)) goto fell_back;
            push(heap, &size, (Cand){-(s + x), c.d + 1, v, 0});
        }
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
        tok[i] = src->toks[(size_t)(d - 1) * src->stride + child_rank[v]];
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
    goto done;
fell_back:
    result = Py_NewRef(Py_None);
done:
    free(heap), free(count), free(rank), free(parent_of), free(depth_of), free(child_rank), free(flat), free(score_of);
    return result;
}

static int sizes_ok(Py_ssize_t L, Py_ssize_t k, Py_ssize_t budget) {
    if (L >= 1 && k >= 1 && budget >= 1 && L <= (1 << 20) && k <= (1 << 24) && budget <= (1 << 24)) return 1;
    PyErr_SetString(PyExc_ValueError, "best_first: L, k and budget must be in [1, 2**20], [1, 2**24], [1, 2**24]");
    return 0;
}

static int outputs_ok(Py_buffer *bi, Py_buffer *bs, Py_buffer *ba, Py_buffer *bm, Py_ssize_t L, Py_ssize_t budget) {
    Py_ssize_t cap = budget + 1;
    return enough(bi, 5 * cap * 8, "ints") && enough(bs, cap * 4, "scores") && enough(ba, cap * (L + 1) * 8, "aidx")
           && enough(bm, cap * cap, "anc");
}

static PyObject *best_first(PyObject *self, PyObject *args) {
    Py_buffer bv, bt, bi, bs, ba, bm;
    Py_ssize_t L, k, budget;
    long long root;
    if (!PyArg_ParseTuple(args, "y*y*nnnLw*w*w*w*", &bv, &bt, &L, &k, &budget, &root, &bi, &bs, &ba, &bm))
        return NULL;
    PyObject *result = NULL;
    if (sizes_ok(L, k, budget) && enough(&bv, L * k * 4, "vals") && enough(&bt, L * k * 8, "toks")
        && outputs_ok(&bi, &bs, &ba, &bm, L, budget))
    {
        Source src = {(const float *)bv.buf, (const int64_t *)bt.buf, k, NULL};
        result = build(&src, L, k, budget, root, (int64_t *)bi.buf, (float *)bs.buf, (int64_t *)ba.buf,
                       (unsigned char *)bm.buf);
    }
    PyBuffer_Release(&bv), PyBuffer_Release(&bt), PyBuffer_Release(&bi), PyBuffer_Release(&bs);
    PyBuffer_Release(&ba), PyBuffer_Release(&bm);
    return result;
}

/* Ranks read from the log-probability rows as the search asks for them. */
#define BLOCK 32

struct Rows {
    const float *logp; /* [L, V] */
    Py_ssize_t V, blocks;
    float *vals; /* [L, k + 1]: each row's ranks read so far, descending */
    int64_t *toks;
    Py_ssize_t stride; /* k + 1 */
    int32_t *have; /* per row: ranks read so far; -1: row not started */
    uint32_t *taken; /* [L, blocks]: bit j of a block: its element j was read already */
    float *head; /* [L, blocks]: each block's largest element not taken yet (-inf: none above -inf) */
    int32_t *head_at; /* its index in the row, -1: none */
    int32_t *order; /* [L, blocks]: a max-heap of the blocks on their heads */
};

static void rescan(struct Rows *rows, const float *row, Py_ssize_t d, Py_ssize_t b) {
    Py_ssize_t lo = b * BLOCK, hi = lo + BLOCK < rows->V ? lo + BLOCK : rows->V;
    uint32_t taken = rows->taken[d * rows->blocks + b];
    float m = -INFINITY;
    int32_t at = -1;
    for (Py_ssize_t j = lo; j < hi; j++) {
        float x = row[j];
        if (!((taken >> (j - lo)) & 1u) && x > m) m = x, at = (int32_t)j;
    }
    rows->head[d * rows->blocks + b] = m, rows->head_at[d * rows->blocks + b] = at;
}

static void sift_blocks(const float *head, int32_t *order, Py_ssize_t n, Py_ssize_t i) {
    int32_t x = order[i];
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && head[order[c + 1]] > head[order[c]]) c++;
        if (!(head[order[c]] > head[x])) break;
        order[i] = order[c];
        i = c;
    }
    order[i] = x;
}

/* Row d read up to rank r + 1 (the rank after it decides whether rank r is unique), where the row has it: 0 where
   a rank read ties its predecessor, the row holds a NaN, or a rank would be -inf (the caller falls back). */
static int reach(struct Rows *rows, Py_ssize_t d, Py_ssize_t r) {
    Py_ssize_t need = r + 2 < rows->V ? r + 2 : rows->V;
    int32_t have = rows->have[d];
    if (have >= need) return 1;
    const float *row = rows->logp + (size_t)d * rows->V;
    Py_ssize_t nb = rows->blocks;
    float *head = rows->head + d * nb;
    int32_t *at = rows->head_at + d * nb, *order = rows->order + d * nb;
    if (have < 0) { /* start the row: no NaN in it, each block's maximum, the blocks' heap */
        int nan = 0;
        for (Py_ssize_t j = 0; j < rows->V; j++) nan |= row[j] != row[j];
        if (nan) return 0;
        memset(rows->taken + d * nb, 0, sizeof(uint32_t) * nb);
        for (Py_ssize_t b = 0; b < nb; b++) rescan(rows, row, d, b), order[b] = (int32_t)b;
        for (Py_ssize_t b = nb / 2; b-- > 0;) sift_blocks(head, order, nb, b);
        have = 0;
    }
    float *vals = rows->vals + d * rows->stride;
    int64_t *toks = rows->toks + d * rows->stride;
    for (; have < need; have++) {
        int32_t b = order[0], j = at[b];
        if (j < 0) return 0; /* only -inf (or nothing) left */
        if (have > 0 && !(vals[have - 1] > head[b])) return 0; /* a tie: torch.topk orders it its own way */
        vals[have] = head[b], toks[have] = j;
        rows->taken[d * nb + b] |= 1u << (j - b * BLOCK);
        rescan(rows, row, d, b);
        sift_blocks(head, order, nb, 0);
    }
    rows->have[d] = have;
    return 1;
}

static PyObject *best_first_rows(PyObject *self, PyObject *args) {
    Py_buffer bl, bi, bs, ba, bm;
    Py_ssize_t L, V, budget;
    long long root;
    if (!PyArg_ParseTuple(args, "y*nnnLw*w*w*w*", &bl, &L, &V, &budget, &root, &bi, &bs, &ba, &bm)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t k = budget < V ? budget : V, nb = (V + BLOCK - 1) / BLOCK;
    struct Rows rows = {(const float *)bl.buf, V, nb, NULL, NULL, k + 1, NULL, NULL, NULL, NULL, NULL};
    if (!sizes_ok(L, k, budget) || !enough(&bl, L * V * 4, "logprobs") || !outputs_ok(&bi, &bs, &ba, &bm, L, budget))
        goto done;
    rows.vals = malloc(sizeof(float) * L * (k + 1)), rows.toks = malloc(sizeof(int64_t) * L * (k + 1));
    rows.have = malloc(sizeof(int32_t) * L), rows.taken = malloc(sizeof(uint32_t) * L * nb);
    rows.head = malloc(sizeof(float) * L * nb), rows.head_at = malloc(sizeof(int32_t) * L * nb);
    rows.order = malloc(sizeof(int32_t) * L * nb);
    if (!rows.vals || !rows.toks || !rows.have || !rows.taken || !rows.head || !rows.head_at || !rows.order) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t d = 0; d < L; d++) rows.have[d] = -1;
    Source src = {rows.vals, rows.toks, k + 1, &rows};
    result = build(&src, L, k, budget, root, (int64_t *)bi.buf, (float *)bs.buf, (int64_t *)ba.buf,
                   (unsigned char *)bm.buf);
done:
    free(rows.vals), free(rows.toks), free(rows.have), free(rows.taken), free(rows.head), free(rows.head_at);
    free(rows.order);
    PyBuffer_Release(&bl), PyBuffer_Release(&bi), PyBuffer_Release(&bs), PyBuffer_Release(&ba), PyBuffer_Release(&bm);
    return result;
}

static PyMethodDef methods[] = {
    {"best_first", best_first, METH_VARARGS, "The best-first draft tree, its ancestry and child lists (see the source)."},
    {"best_first_rows", best_first_rows, METH_VARARGS,
     "best_first from the log-probability rows (their top k taken here), or None on a tie or NaN (see the source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hosttree", "ddtree's host tree build in C.", -1, methods};

PyMODINIT_FUNC PyInit__hosttree(void) { return PyModule_Create(&module); }
