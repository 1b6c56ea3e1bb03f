// im2col the Caffe way: one bounds check per pixel, sequential writes, zeros for padding;
// col2im is the += mirror. Threads split rows of col (im2col) or input channels (col2im), so
// no two threads ever write the same element.
#include "im2col.h"

#include <algorithm>
#include <iterator>
#include <memory>
#include <numeric>
#include <cstdint>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>
#ifdef __SSE2__
#include <xmmintrin.h>
#endif

#include "parallel.h"

namespace pyhet {

namespace {

// dst[0, n) = src[0, n) for the short runs of an output row (often 8 to 32 floats): inline
// vector moves; a call of memcpy per run cost more than the copy (the paper network's and the
// default network's im2col ran at a third of the speed).
inline void copy_short(float* dst, const float* src, int64_t n) {
  if (n > 64) {
    std::memcpy(dst, src, sizeof(float) * n);
    return;
  }
  int64_t k = 0;
#ifdef __SSE2__
  for (; k + 4 <= n; k += 4) _mm_storeu_ps(dst + k, _mm_loadu_ps(src + k));
#endif
  for (; k < n; ++k) dst[k] = src[k];
}

// Row r = (c, i, j) of col for images [n0, n1): for each image and output pixel (oh, ow), the
// input pixel the kernel's (i, j) tap sees there, or 0 in the padding. dst: (n1 - n0) * OH * OW.
inline void im2col_row(const float* x, int64_t C, int64_t H, int64_t W, int64_t KH, int64_t KW,
                       int64_t stride, int64_t pad, int64_t OH, int64_t OW, int64_t r,
                       int64_t n0, int64_t n1, float* dst) {
  const int64_t c = r / (KH * KW), i = (r / KW) % KH, j = r % KW;
  for (int64_t n = n0; n < n1; ++n) {
    const float* plane = x + (n * C + c) * H * W;
    for (int64_t oh = 0; oh < OH; ++oh, dst += OW) {
      const int64_t ih = oh * stride - pad + i;
      if (ih < 0 || ih >= H) {
        std::memset(dst, 0, sizeof(float) * OW);
        continue;
      }
      const float* src = plane + ih * W;
      if (stride == 1) {
        // Columns ow with 0 <= ow - pad + j < W are one contiguous run; zeros around it. Both
        // ends within [0, OW]: a tap that sees only the left padding (pad - j > OW, a kernel
        // wider than the input with its right padding) has no run, and zeros to OW, not beyond
        int64_t lo = pad - j, hi = W + pad - j;  // valid ow in [lo, hi)
        if (lo < 0) lo = 0;
        if (lo > OW) lo = OW;
        if (hi > OW) hi = OW;
        if (hi < lo) hi = lo;
        for (int64_t ow = 0; ow < lo; ++ow) dst[ow] = 0.f;
        if (hi > lo) copy_short(dst + lo, src + lo - pad + j, hi - lo);
        for (int64_t ow = hi; ow < OW; ++ow) dst[ow] = 0.f;
      } else {
        for (int64_t ow = 0; ow < OW; ++ow) {
          const int64_t iw = ow * stride - pad + j;
          dst[ow] = (iw >= 0 && iw < W) ? src[iw] : 0.f;
        }
      }
    }
  }
}

// dst[0, n) = src[0, n): a sliver's row (16 or 32 floats) in a few vector moves, not a call.
inline void copy_run(float* dst, const float* src, int64_t n) {
  if (n == 16)
    std::memcpy(dst, src, sizeof(float) * 16);
  else if (n == 32)
    std::memcpy(dst, src, sizeof(float) * 32);
  else
    std::memcpy(dst, src, sizeof(float) * n);
}

}  // namespace

void im2col(const float* x, int64_t N, int64_t C, int64_t H, int64_t W, int64_t KH, int64_t KW,
            int64_t stride, int64_t pad, float* col, int threads, int64_t r_begin,
            int64_t r_end) {
  const int64_t OH = conv_out_size(H, KH, stride, pad), OW = conv_out_size(W, KW, stride, pad);
  const int64_t NP = N * OH * OW;
#pragma omp parallel for schedule(static) num_threads(clamp_threads(threads))
  for (int64_t r = r_begin; r < r_end; ++r)
    im2col_row(x, C, H, W, KH, KW, stride, pad, OH, OW, r, 0, N, col + r * NP);
}

namespace {

// Writes NR rows of col for the columns of one image (in a buffer, NR x P floats) into a PackedB
// of op(B) = col: in runs of a sliver's width, so that its rows are written one after another.
// Row r of col starts at row_at[r] (PackedB::block, without a division in the loops), then
// every `sliver` floats a sliver of NR columns. One geometry serves every pack of its size.
struct ColWriter {
  int64_t nr = 0, NP = 0, sliver = 0;
  std::vector<int64_t> row_at;

  ColWriter() = default;
  ColWriter(const PackedB& p, int64_t R) : nr(p.nr()), NP(p.N()), sliver(p.kc_step() * p.nr()) {
    row_at.resize(R);
    for (int64_t r = 0; r < R; ++r)
      row_at[r] = (r / p.kc_step()) * p.slivers() * sliver + (r % p.kc_step()) * nr;
  }

  // rows r0 .. r0 + rows of col, columns q0 .. q0 + P, from buf (row u at buf + u * P). A
  // whole row of a sliver (NR floats, whole cache lines where data is 64-byte aligned) goes by
  // streaming stores: the operand is far bigger than the caches, and a plain store first reads
  // each line it writes from memory; a part of one (the ends of the columns) by plain ones.
  void write(float* data, const float* buf, int64_t rows, int64_t r0, int64_t q0,
             int64_t P) const {
#ifdef __SSE2__
    const bool stream = nr % 16 == 0 && reinterpret_cast<std::uintptr_t>(data) % 64 == 0;
#endif
    for (int64_t q = q0; q < q0 + P;) {
      const int64_t s = q / nr, end = std::min(q0 + P, (s + 1) * nr);
      const bool last = end == NP && end % nr != 0;  // zeros past the last column
      float* at = data + s * sliver + (q - s * nr);
      const float* src = buf + (q - q0);
#ifdef __SSE2__
      if (stream && end - q == nr) {
        for (int64_t u = 0; u < rows; ++u) {
          float* d = at + row_at[r0 + u];
          const float* v = src + u * P;
          for (int64_t e = 0; e < nr; e += 4) _mm_stream_ps(d + e, _mm_loadu_ps(v + e));
        }
        q = end;
        continue;
      }
#endif
      for (int64_t u = 0; u < rows; ++u) {
        float* d = at + row_at[r0 + u];
        copy_run(d, src + u * P, end - q);
        if (last) std::memset(d + (end - q), 0, sizeof(float) * (nr - end % nr));
      }
      q = end;
    }
  }
};

// Writes the same NR rows into a PackedB of op(B) = col^T: pixel by pixel (4 at a time,
// transposed in registers, within a K block), the NR rows r0.. of col as one row of the sliver
// (rows past col's last are zeros in buf). Streaming stores: col^T is read only in the
// backward, long after (the layer's forward and everything after it have gone through the
// caches by then), and a plain store first reads each line it writes from memory, which
// doubled this loop's time.
struct ColTWriter {
  int64_t nr = 0, kc = 1, sliver = 0, block = 0;

  ColTWriter() = default;
  explicit ColTWriter(const PackedB& p)
      : nr(p.nr()), kc(p.kc_step()), sliver(p.kc_step() * p.nr()),
        block(p.slivers() * p.kc_step() * p.nr()) {}

  void write(float* data, const float* buf, int64_t r0, int64_t q0, int64_t P) const {
    // its rows start 16-byte aligned where its data does (every offset is a multiple of NR)
    const bool stream = nr % 4 == 0 && reinterpret_cast<std::uintptr_t>(data) % 16 == 0;
    float* const sl = data + (r0 / nr) * sliver;
    int64_t kb = q0 / kc, w = q0 % kc;  // pixel q0's K block and row in it
    for (int64_t p = 0; p < P;) {
      float* d = sl + kb * block + w * nr;
#ifdef __SSE2__
      if (nr % 4 == 0 && p + 4 <= P && w + 4 <= kc) {
        for (int64_t u = 0; u < nr; u += 4) {
          const float* src = buf + u * P + p;
          __m128 a0 = _mm_loadu_ps(src), a1 = _mm_loadu_ps(src + P);
          __m128 a2 = _mm_loadu_ps(src + 2 * P), a3 = _mm_loadu_ps(src + 3 * P);
          _MM_TRANSPOSE4_PS(a0, a1, a2, a3);
          if (stream) {
            _mm_stream_ps(d + u, a0);
            _mm_stream_ps(d + nr + u, a1);
            _mm_stream_ps(d + 2 * nr + u, a2);
            _mm_stream_ps(d + 3 * nr + u, a3);
          } else {
            _mm_storeu_ps(d + u, a0);
            _mm_storeu_ps(d + nr + u, a1);
            _mm_storeu_ps(d + 2 * nr + u, a2);
            _mm_storeu_ps(d + 3 * nr + u, a3);
          }
        }
        p += 4;
        w += 4;
      } else
#endif
      {
        for (int64_t u = 0; u < nr; ++u) d[u] = buf[u * P + p];
        ++p;
        ++w;
      }
      if (w == kc) {
        ++kb;
        w = 0;
      }
    }
  }
};

// Images are taken a few at a time, their columns side by side in the buffers, so that the
// slivers inside a chunk are written whole (fwd) and only those at its ends in parts: chunks of
// at most this many columns of col (NR rows of them in L2), of as many images as fill whole
// slivers where that fits, and starting at multiples of their size (so that a range of images
// that starts there, or the next one, meets no sliver that the chunk before wrote a part of).
constexpr int64_t kChunkColumns = 1024;

int64_t images_per_chunk(int64_t P, int64_t nr) {
  const int64_t whole = nr / std::gcd(P, nr);  // images whose columns fill whole slivers
  if (whole * P <= kChunkColumns) return kChunkColumns / (whole * P) * whole;
  return std::max<int64_t>(1, kChunkColumns / P);
}

// Chunk c of the images [n_begin, n_end) in chunks of G at multiples of G: [n, n1).
inline void chunk(int64_t c, int64_t G, int64_t n_begin, int64_t n_end, int64_t* n,
                  int64_t* n1) {
  const int64_t start = (n_begin / G + c) * G;
  *n = std::max(n_begin, start);
  *n1 = std::min(n_end, start + G);
}

inline int64_t chunk_count(int64_t G, int64_t n_begin, int64_t n_end) {
  return (n_end + G - 1) / G - n_begin / G;
}

}  // namespace

// Image by image, NR rows at a time: the rows are made in a small buffer (NR x OH*OW floats, in
// L1 or L2), then copied to fwd in runs of a sliver's width and written to t transposed, NR rows
// of one pixel in a row. The im2col matrix never goes to memory, nor is it read back to pack.
void im2col_pack(const float* x, int64_t N, int64_t C, int64_t H, int64_t W, int64_t KH,
                 int64_t KW, int64_t stride, int64_t pad, PackedB* fwd, PackedB* t,
                 int64_t n_begin, int64_t n_end, int threads) {
  const int64_t OH = conv_out_size(H, KH, stride, pad), OW = conv_out_size(W, KW, stride, pad);
  const int64_t P = OH * OW, R = C * KH * KW;
  if (n_end <= n_begin || P == 0 || R == 0 || (fwd == nullptr && t == nullptr)) return;
  // both packings share the micro-kernel's NR (gemm.h): the rows go in groups of NR
  const int64_t nr = fwd != nullptr ? fwd->nr() : t->nr();
  const ColWriter to_fwd = fwd != nullptr ? ColWriter(*fwd, R) : ColWriter();
  const ColTWriter to_t = t != nullptr ? ColTWriter(*t) : ColTWriter();
  float* const fwd_data = fwd != nullptr ? fwd->block(0, 0) : nullptr;
  float* const t_data = t != nullptr ? t->block(0, 0) : nullptr;
  // the images in chunks of G (the work is split by chunks: no more threads than chunks), and
  // a buffer each
  const int64_t G = images_per_chunk(P, nr), chunks = chunk_count(G, n_begin, n_end);
  const int team = static_cast<int>(std::min<int64_t>(clamp_threads(threads), chunks));
  std::vector<float> bufs(static_cast<size_t>(team) * nr * G * P);  // before the team starts
  // the caller's whole team (region_size): threads past `team` get no chunk
#pragma omp parallel num_threads(region_size(team, threads))
  {
    float* buf = bufs.data() + std::min(thread_id(), team - 1) * nr * G * P;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      int64_t n, n1;
      chunk(c, G, n_begin, n_end, &n, &n1);
      const int64_t cols = (n1 - n) * P;
      for (int64_t r0 = 0; r0 < R; r0 += nr) {
        const int64_t rows = std::min(nr, R - r0);
        for (int64_t u = 0; u < rows; ++u)
          im2col_row(x, C, H, W, KH, KW, stride, pad, OH, OW, r0 + u, n, n1, buf + u * cols);
        if (rows < nr && t != nullptr)  // past col's last row: zeros in col^T's last sliver
          std::memset(buf + rows * cols, 0, sizeof(float) * (nr - rows) * cols);
        if (fwd != nullptr) to_fwd.write(fwd_data, buf, rows, r0, n * P, cols);
        if (t != nullptr) to_t.write(t_data, buf, r0, n * P, cols);
      }
    }
#ifdef __SSE2__
    _mm_sfence();  // the streaming stores are seen by every thread before the team ends
#endif
  }
}

namespace {

// The quadrants' sums of col and of col^T (gemm.h's sgemm_packed_quadrants: B11 + B22, B11,
// B12 - B22, B21 - B11, B22, B11 + B12, B21 + B22) as sums of blocks of the input, block
// 2 a + b = x[images half a, channels half b]: col's quadrant (r, c) is the im2col of block
// (c, r), col^T's quadrant (r, c) that of block (r, c). Eleven distinct sums, each written to
// the fwd pack and the t pack that take it (-1: none).
struct QuadrantSum {
  int a, sign, b;  // block a + sign * block b (b -1: block a alone)
  int fwd, t;
};
constexpr QuadrantSum kQuadrantSums[] = {
    {0, 1, 3, 0, 0},   {0, 0, -1, 1, 1},  {3, 0, -1, 4, 4},  {2, -1, 3, 2, -1},
    {1, -1, 0, 3, -1}, {0, 1, 2, 5, -1},  {1, 1, 3, 6, -1},  {1, -1, 3, -1, 2},
    {2, -1, 0, -1, 3}, {0, 1, 1, -1, 5},  {2, 1, 3, -1, 6},
};

}  // namespace

int quadrant_sum_count(bool fwd, bool t) {
  int count = 0;
  for (const QuadrantSum& q : kQuadrantSums) count += (fwd && q.fwd >= 0) || (t && q.t >= 0);
  return count;
}

// Image by image of each half of the batch, NR rows of the quadrants at a time: the four blocks'
// rows are made once in small buffers, each sum from them, then written as im2col_pack does. The
// work is a run of (image, sum) units, image by image: whole images in chunks, and the sums of a
// first and a last image that the run takes only some of.
void im2col_pack_quadrants(const float* x, int64_t N, int64_t C, int64_t H, int64_t W,
                           int64_t KH, int64_t KW, int64_t stride, int64_t pad,
                           PackedB* const* fwd, PackedB* const* t, int64_t u_begin,
                           int64_t u_end, int threads) {
  const int64_t OH = conv_out_size(H, KH, stride, pad), OW = conv_out_size(W, KW, stride, pad);
  const int64_t P = OH * OW, N2 = N / 2, R2 = (C / 2) * KH * KW;
  const int S = quadrant_sum_count(fwd != nullptr, t != nullptr);
  if (u_end <= u_begin || P == 0 || R2 == 0 || S == 0) return;
  int active[std::size(kQuadrantSums)];  // the sums with a target, in their order
  for (int i = 0, a = 0; i < static_cast<int>(std::size(kQuadrantSums)); ++i) {
    const QuadrantSum& q = kQuadrantSums[i];
    if ((fwd != nullptr && q.fwd >= 0) || (t != nullptr && q.t >= 0)) active[a++] = i;
  }
  const int64_t nr = fwd != nullptr ? fwd[0]->nr() : t[0]->nr();
  const ColWriter to_fwd = fwd != nullptr ? ColWriter(*fwd[0], R2) : ColWriter();
  const ColTWriter to_t = t != nullptr ? ColTWriter(*t[0]) : ColTWriter();
  const int64_t G = images_per_chunk(P, nr);
  struct Item {
    int64_t n, n1;  // images
    int s0, s1;     // their active sums
  };
  std::vector<Item> items;
  const int64_t first = u_begin / S, last = (u_end - 1) / S;
  const int s_first = static_cast<int>(u_begin % S), s_last = static_cast<int>((u_end - 1) % S) + 1;
  if (first == last) {
    items.push_back({first, first + 1, s_first, s_last});
  } else {
    int64_t whole0 = first, whole1 = last + 1;
    if (s_first > 0) {
      items.push_back({first, first + 1, s_first, S});
      whole0 = first + 1;
    }
    if (s_last < S) whole1 = last;
    if (whole1 > whole0) {
      for (int64_t c = 0, count = chunk_count(G, whole0, whole1); c < count; ++c) {
        int64_t n, n1;
        chunk(c, G, whole0, whole1, &n, &n1);
        items.push_back({n, n1, 0, S});
      }
    }
    if (s_last < S) items.push_back({last, last + 1, 0, s_last});
  }
  const int64_t count = static_cast<int64_t>(items.size());
  const int team = static_cast<int>(std::min<int64_t>(clamp_threads(threads), count));
  const int64_t tile = nr * G * P;  // one buffer: NR rows of a chunk's columns
  std::vector<float> bufs(static_cast<size_t>(team) * 5 * tile);
  // the caller's whole team (region_size): threads past `team` get no item
#pragma omp parallel num_threads(region_size(team, threads))
  {
    // the four blocks' rows (a thread past `team` has none to make)
    float* const blocks = bufs.data() + std::min(thread_id(), team - 1) * 5 * tile;
    float* const sum = blocks + 4 * tile;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < count; ++i) {
      const Item& it = items[i];
      const int64_t n = it.n, g = it.n1 - it.n, cols = g * P;
      const int64_t used = nr * cols;  // of each buffer
      for (int64_t r0 = 0; r0 < R2; r0 += nr) {
        const int64_t rows = std::min(nr, R2 - r0);
        for (int blk = 0; blk < 4; ++blk) {
          float* buf = blocks + blk * tile;
          const int64_t image = (blk / 2) * N2 + n, row0 = (blk % 2) * R2 + r0;
          for (int64_t u = 0; u < rows; ++u)
            im2col_row(x, C, H, W, KH, KW, stride, pad, OH, OW, row0 + u, image, image + g,
                       buf + u * cols);
          if (rows < nr)  // past the quadrant's last row: zeros in col^T's last sliver
            std::memset(buf + rows * cols, 0, sizeof(float) * (used - rows * cols));
        }
        for (int a = it.s0; a < it.s1; ++a) {
          const QuadrantSum& q = kQuadrantSums[active[a]];
          PackedB* f = fwd != nullptr && q.fwd >= 0 ? fwd[q.fwd] : nullptr;
          PackedB* tt = t != nullptr && q.t >= 0 ? t[q.t] : nullptr;
          const float* src = blocks + q.a * tile;
          if (q.b >= 0) {
            const float* other = blocks + q.b * tile;
            const float s = static_cast<float>(q.sign);
            for (int64_t e = 0; e < used; ++e) sum[e] = src[e] + s * other[e];
            src = sum;
          }
          if (f != nullptr) to_fwd.write(f->block(0, 0), src, rows, r0, n * P, cols);
          if (tt != nullptr) to_t.write(tt->block(0, 0), src, r0, n * P, cols);
        }
      }
    }
#ifdef __SSE2__
    _mm_sfence();
#endif
  }
}

namespace {

// col2im of a block of dcol: channels [cb0, cb1) x images [n0, n1) from buf (row
// u = ((c - cb0) * KH + i) * KW + j holds (c, i, j), the images' columns side by side; rows ld
// floats apart) into those planes of x, which it sets: nothing else writes them.
void col2im_block(const float* buf, int64_t ld, int64_t n0, int64_t n1, int64_t cb0, int64_t cb1,
                  int64_t C, int64_t H, int64_t W, int64_t KH, int64_t KW, int64_t stride,
                  int64_t pad, int64_t OH, int64_t OW, float* x) {
  for (int64_t c = cb0; c < cb1; ++c) {
    for (int64_t n = n0; n < n1; ++n)
      std::memset(x + (n * C + c) * H * W, 0, sizeof(float) * H * W);
    for (int64_t i = 0; i < KH; ++i)
      for (int64_t j = 0; j < KW; ++j) {
        const float* src = buf + (((c - cb0) * KH + i) * KW + j) * ld;
        for (int64_t n = n0; n < n1; ++n) {
          float* plane = x + (n * C + c) * H * W;
          for (int64_t oh = 0; oh < OH; ++oh, src += OW) {
            const int64_t ih = oh * stride - pad + i;
            if (ih < 0 || ih >= H) continue;
            float* dst = plane + ih * W;
            for (int64_t ow = 0; ow < OW; ++ow) {
              const int64_t iw = ow * stride - pad + j;
              if (iw >= 0 && iw < W) dst[iw] += src[ow];
            }
          }
        }
      }
  }
}

}  // namespace

void col2im(const float* col, int64_t N, int64_t C, int64_t H, int64_t W, int64_t KH, int64_t KW,
            int64_t stride, int64_t pad, float* x, int threads, int64_t c_begin, int64_t c_end) {
  const int64_t OH = conv_out_size(H, KH, stride, pad), OW = conv_out_size(W, KW, stride, pad);
  const int64_t NP = N * OH * OW;
#pragma omp parallel for schedule(static) num_threads(clamp_threads(threads))
  for (int64_t c = c_begin; c < c_end; ++c)
    col2im_block(col + c * KH * KW * NP, NP, 0, N, c, c + 1, C, H, W, KH, KW, stride, pad, OH,
                 OW, x);
}

namespace {

// The floats of a block: half the core's L2 (512 KiB taken for it where unknown).
int64_t col2im_block_floats() {
  const int64_t l2 = core_l2_bytes();
  return (l2 > 0 ? l2 : int64_t{512} << 10) / 2 / static_cast<int64_t>(sizeof(float));
}

// The blocks: `images` images (at least 256 columns) by `channels` channels (as many as
// `budget` floats hold, in blocks of near-equal size).
void col2im_blocks(int64_t N, int64_t P, int64_t KK, int64_t c_begin, int64_t c_end,
                   int64_t budget, int64_t* images, int64_t* channels) {
  // at least kColumns columns of images (the products' N: their B packed once per block of
  // channels, their A once per block of images), then as many channels as fit the budget
  constexpr int64_t kColumns = 256;
  const int64_t nb =
      std::max<int64_t>(1, std::min(N, (kColumns + P - 1) / std::max<int64_t>(P, 1)));
  const int64_t span = std::max<int64_t>(c_end - c_begin, 1);
  // (divisions, not a product of KK and the columns, which an absurd kernel could overflow)
  int64_t cb = budget / std::max<int64_t>(KK, 1) / std::max<int64_t>(nb * P, 1);
  cb = std::max<int64_t>(1, std::min(cb, span));
  const int64_t pieces = (span + cb - 1) / cb;  // blocks of near-equal size
  *images = nb;
  *channels = (span + pieces - 1) / pieces;
}

}  // namespace

void col2im_product(int parts, const float* const* w, const int64_t* k, const int64_t* ldw,
                    const float* const* dy, const int64_t* lddy, int64_t N, int64_t C,
                    int64_t H, int64_t W, int64_t KH, int64_t KW, int64_t stride, int64_t pad,
                    float* x, int threads, int64_t c_begin, int64_t c_end) {
  const int64_t OH = conv_out_size(H, KH, stride, pad), OW = conv_out_size(W, KW, stride, pad);
  const int64_t P = OH * OW, KK = KH * KW;
  if (N <= 0 || c_end <= c_begin) return;
  bool any = false;
  for (int j = 0; j < parts; ++j) any = any || k[j] > 0;
  if (!any) {  // no kernels: those channels of x are zeros (and no buffer, whatever KK is)
    for (int64_t n = 0; n < N; ++n)
      std::memset(x + (n * C + c_begin) * H * W, 0, sizeof(float) * (c_end - c_begin) * H * W);
    return;
  }
  int64_t nb = 1, cb = 1;
  col2im_blocks(N, P, KK, c_begin, c_end, col2im_block_floats(), &nb, &cb);
  const int64_t image_blocks = (N + nb - 1) / nb;
  const int64_t channel_blocks = (c_end - c_begin + cb - 1) / cb;
  const int64_t blocks = image_blocks * channel_blocks;
  const int team = static_cast<int>(std::min<int64_t>(clamp_threads(threads), blocks));
  const int64_t ld = nb * P;
  // a block of one channel can still be too big (cb * KK is at most the budget, or KK)
  const int64_t limit = int64_t{1} << 40;
  const int64_t buf_floats = ld > 0 && cb * KK > limit / ld ? limit + 1 : cb * KK * ld;
  const int64_t all_floats = buf_floats > limit / team ? limit + 1 : buf_floats * team;
  if (all_floats > limit)
    throw std::length_error("col2im_product: the rows of one channel for " +
                            std::to_string(nb) + " images take more memory than there is (" +
                            std::to_string(KK) + " rows of " + std::to_string(ld) +
                            " floats)");
  // a buffer a thread, not set (a block's products write it whole)
  std::unique_ptr<float[]> bufs(new float[static_cast<size_t>(all_floats)]);
  // block b into buf, then into x: image blocks outer (a thread's blocks share their images'
  // columns of dy)
  auto product_block = [&](int64_t b, float* buf) {
    const int64_t n0 = (b / channel_blocks) * nb, n1 = std::min(N, n0 + nb);
    const int64_t cb0 = c_begin + (b % channel_blocks) * cb, cb1 = std::min(c_end, cb0 + cb);
    const int64_t rows = (cb1 - cb0) * KK, cols = (n1 - n0) * P;
    bool written = false;
    for (int j = 0; j < parts; ++j) {
      if (k[j] <= 0) continue;
      // rows [cb0 * KK, cb1 * KK) of w_j^T: columns of w_j (k_j x C * KK, ldw_j apart)
      sgemm(true, false, rows, cols, k[j], 1.f, w[j] + cb0 * KK, ldw[j], dy[j] + n0 * P,
            lddy[j], written ? 1.f : 0.f, buf, ld, 1);
      written = true;
    }
    col2im_block(buf, ld, n0, n1, cb0, cb1, C, H, W, KH, KW, stride, pad, OH, OW, x);
  };
  std::exception_ptr failed;  // (an exception must not leave the parallel region)
#pragma omp parallel num_threads(region_size(team, threads))
  {
    float* buf = bufs.get() + std::min(thread_id(), team - 1) * buf_floats;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      try {
        product_block(b, buf);
      } catch (...) {
#pragma omp critical(pyhet_col2im_product)
        if (!failed) failed = std::current_exception();
      }
    }
  }
  if (failed) std::rethrow_exception(failed);
}

}  // namespace pyhet
