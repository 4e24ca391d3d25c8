// Tiled attention compiled (chapters 15 and 16): the forward of eqs. 14.1-14.2 and the
// backward of eqs. 16.1-16.5, each tile kept in one core's cache from its first matmul to its
// last. The matmuls call the BLAS that torch links (sgemm_/dgemm_, passed in by
// attnlib/native.py) or, where there is none, the plain loops of `gemm`. Scores are in base 2
// (log2 e folded into the queries). attnlib/tiled.py checks every shape and dtype first.
//
// The arrays, all contiguous: q [B, Hq, T, D] (scaled to base 2), k [B, Hkv, S, D],
// v [B, Hkv, S, Dv], positions [B, T] and [B, S], states [B, nq, nk] of eq. 7.1 (0: it hides
// the whole tile, 2: none of it, 1: some), and `allowed` (nullable) read through strides [4]
// of [B, Hq, T, S], 0 on a broadcast axis. sizes = {B, Hq, Hkv, T, S, D, Dv}.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

template <typename F>  // Fortran BLAS ?gemm_, column-major
using Blas = void (*)(const char*, const char*, const int*, const int*, const int*, const F*,
                      const F*, const int*, const F*, const int*, const F*, F*, const int*);

// Row-major C [rows, cols] = beta C + op(A) op(B), op(A) [rows, inner], op(B) [inner, cols];
// op(X) is X^T where the flag says so.
template <typename F>
static void gemm(Blas<F> blas, bool at, bool bt, int rows, int cols, int inner, const F* a,
                 int lda, const F* b, int ldb, F beta, F* c, int ldc) {
    if (blas) {  // row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T
        const F one = 1;
        blas(bt ? "T" : "N", at ? "T" : "N", &cols, &rows, &inner, &one, b, &ldb, a, &lda,
             &beta, c, &ldc);
        return;
    }
    for (int r = 0; r < rows; ++r) {
        F* out = c + int64_t(r) * ldc;
        for (int j = 0; j < cols; ++j) out[j] = beta == 0 ? F(0) : beta * out[j];
        for (int x = 0; x < inner; ++x) {
            const F left = at ? a[int64_t(x) * lda + r] : a[int64_t(r) * lda + x];
            for (int j = 0; j < cols; ++j)
                out[j] += left * (bt ? b[int64_t(j) * ldb + x] : b[int64_t(x) * ldb + j]);
        }
    }
}

// Eq. 14.1 for one row of scores s [width], in one visit: m' = max(m, max_j s_j), the scores
// replaced by 2^(s_j - m') (0 for -inf), l' = l 2^(m - m') + sum_j 2^(s_j - m'). Returns the
// rescale factor 2^(m - m').
template <typename F>
static inline F row_step(F* s, int64_t width, F& m, F& l) {
    F top = m;
    for (int64_t j = 0; j < width; ++j) top = s[j] > top ? s[j] : top;
    F sum = 0;
    for (int64_t j = 0; j < width; ++j) {
        s[j] = std::exp2(s[j] - top);
        sum += s[j];
    }
    const F factor = std::exp2(m - top);
    l = l * factor + sum;
    m = top;
    return factor;
}

// One tile's softmax steps alone (chapter 15 times them against torch's four passes):
// scores [rows, width] in place, m and l [rows] updated, rescale [rows] written.
template <typename F>
static void tile_pass(F* scores, F* m, F* l, F* rescale, int64_t rows, int64_t width,
                      int64_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) rescale[r] = row_step(scores + r * width, width, m[r], l[r]);
}

struct Layout {  // the sizes, the blocks and `allowed`'s strides
    int64_t batch, q_heads, kv_heads, T, S, D, Dv, block, nq, nk, group;
    const uint8_t* allowed;
    const int64_t* stride;
    int64_t masks_b, masks_h;  // `allowed`'s own batch rows and heads (1 where it broadcasts)
    Layout(const int64_t* sizes, int64_t block, const uint8_t* allowed, const int64_t* stride)
        : batch(sizes[0]), q_heads(sizes[1]), kv_heads(sizes[2]), T(sizes[3]), S(sizes[4]),
          D(sizes[5]), Dv(sizes[6]), block(block), nq((T + block - 1) / block),
          nk((S + block - 1) / block), group(q_heads / kv_heads), allowed(allowed),
          stride(stride), masks_b(stride[0] ? batch : 1), masks_h(stride[1] ? q_heads : 1) {}
    const uint8_t* cell(int64_t b, int64_t h, int64_t i, int64_t j) const {  // allowed[b,h,i,j]
        return allowed + b * stride[0] + h * stride[1] + i * stride[2] + j * stride[3];
    }
    int64_t mask_index(int64_t b, int64_t h, int64_t qi, int64_t kj) const {
        return (((stride[0] ? b : 0) * masks_h + (stride[1] ? h : 0)) * nq + qi) * nk + kj;
    }
};

// What `allowed` hides of each of its own tiles that eq. 7.1 leaves to some batch row: 0 all,
// 2 none, 1 some; a vectorised sweep per row. Shares the work of the enclosing parallel region.
static void classify_tiles(const Layout& x, const int8_t* states, std::vector<int8_t>& masks) {
#pragma omp for schedule(dynamic, 16)
    for (int64_t tile = 0; tile < x.masks_b * x.masks_h * x.nq * x.nk; ++tile) {
        const int64_t kj = tile % x.nk, qi = tile / x.nk % x.nq, bh = tile / (x.nq * x.nk);
        const int64_t b = bh / x.masks_h, h = bh % x.masks_h;
        bool needed = false;
        for (int64_t c = x.stride[0] ? b : 0; c < (x.stride[0] ? b + 1 : x.batch); ++c)
            needed |= states[(c * x.nq + qi) * x.nk + kj] != 0;
        if (!needed) continue;
        const int64_t t = std::min(x.block, x.T - qi * x.block);
        const int64_t s = std::min(x.block, x.S - kj * x.block), across = x.stride[3];
        uint8_t some = 0, every = 1;
        for (int64_t r = 0; r < t && (every || !some); ++r) {
            const uint8_t* row = x.cell(b, h, qi * x.block + r, kj * x.block);
            if (across == 1)
                for (int64_t j = 0; j < s; ++j) some |= row[j], every &= row[j];
            else
                for (int64_t j = 0; j < s; ++j) some |= row[j * across], every &= row[j * across];
        }
        masks[tile] = !some ? 0 : every ? 2 : 1;
    }  // the implied barrier: every tile is classified before anyone reads `masks`
}

// Row r of the tile (b, h, i0, j0) of scores [s] with its hidden keys set to -inf (eq. 5.1):
// by eq. 7.1 where `causal` is 1, by `allowed` where `masked` is 1.
template <typename F>
static inline void hide(const Layout& x, F* row, int64_t s, int8_t causal, int8_t masked,
                        const int64_t* key_pos, int64_t position, int64_t b, int64_t h,
                        int64_t i, int64_t j0) {
    const F inf = std::numeric_limits<F>::infinity();
    if (causal == 1)
        for (int64_t j = 0; j < s; ++j) row[j] = key_pos[j] > position ? -inf : row[j];
    if (masked == 1) {
        const uint8_t* shown = x.cell(b, h, i, j0);
        if (x.stride[3] == 1)
            for (int64_t j = 0; j < s; ++j) row[j] = shown[j] ? row[j] : -inf;
        else
            for (int64_t j = 0; j < s; ++j) row[j] = shown[j * x.stride[3]] ? row[j] : -inf;
    }
}

// The forward: per query head and block of queries, over its key blocks, S = Q K^T (3.3),
// hidden keys to -inf, eq. 14.1 in one visit of each row, o <- o 2^(m - m') + P V (14.2).
// m starts at the lowest finite float, so a row that sees no key gets output 0, never NaN.
// Writes out [B, Hq, T, Dv] and, if lse is not null, lse [B, Hq, T] (natural log, +inf for a
// row that sees no key).
template <typename F>
static void forward(const F* q, const F* k, const F* v, const int64_t* query_positions,
                    const int64_t* key_positions, const uint8_t* allowed, const int64_t* stride,
                    const int8_t* states, F* out, F* lse, const int64_t* sizes, int64_t block,
                    int64_t threads, Blas<F> blas) {
    const Layout x(sizes, block, allowed, stride);
    const int64_t items = x.batch * x.q_heads * x.nq, D = x.D, Dv = x.Dv, T = x.T, S = x.S;
    const F lowest = std::numeric_limits<F>::lowest(), inf = std::numeric_limits<F>::infinity();
    std::vector<int8_t> masks(allowed ? x.masks_b * x.masks_h * x.nq * x.nk : 0, 2);
#pragma omp parallel num_threads(threads)
    {
        if (allowed) classify_tiles(x, states, masks);
        const int64_t rows = std::min(block, T), cols = std::min(block, S);  // a tile at most
        std::vector<F> scores(rows * cols), o(rows * Dv), m(rows), l(rows);
        // Dynamic: a core that another process slows takes fewer items, not an equal share.
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
            const int64_t bh = item / x.nq, qi = x.nq - 1 - item % x.nq;  // longest rows first
            const int64_t b = bh / x.q_heads, h = bh % x.q_heads, kv = h / x.group;  // eq. 9.1
            const int64_t i0 = qi * block, t = std::min(block, T - i0);
            const F* q_block = q + (bh * T + i0) * D;
            const F* keys = k + (b * x.kv_heads + kv) * S * D;
            const F* values = v + (b * x.kv_heads + kv) * S * Dv;
            std::fill(o.begin(), o.begin() + t * Dv, F(0));
            std::fill(m.begin(), m.begin() + t, lowest);
            std::fill(l.begin(), l.begin() + t, F(0));
            for (int64_t kj = 0; kj < x.nk; ++kj) {
                const int8_t causal = states[(b * x.nq + qi) * x.nk + kj];
                const int8_t masked = allowed ? masks[x.mask_index(b, h, qi, kj)] : 2;
                if (causal == 0 || masked == 0) continue;
                const int64_t j0 = kj * block, s = std::min(block, S - j0);
                gemm<F>(blas, false, true, t, s, D, q_block, D, keys + j0 * D, D, F(0),
                        scores.data(), s);
                for (int64_t r = 0; r < t; ++r) {
                    F* row = scores.data() + r * s;
                    hide(x, row, s, causal, masked, key_positions + b * S + j0,
                         query_positions[b * T + i0 + r], b, h, i0 + r, j0);
                    const F factor = row_step(row, s, m[r], l[r]);
                    if (factor != F(1))
                        for (int64_t d = 0; d < Dv; ++d) o[r * Dv + d] *= factor;
                }
                gemm<F>(blas, false, false, t, Dv, s, scores.data(), s, values + j0 * Dv, Dv,
                        F(1), o.data(), Dv);
            }
            for (int64_t r = 0; r < t; ++r) {  // o / l; L = (m + log2 l) ln 2 (eq. 16.5)
                const F inverse = l[r] > 0 ? F(1) / l[r] : F(0);
                F* row = out + (bh * T + i0 + r) * Dv;
                for (int64_t d = 0; d < Dv; ++d) row[d] = o[r * Dv + d] * inverse;
                if (lse)
                    lse[bh * T + i0 + r] = l[r] > 0 ? (m[r] + std::log2(l[r])) * F(M_LN2) : inf;
            }
        }
    }
}

// The backward: per KV head, over its key blocks, the query heads of its group and their
// query blocks, P = 2^(S - L) from the saved L (16.5, in base 2, +inf for a row that saw no
// key), dV += P^T dO (16.1), dS = P o (dO V^T - delta) (16.2-16.3), dK += dS^T Q and
// dQ += dS K (16.4). A worker owns all of one KV head's dK, dV and its group's dQ, so every
// sum is made in one fixed order: the same gradients on every run, whichever thread runs
// what. dq and dk come out in the scores' scale (attnlib/tiled.py multiplies them back).
template <typename F>
static void backward(const F* q, const F* k, const F* v, const F* grad, const F* lse,
                     const F* delta, const int64_t* query_positions,
                     const int64_t* key_positions, const uint8_t* allowed, const int64_t* stride,
                     const int8_t* states, F* dq, F* dk, F* dv, const int64_t* sizes,
                     int64_t block, int64_t threads, Blas<F> blas) {
    const Layout x(sizes, block, allowed, stride);
    const int64_t D = x.D, Dv = x.Dv, T = x.T, S = x.S;
    std::vector<int8_t> masks(allowed ? x.masks_b * x.masks_h * x.nq * x.nk : 0, 2);
#pragma omp parallel num_threads(threads)
    {
        if (allowed) classify_tiles(x, states, masks);
        const int64_t cells = std::min(block, T) * std::min(block, S);  // a tile at most
        std::vector<F> p(cells), ds(cells);
#pragma omp for schedule(dynamic, 1)
        for (int64_t bkv = 0; bkv < x.batch * x.kv_heads; ++bkv) {
            const int64_t b = bkv / x.kv_heads, kv = bkv % x.kv_heads;
            for (int64_t kj = 0; kj < x.nk; ++kj) {
                const int64_t j0 = kj * block, s = std::min(block, S - j0);
                const F* keys = k + (bkv * S + j0) * D;
                const F* values = v + (bkv * S + j0) * Dv;
                F* dk_block = dk + (bkv * S + j0) * D;
                F* dv_block = dv + (bkv * S + j0) * Dv;
                for (int64_t h = kv * x.group; h < (kv + 1) * x.group; ++h) {  // eq. 9.1
                    const int64_t bh = b * x.q_heads + h;
                    for (int64_t qi = 0; qi < x.nq; ++qi) {
                        const int8_t causal = states[(b * x.nq + qi) * x.nk + kj];
                        const int8_t masked = allowed ? masks[x.mask_index(b, h, qi, kj)] : 2;
                        if (causal == 0 || masked == 0) continue;
                        const int64_t i0 = qi * block, t = std::min(block, T - i0);
                        const F* q_block = q + (bh * T + i0) * D;
                        const F* do_block = grad + (bh * T + i0) * Dv;
                        gemm<F>(blas, false, true, t, s, D, q_block, D, keys, D, F(0), p.data(),
                                s);  // S = Q K^T
                        gemm<F>(blas, false, true, t, s, Dv, do_block, Dv, values, Dv, F(0),
                                ds.data(), s);  // dP = dO V^T
                        for (int64_t r = 0; r < t; ++r) {
                            F* row = p.data() + r * s;
                            F* d_row = ds.data() + r * s;
                            hide(x, row, s, causal, masked, key_positions + b * S + j0,
                                 query_positions[b * T + i0 + r], b, h, i0 + r, j0);
                            const F row_lse = lse[bh * T + i0 + r];
                            const F row_delta = delta[bh * T + i0 + r];
                            for (int64_t j = 0; j < s; ++j) {
                                row[j] = std::exp2(row[j] - row_lse);  // eq. 16.5
                                d_row[j] = row[j] * (d_row[j] - row_delta);  // eq. 16.3
                            }
                        }
                        gemm<F>(blas, true, false, s, Dv, t, p.data(), s, do_block, Dv, F(1),
                                dv_block, Dv);  // eq. 16.1
                        gemm<F>(blas, true, false, s, D, t, ds.data(), s, q_block, D, F(1),
                                dk_block, D);  // eq. 16.4
                        gemm<F>(blas, false, false, t, D, s, ds.data(), s, keys, D, F(1),
                                dq + (bh * T + i0) * D, D);  // eq. 16.4
                    }
                }
            }
        }
    }
}

#define EXPORT(F, NAME)                                                                       \
    extern "C" void tile_pass_##NAME(F* scores, F* m, F* l, F* rescale, int64_t rows,        \
                                     int64_t width, int64_t threads) {                       \
        tile_pass(scores, m, l, rescale, rows, width, threads);                               \
    }                                                                                         \
    extern "C" void tiled_forward_##NAME(                                                    \
        const F* q, const F* k, const F* v, const int64_t* query_positions,                   \
        const int64_t* key_positions, const uint8_t* allowed, const int64_t* stride,          \
        const int8_t* states, F* out, F* lse, const int64_t* sizes, int64_t block,            \
        int64_t threads, void* blas) {                                                        \
        forward<F>(q, k, v, query_positions, key_positions, allowed, stride, states, out, lse, \
                   sizes, block, threads, reinterpret_cast<Blas<F>>(blas));                   \
    }                                                                                         \
    extern "C" void tiled_backward_##NAME(                                                   \
        const F* q, const F* k, const F* v, const F* grad, const F* lse, const F* delta,      \
        const int64_t* query_positions, const int64_t* key_positions, const uint8_t* allowed, \
        const int64_t* stride, const int8_t* states, F* dq, F* dk, F* dv,                     \
        const int64_t* sizes, int64_t block, int64_t threads, void* blas) {                   \
        backward<F>(q, k, v, grad, lse, delta, query_positions, key_positions, allowed,       \
                    stride, states, dq, dk, dv, sizes, block, threads,                        \
                    reinterpret_cast<Blas<F>>(blas));                                         \
    }
EXPORT(float, f32)
EXPORT(double, f64)
