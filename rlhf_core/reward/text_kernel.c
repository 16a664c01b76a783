/* The text components' fused CPU kernel (rlhf_core/reward/kernel.py builds and loads it).

   Each function computes, for a whole batch in one call, exactly what its tensor counterpart in
   rlhf_core/reward/text.py computes (the same windows, limits and byte classes; tests/test_reward_kernel.py
   holds the two equal on fuzzed batches), reading the same tensors in place: no copy, no decode. The tensor
   code is the reference and the path on every other device; here one loop per row replaces its few hundred
   small tensor ops, whose dispatch cost dominates on CPU.

   Conventions (as in text.py): `index` int32 [N, L] token id + 1 (0: byte-less), `codes` uint8 [N, Lp] the
   per-token bits of `scan` (Lp = L rounded up to a block), `n_valid` int64 [N] the first stop of each row.
   Vocabulary tables are indexed by id + 1; automaton tables by (id + 1) * m + state. A text is read as its
   tokens' bytes concatenated (`text_of`, the tensor code's tokens_to_bytes). */

#include <stdint.h>
#include <string.h>

enum {
    NOT_SKIP = 1, NOT_BODY = 2, NOT_SPACE = 4, C_DIGIT = 8, C_COMMA = 16, C_DOT = 32, C_MINUS = 64, C_ALNUM = 128
};
enum { CAN_END = 1, STOP = 2, FORMAT0 = 4 };
#define CHUNK 18
#define MAX_W 4096 /* widest byte window handled (text.py's windows are at most about 100 bytes) */

static uint8_t CLS[256];
static int64_t POW10[CHUNK];

/* The byte classes (text.py's _CLASSES, passed once so that both use one table). */
void atr_init(const int64_t *classes) {
    for (int b = 0; b < 256; b++) CLS[b] = (uint8_t)classes[b];
    int64_t p = 1;
    for (int e = 0; e < CHUNK; e++, p *= 10) POW10[e] = p;
}

typedef struct {
    const uint8_t *flat;     /* all tokens' bytes */
    const int32_t *offsets1; /* [V + 1] by id + 1: start in flat */
    const int32_t *lengths1; /* [V + 1] by id + 1: byte count */
} Vocab;

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* The bytes of the tokens at positions start .. start + count - 1 of a row (those outside [0, hi) are
   byte-less), with the first `skip` bytes dropped, into out[0 .. cap] (cap + 1 bytes, 0 past the length).
   Returns the length: clamp(bytes - skip, 0, cap). */
static int64_t text_of(const Vocab *v, const int32_t *row, int64_t start, int64_t count, int64_t hi, int64_t skip,
                       int64_t cap, uint8_t *out) {
    memset(out, 0, (size_t)(cap + 1));
    int64_t at = -skip; /* output position of the next byte */
    for (int64_t q = start; q < start + count && at < cap; q++) {
        if (q < 0 || q >= hi) continue;
        int32_t t = row[q];
        int64_t n = v->lengths1[t];
        const uint8_t *b = v->flat + v->offsets1[t];
        for (int64_t i = 0; i < n; i++, at++) {
            if (at >= cap) break;
            if (at >= 0) out[at] = b[i];
        }
    }
    return max64(0, min64(at, cap));
}

/* text.py's _numbers at the start of x[0 .. W) (the last byte 0): canonical chunks into canon[0 .. C2),
   C2 = 2 * ceil(W / 18); returns is_number, writes rest (index past the number's run). */
static int number_at(const uint8_t *x, int64_t W, int64_t *canon, int64_t C2, int64_t *rest_out) {
    int64_t j0 = 0;
    while (j0 < W && !(CLS[x[j0]] & NOT_SKIP)) j0++;
    if (j0 >= W) j0 = 0;
    int neg = (CLS[x[j0]] & C_MINUS) ? 1 : 0;
    int64_t j1 = j0 + neg, rest = j1;
    while (rest < W && !(CLS[x[rest]] & NOT_BODY)) rest++;
    if (rest >= W) rest = 0;
    *rest_out = rest;
    int64_t end = 0, dot = W, n_int = 0;
    for (int64_t p = 0; p < rest; p++)
        if (CLS[x[p]] & C_DIGIT) end = p + 1;
    int bad = 0; /* a separator after the first '.' */
    for (int64_t p = j1; p < end; p++) {
        uint8_t c = CLS[x[p]];
        if (dot < W && (c & (C_DOT | C_COMMA))) bad = 1;
        if (dot == W && (c & C_DOT)) dot = p;
    }
    int is_number = j1 < W && (CLS[x[j1]] & C_DIGIT) && !bad;
    memset(canon, 0, (size_t)C2 * sizeof(int64_t));
    if (!is_number) return 0;
    for (int64_t p = 0; p < rest && p < dot; p++) n_int += (CLS[x[p]] & C_DIGIT) ? 1 : 0;
    int64_t seen = 0, sign = neg ? -1 : 1;
    for (int64_t p = 0; p < rest; p++) {
        if (!(CLS[x[p]] & C_DIGIT)) continue;
        seen++;
        int64_t r = seen - n_int, frac = r > 0, q = frac ? r - 1 : -r;
        int64_t col = min64((q / CHUNK) * 2 + frac, C2 - 1);
        canon[col] += sign * (int64_t)(x[p] - '0') * POW10[q % CHUNK];
    }
    return 1;
}

typedef struct {
    int64_t K, Wa, Ca2;  /* alternatives, width of lit, columns of canon */
    const int64_t *lit;  /* [N, K, Wa] bytes */
    const int64_t *len;  /* [N, K] */
    const int64_t *canon; /* [N, K, Ca2] */
    const uint8_t *is_num; /* [N, K] bool */
    int any_num, any_text; /* 0: none in the batch (known on the host), 1: some or unknown */
} Answers;

/* text.py's _matches_answer for one row: x[0 .. W) (last byte 0) of length n; cut -1: not given. */
static int matches(const uint8_t *x, int64_t W, int64_t n, const Answers *a, int64_t r, int whole, int cut) {
    int hit = 0;
    const int64_t *lens = a->len + r * a->K;
    const uint8_t *is_num = a->is_num + r * a->K;
    if (a->any_num) {
        int64_t C2 = 2 * ((W + CHUNK - 1) / CHUNK), rest;
        int64_t canon[2 * ((MAX_W + 2 + CHUNK - 1) / CHUNK)];
        if (number_at(x, W, canon, C2, &rest)) {
            int tail = 0;
            if (whole)
                for (int64_t p = rest; p < n && p < W; p++) tail |= (CLS[x[p]] & NOT_SPACE) != 0;
            for (int64_t k = 0; k < a->K && !tail && !hit; k++) {
                if (!is_num[k]) continue;
                const int64_t *ac = a->canon + (r * a->K + k) * a->Ca2;
                int same = 1;
                for (int64_t c = 0; c < max64(C2, a->Ca2) && same; c++)
                    same = (c < C2 ? canon[c] : 0) == (c < a->Ca2 ? ac[c] : 0);
                hit = same;
            }
            if (hit && cut == 1 && !(rest < n)) hit = 0;
        }
    }
    if (hit || !a->any_text) return hit;
    int64_t lead = 0;
    while (lead < W && !(CLS[x[lead]] & NOT_SPACE)) lead++;
    if (lead >= W) lead = 0;
    int64_t Wa = min64(a->Wa, W), last = -1;
    if (whole)
        for (int64_t p = 0; p < n && p < W; p++)
            if (CLS[x[p]] & NOT_SPACE) last = p;
    for (int64_t k = 0; k < a->K; k++) {
        int64_t lk = lens[k];
        if (lk <= 0 || lk > Wa || is_num[k] || lk > n - lead) continue;
        const int64_t *lit = a->lit + (r * a->K + k) * a->Wa;
        int same = 1;
        for (int64_t i = 0; i < lk && same; i++) same = x[min64(lead + i, W - 1)] == (uint8_t)lit[i];
        if (!same) continue;
        if (whole) {
            if (lk != last + 1 - lead) continue;
        } else {
            if (CLS[x[min64(lead + lk, W - 1)]] & C_ALNUM) continue;
            if (cut == 1 && !(lead + lk < n)) continue;
        }
        return 1;
    }
    return 0;
}

/* text.py's scan: index (id + 1), codes (padded to Lp with 0) and the first stop of each row. ids int64
   (ids32 0) or int32 (1); an int64 id outside the int32 range wraps, as in the tensor code. */
void atr_scan(const void *ids, int ids32, int64_t N, int64_t L, int64_t Lp, const uint8_t *codes_table, int64_t V,
              int32_t *index, uint8_t *codes, int64_t *n_valid) {
    for (int64_t r = 0; r < N; r++) {
        int32_t *ix = index + r * L;
        uint8_t *cd = codes + r * Lp;
        int64_t first = L;
        for (int64_t p = 0; p < L; p++) {
            int32_t id = ids32 ? ((const int32_t *)ids)[r * L + p] : (int32_t)((const int64_t *)ids)[r * L + p];
            int32_t i1 = (id < -1 ? -1 : (id > V - 1 ? (int32_t)(V - 1) : id)) + 1;
            uint8_t c = codes_table[i1];
            ix[p] = i1;
            cd[p] = c;
            if ((c & STOP) && first == L) first = p;
        }
        memset(cd + L, 0, (size_t)(Lp - L));
        n_valid[r] = first;
    }
}

/* The automaton row of the token at p: its (id + 1) * m plus the state before it, walked from state 0 over
   the m - 1 tokens before it (those before the row byte-less); text.py's _table_rows. */
static inline int64_t table_row(const int32_t *row, int64_t p, int64_t m, const int32_t *ns32, const int64_t *ns64) {
    int64_t s = 0;
    for (int64_t t = p - (m - 1); t < p; t++) {
        int64_t at = (t >= 0 ? (int64_t)row[t] : 0) * m + s;
        s = ns32 ? ns32[at] : ns64[at];
    }
    return (int64_t)row[p] * m + s;
}

static inline int block_has(const uint8_t *cd, int64_t b, int64_t block, uint8_t bit) {
    for (int64_t j = 0; j < block; j++)
        if (cd[b * block + j] & bit) return 1;
    return 0;
}

/* text.py's TextMatcher.answer_after_marker (last_marker, then the window after it, then _matches_answer). */
void atr_answer_after_marker(const int32_t *index, const uint8_t *codes, int64_t N, int64_t L, int64_t Lp,
                             const int64_t *n_valid, int64_t m, const int32_t *next_state1,
                             const int32_t *match_end1, const uint8_t *flat, const int32_t *offsets1,
                             const int32_t *lengths1, int64_t blocks, int64_t block, int64_t width,
                             int64_t K, int64_t Wa, int64_t Ca2, const int64_t *lit, const int64_t *lit_len,
                             const int64_t *canon, const uint8_t *is_num, int any_num, int any_text, float *out) {
    Vocab v = {flat, offsets1, lengths1};
    Answers a = {K, Wa, Ca2, lit, lit_len, canon, is_num, any_num, any_text};
    uint8_t x[MAX_W + 2];
    int64_t nb = Lp / block;
    for (int64_t r = 0; r < N; r++) {
        out[r] = 0.0f;
        const int32_t *row = index + r * L;
        const uint8_t *cd = codes + r * Lp;
        int64_t nv = n_valid[r], tok = -1, offset = 0, seen = 0;
        for (int64_t b = nb - 1; b >= 0 && seen < blocks && tok < 0; b--) {
            if (!(b * block < nv) || !block_has(cd, b, block, CAN_END)) continue;
            seen++;
            for (int64_t p = min64(b * block + block, nv) - 1; p >= b * block; p--) {
                int32_t e = match_end1[table_row(row, p, m, next_state1, NULL)];
                if (e >= 0) {
                    tok = p, offset = e;
                    break;
                }
            }
        }
        if (tok < 0 || width + 2 > MAX_W) continue;
        int64_t A = min64(width + 1, L), n_tok = max64(nv - tok, 0);
        int64_t n = text_of(&v, row, tok, A, nv, offset, width + 1, x);
        int cut = n > width || n_tok > A;
        out[r] = (float)matches(x, width + 2, n, &a, r, 0, cut);
    }
}

/* text.py's TextMatcher.exact_match. */
void atr_exact_match(const int32_t *index, int64_t N, int64_t L, const int64_t *n_valid, const uint8_t *flat,
                     const int32_t *offsets1, const int32_t *lengths1, int64_t width, int64_t K, int64_t Wa,
                     int64_t Ca2, const int64_t *lit, const int64_t *lit_len, const int64_t *canon,
                     const uint8_t *is_num, int any_num, int any_text, float *out) {
    Vocab v = {flat, offsets1, lengths1};
    Answers a = {K, Wa, Ca2, lit, lit_len, canon, is_num, any_num, any_text};
    uint8_t x[MAX_W + 2];
    int64_t A = min64(width, L);
    for (int64_t r = 0; r < N; r++) {
        out[r] = 0.0f;
        int64_t nv = n_valid[r];
        if (nv > A || width + 2 > MAX_W) continue;
        int64_t n = text_of(&v, index + r * L, 0, A, min64(nv, A), 0, width + 1, x);
        if (n > width) continue;
        out[r] = (float)matches(x, width + 1, n, &a, r, 1, -1);
    }
}

/* text.py's contains_windows. first_table int32 [V + 1]; first_mask int32 [N]; Wc: the answers' word width
   (ans.words.shape[2] * 8); lead / tail: CONTAINS_LEAD_BYTES / CONTAINS_TAIL_BYTES. */
void atr_contains(const int32_t *index, int64_t N, int64_t L, const int64_t *n_valid, const int32_t *first_table,
                  const int32_t *first_mask, const uint8_t *flat, const int32_t *offsets1, const int32_t *lengths1,
                  int64_t blocks, int64_t windows, int64_t block, int64_t Wc, int64_t lead_bytes, int64_t T,
                  int64_t K, int64_t Wa, const int64_t *lit, const int64_t *lit_len, float *out) {
    Vocab v = {flat, offsets1, lengths1};
    int64_t W = 2 + lead_bytes + Wc + T + 1, A = min64(W, L + 2);
    int64_t Lp = (L + block - 1) / block * block, nb = Lp / block;
    uint8_t x[MAX_W + 2];
    int64_t cand[64];
    for (int64_t r = 0; r < N; r++) {
        out[r] = 0.0f;
        const int32_t *row = index + r * L;
        int32_t mask = first_mask[r];
        int64_t nv = n_valid[r], nc = 0, seen = 0;
        if (K == 0 || W > MAX_W || windows > 64) continue;
        /* the last `windows` candidates of the last `blocks` blocks (starting before the stop) holding one */
        for (int64_t b = nb - 1; b >= 0 && seen < blocks && nc < windows; b--) {
            if (!(b * block < nv)) continue;
            int any = 0;
            for (int64_t p = b * block; p < b * block + block && p < L && !any; p++) any = (first_table[row[p]] & mask) != 0;
            if (!any) continue;
            seen++;
            for (int64_t p = min64(b * block + block, nv) - 1; p >= b * block && nc < windows; p--)
                if (first_table[row[p]] & mask) cand[nc++] = p;
        }
        int hit = 0;
        for (int64_t ci = 0; ci < nc && !hit; ci++) {
            int64_t c = cand[ci];
            int64_t pre = (c >= 2 ? lengths1[row[c - 2]] : 0) + (c >= 1 ? lengths1[row[c - 1]] : 0);
            int64_t n = text_of(&v, row, c - 2, A, nv, max64(pre - 2, 0), W, x);
            int cut = n >= W || nv - c + 2 > A;
            int64_t s = min64(pre, 2);
            while (s <= W && !(CLS[x[s]] & NOT_SPACE)) s++;
            if (s > W) s = 0;
            int64_t starts[2] = {s, s + (x[s] == '$')};
            for (int si = 0; si < 2 && !hit; si++) {
                int64_t st = starts[si];
                uint8_t c1 = CLS[st >= 1 ? x[st - 1] : 0], c2 = CLS[st >= 2 ? x[st - 2] : 0];
                int before_ok = !(c1 & (C_ALNUM | C_MINUS)) && !((c1 & (C_DOT | C_COMMA)) && (c2 & C_DIGIT));
                if (!before_ok) continue;
                for (int64_t k = 0; k < K && !hit; k++) {
                    int64_t lk = lit_len[r * K + k];
                    if (lk <= 0 || lk > Wc) continue;
                    const int64_t *lb = lit + (r * K + k) * Wa;
                    int same = 1;
                    for (int64_t i = 0; i < lk && same; i++) same = x[min64(st + i, W)] == (uint8_t)lb[i];
                    int64_t e = st + lk;
                    if (!same || e > n || (cut && e + T > n)) continue;
                    uint8_t tail[8];
                    for (int t = 0; t < 8; t++) tail[t] = x[min64(e + t, W)];
                    uint8_t cn = CLS[tail[0]], cn2 = CLS[tail[1]];
                    int after_ok = !(cn & C_ALNUM) && !((cn & (C_DOT | C_COMMA)) && (cn2 & C_DIGIT));
                    for (int64_t j = 2; j < T && !after_ok && tail[0] == '.'; j++) {
                        int zeros = 1;
                        for (int64_t i = 1; i < j && zeros; i++) zeros = tail[i] == '0';
                        after_ok = zeros && !(CLS[tail[j]] & C_ALNUM);
                    }
                    hit = after_ok;
                }
            }
        }
        out[r] = (float)hit;
    }
}

/* One text of text.py's format_windows: p0 / e0 int64 [N] in and out (the previous text's end token and byte
   offset; first text: p0 = -big). bit: text i's CAN bit (FORMAT0 << 3 i). */
void atr_format_window(const int32_t *index, const uint8_t *codes, int64_t N, int64_t L, int64_t Lp,
                       const int64_t *n_valid, const int32_t *lengths1, const int64_t *next_state,
                       const int64_t *first_end, const int64_t *last_end, int64_t m, int64_t bit, int first,
                       int64_t blocks, int64_t block, int64_t stride, int64_t big, int64_t *p0s, int64_t *e0s) {
    int64_t nb = Lp / block;
    uint8_t can = (uint8_t)bit, whole = (uint8_t)(bit << 1), adv = (uint8_t)(bit << 2);
    const int64_t *tables[2] = {first_end, last_end};
    for (int64_t r = 0; r < N; r++) {
        const int32_t *row = index + r * L;
        const uint8_t *cd = codes + r * Lp;
        int64_t nv = n_valid[r], p0 = p0s[r], e0 = e0s[r], best = big, seen = 0;
        for (int64_t b = 0; b < nb && seen < blocks && !(!first && p0 >= big); b++) {
            if (!(b * block < nv) || (!first && b * block + block - 1 < p0)) continue;
            int any = 0;
            for (int64_t p = b * block; p < b * block + block && !any; p++) {
                int prev_adv = (p % 8 == 0) || (cd[p - 1] & adv);
                any = ((cd[p] & can) && prev_adv) || (cd[p] & whole);
            }
            if (!any) continue;
            seen++;
            for (int64_t p = b * block; p < b * block + block && p < nv; p++) {
                if (!first && p < p0) continue;
                int64_t tr = table_row(row, p, m, NULL, next_state), d = p - p0, between = -e0;
                for (int64_t j = 1; j < m; j++)
                    if (d >= j) between += p - j >= 0 ? lengths1[row[p - j]] : 0;
                for (int t = 0; t < 2; t++) {
                    int64_t e = tables[t][tr];
                    if (e >= 0 && (d >= m || e + between >= m)) best = min64(best, p * stride + e);
                }
            }
        }
        p0s[r] = best < big ? best / stride : big;
        e0s[r] = best % stride;
    }
}

/* One text of text.py's format_tokens (every token read): prev_end int64 [N] in and out (0 before the first
   text; big: not found). */
void atr_format_tokens(const int32_t *index, int64_t N, int64_t L, const int64_t *n_valid, const int32_t *lengths1,
                       const int64_t *next_state, const int64_t *first_end, const int64_t *last_end, int64_t m,
                       int64_t big, int64_t *prev_end) {
    for (int64_t r = 0; r < N; r++) {
        const int32_t *row = index + r * L;
        int64_t start = 0, best = big, prev = prev_end[r], nv = min64(n_valid[r], L);
        for (int64_t p = 0; p < nv; p++) {
            int64_t tr = table_row(row, p, m, NULL, next_state);
            int64_t e1 = first_end[tr], e2 = last_end[tr];
            if (e1 >= 0 && start + e1 - m >= prev) best = min64(best, start + e1);
            if (e2 >= 0 && start + e2 - m >= prev) best = min64(best, start + e2);
            start += lengths1[row[p]];
        }
        prev_end[r] = best;
    }
}
