/* ddtree.engine.tree's host build in C: the best-first draft tree in one call a round (a CPU run's build).

   best_first(logprobs, budget, root, ints, scores, aidx, anc) -> (n, bound)

   The tree of ddtree.testing.reference.best_first_reference, whose docstring is the definition (ties, NaN and -inf
   included): a value is read as a log-probability (NaN counts as -inf, a positive value as 0); each position's ranks
   run from its largest value, equal values by token id; scores are float32 sums root to node (a zero as +0.0); the
   nodes are the first `budget` in the order (score descending, shallower, parent earlier, lower rank); flat layout
   depth-major.

   The search is a best-first heap over candidates (depth d, parent, rank r) keyed (-score, d, parent's pop index, r):
   every key is distinct, so the pop order does not depend on how the heap breaks ties. Each row's ranks are read as the
   search reaches them (a search of budget B reads about 2B ranks in all, most rows only a few): a row is split in
   blocks of 32 whose best values sit in a heap ordered (value descending, block ascending), and each rank pops a
   block and rescans it; once a row's values above -inf are spent, its next ranks are its -inf (and NaN) entries in
   token order. Then the flat layout, the ancestor index and matrix, and each node's children as lists (first child,
   next sibling) for the host walk.

   logprobs float32 [L, V], C-contiguous; read only
   ints     int64   [5, budget + 1] out: tokens, parents, depths, first child, next sibling (-1: none)
   scores   float32 [budget + 1]    out: cumulative scores (0 for the root)
   aidx     int64   [(budget + 1) * (L + 1)] out, its first n * (bound + 1): [i, h] = the h-th ancestor of i (the root
            repeats past it)
   anc      bool    [(budget + 1) ** 2] out, its first n * n: [i, j] = j is i or an ancestor of i
   n = 1 + the number of selected nodes (the root first), bound = the largest depth. Wrong types, dtypes, shapes,
   layouts or sizes raise TypeError / ValueError naming the argument.

   batch_best_first(logprobs, budget, roots, tokens, parents, depths, scores, aidx, anc) -> None

   The same trees for N streams in one call, in the layout of ddtree.engine.batch_tree's batched round (at its
   definition below).
   */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_L (1 << 20)      /* positions (the drafter's block) */
#define MAX_BUDGET (1 << 24) /* nodes: int32 fields, and (budget + 1) ** 2 bytes of ancestor matrix */
#define BLOCK 32

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

/* Ranks read from the log-probability rows as the search asks for them. */
typedef struct {
    const float *logp; /* [L, V] */
    Py_ssize_t V, blocks, k;
    float *vals; /* [L, k]: each row's ranks read so far */
    int64_t *toks;
    int32_t *have; /* per row: ranks read so far; -1: row not started */
    Py_ssize_t *tail; /* per row: where the scan for -inf entries goes on */
    uint32_t *taken; /* [L, blocks]: bit j: the block's element j was read already */
    float *head; /* [L, blocks]: the block's best value not read yet (-inf: none above -inf) */
    int32_t *head_at; /* its index in the row, -1: none */
    int32_t *order; /* [L, blocks]: a heap of the blocks, best head first (the lower block on a tie) */
} Rows;

/* A value as the definition reads it: NaN stays NaN here and is never taken as a head (x > m is false). */
static inline float clamped(float x) { return x > 0.0f ? 0.0f : x; }

static void rescan(Rows *rows, const float *row, Py_ssize_t d, Py_ssize_t b) {
    Py_ssize_t lo = b * BLOCK, hi = lo + BLOCK < rows->V ? lo + BLOCK : rows->V;
    uint32_t taken = rows->taken[d * rows->blocks + b];
    float m = -INFINITY;
    int32_t at = -1;
    for (Py_ssize_t j = lo; j < hi; j++) { /* the first of the block's largest values above -inf */
        float x = clamped(row[j]);
        if (!((taken >> (j - lo)) & 1u) && x > m) m = x, at = (int32_t)j;
    }
    rows->head[d * rows->blocks + b] = m, rows->head_at[d * rows->blocks + b] = at;
}

static inline int block_before(const float *head, int32_t a, int32_t b) {
    return head[a] > head[b] || (head[a] == head[b] && a < b);
}

static void sift_blocks(const float *head, int32_t *order, Py_ssize_t n, Py_ssize_t i) {
    int32_t x = order[i];
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && block_before(head, order[c + 1], order[c])) c++;
        if (!block_before(head, order[c], x)) break;
        order[i] = order[c];
        i = c;
    }
    order[i] = x;
}

/* Row d read up to rank r (r < k <= V: the row has it). */
static void reach(Rows *rows, Py_ssize_t d, Py_ssize_t r) {
    int32_t have = rows->have[d];
    if (have > r) return;
    const float *row = rows->logp + (size_t)d * rows->V;
    Py_ssize_t nb = rows->blocks;
    float *head = rows->head + d * nb;
    int32_t *at = rows->head_at + d * nb, *order = rows->order + d * nb;
    if (have < 0) { /* start the row: each block's best value, the blocks' heap */
        memset(rows->taken + d * nb, 0, sizeof(uint32_t) * nb);
        for (Py_ssize_t b = 0; b < nb; b++) rescan(rows, row, d, b), order[b] = (int32_t)b;
        for (Py_ssize_t b = nb / 2; b-- > 0;) sift_blocks(head, order, nb, b);
        rows->tail[d] = 0;
        have = 0;
    }
    float *vals = rows->vals + d * rows->k;
    int64_t *toks = rows->toks + d * rows->k;
    for (; have <= r; have++) {
        int32_t b = order[0], j = at[b];
        if (j >= 0) {
            vals[have] = head[b], toks[have] = j;
            rows->taken[d * nb + b] |= 1u << (j - b * BLOCK);
            rescan(rows, row, d, b);
            sift_blocks(head, order, nb, 0);
        } else { /* every value above -inf is read: the -inf (and NaN) entries follow in token order */
            Py_ssize_t t = rows->tail[d];
            while (clamped(row[t]) > -INFINITY) t++; /* read already; the row holds V > r entries */
            vals[have] = -INFINITY, toks[have] = t;
            rows->tail[d] = t + 1;
        }
    }
    rows->have[d] = have;
}

static inline float value_at(Rows *rows, Py_ssize_t d, Py_ssize_t r) {
    reach(rows, d, r);
    return rows->vals[d * rows->k + r];
}

/* One tree's scratch, allocated once and reused by every tree of a call: the rows' ranks (`rows`, pointed at each
   tree's logprobs by `rows_start`) and the search's per-node arrays. */
typedef struct {
    Rows rows;
    int32_t *count; /* [L + 2] per depth: nodes selected so far, then the flat offsets */
    int32_t *rank, *parent_of, *depth_of, *child_rank, *flat; /* [budget] per selected node, in pop order */
    float *score_of;
    Cand *heap; /* [budget + 2]: a pop pushes at most two, so budget + 1 entries at most */
} Work;

static void work_free(Work *w) {
    free(w->rows.vals), free(w->rows.toks), free(w->rows.have), free(w->rows.tail), free(w->rows.taken);
    free(w->rows.head), free(w->rows.head_at), free(w->rows.order);
    free(w->count), free(w->rank), free(w->parent_of), free(w->depth_of), free(w->child_rank), free(w->flat);
    free(w->score_of), free(w->heap);
    memset(w, 0, sizeof(Work));
}

/* The scratch for trees of `budget` nodes over [L, V] blocks; 0 with a MemoryError (nothing left allocated). */
static int work_alloc(Work *w, Py_ssize_t L, Py_ssize_t V, Py_ssize_t budget) {
    Py_ssize_t k = budget < V ? budget : V, nb = (V + BLOCK - 1) / BLOCK;
    Rows *rows = &w->rows;
    rows->V = V, rows->blocks = nb, rows->k = k;
    rows->vals = malloc(sizeof(float) * L * k), rows->toks = malloc(sizeof(int64_t) * L * k);
    rows->have = malloc(sizeof(int32_t) * L), rows->tail = malloc(sizeof(Py_ssize_t) * L);
    rows->taken = malloc(sizeof(uint32_t) * L * nb), rows->head = malloc(sizeof(float) * L * nb);
    rows->head_at = malloc(sizeof(int32_t) * L * nb), rows->order = malloc(sizeof(int32_t) * L * nb);
    w->count = malloc(sizeof(int32_t) * (L + 2)), w->rank = malloc(sizeof(int32_t) * budget);
    w->parent_of = malloc(sizeof(int32_t) * budget), w->depth_of = malloc(sizeof(int32_t) * budget);
    w->child_rank = malloc(sizeof(int32_t) * budget), w->flat = malloc(sizeof(int32_t) * budget);
    w->score_of = malloc(sizeof(float) * budget), w->heap = malloc(sizeof(Cand) * (budget + 2));
    if (!rows->vals || !rows->toks || !rows->have || !rows->tail || !rows->taken || !rows->head || !rows->head_at
        || !rows->order || !w->count || !w->rank || !w->parent_of || !w->depth_of || !w->child_rank || !w->flat
        || !w->score_of || !w->heap) {
        work_free(w);
        PyErr_NoMemory();
        return 0;
    }
    return 1;
}

/* The rows read from `logp` [L, V] from their first rank on (a new tree). */
static void rows_start(Rows *rows, const float *logp, Py_ssize_t L) {
    rows->logp = logp;
    for (Py_ssize_t d = 0; d < L; d++) rows->have[d] = -1;
}

/* Where a tree goes: its flat fields (n entries each), the ancestor index (n rows of `width`: 0 for the tree's own
   bound + 1) and matrix (n * n); first and next (the child lists) NULL where not wanted. */
typedef struct {
    int64_t *tok, *par, *dep, *first, *next;
    float *score;
    int64_t *aidx;
    Py_ssize_t width;
    unsigned char *anc;
} Out;

/* The tree (see the top) of the rows `w` reads (rows_start'ed) into `out`: n, its largest depth in *bound. need > 0:
   a tree of other than `need` nodes writes nothing and returns its n (the caller's error). */
static Py_ssize_t build(Work *w, Py_ssize_t L, Py_ssize_t budget, long long root, const Out *out, int32_t *bound_out,
                        Py_ssize_t need) {
    Rows *src = &w->rows;
    Py_ssize_t k = src->k;
    int32_t *count = w->count, *rank = w->rank, *parent_of = w->parent_of, *depth_of = w->depth_of;
    int32_t *child_rank = w->child_rank, *flat = w->flat; /* child_rank: r, its token is toks[d - 1, r] */
    float *score_of = w->score_of;
    Cand *heap = w->heap;
    memset(count, 0, sizeof(int32_t) * (L + 2));

    Py_ssize_t size = 0, sel = 0;
    push(heap, &size, (Cand){-value_at(src, 0, 0), 1, -1, 0});
    while (size > 0 && sel < budget) {
        Cand c = pop(heap, &size);
        int32_t v = (int32_t)sel++;
        float s = -c.neg;
        rank[v] = count[c.d]++;
        parent_of[v] = c.parent, depth_of[v] = c.d, child_rank[v] = c.r, score_of[v] = s;
        if (c.r + 1 < k) { /* the next sibling: float32 sums, as the definition */
            float base = c.parent >= 0 ? score_of[c.parent] : 0.0f;
            push(heap, &size, (Cand){-(base + value_at(src, c.d - 1, c.r + 1)), c.d, c.parent, c.r + 1});
        }
        if (c.d < L) /* the first child */
            push(heap, &size, (Cand){-(s + value_at(src, c.d, 0)), c.d + 1, v, 0});
    }

    Py_ssize_t n = sel + 1;
    if (need > 0 && n != need) return n;
    int32_t bound = 0;
    int32_t offset = 1; /* the root takes index 0 */
    for (Py_ssize_t d = 1; d <= L; d++) {
        int32_t c = count[d];
        count[d] = offset;
        offset += c;
        if (c) bound = (int32_t)d;
    }
    int64_t *tok = out->tok, *par = out->par, *dep = out->dep;
    float *score = out->score;
    for (int32_t v = 0; v < sel; v++) flat[v] = count[depth_of[v]] + rank[v];
    tok[0] = root, par[0] = -1, dep[0] = 0, score[0] = 0.0f;
    for (int32_t v = 0; v < sel; v++) {
        int32_t i = flat[v], d = depth_of[v];
        tok[i] = src->toks[(size_t)(d - 1) * k + child_rank[v]];
        par[i] = parent_of[v] >= 0 ? flat[parent_of[v]] : 0;
        dep[i] = d;
        score[i] = score_of[v] + 0.0f; /* a zero as +0.0 (minus a cost of +0.0, as the torch build has it) */
    }
    if (out->first) {
        int64_t *first = out->first, *next = out->next;
        for (Py_ssize_t i = 0; i < n; i++) first[i] = next[i] = -1;
        for (Py_ssize_t i = n - 1; i >= 1; i--) { /* backwards: children in flat order */
            next[i] = first[par[i]];
            first[par[i]] = i;
        }
    }
    /* parents precede children: row i is i, then its parent's row (the root's: zeros, so the root repeats) */
    Py_ssize_t wd = out->width > 0 ? out->width : bound + 1;
    int64_t *aidx = out->aidx;
    unsigned char *anc = out->anc;
    memset(anc, 0, (size_t)n * n);
    memset(aidx, 0, sizeof(int64_t) * wd);
    anc[0] = 1;
    for (Py_ssize_t i = 1; i < n; i++) {
        int64_t *row = aidx + i * wd;
        const int64_t *up = aidx + par[i] * wd;
        row[0] = i;
        memcpy(row + 1, up, sizeof(int64_t) * (wd - 1));
        for (Py_ssize_t h = 0; h <= dep[i]; h++) anc[i * n + row[h]] = 1;
    }
    *bound_out = bound;
    return n;
}

/* The buffer of `obj` as an array of `kind` ('f' float32, 'q' int64, '?' bool), C-contiguous, of `ndim` dimensions
   and the given shape (-1: any, read back into shape); 0 with a TypeError / ValueError naming the function `fn` and
   the argument. */
static int get_array(const char *fn, PyObject *obj, Py_buffer *view, const char *name, char kind, int ndim,
                     Py_ssize_t *shape, int writable) {
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_RECORDS : PyBUF_RECORDS_RO) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: '%s' must be a%s NumPy array (a buffer), got %.80s", fn, name,
                     writable ? " writable" : "", Py_TYPE(obj)->tp_name);
        return 0;
    }
    const char *f = view->format ? view->format : "B";
    const uint16_t probe = 1;
    int little = *(const unsigned char *)&probe == 1;
    if (*f == '@' || *f == '=' || (little && *f == '<') || (!little && (*f == '>' || *f == '!'))) f++;
    Py_ssize_t itemsize = kind == 'f' ? 4 : kind == 'q' ? 8 : 1;
    int same = f[0] != '\0' && f[1] == '\0' && view->itemsize == itemsize
               && (f[0] == kind || (kind == 'q' && f[0] == 'l'));
    const char *want = kind == 'f' ? "float32" : kind == 'q' ? "int64" : "bool";
    if (!same) {
        PyErr_Format(PyExc_TypeError, "%s: '%s' must be %s, got format '%s' of %zd bytes", fn, name, want,
                     view->format ? view->format : "B", view->itemsize);
        goto fail;
    }
    if (view->ndim != ndim) {
        PyErr_Format(PyExc_ValueError, "%s: '%s' must have %d dimension(s), has %d", fn, name, ndim, view->ndim);
        goto fail;
    }
    for (int i = 0; i < ndim; i++) {
        if (shape[i] >= 0 && view->shape[i] != shape[i]) {
            PyErr_Format(PyExc_ValueError, "%s: '%s' must have %zd entries along dimension %d, has %zd", fn, name,
                         shape[i], i, view->shape[i]);
            goto fail;
        }
        shape[i] = view->shape[i];
    }
    if (!PyBuffer_IsContiguous(view, 'C')) {
        PyErr_Format(PyExc_ValueError, "%s: '%s' must be C-contiguous", fn, name);
        goto fail;
    }
    return 1;
fail:
    PyBuffer_Release(view);
    return 0;
}

/* L and V of a logprobs block, and a budget, in range; 0 with a ValueError. */
static int check_sizes(const char *fn, Py_ssize_t L, Py_ssize_t V, Py_ssize_t budget) {
    if (L < 1 || L > MAX_L || V < 1 || V > INT32_MAX) { /* int32 token indices */
        PyErr_Format(PyExc_ValueError, "%s: 'logprobs' must be [L, V] with 1 <= L <= %d and 1 <= V <= %d, "
                     "is [%zd, %zd]", fn, MAX_L, INT32_MAX, L, V);
        return 0;
    }
    if (budget < 1 || budget > MAX_BUDGET) {
        PyErr_Format(PyExc_ValueError, "%s: budget must be in [1, %d], is %zd", fn, MAX_BUDGET, budget);
        return 0;
    }
    return 1;
}

static PyObject *best_first(PyObject *self, PyObject *args) {
    static const char *fn = "best_first";
    PyObject *ol, *oi, *os, *oa, *om;
    Py_ssize_t budget;
    long long root;
    if (!PyArg_ParseTuple(args, "OnLOOOO", &ol, &budget, &root, &oi, &os, &oa, &om)) return NULL;
    Py_buffer bl, bi, bs, ba, bm;
    Py_buffer *got[5] = {NULL, NULL, NULL, NULL, NULL};
    PyObject *result = NULL;
    Work work = {0};
    Py_ssize_t ls[2] = {-1, -1};
    if (!get_array(fn, ol, &bl, "logprobs", 'f', 2, ls, 0)) goto done;
    got[0] = &bl;
    Py_ssize_t L = ls[0], V = ls[1];
    if (!check_sizes(fn, L, V, budget)) goto done;
    Py_ssize_t cap = budget + 1;
    Py_ssize_t si[2] = {5, cap}, ss[1] = {cap}, sa[1] = {cap * (L + 1)}, sm[1] = {cap * cap}; /* <= 2**45, 2**48 */
    if (!get_array(fn, oi, &bi, "ints", 'q', 2, si, 1)) goto done;
    got[1] = &bi;
    if (!get_array(fn, os, &bs, "scores", 'f', 1, ss, 1)) goto done;
    got[2] = &bs;
    if (!get_array(fn, oa, &ba, "aidx", 'q', 1, sa, 1)) goto done;
    got[3] = &ba;
    if (!get_array(fn, om, &bm, "anc", '?', 1, sm, 1)) goto done;
    got[4] = &bm;

    if (!work_alloc(&work, L, V, budget)) goto done;
    rows_start(&work.rows, (const float *)bl.buf, L);
    int64_t *ints = (int64_t *)bi.buf;
    Out out = {ints, ints + cap, ints + 2 * cap, ints + 3 * cap, ints + 4 * cap, (float *)bs.buf, (int64_t *)ba.buf,
               0, (unsigned char *)bm.buf};
    int32_t bound;
    Py_ssize_t n = build(&work, L, budget, root, &out, &bound, 0);
    result = Py_BuildValue("nn", n, (Py_ssize_t)bound);
done:
    work_free(&work);
    for (int i = 0; i < 5; i++)
        if (got[i]) PyBuffer_Release(got[i]);
    return result;
}

/* batch_best_first(logprobs, budget, roots, tokens, parents, depths, scores, aidx, anc) -> None

   best_first's tree of every stream of a batch (ddtree.engine.batch_tree's batched round on a CPU), in one call:
   row i is the tree of logprobs[i] with root token roots[i], laid out as ddtree.engine.kernels.tree's
   `ddtree::batch_tree_build` lays it out (no child lists, no padding: every row has exactly n nodes).

   logprobs float32 [N, L, V], C-contiguous; read only
   roots    int64   [N]; read only
   tokens, parents, depths int64 [N, n] out (a root's parent -1); scores float32 [N, n] out
   aidx     int64   [N, n, W] out, W = min(L, n - 1) + 1: [i, a, h] = the h-th ancestor of node a of row i (the root,
            index 0, repeats past it)
   anc      bool    [N, n, n] out: [i, a, b] = b is a or an ancestor of a
   n (from tokens' shape) must be 1 + ddtree.engine.tree.tree_size(budget, L, V), the nodes every row has; a row of
   fewer (or more) raises ValueError naming it. Wrong types, dtypes, shapes or layouts raise TypeError / ValueError
   naming the argument. */
static PyObject *batch_best_first(PyObject *self, PyObject *args) {
    static const char *fn = "batch_best_first";
    PyObject *ol, *or_, *ot, *op, *od, *os, *oa, *om;
    Py_ssize_t budget;
    if (!PyArg_ParseTuple(args, "OnOOOOOOO", &ol, &budget, &or_, &ot, &op, &od, &os, &oa, &om)) return NULL;
    Py_buffer views[8];
    Py_buffer *got[8] = {NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    PyObject *result = NULL;
    Work work = {0};
    Py_ssize_t ls[3] = {-1, -1, -1};
    if (!get_array(fn, ol, &views[0], "logprobs", 'f', 3, ls, 0)) goto done;
    got[0] = &views[0];
    Py_ssize_t N = ls[0], L = ls[1], V = ls[2];
    if (!check_sizes(fn, L, V, budget)) goto done;
    Py_ssize_t sr[1] = {N}, st[2] = {N, -1};
    if (!get_array(fn, or_, &views[1], "roots", 'q', 1, sr, 0)) goto done;
    got[1] = &views[1];
    if (!get_array(fn, ot, &views[2], "tokens", 'q', 2, st, 1)) goto done;
    got[2] = &views[2];
    Py_ssize_t n = st[1];
    if (n < 1 || n > budget + 1) {
        PyErr_Format(PyExc_ValueError, "%s: 'tokens' must have 1 + tree_size(budget, L, V) <= budget + 1 = %zd "
                     "columns, has %zd", fn, budget + 1, n);
        goto done;
    }
    Py_ssize_t W = (L < n - 1 ? L : n - 1) + 1;
    Py_ssize_t sp[2] = {N, n}, sd[2] = {N, n}, ss[2] = {N, n}, sa[3] = {N, n, W}, sm[3] = {N, n, n};
    if (!get_array(fn, op, &views[3], "parents", 'q', 2, sp, 1)) goto done;
    got[3] = &views[3];
    if (!get_array(fn, od, &views[4], "depths", 'q', 2, sd, 1)) goto done;
    got[4] = &views[4];
    if (!get_array(fn, os, &views[5], "scores", 'f', 2, ss, 1)) goto done;
    got[5] = &views[5];
    if (!get_array(fn, oa, &views[6], "aidx", 'q', 3, sa, 1)) goto done;
    got[6] = &views[6];
    if (!get_array(fn, om, &views[7], "anc", '?', 3, sm, 1)) goto done;
    got[7] = &views[7];

    if (!work_alloc(&work, L, V, budget)) goto done;
    const float *logp = (const float *)views[0].buf;
    const int64_t *roots = (const int64_t *)views[1].buf;
    for (Py_ssize_t i = 0; i < N; i++) {
        size_t at = (size_t)i * n;
        Out out = {(int64_t *)views[2].buf + at, (int64_t *)views[3].buf + at, (int64_t *)views[4].buf + at, NULL,
                   NULL, (float *)views[5].buf + at, (int64_t *)views[6].buf + at * W, W,
                   (unsigned char *)views[7].buf + at * n};
        int32_t bound;
        rows_start(&work.rows, logp + (size_t)i * L * V, L);
        Py_ssize_t got_n = build(&work, L, budget, roots[i], &out, &bound, n);
        if (got_n != n) {
            PyErr_Format(PyExc_ValueError, "%s: row %zd's tree has %zd nodes, the outputs %zd (n must be "
                         "1 + tree_size(budget, L, V))", fn, i, got_n, n);
            goto done;
        }
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    work_free(&work);
    for (int i = 0; i < 8; i++)
        if (got[i]) PyBuffer_Release(got[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"best_first", best_first, METH_VARARGS,
     "best_first(logprobs, budget, root, ints, scores, aidx, anc) -> (n, bound): the best-first draft tree, its ancestry "
     "and child lists (see the source)."},
    {"batch_best_first", batch_best_first, METH_VARARGS,
     "batch_best_first(logprobs, budget, roots, tokens, parents, depths, scores, aidx, anc) -> None: every stream's "
     "best-first draft tree and its ancestry, in the batched layout (see the source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hosttree", "ddtree's host tree build in C.", -1, methods};

PyMODINIT_FUNC PyInit__hosttree(void) { return PyModule_Create(&module); }
